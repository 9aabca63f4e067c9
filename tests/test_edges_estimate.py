"""lk.estimate at its edges: impossible layouts, flags that are not bools, bad configs, the fake path exact."""
import json

import pytest
import transformers as tf

import labkit as lk
from labkit.estimate import measured


@pytest.mark.parametrize("kw, says", [
    (dict(tp=3), "tp=3 must divide num_attention_heads 32"),
    (dict(tp=64), "tp=64 must divide num_attention_heads 32"),
    (dict(pp=64), "pp=64 is more pipeline stages than num_hidden_layers 32"),
])
def test_a_layout_that_cannot_exist_is_refused(kw, says):
    with pytest.raises(ValueError, match=says):
        lk.estimate("llama-2-7b", 1, 512, "bf16", **kw)
    with pytest.raises(ValueError, match=says):
        lk.estimate("llama-2-7b", 1, 512, "bf16", training=False, **kw)


def test_tp_above_the_kv_heads_replicates_one_kv_head_per_rank():
    """llama-3-8b: 8 KV heads. tp=4 holds 2 per rank (1/4 of the cache); tp=8 and tp=16 hold one (1/8):
    the cache per rank never falls below one head's worth (vLLM's QKVParallelLinear replicates it)."""
    one = lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False).parts["kv_cache"]
    per_rank = {tp: lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False, tp=tp).parts["kv_cache"]
                for tp in (4, 8, 16, 32)}
    assert per_rank == {4: one // 4, 8: one // 8, 16: one // 8, 32: one // 8}
    assert lk.estimate("llama-3-8b", 1, 1024, "bf16", training=False, tp=16, pp=2).parts["kv_cache"] == one // 16
    cfg = lk.models.config("llama-3-8b", "full", num_key_value_heads=6, num_attention_heads=24, hidden_size=3072)
    with pytest.raises(ValueError, match="tp=4 and num_key_value_heads 6: one must divide the other"):
        lk.estimate(cfg, 1, 512, "bf16", tp=4)


@pytest.mark.parametrize("name", ["training", "foreach", "grad_accum"])
@pytest.mark.parametrize("bad", ["False", "True", 0, None])
def test_flags_must_be_bools(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be True or False, got {bad!r}"):
        lk.estimate("llama-2-7b", 1, 512, **{name: bad})


def test_logits_to_keep_is_refused_in_training():
    with pytest.raises(ValueError, match="logits_to_keep is for inference.*got logits_to_keep=1 with training=True"):
        lk.estimate("llama-2-7b", 1, 512, logits_to_keep=1)
    assert lk.estimate("llama-2-7b", 1, 512, training=False, logits_to_keep=0).total > 0


@pytest.mark.parametrize("field, value", [("hidden_size", -64), ("num_attention_heads", 0),
                                          ("num_hidden_layers", 0), ("vocab_size", -1), ("intermediate_size", 1.5)])
def test_a_config_with_a_size_below_one_is_refused_naming_the_field(tmp_path, field, value):
    data = json.loads(lk.models.config("llama-2-7b", "tiny").to_json_string())
    data[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"config {field} must be an int >= 1, got {value!r}"):
        lk.estimate(str(path), 1, 64)


def test_missing_paths_and_unknown_names_list_presets_and_families(tmp_path):
    for where in (str(tmp_path / "nowhere" / "config.json"), tmp_path / "nowhere", "models/mine.json"):
        with pytest.raises(FileNotFoundError, match=r"does not exist\. Presets: .*llama-2-7b.* Families: .*qwen2-7b"):
            lk.estimate(where)
    with pytest.raises(ValueError, match=r"config 'qwen-9b' is neither a preset.*Families: .*mixtral-8x7b"):
        lk.estimate("qwen-9b")


@pytest.mark.parametrize("text, says", [("{not json", "is not valid JSON: Expecting property name"),
                                        ("[1, 2]", "must hold a JSON object, got list"),
                                        ("42", "must hold a JSON object, got int"),
                                        ('{"hidden_size": 64}', "has no 'model_type'")])
def test_a_bad_config_json_names_the_file(tmp_path, text, says):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"config file '{path}'.*{says}"):
        lk.estimate(str(path))
    with pytest.raises(ValueError, match=says):
        lk.estimate(tmp_path)                     # the folder holding it


@pytest.mark.parametrize("cfg", [tf.ViTConfig(), tf.CLIPConfig()])
def test_a_vision_config_is_refused_clearly(cfg):
    with pytest.raises(ValueError, match=rf"model_type '{cfg.model_type}' has no vocab_size: lk.estimate covers language models"):
        lk.estimate(cfg)


def _qwen3_8b_shape():
    """Qwen3-8B's head layout (32 query heads, 8 KV heads), narrowed: 2 layers, head_dim 8, vocab 2048."""
    return tf.Qwen3Config(hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=8,
                          intermediate_size=768, vocab_size=2048, num_hidden_layers=2, max_position_embeddings=4096,
                          tie_word_embeddings=False)


@pytest.mark.parametrize("seq", [64, 2048])
def test_the_fake_path_is_exact_on_grouped_kv_at_tiny_and_2k_tokens(seq):
    """Qwen3 has no formula: the fake step equals a real CPU step to the byte. Without the patch of
    transformers' packed-sequence detection it over-counted by 21.5% at 2048 tokens (a (b,1,s,s) mask per
    layer and K/V expanded to all heads); at 64 tokens the peak is the optimizer step, where the same
    fault moved only the activations. Broken once: with the patch removed, 2048 tokens fails."""
    cfg = _qwen3_8b_shape()
    est = lk.estimate(cfg, 1, seq, "fp32", "adamw")
    first, steady = measured(cfg, 1, seq, "fp32", "adamw")
    assert est.method == "fake"
    assert est.steady == steady.peak
    # The first step: AdamW's 25 4-byte `step` counters are born at a different moment on fake tensors.
    assert abs(est.first_step - first.peak) <= 25 * 4
    assert est.parts["activations"] == steady.at("forward end")["activations"]


def test_the_fake_path_takes_mixed_and_grad_accum_and_adds_their_states_by_formula():
    """Qwen3 (no formula): "mixed" is measured in bf16, then the optimizer state becomes 12 bytes/param
    (fp32 master weights + Adam) in place of bf16 AdamW's 4; grad_accum adds 4 bytes/param of fp32 buffer
    to every moment. The README's ZeRO example then runs for any family."""
    cfg = _qwen3_8b_shape()
    bf16 = lk.estimate(cfg, 1, 64, "bf16", "adamw")
    mixed = lk.estimate(cfg, 1, 64, "mixed", "adamw", grad_accum=True)
    P = bf16.params
    assert mixed.method == "fake" and "added by formula" in mixed.notes[-1]
    assert mixed.parts["optimizer"] - bf16.parts["optimizer"] == (12 - 4) * P
    assert mixed.parts["gradients"] - bf16.parts["gradients"] == 4 * P
    assert mixed.steady - bf16.steady == (12 - 4 + 4) * P
    rank = lk.estimate(cfg, 1, 64, "mixed", "adamw", dp=8, zero=3, tp=2)
    # per rank: the state (with AdamW's measured step counters) over dp x tp = 16 ranks
    assert rank.method == "fake" and rank.parts["optimizer"] == -(-(bf16.parts["optimizer"] + 8 * P) // 16)
    with pytest.raises(ValueError, match="no fake-tensor measurement for optimizer 'adamw-8bit'"):
        lk.estimate(cfg, 1, 64, "bf16", "adamw-8bit")
