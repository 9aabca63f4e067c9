"""The formulas: memory from a model's shapes, one per category, before anything is allocated. No torch
(a config without a formula is counted on the meta device, importing torch only then).

Bytes per parameter (P = parameter count, biases and an untied output layer included):
    weights      P * w              w = 4 (fp32, autocast), 2 (bf16/fp16); "mixed" stores 16-bit weights
    gradients    P * w              same dtype as the weights; grad_accum=True adds an fp32 buffer (4 P)
    optimizer    sgd 0, sgd-momentum P*e, adam/adamw 2*P*e, adamw-8bit ~2*P (+ fp32 blocks' scales);
                 "mixed" keeps fp32 master weights and fp32 Adam: 12 * P   (ZeRO sec. 3.1: 16 B/param,
                 20 B/param with the fp32 gradient-accumulation buffer, the Ultra-Scale Playbook's count)
    kv cache     2 * layers * kv_heads * head_dim * e * batch * tokens          (vLLM sec. 3)
    activations  per layer and token, what each module saves for backward (`layer_terms`, `head_terms`)

The derivation of the activation terms, family by family, and of the moments of a training step (start of
backward, optimizer step, recomputation) is taught in notebooks/01_memory_anatomy.ipynb ("Where the
activation formula comes from"); tests/test_estimate_families.py holds each family to track().
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import fmt_bytes, parse_bytes
from ..checks import count
from .config import get, model_shape
from .levers import (ATTENTIONS, eager_score_bytes, fused_step_moments, layer_backward_bytes, loss_terms,
                     offloaded_activations)
from .params import largest_layer, linear_params, n_params, param_count
from .sharding import as_parallel, gathered, make_layout, move_to_host, parallel_note, shard

__all__ = ["DTYPES", "OPTIMIZERS", "CATS", "Estimate", "kv_cache_bytes", "cache_bytes", "kv_capacity",
           "korthikanti_bytes", "dtype_bytes", "device_type", "layer_terms", "head_terms", "loss_bytes",
           "mask_bytes", "activation_bytes_per_token", "states", "model_states", "training_step", "total_bytes",
           "peak_moment", "inference"]

# dtype -> (bytes per weight/gradient element, bytes per 16/32-bit activation element)
DTYPES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "mixed": (2, 2), "amp-bf16": (4, 2), "amp-fp16": (4, 2)}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit", "paged-adamw", "paged-adamw-8bit", None)
# the categories of memory, as track() files them
CATS = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")


@dataclass
class Estimate:
    """What `estimate` predicts: `parts` (bytes per category), `total` (the predicted peak).

    first_step / steady: the peak of the first training step and of later ones (total = the larger);
    phase: the moment of the peak; method: "formula" or "fake" (measured on fake tensors).
    """
    parts: dict
    total: int
    peak_parts: dict
    params: int
    notes: list = field(default_factory=list)
    method: str = "formula"
    phase: str = ""
    first_step: int = 0
    steady: int = 0
    parallel: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)      # bytes per category offloaded to CPU memory (offload=)
    largest_layer: int = 0                        # parameters of the largest module (ZeRO-3 gathers it whole)
    moments: dict = field(default_factory=dict)   # training by formula: bytes per category at each moment

    def __repr__(self):
        rows = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items() if v)
        return (f"<estimate peak {fmt_bytes(self.total)} at {self.phase or 'the peak'} ({rows}); "
                f"{self.params / 1e6:,.1f}M params; {self.method}>")

    def table(self):
        """The estimate as printable text, one row per category."""
        lines = [f"{'category':<12} {'bytes':>14} {'at peak':>14}"]
        for k, v in self.parts.items():
            lines.append(f"{k:<12} {fmt_bytes(v):>14} {fmt_bytes(self.peak_parts[k]):>14}")
        lines.append(f"{'peak':<12} {'':>14} {fmt_bytes(self.total):>14}   ({self.phase}; {self.method})")
        if self.first_step != self.steady:
            lines.append(f"first step {fmt_bytes(self.first_step)}, later steps {fmt_bytes(self.steady)}")
        return "\n".join(lines + self.notes)


def kv_cache_bytes(config, batch, tokens, dtype="bf16", prefill=None, source_tokens=None):
    """KV cache: 2 (K and V) * layers * kv_heads * head_dim * bytes * batch * tokens.

    An encoder (BERT) has none. A sliding-window layer keeps at most `sliding_window` tokens once decoding
    has started; right after a prefill of `prefill` tokens it still holds all of them. An encoder-decoder
    (T5) holds the decoder's self-attention cache of `tokens` and the cross-attention cache of
    `source_tokens` encoder tokens (default: as many).
    """
    batch, tokens = count("batch", batch, 1), count("tokens", tokens, 0)
    if source_tokens is not None:
        source_tokens = count("source_tokens", source_tokens, 0)
    return cache_bytes(model_shape(config), batch, tokens, dtype, prefill, source_tokens)


def cache_bytes(shape, batch, tokens, dtype="bf16", prefill=None, source_tokens=None):
    """kv_cache_bytes of a `shape` (config.model_shape)."""
    e = dtype_bytes(dtype, activations=True)
    if shape["encoder"]:
        return 0
    if shape["enc_dec"]:
        L = get(shape["config"], "num_decoder_layers", "decoder_layers", "num_layers")
        source = tokens if source_tokens is None else source_tokens
        return 2 * L * shape["a"] * shape["d"] * e * batch * (tokens + source)
    per_token = 2 * shape["kv"] * shape["d"] * e * batch
    full = shape["L"] - shape["sliding_layers"]
    if shape["sliding_layers"]:
        held = tokens if prefill is not None and tokens <= prefill else min(tokens, shape["window"])
        return per_token * (full * tokens + shape["sliding_layers"] * held)
    return per_token * shape["L"] * tokens


def kv_capacity(config, memory, dtype="fp16", weights=None, activations=0, utilization=0.9):
    """(bytes, token slots) that the KV cache can use on a device of `memory` bytes, as vLLM sizes it: the
    `utilization` share of the device (vLLM's gpu_memory_utilization, default 0.9) minus the weights and
    the activations of a profiled forward. OPT-13B on a 40 GB A100: about 12 GiB, 15.7K tokens of 800 KiB.

    memory: bytes or "40 GiB"; weights: their bytes (default: param_count * 2 or 4 by dtype).
    """
    memory = parse_bytes(memory, "memory")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    memory = int(memory * utilization)
    shape = model_shape(config)
    w = n_params(shape) * dtype_bytes(dtype) if weights is None else weights
    per_token = cache_bytes(shape, 1, 1, dtype)
    if per_token == 0:
        raise ValueError(f"config of model_type {shape['model_type']!r} has no KV cache")
    free = memory - w - activations
    if free <= 0:
        raise ValueError(f"memory {fmt_bytes(memory)} does not hold the weights ({fmt_bytes(w)}) "
                         f"and activations ({fmt_bytes(activations)})")
    return free, free // per_token


def korthikanti_bytes(h, a, s, b=1, layers=1, recompute=False, vocab=None):
    """Korthikanti et al. 2022 (sec. 4.1, Eq. 1): activations of Megatron GPT layers in 16-bit with 1-byte
    dropout masks: s*b*h*(34 + 5*a*s/h) per layer; recompute="selective" drops the 5as/h term (sec. 4.2),
    True keeps only each layer's input (2sbh). vocab: add the output layer, 4sbh(1 + v/h) (sec. 4.3)."""
    per_layer = {False: 34 + 5 * a * s / h, "selective": 34, True: 2}[recompute]
    out = s * b * h * per_layer * layers
    if vocab is not None:
        out += 4 * s * b * h * (1 + vocab / h)
    return out


def dtype_bytes(dtype, activations=False):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype][activations]


