"""What a notebook may assert, and what it may print: checks on the notebooks' source.

At tiny size a notebook asserts counted work (bytes, FLOPs, events), never wall-clock time: CI and
learners run on different, shared CPUs. Time may be asserted only under a GPU guard.
"""
import ast
import json
import pathlib
import re

import importlib.util

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TIME_WORDS = re.compile(r"\b(time|times|time_s|seconds|secs?|speedup|speed_up|overhead|latency|ms|elapsed)\b"
                        r"|_s\b|perf_counter|\.time\(", re.IGNORECASE)
GPU_GUARD = re.compile(r"cuda|gpu", re.IGNORECASE)


def timed_asserts(source):
    """Asserts in `source` that mention time and are not nested in an `if` about CUDA/GPU."""
    tree = ast.parse(source)
    found = []

    def visit(node, guarded):
        if isinstance(node, ast.Assert):      # what is asserted, not the message's words
            if TIME_WORDS.search(ast.unparse(node.test)) and not guarded:
                found.append((ast.get_source_segment(source, node) or "").splitlines()[0])
        for child in ast.iter_child_nodes(node):
            is_guard = isinstance(node, ast.If) and child in node.body and GPU_GUARD.search(ast.unparse(node.test))
            visit(child, guarded or bool(is_guard))

    visit(tree, False)
    return found


def code_cells(path):
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            # IPython magics and shell escapes are not Python
            yield i, "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_wall_clock_asserts_outside_a_gpu_branch(path):
    bad = [f"cell {i}: {a}" for i, src in code_cells(path) for a in timed_asserts(src)]
    assert not bad, f"{path.name} asserts wall-clock time at tiny size (count work instead):\n" + "\n".join(bad)


def test_the_time_check_finds_what_it_should():
    assert timed_asserts("assert overhead > 0.05")
    assert timed_asserts("r = 1\nassert r.time_s < 2")
    assert not timed_asserts("if torch.cuda.is_available():\n    assert overhead > 0.2")
    assert not timed_asserts("if lk.has('cuda'):\n    x = 1\n    assert r.time_s < 2")
    assert timed_asserts("if lk.has('cuda'):\n    pass\nelse:\n    assert r.time_s < 2")
    assert not timed_asserts("assert flops_recomputed == 2 * flops_forward")
    assert not timed_asserts("assert n == 2, 'two times the bytes'")


def test_stderr_needs_the_tag():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    unexpected_stderr, STDERR_TAG = hooks.unexpected_stderr, hooks.STDERR_TAG
    err = [{"output_type": "stream", "name": "stderr", "text": "UserWarning: noise\n"},
           {"output_type": "stream", "name": "stdout", "text": "fine\n"}]
    assert unexpected_stderr(err, []) == "UserWarning: noise\n"
    assert unexpected_stderr(err, [STDERR_TAG]) == ""
    assert unexpected_stderr(err[1:], []) == ""
