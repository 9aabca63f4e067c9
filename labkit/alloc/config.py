"""`PYTORCH_CUDA_ALLOC_CONF`: the allocator's constants, its settings parsed as PyTorch parses them, and the
rounding of a request (`round_size`) and of a new segment (`allocation_size`).

The constants and rules follow PyTorch's `c10/cuda/CUDACachingAllocator.cpp` and
`c10/core/AllocatorConfig.cpp` (`AcceleratorAllocatorConfig::parseArgs`); names in comments are theirs.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..units import MiB

__all__ = ["Config", "parse_conf", "round_size", "allocation_size", "KNOWN_KEYS", "IGNORED_KEYS",
           "K_MIN_BLOCK", "K_SMALL_SIZE", "K_SMALL_BUFFER", "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE", "K_INTERVALS",
           "SIZE_MAX"]

K_MIN_BLOCK = 512               # kMinBlockSize
K_SMALL_SIZE = MiB              # kSmallSize: the largest "small" request
K_SMALL_BUFFER = 2 * MiB        # kSmallBuffer: small-pool segments
K_MIN_LARGE_ALLOC = 10 * MiB    # kMinLargeAlloc: below this a large request gets a large_segment_size segment
K_ROUND_LARGE = 2 * MiB         # kRoundLarge
K_INTERVALS = 16                # kRoundUpPowerOfTwoIntervals, from 1 MiB up
SIZE_MAX = 2 ** 64 - 1          # "unlimited" max_split_size, as in the source

KNOWN_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold",
              "roundup_power2_divisions", "expandable_segments", "large_segment_size_mb",
              "per_process_memory_fraction")
# Keys PyTorch 2.13 accepts that do not change the device allocator's decisions (host/pinned memory,
# locking, graphs): accepted, no effect on the model.
IGNORED_KEYS = ("release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
                "pinned_use_background_threads", "pinned_max_round_threshold_mb", "pinned_max_cached_size_mb",
                "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
                "throw_on_cudamalloc_oom", "backend")


@dataclass(frozen=True)
class Config:
    """The allocator settings, as parsed from a `PYTORCH_CUDA_ALLOC_CONF` string."""
    max_split_size: int = SIZE_MAX
    max_non_split_rounding: int = 20 * MiB
    garbage_collection_threshold: float = 0.0
    roundup_power2_divisions: tuple = (0,) * K_INTERVALS
    expandable_segments: bool = False
    large_segment_size: int = 20 * MiB
    per_process_memory_fraction: float | None = None
    text: str = ""


def _tokens(text):
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif not ch.isspace():
            buf += ch
    if buf:
        out.append(buf)
    return out


def _int(value, key):
    if not isinstance(value, str):             # a bracketed list where one number belongs: key:[64]
        raise ValueError(f"{key} must be an integer, got [{''.join(value)}]")
    try:
        v = int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if v < 0:
        raise ValueError(f"{key} must not be negative, got {value!r}")
    return v


def _pow2(v):
    return v > 0 and v & (v - 1) == 0


def parse_conf(text=""):
    """Parse a `PYTORCH_CUDA_ALLOC_CONF` string ("key:value,key:[a:b,>:c]") into a `Config`.

    Unknown keys raise `ValueError` naming the key, as PyTorch does ("Unrecognized key").
    """
    if isinstance(text, Config):
        return text
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise TypeError(f"conf must be a PYTORCH_CUDA_ALLOC_CONF string, got {type(text).__name__}")
    tok = _tokens(text)
    kw, i = {}, 0
    # large_segment_size_mb first, wherever it stands: the two sizes below must be at least it, and
    # max_non_split_rounding defaults to it (AcceleratorAllocatorConfig::parseArgs reads it first too).
    segment_mb = 20
    for k in range(len(tok) - 2):
        if tok[k] == "large_segment_size_mb" and tok[k + 1] == ":":
            value = tok[k + 2]
            if value == "[":
                value = tok[k + 3:tok.index("]", k) if "]" in tok[k:] else len(tok)]
            segment_mb = _int(value, "large_segment_size_mb")
            if segment_mb <= K_MIN_LARGE_ALLOC // MiB:
                raise ValueError(f"large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MiB} MB, got {segment_mb}")
    kw["max_non_split_rounding"] = kw["large_segment_size"] = segment_mb * MiB
    while i < len(tok):
        key = tok[i]
        if key == ",":
            i += 1
            continue
        if key not in KNOWN_KEYS and key not in IGNORED_KEYS:
            raise ValueError(f"Unrecognized key {key!r} in PYTORCH_CUDA_ALLOC_CONF {text!r}; "
                             f"the allocator knows {sorted(KNOWN_KEYS + IGNORED_KEYS)}")
        if i + 2 >= len(tok) or tok[i + 1] != ":":
            raise ValueError(f"{key} needs a value (key:value) in {text!r}")
        i += 2
        if tok[i] == "[":
            j = tok.index("]", i) if "]" in tok[i:] else None
            if j is None:
                raise ValueError(f"{key}: expected a closing ']' in {text!r}")
            value, i = tok[i + 1:j], j + 1
        else:
            value, i = tok[i], i + 1
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            v = _int(value, key)
            if v < segment_mb:
                raise ValueError(f"{key} too small, must be >= {segment_mb} (large_segment_size_mb), got {v}")
            kw["max_split_size" if key == "max_split_size_mb" else "max_non_split_rounding"] = \
                min(v, SIZE_MAX // MiB) * MiB
        elif key == "large_segment_size_mb":
            pass                                      # read above
        elif key == "garbage_collection_threshold":
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"garbage_collection_threshold must be a number, got {value!r}") from None
            if not 0.0 < v < 1.0:
                raise ValueError(f"garbage_collection_threshold must be in (0.0, 1.0), got {v}")
            kw["garbage_collection_threshold"] = v
        elif key == "per_process_memory_fraction":
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"per_process_memory_fraction must be a number, got {value!r}") from None
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"per_process_memory_fraction must be in [0.0, 1.0], got {v}")
            kw["per_process_memory_fraction"] = v
        elif key == "expandable_segments":
            if value not in ("True", "False"):
                raise ValueError(f"expandable_segments must be True or False, got {value!r}")
            kw["expandable_segments"] = value == "True"
        elif key == "roundup_power2_divisions":
            kw["roundup_power2_divisions"] = _parse_divisions(value)
        elif key == "backend" and value != "native":
            raise ValueError(f"backend {value!r} is CUDA's own allocator (cudaMallocAsync), not the caching "
                             "allocator this module models; use backend:native")
    return Config(text=text, **kw)


def _parse_divisions(value):
    if isinstance(value, str):                      # one number for every interval
        d = _int(value, "roundup_power2_divisions")
        if not _pow2(d):         # PyTorch's single-number form: a power of 2 (0 only inside [...])
            raise ValueError(f"roundup_power2_divisions must be a power of 2 (0 only in the [size:divisions] "
                             f"form), got {d}")
        return (d,) * K_INTERVALS
    divs, first, last = [0] * K_INTERVALS, True, 0
    items = [t for t in value if t != ","]
    if len(items) % 3:
        raise ValueError(f"roundup_power2_divisions list must hold size:divisions pairs, got {''.join(value)!r}")
    for k in range(0, len(items), 3):
        size, colon, d = items[k:k + 3]
        d = _int(d, "roundup_power2_divisions")
        if colon != ":" or d and not _pow2(d):
            raise ValueError(f"roundup_power2_divisions divisions must be powers of 2 or 0, got {d}")
        if size == ">":
            divs[last + 1:] = [d] * (K_INTERVALS - last - 1)
            continue
        mb = _int(size, "roundup_power2_divisions interval")
        if not _pow2(mb):
            raise ValueError(f"roundup_power2_divisions intervals must be powers of 2 (MB), got {mb}")
        idx = min(mb.bit_length() - 1, K_INTERVALS - 1)
        if first:
            divs[:idx] = [d] * idx
            first = False
        divs[idx], last = d, idx
    return tuple(divs)


def round_size(size, cfg=Config()):
    """`round_size`: below 512 B -> 512 B; with d > 1 divisions and size > 512*d, up to the next 1/d step
    between powers of two; otherwise up to a multiple of 512."""
    if size < K_MIN_BLOCK:
        return K_MIN_BLOCK
    log = size.bit_length() - 1
    idx = min(max(log - 20, 0), K_INTERVALS - 1)
    d = cfg.roundup_power2_divisions[idx]
    if d > 1 and size > K_MIN_BLOCK * d:
        if size & (size - 1) == 0:
            return size
        floor = 1 << log
        step = floor >> (d.bit_length() - 1)
        if step == 0:
            return floor << 1
        down = size & ~(step - 1)
        return size if down == size else down + step
    return -(-size // K_MIN_BLOCK) * K_MIN_BLOCK


def allocation_size(size, cfg=Config()):
    """`get_allocation_size`: the segment a new device malloc gets for a rounded request."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return cfg.large_segment_size
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
