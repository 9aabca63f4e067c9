"""lk.estimate on one device: the formulas against lk.track and published rows, recomputation, the configs it reads
and the arguments it refuses, and the package's shape (layers of modules, the formulas without torch)."""
import ast
import importlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch

import labkit as lk
from conftest import steady_step

estimate_pkg = importlib.import_module("labkit.estimate")
PACKAGE = pathlib.Path(estimate_pkg.__file__).parent


@pytest.mark.parametrize("name", sorted(lk.models.PRESETS))
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_param_count_matches_the_model(name, size):
    model = lk.models.build(name, size, device="meta")
    assert lk.param_count(model.config) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "sgd"])
def test_training_estimate_within_5_percent_of_track(preset, dtype, optimizer):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = lk.models.build(preset, "tiny", dtype=torch_dtype)
    opt = {"adamw": lambda p: torch.optim.AdamW(p, foreach=False),
           "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}[optimizer](model.parameters())
    step = steady_step(model, opt, next(lk.data.batches(2, 96)))
    with lk.track(model, opt) as mem:
        step()
    est = lk.estimate(model.config, 2, 96, dtype, optimizer)
    assert mem.peak == pytest.approx(est.total, rel=0.05)
    assert mem.at("forward end")["activations"] == pytest.approx(est.parts["activations"], rel=0.05)
    assert mem.max_parts["optimizer"] == pytest.approx(est.parts["optimizer"], rel=0.05, abs=1024)


def test_kv_cache_matches_vllm_opt13b():
    from transformers import LlamaConfig
    cfg = LlamaConfig(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40)
    assert lk.kv_cache_bytes(cfg, 1, 1, "fp16") == 800 * 1024


def test_kv_cache_uses_kv_heads():
    mha = lk.kv_cache_bytes("llama-2-7b", 1, 2048, "bf16")
    gqa = lk.kv_cache_bytes("llama-3-8b", 1, 2048, "bf16")
    assert mha == 2 * 32 * 32 * 128 * 2 * 2048 and gqa == mha // 4


def test_bytes_per_parameter_rules():
    cfg = "llama-2-7b"
    states = lambda e: (e.parts["parameters"] + e.parts["gradients"] + e.parts["optimizer"]) / e.params
    assert states(lk.estimate(cfg, dtype="fp32", optimizer="adamw")) == 16
    assert states(lk.estimate(cfg, dtype="mixed", optimizer="adamw")) == 16
    assert states(lk.estimate(cfg, dtype="bf16", optimizer="adamw")) == 8
    assert states(lk.estimate(cfg, dtype="fp32", optimizer="sgd")) == 8
    assert states(lk.estimate(cfg, dtype="bf16", optimizer="adamw-8bit")) == pytest.approx(6.03, abs=0.01)


def test_recompute_keeps_layer_inputs_only():
    full = lk.estimate("llama-2-7b", 1, 2048, "bf16").parts["activations"]
    ckpt = lk.estimate("llama-2-7b", 1, 2048, "bf16", recompute=True).parts["activations"]
    assert ckpt < full / 5


def test_peak_is_the_larger_of_backward_and_step():
    small = lk.estimate("llama-2-7b", 1, 128, "bf16")       # gradients dominate
    large = lk.estimate("llama-2-7b", 16, 4096, "bf16")     # activations dominate
    assert small.peak_parts["gradients"] > 0 and small.peak_parts["activations"] == 0
    assert large.peak_parts["activations"] > 0 and large.peak_parts["gradients"] == 0
    assert small.total == sum(small.peak_parts.values())


# Published rows, reproduced. GB = 1e9 bytes as the papers write it.
def test_korthikanti_eq1_gpt3_175b():
    from labkit.estimate import korthikanti_bytes
    h, a, s = 12288, 96, 2048                                          # GPT-3 175B, sec. 4.1, Eq. 1
    assert korthikanti_bytes(h, a, s) / 1e9 == pytest.approx(2.869, abs=5e-4)
    assert korthikanti_bytes(h, a, s, recompute="selective") == s * h * 34          # sec. 4.2: 5as/h dropped
    saved = 1 - korthikanti_bytes(h, a, s, recompute="selective") / korthikanti_bytes(h, a, s)
    assert saved == pytest.approx(0.70, abs=0.005)                     # "70% for GPT-3"
    mtnlg = 1 - 34 / (34 + 5 * 128 * 2048 / 20480)                     # MT-NLG 530B: a=128, h=20480
    assert mtnlg == pytest.approx(0.65, abs=0.005)                     # "65% for MT-NLG"


def test_korthikanti_output_layer_term():
    from labkit.estimate import korthikanti_bytes
    h, s, v = 768, 1024, 50257                                         # sec. 4.3: 4sbh(1 + v/h)
    out = korthikanti_bytes(h, 12, s, layers=0, vocab=v)
    assert out == 4 * s * h * (1 + v / h)
    # labkit's GPT-2 head in 16-bit: the logits (2V) plus the fp32 log-softmax (4V) per token, and ln_f
    from labkit.estimate import model_shape
    from labkit.estimate.formulas import head_terms
    head, logits = head_terms(model_shape("gpt2-124m"), "bf16", training=False)
    assert (head + logits) * s == pytest.approx(out * 6 / 4, rel=0.02)


def test_zero_16_bytes_per_param_and_playbook_20():
    est = lk.estimate("llama-2-7b", 1, 128, "mixed", "adam")
    states = (est.parts["parameters"] + est.parts["gradients"] + est.parts["optimizer"]) / est.params
    assert states == 16                                                # ZeRO sec. 3.1
    est = lk.estimate("llama-2-7b", 1, 128, "mixed", "adam", grad_accum=True)
    states = (est.parts["parameters"] + est.parts["gradients"] + est.parts["optimizer"]) / est.params
    assert states == 20                                                # Ultra-Scale Playbook, fp32 grad accum


def test_hf_bert_large_fp32_weights():
    # HF's model memory guide: bert-large-uncased, 335M parameters, 1.34 GB of fp32 weights
    est = lk.estimate("bert-large", 1, 512, "fp32", training=False)
    assert est.params == 335_174_458 and est.parts["parameters"] / 1e9 == pytest.approx(1.34, abs=0.005)


def test_vllm_opt13b_rows():
    from labkit.estimate import kv_capacity
    opt13b = lk.models.family_config("opt-13b", "full")                # the real OPTConfig
    assert lk.kv_cache_bytes(opt13b, 1, 1, "fp16") == 800 * 1024      # sec. 3: 800 KB per token
    free, slots = kv_capacity(opt13b, "40 GiB", "fp16")                # A100 40GB, utilization 0.9
    assert free / 2**30 == pytest.approx(12, rel=0.02) and slots == pytest.approx(15_700, rel=0.02)
    with pytest.raises(ValueError, match="memory .* does not hold"):
        kv_capacity(opt13b, "16 GiB", "fp16")


def test_selective_recompute_drops_only_the_scores():
    cfg = lk.models.family_config("gpt2-124m", "full")
    full = lk.estimate(cfg, 1, 1024, "bf16", device="cpu")
    sel = lk.estimate(cfg, 1, 1024, "bf16", recompute="selective", device="cpu")
    from labkit.estimate import activation_bytes_per_token
    layer = activation_bytes_per_token(cfg, 1024, "bf16", device="cpu")
    assert layer - activation_bytes_per_token(cfg, 1024, "bf16", recompute="selective", device="cpu") == 12 * 12 * 1024
    assert full.parts["activations"] - sel.parts["activations"] == 12 * 12 * 1024 * 1024 * 12
    llama = lk.estimate("llama-2-7b", 1, 1024, "bf16")                 # flash attention keeps no scores
    assert lk.estimate("llama-2-7b", 1, 1024, "bf16", recompute="selective").total == llama.total


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch=0), "batch must be an int >= 1, got 0"),
    (dict(seq="long"), "seq must be an int >= 1, got 'long'"),
    (dict(dtype="fp8"), "dtype must be one of .*'fp8'"),
    (dict(optimizer="lion"), "optimizer must be one of .*'lion'"),
    (dict(training=False, kv_tokens=-3), "kv_tokens must be an int >= 0, got -3"),
    (dict(batch=2.0), "batch must be an int >= 1, got 2.0"),
    (dict(seq=5000), "seq must be <= max_position_embeddings 4096 .* got 5000 .*max_positions"),
    (dict(training=False, seq=4000, kv_tokens=4200), "kv_tokens must be <= max_position_embeddings 4096"),
    (dict(logits_to_keep=-1), "logits_to_keep must be an int >= 0, got -1"),
    (dict(method="guess"), "method must be 'auto', 'formula' or 'fake', got 'guess'"),
    (dict(max_positions=-1), "max_positions must be an int >= 1, got -1"),
    (dict(max_positions=0), "max_positions must be an int >= 1, got 0"),
    (dict(max_positions="long"), "max_positions must be an int >= 1, got 'long'"),
])
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lk.estimate("llama-2-7b", **kwargs)


