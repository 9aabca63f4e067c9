import pytest
import torch

import labkit as lk
from conftest import steady_step


@pytest.mark.parametrize("name", sorted(lk.models.PRESETS))
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_param_count_matches_the_model(name, size):
    model = lk.models.build(name, size, device="meta")
    assert lk.param_count(model.config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "sgd"])
def test_training_estimate_within_5_percent_of_track(preset, dtype, optimizer):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = lk.models.build(preset, "tiny", dtype=torch_dtype)
    opt = {"adamw": lambda p: torch.optim.AdamW(p, foreach=False),
           "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}[optimizer](model.parameters())
    step = steady_step(model, opt, next(lk.data.batches(2, 96)))
    with lk.track(model, opt) as mem:
        step()
    est = lk.estimate(model.config, 2, 96, dtype, optimizer)
    assert mem.peak == pytest.approx(est.total, rel=0.05)
    assert mem.at("forward end")["activations"] == pytest.approx(est.parts["activations"], rel=0.05)
    assert mem.max_parts["optimizer"] == pytest.approx(est.parts["optimizer"], rel=0.05, abs=1024)


def test_kv_cache_matches_vllm_opt13b():
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40)
    assert lk.kv_cache_bytes(cfg, 1, 1, "fp16") == 800 * 1024


def test_kv_cache_uses_kv_heads():
    mha = lk.kv_cache_bytes("llama-2-7b", 1, 2048, "bf16")
    gqa = lk.kv_cache_bytes("llama-3-8b", 1, 2048, "bf16")
    assert mha == 2 * 32 * 32 * 128 * 2 * 2048 and gqa == mha // 4


def test_bytes_per_parameter_rules():
    cfg = "llama-2-7b"
    states = lambda e: (e.parts["parameters"] + e.parts["gradients"] + e.parts["optimizer"]) / e.params
    assert states(lk.estimate(cfg, dtype="fp32", optimizer="adamw")) == 16
    assert states(lk.estimate(cfg, dtype="mixed", optimizer="adamw")) == 16
    assert states(lk.estimate(cfg, dtype="bf16", optimizer="adamw")) == 8
    assert states(lk.estimate(cfg, dtype="fp32", optimizer="sgd")) == 8
    assert states(lk.estimate(cfg, dtype="bf16", optimizer="adamw-8bit")) == pytest.approx(6.03, abs=0.01)


def test_recompute_keeps_layer_inputs_only():
    full = lk.estimate("llama-2-7b", 1, 2048, "bf16").parts["activations"]
    ckpt = lk.estimate("llama-2-7b", 1, 2048, "bf16", recompute=True).parts["activations"]
    assert ckpt < full / 5


def test_peak_is_the_larger_of_backward_and_step():
    small = lk.estimate("llama-2-7b", 1, 128, "bf16")       # gradients dominate
    large = lk.estimate("llama-2-7b", 16, 4096, "bf16")     # activations dominate
    assert small.peak_parts["gradients"] > 0 and small.peak_parts["activations"] == 0
    assert large.peak_parts["activations"] > 0 and large.peak_parts["gradients"] == 0
    assert small.total == sum(small.peak_parts.values())


def test_korthikanti_for_gpt_blocks():
    est = lk.estimate("gpt2-124m", 1, 1024, "bf16")
    h, a, s, L = 768, 12, 1024, 12
    assert est.parts["activations"] == pytest.approx(L * s * h * (34 + 5 * a * s / h), rel=1e-9)
    assert est.notes


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "batch must be a positive int, got 0"),
    (dict(seq="long"), "seq must be a positive int, got 'long'"),
    (dict(dtype="fp8"), "dtype must be one of .*'fp8'"),
    (dict(optimizer="lion"), "optimizer must be one of .*'lion'"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lk.estimate("llama-2-7b", **kwargs)


def test_bad_config():
    with pytest.raises(TypeError, match="config must be"):
        lk.estimate(42)
    with pytest.raises(ValueError, match="name must be one of"):
        lk.estimate("llama-9-1t")
    from transformers import T5Config
    with pytest.raises(ValueError, match="model_type must be llama, gpt2 or bert, got 't5'"):
        lk.estimate(T5Config())


def test_table_and_cli(capsys):
    from labkit.cli import main
    assert main(["estimate", "llama-2-7b", "--seq", "2048", "--batch", "1", "--dtype", "bf16", "--train", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "25.10 GiB" in out and "peak" in out
    with pytest.raises(SystemExit):
        main(["estimate", "llama-2-7b", "--dtype", "fp7"])


def test_mixed_precision_states_per_optimizer():
    states = lambda opt: lk.estimate("llama-2-7b", dtype="mixed", optimizer=opt)
    P = lk.param_count(lk.models.config("llama-2-7b", "full"))
    assert states("sgd").parts["optimizer"] == 4 * P                  # the fp32 master copy only
    assert states("sgd-momentum").parts["optimizer"] == 8 * P
    assert states("adamw-8bit").parts["optimizer"] == int(P * (6 + 8 / 256))


def test_recompute_estimate_against_transformers_checkpointing():
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=8)
    if hasattr(model, "activation_checkpointing_enable"):        # its name since transformers 5
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = steady_step(model, opt, next(lk.data.batches(4, 128)))
    with lk.track(model, opt) as mem:
        step()
    est = lk.estimate(model.config, 4, 128, "fp32", "adamw", recompute=True)
    assert mem.peak == pytest.approx(est.total, rel=0.05)
    # what is recomputed during backward is still filed under activations
    backward = mem.timeline["activations"][[i for i, t in mem.marks if t == "backward"][0]:]
    from labkit.estimate import activation_bytes_per_token
    one_layer = 4 * 128 * activation_bytes_per_token(model.config, 128, "fp32")
    assert (backward[1:] - backward[:-1]).clip(min=0).sum() > 0.9 * 8 * one_layer      # each layer, once more


def test_recompute_bad_input():
    with pytest.raises(ValueError, match="recompute must be True, False or a segment length >= 1, got 0"):
        lk.estimate("llama-2-7b", recompute=0)
