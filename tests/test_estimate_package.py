"""labkit.estimate's shape (issue 29): one idea per module, the formulas without torch, Parallel checked."""
import ast
import dataclasses
import importlib
import pathlib
import subprocess
import sys

import pytest

import labkit as lk

estimate_pkg = importlib.import_module("labkit.estimate")
Parallel = estimate_pkg.Parallel
PACKAGE = pathlib.Path(estimate_pkg.__file__).parent
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


def test_the_public_api_keeps_its_names():
    for name in ("estimate", "Estimate", "Parallel", "param_count", "kv_cache_bytes", "kv_capacity",
                 "korthikanti_bytes", "model_states", "measured", "activation_bytes_per_token", "load_config",
                 "DTYPES", "OPTIMIZERS", "FAMILIES", "ZERO_STAGES"):
        assert name in estimate_pkg.__all__ and hasattr(estimate_pkg, name), name


def test_parallel_is_frozen_and_checked_at_construction():
    p = Parallel(dp=64, zero=3, tp=8)
    assert (p.dp, p.zero, p.tp, p.pp, p.offload, p.world) == (64, 3, 8, 1, None, 512)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.dp = 2
    assert dataclasses.replace(p, tp=4).world == 256
    for kwargs, message in [(dict(dp=0), "dp must be an int >= 1, got 0"),
                            (dict(tp=2.5), "tp must be an int >= 1, got 2.5"),
                            (dict(pp=True), "pp must be an int >= 1, got True"),
                            (dict(zero=4), "zero must be one of (0, 1, 2, 3)"),
                            (dict(zero=True), "zero must be one of"),
                            (dict(offload="gpu"), "offload must be None, 'optimizer' or 'parameters', got 'gpu'"),
                            (dict(zero=2, offload="parameters"), "use zero=3, got zero=2")]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Parallel(**kwargs)


def test_parallel_and_the_flat_keywords_give_the_same_estimate():
    flat = lk.estimate("llama-2-7b", batch=2, seq=1024, dp=64, zero=3, tp=8, pp=2)
    grouped = lk.estimate("llama-2-7b", batch=2, seq=1024, parallel=Parallel(dp=64, zero=3, tp=8, pp=2))
    single = lk.estimate("llama-2-7b", batch=2, seq=1024)
    assert dataclasses.asdict(flat) == dataclasses.asdict(grouped)
    assert grouped.total < single.total / 8           # a real division, not a relabelling
    assert grouped.parallel["dp"] == 64 and grouped.parallel["zero"] == 3
    assert estimate_pkg.model_states(7_500_000_000, parallel=Parallel(dp=64, zero=1)) == \
        estimate_pkg.model_states(7_500_000_000, dp=64, zero=1)


def test_parallel_and_flat_keywords_together_are_refused():
    with pytest.raises(ValueError, match="not both: got tp=2 too"):
        lk.estimate("llama-2-7b", parallel=Parallel(dp=2), tp=2)
    with pytest.raises(ValueError, match="not both"):
        estimate_pkg.model_states(10**9, dp=2, parallel=Parallel(dp=2))
    with pytest.raises(ValueError, match="parallel must be a labkit.estimate.Parallel"):
        lk.estimate("llama-2-7b", parallel={"dp": 2})


def test_a_layout_the_model_cannot_have_is_refused_by_estimate():
    with pytest.raises(ValueError, match="tp=3 must divide num_attention_heads 32"):
        lk.estimate("llama-2-7b", parallel=Parallel(tp=3))
