"""lk.plan held to published recipes (data/recipes.csv), its added formulas, its errors, and `labkit plan`.

Every search runs the formula path of labkit.estimate only (no fake tensors): a full-size search is a
fraction of a second to a few seconds on one CPU thread.
"""
import json
import math
import pathlib

import pytest

from labkit.cli import main
from labkit.plan import (HEADROOM, allocator_overhead, gpu_names, gpu_spec, int8_bits, kv_bytes, lora_params,
                         nf4_bits, paged_kv_tokens, plan, quantized_weight_bytes, recipes, train_flops)

ROOT = pathlib.Path(__file__).resolve().parent.parent
RECIPES = {r["name"]: r for r in recipes()}


def run(name):
    r = RECIPES[name]
    model = str(ROOT / r["model"]) if r["model"].startswith("data/") else r["model"]
    return plan(model, r["task"], r["gpu"], gpus=int(r["gpus"]), seq=int(r["seq"]), batch=int(r["batch"]))


def test_every_recipe_cites_its_source_and_names_a_gpu_of_the_table():
    assert len(RECIPES) == 7
    for r in RECIPES.values():
        assert r["source"].startswith("https://arxiv.org/abs/") and r["claim"], r
        assert r["gpu"] in gpu_names()


def test_gpu_table_has_the_cards_of_the_issue_each_with_its_source():
    assert {"T4", "L4", "A10", "RTX 4090", "A100 40GB", "A100 80GB", "H100", "H200", "V100", "A6000"} <= set(gpu_names())
    for name in gpu_names():
        g = gpu_spec(name)
        assert g["source"].startswith("https://") and g["memory"] >= 16e9 and g["bf16_flops"] > g["fp32_flops"]
    assert gpu_spec("h200")["memory"] == 141e9 and gpu_spec("24 GiB")["memory"] == 24 * 2**30


def test_qlora_65b_fits_one_48_gb_gpu_only_in_nf4():
    plans = run("qlora-65b-48gb")
    assert plans.best and plans.best.levers["weights"] == "nf4"
    assert not any(p.fits for p in plans if p.levers["weights"] == "int8")     # 8 bits: 65 GB of weights


def test_qlora_33b_fits_a_24_gb_card():
    best = run("qlora-33b-24gb").best
    assert best and best.levers["weights"] == "nf4" and best.peak_bytes <= 24e9


def test_lora_65b_in_bf16_does_not_fit_48_gb():
    r = RECIPES["qlora-65b-48gb"]
    plans = plan(str(ROOT / r["model"]), "lora", "A6000", seq=512)
    assert not any(p.fits for p in plans)
    assert all(p.why.startswith("over at parameters") for p in plans)


def test_zero_offload_trains_13b_on_one_32_gb_v100_and_nothing_else_does():
    plans = run("zero-offload-13b-v100")
    assert plans.best and plans.best.levers["offload"]
    assert not any(p.fits for p in plans if not p.levers["offload"])


def test_llama2_7b_full_finetune_needs_sharding_or_offload_on_one_80_gb_gpu():
    plans = run("llama2-7b-full-1x80")
    mixed = [p for p in plans if p.levers["dtype"] == "mixed" and p.levers["optimizer"] == "adamw"]
    assert mixed and not any(p.fits for p in mixed if not p.levers["offload"])
    assert any(p.fits for p in mixed if p.levers["offload"])
    states = sum(next(p for p in mixed if not p.levers["offload"]).parts[c] for c in ("parameters", "gradients", "optimizer"))
    assert states == 16 * plans.question["params"]                 # the ZeRO paper's 16 bytes per parameter


def test_llama2_7b_full_finetune_fits_8_x_80_gb_with_zero3():
    plans = run("llama2-7b-full-8x80-zero3")
    zero3 = [p for p in plans if p.levers["zero"] == 3 and p.levers["dp"] == 8 and p.levers["dtype"] == "mixed"
             and p.levers["optimizer"] == "adamw" and not p.levers["offload"]]
    assert zero3 and any(p.fits for p in zero3)
    fit = next(p for p in zero3 if p.fits)
    assert fit.parts["optimizer"] == pytest.approx(12 * plans.question["params"] / 8, rel=1e-6)


def test_70b_inference_needs_4_bits_on_one_80_gb_gpu():
    plans = run("llama2-70b-nf4-1x80")
    assert not any(p.fits for p in plans if p.levers["weights"] == "bf16")
    assert plans.best.levers["weights"] == "nf4"


