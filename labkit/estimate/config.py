"""What a config describes: the config itself (from a preset, a path or an object), the sizes the formulas
read (`model_shape`), and the model it builds (`model_class`, `build_model`). No torch at import."""
from __future__ import annotations

import json
import pathlib

from ..checks import count

__all__ = ["FAMILIES", "load_config", "model_shape", "model_class", "build_model", "is_masked_lm", "get",
           "check_lm_head"]

# model_type -> the family whose formula describes it
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "gemma": "gemma", "phi": "phi",
            "gpt2": "gpt2", "bert": "bert", "opt": "opt"}


def load_config(config):
    """A transformers config from a config object, a labkit preset or family name (lk.models.PRESETS,
    lk.models.FAMILY_CONFIGS; full size), or a path to a config.json (or a folder holding one)."""
    if isinstance(config, (str, pathlib.Path)):
        from ..models import FAMILY_CONFIGS, PRESETS, family_config
        from ..models import config as preset
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


def _check_sizes(size_of, model_type, where=""):
    """Every size a config gives must be an int >= 1: a negative width would give negative parameters.
    size_of(name): the config's value for `name`, or None."""
    for name in _SIZES:
        value = size_of(name)
        if value is not None:
            try:
                count(f"{where}config {name}", value)
            except ValueError as e:
                raise ValueError(f"{e} (model_type {model_type!r})") from None


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
        from huggingface_hub.errors import StrictDataclassClassValidationError as refused   # transformers 5's checks
    except ImportError:
        refused = ValueError
    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError, ArithmeticError, refused) as e:
        reason = " ".join(str(e.__cause__ or e).split())                   # one line, the field named
        raise ValueError(f"config file {str(path)!r}: transformers refuses it: {reason}") from None


def get(config, *names, default=None):
    """The first of `names` that `config` sets (not None), else `default`."""
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), default)


def model_shape(config):
    """The sizes the formulas read, from an HF config, as a dict (the `shape` every formula takes): h, L, a,
    kv (KV heads), d (head dim), i (MLP width), V (vocab), P (max positions), family (None when no formula
    covers the config), dropout probabilities, biases, the sliding window."""
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
            (get(config, n, default=0) or 0) > 0 for n in ("attention_dropout", "resid_pdrop", "embd_pdrop")):
        family = None                        # dropout in a family whose formula has none: measured instead
    if getattr(config, "vocab_size", None) is None:
        raise ValueError(f"config of model_type {mt!r} has no vocab_size: lk.estimate covers language models "
                         f"(causal LM, masked LM, encoder-decoder), not vision or multi-modal configs. {MEASURE_IT}")
    if family is None:
        check_lm_head(config)

    def size_of(name):
        return getattr(config, name, None)

    _check_sizes(size_of, mt)
    h, a = get(config, "hidden_size", "n_embd", "d_model"), get(config, "num_attention_heads", "n_head", "num_heads")
    L = get(config, "num_hidden_layers", "n_layer", "num_layers")
    i = get(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * h if h else None)
    d = get(config, "head_dim", "d_kv", default=(h // a) if h and a else None)
    shape = dict(family=family, model_type=mt, h=h, L=L, a=a, kv=get(config, "num_key_value_heads", default=a),
                 d=d, i=i, V=config.vocab_size, P=get(config, "max_position_embeddings", "n_positions"),
                 tied=bool(getattr(config, "tie_word_embeddings", True)), types=getattr(config, "type_vocab_size", 0),
                 encoder=mt in ("bert",) or (family is None and is_masked_lm(config)),
                 enc_dec=bool(getattr(config, "is_encoder_decoder", False)), config=config)
    if mt in ("llama", "mistral", "qwen2", "gemma"):
        bias = bool(getattr(config, "attention_bias", False))
        shape.update(qkv_bias=bias or mt == "qwen2", o_bias=bias and mt != "qwen2",
                     mlp_bias=bool(getattr(config, "mlp_bias", False)))
    shape["window"] = getattr(config, "sliding_window", None) if mt in ("mistral", "qwen2") else None
    if shape["window"] and getattr(config, "layer_types", None):
        shape["sliding_layers"] = sum(t == "sliding_attention" for t in config.layer_types)
    else:
        shape["sliding_layers"] = L if shape["window"] else 0
    if family == "gpt2":
        shape.update(p_resid=config.resid_pdrop, p_attn=config.attn_pdrop, p_embd=config.embd_pdrop)
    elif family == "bert":
        shape.update(p_resid=config.hidden_dropout_prob, p_attn=config.attention_probs_dropout_prob,
                     p_embd=config.hidden_dropout_prob)
    elif family == "opt":
        shape.update(p_resid=config.dropout, p_attn=config.attention_dropout, p_embd=config.dropout,
                     p_act=getattr(config, "activation_dropout", 0.0), wpe=config.word_embed_proj_dim)
    elif family is not None:
        shape.update(p_resid=get(config, "resid_pdrop", default=0.0),
                     p_attn=get(config, "attention_dropout", default=0.0), p_embd=get(config, "embd_pdrop", default=0.0))
    return shape


MEASURE_IT = ("Measure the model instead: build it (`model = transformers.AutoModel.from_config(config)`) and run "
              "your own step inside `with lk.track(model) as mem:`.")


def check_lm_head(config):
    """A ValueError (advice that works: build it, lk.track a step) unless transformers has a language-model head
    for `config`: a bare encoder such as CLIP's text tower (`clip_text_model`) gives no loss and no logits."""
    import transformers as tf
    if model_class(config) is tf.AutoModel:
        raise ValueError(f"config of model_type {config.model_type!r} has no language-model head in transformers "
                         f"(no loss, no logits to train or decode with): lk.estimate covers causal LMs, masked LMs "
                         f"and encoder-decoders. {MEASURE_IT}")


def is_masked_lm(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "is_decoder", False):
        return False
    return mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES and (mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or mt != "gpt2")


def model_class(config):
    """The head a training step needs: seq2seq LM, masked LM (encoders), causal LM, else the bare model."""
    import transformers as tf
    from transformers.models.auto import modeling_auto as ma
    mt = config.model_type
    if getattr(config, "is_encoder_decoder", False) and mt in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return tf.AutoModelForSeq2SeqLM
    if is_masked_lm(config):
        return tf.AutoModelForMaskedLM
    if mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return tf.AutoModelForCausalLM
    return tf.AutoModel


def build_model(config, device, dtype=None, attention=None):
    """The model for `config` with the head a step needs (`model_class`), its weights in `dtype` (default
    fp32), on `device`: "fake" (FakeTensorMode, the mode kept as model.fake_mode), "meta", or a real device
    ("cpu", "cuda": random weights). attention: the attn_implementation to build it with (default: the
    config's; transformers writes it into the config it is given, so a copy gets it)."""
    import copy
    import torch
    cls = model_class(config)
    kw = {}
    if attention is not None:
        config, kw = copy.deepcopy(config), {"attn_implementation": attention}
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        if device == "fake":
            from torch._subclasses.fake_tensor import FakeTensorMode
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with mode:
                model = cls.from_config(config, **kw)
            model.fake_mode = mode
            return model
        with torch.device(device):
            return cls.from_config(config, **kw)
    finally:
        torch.set_default_dtype(old)

