"""The sizes the levers read from a Llama-family config: its matrices by name, every parameter's shape, the
largest tensor and the decoder layer (an FSDP unit). No torch: arithmetic on the config's numbers."""
from __future__ import annotations

__all__ = ["LINEARS", "shape_of", "linears", "param_shapes", "largest_param", "layer_params"]

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")     # the matrices of one Llama layer (LoRA's targets)


def shape_of(config):
    """h, L, a, d, kv, i, V, tied and the config itself, from anything labkit.estimate.load_config takes."""
    from ..estimate import load_config
    c = load_config(config)
    h, a = c.hidden_size, c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // a
    return dict(h=h, L=c.num_hidden_layers, a=a, d=d, kv=getattr(c, "num_key_value_heads", None) or a,
                i=getattr(c, "intermediate_size", None) or 4 * h, V=c.vocab_size,
                tied=bool(getattr(c, "tie_word_embeddings", False)), config=c)


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
