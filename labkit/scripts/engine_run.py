"""One engine, one model, one process (started by `labkit.engines.run`): build, time, measure, save.

Reads <workdir>/input-<model>-b<batch>-i<image>.npy; writes <workdir>/<tag>.json (the fields of
`labkit.engines.EngineResult`) and <tag>.npy (the output, fp32). Before each reading of its resident
memory it asks glibc to give back the free pages malloc keeps (`give_back_free_pages`); it counts the
minor page faults of the timed calls (`resource.getrusage`: pages touched for the first time). On a GPU it
reads the device's free memory once its CUDA context exists and again after the calls (`gpu_extra_bytes`).
ONNX Runtime runs the .onnx file that `labkit.engines.run` exported beside the input: that process imports
onnxruntime and NumPy only.
"""
import argparse
import contextlib
import gc
import json
import pathlib
import resource
import statistics
import sys
import time
import warnings

import numpy as np


def rss():
    """(resident bytes now, high-water mark) of this process, from /proc/self/status (Linux)."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                found[key] = int(value.split()[0]) * 1024          # kB
    return found["VmRSS"], found["VmHWM"]


def file_backed():
    """Resident bytes of this process that are pages of files (libraries' code and data read from disk: RssFile)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssFile:"):
                return int(line.split(":")[1].split()[0]) * 1024
    return 0


def give_back_free_pages():
    """Ask glibc's malloc to return the free pages it keeps to the system (`malloc_trim(0)`), so that RSS
    shows what the engine holds rather than what malloc caches for later; False where there is no glibc."""
    import ctypes
    try:
        trim = ctypes.CDLL(None).malloc_trim      # the process's own symbols: glibc's, if it is glibc
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


def reset_peak():
    """Reset the high-water mark to the current RSS (Linux >= 4.0: write 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def gpu_free(on_gpu):
    """Free bytes on the whole GPU now (`torch.cuda.mem_get_info`; the first call creates this process's CUDA
    context), or None when the engine does not run on a GPU."""
    if not on_gpu:
        return None
    import torch
    return torch.cuda.mem_get_info()[0]


def tensorrt_precision(version, fp16):
    """The precision keyword for torch_tensorrt.compile, by Torch-TensorRT's version. Its mixed-precision guide
    (docs.pytorch.org/TensorRT/user_guide/mixed_precision.html): with weak typing (TensorRT before 10.12) the
    builder picks each layer's kernel by speed, and enabled_precisions={torch.half} lets it pick fp16; with
    explicit typing each layer runs in the dtype of the model's own tensors, so an fp16 engine is built from an
    fp16 model (`prepare` calls model.half()). labkit passes the keyword only before 2.10 and nothing after,
    where explicit typing is the default and the keyword is not needed."""
    import re

    import torch
    major, minor = (int(n) for n in re.findall(r"\d+", version)[:2])
    return {"enabled_precisions": {torch.half}} if fp16 and (major, minor) < (2, 10) else {}


def prepare(engine, pixels, args, workdir):
    """The engine's callable, its input, and the file it runs from (None for eager and inductor)."""
    shape = f"{args.model}-b{args.batch}-i{args.image}"
    if engine == "onnxruntime":                # no PyTorch in this process: the exported file is the model
        import onnxruntime as ort
        path = workdir / f"{shape}.onnx"
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.enable_cpu_mem_arena = bool(args.arena)
        gpu = args.device == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
        providers = (["CUDAExecutionProvider"] if gpu else []) + ["CPUExecutionProvider"]
        session = ort.InferenceSession(str(path), options, providers=providers)
        name = session.get_inputs()[0].name
        args.ran_on = "cuda" if gpu else "cpu"        # the CPU-only onnxruntime wheel runs on the CPU
        return lambda x: session.run(None, {name: x})[0], pixels, path

    import torch
    from labkit import engines
    model = engines.build(args.model).to(args.device)
    x = torch.from_numpy(pixels).to(args.device)
    if args.fp16:                              # fp16 weights and input, TensorRT's too: it keeps the model's types
        model, x = model.half(), x.half()
    if engine == "eager":
        return model, x, None
    if engine == "inductor":
        return torch.compile(model), x, None
    if engine == "aoti":
        path = workdir / f"{args.tag}.pt2"
        program = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path))
        return torch._inductor.aoti_load_package(str(path)), x, path
    if engine == "tensorrt":
        # Torch-TensorRT's documented dynamo path (https://docs.pytorch.org/TensorRT/), TensorRT's integration
        # in the PyTorch organisation. NVIDIA-AI-IOT's torch2trt(model, [x], fp16_mode=True,
        # max_workspace_size=1 << 30) is a separate, older converter.
        import torch_tensorrt
        compiled = torch_tensorrt.compile(model, ir="dynamo", inputs=[x], workspace_size=1 << 30,
                                          **tensorrt_precision(torch_tensorrt.__version__, args.fp16))
        path = workdir / f"{args.tag}.ep"
        torch_tensorrt.save(compiled, str(path), inputs=[x])
        return compiled, x, path
    raise ValueError(f"engine must be one of eager, inductor, aoti, onnxruntime, tensorrt; got {engine!r}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engine", required=True)
    p.add_argument("--model", default="resnet-tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--arena", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fp16", type=int, default=0)
    p.add_argument("--workdir", required=True)
    p.add_argument("--tag", required=True)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")          # exporters' deprecation notes: the parent shows only failures
    import logging
    logging.disable(logging.WARNING)

    workdir = pathlib.Path(args.workdir)
    pixels = np.load(workdir / f"input-{args.model}-b{args.batch}-i{args.image}.npy")
    sync, building, running = (lambda: None), contextlib.nullcontext, contextlib.nullcontext
    if args.engine != "onnxruntime":
        import torch
        torch.set_num_threads(1)
        building, running = torch.no_grad, torch.inference_mode      # exporters trace outside inference mode
        if args.device == "cuda":
            sync = torch.cuda.synchronize
    on_gpu = args.device == "cuda" and args.engine != "onnxruntime"
    bare = gpu_free(on_gpu)                      # on a GPU: the CUDA context exists now, nothing else yet

    start = time.perf_counter()
    with building():
        fn, x, artifact = prepare(args.engine, pixels, args, workdir)
    with running():
        if args.engine == "inductor":
            fn(x)                                # inductor compiles at its first call: part of building it
        sync()
        build_s = time.perf_counter() - start
        gc.collect()
        trimmed = give_back_free_pages()
        loaded, _ = rss()                        # model and engine loaded, nothing run yet (but inductor's compile)
        loaded_file = file_backed()
        reset_peak()
        out = fn(x)                              # warm-up: arenas and workspaces grow here
        sync()
        times, cpu_times, faults = [], [], []
        for _ in range(args.repeat):
            sync()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt   # pages touched for the first time (minor faults)
            t0, c0 = time.perf_counter(), time.process_time()         # wall clock; this process's CPU time
            out = fn(x)
            sync()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        gc.collect()
        give_back_free_pages()                   # what stays is the engine's: an arena's blocks, not malloc's cache
        now, peak = rss()
        served = gpu_free(on_gpu)
        kept_file = file_backed() - loaded_file  # code pages the first calls read in: not the engine's data
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not isinstance(out, np.ndarray):
        out = out.detach().float().cpu().numpy()
    np.save(workdir / f"{args.tag}.npy", out.astype(np.float32))
    result = dict(engine=args.engine, model=args.model, latency_s=statistics.median(times), times=times,
                  build_s=build_s, loaded_bytes=loaded, extra_peak_bytes=max(peak - loaded, 0),
                  cpu_s=statistics.median(cpu_times), cpu_times=cpu_times, minor_faults=sum(faults), faults=faults,
                  kept_bytes=max(now - loaded, 0), malloc_trimmed=trimmed,
                  kept_file_bytes=max(kept_file, 0),
                  gpu_extra_bytes=None if bare is None else bare - served,
                  artifact=str(artifact) if artifact is not None else None,
                  artifact_bytes=artifact.stat().st_size if artifact is not None else None,
                  output=str(workdir / f"{args.tag}.npy"), arena=bool(args.arena),
                  device=getattr(args, "ran_on", args.device), imported_torch="torch" in sys.modules)
    (workdir / f"{args.tag}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
