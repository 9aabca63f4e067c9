"""Memory from a model's config, before anything is allocated: the formulas, one per category.

Bytes per parameter (P = parameter count):
    weights      P * w              w = 4 (fp32, autocast), 2 (bf16/fp16); "mixed" stores 16-bit weights
    gradients    P * w              same dtype as the weights
    optimizer    sgd 0, sgd-momentum P*e, adam/adamw 2*P*e, adamw-8bit ~2*P (+ fp32 blocks' scales);
                 "mixed" keeps fp32 master weights and fp32 Adam: 12 * P   (ZeRO sec. 3.1: 16 B/param)
    kv cache     2 * layers * kv_heads * head_dim * e * batch * tokens          (vLLM sec. 3)

Activations kept for backward, per layer, per token (b*s tokens), e bytes per element:
    GPT block (Korthikanti et al. 2022, sec. 4, 16-bit, with dropout):  h*(34 + 5*a*s/h)
    Llama block (derived here for transformers' LlamaDecoderLayer with SDPA flash/efficient kernels,
    no dropout; each term is a tensor that autograd saves, checked against `track()` in the tests):
        2 RMSNorms   2 * (4h + 2eh)   fp32 copy of the input (4h), the normalised 16-bit copy (eh),
                                      the output that the next matmuls save (eh)
        attention    2eh + 2e*h_kv + 4a   q and k after RoPE (q eh, k e*h_kv), v (e*h_kv),
                                      SDPA output (eh), its fp32 log-sum-exp (4 bytes per head)
        SwiGLU MLP   4ei              gate out (SiLU input), SiLU out, up out, their product
        total        8h + 6eh + 2e*h_kv + 4ei + 4a
    Under torch.autocast (fp32 weights, 16-bit matmuls) the residual stream and the norms stay fp32 and
    every matmul casts its own input (q, k and v cast the same normed input three times):
        2 RMSNorms   2 * 8h           the fp32 input and the fp32 normalised tensor
        casts        5eh              inputs of q, k, v, gate, up (o and down get 16-bit inputs already)
        attention    2eh + 2e*h_kv + 4a   q, k after RoPE (computed in fp32, cast back for SDPA), v, output
        SwiGLU MLP   4ei
        total        16h + 7eh + 2e*h_kv + 4ei + 4a,  plus autocast's cache of 16-bit copies of every
                     matmul weight (e bytes per weight), kept from its first use to the end of backward.
    RoPE saves no q/k copies because cos/sin need no gradient. No s^2 term: the flash kernel keeps
    only the log-sum-exp. With full recomputation only each layer's input (e*h) stays, plus one
    layer's activations while it is recomputed; with segments of k layers (Chen et al. 2016), the
    L/k segment inputs plus k layers' activations during the segment's recomputation, smallest at
    k = sqrt(L * input / layer): sqrt(L) only when an input costs as much as a layer (for a
    transformer layer it is ~20x smaller, so k = 1 or 2 wins; notebook 03 measures it).
Head (Llama, loss in fp32 as transformers computes it): final norm (4h + 2eh), the logits (eV, kept by
the output) and the fp32 log-softmax that cross-entropy saves (4V); the fp32 copy of the logits is not
saved (a dtype cast saves nothing).

The peak of a steady-state training step (optimizer state exists, zero_grad(set_to_none=True) as in
PyTorch's default) is one of these moments:
    start of backward   weights + optimizer + activations + the loss gradient: two fp32 V-wide
                        tensors per token (8V) while the e-byte logits (eV) are already freed
    optimizer step      weights + optimizer + gradients + the step's temporaries (AdamW: one
                        parameter-sized copy with foreach=True, two copies of the largest tensor without)
    recomputation       with checkpointing, the top segment (few gradients yet) or the bottom one
                        (most gradients) while its activations are rebuilt
The first step differs: its optimizer state is born inside step().
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .units import fmt_bytes

__all__ = ["estimate", "Estimate", "param_count", "kv_cache_bytes", "DTYPES", "OPTIMIZERS"]

# dtype -> (bytes per weight/gradient element, bytes per 16/32-bit activation element)
DTYPES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "mixed": (2, 2), "amp-bf16": (4, 2), "amp-fp16": (4, 2)}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit", None)


@dataclass
class Estimate:
    """What `estimate` predicts: `parts` (bytes per category), `total` (the predicted peak)."""
    parts: dict
    total: int
    peak_parts: dict
    params: int
    notes: list = field(default_factory=list)

    def __repr__(self):
        rows = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items() if v)
        return f"<estimate peak {fmt_bytes(self.total)} ({rows}); {self.params / 1e6:,.1f}M params>"

    def table(self):
        """The estimate as printable text, one row per category."""
        lines = [f"{'category':<12} {'bytes':>14} {'at peak':>14}"]
        for k, v in self.parts.items():
            lines.append(f"{k:<12} {fmt_bytes(v):>14} {fmt_bytes(self.peak_parts[k]):>14}")
        lines.append(f"{'peak':<12} {'':>14} {fmt_bytes(self.total):>14}")
        return "\n".join(lines + self.notes)


def _shape(config):
    """(family, h, layers, heads, kv_heads, head_dim, intermediate, vocab, positions) of an HF config."""
    if isinstance(config, str):
        from .models import config as preset
        config = preset(config, "full")
    if not hasattr(config, "model_type"):
        raise TypeError(f"config must be a transformers config or a preset name, got {type(config).__name__}")
    g = lambda *names, default=None: next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)
    h, a = g("hidden_size", "n_embd"), g("num_attention_heads", "n_head")
    family = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gpt2": "gpt2", "bert": "bert"}.get(config.model_type)
    if family is None:
        raise ValueError(f"config.model_type must be llama, gpt2 or bert, got {config.model_type!r}")
    return dict(family=family, h=h, L=g("num_hidden_layers", "n_layer"), a=a, kv=g("num_key_value_heads", default=a),
                d=g("head_dim", default=h // a), i=g("intermediate_size", "n_inner", default=4 * h),
                V=config.vocab_size, P=g("max_position_embeddings", "n_positions"),
                tied=bool(getattr(config, "tie_word_embeddings", family != "llama")),
                types=getattr(config, "type_vocab_size", 0))


def param_count(config):
    """Number of parameters of the architecture in `config`, counted from its shapes."""
    s = _shape(config)
    h, i, L, V = s["h"], s["i"], s["L"], s["V"]
    if s["family"] == "llama":
        hkv = s["kv"] * s["d"]
        layer = h * s["a"] * s["d"] * 2 + 2 * h * hkv + 3 * h * i + 2 * h
        return V * h + L * layer + h + (0 if s["tied"] else V * h)
    if s["family"] == "gpt2":
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        return V * h + s["P"] * h + L * layer + 2 * h
    # BERT with the masked-LM head (BertForMaskedLM: no pooler; decoder tied, its bias V)
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    return (V + s["P"] + s["types"]) * h + 2 * h + L * layer + (h * h + h) + 2 * h + V


def kv_cache_bytes(config, batch, tokens, dtype="bf16"):
    """KV cache: 2 (K and V) * layers * kv_heads * head_dim * bytes * batch * tokens."""
    s = _shape(config)
    return 2 * s["L"] * s["kv"] * s["d"] * _bytes(dtype, activations=True) * batch * tokens


def _bytes(dtype, activations=False):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype][activations]


def _linear_params(s):
    """Parameters of a Llama's matmul weights (what autocast casts and caches): all but norms and embedding."""
    h, hkv = s["h"], s["kv"] * s["d"]
    return s["L"] * (2 * h * s["a"] * s["d"] + 2 * h * hkv + 3 * h * s["i"]) + s["V"] * h


