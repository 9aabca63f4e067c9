"""Memory from a model's config, before anything is allocated: `estimate(config, ...)`.

Families with a formula (est.method == "formula"): llama, mistral, qwen2 (the Llama layer), gemma, phi,
gpt2, bert, opt. Any other config (Mixtral, Qwen2-MoE, T5, ...) or option without a formula (autocast
outside Llama, eager attention, dropout where the formula has none) is measured on fake tensors
(est.method == "fake"). `measured()` runs the same step on real tensors: the ground truth that
tests/test_estimate_families.py holds every family to, within 5% of `track()` at tiny size on a CPU
(fp32; training, generate, plain forward; benchmarks/estimate_table.py prints each gap).

One idea per module, each importing only those below it:
    measured.py   measured(): track() around a real step of a randomly initialised model
    fake.py       the estimate by measurement on FakeTensorMode (shapes, no data)
    step.py       the training / inference step both run under track()
    formulas.py   the formulas, one per category (no torch import)
    params.py     the parameter counts of a shape: all, the matmul weights, the largest module (no torch)
    levers.py     the levers a training step's formula takes: fused step, chunked loss, eager attention,
                  activation offload (no torch)
    sharding.py   Parallel and one rank's share of dp x tp x pp devices, ZeRO and offload (no torch)
    config.py     load_config and the one conversion of a config to the sizes the formulas read (model_shape)
Public functions take a config (anything load_config takes); the formulas beneath them take its shape.
Argument checks: labkit/checks.py. The derivation of the formulas is taught in notebooks/01_memory_anatomy.ipynb.
"""
from __future__ import annotations

from ..checks import count, flag
from .config import FAMILIES, load_config, model_shape
from .fake import fake_estimate
from .formulas import (CATS, DTYPES, OPTIMIZERS, Estimate, activation_bytes_per_token, device_type, dtype_bytes,
                       inference, korthikanti_bytes, kv_cache_bytes, kv_capacity, model_states, training_step)
from .levers import ATTENTION_KERNELS, ATTENTIONS, CHUNKED_CE
from .measured import measured
from .params import param_count
from .sharding import OFFLOADS, ZERO_STAGES, Parallel, as_parallel, make_layout, per_rank

__all__ = ["estimate", "Estimate", "Parallel", "param_count", "kv_cache_bytes", "kv_capacity", "korthikanti_bytes",
           "model_states", "load_config", "model_shape", "measured", "activation_bytes_per_token", "full_step",
           "DTYPES", "OPTIMIZERS", "FAMILIES", "ZERO_STAGES", "OFFLOADS", "CATS"]


