"""One model, several inference engines, each in a fresh subprocess: latency, extra memory, same outputs.

Engines (ENGINES): "eager" (PyTorch), "inductor" (`torch.compile`), "aoti" (AOTInductor:
`torch.export` + `torch._inductor.aoti_compile_and_package`, a C++ library loaded without Python
tracing), "onnxruntime" (`torch.onnx.export(..., dynamo=True)` then an ONNX Runtime session) and
"tensorrt" (Torch-TensorRT: `torch_tensorrt.compile(model, ir="dynamo", ...)`, CUDA only).

Why a subprocess per engine: each one's memory is then its own. The process's resident set (RSS)
is read after the model and the engine are loaded ("loaded"), its high-water mark is reset (Linux
`/proc/self/clear_refs`), and after the timed runs the new high-water mark minus "loaded" is what
running costs on top (`extra_peak_bytes`); what stays resident after the runs (`kept_bytes`) shows a
memory arena that keeps its blocks (ONNX Runtime's `enable_cpu_mem_arena`).

The allocator under every engine: on a CPU, PyTorch has no caching allocator of its own (the CUDA
caching allocator is for GPU memory): c10's CPU allocator asks the C library's `malloc` (glibc's
`posix_memalign` on Linux) for each tensor and frees it when the tensor dies. glibc's malloc keeps
freed pages in its heap for the next request, so RSS after the calls would show malloc's cache as
well as the engine's. Before each RSS reading, the engine's process asks glibc to give back the free
pages it keeps (`malloc_trim(0)`): "kept" is then what the engine itself holds, while the timed calls
run with malloc as it is by default, the same for every engine. `malloc_mmap_threshold=65536` runs
an engine with glibc's `MALLOC_MMAP_THRESHOLD_` set instead: every block above that many bytes gets
a mapping of its own, unmapped the moment it is freed, so each large allocation costs fresh page
faults (a way to see what malloc's cache saves an engine that allocates per call, such as eager).
One thread each, so that engines are compared on equal terms. Every engine reads the same input file
and writes its output as a file; `compare()` checks them against eager's. ONNX Runtime runs the file
that the caller exported (`export_onnx`): its process imports onnxruntime and NumPy, never PyTorch,
as a server would.

On a GPU (PyTorch engines and TensorRT) the process also reads the device's free memory
(`torch.cuda.mem_get_info`) once its CUDA context exists and again after the calls: the difference,
`gpu_extra_bytes`, is what serving added on the device (weights, the engine, workspaces, library
handles, PyTorch's cached blocks), read device-wide, so it is exact only while nothing else runs there.

Models (MODELS) are transformers' ResNet (`ResNetForImageClassification`, random weights): its default
`ResNetConfig()` is ResNet-50 (bottleneck blocks, depths 3-4-6-3); "resnet-tiny" keeps the
architecture with one block per stage and narrow channels, so that exporting and compiling fit a
CPU's minute. Its batch norms get random statistics, as training leaves them (a fresh one is the
identity, and folding an identity into a convolution would show nothing). (torchvision's resnet50
would be the usual source, but the PyPI torchvision wheel does not import beside the CPU-only torch
that this workbook installs.)

Helpers of notebook 11 live here too, so that its cells stay short: `setup_cpu_compile` (Inductor in
this process on a CPU), `no_codegen_backend` (AOT autograd's partitioner without code generation,
keeping the backward graphs to read) and `cuda_graph_decode` (a decode step recorded as a CUDA graph,
timed against the same compiled kernels launched one by one, with its pool).
"""
from __future__ import annotations

import dataclasses
import json
import os
import atexit
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from .checks import count
from .device import has

__all__ = ["ENGINES", "MODELS", "EngineResult", "available", "build", "example_input", "export_onnx", "run",
           "compare", "workdir", "TENSORRT_INSTALL", "setup_cpu_compile", "no_codegen_backend", "median_time_s",
           "cuda_graph_decode"]

