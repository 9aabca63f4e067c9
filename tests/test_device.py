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


def test_bitsandbytes_kernel_note_is_silenced_exactly(tmp_path, monkeypatch, caplog):
    import importlib
    import importlib.util
    import logging

    import pathlib
    dev = importlib.import_module("labkit.device")        # the module (lk.device is the function)
    logger, prefix = dev.IMPORT_NOTES["bitsandbytes"][0]
    # The note labkit drops is the one bitsandbytes really logs, from that module's own logger
    # (read from its source, without importing it).
    spec = importlib.util.find_spec("bitsandbytes")
    if spec is not None:
        source = (pathlib.Path(spec.origin).parent / "backends" / "cpu" / "ops.py").read_text()
        assert logger == "bitsandbytes.backends.cpu.ops"
        assert prefix in source and "logging.getLogger(__name__)" in source
    # A package that logs the note on import, as bitsandbytes does on a CPU with AVX512-BF16.
    (tmp_path / "fake_bnb.py").write_text(
        "import logging\n"
        f"logging.getLogger({logger!r}).warning({prefix + ': %s. Please make sure you already `pip install kernels`'!r}, 'offline')\n"
        f"logging.getLogger({logger!r}).warning('another warning that stays')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(dev.IMPORT_NOTES, "fake_bnb", dev.IMPORT_NOTES["bitsandbytes"])
    with caplog.at_level(logging.WARNING):
        dev.import_quietly("fake_bnb")
    said = [r.getMessage() for r in caplog.records]
    assert said == ["another warning that stays"]
    assert not logging.getLogger(logger).filters                  # nothing stays installed