@pytest.mark.parametrize("name", ["training", "foreach", "grad_accum"])
@pytest.mark.parametrize("bad", ["False", "True", 0, None])
def test_flags_must_be_bools(name, bad):
    with pytest.raises(ValueError, match=f"{name} must be True or False, got {bad!r}"):
        lk.estimate("llama-2-7b", 1, 512, **{name: bad})


def test_logits_to_keep_is_refused_in_training():
    with pytest.raises(ValueError, match="logits_to_keep is for inference.*got logits_to_keep=1 with training=True"):
        lk.estimate("llama-2-7b", 1, 512, logits_to_keep=1)
    assert lk.estimate("llama-2-7b", 1, 512, training=False, logits_to_keep=0).total > 0


def test_numpy_integers_and_long_sequences():
    import numpy as np
    assert lk.estimate("llama-2-7b", np.int64(2), np.int32(128)).total == lk.estimate("llama-2-7b", 2, 128).total
    assert lk.kv_cache_bytes("llama-2-7b", np.int64(1), np.int64(7)) == lk.kv_cache_bytes("llama-2-7b", 1, 7)
    long = lk.estimate("llama-2-7b", 1, 8192, max_positions=8192)      # an explicit override
    assert long.parts["activations"] > lk.estimate("llama-2-7b", 1, 4096).parts["activations"]
    with pytest.raises(ValueError, match="tokens must be an int >= 0, got -3"):
        lk.kv_cache_bytes("llama-2-7b", 1, -3)


