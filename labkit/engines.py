"""One model, several inference engines, each in a fresh subprocess: latency, extra memory, same outputs.

Engines (ENGINES): "eager" (PyTorch), "inductor" (`torch.compile`), "aoti" (AOTInductor:
`torch.export` + `torch._inductor.aoti_compile_and_package`, a C++ library loaded without Python
tracing), "onnxruntime" (`torch.onnx.export(..., dynamo=True)` then an ONNX Runtime session) and
"tensorrt" (Torch-TensorRT: `torch_tensorrt.compile(model, ir="dynamo", ...)`, CUDA only).

Why a subprocess per engine: each one's memory is then its own. The process's resident set (RSS)
is read after the model and the engine are loaded ("loaded"), its high-water mark is reset (Linux
`/proc/self/clear_refs`), and after the timed runs the new high-water mark minus "loaded" is what
running costs on top (`extra_peak_bytes`); what stays resident after the runs (`kept_bytes`) shows a
memory arena that keeps its blocks (ONNX Runtime's `enable_cpu_mem_arena`). glibc's malloc is told to
give every freed block above 64 KiB back to the system (`MALLOC_MMAP_THRESHOLD_`), so that what stays
is what the engine keeps, not what malloc happens to cache; that costs page faults on every large
allocation, so latencies are those of an engine without a caching malloc. One thread each, so
that engines are compared on equal terms. Every engine reads the same input file and writes its output
as a file; `compare()` checks them against eager's. ONNX Runtime runs the file that the caller
exported (`export_onnx`): its process imports onnxruntime and NumPy, never PyTorch, as a server would.

Models (MODELS) are transformers' ResNet (`ResNetForImageClassification`, random weights): its default
`ResNetConfig()` is ResNet-50 (bottleneck blocks, depths 3-4-6-3); "resnet-tiny" keeps the
architecture with one block per stage and narrow channels, so that exporting and compiling fit a
CPU's minute. (torchvision's resnet50 would be the usual source, but the PyPI torchvision wheel
does not import beside the CPU-only torch that this workbook installs.)
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

from .device import has

__all__ = ["ENGINES", "MODELS", "EngineResult", "available", "build", "example_input", "export_onnx", "run",
           "compare", "workdir", "TENSORRT_INSTALL"]

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
    """The model (random weights from `seed`), in eval mode, as a module from pixels to logits."""
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
    return Logits(ResNetForImageClassification(ResNetConfig(**MODELS[model]))).eval()


def example_input(batch=1, image=64, seed=1):
    """A batch of random images, (batch, 3, image, image) fp32."""
    import torch
    for name, value in (("batch", batch), ("image", image)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
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


def _check(engine, model, device, repeat, fp16):
    """The arguments of one run, checked before any work."""
    if not isinstance(engine, str) or engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {model!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    if fp16 and engine == "onnxruntime":
        raise ValueError("fp16 is for the PyTorch engines and TensorRT; onnxruntime runs the fp32 export, got fp16=True")


def run(engine, model="resnet-tiny", batch=1, image=64, repeat=5, arena=True, device="cpu", fp16=False,
        workdir=None, timeout=900):
    """Run `model` through `engine` in a fresh Python process; returns an EngineResult.

    An engine that cannot run here (see `available`) returns at once with `skipped` saying why.
    arena: ONNX Runtime's CPU memory arena on or off (other engines ignore it).
    fp16: build the engine in half precision (TensorRT's `enabled_precisions`; GPU only).
    workdir: where the input, exported files and outputs go, kept there (`lk.engines.workdir()` gives a folder
    of its own); an ONNX file already there for the same model and shape is reused, so arena on and off
    export once. Default: a temporary folder removed before `run` returns; the output is then in
    `result.values` and `output`/`artifact` are None (`artifact_bytes` says how large the file was).
    """
    _check(engine, model, device, repeat, fp16)
    pixels = example_input(batch, image)                  # checks batch and image
    ok, why = available(engine, device)
    if not ok:
        return EngineResult(engine, model, skipped=why, arena=arena, device=device)
    if workdir is None:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="labkit-engines-"))
        try:
            result = _run(engine, model, batch, image, repeat, arena, device, fp16, tmp, timeout, pixels)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        result.output = result.artifact = None
        return result
    return _run(engine, model, batch, image, repeat, arena, device, fp16, pathlib.Path(workdir), timeout, pixels)


def _run(engine, model, batch, image, repeat, arena, device, fp16, workdir, timeout, pixels):
    import numpy as np
    workdir.mkdir(parents=True, exist_ok=True)
    shape = f"{model}-b{batch}-i{image}"
    np.save(workdir / f"input-{shape}.npy", pixels.numpy())      # the same images for every engine
    export_s = 0.0
    if engine == "onnxruntime" and not (workdir / f"{shape}.onnx").exists():
        export_s = export_onnx(model, batch, image, workdir / f"{shape}.onnx")
    tag = f"{engine}-{shape}-{device}{'-fp16' if fp16 else ''}{'' if arena else '-noarena'}"
    script = pathlib.Path(__file__).resolve().parent / "scripts" / "engine_run.py"   # a file, not `-m labkit...`:
    args = [sys.executable, str(script), "--engine", engine, "--model", model,         # importing labkit imports torch
            "--batch", str(batch), "--image", str(image), "--repeat", str(repeat), "--arena", str(int(arena)),
            "--device", device, "--fp16", str(int(fp16)), "--workdir", str(workdir), "--tag", tag]
    # MALLOC_MMAP_THRESHOLD_: glibc serves every block above 64 KiB with its own mmap and unmaps it when freed,
    # so memory an engine frees leaves the process and RSS shows what the engine holds (an arena's blocks);
    # by default glibc keeps freed heap pages resident and raises its threshold as it goes: noise of MiBs.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               MALLOC_MMAP_THRESHOLD_=str(64 * 1024))
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"engine {engine!r} on {model!r} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = EngineResult(**json.loads((workdir / f"{tag}.json").read_text()))
    result.build_s += export_s
    result.values = np.load(result.output) if result.output else None
    return result


def compare(engines, rtol=1e-3, atol=1e-4, **kwargs):
    """`run` each engine (names, or (name, {options}) pairs); every output is checked against eager's.

    Returns {label: EngineResult}; eager runs first (added if missing); `kwargs` go to every `run`.
    Every name and option is checked before the first engine runs. Without `workdir` the runs share a
    temporary folder removed at the end (outputs in `.values`); pass `workdir=lk.engines.workdir()` to keep
    the exported files for inspection.
    Each result's `max_abs_diff` is its largest difference from eager; beyond `rtol` plus `atol` times
    eager's largest output (random weights give logits of any scale) it raises AssertionError.
    fp32 engines reorder sums (fused kernels, other convolution algorithms), hence the tolerance;
    pass a looser one for fp16.
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
        _check(name, o.get("model", "resnet-tiny"), o.get("device", "cpu"), o.get("repeat", 5), o.get("fp16", False))
    if not any(name == "eager" and not opts for name, opts in wanted):
        wanted.insert(0, ("eager", {}))
    own = kwargs.get("workdir") is None
    folder = pathlib.Path(tempfile.mkdtemp(prefix="labkit-engines-")) if own else None
    results = {}
    try:
        for name, opts in wanted:
            label = name + "".join(f" {k}={v}" for k, v in opts.items())
            results[label] = run(name, **{**kwargs, **opts, **({"workdir": folder} if own else {})})
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
