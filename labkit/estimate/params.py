"""Parameter counts from a model's shape (config.model_shape): all of them, the matmul weights, the largest
module. No torch (a config without a formula is counted on the meta device, importing torch only then)."""
from __future__ import annotations

from .config import build_model, model_shape

__all__ = ["param_count", "n_params", "linear_params", "largest_layer"]


def param_count(config):
    """Number of parameters of the architecture in `config`, counted from its shapes.

    Untied output layers and biases included. For a config without a formula: counted on the meta device.
    """
    return n_params(model_shape(config))


def n_params(shape):
    """param_count of a `shape` (config.model_shape), counted once and kept in it as shape["n_params"]: the
    planner prices thousands of steps with one shape."""
    if "n_params" not in shape:
        shape["n_params"] = _count_params(shape)
    return shape["n_params"]


def _count_params(shape):
    h, i, L, V, a, d = shape["h"], shape["i"], shape["L"], shape["V"], shape["a"], shape["d"]
    fam = shape["family"]
    if fam is None:
        model = build_model(shape["config"], "meta")
        return sum(p.numel() for p in model.parameters())
    untied = 0 if shape["tied"] else V * h
    if fam in ("llama", "gemma"):
        q, kv = a * d, shape["kv"] * d
        layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        layer += (q + 2 * kv) * shape["qkv_bias"] + h * shape["o_bias"] + (2 * i + h) * shape["mlp_bias"]
        return V * h + L * layer + h + untied
    if fam == "phi":
        q, kv = a * d, shape["kv"] * d
        layer = 2 * h + (h * q + q) + 2 * (h * kv + kv) + (q * h + h) + (h * i + i) + (i * h + h)
        return V * h + L * layer + 2 * h + (untied + V if not shape["tied"] else 0)
    if fam == "gpt2":
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        return V * h + shape["P"] * h + L * layer + 2 * h + untied
    if fam == "opt":
        c = shape["config"]
        bias, affine = bool(c.enable_bias), bool(c.layer_norm_elementwise_affine)
        layer = 4 * (h * h + h * bias) + (h * i + i * bias) + (i * h + h * bias) + 4 * h * affine
        wpe = shape["wpe"]
        proj = 2 * h * wpe if wpe != h else 0
        final = 2 * h * affine if not c._remove_final_layer_norm else 0
        return V * wpe + (shape["P"] + 2) * h + L * layer + final + proj + (0 if shape["tied"] else V * wpe)
    # BERT with the masked-LM head (BertForMaskedLM: no pooler; decoder tied, its bias V)
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    return (V + shape["P"] + shape["types"]) * h + 2 * h + L * layer + (h * h + h) + 2 * h + V + (untied and untied + V)


def linear_params(shape):
    """Parameters of the matmul weights (what autocast casts and caches): all but norms, biases, embeddings
    (the output layer's weight counts: it is a matmul, tied or not)."""
    h, i, L, V, a, d = shape["h"], shape["i"], shape["L"], shape["V"], shape["a"], shape["d"]
    fam = shape["family"]
    if fam in ("llama", "gemma", "phi"):
        q, kv = a * d, shape["kv"] * d
        mlp = 3 * h * i if fam != "phi" else 2 * h * i
        return L * (2 * h * q + 2 * h * kv + mlp) + V * h
    if fam == "gpt2":
        return L * (4 * h * h + 2 * h * i) + V * h
    if fam == "opt":
        return L * (4 * h * h + 2 * h * i) + V * shape["wpe"] + (2 * h * shape["wpe"] if shape["wpe"] != h else 0)
    return L * (4 * h * h + 2 * h * i) + h * h + V * h      # BERT: the MLM head's dense and decoder


def largest_layer(shape):
    """Parameters of the largest single module (its own, not its children's), as DeepSpeed's model_to_params
    counts them: usually the embedding or the LM head (vocab x hidden), else an MLP projection."""
    h, i, V, a, d, fam = shape["h"], shape["i"], shape["V"], shape["a"], shape["d"], shape["family"]
    if fam is None:
        model = build_model(shape["config"], "meta")
        return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    q, kv = a * d, shape["kv"] * d
    if fam in ("llama", "gemma"):
        return max(V * h, h * i + i * shape["mlp_bias"], h * q + q * shape["qkv_bias"], q * h + h * shape["o_bias"],
                   h * kv + kv * shape["qkv_bias"])
    if fam == "phi":
        return max(V * h + V * (not shape["tied"]), h * i + i, h * q + q)
    if fam == "gpt2":
        return max(V * h, shape["P"] * h, 3 * h * h + 3 * h, h * i + i)
    if fam == "opt":
        return max(V * shape["wpe"], (shape["P"] + 2) * h, h * i + i)
    return max(V * h + V, shape["P"] * h, h * i + i)             # BERT: the MLM decoder holds its bias
