"""labkit.engines: the engines run in their own processes, agree with eager, and skip what is absent; bad engine
lists and arguments are refused before any work; each run has a folder of its own and the malloc it was told
(notebook 11's page faults, counted, never timed)."""
import mmap
import pathlib
import subprocess
import tempfile

import numpy as np
import pytest
import torch

import labkit as lk
from labkit import engines
from labkit.scripts import engine_run


@pytest.fixture
def no_subprocess(monkeypatch):
    """Any engine process started fails the test: the refusals must come before the first run."""
    def refuse(*a, **k):
        raise AssertionError("an engine ran before the arguments were checked")
    monkeypatch.setattr(subprocess, "run", refuse)


def test_batch_norms_carry_statistics_as_a_trained_network_does():
    """A fresh batch norm in eval mode is the identity (mean 0, var 1, gamma 1, beta 0): folding it into the
    convolution before it would change nothing that a check could see."""
    norms = [m for m in engines.build("resnet-tiny").modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 17
    for norm in norms:
        assert norm.running_mean.abs().max() > 0 and (norm.running_var - 1).abs().max() > 0.05
        assert (norm.weight - 1).abs().max() > 0 and norm.bias.abs().max() > 0
    again = [m for m in engines.build("resnet-tiny").modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert torch.equal(again[3].running_var, norms[3].running_var)       # the same seed, the same model


def test_setup_cpu_compile_silences_the_cuda_home_notice():
    """A CUDA build of torch without a usable GPU logs "No CUDA runtime is found, using CUDA_HOME=..." when
    Inductor's C++ builder imports torch.utils.cpp_extension and a CUDA toolkit is found. Stood in for here:
    a child process whose torch says it was built with CUDA, with CUDA_HOME set (the first thing it looks at)."""
    import os
    import subprocess
    import sys
    first = "import sys, torch, torch._inductor.config\nfrom labkit import engines\n"     # before the stand-in
    fake = ("torch.cuda._is_compiled = lambda: True; torch.cuda.is_available = lambda: False\n"
            "torch.version.cuda = '13.0'\nassert 'torch.utils.cpp_extension' not in sys.modules\n")
    env = dict(os.environ, CUDA_HOME=os.getcwd())
    plain = subprocess.run([sys.executable, "-c", first + fake + "import torch.utils.cpp_extension"],
                           env=env, capture_output=True, text=True)
    assert "No CUDA runtime is found" in plain.stderr, plain.stderr      # the stand-in shows the notice...
    quiet = subprocess.run([sys.executable, "-c", first + fake + "engines.setup_cpu_compile()\n"
                            "assert 'torch.utils.cpp_extension' in sys.modules\n"
                            "assert torch._inductor.config.compile_threads == 1"],
                           env=env, capture_output=True, text=True)
    assert quiet.returncode == 0 and "No CUDA runtime" not in quiet.stderr, quiet.stderr   # ...which this silences


def test_resnet_50_is_resnet_50():
    # transformers' default ResNetConfig is ResNet-50: bottleneck blocks 3-4-6-3, torchvision's 25,557,032 parameters
    from transformers import ResNetConfig, ResNetForImageClassification
    cfg = ResNetConfig(**engines.MODELS["resnet-50"])
    assert list(cfg.depths) == [3, 4, 6, 3] and cfg.layer_type == "bottleneck"
    with torch.device("meta"):
        model = ResNetForImageClassification(cfg)
    assert sum(p.numel() for p in model.parameters()) == 25_557_032


def test_tensorrt_is_skipped_with_the_install_command(monkeypatch):
    monkeypatch.setattr(engines, "has", lambda name: name == "cuda")      # a GPU, but no TensorRT
    result = engines.run("tensorrt", device="cuda")
    assert not result.ran and result.latency_s is None
    assert "pip install" in result.skipped and "https://pypi.nvidia.com" in result.skipped
    assert "torch-tensorrt==2.13" in result.skipped
    on_cpu = engines.run("tensorrt", device="cpu")
    assert not on_cpu.ran and "GPU" in on_cpu.skipped


def test_tensorrt_needs_both_packages(monkeypatch):
    monkeypatch.setattr(engines, "has", lambda name: name in ("cuda", "tensorrt"))
    ok, why = engines.available("tensorrt", "cuda")
    assert not ok and "Torch-TensorRT" in why
    monkeypatch.setattr(engines, "has", lambda name: True)
    assert engines.available("tensorrt", "cuda") == (True, "")


def test_tensorrt_gets_an_fp16_model_not_a_precision_flag(monkeypatch, tmp_path):
    """With explicit typing (Torch-TensorRT's mixed-precision guide) an fp16 engine comes from an fp16 model:
    labkit gives 2.10 and later an fp16 model and no precision flag, earlier versions the flag too.
    Stood in for on a CPU: a torch_tensorrt module that records what compile() was given."""
    import sys
    import types
    given = {}

    def compile(model, **kwargs):
        given.update(model_dtype=next(model.parameters()).dtype, **kwargs)
        return model

    for version, wants_flag in (("2.11.0+cu130", False), ("2.13.0", False), ("2.9.0", True)):
        given.clear()
        fake = types.SimpleNamespace(__version__=version, compile=compile, save=lambda *a, **k: None)
        monkeypatch.setitem(sys.modules, "torch_tensorrt", fake)
        args = types.SimpleNamespace(model="resnet-tiny", batch=1, image=32, device="cpu", fp16=1, tag="trt")
        pixels = engines.example_input(1, 32).numpy()
        _, x, _ = engine_run.prepare("tensorrt", pixels, args, tmp_path)
        assert given["model_dtype"] == torch.float16 and x.dtype == torch.float16 and given["inputs"][0] is x
        assert ("enabled_precisions" in given) == wants_flag, (version, given)
    assert engine_run.tensorrt_precision("2.13.0", fp16=False) == {}


def test_onnxruntime_and_eager_agree_and_tensorrt_is_skipped(tmp_path):
    # 192x192: the arena keeps about 3.4 MiB against 0.45 MiB without it, well clear of the ~1 MiB RSS noise
    # that made 128x128 (1.4 vs 0.5-1.1 MiB) fail once in a fresh clone
    results = engines.compare(["onnxruntime", ("onnxruntime", {"arena": False}), "tensorrt"], model="resnet-tiny",
                              batch=2, image=192, repeat=2, workdir=tmp_path)
    assert list(results) == ["eager", "onnxruntime", "onnxruntime arena=False", "tensorrt"]
    eager, ort, trt = results["eager"], results["onnxruntime"], results["tensorrt"]
    assert not trt.ran and trt.max_abs_diff is None
    assert eager.max_abs_diff == 0.0 and ort.max_abs_diff < 1e-3
    assert np.load(ort.output).shape == (2, 1000)
    assert eager.imported_torch and not ort.imported_torch       # serving the .onnx file needs no PyTorch
    assert ort.loaded_bytes < eager.loaded_bytes / 2
    import onnx
    from onnx import numpy_helper
    weights = sum(t.numel() * t.element_size() for t in engines.build("resnet-tiny").state_dict().values())
    stored = sum(numpy_helper.to_array(t).nbytes for t in onnx.load(ort.artifact).graph.initializer)
    assert 0.9 < stored / weights <= 1 and stored < ort.artifact_bytes     # the weights, batch norms folded in
    graph = onnx.load(ort.artifact).graph
    assert not [n for n in graph.node if n.op_type == "BatchNormalization"]
    assert all(len(n.input) == 3 for n in graph.node if n.op_type == "Conv")   # each gained the batch norm's shift
    assert len(list(tmp_path.glob("*.onnx"))) == 1                  # arena on and off share one export
    for r in (eager, ort, results["onnxruntime arena=False"]):
        assert r.latency_s > 0 and len(r.times) == 2 and r.loaded_bytes > 0
        assert len(r.cpu_times) == len(r.faults) == 2 and r.cpu_s > 0 and sum(r.faults) == r.minor_faults
        assert r.gpu_extra_bytes is None                               # on the CPU
        assert 0 <= r.kept_bytes <= r.extra_peak_bytes + 2**20     # RSS moves in pages between reads
    no_arena = results["onnxruntime arena=False"]
    assert ort.arena and not no_arena.arena
    assert no_arena.kept_bytes < ort.kept_bytes / 2   # freed blocks go back (malloc_trim) unless an arena holds them
    assert all(r.malloc_trimmed and r.minor_faults >= 0 for r in (eager, ort, no_arena))


def test_inductor_and_aotinductor_engines_agree_with_eager(tmp_path):
    """The two engines that build C++ with gcc (about a minute of one core, cold): the notebook runs them on
    the ResNet at full size only, so this is where they are checked on a CPU."""
    results = engines.compare(["inductor", "aoti"], model="resnet-tiny", batch=1, image=32, repeat=2,
                              workdir=tmp_path)
    assert list(results) == ["eager", "inductor", "aoti"] and all(r.ran for r in results.values())
    aoti = results["aoti"]
    assert aoti.artifact.endswith(".pt2") and aoti.artifact_bytes > 0     # the package a server loads
    assert results["inductor"].artifact is None                            # compiled in the process, no file
    for r in results.values():
        assert r.max_abs_diff < 1e-3 and np.load(r.output).shape == (1, 1000)


@pytest.mark.skipif(not (lk.has("cuda") and lk.has("tensorrt") and lk.has("torch_tensorrt")),
                    reason="Torch-TensorRT needs an NVIDIA GPU and NVIDIA's packages")
def test_tensorrt_fp16_matches_eager(tmp_path):
    results = engines.compare([("tensorrt", {"fp16": True})], model="resnet-tiny", batch=1, image=64,
                              device="cuda", workdir=tmp_path, rtol=5e-2, atol=5e-2)
    assert results["tensorrt fp16=True"].ran and results["tensorrt fp16=True"].artifact_bytes > 0


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="engine must be one of .*'warp'"):
        engines.run("warp")
    with pytest.raises(ValueError, match="model must be one of .*'resnet-7'"):
        engines.run("eager", model="resnet-7")
    with pytest.raises(ValueError, match="repeat must be .*, got 0"):
        engines.run("eager", repeat=0)
    with pytest.raises(ValueError, match="batch must be .*, got 0"):
        engines.example_input(batch=0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        engines.run("eager", device="tpu")
    with pytest.raises(ValueError, match="onnxruntime runs the fp32 export, got fp16=True"):
        engines.run("onnxruntime", fp16=True)


@pytest.mark.parametrize("bad, err, says", [
    ("onnxruntime", TypeError, r"engines must be a list of engine names .* got 'onnxruntime'"),
    (["eager", "onnxrutime"], ValueError, r"engine must be one of .* got 'onnxrutime'"),
    ([("inductor", "fast")], TypeError, r"each engine must be a name or a \(name, \{options\}\) pair, got \('inductor', 'fast'\)"),
    ([("eager", {"speed": 2})], TypeError, "run\\(\\) has no option 'speed'"),
    ([("onnxruntime", {"fp16": True})], ValueError, "onnxruntime runs the fp32 export, got fp16=True"),
    ([3], TypeError, "each engine must be a name .* got 3"),
])
def test_bad_engines_are_refused_before_eager_runs(no_subprocess, bad, err, says):
    with pytest.raises(err, match=says):
        engines.compare(bad)


def test_bad_run_arguments_are_refused_before_any_work(no_subprocess):
    with pytest.raises(ValueError, match="model must be one of .* got 'resnet-9'"):
        engines.compare(["eager"], model="resnet-9")
    with pytest.raises(ValueError, match="engine must be one of .* got 'tensorrtt'"):
        engines.run("tensorrtt")


def test_malloc_mmap_threshold_is_checked_before_any_work(no_subprocess):
    with pytest.raises(ValueError, match="malloc_mmap_threshold must be .*, got '64k'"):
        engines.run("eager", malloc_mmap_threshold="64k")
    with pytest.raises(ValueError, match="malloc_mmap_threshold must be .* got -1"):
        engines.compare([("eager", {"malloc_mmap_threshold": -1})])


def test_each_workdir_is_a_folder_of_its_own():
    a, b = engines.workdir(), engines.workdir()
    assert a != b and a.is_dir() and b.is_dir() and a.parent == pathlib.Path(tempfile.gettempdir())


def test_run_without_a_workdir_leaves_no_folder_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))      # a temp dir no other process writes to
    r = engines.run("eager", repeat=1)
    assert list(tmp_path.iterdir()) == []
    assert r.ran and r.values.shape == (1, 1000) and r.output is None and r.artifact is None