def device_type(device):
    if device is None:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return kind


def layer_terms(shape, seq, dtype, training=True, device="cpu"):
    """(bytes per token of one layer, the attention-score part of it) for a family with a formula."""
    e, h, i, a, d = dtype_bytes(dtype, activations=True), shape["h"], shape["i"], shape["a"], shape["d"]
    q, kv, fam, amp = a * d, shape["kv"] * d, shape["family"], dtype.startswith("amp")
    m = (e if device == "cpu" else 1) if training else 0        # a dropout mask element

    def drop(p):                 # does a dropout of probability p run?
        return bool(training and p and p > 0)

    # Attention: SDPA's flash kernel keeps q, k, v, its output (4eh, o's input too) and a log-sum-exp (4a).
    # With dropout on the attention probabilities a CPU runs SDPA's math kernel instead, in fp32 whatever
    # the dtype: q, k and v copies (12h), 3 score tensors (scores, dropout noise, dropped: 12as) and a
    # contiguous copy of the output for the next matmul (eh).
    math = drop(shape.get("p_attn")) and device == "cpu"
    scores = 12 * a * seq if math else 0
    attn = 12 * q + scores + e * h if math else e * 4 * h + 4 * a
    stats = 4 * e               # two LayerNorms' mean and rstd, in the activations' dtype
    if fam == "llama" and shape["window"] and seq > shape["window"]:
        kv = q                   # a sliding-window mask: SDPA gets expanded K and V (no GQA in the kernel)
    if fam == "llama":
        if amp:
            return 16 * h + 5 * e * h + e * (2 * q + 2 * kv) + 4 * e * i + 4 * a, 0
        return 8 * h + 4 * e * h + e * (2 * q + 2 * kv) + 4 * e * i + 4 * a, 0
    if fam == "gemma":
        return 16 * h + 2 * e * h + e * (2 * q + 2 * kv) + 4 * e * i + 4 * a, 0
    if fam == "phi":
        return e * (2 * h + 3 * q + 2 * kv + 5 * i) + 2 * e + 4 * a, 0
    if fam == "gpt2":
        masks = 2 * m * h * drop(shape["p_resid"])
        return e * 4 * h + stats + attn + 5 * e * i + masks, scores
    if fam == "bert":
        masks = 2 * m * h * drop(shape["p_resid"])
        return e * 4 * h + stats + attn + 2 * e * i + masks, scores
    if fam == "opt":
        masks = 2 * m * h * drop(shape["p_resid"]) + m * i * drop(shape["p_act"])
        return e * 4 * h + stats + attn + e * i + masks, scores
    raise AssertionError(fam)


