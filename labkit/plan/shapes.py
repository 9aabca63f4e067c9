"""The sizes the levers read from a Llama-family model's shape (labkit.estimate.model_shape, the one conversion
of a config): its matrices by name, every parameter's shape, the largest tensor and the decoder layer (an FSDP
unit). No torch: arithmetic on the shape's numbers."""
from __future__ import annotations

__all__ = ["LINEARS", "linears", "param_shapes", "largest_param", "layer_params"]

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")     # the matrices of one Llama layer (LoRA's targets)


def linears(s):
    """(d_in, d_out) of every matrix of one layer, by LINEARS name (q: h -> a d, k and v: h -> kv d, ...)."""
    h, q, kv, i = s["h"], s["a"] * s["d"], s["kv"] * s["d"], s["i"]
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def param_shapes(s):
    """Every parameter's element count, as LlamaForCausalLM holds them (no biases): the embedding, per
    layer seven matrices and two RMSNorm weights, the final norm, the LM head unless tied."""
    out = [s["V"] * s["h"]]
    for _ in range(s["L"]):
        out += [a * b for a, b in linears(s).values()] + [s["h"], s["h"]]
    out.append(s["h"])
    if not s["tied"]:
        out.append(s["V"] * s["h"])
    return out


def largest_param(s):
    """Elements of the largest parameter: the embedding or LM head (V h) or an MLP matrix (h i)."""
    return max(s["V"] * s["h"], max(a * b for a, b in linears(s).values()))


def layer_params(s):
    """Parameters of one decoder layer: what FSDP gathers as one unit (torchtune wraps each layer)."""
    return sum(a * b for a, b in linears(s).values()) + 2 * s["h"]
