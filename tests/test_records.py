import json
from fractions import Fraction

import numpy as np
import pytest
import torch

import labkit as lk
from labkit import records
from labkit.cli import _figure


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "RECORDS_DIR", tmp_path)
    return tmp_path


def _strict(path):
    """Standard JSON only: NaN or Infinity in the file fail here."""
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_numbers_keep_their_value(where):
    path = lk.record("99_test", half=np.float32(2.5), third=Fraction(1, 3), n=np.int64(7), t=torch.tensor(0.25),
                     peak_bytes=1024, name="fp32")
    figures = _strict(path)["figures"]
    assert figures == {"half": 2.5, "third": pytest.approx(1 / 3), "n": 7, "t": 0.25, "peak_bytes": 1024, "name": "fp32"}
    assert isinstance(figures["n"], int) and isinstance(figures["peak_bytes"], int)


def test_nan_and_inf_are_standard_json_and_the_index_shows_them(where):
    path = lk.record("99_test", loss_gap=float("nan"), time_s=float("inf"), peak_bytes=np.float64("-inf"))
    figures = _strict(path)["figures"]
    assert figures == {"loss_gap": "nan", "time_s": "inf", "peak_bytes": "-inf"}
    assert [_figure(k, v) for k, v in figures.items()] == ["nan", "inf", "-inf"]    # the workbook index


def test_a_corrupted_record_is_set_aside_and_replaced(where, capsys):
    (where / "99_test.json").write_text('{"size": "tiny", "figures": {"a": 1')    # cut short
    path = lk.record("99_test", b=2)
    assert _strict(path)["figures"] == {"b": 2}
    kept = list(where.glob("99_test.json.corrupt-*"))
    assert len(kept) == 1 and kept[0].read_text().startswith('{"size"')
    assert "is not valid JSON" in capsys.readouterr().out
    lk.record("99_test", c=3)                                                       # merged as before
    assert _strict(path)["figures"] == {"b": 2, "c": 3}


def test_bad_figures_name_the_figure(where):
    with pytest.raises(TypeError, match="figure flag must be a number or a string, got True"):
        lk.record("99_test", flag=True)
    with pytest.raises(TypeError, match="figure v must be"):
        lk.record("99_test", v=[1, 2])
    with pytest.raises(ValueError, match="notebook must be a name like"):
        lk.record("notebook", a=1)
