"""The ground truth an estimate is checked against: `track()` around a real step of a model built from the
config with random weights (tests/test_estimate_families.py, benchmarks/estimate_table.py)."""
from __future__ import annotations

from .config import build_model, check_lm_head, is_masked_lm, load_config
from .step import measure_inference, measure_step, quiet

__all__ = ["measured"]


def measured(config, batch=2, seq=64, dtype="fp32", optimizer="adamw", training=True, new_tokens=4,
             logits_to_keep=1, foreach=False, device="cpu", seed=0):
    """The ground truth an estimate is checked against: `track()` around a real step of a model built
    from `config` with random weights on `device`.

    training: the second AdamW step (the first builds the optimizer state): returns (first, steady)
    trackers. Inference: `generate` with `new_tokens` greedy tokens (logits_to_keep=1) or one plain forward
    returning every position's logits (logits_to_keep=0); an encoder runs one forward. Returns (mem, mem).
    """
    import torch
    from ..memory import track
    config = load_config(config)
    check_lm_head(config)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    torch.manual_seed(seed)
    model = build_model(config, device, torch_dtype)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen).to(device)
    if training:
        return measure_step(model, config, batch, seq, dtype, optimizer, True, False, seq, foreach, None, ids=ids)
    model.eval()
    masked, enc_dec = is_masked_lm(config), bool(getattr(config, "is_encoder_decoder", False))
    if masked or logits_to_keep == 0 or enc_dec:
        mem = measure_inference(model, ids, seq + new_tokens - 1 if enc_dec else seq, logits_to_keep, enc_dec, masked)
        return mem, mem
    with torch.no_grad(), quiet(), track(model) as mem:
        mem.mark("prefill")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        mem.label(out["cache"] if "cache" in out else out.get("past_key_values"), "kv_cache")
    del out
    return mem, mem
