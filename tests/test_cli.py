import json

import nbformat

from labkit.cli import main, notebook_meta, readiness
from labkit.course import strip_solutions, student


def test_doctor_lists_notebooks(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "00_start_here.ipynb" in out and "features:" in out and "Versions against the lock" in out


def test_doctor_names_a_planted_mismatch(tmp_path, capsys):
    from importlib.metadata import version
    lock = tmp_path / "lock.txt"
    lock.write_text(f"# planted\ntorch=={version('torch').split('+')[0]}\ntransformers==0.0.1\nbitsandbytes==0.0.1\n"
                    "safetensors==0.0.1\npytest==0.0.1\nnot-a-package==1.0\n")
    assert main(["doctor", "--lock", str(lock)]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if "may affect:" in line}
    # torch agrees; not-a-package is missing, but nothing here requires it (as the CUDA libraries beside a CPU torch)
    assert set(rows) == {"transformers", "bitsandbytes", "safetensors", "pytest"}
    assert "lock 0.0.1" in rows["transformers"] and rows["transformers"].endswith("may affect: all notebooks")
    assert "06_quantization_qlora.ipynb" in rows["bitsandbytes"].split("may affect: ")[1].split(", ")   # and 13 now
    assert rows["safetensors"].endswith("may affect: all notebooks (through transformers)")
    assert "(make test), not the notebooks" in rows["pytest"]
    assert "4 of 6 differ" in out and "(1 more pins for this platform are for packages nothing here requires, " \
        "not-a-package;" in out


def test_doctor_diagnoses_a_bad_size(monkeypatch, capsys):
    import os
    monkeypatch.setenv("LABKIT_SIZE", "huge")
    assert main(["doctor"]) == 1                       # a clear line, not a traceback
    out = capsys.readouterr().out
    assert out.startswith("PROBLEM: LABKIT_SIZE must be one of ('tiny', 'full'), got 'huge'. Unset it")
    assert "Notebooks here:" in out and os.environ["LABKIT_SIZE"] == "huge"


def test_readiness():
    assert readiness({"requires": ["transformers"], "optional": {}}) == ("full", [])
    verdict, reasons = readiness({"requires": [], "optional": {"tensorrt": "the TensorRT engine"}})
    assert verdict == "partly" and reasons == ["without tensorrt: skips the TensorRT engine"]
    assert readiness({"requires": ["tensorrt"]})[0] == "no"
    assert set(notebook_meta()) >= {"00_start_here.ipynb", "01_memory_anatomy.ipynb"}


def test_strip_solutions():
    src = "x = 1\n    ### BEGIN SOLUTION\n    y = secret()\n    ### END SOLUTION\nprint(y)"
    out = strip_solutions(src)
    assert "secret" not in out and "    raise NotImplementedError()" in out and out.endswith("print(y)")
    import pytest
    with pytest.raises(ValueError, match="without"):
        strip_solutions("### BEGIN SOLUTION\nx")


def test_student_versions(tmp_path):
    student(dest=tmp_path)
    for path in tmp_path.glob("*.ipynb"):
        text = "".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
        assert "### BEGIN SOLUTION" not in text and "NotImplementedError" in text


def test_estimate_takes_a_config_json(tmp_path, capsys):
    import labkit as lk
    path = tmp_path / "config.json"
    path.write_text(lk.models.family_config("mistral-7b", "full").to_json_string())
    assert main(["estimate", str(path), "--seq", "1024", "--train", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "mistral" in out and "config.json" in out and "formula" in out and "optimizer" in out
    assert main(["estimate", "t5-base", "--size", "tiny", "--seq", "32"]) == 0
    assert "fake" in capsys.readouterr().out                        # no formula: measured on fake tensors
    import pytest
    with pytest.raises(SystemExit):
        main(["estimate", str(tmp_path / "nothing.json")])
    with pytest.raises(SystemExit):
        main(["estimate", "llama-2-7b", "--seq", "9000"])             # beyond max_position_embeddings


def test_doctor_on_windows_names_the_notebooks_that_need_linux(capsys):
    from labkit.cli import doctor
    assert doctor(system="Windows") == 0
    out = capsys.readouterr().out
    assert "WSL2 is the supported path" in out and "triton has no wheels" in out
    rows = {l.split()[1]: l.split()[0] for l in out.splitlines() if l.startswith("  ") and ".ipynb" in l}
    assert rows["09_tensor_and_pipeline_parallelism.ipynb"] == rows["10_zero_and_fsdp.ipynb"] == "no"
    assert rows["11_compile_and_engines.ipynb"] == "no" and rows["01_memory_anatomy.ipynb"] != "no"
    assert "needs Linux: it starts its ranks with torchrun over gloo" in out and "os.killpg" in out
    assert "MALLOC_MMAP_THRESHOLD_" in out and "cl.exe" in out


def test_doctor_on_macos_says_tiny_on_the_cpu_and_no_mps(capsys):
    from labkit.cli import doctor
    assert doctor(system="Darwin") == 0
    out = capsys.readouterr().out
    assert "tiny size on the CPU" in out and "(MPS) is not used" in out and "twins" in out
    rows = {l.split()[1]: l.split()[0] for l in out.splitlines() if l.startswith("  ") and ".ipynb" in l}
    assert rows["11_compile_and_engines.ipynb"] == "no" and rows["09_tensor_and_pipeline_parallelism.ipynb"] != "no"


def test_platform_notes_on_linux_only_speak_of_a_missing_compiler():
    from labkit.cli import platform_notes
    assert platform_notes("Linux", compiler="/usr/bin/c++") == ([], {})
    lines, linux_only = platform_notes("Linux", compiler=False)
    assert linux_only == {} and len(lines) == 1 and "No C++ compiler" in lines[0] and "notebook 11" in lines[0]
    assert readiness({"requires": []}, "measures memory from /proc") == ("no", ["needs Linux: it measures memory from /proc"])


def test_doctor_compares_only_the_lock_lines_for_this_machine(tmp_path, capsys):
    """A line for another system (here: a planted win32-only pin) is not a difference on this one."""
    import sys
    from importlib.metadata import version
    lock = tmp_path / "lock.txt"
    other = "win32" if sys.platform != "win32" else "linux"
    lock.write_text(f"torch=={version('torch').split('+')[0]}\nnot-a-package==1.0 ; sys_platform == '{other}'\n"
                    f"transformers=={version('transformers')} ; sys_platform == '{sys.platform}'\n")
    assert main(["doctor", "--lock", str(lock)]) == 0
    out = capsys.readouterr().out
    assert "all 2 pinned packages match" in out and "not-a-package" not in out


def _stub_notebook(path, text):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(text)]
    nbformat.write(nb, path)


def test_student_build_kept_in_step_without_losing_the_learners_work(tmp_path, capsys):
    from labkit.cli import student_in_step
    src, dest = tmp_path / "notebooks", tmp_path / "student"
    src.mkdir()
    _stub_notebook(src / "00_a.ipynb", "x = 1\n### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION")
    _stub_notebook(src / "01_b.ipynb", "y = 2")
    assert {p.name for p in student_in_step(src, dest)} == {"00_a.ipynb", "01_b.ipynb"}
    assert "answer = 42" not in (dest / "00_a.ipynb").read_text()           # the student's copy: solution stubbed
    assert student_in_step(src, dest) == []                                   # in step: nothing rewritten
    # The course changes both; the learner has worked in 01 (JupyterLab saved it).
    _stub_notebook(src / "00_a.ipynb", "x = 10\n### BEGIN SOLUTION\nanswer = 42\n### END SOLUTION")
    _stub_notebook(src / "01_b.ipynb", "y = 20")
    _stub_notebook(dest / "01_b.ipynb", "y = 2\nmy_work = 'mine'")
    capsys.readouterr()
    assert [p.name for p in student_in_step(src, dest)] == ["00_a.ipynb"]
    assert "x = 10" in (dest / "00_a.ipynb").read_text()
    assert "my_work" in (dest / "01_b.ipynb").read_text()                     # the learner's work stays
    assert "y = 20" in (dest / "updated" / "01_b.ipynb").read_text()          # the new version beside it
    assert "kept your" in capsys.readouterr().out
    student_in_step(src, dest)
    assert "kept your" not in capsys.readouterr().out                         # said once, not on every start




def test_estimate_defaults_to_a_sequence_the_model_has(capsys):
    """`labkit estimate gpt2-124m` (a preset it lists, 1024 positions) with the default --seq: no error."""
    assert main(["estimate", "gpt2-124m"]) == 0
    out = capsys.readouterr().out
    assert "seq 1024 (--seq defaults to 2048; this model's max_position_embeddings is 1024)" in out


def test_estimate_beyond_the_positions_names_the_flag_it_has(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["estimate", "gpt2-124m", "--seq", "2048"])
    err = capsys.readouterr().err
    assert "--max-positions 2048" in err and "max_positions=" not in err
    assert main(["estimate", "gpt2-124m", "--seq", "2048", "--max-positions", "2048"]) == 0


def _config_file(tmp_path, **changes):
    import labkit as lk
    data = json.loads(lk.models.config("llama-2-7b", "full").to_json_string())
    data.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_estimate_takes_a_null_head_dim(tmp_path, capsys):
    assert main(["estimate", _config_file(tmp_path, head_dim=None), "--seq", "512"]) == 0
    assert "formula" in capsys.readouterr().out


def test_config_errors_are_one_line_naming_the_field(tmp_path, capsys):
    import pytest
    for changes, named in ((dict(num_attention_heads=5, num_key_value_heads=2), "attention heads (5)"),
                           (dict(hidden_size=4000, num_attention_heads=5, num_key_value_heads=2, head_dim=None),
                            "num_key_value_heads 2")):
        for command in (["estimate"], ["plan", "--task", "finetune", "--gpu", "L4"]):
            with pytest.raises(SystemExit) as exc:
                main(command[:1] + [_config_file(tmp_path, **changes)] + command[1:])
            assert exc.value.code == 2
            err = [l for l in capsys.readouterr().err.splitlines() if "error:" in l]
            assert len(err) == 1 and named in err[0] and "Traceback" not in err[0]


def test_plan_recipes_prints_the_closing_table(capsys):
    assert main(["plan", "--recipes"]) == 0
    out = capsys.readouterr().out
    assert "fit agreement" in out and "last round's three plans" in out and "tt-8b-full-4090" in out


def test_a_config_naming_flash_attention_is_estimated_and_planned_without_the_package(tmp_path, capsys):
    """flash-attn is not installed here: the config's kernel is priced as SDPA's flash kernel, never imported."""
    path = _config_file(tmp_path)
    data = json.loads(open(path).read())
    data["_attn_implementation"] = "flash_attention_2"
    open(path, "w").write(json.dumps(data))
    assert main(["estimate", path, "--seq", "512", "--train", "adamw"]) == 0
    assert "priced as SDPA's flash kernel" in capsys.readouterr().out
    assert main(["plan", path, "--task", "lora", "--gpu", "L4", "--seq", "512", "--rows", "1"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_plan_json_carries_the_verification(capsys):
    assert main(["plan", "llama-2-7b", "--task", "finetune", "--gpu", "L4", "--seq", "256", "--batch", "2",
                 "--json", "--rows", "1", "--verify"]) == 0
    data = json.loads(capsys.readouterr().out)
    v = data["verification"]
    assert len(data["plans"]) == 1 and v["techniques"] == data["plans"][0]["techniques"]
    assert v["measured_peak"] > 0 and abs(v["gap"]) < 0.05
