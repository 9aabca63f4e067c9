"""labkit.memory as a package: one class per backend behind track(), the old names still there, small modules."""
import ast
import pathlib

import pytest
import torch

import labkit as lk
from labkit import memory

PACKAGE = pathlib.Path(memory.__file__).parent


def test_track_picks_one_class_per_backend():
    assert type(lk.track()) is memory.DispatchTracker and lk.track().backend == "dispatch"
    assert type(lk.track(backend="profiler")) is memory.ProfilerTracker
    assert isinstance(lk.track(), memory.Tracker) and isinstance(lk.track(backend="profiler"), memory.Tracker)
    # only the dispatch tracker is a dispatch mode: the profiler one never sits on the mode stack
    from torch.utils._python_dispatch import TorchDispatchMode
    assert isinstance(lk.track(), TorchDispatchMode) and not isinstance(lk.track(backend="profiler"), TorchDispatchMode)


def test_the_base_class_alone_says_to_use_track():
    with pytest.raises(NotImplementedError, match="use track"):
        with memory.Tracker(torch.ones(3)):
            pass


def test_the_walk_reads_a_one_shot_iterator_once():
    from labkit.memory import BACKENDS, CATEGORIES
    from labkit.memory.walk import objects, tensors
    model = torch.nn.Linear(2, 3)
    assert len(list(tensors(model))) == 2
    assert objects((model.parameters(),), "track")[0][0] is model.weight     # a one-shot iterator read once
    assert BACKENDS == ("dispatch", "profiler") and CATEGORIES[0] == "parameters"


def test_both_backends_fill_the_same_report():
    model, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    reports = {}
    for backend in memory.BACKENDS:
        with lk.track(model, backend=backend) as mem:
            model(x).sum().backward()
        reports[backend] = mem
        model.zero_grad(set_to_none=True)
    d, p = reports["dispatch"], reports["profiler"]
    assert [t for _, t in d.marks] == [t for _, t in p.marks] == ["start", "forward", "forward end", "backward", "end"]
    assert d.peak_parts["parameters"] == p.peak_parts["parameters"] == (16 * 16 + 16) * 4
    assert d.live - d.start == p.live - p.start == (16 * 16 + 16) * 4          # the gradients stay


def test_no_module_of_the_package_is_over_500_lines_and_none_uses_a_lambda():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 500, f"{path.name} has {len(text.splitlines())} lines"
        lambdas = [n.lineno for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Lambda)]
        assert not lambdas, f"{path.name} uses lambdas on lines {lambdas}: name the function"
