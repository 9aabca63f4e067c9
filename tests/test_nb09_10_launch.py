"""labkit.parallel split along its ideas (issue 29): the layers stay, the torchrun launcher moved to labkit.launch and
the collective counter to labkit.collectives, and every old name still works; where_ranks_run says plainly where
the ranks of notebooks 09 and 10 run (a one-GPU machine: on the CPU, the GPU idle); progress lines of every rank."""
import ast
import pathlib
import re

import pytest
import torch

import labkit.collectives as collectives
import labkit.launch as launch
import labkit.parallel as parallel
import labkit.zero as zero

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_old_names_are_the_new_objects():
    for name in ("launch", "init", "finish", "progress", "write_result", "_free_port", "_alive"):
        assert getattr(parallel, name) is getattr(launch, name), name
    assert parallel.process_group_calls is collectives.process_group_calls
    assert parallel._Copy is parallel.CopyToParallel and parallel._Reduce is parallel.ReduceFromParallel
    assert parallel._all_reduce is parallel.counted_all_reduce and parallel._shard is parallel.shard_weight
    assert zero.Zero._local_grad is zero.Zero.local_grad and zero.Zero._pack is zero.Zero.pack
    assert zero._all_gather is zero.all_gather and zero._reduce_scatter is zero.reduce_scatter
    assert zero._Gather is zero.Gather


def test_the_layers_module_no_longer_holds_a_subprocess():
    tree = ast.parse((ROOT / "labkit" / "parallel.py").read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not imported & {"subprocess", "signal", "socket", "threading", "tempfile"}, imported
    assert set(parallel.__all__) >= {"CopyToParallel", "ReduceFromParallel", "ColumnParallelLinear", "RowParallelLinear",
                                     "gpipe", "one_f_one_b", "replay", "launch"}


@pytest.mark.parametrize("module", ["labkit/parallel.py", "labkit/zero.py", "labkit/launch.py", "labkit/collectives.py",
                                    "labkit/scripts/tensor_parallel.py", "labkit/scripts/pipeline_parallel.py",
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
        private = re.findall(r"(?<![A-Za-z0-9_])(?:zero|par|parallel|launch|lk)\.(?:\w+\.)*_[a-z]\w*", code)
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
