"""The workbook as a course: student and instructor builds, ready for nbgrader.

Exercise cells carry nbgrader's metadata (`solution` cells hold the answer between `### BEGIN SOLUTION`
and `### END SOLUTION`; `grade` cells are the checks, worth `points`), so an instructor can use nbgrader
as usual on the instructor build. The student build does what nbgrader's `generate_assignment` does
without its database: solutions become `raise NotImplementedError()`, hidden tests
(`### BEGIN HIDDEN TESTS` ... `### END HIDDEN TESTS`) disappear, outputs are cleared.

    build/student/NN_name.ipynb                      make student: hand these out
    build/course/nbgrader_config.py                  make instructor: an nbgrader course folder,
    build/course/source/NN_name/NN_name.ipynb          one assignment per notebook (the answer key)
"""
from __future__ import annotations

import json
import pathlib
import shutil
import sys

__all__ = ["strip_solutions", "student", "instructor", "exercises", "agenda", "fill_agendas", "session_minutes", "SOLUTION", "HIDDEN"]

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS, BUILD = ROOT / "notebooks", ROOT / "build"
SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
STUB = ["# YOUR CODE HERE", "raise NotImplementedError()"]
COURSE_ID = "gpu-memory-lab"


def _replace_blocks(source, begin, end, stub):
    """`source` with every begin..end block (marker lines included) replaced by `stub`, at the block's indent."""
    out, inside, indent = [], False, ""
    for line in source.splitlines():
        if line.strip() == begin:
            if inside:
                raise ValueError(f"{begin!r} inside another {begin!r} block in:\n{source}")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.extend(indent + s for s in stub)
        elif line.strip() == end:
            if not inside:
                raise ValueError(f"{end!r} without {begin!r} in:\n{source}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{begin!r} without {end!r} in:\n{source}")
    return "\n".join(out)


def strip_solutions(source):
    """A cell's source as the student sees it: solutions stubbed, hidden tests removed."""
    return _replace_blocks(_replace_blocks(source, *SOLUTION, STUB), *HIDDEN, [])


def _notebooks(folder):
    paths = sorted(pathlib.Path(folder).glob("[0-9][0-9]_*.ipynb"))
    if not paths:
        raise ValueError(f"folder holds no NN_name.ipynb notebooks: {folder}")
    return paths


def student(folder=NOTEBOOKS, dest=BUILD / "student", quiet=False):
    """Student copies of the notebooks (solutions stubbed, hidden tests removed, no outputs) in `dest`."""
    import nbformat
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for path in _notebooks(folder):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = strip_solutions(cell.source)
                cell.outputs, cell.execution_count = [], None
        nbformat.write(nb, dest / path.name)
        written.append(dest / path.name)
        if not quiet:
            print(f"student version: {dest / path.name}")
    return written


def instructor(folder=NOTEBOOKS, dest=BUILD / "course", quiet=False):
    """An nbgrader course folder in `dest`: one assignment per notebook, the notebooks with their solutions."""
    dest = pathlib.Path(dest)
    (dest / "source").mkdir(parents=True, exist_ok=True)
    (dest / "nbgrader_config.py").write_text(
        "# nbgrader's course settings for GPU Memory Lab (written by `make instructor`).\n"
        "c = get_config()\n"
        f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
        "c.ExecutePreprocessor.timeout = 1800\n")
    written = []
    for path in _notebooks(folder):
        target = dest / "source" / path.stem / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        written.append(target)
    if not quiet:
        # nbgrader as this Python has it (the venv's, which need not be on the PATH).
        nbgrader = pathlib.Path(sys.executable).parent / "nbgrader"
        print(f"answer key and nbgrader source: {dest / 'source'} ({len(written)} assignments)")
        print(f"then: cd {dest} && {nbgrader if nbgrader.exists() else 'nbgrader'} generate_assignment 00_start_here"
              "   (and autograde, as usual)")
    return written


def exercises(path):
    """[(exercise grade_id, points, solution grade_id)] of one notebook, from its nbgrader metadata."""
    cells = json.loads(pathlib.Path(path).read_text())["cells"]
    meta = [c["metadata"].get("nbgrader", {}) for c in cells]
    found = []
    for i, m in enumerate(meta):
        if m.get("grade"):
            before = next((p for p in reversed(meta[:i]) if p.get("solution")), {})
            found.append((m["grade_id"], m.get("points", 0), before.get("grade_id")))
    return found


DAYS = {1: [["00", "01", "02", "03", "05", "07", "08"]],
        2: [["00", "01", "02", "03", "04", "05", "06"], ["07", "08", "09", "10", "11", "12", "13"]]}
EXPLAIN_MIN, DISCUSS_MIN, PER_EXERCISE_MIN, LUNCH_MIN = 20, 10, 12, 60


def session_minutes(path, size="tiny"):
    """Teaching time of one notebook: explain, run it (its measured minutes), discuss, then its exercises."""
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    run = json.loads(pathlib.Path(path).read_text())["metadata"]["labkit"][f"minutes_{size}"]
    return EXPLAIN_MIN + int(-(-run // 1)) + DISCUSS_MIN + PER_EXERCISE_MIN * len(exercises(path))


def agenda(days, size="tiny", folder=NOTEBOOKS, start=9 * 60):
    """A workshop of `days` days (1 or 2) as markdown: each notebook's session with its clock times."""
    if days not in DAYS:
        raise ValueError(f"days must be 1 or 2, got {days!r}")
    paths = {p.name[:2]: p for p in _notebooks(folder)}
    clock = lambda m: f"{m // 60:02d}:{m % 60:02d}"
    lines = []
    for day, numbers in enumerate(DAYS[days], 1):
        lines += [f"**Day {day}** (notebooks run at size `{size}`)", "",
                  "| time | notebook | run (min) | exercises | session (min) |", "|---|---|---|---|---|"]
        t, lunch = start, False
        for n in (n for n in numbers if n in paths):
            if not lunch and t >= 12 * 60:
                lines.append(f"| {clock(t)} | lunch | | | {LUNCH_MIN} |")
                t, lunch = t + LUNCH_MIN, True
            meta = json.loads(paths[n].read_text())["metadata"]["labkit"]
            minutes = session_minutes(paths[n], size)
            lines.append(f"| {clock(t)} | `{paths[n].name}` | {meta[f'minutes_{size}']} | "
                         f"{len(exercises(paths[n]))} | {minutes} |")
            t += minutes
        lines += [f"| {clock(t)} | end of day {day} | | | |", ""]
    return "\n".join(lines)


def fill_agendas(text, size="tiny"):
    """`text` (docs/instructor.md) with each `<!-- agenda N -->` ... `<!-- /agenda -->` block recomputed."""
    import re
    return re.sub(r"(<!-- agenda (\d) -->\n).*?(<!-- /agenda -->)",
                  lambda m: m.group(1) + agenda(int(m.group(2)), size) + "\n" + m.group(3), text, flags=re.S)
