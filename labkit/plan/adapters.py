"""LoRA and QLoRA: a frozen base (16-bit, 8-bit or NF4; replicated, or sharded over the GPUs) and trainable
low-rank adapters at any rank on any set of matrices, with their optimizer state and what they keep for
backward. Each figure is a small function with its source; tests/test_plan.py holds them to peft and
bitsandbytes at tiny size."""
from __future__ import annotations

from ..checks import count
from ..estimate.config import model_shape
from .shapes import LINEARS, layer_params, linears

__all__ = ["TARGETS", "ALL_TARGETS", "ATTENTION_TARGETS", "nf4_bits", "int8_bits", "lora_params",
           "quantized_weight_bytes", "frozen_base_saving", "lora_activation_bytes", "quantized_input_bytes",
           "adapter_state_bytes",
           "gathered_unit_bytes", "check_targets"]

ALL_TARGETS = LINEARS                      # QLoRA adapts every linear layer (Dettmers et al. 2023, sec. 4)
ATTENTION_TARGETS = ("q", "k", "v", "o")
TARGETS = {"all": ALL_TARGETS, "attention": ATTENTION_TARGETS, "qv": ("q", "v")}
PEFT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}


def nf4_bits(blocksize=64, double_quant=True):
    """Bits per weight of NF4 (QLoRA, Dettmers et al. 2023, sec. 3): 4 bits plus one absmax per block of
    64; double quantization stores those absmaxes in 8 bits with one fp32 constant per 256 of them:
    4 + 8/64 + 32/(64*256) = 4.127 bits, instead of 4 + 32/64 = 4.5."""
    if double_quant:
        return 4 + 8 / blocksize + 32 / (blocksize * 256)
    return 4 + 32 / blocksize


def int8_bits(in_features):
    """Bits per weight of LLM.int8 (Dettmers et al. 2022, sec. 3): 8 bits plus one fp32 scale per row
    (vector-wise quantization) of `in_features` weights; the fp16 outlier columns are left out."""
    return 8 + 32 / in_features


def check_targets(targets):
    """`targets` as a tuple of LINEARS names; "all", "attention" and "qv" name the usual sets."""
    if isinstance(targets, str):
        if targets not in TARGETS:
            raise ValueError(f"targets must be a tuple of {LINEARS} or one of {tuple(TARGETS)}, got {targets!r}")
        return TARGETS[targets]
    targets = tuple(targets)
    unknown = [t for t in targets if t not in LINEARS]
    if unknown or not targets:
        raise ValueError(f"targets must be a non-empty tuple of {LINEARS}, got {targets!r}")
    return targets


def _rank(rank):
    return count("rank", rank)


def lora_params(config, rank, targets=ALL_TARGETS):
    """Trainable parameters of LoRA (Hu et al. 2021, sec. 4.1): per adapted matrix W (d_out x d_in), A is
    r x d_in and B is d_out x r: r (d_in + d_out) parameters, in every layer."""
    rank, targets = _rank(rank), check_targets(targets)
    s = model_shape(config)
    shapes = linears(s)
    return s["L"] * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def quantized_weight_bytes(config, weights):
    """Bytes of the weights with the layers' matrices in `weights` ("bf16", "int8", "nf4"); embeddings,
    norms and the LM head stay 16-bit, as bitsandbytes and QLoRA leave them."""
    from ..estimate.params import n_params
    s = model_shape(config)
    matrices = s["L"] * sum(a * b for a, b in linears(s).values())
    rest = n_params(s) - matrices
    bits = {"bf16": 16, "int8": int8_bits(s["h"]), "nf4": nf4_bits()}
    if weights not in bits:
        raise ValueError(f"weights must be one of {tuple(bits)}, got {weights!r}")
    return int(matrices * bits[weights] / 8 + 2 * rest)


def frozen_base_saving(s, e=2):
    """Bytes per token and layer that a frozen base does not keep for backward, against full training:
    no weight gradient needs the inputs of q/k/v (the first norm's output), of gate/up (the second's),
    of down (e i), nor the two norms' casts that multiply their frozen weights: 4 e h + e i. The input of
    o is attention's output, which attention's backward keeps anyway. Measured with lk.track on
    LlamaForCausalLM at tiny size (tests/test_plan.py); autograd saves a tensor only for the gradients
    that are required."""
    return 4 * e * s["h"] + e * s["i"]


