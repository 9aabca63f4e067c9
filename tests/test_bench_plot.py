import matplotlib
import pytest
import torch

import labkit as lk


def test_measure_times_and_peak():
    r = lk.measure(lambda: torch.ones(256, 1024).sum(), warmup=1, repeat=3)
    assert len(r.times) == 3 and r.time_s > 0
    assert r.peak == 2**20 + 4                   # the 1 MiB tensor and the 4-byte sum
    assert "ms" in repr(r)


def test_measure_counts_given_objects():
    w = torch.nn.Linear(256, 256)
    r = lk.measure(lambda: w(torch.ones(4, 256)), w, repeat=1)
    assert r.peak_parts["parameters"] == (256 * 256 + 256) * 4


@pytest.mark.parametrize("kwargs, message", [(dict(repeat=0), "repeat must be an int >= 1, got 0"),
                                             (dict(warmup=-1), "warmup must be an int >= 0, got -1")])
def test_measure_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lk.measure(lambda: None, **kwargs)
    with pytest.raises(TypeError, match="fn must be callable"):
        lk.measure(3)


def test_compare_table_ratios():
    table = lk.compare({"small": lambda: torch.ones(1024), "big": lambda: torch.ones(4096)}, repeat=2)
    assert table.rows[0]["peak_ratio"] == 1 and table.rows[1]["peak_ratio"] == 4
    assert "x peak" in str(table) and "<table>" in table._repr_html_()
    assert table["big"].peak == 4096 * 4
    with pytest.raises(ValueError, match="variants must be a non-empty dict"):
        lk.compare({})


def test_plots_return_axes():
    matplotlib.use("Agg")
    with lk.track() as mem:
        x = torch.ones(100)
        mem.mark("half")
        y = x * 2
    est = lk.estimate("llama-2-7b", 1, 128)
    assert lk.plot.breakdown(est, mem, labels=["est", "meas"]).get_title()
    ax = lk.plot.timeline(mem)
    assert ax.get_xlabel().startswith("event")
    peak = [t.get_text() for t in ax.get_legend().get_texts() if t.get_text().startswith("peak")]
    unit = ax.get_ylabel()                                            # a one-event spike is still shown
    assert peak == [f"peak {mem.peak / lk.parse_bytes('1 ' + unit):.3g} {unit}"], peak
    table = lk.compare({"a": lambda: torch.ones(10), "b": lambda: torch.ones(20)}, repeat=1)
    assert lk.plot.tradeoff(table, highlight="a").get_xlabel().startswith("peak")
    with pytest.raises(ValueError, match="highlight must name rows"):
        lk.plot.tradeoff(table, highlight="c")
    assert lk.plot.scaling([1, 2, 4], {"n^2": [1, 4, 16]}).get_xscale() == "log"


def test_plot_bad_input():
    with pytest.raises(ValueError, match="labels must have one name per bar"):
        lk.plot.breakdown({"parameters": 1}, labels=["a", "b"])
    with pytest.raises(ValueError, match="unknown categories .*'weights'"):
        lk.plot.breakdown({"weights": 1})
    with pytest.raises(TypeError, match="expected a track"):
        lk.plot.breakdown(42)
    with pytest.raises(ValueError, match="series 'y' has 2 values for 3 x values"):
        lk.plot.scaling([1, 2, 3], {"y": [1, 2]})
