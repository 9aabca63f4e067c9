"""lk.exercise and its helpers: forbid= refuses an answer that reaches the taught code by any route (and lets the
rest run), a stub is "not attempted", lk.reveal sets a prediction beside the estimate and the measurement, and
lk.nontrivial refuses values no real answer is."""
import functools
import sys
import threading

import numpy as np
import pytest
import torch

import labkit as lk
import labkit.units


# ---- forbid: the taught code, however the answer reaches it ----------------------------------------------
def forbidden_answers():
    """Every way an answer can reach the taught function: direct, alias, import, default argument, a module lookup, builtin."""
    import torch
    import torch.nn.functional as F
    from labkit import zero

    def direct(t):
        return zero.shard(t, 0, 2)

    def alias(t):
        cut = zero.shard
        return cut(t, 0, 2)

    def imported(t):
        from labkit.zero import shard as mine
        return mine(t, 0, 2)

    def default_argument(t, _lib=zero.shard):
        return _lib(t, 0, 2)

    def through_modules(t):
        import importlib
        return getattr(importlib.import_module("labkit.zero"), "shard")(t, 0, 2)

    def builtin(t):
        q = t.reshape(1, 1, -1, 2)
        return F.scaled_dot_product_attention(q, q, q)

    def pytorch_internals(t):
        scale, growth = torch.ones(1), torch.zeros(1, dtype=torch.int32)
        torch._amp_update_scale_(scale, growth, torch.zeros(1), 2.0, 0.5, 2000)
        return scale
    return [direct, alias, imported, default_argument, through_modules, builtin, pytorch_internals]


@pytest.mark.parametrize("answer", forbidden_answers(), ids=lambda f: f.__name__)
def test_an_answer_that_calls_the_taught_code_fails_however_it_gets_there(answer):
    import torch
    import torch.nn.functional as F
    import labkit as lk
    from labkit import zero
    forbid = [zero, F.scaled_dot_product_attention, torch._amp_update_scale_]
    with pytest.raises(AssertionError, match="your answer calls"):
        with lk.exercise(3, "write it yourself", forbid=forbid):
            answer(torch.arange(8.0))


def test_forbid_lets_other_code_run_and_refuses_names(capsys):
    import torch
    import labkit as lk
    from labkit import zero
    with lk.exercise(1, "t", forbid=[zero, torch.amp.GradScaler]):
        assert torch.arange(4.0).sum() == 6
    assert "Exercise 1: passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="GradScaler"):
        with lk.exercise(1, "t", forbid=[torch.amp.GradScaler]):
            torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(TypeError, match="not its name"):
        with lk.exercise(1, "t", forbid=["zero.shard"]):
            pass


@pytest.mark.parametrize("route", ["torch", "packet", "overload"])
def test_forbid_covers_an_aten_operator_by_every_route(route):
    import torch
    import labkit as lk
    calls = {"torch": torch._amp_update_scale_, "packet": torch.ops.aten._amp_update_scale_,
             "overload": torch.ops.aten._amp_update_scale_.default}
    for target in calls.values():
        scale, growth = torch.ones(1), torch.zeros(1, dtype=torch.int32)
        with pytest.raises(AssertionError, match="your answer calls"):
            with lk.exercise(1, "write the scale update", forbid=[target]):
                calls[route](scale, growth, torch.zeros(1), 2.0, 0.5, 2000)
    with lk.exercise(1, "other operators still run", forbid=[torch._amp_update_scale_]):
        torch.ops.aten.add.Tensor(torch.ones(1), torch.ones(1))


def test_forbidding_a_module_with_an_enum_does_not_forbid_object_itself(capsys):
    """A module walk takes what the module defines: an Enum there holds object.__new__, which is no one's answer."""
    import enum
    import torch
    import labkit as lk
    with lk.exercise(1, "t", forbid=[torch.amp.grad_scaler]):
        class Colour(enum.Enum):
            RED = 1
        assert Colour.RED.value == 1 and object() is not None
    assert "Exercise 1: passed" in capsys.readouterr().out


def test_an_execd_copy_of_the_taught_function_is_refused_too():
    import inspect
    import torch
    import labkit as lk
    from labkit import zero
    scope = {"torch": torch, "shard_size": zero.shard_size, "_check_rank": getattr(zero, "_check_rank", None)}
    exec(inspect.getsource(zero.shard), scope)               # a new code object with the same instructions
    with pytest.raises(AssertionError, match="your answer calls labkit.zero.shard"):
        with lk.exercise(1, "write shard", forbid=[zero.shard]):
            scope["shard"](torch.arange(8.0), 0, 2)


def test_an_answer_that_switches_off_the_watch_is_refused():
    import sys
    import torch
    import labkit as lk
    from labkit import zero
    with pytest.raises(AssertionError, match="setprofile"):
        with lk.exercise(1, "write shard", forbid=[zero]):
            sys.setprofile(None)
            zero.shard(torch.arange(8.0), 0, 2)
    assert sys.getprofile() is None


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


