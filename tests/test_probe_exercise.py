"""A hostile caller's probe of lk.exercise(forbid=...), lk.reveal and lk.nontrivial (each test once failed)."""
import functools
import os
import sys
import threading

import numpy as np
import pytest
import torch

import labkit as lk
import labkit.units


def _refused(body, forbid):
    with pytest.raises(AssertionError, match="your answer calls"):
        with lk.exercise(1, "write it yourself", forbid=forbid):
            body()


def test_a_forbidden_function_run_in_a_thread_the_answer_starts_is_refused():
    def answer():
        worker = threading.Thread(target=labkit.units.fmt_bytes, args=(5,))
        worker.start()
        worker.join()
    _refused(answer, [labkit.units.fmt_bytes])
    assert sys.getprofile() is None and threading.getprofile() is None, "both hooks are restored"


def test_a_forbidden_torch_op_reached_as_a_tensor_method_or_from_c_is_refused():
    x = torch.randn(4, 4)
    for body in (lambda: x.softmax(-1),                              # a Tensor method (bound builtin)
                 lambda: torch.nn.functional.softmax(x, -1),           # a Python wrapper around it
                 lambda: list(map(torch.softmax, [x], [-1])),          # C calling C: no profile event
                 lambda: functools.partial(torch.softmax, dim=-1)(x)):
        _refused(body, [torch.softmax])
    _refused(lambda: x.softmax(-1), [torch.ops.aten.softmax])
    _refused(lambda: x @ x, [torch.matmul])                          # an operator
    _refused(lambda: x.softmax(-1), [torch.Tensor.softmax])          # the method itself, forbidden
    _refused(lambda: torch.softmax(x, -1), [torch.Tensor.softmax])   # and its torch.<name> twin


def test_a_torch_compiled_answer_runs_quietly_under_the_watch(capfd):
    double = torch.compile(lambda a: a.exp() * 2, backend="eager")
    with lk.exercise(1, "t", forbid=[labkit.units.fmt_bytes]):
        double(torch.ones(3))
    out, err = capfd.readouterr()
    assert "Exercise 1: passed" in out and err == "", "dynamo must not trace the profile hook (stderr fails a cell)"


def test_unrelated_torch_calls_still_pass_beside_a_forbidden_op(capsys):
    x = torch.randn(4, 4)
    with lk.exercise(1, "write softmax", forbid=[torch.softmax]):
        e = (x - x.amax(-1, keepdim=True)).exp()
        got = e / e.sum(-1, keepdim=True)
    assert "Exercise 1: passed" in capsys.readouterr().out
    torch.testing.assert_close(got, torch.softmax(x, -1))             # the reference, after the block


def test_a_forbidden_call_then_a_stub_is_reported_as_the_call_not_as_not_attempted(monkeypatch):
    def answer():
        labkit.units.fmt_bytes(5)
        raise NotImplementedError()
    _refused(answer, [labkit.units.fmt_bytes])
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    _refused(answer, [labkit.units.fmt_bytes])


def test_exercise_numbers_may_be_numpy_integers_but_not_bools(capsys):
    with lk.exercise(np.int64(3), "t"):
        pass
    assert "Exercise 3: passed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="number must be an int >= 1, got np.True_"):
        with lk.exercise(np.bool_(True), "t"):
            pass


def test_reveal_takes_0d_arrays_and_tensors_and_unit_strings_and_refuses_a_non_text_label(capsys):
    gaps = lk.reveal("peak", np.array(90.0), torch.tensor(100), 100)
    assert gaps["prediction"] == pytest.approx(-0.1) and gaps["estimate"] == 0
    assert lk.reveal("step time", "12 ms", None, 10, unit="ms")["prediction"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="predicted must be a number of ms or a string like '12 ms', got '12 s'"):
        lk.reveal("step time", "12 s", None, 10, unit="ms")
    with pytest.raises(ValueError, match="what must name the figure.*got None"):
        lk.reveal(None, None, None, 100)


def test_nontrivial_names_what_is_wrong_with_odd_arrays_and_lists():
    with pytest.raises(AssertionError, match="has NaN or infinite entries"):
        lk.nontrivial([float("nan"), 1.0], "the losses")
    lk.nontrivial([2, 2], "two equal counts")                  # equal numbers in a list may be the real answer
    with pytest.raises(AssertionError, match="is a complex array"):
        lk.nontrivial(np.array([1j, 2j]))
    with pytest.raises(AssertionError, match="is an array of <U1"):
        lk.nontrivial(np.array(["a", "b"]))
    with pytest.raises(AssertionError, match=r"is \(nan\+0j\)"):
        lk.nontrivial(complex("nan"))
    with pytest.raises(TypeError, match="what must say what the value is, .*got None"):
        lk.nontrivial(np.arange(3), None)


def test_forbidding_a_package_forbids_its_submodules_code(tmp_path, monkeypatch):
    """labkit.memory and labkit.estimate are packages: their code lives in submodules."""
    pkg = tmp_path / "taughtpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .inner import helper\n")
    (pkg / "inner.py").write_text("class Tracker:\n    def run(self):\n        return 3\n\ndef helper():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import taughtpkg
    from taughtpkg.inner import Tracker
    _refused(lambda: Tracker().run(), forbid=[taughtpkg])
    _refused(lambda: taughtpkg.helper(), forbid=[taughtpkg])


def test_reveal_names_a_modelled_figure_as_a_model(capsys):
    gaps = lk.reveal("peak reserved", None, 110, 100, unit="MiB", measured_label="modelled")
    out = capsys.readouterr().out
    assert "modelled" in out and "vs modelled" in out and "measured" not in out
    assert gaps == {"estimate": pytest.approx(0.1), "measured": 0.0}
    with pytest.raises(ValueError, match="measured_label must be a non-empty string"):
        lk.reveal("x", None, 1, 1, unit="MiB", measured_label="")
