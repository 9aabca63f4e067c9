"""The repository's own rules: stripped notebooks, the notebook contract, agreeing dependency lists, named functions
in the code notebooks 09 and 10 show."""
import ast
import json
import pathlib
import re
import tomllib

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SECTIONS = ["## Why", "## Baseline", "## The technique", "## Correctness", "## Measured effect", "## Plot",
            "## Summary", "## Exercises"]


def cells(path, kind=None):
    nb = json.loads(path.read_text())
    return [c for c in nb["cells"] if kind is None or c["cell_type"] == kind]


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:2] == ["00_start_here.ipynb", "01_memory_anatomy.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_stripped(path):
    for c in cells(path, "code"):
        assert not c.get("outputs") and c.get("execution_count") is None, f"{path.name}: strip outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_valid_nbformat(path):
    import nbformat
    nbformat.validate(nbformat.read(path, as_version=4))       # e.g. cell ids only from nbformat 4.5 on


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_contract_sections_in_order(path):
    md = [source(c) for c in cells(path, "markdown")]
    assert md[0].startswith("# ") and "You will learn" in md[0]
    headings = [line for text in md for line in text.splitlines() if line.startswith("## ")]
    found = [next((i for i, h in enumerate(headings) if h.startswith(s)), None) for s in SECTIONS]
    assert None not in found, f"{path.name} lacks {[s for s, i in zip(SECTIONS, found) if i is None]}"
    assert found == sorted(found), f"{path.name}: sections out of order"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_parameters_cell_metadata_and_record(path):
    nb = json.loads(path.read_text())
    code = cells(path, "code")
    assert "parameters" in code[0].get("metadata", {}).get("tags", [])
    assert "lk.size()" in source(code[0])
    meta = nb["metadata"]["labkit"]
    assert {"minutes_tiny", "minutes_full", "requires", "optional"} <= set(meta)
    assert meta["minutes_tiny"] <= 1.5, "a notebook runs in at most 90 s at tiny size"
    assert any(f'lk.record("{path.stem}"' in source(c) for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_requirements_name_features_labkit_can_check(path):
    """`labkit doctor` and notebook 00 ask lk.has() about every name a notebook requires or can use."""
    from labkit.device import FEATURES
    meta = json.loads(path.read_text())["metadata"]["labkit"]
    assert set(meta["requires"]) | set(meta["optional"]) <= set(FEATURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_solution_has_a_check(path):
    code = [source(c) for c in cells(path, "code")]
    solutions = [i for i, s in enumerate(code) if "### BEGIN SOLUTION" in s]
    assert solutions, f"{path.name} has no exercises"
    for i in solutions:
        assert "### END SOLUTION" in code[i]
        assert i + 1 < len(code) and "assert" in code[i + 1], f"{path.name}: a check cell follows each solution"


@pytest.mark.parametrize("module", ["labkit/tensor_parallel.py", "labkit/pipeline_parallel.py", "labkit/zero.py",
                                    "labkit/launch.py", "labkit/collectives.py", "labkit/scripts/tensor_parallel.py", "labkit/scripts/pipeline_parallel.py",
                                    "labkit/scripts/zero_scratch.py", "labkit/scripts/fsdp_production.py",
                                    "labkit/scripts/ddp_buckets.py", "labkit/scripts/chain.py"])
def test_the_code_notebooks_09_and_10_show_names_its_functions(module):
    tree = ast.parse((ROOT / module).read_text())
    lambdas = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Lambda)]
    assert not lambdas, f"{module}: lambdas on lines {lambdas}"


SETTINGS = {"24 GiB", "256 GiB", "1 MiB", "2 MiB", "10 MiB", "20 MiB"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_measured_figures_typed_into_markdown(path):
    # Our measurements print in binary units and milliseconds; published figures are quoted in GB. Settings
    # and rules are not measurements: the workshop card (24 GiB), the host memory a notebook asks the planner
    # for (256 GiB), and the caching allocator's size classes (1 and 10 MiB requests, 2 and 20 MiB segments).
    for c in cells(path, "markdown"):
        own = "\n".join(line for line in source(c).splitlines() if not line.startswith(">"))   # not a quoted seed
        hits = [h for h in re.findall(r"\d[\d.,]*\s*(?:GiB|MiB|KiB|ms)\b", own)
                if re.sub(r"\s+", " ", h) not in SETTINGS]
        assert not hits, f"{path.name}: {hits} typed into markdown; print them from a cell"


def test_readme_lists_every_notebook_with_its_minutes():
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        meta = json.loads(path.read_text())["metadata"]["labkit"]
        row = next((l for l in readme.splitlines() if path.name in l), None)
        assert row, f"README's notebook map lacks {path.name}"
        assert f"| {meta['minutes_tiny']} |" in row and f"| {meta['minutes_full']} |" in row, row


def test_dependency_lists_agree_with_pyproject_and_the_lock():
    """environment.yml lists pyproject's dependencies and installs the lock's pins, as the Makefile does;
    every pin in the lock satisfies what pyproject asks for (else `make lock` is due)."""
    from packaging.requirements import Requirement
    from packaging.version import Version
    from labkit.cli import read_lock
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra, deps in project["optional-dependencies"].items():
        wanted |= {d for d in deps if not d.startswith("labkit")}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert set(pip) - {"-e .", "-c labkit/lock.txt"} == wanted
    assert pip[0] == "torch==2.13.0", "torch first, pinned"
    assert "-c labkit/lock.txt" in pip, "conda's pip installs the lock's versions"
    assert 'triton>=3.0; sys_platform == "linux"' in pip, "triton only where it has wheels, as in pyproject"
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK    := labkit/lock.txt" in makefile and "TORCH   := torch==2.13.0" in makefile
    installs = [l for l in makefile.split("$(STAMP):")[1].split("\n\n")[0].splitlines() if "pip install" in l]
    assert len(installs) == 3 and all("-c $(LOCK)" in l for l in installs), installs
    lock = read_lock(ROOT / "labkit" / "lock.txt")
    for spec in map(Requirement, wanted):
        if spec.marker is not None and not spec.marker.evaluate({"extra": ""}):
            continue                                      # e.g. triton off Linux: no line for this machine
        name = spec.name.lower().replace("_", "-")
        assert name in lock, f"the lock lacks {name}: run `make lock`"
        assert Version(lock[name]) in spec.specifier, f"lock {name}=={lock[name]} breaks {spec}: run `make lock`"


def make_targets():
    return set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in (ROOT / "README.md").read_text()
    commands = [l.strip() for l in ci.splitlines() if l.strip().startswith("make ")]
    assert commands[0] == "make test", "CI runs the README's test command first"
    assert {"make test-browser", "make test-course", "make check-resolution"} <= set(commands)
    assert {c.split()[1] for c in commands} <= make_targets()


def test_workflow_names_only_make_targets_that_exist():
    """The GitHub workflow: a CPU job and a self-hosted `gpu` job; every `make X` it runs is a target."""
    flow = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
    jobs = flow["jobs"]
    assert "gpu" in jobs["gpu"]["runs-on"] and "self-hosted" in jobs["gpu"]["runs-on"]
    runs = [s["run"] for job in jobs.values() for s in job["steps"] if "run" in s]
    named = {m for r in runs for m in re.findall(r"\bmake ([a-z][a-z-]*)", r)}
    assert {"test", "test-gpu", "gpu-smoke", "check-resolution", "test-browser"} <= named, named
    assert named <= make_targets(), named - make_targets()
    # Ubuntu's `chromium` is a snap stub: the hosted runner's browser is its Google Chrome, named to the target.
    assert any("make test-browser CHROMIUM=" in r and "google-chrome" in r for r in runs), runs
    artifacts = [s for s in jobs["gpu"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert artifacts and "build/records/" in artifacts[0]["with"]["path"]
