"""Tensor and pipeline parallelism with 2 ranks (gloo on CPU, NCCL on GPUs), started by torchrun."""
import pytest
import torch

from labkit.parallel import launch


def test_sharded_layers_match_the_unsharded_blocks():
    # the script asserts outputs, input gradients and weight-gradient shards itself (rtol 1e-4)
    r = launch("labkit.scripts.tensor_parallel", nproc=2, timeout=300)
    tokens, h = r["tokens"], r["hidden"]
    for block in ("mlp", "attention"):
        assert r[block]["param_bytes"] * 2 == r[block]["full_param_bytes"]        # 1/N per rank
        assert r[block]["forward_bytes"] == r[block]["backward_bytes"] == tokens * h * 4
        assert r[block]["calls"] == 2                                            # one all-reduce each way
    assert r["dtensor"]["loss"] == pytest.approx(r["dtensor"]["reference_loss"], abs=1e-5)
    assert r["dtensor"]["local_param_bytes"] < r["dtensor"]["full_param_bytes"]


def test_launch_reports_a_failing_rank():
    with pytest.raises(RuntimeError, match="labkit.scripts.missing with 2 ranks failed"):
        launch("labkit.scripts.missing", nproc=2, timeout=120)
    with pytest.raises(ValueError, match="nproc must be a positive int, got 0"):
        launch("labkit.scripts.tensor_parallel", nproc=0)