def test_nf4_double_quant_is_4_127_bits_as_the_qlora_paper_says():
    assert round(nf4_bits(), 3) == 4.127 and nf4_bits(double_quant=False) == 4.5
    assert int8_bits(4096) == 8 + 32 / 4096


def test_lora_params_match_peft_at_tiny_size():
    peft = pytest.importorskip("peft")
    import labkit as lk
    model = lk.models.build("llama-2-7b", "tiny")
    cfg = peft.LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, cfg)
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert lora_params(model.config, 8) == trainable


def test_quantized_weights_keep_embeddings_and_head_in_16_bits():
    from labkit.estimate import param_count
    P = param_count("llama-2-70b")
    assert quantized_weight_bytes("llama-2-70b", "bf16") == 2 * P
    nf4 = quantized_weight_bytes("llama-2-70b", "nf4")
    rest = 2 * 32000 * 8192 + (2 * 80 + 1) * 8192          # embeddings, LM head, norms: 16-bit
    assert nf4 == int((P - rest) * nf4_bits() / 8 + 2 * rest)


def test_paged_kv_rounds_each_sequence_to_whole_blocks():
    assert paged_kv_tokens(4096, 16) == 4096 and paged_kv_tokens(4097, 16) == 4112 and paged_kv_tokens(1, 16) == 16
    assert kv_bytes("llama-2-7b", 2, 17, "bf16") == 2 * (2 * 32 * 4096 * 2) * 32         # 17 tokens -> 32 slots
    assert kv_bytes("llama-2-7b", 2, 17, "int8") * 2 == kv_bytes("llama-2-7b", 2, 17, "bf16")


def test_offload_moves_every_micro_batch_gradient_and_the_weights_once():
    from labkit.plan import offload_bytes, offload_seconds
    assert offload_bytes(100, None, 4) == 0
    assert offload_bytes(100, "optimizer", 4) == 500 and offload_bytes(100, "parameters", 1) == 400
    assert offload_seconds(100, "optimizer", 1, 10, "L4") == pytest.approx(200 / 32e9 + 320 / 50e9)
    with pytest.raises(ValueError, match="offload"):
        offload_bytes(100, "disk")


def test_costs_are_the_stated_formulas():
    assert train_flops(10, 100) == 6000 and train_flops(10, 100, recompute=True) == 8000
    assert train_flops(10, 100, frozen=True) == 4000 and train_flops(10, 100, recompute="selective") == 6000
    assert allocator_overhead(1000) == int(1000 * HEADROOM)


def test_every_plan_counts_the_allocator_and_ranks_fits_first_then_fastest():
    plans = plan("llama-2-7b", "finetune", "RTX 4090", seq=2048, batch=4)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    times = [p.step_time_s for p in plans if p.fits]
    assert times == sorted(times)
    for p in plans:
        assert sum(p.parts.values()) == p.peak_bytes
        assert p.parts["allocator"] == allocator_overhead(p.peak_bytes - p.parts["allocator"])
        assert p.fits == (p.peak_bytes <= p.budget) and (p.why == "") == p.fits


def test_serving_ranks_by_tokens_per_second():
    plans = plan("llama-2-70b", "serve", "H100", gpus=8, seq=4096, batch=64)
    speeds = [p.tokens_per_s for p in plans if p.fits]
    assert speeds == sorted(speeds, reverse=True) and plans.best.levers["tp"] == 8


@pytest.mark.parametrize("kwargs, named", [
    (dict(task="train"), "task"), (dict(gpu="B300"), "gpu"), (dict(gpus=0), "gpus"), (dict(seq=0), "seq"),
    (dict(batch=1.5), "batch"), (dict(model="no-such-model"), "no-such-model"), (dict(seq=10**6), "seq"),
    (dict(model="gpt2-124m"), "gpt2"),
])
def test_bad_input_is_named_with_its_value(kwargs, named):
    args = dict(model="llama-2-7b", task="finetune", gpu="L4") | kwargs
    with pytest.raises(ValueError, match=named):
        plan(**args)


def test_cli_prints_the_table_and_json(capsys):
    assert main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "L4", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "cost model: MFU" in out
    assert main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "L4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"techniques", "peak_bytes", "fits", "step_time_s", "parts"} <= set(rows[0])


def test_cli_refuses_bad_input_naming_it(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "llama-2-7b", "--task", "lora", "--gpu", "B300"])
    assert "B300" in capsys.readouterr().err