def head_terms(shape, dtype, training=True, device="cpu"):
    """(bytes per token of the head kept for backward without the logits, the logits' bytes per token)."""
    e, h, V, fam = dtype_bytes(dtype, activations=True), shape["h"], shape["V"], shape["family"]
    amp = dtype.startswith("amp")
    m = (e if device == "cpu" else 1) if training else 0
    embd = m * h if training and shape.get("p_embd") else 0
    norm = {"llama": (8 * h + e * h) if amp else (4 * h + 2 * e * h), "gemma": 8 * h + e * h}.get(fam, 2 * e * h + 2 * e)
    if fam == "bert":            # MLM transform: dense's input, GELU's input, its LayerNorm; embeddings' LayerNorm
        norm = 4 * e * h + 2 * e + e * h + 2 * e
    if fam == "opt" and shape["wpe"] != h:
        norm += e * h
    return norm + embd + loss_bytes(shape, dtype) * V, e * V


def loss_bytes(shape, dtype):
    """Bytes per element of the log-softmax cross-entropy saves: transformers' causal-LM loss upcasts the
    logits to fp32; BERT's masked-LM head calls CrossEntropyLoss on the logits in their own dtype."""
    return dtype_bytes(dtype, activations=True) if shape["family"] == "bert" else 4


def mask_bytes(shape, seq, dtype):
    """Per token: the (b, 1, s, s) additive mask that a sliding window shorter than seq needs (one for all layers)."""
    if shape["family"] == "llama" and shape["window"] and seq > shape["window"]:
        return dtype_bytes(dtype, activations=True) * seq
    return 0


def activation_bytes_per_token(config, seq, dtype="bf16", recompute=False, device=None):
    """Bytes of activations that one layer keeps for backward, per token (`layer_terms`; recompute=True:
    the layer's input alone, "selective": without the attention scores)."""
    shape, e = model_shape(config), dtype_bytes(dtype, activations=True)
    if shape["family"] is None:
        raise ValueError(f"no formula for model_type {shape['model_type']!r}; lk.estimate measures it on fake tensors")
    if recompute is True:
        return (4 if dtype.startswith("amp") else e) * shape["h"]    # the layer's input (fp32 under autocast)
    layer, scores = layer_terms(shape, seq, dtype, device=device_type(device))
    return layer - scores if recompute == "selective" else layer