def test_peak_rss_can_be_reset():
    now, peak = engine_run.rss()
    assert 0 < now <= peak
    block = mmap.mmap(-1, 64 * 2**20)        # 64 MiB of fresh pages (malloc might reuse resident free ones)...
    for _ in range(64):
        block.write(b"\x01" * 2**20)         # ...written, then unmapped: the high-water mark stays up...
    block.close()
    assert engine_run.rss()[1] >= now + 60 * 2**20
    engine_run.reset_peak()                  # ...until reset to the current resident size
    assert engine_run.rss()[1] < now + 60 * 2**20


def test_malloc_trim_gives_back_the_free_pages_malloc_keeps():
    """300 blocks of 100 KB (below glibc's mmap threshold: they come from the heap), all freed but the last, which
    pins the heap's top so glibc cannot shrink it by itself: their pages stay resident until malloc_trim(0)."""
    import ctypes
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(100_000) for _ in range(300)]
    for b in blocks:
        ctypes.memset(b, 1, 100_000)           # touch every page: now resident
    for b in blocks[:-1]:
        libc.free(b)
    before = engine_run.rss()[0]
    assert engine_run.give_back_free_pages()
    after = engine_run.rss()[0]
    libc.free(blocks[-1])
    assert before - after > 20 * 2**20, f"RSS {before} -> {after}: malloc kept its free pages"


