"""Memory from a model's config, before anything is allocated: the formulas, one per category.

`estimate(config, ...)` answers for every transformers config. Families with a formula (est.method ==
"formula"): llama, mistral, qwen2 (the Llama layer), gemma, phi, gpt2, bert, opt. Any other config
(Mixtral, Qwen2-MoE, T5, ...) or option without a formula (autocast outside Llama, eager attention,
dropout where the formula has none) is measured: the model is built on FakeTensorMode (shapes, no data)
and `track()` follows a real step (est.method == "fake"). `measured()` runs the same step on real
tensors: the ground truth of tests/test_estimate_families.py and benchmarks/estimate_table.py, where
every family is within 0.5% of `track()` at tiny size on a CPU (fp32; training, generate, plain forward).
The fake step is exact to the byte only where a test shows it: a grouped-KV decoder (Qwen3) training
in fp32 at 64 and 2048 tokens (tests/test_edges_estimate.py; the first step within AdamW's 4-byte step
counters). Elsewhere it is what the same step allocates on a CPU, not what CUDA kernels would.
In training, K/V are activations (what attention saves for backward); "kv_cache" is the inference cache
(track() files them the same way, also with `use_cache` left on in a training loop).
The CUDA variants below (1-byte dropout masks, flash attention with dropout) are derived, not yet measured.

Bytes per parameter (P = parameter count, biases and an untied output layer included):
    weights      P * w              w = 4 (fp32, autocast), 2 (bf16/fp16); "mixed" stores 16-bit weights
    gradients    P * w              same dtype as the weights; grad_accum=True adds an fp32 buffer (4 P)
    optimizer    sgd 0, sgd-momentum P*e, adam/adamw 2*P*e, adamw-8bit ~2*P (+ fp32 blocks' scales);
                 "mixed" keeps fp32 master weights and fp32 Adam: 12 * P   (ZeRO sec. 3.1: 16 B/param,
                 20 B/param with the fp32 gradient-accumulation buffer, the Ultra-Scale Playbook's count)
    kv cache     2 * layers * kv_heads * head_dim * e * batch * tokens          (vLLM sec. 3); none for an
                 encoder (BERT); a sliding-window layer (Mistral) holds at most `sliding_window` tokens once
                 decoding starts (transformers keeps the last window-1 plus the new one).

Activations kept for backward, per layer, per token (b*s tokens), e bytes per 16/32-bit element, derived
from what each module saves for backward (torch.autograd.graph.saved_tensors_hooks) and checked against
`track()` in tests/test_estimate_families.py. a = heads, d = head dim, kv = kv_heads * d, i = MLP width.
    Llama / Mistral / Qwen2  2 RMSNorms 2*(4h + 2eh): the fp32 input, the normalised 16-bit copy, the output
                 attention  e*(2ad + 2kv) + 4a: q, k after RoPE, v, the SDPA output, its fp32 log-sum-exp
                 SwiGLU     4ei: gate out, SiLU out, up out, their product
    Gemma        2 norms 2*(8h + eh) (the normalised tensor stays fp32), attention and GeGLU as Llama
    Phi          LayerNorm eh + 2e (input, mean, rstd), its output eh (shared by q, k, v and fc1: parallel
                 block), q, k (partial RoPE concatenates new tensors), v, SDPA output, o's contiguous input:
                 e*(3ad + 2kv) + 4a; gelu_new's elementwise chain 4ei + fc2's input ei
    GPT-2        ln_1, ln_2: 2*(eh + 2e) + their outputs 2eh; attention A; gelu_new's chain 4ei + c_proj's
                 input ei; 2 residual dropout masks 2mh
    BERT         q|k|v's input eh, attention A, output dense's LayerNorm eh + 2e, intermediate's input eh,
                 GELU's input and output 2ei, second LayerNorm eh + 2e; 2 dropout masks 2mh
    OPT          2 LayerNorms 2*(eh + 2e) + outputs 2eh, attention A, ReLU output ei, 2 dropout masks 2mh
    A, attention: SDPA's flash kernel keeps q, k, v, its output (4eh, also o's input) and a log-sum-exp
    (4a). With dropout on the attention probabilities a CPU runs the math kernel instead, in fp32 whatever
    the dtype: copies of q, k, v (12h), three a*s score tensors per token (scores, dropout noise, dropped:
    12as, Korthikanti's 5as/h term) and a contiguous copy of the output (eh). m, a dropout mask element: e
    bytes on a CPU (a noise tensor), 1 byte on CUDA (a bool mask). Dropout counts only in training with
    p > 0 (what `model.train()` runs). Mistral with a sliding window shorter than seq: one (b, 1, s, s)
    additive mask (e*s per token) and K/V expanded to all heads (kv = ad), since SDPA gets a mask.
    Under torch.autocast (Llama): norms stay fp32 and every matmul casts its own input:
        2 RMSNorms 2*8h, casts 5eh, attention e*(2ad + 2kv) + 4a, SwiGLU 4ei, total 16h + 7eh + ...
    plus autocast's 16-bit copy of every matmul weight, kept from first use to the end of backward. Other
    families under autocast are measured on fake tensors (their copies counted the same way).
    RoPE saves no q/k copies because cos/sin need no gradient. With full recomputation only each layer's
    input (e*h) stays, plus one layer's activations while it is recomputed; with segments of k layers
    (Chen et al. 2016), the L/k segment inputs plus k layers' activations during the segment's
    recomputation. recompute="selective" (Korthikanti et al. 2022 sec. 4.2) drops only the attention
    scores (the 12as term; nothing with flash attention, which already keeps none).
Head and loss (per token): final norm and its output as in the layers, the logits (eV, alive until the
output is dropped), the fp32 log-softmax that cross-entropy saves (4V; BERT's masked-LM loss stays in the
logits' dtype: eV). BERT's MLM head adds its dense layer's input, GELU and LayerNorm (4eh + 2e), and the
embeddings' LayerNorm (eh + 2e); GPT-2 and BERT the embedding dropout mask mh. Korthikanti (sec. 4.3)
counts the output layer as 4sbh(1 + v/h) in 16-bit; korthikanti_bytes() reproduces the paper's rows.

Moments of a training step (zero_grad(set_to_none=True), PyTorch's default); the peak is one of:
    start of backward   weights + optimizer + activations + the loss gradient: two fp32 V-wide tensors per
                        token (8V; BERT: 2eV) beside the saved log-softmax, the e-byte logits already freed
    optimizer step      weights + optimizer + gradients + the step's temporaries (AdamW: one
                        parameter-sized copy with foreach=True, two copies of the largest tensor without)
    recomputation       with checkpointing, the top segment (few gradients yet) or the bottom one
                        (most gradients) while its activations are rebuilt
The first step (est.first_step) has no optimizer state before step(); later steps (est.steady) hold it
through forward and backward. est.total is the larger, est.phase names the moment of the peak.
Inference (training=False): weights + KV cache + the largest transient (phase "prefill", "logits" or
"decode"): the prefill's MLP (measured per family: SwiGLU 3ei + 4eh + e*kv, gelu_new 5ei + 2eh, ...) or the
logits: generate computes them for the last position only (logits_to_keep=1) and copies them to fp32; a
plain forward (logits_to_keep=0) and an encoder return e*V per token.
"""
from __future__ import annotations

