import pytest
import torch

import labkit as lk


def test_size_follows_env(monkeypatch):
    monkeypatch.setenv("LABKIT_SIZE", "full")
    assert lk.size() == "full"
    monkeypatch.setenv("LABKIT_SIZE", "tiny")
    assert lk.size() == "tiny"
    monkeypatch.delenv("LABKIT_SIZE")
    assert lk.size() == ("full" if torch.cuda.is_available() else "tiny")


def test_size_rejects_unknown(monkeypatch):
    monkeypatch.setenv("LABKIT_SIZE", "medium")
    with pytest.raises(ValueError, match="LABKIT_SIZE.*'medium'"):
        lk.size()


def test_device_and_has():
    assert lk.device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert lk.has("cuda") == torch.cuda.is_available()
    assert lk.has("transformers") and lk.has("gloo")
    assert lk.has("flash_attn") in (True, False)


def test_has_unknown_lists_known():
    with pytest.raises(ValueError, match="name must be one of .*bitsandbytes.*'warp_drive'"):
        lk.has("warp_drive")


def test_report(capsys):
    info = lk.report()
    assert info["torch"] == torch.__version__ and info["size"] in ("tiny", "full")
    assert set(info["features"]) >= {"cuda", "bitsandbytes", "flash_attn", "triton", "tensorrt"}
    assert "torch" in capsys.readouterr().out
    assert lk.report(show=False)["device"] == str(lk.device())
