"""The levers a training step's formula takes beyond precision, optimizer, recomputation and sharding (used by
formulas.training_step, priced and searched by labkit.plan): each a small function with its source, held to
lk.track on the real thing at tiny size by tests/test_plan.py. No torch."""
from __future__ import annotations

__all__ = ["CE_CHUNK", "OUTPUT_CHUNKS", "CHUNKED_CE", "ATTENTIONS", "OFFLOAD_IN_FLIGHT", "eager_score_bytes",
           "loss_terms", "fused_step_moments", "offloaded_activations", "layer_backward_bytes", "ATTENTION_KERNELS"]

CE_CHUNK = 256            # rows of logits notebook 12's linear_cross_entropy holds at a time (its default)
OUTPUT_CHUNKS = 8         # torchtune's CEWithChunkedOutputLoss: the logits in 8 chunks of the sequence
CHUNKED_CE = (False, True, "output")
ATTENTIONS = ("sdpa", "eager")
# attention implementations a config may name -> what the formulas price it as: FlashAttention 2/3 and flex
# attention keep what SDPA's flash kernel keeps (q, k, v, the output, a log-sum-exp: Dao et al. 2022, sec.
# 3.1); eager keeps the score matrix (`eager_score_bytes`)
ATTENTION_KERNELS = {"sdpa": "sdpa", "flash_attention_2": "sdpa", "flash_attention_3": "sdpa",
                     "flex_attention": "sdpa", "eager": "eager"}
OFFLOAD_IN_FLIGHT = 2     # layers of offloaded activations on the device at once (the one in use, the next)


def eager_score_bytes(shape, seq, e):
    """Per token and layer, what eager attention keeps beyond SDPA's flash kernel: transformers'
    eager_attention_forward takes the softmax in fp32 and saves its output for softmax's backward (4 a s
    bytes per query token), casts it to the activations' dtype and saves that for the product with V
    (e a s; in fp32 the cast returns the same tensor), and needs no log-sum-exp (SDPA's 4 a). The score
    matrix is what FlashAttention never stores (Dao et al. 2022, sec. 3.1). e: bytes of an activation element.
    Held to lk.track in tests/test_plan.py at tiny size."""
    return shape["a"] * (seq * (4 + (e if e != 4 else 0)) - 4)


def loss_terms(shape, e, lb, tokens, chunked_ce=False, w=4, frozen=False):
    """(saved per token, forward transient per token, backward transient in all) of the loss over the
    vocabulary, for `tokens` tokens on one device; e: bytes of an activation element, lb: of an element the
    loss keeps (formulas.loss_bytes: fp32 for a causal LM's upcast loss).

    False: transformers' causal-LM loss: the logits (e V per token) at the end of forward, fp32 log-softmax
    saved (4 V), its gradient and the logits' (8 V) at the start of backward (`head_terms`, `loss_bytes`).
    "output": torchtune's CEWithChunkedOutputLoss: the same saved log-probabilities, but the loss is upcast
    and differentiated one of OUTPUT_CHUNKS chunks at a time: backward holds one chunk's gradients
    ((8 + e) V per token of the chunk).
    True: notebook 12's linear_cross_entropy (labkit.kernels): no logits kept; it saves the (N,) fp32
    log-sum-exp and a bool mask (5 bytes per token), forward holds CE_CHUNK rows of logits and their fp32
    copy ((e + 4) V each), backward two fp32 chunk-sized buffers at a time (the recomputed logits less the
    log-sum-exp, then their exponential: 8 V per row), the LM head's fp32 weight gradient it accumulates
    into (4 V h) and the hidden states' gradient it fills chunk by chunk (e h per token); as it returns, the
    weight gradient cast to the weight's dtype (w V h beside the fp32 one, when w < 4) once the chunks are
    freed. w: bytes of a weight element; frozen: the LM head is frozen (LoRA), so no weight gradient."""
    if chunked_ce not in CHUNKED_CE:
        raise ValueError(f"chunked_ce must be one of {CHUNKED_CE}, got {chunked_ce!r}")
    V = shape["V"]
    if chunked_ce is True:
        rows = min(CE_CHUNK, tokens)
        grad_w = 0 if frozen else 4 * V * shape["h"]
        cast = w * V * shape["h"] if w < 4 and not frozen else 0
        return 5, rows * (e + 4) * V / tokens, max(rows * 8 * V, cast) + grad_w + tokens * e * shape["h"]
    if chunked_ce == "output":
        rows = -(-tokens // OUTPUT_CHUNKS)
        return lb * V, e * V, rows * (8 + e) * V
    return lb * V, e * V, tokens * 2 * lb * V


def fused_step_moments(moments, largest_grad, largest_temp, layer_grad=None):
    """The optimizer step fused into backward (a `register_post_accumulate_grad_hook` per parameter that
    steps and frees its gradient: PyTorch's tutorial "How to save memory by fusing the optimizer step into
    the backward pass", torchtune's optimizer_in_bwd): no moment holds every gradient. The "optimizer step"
    moment is gone (its work happened in backward); the start of backward is as it was (no gradient yet);
    a "fused step" moment holds that moment's activations, one parameter's gradient (`largest_grad`, the
    LM head's or embedding's: the loss gradient is gone once the head's backward has run) and that step's
    temporaries (`largest_temp`); recomputation holds at most one parameter's gradient: `layer_grad`, a
    layer's largest matrix (the LM head's was stepped before any layer's backward), else `largest_grad`."""
    out = {}
    for name, parts in moments.items():
        if name == "optimizer step":
            continue
        one = layer_grad if name == "recomputation" and layer_grad is not None else largest_grad
        out[name] = parts if name == "start of backward" else dict(parts, gradients=one)
    start = moments["start of backward"]
    out["fused step"] = dict(start, gradients=largest_grad, other=largest_temp)
    return out


def offloaded_activations(held, units):
    """(device bytes, host bytes) of `held` bytes of per-layer activations in `units` equal layers (or
    checkpointed segments) when each is moved to pinned host memory as forward saves it and brought
    back as backward needs it (notebook 04's saved-tensor hooks, labkit.offload.ActivationOffload;
    torchtune's OffloadActivations): OFFLOAD_IN_FLIGHT units stay on the device (the one in use and
    the next one in transit), every unit occupies the host."""
    units = max(int(units), 1)
    return held * min(OFFLOAD_IN_FLIGHT, units) / units, held


def layer_backward_bytes(shape, e):
    """(bytes per token freed, bytes per token made) at the peak of one decoder layer's backward, beyond what
    the layer keeps for it: what decides the peak when the layer was just recomputed (recompute=True keeps
    only the layers' inputs, so the top layer's recomputed activations and its backward meet). In a gated
    MLP (Llama, Gemma: down(act(gate(x)) * up(x))) the peak comes once down's backward has run: its input
    (e i) is freed, and its input's gradient, the gradients of the two factors (3 e i) and the gradient
    arriving at the layer (e h) are alive. Measured with lk.track on fake tensors (tests/test_plan.py:
    the 7B step of notebook 13 holds 3 x 172 MiB + 64 MiB there). Other families: (0, 0), not modelled."""
    if shape.get("family") not in ("llama", "gemma"):
        return 0, 0
    return e * shape["i"], 3 * e * shape["i"] + e * shape["h"]