@pytest.mark.parametrize("threshold", [None, 65536])
def test_every_engine_runs_the_same_malloc_unless_told(monkeypatch, tmp_path, threshold):
    """An MALLOC_MMAP_THRESHOLD_ the caller's shell set does not reach the engine's process (it would time one
    engine under another malloc than the next); malloc_mmap_threshold sets it for that one run."""
    seen = {}

    def capture(args, env, **kwargs):
        seen.update(env)
        raise KeyboardInterrupt                     # stop before anything runs
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1234")
    monkeypatch.setattr(subprocess, "run", capture)
    with pytest.raises(KeyboardInterrupt):
        engines.run("eager", workdir=tmp_path, malloc_mmap_threshold=threshold)
    assert seen.get("MALLOC_MMAP_THRESHOLD_") == (None if threshold is None else str(threshold))
    assert seen["OMP_NUM_THREADS"] == "1"


def test_unmapping_every_freed_block_costs_eager_page_faults_on_every_call():
    results = engines.compare(["eager", ("eager", {"malloc_mmap_threshold": 65536})], model="resnet-tiny",
                              batch=4, image=128, repeat=3)
    plain, unmapped = results["eager"], results["eager malloc_mmap_threshold=65536"]
    assert plain.malloc_mmap_threshold is None and unmapped.malloc_mmap_threshold == 65536
    # unmapped, each large tensor is new pages on every call: a threshold set by hand stops glibc from raising
    # it, so these faults do not depend on the process's history (about 3,300 per call here, three runs).
    # At glibc's defaults the thresholds adapt as mapped blocks are freed: the plain run's faults move from run
    # to run (0 to several hundred per call, mostly in the first), so it is held to a share of them only.
    assert min(unmapped.faults) > 1000, unmapped.faults
    assert unmapped.minor_faults > 2 * plain.minor_faults, (plain.faults, unmapped.faults)
    assert unmapped.max_abs_diff == 0.0                   # the same arithmetic, another malloc