import contextlib
import json
import operator
import pathlib
from dataclasses import dataclass, field

from .units import fmt_bytes, parse_bytes

__all__ = ["estimate", "Estimate", "param_count", "kv_cache_bytes", "kv_capacity", "korthikanti_bytes",
           "model_states", "load_config", "measured", "DTYPES", "OPTIMIZERS", "FAMILIES", "ZERO_STAGES"]

# dtype -> (bytes per weight/gradient element, bytes per 16/32-bit activation element)
DTYPES = {"fp32": (4, 4), "bf16": (2, 2), "fp16": (2, 2), "mixed": (2, 2), "amp-bf16": (4, 2), "amp-fp16": (4, 2)}
OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adamw-8bit", None)
# model_type -> the family whose formula describes it
ZERO_STAGES = (0, 1, 2, 3)
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma": "gemma", "phi": "phi",
            "gpt2": "gpt2", "bert": "bert", "opt": "opt"}


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


# ---- configs ----------------------------------------------------------------------------------
def load_config(config):
    """A transformers config from a config object, a labkit preset or family name (lk.models.PRESETS,
    lk.models.FAMILY_CONFIGS; full size), or a path to a config.json (or a folder holding one)."""
    if isinstance(config, (str, pathlib.Path)):
        from .models import FAMILY_CONFIGS, PRESETS, family_config
        from .models import config as preset
        name, path = str(config), pathlib.Path(config)
        if name in PRESETS and not path.exists():
            return preset(name, "full")
        if name in FAMILY_CONFIGS and not path.exists():
            return family_config(name, "full")
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            looks_like_path = isinstance(config, pathlib.Path) or path.suffix == ".json" or "/" in name or "\\" in name
            known = f"Presets: {', '.join(sorted(PRESETS))}. Families: {', '.join(sorted(FAMILY_CONFIGS))}."
            if looks_like_path:
                raise FileNotFoundError(f"config file {str(path)!r} does not exist. {known}")
            raise ValueError(f"config {name!r} is neither a preset, a family nor an existing path. {known}")
        return _read_config_json(path)
    if not hasattr(config, "model_type"):
        raise TypeError(f"config must be a transformers config, a preset name or a config.json path, "
                        f"got {type(config).__name__}")
    return config


_SIZES = ("hidden_size", "n_embd", "d_model", "num_attention_heads", "n_head", "num_heads", "num_hidden_layers",
          "n_layer", "num_layers", "intermediate_size", "n_inner", "ffn_dim", "d_ff", "head_dim", "d_kv",
          "num_key_value_heads", "vocab_size")


def _check_sizes(get, model_type, where=""):
    """Every size a config gives must be a positive int: a negative width would give negative parameters."""
    for name in _SIZES:
        value = get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{where}config {name} must be a positive int, got {value!r} (model_type {model_type!r})")


def _read_config_json(path):
    """A transformers config from a config.json, with errors that name the file."""
    from transformers import AutoConfig
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a JSON object, got {type(data).__name__}")
    if "model_type" not in data:
        raise ValueError(f"config file {str(path)!r} has no 'model_type'")
    _check_sizes(data.get, data["model_type"], f"config file {str(path)!r}: ")
    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError, ArithmeticError) as e:
        raise ValueError(f"config file {str(path)!r}: transformers refuses it: {e}") from None


