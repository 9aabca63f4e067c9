"""A hostile caller's probe of the gpu_smoke and validate_allocator command lines (each test once failed):
bad arguments stop with exit status 2 and a message naming the flag and the value, before CUDA is asked."""
import pytest

from labkit import records
from labkit.scripts import gpu_smoke, validate_allocator


@pytest.mark.parametrize("argv, says", [
    (["--budget", "0"], "--budget must be a positive number of seconds, got 0.0"),
    (["--budget", "-1"], "--budget must be a positive number of seconds, got -1.0"),
    (["--budget", "nan"], "--budget must be a positive number of seconds, got nan"),
    (["--only", "flash,nope"], "--only names unknown checks ['nope']"),
    (["--only", ","], "--only must name checks"),
])
def test_gpu_smoke_refuses_bad_arguments_before_looking_for_cuda(argv, says, capsys, monkeypatch):
    monkeypatch.setattr(gpu_smoke, "cuda_env", lambda: pytest.fail("CUDA was asked about before the arguments"))
    with pytest.raises(SystemExit) as e:
        gpu_smoke.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_gpu_smoke_refuses_an_out_folder_it_cannot_write(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_smoke, "cuda_env", lambda: pytest.fail("CUDA was asked about before the arguments"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for out, says in ((blocker, "it is a file, not a folder"), (blocker / "sub", "is a file, not a folder")):
        with pytest.raises(SystemExit) as e:
            gpu_smoke.main(["--out", str(out)])
        assert e.value.code == 2 and says in capsys.readouterr().err
    assert records.unwritable(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, says", [
    (["--layers", "0"], "--layers must be a positive number of decoder layers, got 0"),
    (["--jobs", "-2"], "--jobs must be a positive number of children at a time, got -2"),
])
def test_validate_allocator_refuses_bad_counts(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        validate_allocator.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_validate_allocator_refuses_an_out_path_it_cannot_write_before_the_gpu_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        validate_allocator.main(["--out", str(blocker / "x.json")])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
