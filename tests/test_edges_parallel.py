"""labkit.launch at its faults (a rank that ignores SIGTERM, one that writes no result, a bad timeout) and
the tensor-parallel layers with a bias."""
import os
import signal
import textwrap
import time

import pytest
import torch

from labkit.launch import _alive, launch
from labkit.tensor_parallel import ColumnParallelLinear, RowParallelLinear


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


def test_column_and_row_parallel_keep_a_bias(monkeypatch):
    """Two ranks simulated in one process (the all-reduce replaced by a sum over the two partial outputs):
    column-parallel shards the bias with the output features, row-parallel adds it once after the sum.
    Tolerance: fp32 sums in a different order, 1e-6."""
    from labkit import tensor_parallel
    torch.manual_seed(0)
    col, row, x = torch.nn.Linear(8, 6), torch.nn.Linear(6, 8), torch.randn(3, 8)
    shards = [ColumnParallelLinear(col, r, 2) for r in range(2)]
    torch.testing.assert_close(torch.cat([s(x) for s in shards], -1), col(x), rtol=0, atol=1e-6)
    rows = [RowParallelLinear(row, r, 2) for r in range(2)]
    h = col(x)
    parts = [torch.nn.functional.linear(h.chunk(2, -1)[r], rows[r].weight) for r in range(2)]
    monkeypatch.setattr(tensor_parallel, "reduce_from_parallel", lambda y: sum(parts))
    torch.testing.assert_close(rows[0](h.chunk(2, -1)[0]), row(h), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        ColumnParallelLinear(col, 2, 2)