ENGINES = ("eager", "inductor", "aoti", "onnxruntime", "tensorrt")
MODELS = {                      # ResNetConfig's defaults are ResNet-50's layers; ImageNet has 1000 classes
    "resnet-50": dict(num_labels=1000),
    "resnet-tiny": dict(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=16, num_labels=1000),
}
TENSORRT_INSTALL = ('pip install "torch-tensorrt==2.13.*" --extra-index-url https://pypi.nvidia.com '
                    "(on a machine with an NVIDIA GPU and torch 2.13 for CUDA)")


@dataclasses.dataclass
class EngineResult:
    """What one engine did: median latency, memory above the loaded state, its artifact, its output."""
    engine: str
    model: str
    skipped: str | None = None        # why it did not run (then every figure is None)
    latency_s: float | None = None    # median of `repeat` timed calls
    times: list | None = None
    build_s: float | None = None      # export (in the caller, for ONNX Runtime) + compile + load, once
    loaded_bytes: int | None = None   # RSS with the model and the engine loaded, before any call
    extra_peak_bytes: int | None = None   # peak RSS during the calls, above loaded
    kept_bytes: int | None = None     # RSS after the calls, above loaded (what an arena keeps)
    kept_file_bytes: int | None = None    # of kept: pages of files (libraries' code) the calls read in, not data
    cpu_s: float | None = None        # median CPU time of the process per call: the engine's own work, which
    cpu_times: list | None = None     # other processes on a shared machine do not lengthen (one thread each)
    minor_faults: int | None = None   # page faults during the timed calls (pages the process touched anew)
    faults: list | None = None        # the same, call by call
    gpu_extra_bytes: int | None = None    # device memory the process added above its bare CUDA context (GPU only)
    malloc_trimmed: bool | None = None    # whether malloc gave back its free pages before each RSS reading
    malloc_mmap_threshold: int | None = None   # MALLOC_MMAP_THRESHOLD_ of the process (None: glibc's default)
    artifact: str | None = None       # the exported file (.onnx, .pt2, TensorRT program), if any
    artifact_bytes: int | None = None     # its size
    output: str | None = None         # path of the saved output (.npy, fp32)
    max_abs_diff: float | None = None     # against eager's output, filled by compare()
    arena: bool | None = None
    device: str | None = None
    imported_torch: bool | None = None    # whether the engine's process imported PyTorch at all
    values: object = dataclasses.field(default=None, repr=False)   # the output itself (NumPy, fp32)

    @property
    def ran(self):
        return self.skipped is None