def lora_activation_bytes(s, rank, targets=ALL_TARGETS, e=2, adapter_dtype="fp32", dropout=0.0):
    """Bytes per token and layer the adapters add to a frozen base's activations.

    adapter_dtype "fp32" (peft's default autocast_adapter_dtype=True with a 16-bit base): each adapter
    casts its input to fp32 and keeps that (4 d_in) and A's output (4 r). "bf16" (torchtune, LitGPT):
    the adapters keep the base's input itself, once per distinct input (q, k and v share one, gate and up
    another, o's is attention's output, already kept), and A's output (e r). dropout > 0: each adapter
    keeps its dropped input and a 1-byte mask ((e + 1) d_in)."""
    rank, targets = _rank(rank), check_targets(targets)
    shapes = linears(s)
    if adapter_dtype == "fp32":
        out = sum(4 * shapes[t][0] + 4 * rank for t in targets)
    elif adapter_dtype == "bf16":
        share = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gu", "up": "gu", "down": "down", "o": "o"}
        inputs = {share[t] for t in targets} - {"o"}
        sizes = {"qkv": s["h"], "gu": s["h"], "down": s["i"]}
        out = sum(e * sizes[k] for k in inputs) + len(targets) * e * rank
    else:
        raise ValueError(f"adapter_dtype must be 'fp32' or 'bf16', got {adapter_dtype!r}")
    if dropout:
        out += sum((e + 1) * shapes[t][0] for t in targets)
    return out


def quantized_input_bytes(s, targets=ALL_TARGETS, e=2, adapter_dtype="fp32"):
    """Bytes per token and layer that bitsandbytes before 0.44 kept for backward beyond a frozen 16-bit base:
    its 4-bit matmul (MatMul4Bit) saved every quantized layer's input although only the input's gradient
    is needed; bitsandbytes PR #1270 ("fix QLoRA mem bug: delete useless buffered activation", July 2024)
    stopped it. The inputs: the first norm's output (q, k, v), o's (a copy of attention's output), the
    second norm's (gate, up), down's; those 16-bit adapters already keep are not counted twice."""
    targets = check_targets(targets)
    kept = set()
    if adapter_dtype == "bf16":
        share = {"q": "qkv", "k": "qkv", "v": "qkv", "gate": "gu", "up": "gu", "down": "down", "o": "o"}
        kept = {share[t] for t in targets}
    sizes = {"qkv": s["h"], "o": s["a"] * s["d"], "gu": s["h"], "down": s["i"]}
    return sum(e * n for k, n in sizes.items() if k not in kept)


def adapter_state_bytes(params, optimizer="adamw", adapter_dtype="fp32"):
    """(weights, gradients, optimizer state) bytes of `params` adapter parameters: fp32 or bf16 weights
    and gradients; AdamW's two moments in the weights' dtype, 8-bit AdamW's 2 bytes plus block scales."""
    w = 4 if adapter_dtype == "fp32" else 2
    state = {"adamw": 2 * w, "adamw-8bit": 2 + 8 / 256, "paged-adamw-8bit": 2 + 8 / 256, "paged-adamw": 8}
    if optimizer not in state:
        raise ValueError(f"optimizer must be one of {tuple(state)} for adapters, got {optimizer!r}")
    return w * params, w * params, int(state[optimizer] * params)


def gathered_unit_bytes(s, weights, prefetch=1):
    """Device bytes of the frozen base that FSDP (or ZeRO-3) gathers whole while it runs, on top of each
    rank's shard: one decoder layer (torchtune wraps each as a unit) and the `prefetch` next ones (FSDP2
    prefetches one), in the base's storage format (NF4 units are gathered quantized, dequantized per
    matrix as they run), or the embedding/LM head when that is larger."""
    bits = {"bf16": 16, "int8": int8_bits(s["h"]), "nf4": nf4_bits()}[weights]
    unit = layer_params(s) * bits / 8
    return int(max(unit * (1 + prefetch), 2 * s["V"] * s["h"]))
