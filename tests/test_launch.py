"""labkit.launch and labkit.collectives: torchrun's ranks and their faults (a rank that fails, ignores SIGTERM or
writes no result; a bad timeout), where the ranks run and what they print, fake ranks (one rank of a layout in
this process), and process_group_calls counting what the process group is asked to send (one gloo rank)."""
import os
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from labkit.collectives import process_group_calls
from labkit.launch import _alive, _forward, backend_for, fake_ranks, launch, progress, where_ranks_run


# ---- torchrun's ranks and their faults -------------------------------------------------------------------
@pytest.fixture
def scripts(tmp_path, monkeypatch):
    """A folder on the ranks' PYTHONPATH holding two tiny scripts (no torch import: they start fast)."""
    (tmp_path / "stubborn_rank.py").write_text(textwrap.dedent("""\
        import os, pathlib, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)        # a rank that ignores SIGTERM
        pathlib.Path(os.environ["PID_DIR"], str(os.getpid())).write_text("")
        while True:
            time.sleep(1)
        """))
    (tmp_path / "silent_rank.py").write_text("print('done, but no write_result')\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PID_DIR", str(tmp_path))
    return tmp_path


def test_launch_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="labkit.scripts.missing with 2 ranks failed"):
        launch("labkit.scripts.missing", nproc=2, timeout=120)
    with pytest.raises(ValueError, match="nproc must be .*, got 0"):
        launch("labkit.scripts.tensor_parallel", nproc=0)
    with pytest.raises(ValueError, match="module must be a module name or a list of them, got 3"):
        launch(3)


def test_a_rank_that_ignores_sigterm_is_killed_and_confirmed_gone_on_timeout(scripts):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 30 s and was stopped .*confirmed gone"):
        launch("stubborn_rank", nproc=2, timeout=30)
    pids = [int(p.name) for p in scripts.iterdir() if p.name.isdigit()]
    assert len(pids) == 2, "both ranks started before the timeout"
    assert not any(_alive(p) for p in pids)
    assert time.monotonic() - start < 30 + 30          # SIGTERM, 5 s of grace, SIGKILL: not torchrun's 30 s + more


def test_a_rank_that_exits_0_without_a_result_says_so(scripts):
    with pytest.raises(RuntimeError, match=r"(?s)exited 0 but silent_rank wrote no result: rank 0 must call "
                                           r"labkit.launch.write_result\(data\).*done, but no write_result"):
        launch("silent_rank", nproc=1, timeout=120)


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), "60", True])
def test_a_bad_timeout_is_refused_before_torchrun_starts(bad, capsys):
    with pytest.raises(ValueError, match=f"timeout must be a positive number of seconds, got {bad!r}"):
        launch("labkit.scripts.tensor_parallel", timeout=bad)
    assert "torchrun" not in capsys.readouterr().out


# ---- where the ranks run, what they print ---------------------------------------------------------------
@pytest.mark.parametrize("gpus, nproc, backend, says", [
    (0, 2, "gloo", "2 ranks on 0 GPU(s): the ranks are CPU processes and talk over gloo. Sharding"),
    (1, 2, "gloo", "the GPU does nothing in them"),
    (3, 4, "gloo", "the 3 GPUs do nothing in them"),
    (2, 2, "nccl", "one GPU per rank, NCCL"),
])
def test_where_ranks_run_says_which_backend_and_what_idles(monkeypatch, gpus, nproc, backend, says):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert backend_for(nproc)[0] == backend
    assert says in where_ranks_run(nproc)


