"""`lk.estimate` against `lk.track`, family by family: training, generate and a plain forward.

Every family that `lk.estimate` names, at tiny size (labkit.models.family_config), fp32 on the CPU:
- train: the second AdamW step (foreach=False), batch 2, seq 64; the first step is shown too;
- generate: a prefill of 64 tokens and 4 greedy tokens (transformers' generate, logits_to_keep=1);
- forward: one no-grad forward returning every position's logits (an encoder's only mode).
Columns: the estimate's peak, the measured peak, their gap, the category whose estimate at the peak is
furthest from the measurement (bytes in parentheses), the moment of the peak, and the method ("formula",
or "fake": no formula, measured on fake tensors). Tests: tests/test_estimate_families.py.

    python benchmarks/estimate_table.py [--families gpt2-124m,bert-large] [--wide]

--wide adds the published widths with 2 layers, bf16, batch 8, seq 512: formula against fake tensors.
"""
from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import labkit as lk  # noqa: E402
from labkit.estimate import measured  # noqa: E402

FAMILIES = ["llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2-7b", "gemma-7b", "phi-2", "opt-13b", "gpt2-124m",
            "bert-large", "mixtral-8x7b", "qwen2-moe", "t5-base"]
BATCH, SEQ, NEW = 2, 64, 4


def tiny(name):
    if name in lk.models.PRESETS:
        return lk.models.config(name, "tiny")
    return lk.models.family_config(name, "tiny")


def worst(est_parts, meas_parts):
    """(category, relative gap, byte gap) of the category furthest from its measurement."""
    gaps = {c: (est_parts[c] - m, est_parts[c] / m - 1 if m else 0.0) for c, m in meas_parts.items()}
    cat = max(gaps, key=lambda c: abs(gaps[c][0]))
    return cat, gaps[cat][1], gaps[cat][0]


def row(name, mode, est, peak, peak_parts, extra=""):
    cat, rel, diff = worst(est.peak_parts, peak_parts)
    print(f"{name:<13} {mode:<9} {lk.fmt_bytes(est.total):>11} {lk.fmt_bytes(peak):>11} {est.total / peak - 1:>+7.2%}  "
          f"{cat:<11} {rel:>+7.2%} ({diff:+,d} B)  {est.phase:<17} {est.method:<7} {extra}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--wide", action="store_true", help="7B-width configs (2 layers) on fake tensors")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'family':<13} {'mode':<9} {'estimate':>11} {'measured':>11} {'gap':>7}  {'worst cat.':<11} "
          f"{'its gap':>7}             {'peak at':<17} {'method':<7}")
    for name in args.families.split(","):
        cfg = tiny(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)       # transformers' past_key_values rename
            first, mem = measured(cfg, BATCH, SEQ, "fp32", "adamw")
            est = lk.estimate(cfg, BATCH, SEQ, "fp32", "adamw", device="cpu")
            row(name, "train", est, mem.peak, mem.peak_parts,
                f"first step: est {lk.fmt_bytes(est.first_step)}, meas {lk.fmt_bytes(first.peak)}")
            for mode, keep in (("generate", 1), ("forward", 0)):
                if cfg.is_encoder_decoder and keep == 0:
                    continue                                     # T5: generate only
                if cfg.model_type == "bert" and keep == 1:
                    continue                                     # an encoder: one forward only
                gen, _ = measured(cfg, BATCH, SEQ, "fp32", training=False, new_tokens=NEW, logits_to_keep=keep)
                kv_tokens = SEQ + NEW - 1 if keep or cfg.is_encoder_decoder else SEQ
                est = lk.estimate(cfg, BATCH, SEQ, "fp32", training=False, kv_tokens=kv_tokens, logits_to_keep=keep,
                                  device="cpu")
                row(name, mode, est, gen.peak, gen.peak_parts)
    if args.wide:
        print("\npublished widths, 2 layers, bf16, batch 8, seq 512, AdamW: formula vs fake tensors")
        for name in ("llama-2-7b", "mistral-7b", "qwen2-7b", "gemma-7b", "phi-2", "opt-13b", "gpt2-124m", "bert-large"):
            layers = {"n_layer": 2} if name.startswith("gpt2") else {"num_hidden_layers": 2}
            cfg = (lk.models.config(name, "full", **layers) if name in lk.models.PRESETS
                   else lk.models.family_config(name, "full", **layers))
            fake = lk.estimate(cfg, 8, 512, "bf16", "adamw", method="fake")
            est = lk.estimate(cfg, 8, 512, "bf16", "adamw", device="cpu")
            row(name, "train", est, fake.total, fake.peak_parts, "(measured: fake tensors)")


if __name__ == "__main__":
    main()