def available(engine, device="cpu"):
    """(True, "") if `engine` can run here, else (False, why and what to install)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "onnxruntime" and not (has("onnxruntime") and has("onnx_export")):
        return False, "onnxruntime is not installed (pip install onnxruntime onnx onnxscript)"
    if engine == "tensorrt":
        if device != "cuda" or not has("cuda"):
            return False, "TensorRT runs on NVIDIA GPUs only; this run is on the CPU"
        if not (has("tensorrt") and has("torch_tensorrt")):
            return False, f"Torch-TensorRT is not installed: {TENSORRT_INSTALL}"
    return True, ""


def build(model="resnet-tiny", seed=0):
    """The model (random weights from `seed`), in eval mode, as a module from pixels to logits. Each batch
    norm gets random running statistics and affine weights, as a trained network has them."""
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    class Logits(torch.nn.Module):          # one tensor in, one out: what every exporter wants
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, pixel_values):   # (B, 3, H, W) -> (B, 1000)
            return self.net(pixel_values=pixel_values).logits

    torch.manual_seed(seed)
    net = ResNetForImageClassification(ResNetConfig(**MODELS[model]))
    with torch.no_grad():
        for norm in net.modules():
            if isinstance(norm, torch.nn.BatchNorm2d):         # (C,) each: mean ~0, var in [0.5, 1.5)
                norm.running_mean.normal_(0.0, 0.1)
                norm.running_var.uniform_(0.5, 1.5)
                norm.weight.normal_(1.0, 0.1)
                norm.bias.normal_(0.0, 0.1)
    return Logits(net).eval()


def example_input(batch=1, image=64, seed=1):
    """A batch of random images, (batch, 3, image, image) fp32."""
    import torch
    batch, image = count("batch", batch), count("image", image)
    return torch.randn(batch, 3, image, image, generator=torch.Generator().manual_seed(seed))


def export_onnx(model, batch, image, path):
    """Export `model` (a MODELS name) for a (batch, 3, image, image) input to the ONNX file `path`
    (`torch.onnx.export(..., dynamo=True)`, the exporter's notes silenced); returns the seconds it took."""
    import logging
    import time
    import warnings

    import torch
    start = time.perf_counter()
    net, x = build(model), example_input(batch, image)
    with warnings.catch_warnings(), torch.no_grad():      # exporters trace outside inference mode
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            program = torch.onnx.export(net, (x,), dynamo=True, verbose=False)
        finally:
            logging.disable(logging.NOTSET)
    path = pathlib.Path(path)
    program.save(str(path) + ".part")
    os.replace(str(path) + ".part", path)
    return time.perf_counter() - start


def workdir(prefix="labkit-engines-"):
    """A new folder of its own for engine runs (input, exported files, outputs), in the system's temporary
    directory, removed when this Python process exits. Two sessions (a notebook and a test run in the same
    checkout) never share one, so neither deletes the other's files."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _check(engine, model, device, repeat, fp16, malloc_mmap_threshold=None):
    """The arguments of one run, checked before any work."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    count("repeat", repeat)
    if fp16 and engine == "onnxruntime":
        raise ValueError("fp16 is for the PyTorch engines and TensorRT; onnxruntime runs the fp32 export, got fp16=True")
    if malloc_mmap_threshold is not None:
        count("malloc_mmap_threshold", malloc_mmap_threshold, 0)             # bytes


def run(engine, model="resnet-tiny", batch=1, image=64, repeat=5, arena=True, device="cpu", fp16=False,
        workdir=None, timeout=900, malloc_mmap_threshold=None):
    """Run `model` through `engine` in a fresh Python process; returns an EngineResult.

    An engine that cannot run here (see `available`) returns at once with `skipped` saying why.
    arena: ONNX Runtime's CPU memory arena on or off (other engines ignore it).
    fp16: the model's weights and input in half precision (`model.half()`), for the PyTorch engines and for
    TensorRT, which builds a strongly typed engine: its layers run in the dtypes of the model's tensors.
    malloc_mmap_threshold: None (glibc's malloc as it is by default), or bytes: the process runs with
    `MALLOC_MMAP_THRESHOLD_` set to it, so every freed block above it leaves the process at once (and
    every allocation above it pays fresh page faults; see the module docstring).
    workdir: where the input, exported files and outputs go, kept there (`lk.engines.workdir()` gives a folder
    of its own); an ONNX file already there for the same model and shape is reused, so arena on and off
    export once. Default: a temporary folder removed before `run` returns; the output is then in
    `result.values` and `output`/`artifact` are None (`artifact_bytes` says how large the file was).
    """
    _check(engine, model, device, repeat, fp16, malloc_mmap_threshold)
    pixels = example_input(batch, image)                  # checks batch and image
    ok, why = available(engine, device)
    if not ok:
        return EngineResult(engine, model, skipped=why, arena=arena, device=device)
    if workdir is None:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="labkit-engines-"))
        try:
            result = _run(engine, model, batch, image, repeat, arena, device, fp16, tmp, timeout, pixels,
                          malloc_mmap_threshold)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        result.output = result.artifact = None
        return result
    return _run(engine, model, batch, image, repeat, arena, device, fp16, pathlib.Path(workdir), timeout, pixels,
                malloc_mmap_threshold)


