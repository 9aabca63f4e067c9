"""The step that fake.py (on FakeTensorMode), measured.py (on real tensors) and `make gpu-smoke` (on a GPU)
run under `track()`: a plain training loop's step (`plain_step`), twice (the first builds the optimizer
state), or a prefill and greedy decoding steps."""
from __future__ import annotations

import contextlib

from .config import is_masked_lm

__all__ = ["quiet", "make_optimizer", "plain_step", "measure_step", "measure_inference", "storage_bytes"]


@contextlib.contextmanager
def quiet():
    """transformers' one-time notices during a measured step (its default-loss notice, the past_key_values
    rename) are about the library, not the user's model: silence them here, only while measuring."""
    import warnings
    from transformers.utils import logging as hf_logging
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)



def make_optimizer(name, params, foreach=False):
    """The torch optimizer `name` names (one of formulas.OPTIMIZERS) over `params`; None for None."""
    import torch
    if name is None:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, foreach=foreach)
    if name == "adamw":
        return torch.optim.AdamW(params, foreach=foreach)
    raise KeyError(name)


def measure_step(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                 logits_to_keep, ids=None):
    """(first, later) trackers of two training steps of `model`, or of inference (the same tracker twice)."""
    with quiet():
        return _measure_step_quietly(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens,
                                     foreach, logits_to_keep, ids)


def plain_step(model, config, ids, dtype, optimizer, recompute=False, foreach=False):
    """(step, objs): `step()` is one step of a plain training loop for `model` on the token ids `ids`
    (forward under autocast for dtype "amp-*", loss.backward(), optimizer.step(), zero_grad); objs are the
    model and its optimizer (`optimizer` names one of formulas.OPTIMIZERS), what track() is given.
    recompute: activation checkpointing of every layer (transformers' own, non-reentrant)."""
    import torch
    enc_dec = bool(getattr(config, "is_encoder_decoder", False))
    model.train()
    if recompute:        # transformers 5.24 renamed it (the old name warns); 5.17 has the old one only
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    opt = make_optimizer(optimizer, model.parameters(), foreach)
    amp = torch.autocast(ids.device.type, dtype={"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}[dtype]) \
        if dtype.startswith("amp") else contextlib.nullcontext()

    def step():
        with amp:
            # a plain loop's call: use_cache left at the config's default, as a learner leaves it (a
            # training forward fills a cache too; tests/test_estimate_families.py shows what it changes)
            kw = dict(labels=ids)
            if enc_dec:             # the decoder reads the labels, shifted right by the model itself
                kw["decoder_input_ids"] = ids
            loss = model(input_ids=ids, **kw).loss
        loss.backward()
        del loss
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)

    return step, ((model, opt) if opt is not None else (model,))


def _measure_step_quietly(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                          logits_to_keep, ids=None):
    import torch
    from ..memory import track
    enc_dec, masked = bool(getattr(config, "is_encoder_decoder", False)), is_masked_lm(config)
    with getattr(model, "fake_mode", contextlib.nullcontext()):
        ids = torch.zeros(batch, seq, dtype=torch.long) if ids is None else ids
        if training:
            step, objs = plain_step(model, config, ids, dtype, optimizer, recompute, foreach)
            with track(*objs) as first:
                step()
            with track(*objs) as mem:
                step()
        else:
            model.eval()
            first = mem = measure_inference(model, ids, kv_tokens, logits_to_keep, enc_dec, masked, max_steps=3)
    return first, mem



def measure_inference(model, ids, kv_tokens, logits_to_keep, enc_dec, masked, max_steps=None):
    """generate's memory without generate (it reads data): a prefill, then greedy decoding steps."""
    import inspect
    import torch
    from ..memory import track
    batch, seq = ids.shape
    keep = 1 if logits_to_keep is None else logits_to_keep
    # transformers 5 renamed past_key_values to cache (the old name warns)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad(), track(model) as mem:
        mem.mark("prefill")
        if masked:
            out = model(input_ids=ids)
            del out
            return mem
        kw = dict(use_cache=kv_tokens > 0)
        if not enc_dec:
            kw["logits_to_keep"] = keep
        if enc_dec:
            start = torch.zeros(batch, 1, dtype=torch.long, device=ids.device)
            out = model(input_ids=ids, decoder_input_ids=start, **kw)
            enc = (out.encoder_last_hidden_state,)
        else:
            out = model(input_ids=ids, **kw)
        cache = out.get(name) if kv_tokens and name in out else None
        nxt = out.logits[:, -1, :].to(copy=True, dtype=torch.float32).argmax(-1, keepdim=True)
        del out
        steps = max(kv_tokens - seq + 1, 1) - 1 if kv_tokens else 0
        run = steps if max_steps is None else min(steps, max_steps)
        sizes = []
        for _ in range(run):
            mem.mark("decode")
            if enc_dec:
                out = model(encoder_outputs=enc, decoder_input_ids=nxt, use_cache=True, **{name: cache})
            else:
                out = model(input_ids=nxt, use_cache=True, logits_to_keep=1, **{name: cache})
            cache = out[name]
            nxt = out.logits[:, -1, :].to(copy=True, dtype=torch.float32).argmax(-1, keepdim=True)
            del out
            sizes.append(storage_bytes(cache))
        if cache is not None:
            mem.label(cache, "kv_cache")
    # decoding steps not run: the cache grows by the last measured step's growth each (a sliding window
    # that caps it later is over-counted: conservative)
    mem.unrun = (steps - run, sizes[-1] - sizes[-2] if len(sizes) > 1 else 0)
    return mem


def storage_bytes(obj):
    """Bytes of the storages behind the tensors in `obj` (a cache, a list, a tensor), each counted once."""
    from ..memory.walk import tensors
    seen = {}
    for t in tensors(obj):
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())