def activation_bytes_per_token(config, seq, dtype="bf16", recompute=False):
    """Bytes of activations that one layer keeps for backward, per token (see the module docstring)."""
    s, e = _shape(config), _bytes(dtype, activations=True)
    h, a, hkv, amp = s["h"], s["a"], s["kv"] * s["d"], dtype.startswith("amp")
    if recompute:
        return (4 if amp else e) * h            # the layer's input: the fp32 residual stream under autocast
    if s["family"] == "llama" and amp:
        return 16 * h + 7 * e * h + 2 * e * hkv + 4 * e * s["i"] + 4 * a
    if s["family"] == "llama":
        return 8 * h + 6 * e * h + 2 * e * hkv + 4 * e * s["i"] + 4 * a
    return h * (34 + 5 * a * seq / h) * e / 2      # Korthikanti et al., scaled from 16-bit


def estimate(config, batch=1, seq=512, dtype="bf16", optimizer="adamw", training=True, recompute=False,
             kv_tokens=None, foreach=False):
    """Predicted memory of a training step (training=True) or of inference with a KV cache.

    config: a transformers config or a labkit preset name (its full size).
    dtype: "fp32", "bf16", "fp16" (weights, grads and states in that dtype), "mixed" (16-bit weights
    and grads, fp32 master weights and Adam states: 16 bytes/param), or "amp-bf16"/"amp-fp16"
    (torch.autocast: fp32 weights, grads and states; 16-bit matmul outputs and autocast's weight cache).
    optimizer: "sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit" or None (training only).
    recompute: activation checkpointing: True (every layer), an int k (segments of k layers, Chen et al.
    2016: only segment inputs are kept, one segment is recomputed at a time), or False.
    kv_tokens: tokens held in the KV cache for inference (default: seq).
    foreach: the optimizer's foreach flag (PyTorch's default: True on CUDA, False on CPU).
    """
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not (isinstance(recompute, bool) or isinstance(recompute, int) and recompute >= 1):
        raise ValueError(f"recompute must be True, False or a segment length >= 1, got {recompute!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    s, w, e, P = _shape(config), _bytes(dtype), _bytes(dtype, activations=True), param_count(config)
    amp, llama = dtype.startswith("amp"), s["family"] == "llama"
    tokens = batch * seq
    parts = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "kv_cache", "other"), 0)
    parts["parameters"] = P * w
    notes = []
    if training:
        parts["gradients"] = P * w
        state = {"sgd": 0, "sgd-momentum": w, "adam": 2 * w, "adamw": 2 * w, "adamw-8bit": 2 + 8 / 256, None: 0}
        parts["optimizer"] = int(P * state[optimizer])
        if dtype == "mixed":       # fp32 master weights (4) + the optimizer's state kept in fp32
            fp32_state = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8, "adamw-8bit": 2 + 8 / 256, None: 0}
            parts["optimizer"] = int(P * (4 + fp32_state[optimizer]))
        layer = activation_bytes_per_token(config, seq, dtype)
        head = ((8 * s["h"] + e * s["h"] if amp else 4 * s["h"] + 2 * e * s["h"]) + (e + 4) * s["V"]) if llama else 0
        if recompute:              # segments of k layers keep only their input; one is recomputed at a time
            k = 1 if recompute is True else min(recompute, s["L"])
            held = -(-s["L"] // k) * activation_bytes_per_token(config, seq, dtype, recompute=True)
            recomputed = k * layer
        else:
            held, recomputed = s["L"] * layer, 0
        cache = e * _linear_params(s) if amp and llama else 0   # autocast's 16-bit weight copies, kept
        parts["activations"] = int(tokens * (held + max(head, recomputed)) + cache)   # through backward
        loss_grad = tokens * 8 * s["V"] if llama else 0
        largest = max(s["V"] * s["h"], s["h"] * s["i"]) * w
        step_temp = 0 if optimizer in ("sgd", "sgd-momentum", "adamw-8bit", None) else (
            P * w if foreach else 2 * largest)
        # at the start of backward the loss gradient (8V per token, fp32) is live and the logits are gone
        logits = tokens * e * s["V"] if llama else 0
        backward = dict(parts, gradients=0, activations=int(tokens * (held + head) + cache - logits), other=loss_grad)
        step = dict(parts, activations=0, other=step_temp)
        candidates = [backward, step]
        if recompute:              # recomputing the top segment (few gradients yet) or the bottom one (most)
            layer_params = (P - s["V"] * s["h"] * (1 if s["tied"] else 2) - s["h"]) // s["L"]
            inp = activation_bytes_per_token(config, seq, dtype, recompute=True)
            candidates += [dict(parts, gradients=w * s["V"] * s["h"] * (not s["tied"]), other=0,
                                activations=int(tokens * (held + recomputed) + cache)),
                           dict(parts, gradients=P * w - w * (k * layer_params + s["V"] * s["h"]), other=0,
                                activations=int(tokens * (inp + recomputed) + cache))]
        peak = max(candidates, key=lambda p: sum(p.values()))
        parts["other"] = peak["other"]
        if s["family"] != "llama":
            notes.append("activations: Korthikanti et al.'s GPT block formula (Megatron's layer), not this exact code")
    else:
        parts["kv_cache"] = kv_cache_bytes(config, batch, seq if kv_tokens is None else kv_tokens, dtype)
        if amp:
            raise ValueError(f"dtype {dtype!r} is for training; for inference use 'bf16' or 'fp16'")
        # The largest transient of a no-grad prefill is in the MLP: SiLU(gate), up and their product
        # (3ei) beside the residual stream, the normed input and attention's q/k/v (about 4eh).
        # An approximation: within ~5% of track() for the Llama presets at tiny size.
        parts["activations"] = tokens * w * (3 * s["i"] + 4 * s["h"])
        peak = dict(parts)
    return Estimate(parts=parts, total=sum(peak.values()), peak_parts=peak, params=P, notes=notes)
