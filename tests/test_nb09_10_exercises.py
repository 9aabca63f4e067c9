"""Notebook 09's exercises 3 (Megatron's f and g) and 4 (1F1B's order), run from the notebook's own cells: the
answer key passes; each wrong half of f/g, GPipe's order, a warm-up one forward too long, and an answer that
calls labkit's taught code each fail. The ranks' recorded 1F1B orders are stood in for by labkit's reference
(tests/test_parallel.py checks that torch's Schedule1F1B ran exactly that order)."""
import contextlib
import io
import pathlib
import re
from fractions import Fraction

import nbformat
import pytest
import torch
import torch.nn.functional as F

import labkit as lk
from labkit import pipeline_parallel, tensor_parallel

NB = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "09_tensor_and_pipeline_parallelism.ipynb"


def _cells():
    return nbformat.read(NB, as_version=4).cells


def _cell(text):
    found = [c.source for c in _cells() if c.cell_type == "code" and text in c.source]
    assert len(found) == 1, (text, len(found))
    return found[0]


def _solution(grade_id):
    """The answer key's source, solution markers dropped."""
    [src] = [c.source for c in _cells() if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    return src


def _run(ns, answer, check):
    exec(answer, ns)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(check, ns)
    return out.getvalue()


def _ns3():
    ns = dict(torch=torch, F=F, lk=lk, tensor_parallel=tensor_parallel)
    exec(_cell("def all_reduce(stacked):"), ns)
    return ns


def _ns4():
    def bubbles(timeline):
        step = max(end for stage in timeline for *_, end in stage)
        return [1 - Fraction(sum(end - start for *_, start, end in stage), step) for stage in timeline]

    def pct(xs):
        return " / ".join(f"{float(x):.1%}" for x in xs)

    p, ms = 2, (2, 4, 8)
    rows = {("1F1B", m, s): {"events": [[k, c, 0.0, 0.0] for k, c in pipeline_parallel.one_f_one_b(p, m)[s]]} for m in ms for s in range(p)}
    return dict(torch=torch, lk=lk, pipeline_parallel=pipeline_parallel, replay=pipeline_parallel.replay, Fraction=Fraction, bubbles=bubbles, pct=pct,
                p=p, pp={"microbatches": list(ms)}, rows=rows)


F_G = _solution("09-ex3-solution")
CHECK3 = _cell("check_exercise_3()")


def test_exercise_3s_answer_key_passes_with_one_all_reduce_each_way():
    out = _run(_ns3(), F_G, CHECK3)
    assert "Exercise 3: passed" in out and "1 in forward, 1 in backward" in out


@pytest.mark.parametrize("wrong, message", [
    (("        return all_reduce(grad)", "        return grad"), "input gradient is not the whole one"),     # f: no all-reduce
    (("        return all_reduce(x)", "        return x.view_as(x)"), "output differs"),                    # g: no all-reduce
    (("        return grad", "        return all_reduce(grad)"), "gradient"),                                # g: all-reduce back: N times
    (("        return x.view_as(x)", "        return all_reduce(x)"), "output differs"),                   # f: all-reduce forward
])
def test_exercise_3_fails_each_wrong_half_of_f_and_g(wrong, message):
    old, new = wrong
    answer = re.sub(r"\s*### (BEGIN|END) SOLUTION", "", F_G)
    assert old in answer
    if old == "        return grad":                                        # Reduce.backward is the last `return grad`
        head, _, tail = answer.rpartition(old)
        answer = head + new + tail
    else:
        answer = answer.replace(old, new, 1)
    with pytest.raises(AssertionError, match=message):
        _run(_ns3(), answer, CHECK3)


def test_exercise_3_refuses_labkits_own_f_and_g():
    answer = "from labkit.tensor_parallel import CopyToParallel as Copy, ReduceFromParallel as Reduce\n"
    with pytest.raises(AssertionError, match="your answer calls"):
        _run(_ns3(), answer, CHECK3)


CHECK4 = _cell("check_exercise_4()")


def test_exercise_4s_answer_key_passes():
    out = _run(_ns4(), _solution("09-ex4-solution"), CHECK4)
    assert "Exercise 4: passed" in out and "p = 8, m = 3" in out


def test_exercise_4_refuses_gpipes_order_a_long_warm_up_and_labkits_reference():
    gpipe = ("def one_f_one_b_order(p, m):\n"
             "    return [[('F', c) for c in range(m)] + [('B', c) for c in range(m)] for _ in range(p)]\n")
    with pytest.raises(AssertionError, match="GPipe's order, not 1F1B's"):
        _run(_ns4(), gpipe, CHECK4)
    torch_warm_up = _solution("09-ex4-solution").replace("warm = min(p - 1 - s, m)", "warm = min(p - s, m)")
    with pytest.raises(AssertionError, match="GPipe's order, not 1F1B's|is not the order 1F1B runs"):
        _run(_ns4(), torch_warm_up, CHECK4)
    with pytest.raises(AssertionError, match="your answer calls labkit.pipeline_parallel.one_f_one_b"):
        _run(_ns4(), "def one_f_one_b_order(p, m, _ref=pipeline_parallel.one_f_one_b):\n    return _ref(p, m)\n", CHECK4)


def test_a_stub_is_not_attempted():
    stub = "def one_f_one_b_order(p, m):\n    raise NotImplementedError()\n"
    assert "not attempted yet" in _run(_ns4(), stub, CHECK4)


CHECK2 = _cell("check_exercise_2()")


def test_exercise_2_shows_the_replayed_answers_only_once_an_answer_passes():
    stub = "def smallest_microbatches(p, target):\n    raise NotImplementedError()\n"
    out = _run(_ns4(), stub, CHECK2)
    assert "not attempted yet" in out and "m = " not in out, out
    out = _run(_ns4(), _solution("09-ex2-solution"), CHECK2)
    assert "Exercise 2: passed" in out and "p = 8, bubble under 10%: m = 64" in out, out


def test_exercise_2_takes_an_exact_closed_form_and_refuses_the_same_in_floats():
    exact = "import math\ndef smallest_microbatches(p, target):\n    return math.floor((p - 1) * (1 - target) / target) + 1\n"
    assert "Exercise 2: passed" in _run(_ns4(), exact, CHECK2)
    floats = exact.replace("    return", "    target = float(target)\n    return")
    with pytest.raises(AssertionError, match="m = 63 is not the smallest m whose bubble is below it"):
        _run(_ns4(), floats, CHECK2)
