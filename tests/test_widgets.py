"""The memory calculator, driven without a browser: build it, move its controls, read what it shows."""
import re

import pytest

import labkit as lk

pytest.importorskip("ipywidgets")
from labkit.widgets import calculator, describe, peak_phase  # noqa: E402


def shown(calc):
    """(title, [bar label texts], y-axis label) of the calculator's current chart."""
    ax = calc.figure.axes[0]
    return ax.get_title(), [t.get_text() for t in ax.texts], ax.get_ylabel()


def unit(text):
    return re.search(r"[KMGT]iB", text).group(0)


def test_calculator_follows_its_controls():
    calc = calculator(preset="llama-2-7b", seq=1024)
    title, bars, ylabel = shown(calc)
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 1024, "bf16", "adamw").total
    assert title == calc.title and title.startswith("estimated peak")
    calc.controls["seq"].value = 4096
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 4096, "bf16", "adamw").total
    assert shown(calc)[0] != title, "the chart is redrawn when a slider moves"
    calc.controls["batch"].value = 8
    assert calc.estimate.total == lk.estimate("llama-2-7b", 8, 4096, "bf16", "adamw").total


@pytest.mark.parametrize("preset, seq, batch", [("llama-2-7b", 2048, 1), ("llama-2-70b", 4096, 64),
                                                 ("gpt2-124m", 128, 1), ("bert-large", 512, 64)])
def test_one_unit_for_title_bars_and_axis(preset, seq, batch):
    calc = calculator(preset=preset, seq=seq, batch=batch)
    title, bars, ylabel = shown(calc)
    assert len(bars) == 1
    assert unit(title) == unit(bars[0]) == ylabel, (title, bars, ylabel)
    assert re.search(r"[\d.]+", title).group(0) == re.search(r"[\d.]+", bars[0]).group(0), (title, bars)


def test_the_title_names_the_phase_of_the_peak():
    calc = calculator(preset="llama-2-7b", seq=128, batch=1)          # gradients outweigh activations
    assert peak_phase(calc.estimate) == "optimizer step"
    assert calc.title.endswith("at the optimizer step")
    calc.controls["seq"].value = 4096
    calc.controls["batch"].value = 64                                  # activations outweigh gradients
    assert peak_phase(calc.estimate) == "start of backward"
    assert shown(calc)[0].endswith("at the start of backward")
    calc.controls["training"].value = False
    phase = peak_phase(calc.estimate)
    assert phase in ("inference", "prefill", "logits", "decode", "forward") and calc.title.endswith(f"at the {phase}")


def test_phase_agrees_with_the_peak_breakdown():
    for batch in (1, 64):
        est = lk.estimate("llama-2-7b", batch, 4096, "bf16", "adamw")
        phase = peak_phase(est)
        if phase == "optimizer step":
            assert est.peak_parts["gradients"] > 0 and est.peak_parts["activations"] == 0
        else:
            assert phase == "start of backward" and est.peak_parts["gradients"] == 0
    assert describe(est).startswith("estimated peak") and phase in describe(est)


def test_sequence_slider_ends_at_the_context_length():
    calc = calculator(preset="llama-3-8b", seq=8192)
    assert calc.controls["seq"].value == 8192
    calc.controls["preset"].value = "gpt2-124m"                        # 1024 positions
    assert calc.controls["seq"].max == 1024 and calc.controls["seq"].value <= 1024
    assert calc.estimate.total == lk.estimate("gpt2-124m", 1, calc.controls["seq"].value, "bf16", "adamw").total


def test_a_combination_without_estimate_is_said_not_raised():
    calc = calculator(preset="llama-2-7b", seq=1024, dtype="amp-bf16")
    before = calc.estimate
    calc.controls["training"].value = False          # autocast has no inference estimate
    assert calc.message and "no estimate" in calc.message and "dtype" in calc.message
    assert calc.estimate is before
    calc.controls["dtype"].value = "bf16"
    assert calc.message is None and calc.estimate.parts["kv_cache"] > 0


def test_the_calculator_has_parallel_controls():
    calc = calculator(preset="llama-2-7b", seq=1024, dtype="mixed")
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw").total
    calc.controls["dp"].value = 64
    calc.controls["zero"].value = 3
    assert calc.estimate.total == lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=64, zero=3).total
    calc.controls["tp"].value = 8
    calc.controls["pp"].value = 2
    want = lk.estimate("llama-2-7b", 1, 1024, "mixed", "adamw", dp=64, zero=3, tp=8, pp=2)
    assert calc.estimate.total == want.total and calc.message is None
    calc.controls["training"].value = False           # ZeRO shards training state: inference ignores it
    assert calc.message is None and calc.estimate.parts["kv_cache"] > 0