def _get(config, *names, default=None):
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def _shape(config):
    """The shapes the formulas need, from an HF config; family None when no formula covers it."""
    config = load_config(config)
    mt = config.model_type
    family = FAMILIES.get(mt)
    if family == "phi" and getattr(config, "qk_layernorm", False):
        family = None
    if family == "opt" and not getattr(config, "do_layer_norm_before", True):
        family = None                        # OPT-350m's post-norm layout: measured instead
    attn = getattr(config, "_attn_implementation", None)
    if attn not in (None, "sdpa"):
        family = None                        # eager attention keeps a*s scores per token: measured instead
    if family in ("llama", "gemma", "phi") and any(
            (_get(config, n, default=0) or 0) > 0 for n in ("attention_dropout", "resid_pdrop", "embd_pdrop")):
        family = None                        # dropout in a family whose formula has none: measured instead
    if getattr(config, "vocab_size", None) is None:
        raise ValueError(f"config of model_type {mt!r} has no vocab_size: lk.estimate covers language models "
                         "(causal LM, masked LM, encoder-decoder), not vision or multi-modal configs "
                         "(for CLIP-like configs pass config.text_config)")
    _check_sizes(lambda name: getattr(config, name, None), mt)
    h, a = _get(config, "hidden_size", "n_embd", "d_model"), _get(config, "num_attention_heads", "n_head", "num_heads")
    L = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    i = _get(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * h if h else None)
    d = _get(config, "head_dim", "d_kv", default=(h // a) if h and a else None)
    s = dict(family=family, model_type=mt, h=h, L=L, a=a, kv=_get(config, "num_key_value_heads", default=a), d=d,
             i=i, V=config.vocab_size, P=_get(config, "max_position_embeddings", "n_positions"),
             tied=bool(getattr(config, "tie_word_embeddings", True)), types=getattr(config, "type_vocab_size", 0),
             encoder=mt in ("bert",) or (family is None and _is_masked_lm(config)),
             enc_dec=bool(getattr(config, "is_encoder_decoder", False)), config=config)
    if mt in ("llama", "mistral", "qwen2", "gemma"):
        bias = bool(getattr(config, "attention_bias", False))
        s.update(qkv_bias=bias or mt == "qwen2", o_bias=bias and mt != "qwen2",
                 mlp_bias=bool(getattr(config, "mlp_bias", False)))
    s["window"] = getattr(config, "sliding_window", None) if mt in ("mistral", "qwen2") else None
    if s["window"] and getattr(config, "layer_types", None):
        s["sliding_layers"] = sum(t == "sliding_attention" for t in config.layer_types)
    else:
        s["sliding_layers"] = L if s["window"] else 0
    if family == "gpt2":
        s.update(p_resid=config.resid_pdrop, p_attn=config.attn_pdrop, p_embd=config.embd_pdrop)
    elif family == "bert":
        s.update(p_resid=config.hidden_dropout_prob, p_attn=config.attention_probs_dropout_prob,
                 p_embd=config.hidden_dropout_prob)
    elif family == "opt":
        s.update(p_resid=config.dropout, p_attn=config.attention_dropout, p_embd=config.dropout,
                 p_act=getattr(config, "activation_dropout", 0.0), wpe=config.word_embed_proj_dim)
    elif family is not None:
        s.update(p_resid=_get(config, "resid_pdrop", default=0.0), p_attn=_get(config, "attention_dropout", default=0.0),
                 p_embd=_get(config, "embd_pdrop", default=0.0))
    return s


def _is_masked_lm(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return False
    return mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and (mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or mt != "gpt2")


def _model_class(config):
    """The head a training step needs: seq2seq LM, masked LM (encoders), causal LM, else the bare model."""
    import transformers as tf
    from transformers.models.auto import modeling_auto as ma
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False) and mt in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return tf.AutoModelForSeq2SeqLM
    if _is_masked_lm(config):
        return tf.AutoModelForMaskedLM
    if mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return tf.AutoModelForCausalLM
    return tf.AutoModel


# ---- parameters -------------------------------------------------------------------------------
def param_count(config):
    """Number of parameters of the architecture in `config`, counted from its shapes.

    Untied output layers and biases included. For a config without a formula: counted on the meta device.
    """
    s = _shape(config)
    h, i, L, V, a, d = s["h"], s["i"], s["L"], s["V"], s["a"], s["d"]
    fam = s["family"]
    if fam is None:
        model = _build(s["config"], "meta")
        return sum(p.numel() for p in model.parameters())
    untied = 0 if s["tied"] else V * h
    if fam in ("llama", "gemma"):
        q, kv = a * d, s["kv"] * d
        layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        layer += (q + 2 * kv) * s["qkv_bias"] + h * s["o_bias"] + (2 * i + h) * s["mlp_bias"]
        return V * h + L * layer + h + untied
    if fam == "phi":
        q, kv = a * d, s["kv"] * d
        layer = 2 * h + (h * q + q) + 2 * (h * kv + kv) + (q * h + h) + (h * i + i) + (i * h + h)
        return V * h + L * layer + 2 * h + (untied + V if not s["tied"] else 0)
    if fam == "gpt2":
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        return V * h + s["P"] * h + L * layer + 2 * h + untied
    if fam == "opt":
        c = s["config"]
        bias, affine = bool(c.enable_bias), bool(c.layer_norm_elementwise_affine)
        layer = 4 * (h * h + h * bias) + (h * i + i * bias) + (i * h + h * bias) + 4 * h * affine
        wpe = s["wpe"]
        proj = 2 * h * wpe if wpe != h else 0
        final = 2 * h * affine if not c._remove_final_layer_norm else 0
        return V * wpe + (s["P"] + 2) * h + L * layer + final + proj + (0 if s["tied"] else V * wpe)
    # BERT with the masked-LM head (BertForMaskedLM: no pooler; decoder tied, its bias V)
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    return (V + s["P"] + s["types"]) * h + 2 * h + L * layer + (h * h + h) + 2 * h + V + (untied and untied + V)


def _linear_params(s):
    """Parameters of the matmul weights (what autocast casts and caches): all but norms, biases, embeddings
    (the output layer's weight counts: it is a matmul, tied or not)."""
    h, i, L, V, a, d = s["h"], s["i"], s["L"], s["V"], s["a"], s["d"]
    fam = s["family"]
    if fam in ("llama", "gemma", "phi"):
        q, kv = a * d, s["kv"] * d
        mlp = 3 * h * i if fam != "phi" else 2 * h * i
        return L * (2 * h * q + 2 * h * kv + mlp) + V * h
    if fam == "gpt2":
        return L * (4 * h * h + 2 * h * i) + V * h
    if fam == "opt":
        return L * (4 * h * h + 2 * h * i) + V * s["wpe"] + (2 * h * s["wpe"] if s["wpe"] != h else 0)
    return L * (4 * h * h + 2 * h * i) + h * h + V * h      # BERT: the MLM head's dense and decoder


# ---- KV cache ---------------------------------------------------------------------------------
def kv_cache_bytes(config, batch, tokens, dtype="bf16", prefill=None, source_tokens=None):
    """KV cache: 2 (K and V) * layers * kv_heads * head_dim * bytes * batch * tokens.

    An encoder (BERT) has none. A sliding-window layer keeps at most `sliding_window` tokens once decoding
    has started; right after a prefill of `prefill` tokens it still holds all of them. An encoder-decoder
    (T5) holds the decoder's self-attention cache of `tokens` and the cross-attention cache of
    `source_tokens` encoder tokens (default: as many).
    """
    batch, tokens = _count("batch", batch, 1), _count("tokens", tokens, 0)
    s, e = _shape(config), _bytes(dtype, activations=True)
    if s["encoder"]:
        return 0
    c = s["config"]
    if s["enc_dec"]:
        L = _get(c, "num_decoder_layers", "decoder_layers", "num_layers")
        source = tokens if source_tokens is None else _count("source_tokens", source_tokens, 0)
        return 2 * L * s["a"] * s["d"] * e * batch * (tokens + source)
    per_token = 2 * s["kv"] * s["d"] * e * batch
    full = s["L"] - s["sliding_layers"]
    if s["sliding_layers"]:
        held = tokens if prefill is not None and tokens <= prefill else min(tokens, s["window"])
        return per_token * (full * tokens + s["sliding_layers"] * held)
    return per_token * s["L"] * tokens


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
    w = param_count(config) * _bytes(dtype) if weights is None else weights
    per_token = kv_cache_bytes(config, 1, 1, dtype)
    if per_token == 0:
        raise ValueError(f"config of model_type {load_config(config).model_type!r} has no KV cache")
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


# ---- activations ------------------------------------------------------------------------------
def _bytes(dtype, activations=False):
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype][activations]


def _count(name, value, minimum):
    """An int >= minimum (numpy integers welcome), else a ValueError naming the argument."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}") from None
    if n < minimum:
        word = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {word}, got {value!r}")
    return n


def _device_type(device):
    if device is None:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = str(device).split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return kind


def _layer_terms(s, seq, dtype, training=True, device="cpu"):
    """(bytes per token of one layer, the attention-score part of it) for a family with a formula."""
    e, h, i, a, d = _bytes(dtype, activations=True), s["h"], s["i"], s["a"], s["d"]
    q, kv, fam, amp = a * d, s["kv"] * d, s["family"], dtype.startswith("amp")
    m = (e if device == "cpu" else 1) if training else 0        # a dropout mask element
    drop = lambda p: bool(training and p and p > 0)
    # Attention: SDPA's flash kernel keeps q, k, v, its output (4eh, o's input too) and a log-sum-exp (4a).
    # With dropout on the attention probabilities a CPU runs SDPA's math kernel instead, in fp32 whatever
    # the dtype: q, k and v copies (12h), 3 score tensors (scores, dropout noise, dropped: 12as) and a
    # contiguous copy of the output for the next matmul (eh).
    math = drop(s.get("p_attn")) and device == "cpu"
    scores = 12 * a * seq if math else 0
    attn = 12 * q + scores + e * h if math else e * 4 * h + 4 * a
    stats = 4 * e               # two LayerNorms' mean and rstd, in the activations' dtype
    if fam == "llama" and s["window"] and seq > s["window"]:
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
        masks = 2 * m * h * drop(s["p_resid"])
        return e * 4 * h + stats + attn + 5 * e * i + masks, scores
    if fam == "bert":
        masks = 2 * m * h * drop(s["p_resid"])
        return e * 4 * h + stats + attn + 2 * e * i + masks, scores
    if fam == "opt":
        masks = 2 * m * h * drop(s["p_resid"]) + m * i * drop(s["p_act"])
        return e * 4 * h + stats + attn + e * i + masks, scores
    raise AssertionError(fam)


def _head_terms(s, dtype, training=True, device="cpu"):
    """(bytes per token of the head kept for backward without the logits, the logits' bytes per token)."""
    e, h, V, fam = _bytes(dtype, activations=True), s["h"], s["V"], s["family"]
    amp = dtype.startswith("amp")
    m = (e if device == "cpu" else 1) if training else 0
    embd = m * h if training and s.get("p_embd") else 0
    norm = {"llama": (8 * h + e * h) if amp else (4 * h + 2 * e * h), "gemma": 8 * h + e * h}.get(fam, 2 * e * h + 2 * e)
    if fam == "bert":            # MLM transform: dense's input, GELU's input, its LayerNorm; embeddings' LayerNorm
        norm = 4 * e * h + 2 * e + e * h + 2 * e
    if fam == "opt" and s["wpe"] != h:
        norm += e * h
    return norm + embd + _loss_bytes(s, dtype) * V, e * V


def _loss_bytes(s, dtype):
    """Bytes per element of the log-softmax cross-entropy saves: transformers' causal-LM loss upcasts the
    logits to fp32; BERT's masked-LM head calls CrossEntropyLoss on the logits in their own dtype."""
    return _bytes(dtype, activations=True) if s["family"] == "bert" else 4


def _mask_bytes(s, seq, dtype):
    """Per token: the (b, 1, s, s) additive mask that a sliding window shorter than seq needs (one for all layers)."""
    if s["family"] == "llama" and s["window"] and seq > s["window"]:
        return _bytes(dtype, activations=True) * seq
    return 0


def activation_bytes_per_token(config, seq, dtype="bf16", recompute=False, device=None):
    """Bytes of activations that one layer keeps for backward, per token (see the module docstring)."""
    s, e = _shape(config), _bytes(dtype, activations=True)
    if s["family"] is None:
        raise ValueError(f"no formula for model_type {s['model_type']!r}; lk.estimate measures it on fake tensors")
    if recompute is True:
        return (4 if dtype.startswith("amp") else e) * s["h"]    # the layer's input (fp32 under autocast)
    layer, scores = _layer_terms(s, seq, dtype, device=_device_type(device))
    return layer - scores if recompute == "selective" else layer


# ---- the estimate -----------------------------------------------------------------------------
def estimate(config, batch=1, seq=512, dtype="bf16", optimizer="adamw", training=True, recompute=False,
             kv_tokens=None, foreach=False, logits_to_keep=None, grad_accum=False, device=None,
             method="auto", max_positions=None, dp=1, zero=0, tp=1, pp=1, offload=None):
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
    FakeTensorMode tensors: takes seconds; exact where tests/test_edges_estimate.py shows it).
    max_positions: allow seq + generated tokens beyond config.max_position_embeddings up to this number.
    dp, zero, tp, pp: the memory of one rank when training on dp x tp x pp devices (batch is then the
    micro-batch of one data-parallel rank). zero: the ZeRO stage over the dp ranks (Rajbhandari et al.
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
    grad_accum and dtype="mixed" on the fake path: the step is measured (in bf16 for "mixed") and the fp32
    buffer (4 bytes/param, alive across steps) and fp32 master weights + Adam state (12 bytes/param in
    place of the measured bf16 state) are added by formula, as a note says.
    """
    batch, seq = _count("batch", batch, 1), _count("seq", seq, 1)
    kv_tokens = seq if kv_tokens is None else _count("kv_tokens", kv_tokens, 0)
    training, foreach, grad_accum = (_flag(n, v) for n, v in (("training", training), ("foreach", foreach),
                                                              ("grad_accum", grad_accum)))
    if not (isinstance(recompute, bool) or recompute == "selective" or isinstance(recompute, int) and recompute >= 1):
        raise ValueError(f"recompute must be True, False, 'selective' or a segment length >= 1, got {recompute!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if logits_to_keep is not None:
        logits_to_keep = _count("logits_to_keep", logits_to_keep, 0)
    if training and logits_to_keep is not None:
        raise ValueError(f"logits_to_keep is for inference (training=False): a training step keeps every "
                         f"position's logits for the loss, got logits_to_keep={logits_to_keep!r} with training=True")
    if method not in ("auto", "formula", "fake"):
        raise ValueError(f"method must be 'auto', 'formula' or 'fake', got {method!r}")
    _bytes(dtype)
    parallel = _parallel(dp, zero, tp, pp)
    if offload not in (None, "optimizer", "parameters"):
        raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {offload!r}")
    if offload and not training:
        raise ValueError(f"offload moves training state to the CPU; for inference use offload=None, got {offload!r}")
    if offload == "parameters" and zero != 3:
        raise ValueError(f"offload='parameters' offloads the weight partitions of ZeRO-3 (FSDP); use zero=3, got zero={zero!r}")
    parallel["offload"] = offload
    if zero and not training:
        raise ValueError(f"zero shards training state; for inference (training=False) use zero=0, got zero={zero!r}")
    if not training and dtype.startswith("amp"):
        raise ValueError(f"dtype {dtype!r} is for training; for inference use 'bf16' or 'fp16'")
    config = load_config(config)
    s = _shape(config)
    _check_layout(s, parallel)
    longest = max(seq, kv_tokens)
    limit = s["P"] if max_positions is None else max_positions
    if limit is not None and longest > limit and not s["enc_dec"]:
        name = "seq" if seq >= kv_tokens else "kv_tokens"
        raise ValueError(f"{name} must be <= max_position_embeddings {s['P']} of this config, got {longest} "
                         f"(pass max_positions={longest} to estimate beyond it anyway)")
    device = _device_type(device)
    formula_ok = s["family"] is not None and not (dtype.startswith("amp") and s["family"] != "llama")
    if method == "formula" and not formula_ok:
        raise ValueError(f"no formula for model_type {s['model_type']!r} with dtype {dtype!r}; use method='fake'")
    if method == "fake" or not formula_ok:
        est = _measure(config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                       logits_to_keep, grad_accum)
    elif training:
        est = _train(s, batch, seq, dtype, optimizer, recompute, foreach, grad_accum, device, parallel)
    else:
        est = _infer(s, batch, seq, dtype, kv_tokens, 1 if logits_to_keep is None else logits_to_keep)
    if est.method == "fake" or not training:
        est = _per_rank(est, parallel, _bytes(dtype), grad_accum)
    return est


def _parallel(dp, zero, tp, pp):
    """The degrees of parallelism, checked: {"dp", "zero", "tp", "pp"}."""
    out = {name: _count(name, value, 1) for name, value in (("dp", dp), ("tp", tp), ("pp", pp))}
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES} (the ZeRO stage), got {zero!r}")
    out["zero"] = zero
    return out


def _flag(name, value):
    """A bool (numpy's too), else a ValueError: the string "False" is truthy and would mean True."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _check_layout(s, parallel):
    """Refuse a tp x pp layout that cannot exist for this model; note the KV heads each tp rank holds.

    Every tp rank holds whole attention heads, so tp must divide num_attention_heads. With tp at most
    the KV heads, tp must divide them too (each rank holds kv/tp); with tp above them, each rank holds
    one KV head, replicated tp/kv times, so kv must divide tp (Megatron-LM's and vLLM's rule:
    vllm/model_executor/layers/linear.py QKVParallelLinear). pp stages hold whole layers: pp <= layers.
    """
    tp, pp, a, kv, L = parallel["tp"], parallel["pp"], s["a"], s["kv"], s["L"]
    if tp > 1 and a and a % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads {a} (each rank holds whole heads)")
    if tp > 1 and kv and (kv % tp if tp <= kv else tp % kv):
        raise ValueError(f"tp={tp} and num_key_value_heads {kv}: one must divide the other (each rank holds "
                         f"{'kv/tp' if tp <= kv else 'one'} KV head{'s' if tp <= kv else ', replicated'})")
    if pp > 1 and L and pp > L:
        raise ValueError(f"pp={pp} is more pipeline stages than num_hidden_layers {L} (a stage holds whole layers)")
    if kv:
        parallel["kv_heads"], parallel["kv_heads_per_rank"] = kv, max(1, kv // tp)


def _divisors(parallel):
    """What each category is divided by on one rank (a KV cache replicated when tp > kv heads)."""
    from fractions import Fraction
    mp, dp, z = parallel["tp"] * parallel["pp"], parallel["dp"], parallel["zero"]
    kv, per_rank = parallel.get("kv_heads"), parallel.get("kv_heads_per_rank")
    cache = Fraction(kv * parallel["pp"], per_rank) if kv and per_rank else mp
    return {"parameters": mp * (dp if z >= 3 else 1), "gradients": mp * (dp if z >= 2 else 1),
            "optimizer": mp * (dp if z >= 1 else 1), "activations": parallel["tp"],
            "kv_cache": cache, "other": parallel["tp"]}


def _shard(moment, parallel, phase=""):
    """One moment's bytes per category on one rank. Inside step() "other" is the optimizer's temporaries,
    sharded as its state; elsewhere it is the loss gradient, split over the vocabulary by tp."""
    div = _divisors(parallel)
    if phase == "optimizer step":
        div["other"] = div["optimizer"]
    return {c: -(-v // div[c]) for c, v in moment.items()}


def _per_rank(est, parallel, w=2, grad_accum=False):
    """An estimate made for one device, divided as `_shard` says (the measured and inference paths), with
    ZeRO-3's gathered layer and what `offload` moves to the host."""
    if all(parallel[k] == 1 for k in ("dp", "tp", "pp")) and not parallel["zero"] and not parallel.get("offload"):
        return est
    before = max(sum(est.peak_parts.values()), 1)
    if parallel["zero"] >= 3 and grad_accum:     # the fp32 partition alone: no w-byte gradient partition
        est.parts["gradients"] -= min(est.parts["gradients"], w * est.params)
        if est.phase == "optimizer step":        # the only moment that holds every w-byte gradient
            est.peak_parts["gradients"] -= min(est.peak_parts["gradients"], w * est.params)
    est.parts = _shard(est.parts, parallel)
    est.peak_parts = _shard(est.peak_parts, parallel, est.phase)
    gathered = _gathered(est.largest_layer, w, parallel)
    est.parts, est.host = _offload(est.parts, parallel, gathered, gathered)
    in_step = est.phase == "optimizer step"
    est.peak_parts, _ = _offload(est.peak_parts, parallel, 0 if in_step else gathered, 0 if in_step else gathered,
                                 est.phase)
    est.total = sum(est.peak_parts.values())
    scale = est.total / before
    est.first_step, est.steady = int(est.first_step * scale), int(est.steady * scale)
    est.parallel = dict(parallel)
    est.notes.append(_parallel_note(parallel))
    return est


def _gathered(largest, w, parallel):
    """ZeRO-3: the largest module's weights gathered whole on every rank while it runs (its tp share)."""
    return -(-w * largest // parallel["tp"]) if parallel["zero"] >= 3 else 0


def _offload(moment, parallel, weights_gathered, grads_gathered, phase=""):
    """(what one rank's device holds, what its CPU holds) for one moment: ZeRO-3's gathered layer added,
    then `offload`'s categories moved to the host (the gathered buffers stay on the device)."""
    out, host, where = dict(moment), {}, parallel.get("offload")
    moved = {"optimizer": ("optimizer",) + (("gradients",) if parallel["zero"] >= 2 else ()),
             "parameters": ("optimizer", "gradients", "parameters")}.get(where, ())
    for c in moved:
        host[c], out[c] = out[c], 0
    if where and phase == "optimizer step":      # the step runs on the CPU: its temporaries are there
        host["other"], out["other"] = out.get("other", 0), 0
    out["parameters"] += weights_gathered
    out["gradients"] += grads_gathered
    return out, host


def _parallel_note(parallel):
    where = parallel.get("offload")
    return (f"per rank of dp={parallel['dp']} x tp={parallel['tp']} x pp={parallel['pp']}, "
            f"ZeRO stage {parallel['zero']}" + (f", {where} offloaded to CPU memory (est.host)" if where else ""))


def model_states(params, dp=1, zero=0, dtype="mixed", optimizer="adamw", tp=1, pp=1, grad_accum=False):
    """Bytes per rank of weights, gradients and optimizer state: {"parameters", "gradients", "optimizer"}.

    params: a parameter count or a config (anything `estimate` takes). With dtype="mixed" and AdamW
    (K = 12) the ZeRO paper's Fig. 1: DDP 16 bytes/param, ZeRO-1 2 + 2 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3
    16/N (N = dp); 7.5B params on 64 ranks: 120 GB -> 31.4 / 16.6 / 1.9 GB.
    """
    P = params if isinstance(params, int) and not isinstance(params, bool) else param_count(params)
    _count("params", P, 1)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    _bytes(dtype)
    parallel = _parallel(dp, zero, tp, pp)
    w, g, o = _states(P, dtype, optimizer, grad_accum, zero)
    return _shard({"parameters": w, "gradients": g, "optimizer": o}, parallel)


CATS = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")


def _states(P, dtype, optimizer, grad_accum, zero=0):
    w = _bytes(dtype)
    if zero >= 3 and grad_accum:      # reduce-scatter writes into the fp32 partition: no w-byte one beside it
        return P * w, 4 * P, _states(P, dtype, optimizer, False)[2]
    state = {"sgd": 0, "sgd-momentum": w, "adam": 2 * w, "adamw": 2 * w, "adamw-8bit": 2 + 8 / 256, None: 0}
    opt = int(P * state[optimizer])
    if dtype == "mixed":       # fp32 master weights (4) + the optimizer's state kept in fp32
        fp32_state = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8, "adamw-8bit": 2 + 8 / 256, None: 0}
        opt = int(P * (4 + fp32_state[optimizer]))
    return P * w, P * w + 4 * P * bool(grad_accum), opt


def _train(s, batch, seq, dtype, optimizer, recompute, foreach, grad_accum, device, parallel=None):
    P, w, e = param_count(s["config"]), _bytes(dtype), _bytes(dtype, activations=True)
    amp, tokens, L = dtype.startswith("amp"), batch * seq, s["L"]
    parts = dict.fromkeys(CATS, 0)
    zero = (parallel or {}).get("zero", 0)
    parts["parameters"], parts["gradients"], parts["optimizer"] = _states(P, dtype, optimizer, grad_accum, zero)
    accum = 4 * P * bool(grad_accum)          # the buffer lives across steps
    layer, scores = _layer_terms(s, seq, dtype, device=device)
    head, logits = _head_terms(s, dtype, device=device)
    head += _mask_bytes(s, seq, dtype)
    if recompute == "selective":
        layer -= scores
    if recompute is True or (not isinstance(recompute, bool) and isinstance(recompute, int)):
        k = 1 if recompute is True else min(recompute, L)
        inp = activation_bytes_per_token(s["config"], seq, dtype, recompute=True)
        held, recomputed = -(-L // k) * inp, k * layer
    else:
        k, held, recomputed = 0, L * layer, 0
    cache = e * _linear_params(s) if amp else 0     # autocast's 16-bit weight copies, kept through backward
    parts["activations"] = int(tokens * (held + max(head + logits, recomputed)) + cache)
    largest = max(s["V"] * s["h"], s["h"] * s["i"]) * w
    step_temp = 0 if optimizer in ("sgd", "sgd-momentum", "adamw-8bit", None) else (P * w if foreach else 2 * largest)
    # at the start of backward the loss gradient (8V per token, fp32) is live and the logits are gone
    backward = dict(parts, gradients=accum, activations=int(tokens * (held + head) + cache), other=tokens * 2 * _loss_bytes(s, dtype) * s["V"])
    step = dict(parts, activations=0, other=step_temp)
    moments = {"start of backward": backward, "optimizer step": step}
    if k:                      # recomputing the top segment (few gradients yet) or the bottom one (most)
        layer_params = (P - s["V"] * s["h"] * (1 if s["tied"] else 2) - s["h"]) // L
        moments["recomputation"] = max(
            [dict(parts, gradients=accum + w * s["V"] * s["h"] * (not s["tied"]), other=0,
                  activations=int(tokens * (held + recomputed) + cache)),
             dict(parts, gradients=parts["gradients"] - w * (k * layer_params + s["V"] * s["h"]), other=0,
                  activations=int(tokens * (inp + recomputed) + cache))], key=lambda p: sum(p.values()))
    notes, host, largest = [], {}, _largest_layer(s)
    if parallel is not None and (parallel["zero"] or parallel.get("offload")
                                 or any(parallel[k] > 1 for k in ("dp", "tp", "pp"))):
        gathered = _gathered(largest, w, parallel)
        moments = {n: _offload(_shard(p, parallel, n), parallel, 0 if n == "optimizer step" else gathered,
                               0 if n == "optimizer step" else gathered, n)[0] for n, p in moments.items()}
        parts, host = _offload(_shard(parts, parallel), parallel, gathered, gathered)
        notes.append(_parallel_note(parallel))
    first = {n: dict(p, optimizer=0) if n != "optimizer step" else p for n, p in moments.items()}
    phase, peak = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    parts["other"] = peak["other"]
    if dtype == "mixed" or optimizer == "adamw-8bit":
        notes.append("first step: the optimizer state is born in step(), as later steps hold it")
    return Estimate(parts=parts, total=sum(peak.values()), peak_parts=peak, params=P, notes=notes,
                    method="formula", phase=phase, first_step=max(sum(p.values()) for p in first.values()),
                    steady=sum(peak.values()), parallel=dict(parallel or {}), host=host, largest_layer=largest)


def _largest_layer(s):
    """Parameters of the largest single module (its own, not its children's), as DeepSpeed's model_to_params
    counts them: usually the embedding or the LM head (vocab x hidden), else an MLP projection."""
    h, i, V, a, d, fam = s["h"], s["i"], s["V"], s["a"], s["d"], s["family"]
    if fam is None:
        model = _build(s["config"], "meta")
        return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    q, kv = a * d, s["kv"] * d
    if fam in ("llama", "gemma"):
        return max(V * h, h * i + i * s["mlp_bias"], h * q + q * s["qkv_bias"], q * h + h * s["o_bias"],
                   h * kv + kv * s["qkv_bias"])
    if fam == "phi":
        return max(V * h + V * (not s["tied"]), h * i + i, h * q + q)
    if fam == "gpt2":
        return max(V * h, s["P"] * h, 3 * h * h + 3 * h, h * i + i)
    if fam == "opt":
        return max(V * s["wpe"], (s["P"] + 2) * h, h * i + i)
    return max(V * h + V, s["P"] * h, h * i + i)             # BERT: the MLM decoder holds its bias


def _infer(s, batch, seq, dtype, kv_tokens, logits_to_keep):
    P, w, e = param_count(s["config"]), _bytes(dtype), _bytes(dtype, activations=True)
    tokens, h, V = batch * seq, s["h"], s["V"]
    parts = dict.fromkeys(CATS, 0)
    parts["parameters"] = P * w
    parts["kv_cache"] = kv_cache_bytes(s["config"], batch, kv_tokens, dtype, prefill=seq)
    # The largest no-grad transient, per token, measured op by op (track) at tiny size: gelu_new (GPT-2) is a
    # chain of elementwise ops with up to five i-wide tensors live; Phi's parallel block keeps four beside
    # attention's output; OPT's ReLU one; SwiGLU/GeGLU three beside the stream, q and k/v.
    i = s["i"]
    mlp = {"gpt2": 5 * i + 2 * h, "phi": 4 * i + 4 * h, "opt": i + 8 * h,
           "bert": 2 * i + 4 * h}.get(s["family"], 3 * i + 4 * h + s["kv"] * s["d"])
    prefill = tokens * e * mlp
    if s["encoder"]:             # an encoder's forward returns every position's logits
        logits_to_keep = 0
    kept = seq if logits_to_keep == 0 or logits_to_keep > seq else logits_to_keep
    # the logits of the kept positions; generate copies the last one to fp32
    head = batch * kept * V * e + (batch * V * 4 if logits_to_keep else 0) + tokens * e * h * (2 if s["encoder"] else 1)
    kv_prefill = kv_cache_bytes(s["config"], batch, seq if not s["encoder"] and kv_tokens else 0, dtype, prefill=seq)
    moments = {"prefill": dict(parts, kv_cache=kv_prefill, activations=prefill),
               "logits": dict(parts, kv_cache=kv_prefill, activations=head)}
    if kv_tokens > seq:
        moments["decode"] = dict(parts, activations=batch * (V * (e + 4) + e * (3 * s["i"] + 4 * h)))
    phase, peak = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    parts["activations"] = max(prefill, head)
    total = sum(peak.values())
    return Estimate(parts=parts, total=total, peak_parts=peak, params=P, method="formula", phase=phase,
                    first_step=total, steady=total)


def _build(config, device, dtype=None):
    """The model for `config` with the head a step needs, on "meta" or on FakeTensorMode ("fake")."""
    import torch
    cls = _model_class(config)
    dtype = dtype or torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if device == "meta":
            with torch.device("meta"):
                return cls.from_config(config)
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = cls.from_config(config)
        model.fake_mode = mode
        return model
    finally:
        torch.set_default_dtype(old)


def _measure(config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach, logits_to_keep,
             grad_accum):
    """The estimate by measurement: a real step of the model on FakeTensorMode tensors, followed by track()."""
    import torch
    from .memory import track
    if optimizer == "adamw-8bit":
        raise ValueError(f"no fake-tensor measurement for optimizer {optimizer!r} (model_type "
                         f"{config.model_type!r} has no formula); use 'adamw' or a family with a formula")
    if dtype == "mixed" and optimizer not in ("adam", "adamw", None, "sgd", "sgd-momentum"):
        raise ValueError(f"no fake-tensor measurement for dtype 'mixed' with optimizer {optimizer!r}")
    if recompute not in (False, True):
        raise ValueError(f"recompute={recompute!r} has no fake-tensor measurement; use True or False "
                         f"(model_type {config.model_type!r} has no formula)")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "mixed": torch.bfloat16}.get(dtype, torch.float32)
    model = _build(config, "fake", torch_dtype)
    with _fake_friendly_moe():
        first, mem = _measure_model(model, config, batch, seq, "bf16" if dtype == "mixed" else dtype, optimizer,
                                    training, recompute, kv_tokens, foreach, logits_to_keep)
    est = _from_trackers(model, config, first, mem)
    est.largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    if training:
        _add_states_by_formula(est, dtype, optimizer, grad_accum)
    return est


def _add_states_by_formula(est, dtype, optimizer, grad_accum):
    """What the fake step cannot run, added to a measured training step by formula: dtype="mixed" (measured
    in bf16; its optimizer state becomes fp32 master weights + fp32 state, `_states`) and grad_accum's fp32
    buffer (4 bytes/param, alive through every moment of every step)."""
    P = est.params
    extra_opt = _states(P, dtype, optimizer, False)[2] - _states(P, "bf16", optimizer, False)[2] if dtype == "mixed" else 0
    extra_grad = 4 * P if grad_accum else 0
    if not (extra_opt or extra_grad):
        return
    est.parts["optimizer"] += extra_opt
    est.parts["gradients"] += extra_grad
    est.peak_parts["gradients"] += extra_grad
    est.peak_parts["optimizer"] += extra_opt     # the steady peak holds the state
    est.steady += extra_opt + extra_grad
    est.first_step += extra_grad + (extra_opt if est.phase == "optimizer step" else 0)
    est.total = max(est.first_step, est.steady)
    est.notes.append("added by formula to the measured step: " + ", ".join(
        x for x in (f"fp32 master weights and state for 'mixed' (+{fmt_bytes(extra_opt)})" if extra_opt else "",
                    f"grad_accum's fp32 buffer (+{fmt_bytes(extra_grad)})" if extra_grad else "") if x))


@contextlib.contextmanager
def _patched(module_name, attr, replacement):
    """module.attr replaced while the block runs (nothing done if the module or the name does not exist)."""
    import importlib
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        module = None
    if module is None or not hasattr(module, attr):
        yield
        return
    old = getattr(module, attr)
    setattr(module, attr, replacement)
    try:
        yield
    finally:
        setattr(module, attr, old)


@contextlib.contextmanager
def _fake_friendly_moe():
    """What a fake step must not inherit from transformers' checks for tracing (is_tracing() is True on a
    FakeTensor), each patched only while measuring:
    - MoE experts call torch's grouped_mm, whose fake kernel accepts bf16 only; transformers' own fallback
      op (same output, same saved tensors) has a fake kernel for every dtype: use it.
    - masking_utils.find_packed_sequence_indices cannot read the position ids of a fake tensor, so it
      assumes packed sequences: every layer then gets a (b, 1, s, s) mask and SDPA K/V expanded to all
      heads, which a real step with one sequence per row never has. Our step packs nothing: say so (None).
    """
    with _patched("transformers.integrations.moe", "_can_use_grouped_mm", lambda *a, **k: False), \
            _patched("transformers.masking_utils", "find_packed_sequence_indices", lambda position_ids: None):
        yield


@contextlib.contextmanager
def _quiet():
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


def _measure_model(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                   logits_to_keep, ids=None):
    with _quiet():
        return _measure_model_quietly(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens,
                                      foreach, logits_to_keep, ids)


def _measure_model_quietly(model, config, batch, seq, dtype, optimizer, training, recompute, kv_tokens, foreach,
                           logits_to_keep, ids=None):
    import torch
    from .memory import track
    enc_dec, masked = bool(getattr(config, "is_encoder_decoder", False)), _is_masked_lm(config)
    with getattr(model, "fake_mode", contextlib.nullcontext()):
        ids = torch.zeros(batch, seq, dtype=torch.long) if ids is None else ids
        if training:
            model.train()
            if recompute:
                model.gradient_checkpointing_enable({"use_reentrant": False})
            make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1),
                    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                    "adam": lambda p: torch.optim.Adam(p, foreach=foreach),
                    "adamw": lambda p: torch.optim.AdamW(p, foreach=foreach), None: None}[optimizer]
            opt = make(model.parameters()) if make else None
            amp = torch.autocast(ids.device.type, dtype={"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}[dtype]) \
                if dtype.startswith("amp") else contextlib.nullcontext()

            def step():
                with amp:
                    kw = dict(labels=ids) if masked else dict(labels=ids, use_cache=False)
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

            objs = (model, opt) if opt is not None else (model,)
            with track(*objs) as first:
                step()
            with track(*objs) as mem:
                step()
        else:
            model.eval()
            first = mem = _measure_inference(model, ids, kv_tokens, logits_to_keep, enc_dec, masked, max_steps=3)
    return first, mem


def _from_trackers(model, config, first, mem):
    """An Estimate from the trackers of a measured first and later step."""
    parts = dict(mem.max_parts)
    if any(t == "forward end" for _, t in mem.marks) and mem.max_parts["optimizer"] + mem.max_parts["gradients"]:
        parts["activations"] = mem.at("forward end")["activations"]    # what the formulas call activations
    peak = mem.peak_parts
    parts["other"] = peak["other"]
    notes = [f"measured on fake tensors: {config.model_type} has no formula here"]
    total, phase = mem.peak, _phase_of(mem)
    if not (mem.max_parts["optimizer"] + mem.max_parts["gradients"]):
        parts["kv_cache"] = mem.at("end")["kv_cache"]          # the cache that stays, as the formulas count it
        left, growth = getattr(mem, "unrun", (0, 0))
        if left:                 # the first decoding steps were run; the rest add `growth` bytes of cache each
            import numpy as np
            tl = mem.timeline
            start = next(i for i, t in mem.marks if t == "decode")
            i = start + int(np.argmax(tl["total"][start:]))
            decode = {c: int(tl[c][i]) for c in CATS}
            decode["kv_cache"] += left * growth
            parts["kv_cache"] += left * growth
            if sum(decode.values()) > total:
                total, peak, phase = sum(decode.values()), decode, "decode"
            notes.append(f"the last {left} decoding steps extrapolated: +{fmt_bytes(growth)} of cache each")
    P = sum(p.numel() for p in model.parameters())
    total = max(total, first.peak) if first is not mem else total
    return Estimate(parts=parts, total=total, peak_parts=peak, params=P, method="fake",
                    phase=phase, first_step=first.peak if first is not mem else total,
                    steady=mem.peak if first is not mem else total, notes=notes)


def _phase_of(mem):
    """The name of the moment holding the peak, from the tracker's marks."""
    import numpy as np
    i = int(np.argmax(mem.timeline["total"]))
    before = [t for j, t in mem.marks if j <= i]
    if "step" in before and "step end" not in before[before.index("step"):]:
        return "optimizer step"
    for mark, phase in (("decode", "decode"), ("prefill", "prefill"), ("backward", "start of backward"),
                        ("forward end", "loss"), ("forward", "forward")):
        if mark in before:
            if phase == "start of backward" and [t for t in before if t == "forward"][1:]:
                return "recomputation"
            return phase
    return "start"


def _measure_inference(model, ids, kv_tokens, logits_to_keep, enc_dec, masked, max_steps=None):
    """generate's memory without generate (it reads data): a prefill, then greedy decoding steps."""
    import inspect
    import torch
    from .memory import track
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
            sizes.append(_storage_bytes(cache))
        if cache is not None:
            mem.label(cache, "kv_cache")
    # decoding steps not run: the cache grows by the last measured step's growth each (a sliding window
    # that caps it later is over-counted: conservative)
    mem.unrun = (steps - run, sizes[-1] - sizes[-2] if len(sizes) > 1 else 0)
    return mem


def _storage_bytes(obj):
    from .memory import _tensors
    seen = {}
    for t in _tensors(obj):
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


def measured(config, batch=2, seq=64, dtype="fp32", optimizer="adamw", training=True, new_tokens=4,
             logits_to_keep=1, foreach=False, device="cpu", seed=0):
    """The ground truth an estimate is checked against: `track()` around a real step of a model built
    from `config` with random weights on `device`.

    training: the second AdamW step (the first builds the optimizer state): returns (first, steady)
    trackers. Inference: `generate` with `new_tokens` greedy tokens (logits_to_keep=1) or one plain forward
    returning every position's logits (logits_to_keep=0); an encoder runs one forward. Returns (mem, mem).
    """
    import torch
    from .memory import track
    config = load_config(config)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)
    try:
        with torch.device(device):
            model = _model_class(config).from_config(config)
    finally:
        torch.set_default_dtype(old)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=gen).to(device)
    if training:
        return _measure_model(model, config, batch, seq, dtype, optimizer, True, False, seq, foreach, None, ids=ids)
    model.eval()
    masked, enc_dec = _is_masked_lm(config), bool(getattr(config, "is_encoder_decoder", False))
    if masked or logits_to_keep == 0 or enc_dec:
        mem = _measure_inference(model, ids, seq + new_tokens - 1 if enc_dec else seq, logits_to_keep, enc_dec, masked)
        return mem, mem
    with torch.no_grad(), _quiet(), track(model) as mem:
        mem.mark("prefill")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        mem.label(out["cache"] if "cache" in out else out.get("past_key_values"), "kv_cache")
    del out
    return mem, mem
