"""The code of notebooks 09 and 10 reads plainly (named functions, no private names, short cells); where_ranks_run
says where their ranks run (a one-GPU machine: on the CPU, the GPU idle); progress lines of every rank."""
import ast
import pathlib
import re

import pytest
import torch

import labkit.launch as launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module", ["labkit/tensor_parallel.py", "labkit/pipeline_parallel.py", "labkit/zero.py",
                                    "labkit/launch.py", "labkit/collectives.py", "labkit/scripts/tensor_parallel.py", "labkit/scripts/pipeline_parallel.py",
                                    "labkit/scripts/zero_scratch.py", "labkit/scripts/fsdp_production.py",
                                    "labkit/scripts/ddp_buckets.py", "labkit/scripts/chain.py"])
def test_named_functions_over_lambdas(module):
    tree = ast.parse((ROOT / module).read_text())
    lambdas = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Lambda)]
    assert not lambdas, f"{module}: lambdas on lines {lambdas}"


@pytest.mark.parametrize("gpus, nproc, backend, says", [
    (0, 2, "gloo", "2 ranks on 0 GPU(s): the ranks are CPU processes and talk over gloo. Sharding"),
    (1, 2, "gloo", "the GPU does nothing in them"),
    (3, 4, "gloo", "the 3 GPUs do nothing in them"),
    (2, 2, "nccl", "one GPU per rank, NCCL"),
])
def test_where_ranks_run_says_which_backend_and_what_idles(monkeypatch, gpus, nproc, backend, says):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert launch.backend_for(nproc)[0] == backend
    assert says in launch.where_ranks_run(nproc)


def test_progress_of_every_rank_names_it(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    launch.progress("loaded", every_rank=True)
    launch.progress("only rank 0 says this")
    assert capsys.readouterr().out == "[labkit progress] rank 1: loaded\n"


def test_the_notebooks_show_code_with_lk_show_and_call_no_private_name():
    import nbformat
    for name in ("09_tensor_and_pipeline_parallelism", "10_zero_and_fsdp"):
        nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "inspect.getsource" not in code and "Code(" not in code, name
        private = re.findall(r"(?<![A-Za-z0-9_])(?:zero|tensor_parallel|pipeline_parallel|launch|lk)\.(?:\w+\.)*_[a-z]\w*", code)
        assert not private, (name, "private labkit names", private)
        long = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and len(c.source.splitlines()) > 30]
        assert not long, (name, "cells over 30 lines", long)


def test_progress_lines_two_ranks_ran_together_are_shown_apart(capsys):
    from labkit import launch
    lines = []
    launch._forward(iter(["[labkit progress] rank 0: torch loaded[labkit progress] rank 1: torch loaded\n",
                          "other output\n"]), lines)
    out = capsys.readouterr().out
    assert out.count("torch loaded") == 2 and "[labkit progress]" not in out and "other output" not in out
    assert len(lines) == 2