def _run(engine, model, batch, image, repeat, arena, device, fp16, workdir, timeout, pixels, malloc_mmap_threshold):
    import numpy as np
    workdir.mkdir(parents=True, exist_ok=True)
    shape = f"{model}-b{batch}-i{image}"
    np.save(workdir / f"input-{shape}.npy", pixels.numpy())      # the same images for every engine
    export_s = 0.0
    if engine == "onnxruntime" and not (workdir / f"{shape}.onnx").exists():
        export_s = export_onnx(model, batch, image, workdir / f"{shape}.onnx")
    tag = (f"{engine}-{shape}-{device}{'-fp16' if fp16 else ''}{'' if arena else '-noarena'}"
           f"{'' if malloc_mmap_threshold is None else f'-mmap{malloc_mmap_threshold}'}")
    script = pathlib.Path(__file__).resolve().parent / "scripts" / "engine_run.py"   # a file, not `-m labkit...`:
    args = [sys.executable, str(script), "--engine", engine, "--model", model,         # importing labkit imports torch
            "--batch", str(batch), "--image", str(image), "--repeat", str(repeat), "--arena", str(int(arena)),
            "--device", device, "--fp16", str(int(fp16)), "--workdir", str(workdir), "--tag", tag]
    # glibc's malloc as it is by default (the engine's process trims malloc's free pages before reading RSS);
    # with malloc_mmap_threshold, MALLOC_MMAP_THRESHOLD_: every block above it is a mapping of its own,
    # unmapped when freed. An inherited MALLOC_MMAP_THRESHOLD_ is dropped: every engine runs the same malloc.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if malloc_mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"engine {engine!r} on {model!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = EngineResult(**json.loads((workdir / f"{tag}.json").read_text()), malloc_mmap_threshold=malloc_mmap_threshold)
    result.build_s += export_s
    result.values = np.load(result.output) if result.output else None
    return result


def compare(engines, rtol=1e-3, atol=1e-4, progress=False, **kwargs):
    """`run` each engine (names, or (name, {options}) pairs); every output is checked against eager's.

    Returns {label: EngineResult}; eager runs first (added if missing); `kwargs` go to every `run`.
    Every name and option is checked before the first engine runs. Without `workdir` the runs share a
    temporary folder removed at the end (outputs in `.values`); pass `workdir=lk.engines.workdir()` to keep
    the exported files for inspection.
    Each result's `max_abs_diff` is its largest difference from eager; beyond `rtol` plus `atol` times
    eager's largest output (random weights give logits of any scale) it raises AssertionError.
    fp32 engines reorder sums (fused kernels, other convolution algorithms), hence the tolerance;
    pass a looser one for fp16.
    progress: print a line as each engine's process starts and ends (a run takes seconds: import, build, calls).
    """
    import inspect

    import torch
    if isinstance(engines, str) or not isinstance(engines, (list, tuple)):
        raise TypeError(f"engines must be a list of engine names or (name, {{options}}) pairs, like "
                        f"['eager', 'onnxruntime'], got {engines!r}")
    wanted = []
    for e in engines:
        if isinstance(e, str):
            wanted.append((e, {}))
        elif isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[1], dict):
            wanted.append((e[0], dict(e[1])))
        else:
            raise TypeError(f"each engine must be a name or a (name, {{options}}) pair, got {e!r}")
    allowed = set(inspect.signature(run).parameters) - {"engine"}
    for name, opts in wanted:                     # every engine checked before the first one runs
        unknown = sorted((set(opts) | set(kwargs)) - allowed)
        if unknown:
            raise TypeError(f"run() has no option {unknown[0]!r} (options: {sorted(allowed)})")
        o = {**kwargs, **opts}
        _check(name, o.get("model", "resnet-tiny"), o.get("device", "cpu"), o.get("repeat", 5), o.get("fp16", False),
               o.get("malloc_mmap_threshold"))
    if not any(name == "eager" and not opts for name, opts in wanted):
        wanted.insert(0, ("eager", {}))
    own = kwargs.get("workdir") is None
    folder = pathlib.Path(tempfile.mkdtemp(prefix="labkit-engines-")) if own else None
    results = {}
    try:
        for n, (name, opts) in enumerate(wanted, 1):
            label = name + "".join(f" {k}={v}" for k, v in opts.items())
            if progress:
                print(f"[{n}/{len(wanted)}] {label}: starting its process ...", end=" ", flush=True)
            start = time.perf_counter()
            results[label] = run(name, **{**kwargs, **opts, **({"workdir": folder} if own else {})})
            if progress:
                r = results[label]
                print(f"done in {time.perf_counter() - start:.1f} s" if r.ran else f"skipped: {r.skipped}", flush=True)
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
            for r in results.values():
                r.output = r.artifact = None
    reference = torch.from_numpy(results["eager"].values)
    scale = float(reference.abs().max()) or 1.0
    for label, r in results.items():
        if r.ran:
            got = torch.from_numpy(r.values)
            r.max_abs_diff = float((got - reference).abs().max())
            torch.testing.assert_close(got, reference, rtol=rtol, atol=atol * scale,
                                       msg=lambda m, label=label: f"{label} differs from eager: {m}")
    return results