def test_progress_of_every_rank_names_it(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    progress("loaded", every_rank=True)
    progress("only rank 0 says this")
    assert capsys.readouterr().out == "[labkit progress] rank 1: loaded\n"


def test_progress_lines_two_ranks_ran_together_are_shown_apart(capsys):
    lines = []
    _forward(iter(["[labkit progress] rank 0: torch loaded[labkit progress] rank 1: torch loaded\n",
                          "other output\n"]), lines)
    out = capsys.readouterr().out
    assert out.count("torch loaded") == 2 and "[labkit progress]" not in out and "other output" not in out
    assert len(lines) == 2


# ---- fake ranks: one rank of a layout, in this process ----------------------------------------------------
def test_fake_ranks_makes_this_process_one_rank_and_then_leaves():
    with fake_ranks(8, rank=3):
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (3, 8, "fake")
        t = torch.ones(4)
        dist.all_reduce(t)                              # returns at once; nothing is sent anywhere
        with pytest.raises(RuntimeError, match="already running here"):
            with fake_ranks(2):
                pass
    assert not dist.is_initialized()


@pytest.mark.parametrize("kwargs, message", [(dict(world=0), "world must be .*, got 0"),
                                             (dict(world=2, rank=2), r"rank must be an int in \[0, 2\), got 2"),
                                             (dict(world=True), "world must be .*, got True")])
def test_fake_ranks_refuses_a_bad_world_or_rank(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with fake_ranks(**kwargs):
            pass
    assert not dist.is_initialized()


# ---- process_group_calls: what the process group is asked to send, whoever asks ----------------------------
@pytest.fixture
def group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    original = dict(vars(dist.ProcessGroup))
    try:
        yield original
    finally:
        dist.destroy_process_group()


def _restored(original):
    return all(vars(dist.ProcessGroup).get(name) is method for name, method in original.items())


def test_each_collective_is_counted_in_the_process_group_itself(group):
    x = torch.ones(1000)                                    # 4000 bytes
    with process_group_calls() as pg:
        dist.all_reduce(x)
        dist.reduce_scatter_tensor(torch.empty(1000), x)   # input: 4000 bytes
        dist.all_gather_into_tensor(torch.empty(1000), x)  # output: 4000 bytes
        x.add_(1)                                          # not a collective: not counted
    assert pg == {"all_reduce": 4000, "reduce_scatter": 4000, "all_gather": 4000, "calls": 3}
    with process_group_calls() as after:
        pass
    assert after["calls"] == 0, "the methods are restored on exit"
    dist.all_reduce(x)                                     # and still bound: collectives work afterwards
    dist.reduce_scatter_tensor(torch.empty(1000), x)
    dist.all_gather_into_tensor(torch.empty(1000), x)


def test_the_list_forms_are_counted_too(group):
    x = torch.ones(250)                                    # 1000 bytes
    with process_group_calls() as pg:
        dist.all_gather([torch.empty(250)], x)             # output list: 1000 bytes
        dist.all_reduce_coalesced([x, x]) if hasattr(dist, "all_reduce_coalesced") else dist.all_reduce(x)
    assert pg["all_gather"] == 1000 and pg["all_reduce"] in (1000, 2000) and pg["calls"] == 2


def test_nested_counters_each_count_their_own_calls_and_an_exception_restores_the_methods(group):
    x = torch.ones(1000)                                       # 4000 bytes
    with process_group_calls() as outer:
        with process_group_calls() as inner:
            dist.all_reduce(x)
        dist.all_reduce(x)
    assert (outer["all_reduce"], outer["calls"], inner["all_reduce"], inner["calls"]) == (8000, 2, 4000, 1)
    with pytest.raises(RuntimeError, match="inside"):
        with process_group_calls():
            raise RuntimeError("inside")
    assert _restored(group)
    dist.all_reduce(x, async_op=True).wait()                   # still bound after exit


def test_a_keyword_call_to_the_process_group_is_counted(group):
    pg = dist.distributed_c10d._get_default_group()
    with process_group_calls() as pg_calls:
        pg.allreduce(tensors=[torch.ones(10)]).wait()
    assert pg_calls["all_reduce"] == 40


def test_contexts_exited_out_of_order_leave_the_process_group_unpatched(group):
    first, second = process_group_calls(), process_group_calls()
    counts = first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    second.__exit__(None, None, None)
    dist.all_reduce(torch.ones(10))
    assert _restored(group) and counts["calls"] == 0