def test_any_config_gets_an_answer():
    """No formula (T5): the estimate is a measurement on fake tensors, and says so."""
    from transformers import T5Config
    cfg = T5Config(d_model=64, d_ff=128, num_layers=1, num_heads=2, d_kv=32, vocab_size=512, decoder_start_token_id=0)
    est = lk.estimate(cfg, 1, 32, "fp32", "adamw")
    assert est.method == "fake" and est.total > 0 and est.notes
    assert lk.estimate("llama-2-7b").method == "formula"
    with pytest.raises(ValueError, match="no formula for model_type 't5'"):
        lk.estimate(cfg, method="formula")


def test_config_json_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(lk.models.family_config("qwen2-7b", "tiny").to_json_string())
    assert lk.estimate(str(path), 1, 64).total == lk.estimate(lk.models.family_config("qwen2-7b", "tiny"), 1, 64).total
    with pytest.raises(FileNotFoundError, match="config file"):
        lk.estimate(str(tmp_path / "missing" / "config.json"))


@pytest.mark.parametrize("field, value", [("hidden_size", -64), ("num_attention_heads", 0),
                                          ("num_hidden_layers", 0), ("vocab_size", -1), ("intermediate_size", 1.5)])
def test_a_config_with_a_size_below_one_is_refused_naming_the_field(tmp_path, field, value):
    data = json.loads(lk.models.config("llama-2-7b", "tiny").to_json_string())
    data[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"config {field} must be an int >= 1, got {value!r}"):
        lk.estimate(str(path), 1, 64)


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


def test_bad_config():
    with pytest.raises(TypeError, match="config must be"):
        lk.estimate(42)
    with pytest.raises(ValueError, match="config 'llama-9-1t' is neither a preset, a family nor an existing path"):
        lk.estimate("llama-9-1t")


def test_missing_paths_and_unknown_names_list_presets_and_families(tmp_path):
    for where in (str(tmp_path / "nowhere" / "config.json"), tmp_path / "nowhere", "models/mine.json"):
        with pytest.raises(FileNotFoundError, match=r"does not exist\. Presets: .*llama-2-7b.* Families: .*qwen2-7b"):
            lk.estimate(where)
    with pytest.raises(ValueError, match=r"config 'qwen-9b' is neither a preset.*Families: .*mixtral-8x7b"):
        lk.estimate("qwen-9b")


