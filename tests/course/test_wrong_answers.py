"""Exercise checks refuse the wrong answers a learner could plausibly write (issue 37's list, each one tried).

For every wrong answer below the notebook runs as the answer key up to that exercise's check; right after the
check, a cell defines the wrong answer in place of the solution and a copy of the check runs on it: that copy
must fail (an AssertionError, ValueError or TypeError from the check, never "not attempted"). Then the
solution cell runs again, so the cells after it see the answer key. A wrong answer here is one a learner might
really write (a constant, the unsharded computation, a copy that saves nothing, a number typed in instead of
measured), not deliberate introspection: a check in the learner's own process cannot stop that, and graded
courses use nbgrader's hidden tests (docs/instructor.md). Cells after the last check are dropped to save time;
one kernel per notebook.
"""
import pathlib
import textwrap

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = {p.name[:2]: p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}

# notebook -> [(exercise id, why it is wrong, the answer's source)]: the answer replaces the solution cell.
WRONG = {
}


def _cell_index(nb, grade_id):
    found = [i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(found) == 1, f"expected one cell with nbgrader grade_id {grade_id!r}, found {len(found)}"
    return found[0]


def _text(cell):
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}")
        elif "text/plain" in o.get("data", {}):
            parts.append(o.data["text/plain"])
    return "".join(parts)


def _prepared(path):
    """The answer key with, after each check, (wrong answer, copy of the check) pairs and the solution again."""
    nb = nbformat.read(path, as_version=4)
    tries = []                                  # (copied check cell, exercise id, why)
    by_exercise = {}
    for exercise, why, source in WRONG[path.name[:2]]:
        by_exercise.setdefault(exercise, []).append((why, source))
    last = 0
    for exercise, answers in by_exercise.items():
        solution = nb.cells[_cell_index(nb, f"{exercise}-solution")]
        check = nb.cells[_cell_index(nb, f"{exercise}-check")]
        at = next(i for i, c in enumerate(nb.cells) if c is check) + 1
        added = []
        for why, source in answers:
            copy = nbformat.v4.new_code_cell(check.source)
            copy.metadata["tags"] = ["raises-exception"]
            added += [nbformat.v4.new_code_cell(textwrap.dedent(source).strip()), copy]
            tries.append((copy, exercise, why))
        added.append(nbformat.v4.new_code_cell(solution.source))       # the answer key again for what follows
        nb.cells[at:at] = added
        last = max(last, at + len(added))
    del nb.cells[last:]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("nbgrader", None)
    return nb, tries


@pytest.mark.parametrize("number", sorted(WRONG))
def test_every_exercise_check_refuses_the_plausible_wrong_answers(number):
    path = NOTEBOOKS[number]
    nb, tries = _prepared(path)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()   # any other cell's error raises
    accepted = []
    for copy, exercise, why in tries:
        text = _text(copy)
        errors = [o for o in copy.outputs if o.output_type == "error"]
        if not errors or "not attempted" in text:
            accepted.append(f"{exercise} accepted a wrong answer ({why}):\n{text[-1500:]}")
        elif errors[0].ename not in ("AssertionError", "ValueError", "TypeError"):
            accepted.append(f"{exercise} failed on a wrong answer ({why}) by a crash, not a check: "
                            f"{errors[0].ename}: {errors[0].evalue}")
    assert not accepted, "\n\n".join(accepted)
