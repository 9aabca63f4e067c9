"""The whole course, as `make test-course` runs it (CI, after `make test`): minutes per notebook, twice.

- The student build executes from top to bottom, and every exercise's check reports "not attempted".
- nbgrader's autograde of the instructor build (the answer key, submitted as a student) gives full points.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from labkit.course import exercises, instructor, student

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
VENV_BIN = pathlib.Path(sys.executable).parent


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_student_build_runs_with_every_check_not_attempted(path, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(path, src)
    [built] = student(src, tmp_path / "student", quiet=True)
    nb = nbformat.read(built, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3").execute()     # raises on any error
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    n = len(exercises(path))
    assert text.count("not attempted yet") == n, f"{n} exercises, but:\n{text[-3000:]}"
    assert ": passed" not in text, "a stub passed its check: the check does not test the learner's code"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_autograde_of_the_answer_key_gives_full_points(path, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(path, src)
    course = tmp_path / "course"
    instructor(src, course, quiet=True)
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")
    sub = course / "submitted" / "key" / path.stem
    sub.mkdir(parents=True)
    shutil.copy(path, sub)
    for args in (["generate_assignment", path.stem], ["autograde", path.stem]):
        run = subprocess.run([str(VENV_BIN / "nbgrader"), *args, "--force"], cwd=course, env=env,
                             capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        s = gb.find_submission(path.stem, "key")
        score, max_score = s.score, s.max_score
    assert max_score == sum(points for _, points, _ in exercises(path)) > 0
    assert score == max_score, f"the answer key earned {score} of {max_score}"
