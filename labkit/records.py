"""Headline figures a notebook measured (JSON for `make workbook`'s index), the GPU figures of data/gpu/, and
the published figures of data/published.csv.

`record()` saves what a notebook measured in this run, in build/records/. `gpu_figures(check)` and
`show_gpu(check)` read what `make gpu-smoke` measured on real GPUs: one JSON line per check and run in
data/gpu/<gpu>.jsonl (committed), so a notebook on a laptop can show a GPU's figure beside its own, labelled
with the GPU and the date, instead of a number typed into its text. `published(key, ...)` prints a paper's or a
release note's figure with its source and the words quoted, and returns it.
"""
from __future__ import annotations

import csv
import datetime
import difflib
import functools
import json
import math
import numbers
import os
import pathlib
import re

import torch

from .data import DATA_DIR
from .device import size

__all__ = ["record", "published", "RECORDS_DIR", "gpu_figures", "gpu_records", "unwritable", "show_gpu", "GPU_CHECKS", "GPU_RUNS",
           "GPU_DIR", "NOTEBOOKS"]

RECORDS_DIR = pathlib.Path(os.environ.get(
    "LABKIT_RECORDS", pathlib.Path(__file__).resolve().parent.parent / "build" / "records"))
# A checkout reads data/gpu/ at the repository's root, an installed wheel labkit/_data/gpu/ (labkit.data
# decides which, and LABKIT_DATA moves both); LABKIT_GPU_RECORDS moves this folder alone.
GPU_DIR = pathlib.Path(os.environ.get("LABKIT_GPU_RECORDS") or DATA_DIR / "gpu")

# Every check `make gpu-smoke` records (labkit/scripts/gpu_smoke.py runs them in this order), and what it measures.
GPU_CHECKS = {
    "test_gpu": "tests/test_gpu.py: lk.track against the CUDA caching allocator",
    "allocator": "labkit.alloc's model against the real caching allocator (validate_allocator)",
    "flash": "the Triton flash-attention kernel against SDPA, forward and backward: error and TFLOP/s",
    "tf32": "fp32 matmuls with TF32 off and on: TFLOP/s and error",
    "matmul": "the Triton matmul of labkit.kernels against cuBLAS: TFLOP/s",
    "cuda_graphs": "a CUDA graph's private memory pool and launch time against eager",
    "bandwidth": "host-to-device copies from pinned and pageable memory: GB/s",
    "overlap": "a copy on a side stream overlapping compute: time against serial",
    "bnb_4bit": "bitsandbytes 4-bit (NF4) linear layers at batch 1 against bf16",
}
# Then each notebook's full-size steps (its FULL_STEPS), run for real while the smoke test's time remains.
NOTEBOOKS = ("00_start_here", "01_memory_anatomy", "02_mixed_precision", "03_activation_checkpointing",
             "04_cpu_offload", "05_caching_allocator", "06_quantization_qlora", "07_kv_cache_paged_attention",
             "08_flash_attention", "09_tensor_and_pipeline_parallelism", "10_zero_and_fsdp",
             "11_compile_and_engines", "12_profiling_and_kernels", "13_capstone_fit_what_does_not_fit")
GPU_CHECKS.update({nb: f"notebook {nb[:2]}'s largest full-size step (FULL_STEPS) on the GPU, capped at lk.LIMIT "
                       f"(lk.CARD less lk.HEADROOM): whether it fits, peaks tracked, allocated and reserved against the estimate, "
                       f"its time" for nb in NOTEBOOKS})
# `make test-gpu`'s records (labkit/scripts/gpu_run.py): each notebook run whole at full size, and tests/test_gpu.py.
GPU_RUNS = {f"test-gpu:{nb}": f"make test-gpu: notebook {nb[:2]} at full size under nbval, its kernel fenced to lk.LIMIT "
                              f"(21.6 GiB): passed or not, minutes, peak reserved" for nb in NOTEBOOKS}
GPU_RUNS["test-gpu:test_gpu"] = "make test-gpu: tests/test_gpu.py"
_REQUIRED = ("gpu", "date", "check", "torch")