# ---- a stub, the exercise's number ---------------------------------------------------------------------
def test_a_stub_is_not_attempted_but_a_missing_forward_is_an_error(capsys):
    import torch
    import labkit as lk

    class Misspelt(torch.nn.Module):
        def forwrad(self, x):
            return x
    with lk.exercise(2, "write it"):
        raise NotImplementedError()
    assert "not attempted" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="forward"):
        with lk.exercise(2, "write it"):
            Misspelt()(torch.ones(1))


def test_exercise_numbers_may_be_numpy_integers_but_not_bools(capsys):
    with lk.exercise(np.int64(3), "t"):
        pass
    assert "Exercise 3: passed" in capsys.readouterr().out
    with pytest.raises(ValueError, match="number must be an int >= 1, got np.True_"):
        with lk.exercise(np.bool_(True), "t"):
            pass


# ---- lk.reveal ------------------------------------------------------------------------------------------
def test_reveal_says_when_no_prediction_was_made(capsys):
    import numpy as np
    import labkit as lk
    gaps = lk.reveal("peak", None, "90 MiB", np.int64(100 * 2**20))
    out = capsys.readouterr().out
    assert "not predicted" in out and "+nan" not in out and set(gaps) == {"estimate", "measured"}
    assert lk.reveal("time", np.float32(2.0), None, np.float64(4.0), unit="ms")["prediction"] == -0.5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="estimated"):
            lk.reveal("time", None, bad, 4.0, unit="ms")


def test_reveal_takes_0d_arrays_and_tensors_and_unit_strings_and_refuses_a_non_text_label(capsys):
    gaps = lk.reveal("peak", np.array(90.0), torch.tensor(100), 100)
    assert gaps["prediction"] == pytest.approx(-0.1) and gaps["estimate"] == 0
    assert lk.reveal("step time", "12 ms", None, 10, unit="ms")["prediction"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="predicted must be a number of ms or a string like '12 ms', got '12 s'"):
        lk.reveal("step time", "12 s", None, 10, unit="ms")
    with pytest.raises(ValueError, match="what must name the figure.*got None"):
        lk.reveal(None, None, None, 100)


def test_reveal_names_a_modelled_figure_as_a_model(capsys):
    gaps = lk.reveal("peak reserved", None, 110, 100, unit="MiB", measured_label="modelled")
    out = capsys.readouterr().out
    assert "modelled" in out and "vs modelled" in out and "measured" not in out
    assert gaps == {"estimate": pytest.approx(0.1), "measured": 0.0}
    with pytest.raises(ValueError, match="measured_label must be a non-empty string"):
        lk.reveal("x", None, 1, 1, unit="MiB", measured_label="")


def test_reveal_never_prints_minus_zero(capsys):
    lk.reveal("peak", "99.92 MiB", 100.00001, 100, unit="MiB")
    out = capsys.readouterr().out
    assert "-0%" not in out and "-0.00%" not in out
    assert "(-0.08% vs measured)" in out and "(0.00% vs measured)" in out
    lk.reveal("peak", 150, 99, 100, unit="MiB")
    assert "(+50% vs measured)" in capsys.readouterr().out


# ---- lk.nontrivial --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [float("inf"), float("nan"), "np.float32('nan')", "np.zeros(3)", "np.array([])",
                                   "torch.full((3,), float('inf'))"])
def test_nontrivial_rejects_what_no_real_answer_is(value):
    import numpy as np
    import torch
    import labkit as lk
    value = eval(value) if isinstance(value, str) else value
    with pytest.raises(AssertionError):
        lk.nontrivial(value)


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


# ---- OpLog: what an answer ran, for the checks of 08 and 09 ----------------------------------------------------
def test_oplog_sees_tensors_in_lists_and_keywords_and_no_data_in_meta_tensors():
    from labkit.oplog import OpLog
    x, out, meta = torch.randn(3, 4), torch.empty(3, 3), torch.empty(2, 2, device="meta")
    with OpLog() as log:
        torch.cat([x, x])                       # a list argument
        torch.mm(x, x.T, out=out)               # a keyword argument
        meta + 1
    assert log.names()[0] == "cat" and log.ops[0].shapes == [(3, 4), (3, 4)]
    assert log.read(x) and log.read(out) and not log.read(meta)
    assert log.matmuls() == [((3, 4), (4, 3))]
    assert not log.read(torch.randn(3, 4))       # a tensor no operation took


def test_a_tracked_storage_dying_inside_the_check_is_no_call_of_the_answer():
    """A tracker's weakref callback runs when a storage it counted dies, inside any block: a check cell run a
    second time rebinds the globals that held the first run's models (notebook 01's exercise 2)."""
    import labkit.memory
    with lk.track():
        t = torch.ones(1000)
    with lk.exercise(1, "nothing to write", forbid=[labkit.memory]):
        del t                                   # the closed tracker's callback runs here
    with pytest.raises(AssertionError, match="your answer calls labkit.memory"):
        with lk.exercise(1, "nothing to write", forbid=[labkit.memory]):
            with lk.track():                    # a real call into the forbidden code is still refused
                pass