def test_eager_faults_come_from_malloc_giving_its_heap_back(monkeypatch):
    """Notebook 11 prints page faults per eager call at the default malloc: after each call the freed tensors
    leave glibc's heap top free, past its trim threshold, and free() hands those pages back (and blocks above the
    mmap threshold are unmapped). With neither (a 32 MiB mmap threshold, an unreachable trim threshold) the same
    calls mostly fault no pages at all. The default thresholds are set explicitly (128 KiB each): left alone,
    glibc raises them as it sees large mapped blocks freed, so what a process does depends on its history (one
    run in five here faulted no page after its first call)."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))     # engines.run passes the environment on
    plain = engines.run("eager", model="resnet-tiny", batch=8, image=128, repeat=6, malloc_mmap_threshold=128 * 1024)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(2**40))
    kept = engines.run("eager", model="resnet-tiny", batch=8, image=128, repeat=6, malloc_mmap_threshold=2**25)
    # every call faults again at the default; with the thresholds raised, calls fault nothing (a few still fault
    # some pages: here one call in six faulted 513, on an AVX512 CI machine the first three faulted 256 each)
    assert min(plain.faults) > 200 and sum(f < 50 for f in kept.faults) >= 2, (plain.faults, kept.faults)


def test_no_codegen_backend_hands_over_the_backward_graph():
    graphs = []
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.SiLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=engines.no_codegen_backend(graphs))
    compiled(x).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    layer(x).sum().backward()
    for g, p in zip(got, layer.parameters()):
        torch.testing.assert_close(g, p.grad)
    assert len(graphs) == 1
    inputs = [n.name for n in graphs[0].nodes if n.op == "placeholder"]
    assert any(n.startswith("tangents") for n in inputs) and any(n.startswith("primals") for n in inputs)
    torch._dynamo.reset()


@pytest.mark.skipif(not lk.has("cuda"), reason="CUDA graphs need a CUDA GPU")
def test_cuda_graph_decode_keeps_a_private_pool():
    model = lk.models.build("llama-2-7b", "tiny", dtype=torch.float32, device="cuda", num_hidden_layers=2).eval()
    r = engines.cuda_graph_decode(model, repeat=5)
    assert r["private_pool_bytes"] > 0 and r["eager_s"] > 0 and r["graph_s"] > 0 and r["compiled_s"] > 0