def model_states(params, dp=None, zero=None, dtype="mixed", optimizer="adamw", tp=None, pp=None, grad_accum=False,
                 *, parallel=None):
    """Bytes per rank of weights, gradients and optimizer state: {"parameters", "gradients", "optimizer"}.

    parallel: a Parallel, or the flat dp= (default 1), zero= (0), tp= (1), pp= (1), not both (an offload
    it names is not applied: these are the bytes each rank holds, wherever they live).

    params: a parameter count or a config (anything `estimate` takes). With dtype="mixed" and AdamW
    (K = 12) the ZeRO paper's Fig. 1: DDP 16 bytes/param, ZeRO-1 2 + 2 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3
    16/N (N = dp); 7.5B params on 64 ranks: 120 GB -> 31.4 / 16.6 / 1.9 GB.
    """
    P = params if isinstance(params, int) and not isinstance(params, bool) else param_count(params)
    count("params", P, 1)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    dtype_bytes(dtype)
    parallel = as_parallel(parallel, dp=dp, zero=zero, tp=tp, pp=pp)
    w, g, o = states(P, dtype, optimizer, grad_accum, parallel.zero)
    return shard({"parameters": w, "gradients": g, "optimizer": o}, make_layout(parallel))


def states(P, dtype, optimizer, grad_accum, zero=0):
    """(weights, gradients, optimizer state) in bytes for P parameters on one device."""
    w = dtype_bytes(dtype)
    if zero >= 3 and grad_accum:      # reduce-scatter writes into the fp32 partition: no w-byte one beside it
        return P * w, 4 * P, states(P, dtype, optimizer, False)[2]
    # bitsandbytes' 8-bit AdamW: two uint8 moments and one fp32 absmax per block of 256 of each (its
    # blockwise quantization, Dettmers et al. 2022 "8-bit Optimizers via Block-wise Quantization");
    # bitsandbytes' paged optimizers hold the same bytes in CUDA unified memory (what paging changes is
    # where they live when the device runs short: labkit.plan.paged_optimizer), its 32-bit AdamW in fp32
    state = {"sgd": 0, "sgd-momentum": w, "adam": 2 * w, "adamw": 2 * w, "adamw-8bit": 2 + 8 / 256,
             "paged-adamw-8bit": 2 + 8 / 256, "paged-adamw": 8, None: 0}
    opt = int(P * state[optimizer])
    if dtype == "mixed":       # fp32 master weights (4) + the optimizer's state kept in fp32
        fp32_state = dict(state, **{"sgd-momentum": 4, "adam": 8, "adamw": 8})
        opt = int(P * (4 + fp32_state[optimizer]))
    return P * w, P * w + 4 * P * bool(grad_accum), opt


def total_bytes(moment):
    """Bytes of one moment of a step: the sum over its categories."""
    return sum(moment.values())


def peak_moment(moments):
    """(name, bytes per category) of the moment holding the most bytes (the first of a tie)."""
    best = None
    for name, parts in moments.items():
        if best is None or total_bytes(parts) > total_bytes(best[1]):
            best = (name, parts)
    return best


