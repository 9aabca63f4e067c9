"""The CI definitions: .ci/run (this workplace's CI) and the GitHub workflow, read as their machines read them."""
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLOW = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())
TRIGGERS = FLOW.get("on", FLOW.get(True))           # YAML 1.1 reads the key `on` as True


def _steps(job):
    return FLOW["jobs"][job]["steps"]


def test_the_gpu_job_runs_only_where_a_gpu_runner_exists_and_never_for_a_pull_request():
    gate = FLOW["jobs"]["gpu"]["if"]
    assert "vars.GPU_RUNNER == 'true'" in gate                  # unset (forks, most clones): skipped, not queued
    assert "github.event_name != 'pull_request'" in gate       # a pull request's code never reaches that machine
    assert "workflow_dispatch" in TRIGGERS                     # a maintainer starts it by hand


def test_a_same_repository_pull_request_runs_once():
    """Pushes run for main only: a pull request's branch runs as the pull request, not twice."""
    assert TRIGGERS["push"] == {"branches": ["main"]} and "pull_request" in TRIGGERS


def test_the_gpu_job_has_its_python_keeps_its_venv_and_skips_tests_after_a_failed_install():
    steps = _steps("gpu")
    setup = next(s for s in steps if s.get("uses", "").startswith("actions/setup-python"))
    assert setup["with"]["python-version"] in ("3.11", "3.12", "3.13")     # Ubuntu 22.04's 3.10 stops make env
    venv = FLOW["jobs"]["gpu"]["env"]["VENV"]
    assert "/../" in venv                                       # outside the checkout, which checkout cleans
    env_step = next(s for s in steps if s.get("run", "").startswith("make env"))
    assert env_step["id"] == "env" and 'VENV="$VENV"' in env_step["run"]
    later = [s for s in steps if s is not env_step and "if" in s]
    assert later and all("steps.env.outcome == 'success'" in s["if"] and "always()" not in s["if"] for s in later)


def test_the_twin_runs_in_both_cis():
    assert any("make test-twin" in s.get("run", "") for s in _steps("twin"))
    run = (ROOT / ".ci" / "run").read_text()
    assert '(make twin-env TWIN="$TWIN" > build/twin-env.log 2>&1) &' in run     # built beside make test
    lines = [l.strip() for l in run.splitlines() if l.strip().startswith("make ")]
    assert lines[0] == "make test" and any(l.startswith("make test-twin") for l in lines)
    assert any(l.startswith("make check-gpu-wheels") for l in lines)
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    assert {l.split()[1] for l in lines} <= targets