def _clean(key, value):
    """A JSON-safe figure: ints stay exact, other reals become floats, NaN/inf become the text 'nan'/'inf'."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if hasattr(value, "item") and not isinstance(value, (str, bool)) and getattr(value, "shape", None) == ():
        value = value.item()                      # numpy scalars: np.float32(2.5) -> 2.5
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"figure {key} must be a number or a string, got {value!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    value = float(value)                          # Fraction(1, 3) -> 0.333..., not 0
    return value if math.isfinite(value) else str(value)     # standard JSON has no NaN or Infinity


def _previous(path):
    """The record already saved, or {} if there is none or it is unreadable (then kept aside, said so)."""
    if not path.exists():
        return {}
    try:
        previous = json.loads(path.read_text())
        if isinstance(previous, dict):
            return previous
        problem = f"holds a {type(previous).__name__}, not a record"
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"is not valid JSON ({e})"
    backup = path.with_name(f"{path.name}.corrupt-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    path.replace(backup)
    print(f"record: {path} {problem}; kept it as {backup.name} and started a fresh record.")
    return {}


def record(notebook, **figures):
    """Save `figures` (name=number or short text) under the notebook's name; returns the file's path.

    Names ending in `_bytes` are shown in binary units, `_s` in seconds, `_ratio` as "x", `_gap` as a
    signed percentage, `_share` as a percentage. Integers are kept exact, other numbers (numpy,
    Fraction, 0-d tensors) as floats; NaN and infinities are saved as the text "nan"/"inf" (standard
    JSON has no such numbers). A record file that cannot be read is set aside and replaced.
    """
    if not isinstance(notebook, str) or not re.fullmatch(r"[0-9]{2}_[a-z0-9_]+", notebook):
        raise ValueError(f"notebook must be a name like '01_memory_anatomy', got {notebook!r}")
    if not figures:
        raise ValueError("record needs at least one figure, like record('01_x', peak_bytes=123)")
    clean = {key: _clean(key, value) for key, value in figures.items()}
    RECORDS_DIR.mkdir(parents=True, exist_ok=True)
    path = RECORDS_DIR / f"{notebook}.json"
    previous = _previous(path)
    old = previous.get("figures") if previous.get("size") == size() else None
    entry = {"size": size(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
             "torch": torch.__version__, "when": datetime.datetime.now().isoformat(timespec="seconds"),
             "figures": {**old, **clean} if isinstance(old, dict) else clean}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")     # write, then rename: never half a file
    tmp.write_text(json.dumps(entry, indent=1, allow_nan=False))
    tmp.replace(path)
    return path


def _known(check):
    if not isinstance(check, str):
        raise TypeError(f"check must be the name of a GPU check (a str), got {check!r}")
    if check not in GPU_CHECKS and check not in GPU_RUNS:
        raise ValueError(f"check must be one of {', '.join(GPU_CHECKS)} or {', '.join(GPU_RUNS)}; got {check!r}")
    return check


def _folder(folder):
    folder = GPU_DIR if folder is None else folder
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a path to a folder of GPU records (*.jsonl), got {folder!r}")
    folder = pathlib.Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"folder must be a folder of GPU records (*.jsonl), got the file {folder}")
    return folder


def _lines(folder):
    """(file, line number, record) for every line of every data/gpu/*.jsonl; a bad line is an error naming it."""
    for path in sorted(pathlib.Path(folder).glob("*.jsonl")):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e})") from None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number} is not a JSON line ({e})") from None
            missing = [key for key in _REQUIRED if not isinstance(rec, dict) or key not in rec]
            if missing:
                raise ValueError(f"{path}:{number} is not a GPU record: it lacks {', '.join(missing)}")
            odd = {key: rec[key] for key in _REQUIRED if not isinstance(rec[key], str)}
            if odd:
                raise ValueError(f"{path}:{number} is not a GPU record: {', '.join(odd)} must be text, got {odd}")
            yield path, number, rec


def gpu_records(folder=None):
    """Every record of every check in data/gpu/*.jsonl (failed and skipped runs too), oldest first."""
    return sorted((rec for _, _, rec in _lines(_folder(folder))), key=lambda rec: rec["date"])


def gpu_figures(check, *, failed=False, folder=None):
    """The records of one GPU check from data/gpu/*.jsonl, oldest first: dicts with "gpu", "date", "check",
    "torch" and the check's figures. Checks that failed or were skipped are left out unless `failed=True`
    (theirs hold "status" and "error" or "reason" instead of figures)."""
    _known(check)
    out = []
    for _, _, rec in _lines(_folder(folder)):
        if rec["check"] == check and (failed or rec.get("status", "ok") == "ok"):
            out.append(rec)
    return sorted(out, key=lambda rec: rec["date"])


_SKIP = set(_REQUIRED) | {"status", "seconds", "cuda"}


def _shown(rec, keys=None):
    from .units import fmt_figure
    shown = []
    for key in (rec if keys is None else [k for k in keys if k in rec]):
        value = rec[key]
        if key in _SKIP or not isinstance(value, (int, float, str)):      # nested details: gpu_figures has them
            continue
        shown.append(f"{key} {('yes' if value else 'no') if isinstance(value, bool) else fmt_figure(key, value)}")
    return ", ".join(shown) or "(no one-number figures in this record)"


def show_gpu(check, keys=None, *, folder=None):
    """Print each GPU record of `check`, labelled with the GPU and the date, or one line saying there is none.

    keys: the figures to show (default: every one-number figure of the record); a key that no record of
    the check holds is an error. Returns the records (as gpu_figures does), so a cell can print them and use them."""
    if keys is not None:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
            raise TypeError(f"keys must be a list of figure names like ['fwd_tflops'], got {keys!r}")
        keys = list(keys)                          # a generator is read once
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"keys must be a list of figure names like ['fwd_tflops'], got {keys!r}")
    where = _folder(folder)
    recs = gpu_figures(check, folder=where)
    if not recs:
        others = gpu_figures(check, failed=True, folder=where)
        target = "make test-gpu" if check.startswith("test-gpu:") else "make gpu-smoke"     # GPU_RUNS, GPU_CHECKS
        print(f"No GPU record of the check {check!r} exists yet in {_where(where)}: `{target}` on a CUDA GPU "
              f"writes one." + (f" ({len(others)} failed or skipped run(s) of it are there: "
                                f"gpu_figures({check!r}, failed=True) shows why.)" if others else ""))
        return recs
    if keys is not None:
        held = set().union(*(rec.keys() for rec in recs)) - _SKIP
        unknown = [k for k in keys if k not in held]
        if unknown:
            raise ValueError(f"keys {unknown} are in no record of {check!r}; its figures are {sorted(held)}")
    for rec in recs:
        print(f"{rec['gpu']}, {rec['date'][:10]} (torch {rec['torch']}), {check}: {_shown(rec, keys)}")
    return recs


def _where(folder):
    """data/gpu/ as the learner knows it, or the folder LABKIT_GPU_RECORDS / folder= points at."""
    default = pathlib.Path(DATA_DIR / "gpu")
    return "data/gpu/" if folder.resolve() == default.resolve() else str(folder)


def unwritable(folder):
    """Why records cannot be written to `folder` (a file, or a folder this user may not write), or None.
    Creates nothing: the nearest existing folder above must be writable."""
    folder = pathlib.Path(folder)
    if folder.exists() and not folder.is_dir():
        return "it is a file, not a folder"
    existing = next(p for p in [folder, *folder.parents] if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable, so no record could be written"
    return None


@functools.cache
def _published_rows():
    with open(DATA_DIR / "published.csv", newline="", encoding="utf-8") as f:
        return {row["id"]: row for row in csv.DictReader(f)}


def published(*keys, quote=True):
    """Figures of data/published.csv by id: each printed with its source, the quoted words once per quote (if
    `quote`); the value as a float for one id, a list of floats for several."""
    rows = _published_rows()
    if not keys:
        raise TypeError("published() takes one or more ids of data/published.csv, got none")
    for key in keys:
        if key not in rows:
            near = difflib.get_close_matches(str(key), rows, n=3)
            raise ValueError(f"key {key!r} is not an id of data/published.csv"
                             + (f" (did you mean {' or '.join(near)}?)" if near else ""))
    shown = set()
    for i, key in enumerate(keys):
        row = rows[key]
        print(f"  published: {row['figure']}: {row['value']} {row['unit']} [{row['source']}]")
        later = {(rows[k]["source"], rows[k]["quote"]) for k in keys[i + 1:]}
        said = (row["source"], row["quote"])
        if quote and row["quote"] and said not in shown and said not in later:    # after the last row it backs
            print(f'    "{row["quote"]}"')
            shown.add(said)
    values = [float(rows[key]["value"]) for key in keys]
    return values[0] if len(values) == 1 else values