# ---- helpers of notebook 11 ------------------------------------------------------------------------------
def setup_cpu_compile():
    """Set Inductor up to compile on a CPU in this process: one compile thread (no pool of compile workers to
    start), and its C++ builder, `torch.utils.cpp_extension`, imported now with its one-time notice
    silenced: a CUDA build of torch on a machine without a usable GPU logs "No CUDA runtime is found, using
    CUDA_HOME=..." when it finds a CUDA toolkit (nvcc on PATH, /usr/local/cuda), which code for a CPU does
    not need."""
    import logging

    import torch
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1
    if "torch.utils.cpp_extension" not in sys.modules and not torch.cuda.is_available():
        log = logging.getLogger("torch.utils.cpp_extension")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            import torch.utils.cpp_extension  # noqa: F401  (what Inductor's C++ builder imports)
        finally:
            log.setLevel(level)


def no_codegen_backend(graphs, partition=None):
    """A `torch.compile` backend: AOT autograd's joint graph split by `partition` (default: the min-cut
    partitioner that Inductor uses), then every op of the forward and backward graphs run as the plain
    PyTorch op it is (no code generation, no fusion: what the `aot_eager` backend does). Each backward
    graph it makes is appended to the list `graphs` (a `torch.fx.Graph`), to read what the forward saved
    for it: its inputs other than the weights (`primals_*`) and the incoming gradient (`tangents_*`)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    if partition is None:
        partition = min_cut_rematerialization_partition

    def forward_compiler(gm, example_inputs):
        return make_boxed_func(gm.forward)      # the graph's ops, run one by one

    def backward_compiler(gm, example_inputs):
        graphs.append(gm.graph)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=forward_compiler, bw_compiler=backward_compiler, partition_fn=partition)


def median_time_s(fn, repeat=20):
    """Median wall time of `fn()` in seconds over `repeat` calls, each between two
    `torch.cuda.synchronize()` (a launch returns before the GPU is done: CUDA graphs too)."""
    import torch
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cuda_graph_decode(model, repeat=20):
    """One decode step of `model` (a causal LM on CUDA: one token in, logits out, no KV cache) three ways:
    eagerly, compiled by Inductor (`torch.compile(model)`: fused kernels, each launched from Python), and
    compiled with `mode="reduce-overhead"` (Inductor's `triton.cudagraphs`: the same kernels recorded once
    as a CUDA graph and replayed with one launch).

    Returns {"eager_s", "compiled_s", "graph_s", "private_pool_bytes"}: median step times, and the bytes of
    the allocator segments that the recording owns: a private memory pool, any pool other than the default
    `(0, 0)`. compiled_s against graph_s is the launch overhead alone (same kernels); eager_s against
    compiled_s is fusion and launches together.
    """
    import torch
    token = torch.zeros(1, 1, dtype=torch.long, device="cuda")      # a decode-sized step: one token
    compiled = torch.compile(model)
    graphed = torch.compile(model, mode="reduce-overhead")

    def eager_step():
        with torch.no_grad():
            return model(input_ids=token, use_cache=False).logits

    def compiled_step():
        with torch.no_grad():
            return compiled(input_ids=token, use_cache=False).logits

    def graph_step():
        torch.compiler.cudagraph_mark_step_begin()     # a new step: the previous replay's outputs may be reused
        with torch.no_grad():
            return graphed(input_ids=token, use_cache=False).logits

    for _ in range(3):                                 # warm-up runs (compiles), then the recording
        compiled_step()
        graph_step()
    segments = torch.cuda.memory._snapshot()["segments"]
    private = sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) != (0, 0))
    return {"eager_s": median_time_s(eager_step, repeat), "compiled_s": median_time_s(compiled_step, repeat),
            "graph_s": median_time_s(graph_step, repeat), "private_pool_bytes": private}