def training_step(shape, batch, seq, dtype, optimizer, recompute, foreach, grad_accum, device, layout=None,
                  fused_step=False, chunked_ce=False, attention="sdpa", activation_offload=False, accumulate=False,
                  frozen=False):
    """The Estimate of a training step by formula: its moments (start of backward, optimizer step,
    recomputation), each divided for one rank of `layout` (sharding.make_layout) when one is given.

    The levers (each a small function of levers.py, with its source): fused_step (`fused_step_moments`),
    chunked_ce (`loss_terms`), attention "eager" (`eager_score_bytes`), activation_offload
    (`offloaded_activations`: est.host["activations"] holds what moved). accumulate: the step sums
    micro-batches, so the gradients of those before are alive through each backward: in grad_accum's fp32
    buffer, or without one in the parameters' own .grad (a plain loop's `loss.backward()` adds into it).
    Recomputation's moment holds the recomputed layer in its backward (`layer_backward_bytes`). frozen:
    the weights are frozen (a LoRA base: labkit.plan prices the adapters), so the loss makes no LM-head
    weight gradient."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    P, w, e = n_params(shape), dtype_bytes(dtype), dtype_bytes(dtype, activations=True)
    amp, tokens, L = dtype.startswith("amp"), batch * seq, shape["L"]
    parts = dict.fromkeys(CATS, 0)
    zero = (layout or {}).get("zero", 0)
    parts["parameters"], parts["gradients"], parts["optimizer"] = states(P, dtype, optimizer, grad_accum, zero)
    accum = 4 * P * bool(grad_accum)          # the buffer lives across steps
    in_grad = P * w if accumulate and not grad_accum else 0      # earlier micro-batches' .grad, all of it

    def grads(made):          # gradients alive once this backward has made `made` bytes of w-byte gradients
        return accum + max(made, in_grad)
    layer, scores = layer_terms(shape, seq, dtype, device=device)
    if attention == "eager":
        eager = eager_score_bytes(shape, seq, e)
        layer, scores = layer + eager, scores + eager
    head, _ = head_terms(shape, dtype, device=device)
    saved, logits, loss_grad = loss_terms(shape, e, loss_bytes(shape, dtype), tokens, chunked_ce, w, frozen)
    head += saved - loss_bytes(shape, dtype) * shape["V"] + mask_bytes(shape, seq, dtype)
    if recompute == "selective":
        layer -= scores
    if recompute is True or (not isinstance(recompute, bool) and isinstance(recompute, int)):
        k = 1 if recompute is True else min(recompute, L)
        inp = (4 if amp else e) * shape["h"]     # the layer's input (activation_bytes_per_token, recompute=True)
        units, held, recomputed = -(-L // k), -(-L // k) * inp, k * layer
    else:
        k, units, held, recomputed = 0, L, L * layer, 0
    offloaded = 0
    if activation_offload:
        held, offloaded = offloaded_activations(held, units)
    # autocast's 16-bit weight copies, kept through backward by the matmuls that saved them; a checkpointed
    # segment saves none (its casts die when autocast exits), so with recomputation only the output layer's
    # stays, and the recomputed segment makes its own again (`again`, in the recomputation moment)
    out_layer = shape["V"] * shape["h"] if shape["family"] in ("llama", "gemma", "phi") else 0
    cache = e * (out_layer if k and out_layer else linear_params(shape)) if amp else 0
    again = e * k * (linear_params(shape) - out_layer) // L if amp and k and out_layer else 0
    parts["activations"] = int(tokens * (held + max(head + logits, recomputed)) + cache)
    largest_tensor = max(shape["V"] * shape["h"], shape["h"] * shape["i"]) * w
    base = optimizer[len("paged-"):] if optimizer and optimizer.startswith("paged-") else optimizer
    no_temps = base in ("sgd", "sgd-momentum", "adamw-8bit", None) or base != optimizer   # bitsandbytes: fused kernels
    step_temp = 0 if no_temps else (P * w if foreach else 2 * largest_tensor)
    # at the start of backward the loss gradient is live and the logits are gone
    backward = dict(parts, gradients=grads(0), activations=int(tokens * (held + head) + cache), other=int(loss_grad))
    step = dict(parts, activations=0, other=step_temp)
    moments = {"start of backward": backward, "optimizer step": step}
    if fused_step and (grad_accum or accumulate):
        raise ValueError("fused_step steps each parameter as soon as its gradient is complete: it cannot "
                         "accumulate micro-batches (grad_accum or accumulate); torchtune refuses the same")
    # a fused step in a layer's backward holds one of its matrices' gradients at most (the MLP's or q's)
    layer_grad = w * shape["h"] * max(shape["i"], shape["a"] * shape["d"]) if fused_step else None
    candidates = []            # recomputing the top segment (few gradients yet) or the bottom one (most), in
    if k:                      # its backward: which is larger is decided on one rank's device, below
        layer_params = (P - shape["V"] * shape["h"] * (1 if shape["tied"] else 2) - shape["h"]) // L
        freed, made = layer_backward_bytes(shape, e)
        inside = dict(parts, other=int(tokens * made))
        candidates = [dict(inside, gradients=grads(w * shape["V"] * shape["h"] * (not shape["tied"])),
                           activations=int(tokens * (held + recomputed - freed) + cache + again)),
                      dict(inside, gradients=grads(max(0, parts["gradients"] - accum
                                                       - w * (k * layer_params + shape["V"] * shape["h"]))),
                           activations=int(tokens * (inp + recomputed - freed) + cache + again))]
    if fused_step:             # no gradient waits for the step: the top segment, with more activations, is larger
        candidates = [dict(c, gradients=layer_grad) for c in candidates]
        moments = fused_step_moments(moments, largest_tensor, 0 if no_temps else 2 * largest_tensor, layer_grad)
        parts["gradients"] = largest_tensor
    notes, host, largest = [], {}, largest_layer(shape)
    if layout is not None and (layout["zero"] or layout.get("offload")
                               or any(layout[k] > 1 for k in ("dp", "tp", "pp"))):
        extra = gathered(largest, w, layout)         # ZeRO-3's gathered layer, outside the optimizer step
        moments = {n: move_to_host(shard(p, layout, n), layout, 0 if n == "optimizer step" else extra,
                                   0 if n == "optimizer step" else extra, n)[0] for n, p in moments.items()}
        candidates = [move_to_host(shard(c, layout, "recomputation"), layout, extra, extra, "recomputation")[0]
                      for c in candidates]     # offloaded gradients no longer make the bottom segment larger
        parts, host = move_to_host(shard(parts, layout), layout, extra, extra)
        notes.append(parallel_note(layout))
    if candidates:
        moments["recomputation"] = max(candidates, key=total_bytes)
    if offloaded:
        host["activations"] = int(tokens * offloaded / (layout or {}).get("tp", 1))
    first = {n: dict(p, optimizer=0) if n != "optimizer step" else p for n, p in moments.items()}
    phase, peak = peak_moment(moments)
    parts["other"] = peak["other"]
    if dtype == "mixed" or base == "adamw-8bit":
        notes.append("first step: the optimizer state is born in step(), as later steps hold it")
    return Estimate(parts=parts, total=sum(peak.values()), peak_parts=peak, params=P, notes=notes,
                    method="formula", phase=phase, first_step=max(sum(p.values()) for p in first.values()),
                    steady=sum(peak.values()), parallel=dict(layout or {}), host=host, largest_layer=largest,
                    moments=moments)


def inference(shape, batch, seq, dtype, kv_tokens, logits_to_keep):
    """The Estimate of inference by formula: weights + KV cache + the largest transient (prefill, logits
    or a decoding step)."""
    P, w, e = n_params(shape), dtype_bytes(dtype), dtype_bytes(dtype, activations=True)
    tokens, h, V = batch * seq, shape["h"], shape["V"]
    parts = dict.fromkeys(CATS, 0)
    parts["parameters"] = P * w
    parts["kv_cache"] = cache_bytes(shape, batch, kv_tokens, dtype, prefill=seq)
    # The largest no-grad transient, per token, measured op by op (track) at tiny size: gelu_new (GPT-2) is a
    # chain of elementwise ops with up to five i-wide tensors live; Phi's parallel block keeps four beside
    # attention's output; OPT's ReLU one; SwiGLU/GeGLU three beside the stream, q and k/v.
    i = shape["i"]
    mlp = {"gpt2": 5 * i + 2 * h, "phi": 4 * i + 4 * h, "opt": i + 8 * h,
           "bert": 2 * i + 4 * h}.get(shape["family"], 3 * i + 4 * h + shape["kv"] * shape["d"])
    prefill = tokens * e * mlp
    if shape["encoder"]:             # an encoder's forward returns every position's logits
        logits_to_keep = 0
    kept = seq if logits_to_keep == 0 or logits_to_keep > seq else logits_to_keep
    # the logits of the kept positions; generate copies the last one to fp32
    head = batch * kept * V * e + (batch * V * 4 if logits_to_keep else 0) + tokens * e * h * (2 if shape["encoder"] else 1)
    kv_prefill = cache_bytes(shape, batch, seq if not shape["encoder"] and kv_tokens else 0, dtype, prefill=seq)
    moments = {"prefill": dict(parts, kv_cache=kv_prefill, activations=prefill),
               "logits": dict(parts, kv_cache=kv_prefill, activations=head)}
    if kv_tokens > seq:
        moments["decode"] = dict(parts, activations=batch * (V * (e + 4) + e * (3 * shape["i"] + 4 * h)))
    phase, peak = peak_moment(moments)
    parts["activations"] = max(prefill, head)
    total = sum(peak.values())
    return Estimate(parts=parts, total=total, peak_parts=peak, params=P, method="formula", phase=phase,
                    first_step=total, steady=total)

