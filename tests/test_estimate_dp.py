"""lk.estimate per rank: data parallelism with ZeRO stages, tensor and pipeline parallelism (notebook 10)."""
import pytest

import labkit as lk
from labkit.estimate import ZERO_STAGES, model_states

P = 7_500_000_000                       # the ZeRO paper's example (Fig. 1): 7.5B parameters, 64 ranks


@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_the_zero_papers_example(stage, gb):
    states = model_states(P, dp=64, zero=stage)
    assert round(sum(states.values()) / 1e9, 1) == gb


@pytest.mark.parametrize("n", [1, 2, 4, 64])
def test_bytes_per_param_by_stage(n):
    per_param = [sum(model_states(1_000_000 * n, dp=n, zero=z).values()) / (1_000_000 * n) for z in ZERO_STAGES]
    assert per_param == [16, 2 + 2 + 12 / n, 2 + 14 / n, 16 / n]


def test_defaults_leave_the_estimate_unchanged():
    base = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw")
    same = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=1, zero=0, tp=1, pp=1)
    assert (same.total, same.parts, same.peak_parts) == (base.total, base.parts, base.peak_parts)
    assert model_states("llama-2-7b")["parameters"] == 2 * base.params


def test_each_stage_shards_one_more_category():
    kw = dict(batch=1, seq=1024, dtype="mixed", optimizer="adamw", dp=8)
    base = lk.estimate("llama-2-7b", **kw)
    z = {stage: lk.estimate("llama-2-7b", zero=stage, **kw) for stage in ZERO_STAGES}
    assert z[0].parts == base.parts, "dp alone replicates everything: DDP"
    assert z[1].parts["optimizer"] == -(-base.parts["optimizer"] // 8) and z[1].parts["gradients"] == base.parts["gradients"]
    assert z[2].parts["gradients"] == -(-base.parts["gradients"] // 8) and z[2].parts["parameters"] == base.parts["parameters"]
    gathered = 2 * z[3].largest_layer           # ZeRO-3 holds the largest module's 16-bit weights whole while it runs
    assert z[3].parts["parameters"] == -(-base.parts["parameters"] // 8) + gathered
    assert all(z[s].parts["activations"] == base.parts["activations"] for s in ZERO_STAGES), "ZeRO does not touch activations"
    assert z[0].total > z[1].total > z[2].total >= z[3].total


def test_tensor_and_pipeline_parallel_split_states_and_activations():
    base = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw")
    tp = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw", tp=8)
    pp = lk.estimate("llama-2-70b", 1, 4096, "mixed", "adamw", pp=8)
    assert tp.parts["parameters"] == pp.parts["parameters"] == -(-base.parts["parameters"] // 8)
    assert tp.parts["activations"] == -(-base.parts["activations"] // 8), "tensor + sequence parallel: / t"
    assert pp.parts["activations"] == base.parts["activations"], "1F1B: p micro-batches of L/p layers"
    assert "dp=1 x tp=8 x pp=1" in tp.table()


def test_recomputation_composes_with_sharding():
    kw = dict(batch=1, seq=4096, dtype="mixed", optimizer="adamw", dp=8, zero=3, tp=8, pp=2)
    plain, rc = lk.estimate("llama-2-70b", **kw), lk.estimate("llama-2-70b", recompute=True, **kw)
    assert rc.parts["activations"] < plain.parts["activations"] / 10
    assert rc.total < plain.total < 80e9


def test_inference_and_measured_paths_are_divided_too():
    inf = lk.estimate("llama-2-70b", 1, 4096, "bf16", training=False, tp=8)
    one = lk.estimate("llama-2-70b", 1, 4096, "bf16", training=False)
    assert inf.parts["parameters"] == -(-one.parts["parameters"] // 8)
    assert inf.parts["kv_cache"] == -(-one.parts["kv_cache"] // 8)


@pytest.mark.parametrize("kw, match", [
    (dict(dp=0), "dp must be an int >= 1, got 0"),
    (dict(tp=1.5), "tp must be an int >= 1, got 1.5"),
    (dict(pp=True), "pp must be an int >= 1, got True"),
    (dict(zero=4), r"zero must be one of \(0, 1, 2, 3\).*got 4"),
    (dict(zero="3"), r"zero must be one of .*got '3'"),
])
def test_bad_parallel_arguments_name_themselves(kw, match):
    with pytest.raises(ValueError, match=match):
        lk.estimate("llama-2-7b", 1, 512, **kw)
    with pytest.raises(ValueError, match=match):
        model_states(P, **kw)


def test_zero_is_for_training():
    with pytest.raises(ValueError, match="zero shards training state"):
        lk.estimate("llama-2-7b", 1, 512, "bf16", training=False, zero=3, dp=8)
    with pytest.raises(ValueError, match="params must be an int >= 1, got 0"):
        model_states(0)


def test_the_calculator_has_parallel_controls():
    pytest.importorskip("ipywidgets")
    from labkit.widgets import calculator
    calc = calculator(preset="llama-2-7b", seq=1024, dtype="mixed")
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw").total
    calc.controls["dp"].value = 64
    calc.controls["zero"].value = 3
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=64, zero=3).total
    calc.controls["tp"].value = 8
    calc.controls["pp"].value = 2
    want = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=64, zero=3, tp=8, pp=2)
    assert calc.estimate.total == want.total and calc.message is None
    calc.controls["training"].value = False           # ZeRO shards training state: inference ignores it
    assert calc.message is None and calc.estimate.parts["kv_cache"] > 0
