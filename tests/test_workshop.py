"""Workshop mode: every notebook's exercises are nbgrader cells whose checks run on a stub, and the builds work.

Static rules on the notebooks here (seconds); nbgrader itself on a two-exercise notebook (about 20 s).
The whole course (every student notebook executed, every instructor notebook autograded) is
`make test-course` (tests/course/), which CI runs after `make test`.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from labkit.course import HIDDEN, SOLUTION, exercises, instructor, strip_solutions, student

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
VENV_BIN = pathlib.Path(sys.executable).parent


def code_cells(path):
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_exercises_are_nbgrader_cells_with_honest_checks(path):
    cells = code_cells(path)
    checks = [c for c in cells if c.metadata.get("nbgrader", {}).get("grade")]
    assert len(checks) >= 2, f"{path.name}: at least two exercises with nbgrader check cells"
    number = path.name[:2]
    ids = [c.metadata["nbgrader"]["grade_id"] for c in cells if "nbgrader" in c.metadata]
    assert len(ids) == len(set(ids)) and all(i.startswith(f"{number}-ex") for i in ids), ids
    for k, (grade_id, points, solution_id) in enumerate(exercises(path), 1):
        assert points > 0 and solution_id, f"{grade_id}: a check with points, after its solution cell"
        check = next(c for c in checks if c.metadata["nbgrader"]["grade_id"] == grade_id)
        assert re.search(rf"lk\.exercise\(\s*{k}\s*,", check.source), \
            f"{grade_id}: wrap the check in `with lk.exercise({k}, ...)` so a stub says 'not attempted'"
        assert SOLUTION[0] not in check.source, f"{grade_id}: a check cell holds no solution"
    for c in cells:
        meta = c.metadata.get("nbgrader", {})
        has_solution = SOLUTION[0] in c.source
        assert has_solution == bool(meta.get("solution")), \
            f"{path.name}: a solution block needs nbgrader solution metadata, and back:\n{c.source[:200]}"
        for line in c.source.splitlines():
            if line.strip() == SOLUTION[0]:
                assert line.startswith((" ", "\t")), \
                    f"{path.name}: a solution sits inside a function, so the student's stub raises only when called"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markers_only_where_nbgrader_allows_them(path):
    """nbgrader's generate_assignment refuses any other cell with a line that names a marker, prose too."""
    for c in nbformat.read(path, as_version=4).cells:
        meta = c.metadata.get("nbgrader", {})
        for line in c.source.splitlines():
            if "BEGIN SOLUTION" in line or "END SOLUTION" in line:
                assert meta.get("solution"), f"{path.name}: a marker outside a solution cell: {line.strip()!r}"
            if "HIDDEN TESTS" in line:
                assert meta.get("grade"), f"{path.name}: a hidden-tests marker outside a check cell: {line.strip()!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_predict_then_measure(path):
    source = "\n".join(c.source for c in code_cells(path))
    assert "lk.reveal(" in source, f"{path.name}: ask for a prediction, then lk.reveal() it beside the measurement"
    assert re.search(r"^PREDICT_\w+\s*=", source, re.M), f"{path.name}: a PREDICT_... variable with a default"


def test_strip_solutions_removes_hidden_tests():
    src = ("def f(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION\n"
           "with lk.exercise(1, 'f'):\n    assert f(3) == 6\n    ### BEGIN HIDDEN TESTS\n    assert f(0) == 0\n    ### END HIDDEN TESTS")
    out = strip_solutions(src)
    assert "2 * x" not in out and "f(0)" not in out and HIDDEN[0] not in out
    assert "    raise NotImplementedError()" in out and out.endswith("assert f(3) == 6")
    with pytest.raises(ValueError, match="inside another"):
        strip_solutions("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION")