def test_table_and_cli(capsys):
    from labkit.cli import main
    assert main(["estimate", "llama-2-7b", "--seq", "2048", "--batch", "1", "--dtype", "bf16", "--train", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "25.10 GiB" in out and "peak" in out
    with pytest.raises(SystemExit):
        main(["estimate", "llama-2-7b", "--dtype", "fp7"])


def test_mixed_precision_states_per_optimizer():
    states = lambda opt: lk.estimate("llama-2-7b", dtype="mixed", optimizer=opt)
    P = lk.param_count(lk.models.config("llama-2-7b", "full"))
    assert states("sgd").parts["optimizer"] == 4 * P                  # the fp32 master copy only
    assert states("sgd-momentum").parts["optimizer"] == 8 * P
    assert states("adamw-8bit").parts["optimizer"] == int(P * (6 + 8 / 256))


def test_recompute_estimate_against_transformers_checkpointing():
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=8)
    if hasattr(model, "activation_checkpointing_enable"):        # its name since transformers 5
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    step = steady_step(model, opt, next(lk.data.batches(4, 128)))
    with lk.track(model, opt) as mem:
        step()
    est = lk.estimate(model.config, 4, 128, "fp32", "adamw", recompute=True)
    assert mem.peak == pytest.approx(est.total, rel=0.05)
    # what is recomputed during backward is still filed under activations
    backward = mem.timeline["activations"][[i for i, t in mem.marks if t == "backward"][0]:]
    from labkit.estimate import activation_bytes_per_token
    one_layer = 4 * 128 * activation_bytes_per_token(model.config, 128, "fp32")
    assert (backward[1:] - backward[:-1]).clip(min=0).sum() > 0.9 * 8 * one_layer      # each layer, once more


def test_recompute_bad_input():
    with pytest.raises(ValueError, match="recompute must be True, False, 'selective' or a segment length >= 1, got 0"):
        lk.estimate("llama-2-7b", recompute=0)


# ---- the package: each module imports only those below it, the formulas need no torch ------------------
# each module imports only the ones after it in this list (the arrows point down)
LAYERS = ["__init__", "measured", "fake", "step", "formulas", "params", "levers", "sharding", "config"]
NO_TORCH = """
import importlib, sys, types
root = {root!r}
for name, path in (("labkit", root), ("labkit.estimate", root + "/estimate")):
    package = types.ModuleType(name)
    package.__path__ = [path]          # a bare package: labkit/__init__.py (which imports torch) is not run
    sys.modules[name] = package
formulas = importlib.import_module("labkit.estimate.formulas")
sharding = importlib.import_module("labkit.estimate.sharding")
assert formulas.korthikanti_bytes(4096, 32, 2048) > 0
assert sharding.Parallel(dp=8, zero=3).world == 8
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
assert not heavy, heavy
"""


def test_importing_the_formulas_and_the_sharding_does_not_import_torch():
    code = NO_TORCH.format(root=str(PACKAGE.parent))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def _imports(path):
    """The labkit.estimate modules that `path` imports (at any depth of its code)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add((node.module or "").split(".")[0])
    return found - {""}


def test_each_module_imports_only_modules_below_it():
    assert sorted(p.stem for p in PACKAGE.glob("*.py")) == sorted(LAYERS)
    for i, name in enumerate(LAYERS):
        imported = _imports(PACKAGE / f"{name}.py")
        above = imported & set(LAYERS[:i + 1])
        assert not above, f"{name}.py imports {sorted(above)}, which sit above it (or is itself)"


def test_no_module_is_over_500_lines():
    for path in PACKAGE.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 500, path.name


def test_the_public_api_lists_and_exports_its_names():
    for name in ("estimate", "Estimate", "Parallel", "param_count", "kv_cache_bytes", "kv_capacity",
                 "korthikanti_bytes", "model_states", "measured", "activation_bytes_per_token", "load_config",
                 "DTYPES", "OPTIMIZERS", "FAMILIES", "ZERO_STAGES"):
        assert name in estimate_pkg.__all__ and hasattr(estimate_pkg, name), name