def estimate(config, batch=1, seq=512, dtype="bf16", optimizer="adamw", training=True, recompute=False,
             kv_tokens=None, foreach=False, logits_to_keep=None, grad_accum=False, device=None,
             method="auto", max_positions=None, *, parallel=None, dp=None, zero=None, tp=None, pp=None, offload=None,
             fused_step=False, chunked_ce=False, attention="sdpa", activation_offload=False, accumulate=False):
    """Predicted memory of a training step (training=True) or of inference with a KV cache.

    config: a transformers config, a labkit preset name (its full size) or a path to a config.json.
    dtype: "fp32", "bf16", "fp16" (weights, grads and states in that dtype), "mixed" (16-bit weights
    and grads, fp32 master weights and Adam states: 16 bytes/param), or "amp-bf16"/"amp-fp16"
    (torch.autocast: fp32 weights, grads and states; 16-bit matmul outputs and autocast's weight cache).
    optimizer: "sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit" or None (training only).
    recompute: activation checkpointing: True (every layer), an int k (segments of k layers, Chen et al.
    2016: only segment inputs are kept, one segment is recomputed at a time), "selective" (Korthikanti
    et al.: only the attention scores are recomputed), or False.
    kv_tokens: tokens held in the KV cache for inference (default: seq; 0: no cache).
    foreach: the optimizer's foreach flag (PyTorch's default: True on CUDA, False on CPU).
    logits_to_keep: inference only: 1 (default) as generate's prefill, 0 for a plain forward's full logits.
    grad_accum: an fp32 gradient-accumulation buffer (4 bytes/param; with "mixed": 20 bytes/param).
    device: "cpu" or "cuda" (default: this machine): dropout masks are e bytes on a CPU, 1 byte on CUDA.
    method: "auto" (a formula where one exists, else "fake"), "formula" or "fake" (measure a real step on
    FakeTensorMode tensors: takes seconds; exact where tests/test_estimate_families.py shows it).
    max_positions: allow seq + generated tokens beyond config.max_position_embeddings up to this number.
    parallel: Parallel(dp, zero, tp, pp, offload): the memory of one rank when training on dp x tp x pp
    devices (batch is then the micro-batch of one data-parallel rank); the flat keywords dp=, zero=, tp=,
    pp=, offload= say the same (not both). zero: the ZeRO stage over the dp ranks (Rajbhandari et al.
    2020): 1 shards the optimizer state, 2 the gradients too, 3 the weights too. Tensor (tp) and pipeline
    (pp) parallelism split the weights, gradients and optimizer state tp x pp ways (as if evenly: the
    embeddings and the LM head really sit on the first and last stages). Activations: divided by tp
    (Korthikanti et al. 2022 with sequence parallelism: every term / t); with 1F1B the first stage keeps
    p micro-batches of L/p layers, as many as the L layers of one: pp leaves them as they are.
    ZeRO-3 also holds the largest module gathered whole while it runs: its 16-bit weights and its
    unreduced gradients (2 x w x largest layer, DeepSpeed's "4 x largest_layer_params"), and its gradient
    partition is the fp32 one alone when grad_accum=True (reduce-scatter writes into it), as in DeepSpeed's
    estimate_zero3_model_states_mem_needs; ZeRO-2's unreduced bucket is left out, as in the paper's count.
    offload: None, "optimizer" (ZeRO-Offload: the optimizer state, fp32 master weights and, with zero >= 2,
    the gradient partitions live in CPU memory) or "parameters" (ZeRO-Infinity on CPU, FSDP's
    CPUOffloadPolicy: the weight partitions too; needs zero=3). What moved is in est.host, per category.
    Levers priced by formula only (method="formula", training, a family with a formula; levers.py has each
    one's function and source): fused_step (the optimizer step fused into backward: one parameter's gradient
    at a time), chunked_ce (True: notebook 12's linear_cross_entropy, no logits kept; "output": torchtune's
    chunked output loss), attention ("sdpa", or "eager": the score matrix kept), activation_offload (the
    layers' saved activations in host memory: est.host["activations"]), accumulate (the step sums several
    micro-batches of `batch`: the earlier ones' gradients stay alive through each backward, in the
    parameters' .grad, or with grad_accum=True in its fp32 buffer). optimizer "paged-adamw-8bit" and
    "paged-adamw" are bitsandbytes' paged optimizers (the same bytes; labkit.plan prices the paging).
    grad_accum and dtype="mixed" on the fake path: the step is measured (in bf16 for "mixed") and the fp32
    buffer (4 bytes/param, alive across steps) and fp32 master weights + Adam state (12 bytes/param in
    place of the measured bf16 state) are added by formula, as a note says.
    """
    batch, seq = count("batch", batch, 1), count("seq", seq, 1)
    kv_tokens = seq if kv_tokens is None else count("kv_tokens", kv_tokens, 0)
    training, foreach, grad_accum = flag("training", training), flag("foreach", foreach), flag("grad_accum", grad_accum)
    if not (isinstance(recompute, bool) or recompute == "selective" or isinstance(recompute, int) and recompute >= 1):
        raise ValueError(f"recompute must be True, False, 'selective' or a segment length >= 1, got {recompute!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if logits_to_keep is not None:
        logits_to_keep = count("logits_to_keep", logits_to_keep, 0)
    if max_positions is not None:
        max_positions = count("max_positions", max_positions, 1)
    if training and logits_to_keep is not None:
        raise ValueError(f"logits_to_keep is for inference (training=False): a training step keeps every "
                         f"position's logits for the loss, got logits_to_keep={logits_to_keep!r} with training=True")
    if method not in ("auto", "formula", "fake"):
        raise ValueError(f"method must be 'auto', 'formula' or 'fake', got {method!r}")
    dtype_bytes(dtype)
    levers = dict(fused_step=flag("fused_step", fused_step), chunked_ce=chunked_ce, attention=attention,
                  activation_offload=flag("activation_offload", activation_offload),
                  accumulate=flag("accumulate", accumulate))
    if chunked_ce not in CHUNKED_CE:
        raise ValueError(f"chunked_ce must be one of {CHUNKED_CE}, got {chunked_ce!r}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    asked = [f"{k}={v!r}" for k, v in levers.items() if v not in (False, "sdpa")]
    if training and optimizer and optimizer.startswith("paged-"):
        asked.append(f"optimizer={optimizer!r}")
    if asked and not training:
        raise ValueError(f"{', '.join(asked)}: training levers; inference (training=False) takes none")
    if asked and method == "fake":
        raise ValueError(f"{', '.join(asked)}: priced by formula only (method='formula'); labkit.plan.verify "
                         f"measures what fake tensors can run")
    parallel = as_parallel(parallel, dp=dp, zero=zero, tp=tp, pp=pp, offload=offload)
    if parallel.offload and not training:
        raise ValueError(f"offload moves training state to the CPU; for inference use offload=None, "
                         f"got {parallel.offload!r}")
    if parallel.zero and not training:
        raise ValueError(f"zero shards training state; for inference (training=False) use zero=0, "
                         f"got zero={parallel.zero!r}")
    if not training and dtype.startswith("amp"):
        raise ValueError(f"dtype {dtype!r} is for training; for inference use 'bf16' or 'fp16'")
    config = load_config(config)
    kernel = getattr(config, "_attn_implementation", None)
    if kernel in ATTENTION_KERNELS and ATTENTION_KERNELS[kernel] == "sdpa" and kernel != "sdpa":
        import copy                  # FlashAttention, flex attention: what SDPA's flash kernel keeps; no import
        config = copy.deepcopy(config)
        config._attn_implementation = "sdpa"
    shape = model_shape(config)
    if shape["a"] and shape["kv"] and shape["a"] % shape["kv"]:
        raise ValueError(f"config num_attention_heads {shape['a']} is not a multiple of num_key_value_heads "
                         f"{shape['kv']}: each KV head serves a whole group of query heads")
    layout = make_layout(parallel, shape)       # refuses a tp or pp this model cannot have
    longest = max(seq, kv_tokens)
    limit = shape["P"] if max_positions is None else max_positions
    if limit is not None and longest > limit and not shape["enc_dec"]:
        name = "seq" if seq >= kv_tokens else "kv_tokens"
        raise ValueError(f"{name} must be <= max_position_embeddings {shape['P']} of this config, got {longest} "
                         f"(pass max_positions={longest} to estimate beyond it anyway)")
    device = device_type(device)
    formula_ok = shape["family"] is not None and not (dtype.startswith("amp") and shape["family"] != "llama")
    if method == "formula" and not formula_ok:
        raise ValueError(f"no formula for model_type {shape['model_type']!r} with dtype {dtype!r}; use method='fake'")
    if asked and not formula_ok:
        raise ValueError(f"{', '.join(asked)}: priced by formula only, and model_type {shape['model_type']!r} "
                         f"with dtype {dtype!r} has none here")
    if method == "fake" or not formula_ok:
        est = fake_estimate(config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                            logits_to_keep, grad_accum)
    elif training:
        est = training_step(shape, batch, seq, dtype, optimizer, recompute, foreach, grad_accum, device, layout,
                            **levers)
    else:
        est = inference(shape, batch, seq, dtype, kv_tokens, 1 if logits_to_keep is None else logits_to_keep)
    if est.method == "fake" or not training:
        est = per_rank(est, layout, dtype_bytes(dtype), grad_accum)
    if kernel in ATTENTION_KERNELS and kernel not in ("sdpa", "eager"):
        est.notes.append(f"attn_implementation {kernel!r}: priced as SDPA's flash kernel (the same saved tensors)")
    return est



# estimate's keywords beyond a plain training loop's (forward, backward, optimizer.step()): `full_step` names them
LEVER_KEYWORDS = ("fused_step", "chunked_ce", "attention", "activation_offload", "accumulate", "grad_accum", "zero",
                  "offload", "dp", "tp", "pp", "parallel")


def full_step(entry):
    """One entry of a notebook's FULL_STEPS (its parameters cell: what the notebook runs at full size) read as
    tests/test_full_size.py and `make gpu-smoke` need it. An entry is lk.estimate's keywords, or
    dict(bytes=...) for a step given by its size, either with beside={what stays alive beside the step: bytes}.

    Returns {"estimate": the keywords for lk.estimate (None for a given size), "bytes": the given size (None
    otherwise), "beside": {what: bytes}, "levers": the keywords a plain training loop (forward, backward,
    optimizer.step()) does not run, with their values (fused_step, chunked_ce, ...; {} for a plain step),
    "verify": the step as labkit.plan.verify.measure(config, "finetune", levers, seq, device=...) runs it on
    real or fake tensors (None where it cannot: inference, fp16, an optimizer or lever it has not)}.
    A malformed entry raises ValueError or TypeError naming the key and the value, before any work."""
    import inspect
    from ..units import parse_bytes
    if not isinstance(entry, dict):
        raise TypeError(f"a FULL_STEPS entry must be a dict of lk.estimate keywords or dict(bytes=...), got {entry!r}")
    kw = dict(entry)
    beside = kw.pop("beside", {})
    if not isinstance(beside, dict):
        raise TypeError(f"beside must be a dict of what stays alive -> bytes, got {beside!r}")
    beside = {str(k): parse_bytes(v, f"beside[{k!r}]") for k, v in beside.items()}
    if "bytes" in kw:
        if set(kw) != {"bytes"}:
            raise ValueError(f"an entry with bytes holds nothing else but beside, got keys {sorted(kw)}")
        return dict(estimate=None, bytes=parse_bytes(kw["bytes"], "bytes"), beside=beside, levers={}, verify=None)
    known = set(inspect.signature(estimate).parameters)
    unknown = sorted(set(kw) - known)
    if unknown or "config" not in kw:
        raise TypeError(f"a FULL_STEPS entry takes lk.estimate's keywords ({', '.join(sorted(known))}) or bytes; "
                        + (f"got unknown {unknown}" if unknown else "config is missing"))
    levers = {k: v for k, v in kw.items() if k in LEVER_KEYWORDS and not (
        v in (None, False, "sdpa") or isinstance(v, int) and not isinstance(v, bool) and v in (0, 1))}
    return dict(estimate=kw, bytes=None, beside=beside, levers=levers, verify=_verify_levers(kw))


def _verify_levers(kw):
    """The levers labkit.plan.verify.measure runs for lk.estimate keywords `kw`, or None where it cannot."""
    dtype, optimizer = kw.get("dtype", "bf16"), kw.get("optimizer", "adamw")
    runs = dict(fp32="fp32", bf16="bf16", mixed="mixed", **{"amp-bf16": "amp-bf16"})
    if (not kw.get("training", True) or dtype not in runs or kw.get("parallel") is not None
            or optimizer not in ("adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw")
            or any(kw.get(k) not in (None, 1) for k in ("dp", "tp", "pp")) or kw.get("recompute", False) not in
            (False, True, "selective")):
        return None
    accumulate = bool(kw.get("accumulate") or kw.get("grad_accum"))
    return dict(dtype=runs[dtype], optimizer=optimizer, fused_step=kw.get("fused_step", False),
                recompute=kw.get("recompute", False), chunked_ce=kw.get("chunked_ce", False),
                attention=kw.get("attention", "sdpa"), activation_offload=kw.get("activation_offload", False),
                zero=kw.get("zero") or 0, offload=kw.get("offload"), micro_batch=kw.get("batch", 1),
                grad_accum=2 if accumulate else 1)