def toy_notebook(folder):
    """Two exercises as the notebooks write them: one with a hidden reference."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["labkit"] = {"minutes_tiny": 0.1, "minutes_full": 0.1, "requires": [], "optional": {}}
    meta = lambda k, kind: ({"solution": True, "grade": False, "locked": False} if kind == "solution" else
                            {"solution": False, "grade": True, "locked": True, "points": 1}) | {
        "grade_id": f"99-ex{k}-{kind if kind == 'solution' else 'check'}", "schema_version": 3}
    cells = [nbformat.v4.new_code_cell("import labkit as lk\nimport torch")]
    for k, (body, check) in enumerate([
        ("    ### BEGIN SOLUTION\n    return torch.cumsum(x, 0)\n    ### END SOLUTION",
         "    got = lk.nontrivial(answer(torch.tensor([1., 2., 3.])))\n    assert got[-1] == 6\n"
         "    ### BEGIN HIDDEN TESTS\n    assert torch.equal(got, torch.tensor([1., 3., 6.]))\n    ### END HIDDEN TESTS"),
        ("    ### BEGIN SOLUTION\n    return x * 2\n    ### END SOLUTION",
         "    assert answer(torch.ones(2) * 3).sum() == 12"),
    ], 1):
        name = "answer"
        sol = nbformat.v4.new_code_cell(f"def {name}(x):\n{body}")
        sol.metadata["nbgrader"] = meta(k, "solution")
        chk = nbformat.v4.new_code_cell(f"with lk.exercise({k}, 'write {name}() above'):\n{check}")
        chk.metadata["nbgrader"] = meta(k, "check")
        cells += [sol, chk]
    nb.cells = cells
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / "99_toy.ipynb")
    return folder / "99_toy.ipynb"


def run_notebook(path):
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_student_build_runs_and_reports_not_attempted(tmp_path):
    toy = toy_notebook(tmp_path / "src")
    assert [e[0] for e in exercises(toy)] == ["99-ex1-check", "99-ex2-check"]
    [built] = student(tmp_path / "src", tmp_path / "student", quiet=True)
    text = run_notebook(built)
    assert text.count("not attempted yet") == 2 and "passed" not in text
    assert "passed" in run_notebook(toy) and "not attempted" not in run_notebook(toy)


def test_nbgrader_agrees_with_the_student_build_and_grades_key_and_stub(tmp_path):
    """As an instructor would: generate_assignment (its release equals `make student`), then autograde."""
    toy = toy_notebook(tmp_path / "src")
    course = tmp_path / "course"
    instructor(tmp_path / "src", course, quiet=True)
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")   # nbgrader runs `alembic`

    def nbgrader(*args):
        run = subprocess.run([str(VENV_BIN / "nbgrader"), *args, "--force"], cwd=course, env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    nbgrader("generate_assignment", "99_toy")
    release = course / "release" / "99_toy" / "99_toy.ipynb"
    [ours] = student(tmp_path / "src", tmp_path / "student", quiet=True)
    assert [c.source for c in code_cells(release)] == [c.source for c in code_cells(ours)]
    for who, notebook in (("key", toy), ("stub", release)):
        (course / "submitted" / who / "99_toy").mkdir(parents=True)
        shutil.copy(notebook, course / "submitted" / who / "99_toy" / "99_toy.ipynb")
    nbgrader("autograde", "99_toy")
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {who: (gb.find_submission("99_toy", who).score, gb.find_submission("99_toy", who).max_score)
                  for who in ("key", "stub")}
    assert scores == {"key": (2.0, 2.0), "stub": (0.0, 2.0)}, scores


def test_instructor_guide_agendas_follow_the_notebooks():
    from labkit.course import fill_agendas
    guide = (ROOT / "docs" / "instructor.md").read_text()
    assert "<!-- agenda 1 -->" in guide and "<!-- agenda 2 -->" in guide
    assert fill_agendas(guide) == guide, "run `labkit agenda --write docs/instructor.md`"
    for path in NOTEBOOKS:
        assert f"`{path.name}`" in guide, f"the two-day agenda lacks {path.name}"


# Predictions: None until the learner makes one, so nobody is handed an answer to copy.
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_predictions_default_to_none(path):
    import ast
    for c in code_cells(path):
        try:
            tree = ast.parse(c.source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name) and t.id.startswith("PREDICT")]
                if names and node.value is not None:
                    assert isinstance(node.value, ast.Constant) and node.value.value is None, \
                        f"{path.name}: {names[0]} = {ast.unparse(node.value)}: a prediction starts as None"
