import json

import pytest
import torch

import labkit as lk


def test_tiny_presets_keep_their_architecture():
    for name in lk.models.PRESETS:
        tiny, full = lk.models.config(name, "tiny"), lk.models.config(name, "full")
        assert type(tiny) is type(full) and tiny.vocab_size == 4096
    cfg = lk.models.config("llama-2-70b", "tiny")
    assert cfg.num_attention_heads // cfg.num_key_value_heads == 8          # GQA ratio of the real 70B


def test_build_dtype_device_and_fake():
    m = lk.models.build("llama-2-7b", "tiny", dtype=torch.bfloat16)
    assert next(m.parameters()).dtype == torch.bfloat16
    big = lk.models.build("llama-2-70b", "full", device="fake")
    from torch._subclasses.fake_tensor import FakeTensor
    assert isinstance(big.model.embed_tokens.weight, FakeTensor)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(name="gpt-5"), ValueError, "name must be one of .*llama-2-7b.*'gpt-5'"),
    (dict(name="llama-2-7b", size="huge"), ValueError, "size must be 'tiny' or 'full', got 'huge'"),
    (dict(name="llama-2-7b", dtype="bf16"), TypeError, "dtype must be a floating torch.dtype"),
    (dict(name="llama-2-7b", device="tpu"), ValueError, "device must be 'cpu', 'cuda', 'meta' or 'fake', got 'tpu'"),
])
def test_build_bad_input(kwargs, error, message):
    with pytest.raises(error, match=message):
        lk.models.build(**kwargs)


def test_cache_of_reads_the_cache_under_either_name():
    """transformers 5.24 names generate()'s cache `cache`, 5.17 (the GPU image's) `past_key_values`."""
    assert lk.models.cache_of({"past_key_values": "old"}) == "old" and lk.models.cache_of({"cache": "new"}) == "new"
    model = lk.models.build("llama-2-7b", "tiny").eval()
    prompt = next(lk.data.batches(1, 8))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=2, min_new_tokens=2,
                         do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    assert lk.models.cache_of(out).get_seq_length() == 9            # the prompt and the first new token
    with pytest.raises(ValueError, match="no KV cache"):
        lk.models.cache_of({"sequences": prompt})


def test_minilm_is_pretrained_and_offline():
    model, tok = lk.models.minilm()
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    batch = tok(["memory is finite", "memory is limited", "bananas are yellow"], return_tensors="pt", padding=True)
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1)
    emb = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]                 # real weights know what words mean


def test_corpus_tokenizer_and_batches():
    assert len(lk.data.text()) == 1_000_000
    assert lk.data.tokenizer().get_vocab_size() == 4096
    b1 = list(lk.data.batches(3, 32, steps=2, seed=1))
    b2 = list(lk.data.batches(3, 32, steps=2, seed=1))
    assert len(b1) == 2 and b1[0].shape == (3, 32) and b1[0].dtype == torch.long
    assert all(torch.equal(x, y) for x, y in zip(b1, b2))
    assert int(b1[0].max()) < 4096
    hf = lk.data.hf_tokenizer()
    assert hf.decode(hf("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"


@pytest.mark.parametrize("kwargs, message", [(dict(batch=0, seq=8), "batch must be an int >= 1"),
                                             (dict(batch=1, seq=10**9), "seq must be shorter than"),
                                             (dict(batch=1, seq=8, split="test"), "split must be 'train' or 'val'")])
def test_batches_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        next(lk.data.batches(**kwargs))


def test_record_writes_json(tmp_path, monkeypatch):
    import labkit.records as rec
    monkeypatch.setattr(rec, "RECORDS_DIR", tmp_path)
    path = lk.record("99_test", peak_bytes=123, ratio=torch.tensor(1.5), note="hi")
    data = json.loads(path.read_text())
    assert data["figures"] == {"peak_bytes": 123, "ratio": 1.5, "note": "hi"} and data["size"] == lk.size()
    lk.record("99_test", more=1)
    assert set(json.loads(path.read_text())["figures"]) == {"peak_bytes", "ratio", "note", "more"}
    with pytest.raises(ValueError, match="notebook must be a name like"):
        lk.record("My Notebook", x=1)
    with pytest.raises(TypeError, match="figure x must be a number or a string"):
        lk.record("99_test", x=[1, 2])
    with pytest.raises(ValueError, match="at least one figure"):
        lk.record("99_test")


def test_calculator_widget_updates():
    calc = lk.widgets.calculator(preset="llama-2-7b", seq=1024)
    first = calc.estimate.total
    calc.controls["seq"].value = 4096
    assert calc.estimate.total > first
    calc.controls["training"].value = False
    assert calc.estimate.parts["kv_cache"] > 0 and calc.estimate.parts["optimizer"] == 0
