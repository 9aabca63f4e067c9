"""Fit what does not fit: the levers of notebooks 01-12 combined for a model, a task and a GPU, ranked.

`plan(model, task, gpu, gpus=1, seq=2048, batch=1)` tries every combination of the levers the workbook
measured, asks `labkit.estimate` (its formula path only: no fake tensors, so a 70B search takes a second)
for the memory of one GPU, adds what estimate does not model (the small named functions below, each with
its source), prices each combination with the stated cost model, and ranks: plans that fit first, then
by step time (training) or tokens per second (serving). Notebook 13 teaches it and checks its top plan by
measurement at tiny size.

The cost model (every constant is stated here and printed with the table; none is measured yet: no record
in data/gpu/ holds an MFU or a link bandwidth, so the spec-sheet figures of data/gpus.csv are used):
    compute      FLOPs / (peak FLOP/s x MFU x GPUs): 6 N per token for a training step (2 forward,
                 4 backward; Kaplan et al. 2020), + 2 N with full recomputation (one more forward), 4 N
                 for LoRA/QLoRA (no weight gradients of the frozen base), attention's score FLOPs left out
    offload      offload_bytes over PCIe (half the spec sheet's bidirectional figure per direction: every
                 micro-batch's gradients out, the weights back once) plus the CPU's Adam update at CPU_GBPS
                 (its 16 bytes of state per parameter read and written)
    comm         data parallel: 2 (d-1)/d x gradient bytes (ring all-reduce, or reduce-scatter + all-gather
                 for ZeRO-1/2), 3 (d-1)/d x weight bytes for ZeRO-3 (ZeRO paper sec. 7: 1.5x); tensor
                 parallel: 4 all-reduces of the activations per layer and step (Megatron-LM sec. 3); over
                 NVLink where the card has it (half the bidirectional figure), else PCIe; no overlap
    bubble       pipeline: the step x (p - 1) / m for m micro-batches (GPipe, 1F1B)
    dequant      4- and 8-bit weights: every pass writes and reads them as 16-bit once more (HBM bytes)
    serve        one decode step reads the weights and the KV cache from HBM at HBM_UTIL of its bandwidth,
                 or computes 2 N FLOPs per sequence at MFU, whichever is slower; tokens/s = sequences / step
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import itertools
import json
import pathlib

from ..units import fmt_bytes, parse_bytes

__all__ = ["plan", "Plan", "Plans", "TASKS", "gpu_spec", "gpu_names", "nf4_bits", "int8_bits", "lora_params",
           "quantized_weight_bytes", "frozen_base_activations", "paged_kv_tokens", "kv_bytes", "allocator_overhead",
           "train_flops", "offload_bytes", "offload_seconds",
           "MFU", "HBM_UTIL", "CPU_GBPS", "HEADROOM", "recipes"]

from ..data import DATA_DIR as DATA
TASKS = ("pretrain", "finetune", "lora", "qlora", "serve")
MFU = 0.4            # model FLOP/s utilisation assumed for training and prefill (PaLM, Chowdhery et al. 2022: 46%)
HBM_UTIL = 0.8       # share of the spec sheet's memory bandwidth a decode step reaches (assumed)
CPU_GBPS = 50        # host memory bandwidth for the CPU's Adam update, GB/s (assumed: a server's DDR channels)
HEADROOM = 0.10      # the caching allocator's reserved overhead and the CUDA context, as a share of the peak
                     # (the notebooks' HEADROOM; notebook 05 models the allocator's rounding and caching)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")     # QLoRA adapts every linear layer (sec. 4)
CATS = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other", "allocator")


# ---- what estimate does not model: one small function each -----------------------------------------
def nf4_bits(blocksize=64, double_quant=True):
    """Bits per weight of NF4 (QLoRA, Dettmers et al. 2023, sec. 3): 4 bits plus one absmax per block of
    64; double quantization stores those absmaxes in 8 bits with one fp32 constant per 256 of them:
    4 + 8/64 + 32/(64*256) = 4.127 bits, instead of 4 + 32/64 = 4.5."""
    if double_quant:
        return 4 + 8 / blocksize + 32 / (blocksize * 256)
    return 4 + 32 / blocksize


def int8_bits(in_features):
    """Bits per weight of LLM.int8 (Dettmers et al. 2022, sec. 3): 8 bits plus one fp32 scale per row
    (vector-wise quantization) of `in_features` weights; the fp16 outlier columns are left out."""
    return 8 + 32 / in_features


def _shape(config):
    from ..estimate import load_config
    c = load_config(config)
    h, L = c.hidden_size, c.num_hidden_layers
    a = c.num_attention_heads
    d = getattr(c, "head_dim", None) or h // a
    kv = getattr(c, "num_key_value_heads", None) or a
    i = getattr(c, "intermediate_size", None) or 4 * h
    return dict(h=h, L=L, a=a, d=d, kv=kv, i=i, V=c.vocab_size, config=c)


def _linears(s):
    """(d_in, d_out) of every matrix of one Llama-style layer, by LORA_TARGETS name."""
    h, q, kv, i = s["h"], s["a"] * s["d"], s["kv"] * s["d"], s["i"]
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}


def lora_params(config, rank, targets=LORA_TARGETS):
    """Trainable parameters of LoRA (Hu et al. 2021, sec. 4.1): per adapted matrix W (d_out x d_in), A is
    r x d_in and B is d_out x r: r (d_in + d_out) parameters, in every layer."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int, got {rank!r}")
    s = _shape(config)
    shapes = _linears(s)
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"targets must be among {tuple(shapes)}, got {unknown!r}")
    return s["L"] * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def quantized_weight_bytes(config, weights):
    """Bytes of the weights with the layers' matrices in `weights` ("bf16", "int8", "nf4"); embeddings,
    norms and the LM head stay 16-bit, as bitsandbytes and QLoRA leave them."""
    from ..estimate import param_count
    s = _shape(config)
    matrices = s["L"] * sum(a * b for a, b in _linears(s).values())
    rest = param_count(s["config"]) - matrices
    bits = {"bf16": 16, "int8": int8_bits(s["h"]), "nf4": nf4_bits()}
    if weights not in bits:
        raise ValueError(f"weights must be one of {tuple(bits)}, got {weights!r}")
    return int(matrices * bits[weights] / 8 + 2 * rest)


def paged_kv_tokens(tokens, block_size=16):
    """Token slots a paged KV cache holds for one sequence of `tokens`: whole blocks (vLLM, Kwon et al. 2023,
    sec. 4.2: the waste is under one block per sequence)."""
    return -(-tokens // block_size) * block_size


def kv_bytes(config, sequences, tokens, kv_dtype="bf16", block_size=16):
    """KV cache of `sequences` paged sequences of `tokens`: labkit.estimate's formula in 16 bits, halved for
    an 8-bit cache (vLLM's fp8 KV cache; its per-tensor scales left out)."""
    from ..estimate import kv_cache_bytes
    per = {"bf16": 1.0, "int8": 0.5}
    if kv_dtype not in per:
        raise ValueError(f"kv_dtype must be one of {tuple(per)}, got {kv_dtype!r}")
    return int(kv_cache_bytes(config, sequences, paged_kv_tokens(tokens, block_size), "bf16") * per[kv_dtype])


def allocator_overhead(peak, fraction=HEADROOM):
    """What the caching allocator reserves beyond the live bytes (rounding, cached free blocks) and the CUDA
    context: a stated share of the peak (the notebooks' HEADROOM = 0.10; notebook 05 models it)."""
    return int(peak * fraction)


def train_flops(params, tokens, recompute=False, frozen=False):
    """FLOPs of one training step: 6 N per token (Kaplan et al. 2020, sec. 2.1), 4 N when the weights are
    frozen (LoRA: input gradients only), plus one more forward (2 N) with full recomputation."""
    per = (4 if frozen else 6) + (2 if recompute is True or (isinstance(recompute, int) and not isinstance(recompute, bool)) else 0)
    return per * params * tokens


def offload_bytes(weight_bytes, offload, grad_accum=1):
    """Bytes one step moves over PCIe for `weight_bytes` of weights (as many of gradients) on one rank:
    "optimizer" (ZeRO-Offload, Ren et al. 2021, sec. 4.2): every micro-batch's gradients to the host,
    where they are accumulated, and the updated weights back once; "parameters" (ZeRO-Infinity) also
    brings every weight to the device for each micro-batch's forward and again for its backward."""
    if offload not in (None, "optimizer", "parameters"):
        raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {offload!r}")
    if not offload:
        return 0
    moved = weight_bytes * grad_accum + weight_bytes
    if offload == "parameters":
        moved += 2 * weight_bytes * grad_accum
    return int(moved)


def offload_seconds(weight_bytes, offload, grad_accum, params, gpu):
    """Seconds of one step spent offloading: offload_bytes over one direction of PCIe (half the spec sheet's
    bidirectional figure) plus the CPU's Adam update, 16 bytes of state per parameter read and written
    at CPU_GBPS; no overlap with compute (an upper bound: DeepSpeed overlaps part of it)."""
    g = gpu_spec(gpu) if not isinstance(gpu, dict) else gpu
    if not offload:
        return 0.0
    return offload_bytes(weight_bytes, offload, grad_accum) / (g["pcie_bps"] / 2) + 2 * 16 * params / (CPU_GBPS * 1e9)


# ---- GPUs -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _gpu_table():
    with open(DATA / "gpus.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out = {}
    for r in rows:
        out[r["name"].lower()] = dict(name=r["name"], memory=int(float(r["memory_gb"]) * 1e9),
                                     bf16_flops=float(r["bf16_tflops"]) * 1e12, fp32_flops=float(r["fp32_tflops"]) * 1e12,
                                     hbm_bps=float(r["hbm_gbps"]) * 1e9, pcie_bps=float(r["pcie_gbps"]) * 1e9,
                                     nvlink_bps=float(r["nvlink_gbps"]) * 1e9, source=r["source"], measured=False)
    return out


def gpu_names():
    """The GPUs of data/gpus.csv, as `plan` accepts them."""
    return [g["name"] for g in _gpu_table().values()]


def gpu_spec(gpu):
    """A GPU's figures: a name of data/gpus.csv (any case) or a memory size (bytes or "24 GiB"; its compute
    and links are then the A100 80GB's, as the returned "name" says)."""
    table = _gpu_table()
    if isinstance(gpu, str) and gpu.strip().lower() in table:
        return dict(table[gpu.strip().lower()])
    try:
        memory = parse_bytes(gpu, "gpu")
    except (TypeError, ValueError):
        raise ValueError(f"gpu must be one of {gpu_names()} or a memory size like '24 GiB', got {gpu!r}") from None
    return dict(table["a100 80gb"], name=f"{fmt_bytes(memory)} (A100 80GB's compute)", memory=memory)


# ---- plans ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """One combination of levers: its techniques, memory per GPU (parts), fit, and cost (seconds)."""
    techniques: list
    levers: dict
    peak_bytes: int
    fits: bool
    step_time_s: float
    parts: dict
    cost: dict
    budget: int
    why: str = ""
    tokens_per_s: float | None = None

    def to_dict(self):
        return dataclasses.asdict(self)


class Plans(list):
    """The ranked plans (fits first, then fastest), with the question they answer and the cost model."""

    def __init__(self, plans, question):
        super().__init__(plans)
        self.question = question

    @property
    def best(self):
        """The top plan if it fits, else None."""
        return self[0] if self and self[0].fits else None

    def table(self, rows=10):
        """The ranked plans as text: the first `rows`, with the cost model's constants."""
        q = self.question
        serve = q["task"] == "serve"
        lines = [f"{q['model']}: {q['task']} on {q['gpus']} x {q['gpu']} ({fmt_bytes(q['memory'])} each), "
                 f"seq {q['seq']}, batch {q['batch']}; {len(self)} plans, {sum(p.fits for p in self)} fit",
                 f"{'#':>3} {'fits':<4} {'peak/GPU':>10} {'tok/s' if serve else 'step s':>9}  techniques / why"]
        shown, hidden = set(), 0
        for n, p in enumerate(self, 1):
            key = (p.fits, p.peak_bytes, round(p.step_time_s, 2), p.tokens_per_s and round(p.tokens_per_s))
            if key in shown:           # the same memory and time as a plan above (e.g. selective = none)
                hidden += 1
                continue
            if len(shown) == rows:
                break
            shown.add(key)
            speed = f"{p.tokens_per_s:>9,.0f}" if serve else f"{p.step_time_s:>9.2f}"
            lines.append(f"{n:>3} {'yes' if p.fits else 'no':<4} {fmt_bytes(p.peak_bytes):>10} {speed}  "
                         f"{', '.join(p.techniques)}" + ("" if p.fits else f"  <- {p.why}"))
        if hidden:
            lines.append(f"    ({hidden} plans with the same memory and time as one above not shown)")
        lines.append(f"cost model: MFU {MFU}, HBM at {HBM_UTIL:.0%}, CPU Adam at {CPU_GBPS} GB/s, allocator "
                     f"overhead {HEADROOM:.0%} of the peak, no overlap of compute, offload and communication (an upper "
                     f"bound); spec-sheet FLOP/s and bandwidths from data/gpus.csv "
                     f"({q['source']}); no measured figures in data/gpu/ yet")
        return "\n".join(lines)

    def to_json(self):
        """The plans as a JSON list (techniques, peak_bytes, fits, step_time_s, parts, ...)."""
        return json.dumps([p.to_dict() for p in self], indent=1)


def _count(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _why(parts, budget):
    """The first category, in CATS order, at which the running sum passes the budget."""
    total = 0
    for c in CATS:
        total += parts.get(c, 0)
        if parts.get(c, 0) and total > budget:
            return f"over at {c}: {fmt_bytes(total)} > {fmt_bytes(budget)}"
    return ""


def _link(g, gpus):
    """Bytes/s of one direction between GPUs: NVLink where the card has it, else PCIe."""
    return (g["nvlink_bps"] or g["pcie_bps"]) / 2 if gpus > 1 else float("inf")


def _finish(parts, g, levers, techniques, cost, tokens_per_s=None):
    parts = {c: int(parts.get(c, 0)) for c in CATS}
    parts["allocator"] = allocator_overhead(sum(parts.values()))
    peak = sum(parts.values())
    fits = peak <= g["memory"]
    return Plan(techniques=techniques, levers=levers, peak_bytes=peak, fits=fits,
                step_time_s=float(sum(cost.values())), parts=parts, cost=cost, budget=g["memory"],
                why="" if fits else _why(parts, g["memory"]), tokens_per_s=tokens_per_s)


def _layouts(gpus, s, tp_ok=True):
    """(dp, tp, pp) with dp x tp x pp = gpus; tp divides the heads (and the KV heads, or they it), pp <= layers."""
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if gpus % (tp * pp) or (tp > 1 and not tp_ok):
                continue
            if s["a"] % tp or (s["kv"] % tp if tp <= s["kv"] else tp % s["kv"]) or pp > s["L"]:
                continue
            yield gpus // (tp * pp), tp, pp


RECOMPUTE = {False: "no recompute", "selective": "selective recompute", True: "full recompute"}
DTYPE_NAMES = {"fp32": "fp32", "amp-bf16": "autocast bf16", "mixed": "bf16 + fp32 master (mixed)", "bf16": "pure bf16"}


def _train_plans(cfg, s, P, g, gpus, seq, batch, pretrain):
    from ..estimate import estimate
    out = []
    for (dp, tp, pp), dtype, opt, rc, offload, zero in itertools.product(
            list(_layouts(gpus, s)), DTYPE_NAMES, ("adamw", "adamw-8bit"), RECOMPUTE,
            (None, "optimizer", "parameters"), (0, 1, 2, 3)):
        if (zero and dp == 1 and not offload) or (offload == "parameters" and zero != 3) or \
                (offload == "optimizer" and zero == 3 and dp == 1) or batch % dp or (opt == "adamw-8bit" and offload):
            continue
        for mb in sorted({1, batch // dp}):
            accum = batch // (dp * mb)
            try:
                est = estimate(cfg, batch=mb, seq=seq, dtype=dtype, optimizer=opt, recompute=rc, method="formula",
                               grad_accum=accum > 1 and dtype == "mixed", device="cuda", dp=dp, zero=zero, tp=tp,
                               pp=pp, offload=offload)
            except ValueError:
                continue
            tokens = batch * seq
            peak_flops = g["fp32_flops"] if dtype == "fp32" else g["bf16_flops"]
            cost = {"compute": train_flops(P, tokens, rc) / (peak_flops * MFU * gpus)}
            # bytes of one rank's gradients (and weights): fp32 under plain fp32 and under autocast
            grad = (4 if dtype in ("fp32", "amp-bf16", "amp-fp16") else 2) * P / (tp * pp)
            link = _link(g, gpus)
            if dp > 1:
                cost["comm"] = (3 if zero == 3 else 2) * (dp - 1) / dp * grad / link
            if tp > 1:
                cost["comm"] = cost.get("comm", 0) + 4 * s["L"] / pp * 2 * (tp - 1) / tp * mb * seq * s["h"] * 2 * accum / link
            if offload:
                cost["offload"] = offload_seconds(grad / dp, offload, accum, P // (tp * pp * dp), g)
            if pp > 1:
                cost["bubble"] = cost["compute"] * (pp - 1) / max(accum, 1)
            tech = [DTYPE_NAMES[dtype], "8-bit AdamW" if opt == "adamw-8bit" else "AdamW", RECOMPUTE[rc]]
            tech += [f"dp={dp}"] * (dp > 1) + [f"ZeRO-{zero}"] * bool(zero) + [f"tp={tp}"] * (tp > 1) + \
                    [f"pp={pp}"] * (pp > 1) + [f"{offload} offload"] * bool(offload) + \
                    [f"micro-batch {mb} x {accum} accumulation"] * (accum > 1)
            levers = dict(dtype=dtype, optimizer=opt, recompute=rc, dp=dp, zero=zero, tp=tp, pp=pp, offload=offload,
                          micro_batch=mb, grad_accum=accum)
            out.append(_finish(est.peak_parts, g, levers, tech, cost))
    return out


def frozen_base_activations(config, batch, seq, recompute=False):
    """The activations and loss gradient of a training step whose weights take no optimizer step (LoRA's
    frozen base): estimate's formula (bf16, no optimizer) at the start of backward or during recomputation.
    The model states are made negligible by sharding them over 2**30 ranks with ZeRO-3, so the peak moment
    is the one with the activations (the peak_parts "activations" and "other" are read; the rest ignored)."""
    from ..estimate import estimate
    return estimate(config, batch=batch, seq=seq, dtype="bf16", optimizer=None, recompute=recompute,
                    method="formula", device="cuda", dp=2**30, zero=3)


def _adapter_plans(cfg, s, P, g, gpus, seq, batch, quantized):
    """LoRA / QLoRA: frozen base weights (bf16, or int8/NF4), fp32 adapters with AdamW (16 bytes/param),
    activations from estimate's formula (bf16, no optimizer), plus one layer's dequantized weight."""
    from ..estimate import estimate
    out = []
    shapes = _linears(s)
    largest = max(a * b for a, b in shapes.values())
    for weights, rank, opt, rc in itertools.product(("nf4", "int8") if quantized else ("bf16",), (16, 64),
                                                   ("adamw", "adamw-8bit"), RECOMPUTE):
        if batch % gpus:
            continue
        for mb in sorted({1, batch // gpus}):
            accum = batch // (gpus * mb)
            est = frozen_base_activations(cfg, mb, seq, rc)
            A = lora_params(cfg, rank)
            state = 8 if opt == "adamw" else 2 + 8 / 256
            parts = dict(parameters=quantized_weight_bytes(cfg, weights) + 4 * A, gradients=4 * A,
                         optimizer=int(state * A), activations=est.peak_parts["activations"],
                         other=est.peak_parts["other"] + (2 * largest if weights != "bf16" else 0))
            tokens = batch * seq
            cost = {"compute": train_flops(P, tokens, rc, frozen=True) / (g["bf16_flops"] * MFU * gpus)}
            if weights != "bf16":
                passes = 3 if rc is True else 2        # forward, backward (and the recomputed forward)
                cost["dequant"] = passes * accum * s["L"] * sum(a * b for a, b in shapes.values()) * 4 / g["hbm_bps"]
            if gpus > 1:
                cost["comm"] = 2 * (gpus - 1) / gpus * 4 * A / _link(g, gpus)
            tech = ([{"nf4": "NF4 + double quant", "int8": "int8 weights"}[weights]] if quantized else ["bf16 base"])
            tech += [f"LoRA r={rank}", "8-bit AdamW" if opt == "adamw-8bit" else "AdamW", RECOMPUTE[rc]]
            tech += [f"dp={gpus}"] * (gpus > 1) + [f"micro-batch {mb} x {accum} accumulation"] * (accum > 1)
            levers = dict(weights=weights, rank=rank, optimizer=opt, recompute=rc, dp=gpus, micro_batch=mb,
                          grad_accum=accum)
            out.append(_finish(parts, g, levers, tech, cost))
    return out


def _serve_plans(cfg, s, P, g, gpus, seq, batch):
    """Serving `batch` concurrent sequences of `seq` tokens: weights, paged KV, one prefill's activations."""
    from ..estimate import estimate
    out = []
    for (replicas, tp, pp), weights, kv_dtype in itertools.product(
            list(_layouts(gpus, s)), ("bf16", "int8", "nf4"), ("bf16", "int8")):
        if pp > 1:
            continue
        users = -(-batch // replicas)                    # sequences per replica
        try:
            prefill = estimate(cfg, batch=1, seq=seq, dtype="bf16", training=False, method="formula", tp=tp)
        except ValueError:
            continue
        kv_heads = max(1, s["kv"] // tp)
        kv = kv_bytes(cfg, users, seq, kv_dtype) * kv_heads // s["kv"]
        w = quantized_weight_bytes(cfg, weights) // tp
        parts = dict(parameters=w, kv_cache=kv, activations=prefill.peak_parts["activations"])
        read = w + kv                                     # one decode step reads every weight and the cache
        flops = 2 * P * users / tp
        step = max(read / (g["hbm_bps"] * HBM_UTIL), flops / (g["bf16_flops"] * MFU))
        cost = {"decode": step}
        if weights != "bf16":
            cost["dequant"] = (P / tp) * 4 / g["hbm_bps"]
        if tp > 1:
            cost["comm"] = 2 * s["L"] * 2 * (tp - 1) / tp * users * s["h"] * 2 / _link(g, gpus)
        tps = users * replicas / sum(cost.values())
        tech = [{"bf16": "bf16 weights", "int8": "int8 weights", "nf4": "NF4 weights"}[weights],
                f"{'bf16' if kv_dtype == 'bf16' else '8-bit'} paged KV (blocks of 16)"]
        tech += [f"tp={tp}"] * (tp > 1) + [f"{replicas} replicas"] * (replicas > 1)
        levers = dict(weights=weights, kv_dtype=kv_dtype, tp=tp, replicas=replicas, block_size=16)
        out.append(_finish(parts, g, levers, tech, cost, tokens_per_s=tps))
    return out


def plan(model, task, gpu, gpus=1, seq=2048, batch=1):
    """Every combination of levers for `task` on `gpus` x `gpu`, ranked: fits first, then the fastest.

    model: anything `labkit.estimate` takes (preset, family, config.json) with a formula (Llama family);
    task: "pretrain", "finetune" (full), "lora", "qlora" or "serve" (batch = concurrent sequences,
    seq = context length); gpu: a name of data/gpus.csv or a memory size; batch: sequences per step (all
    GPUs together; micro-batches and gradient accumulation are searched). Returns Plans (a list of Plan).
    """
    from ..estimate import load_config, param_count
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    g = gpu_spec(gpu)
    gpus, seq, batch = _count("gpus", gpus), _count("seq", seq), _count("batch", batch)
    try:
        cfg = load_config(model)
    except (TypeError, FileNotFoundError) as err:
        raise ValueError(f"model {model!r}: {err}") from None
    s = _shape(cfg)
    if cfg.model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"model {model!r} is a {cfg.model_type!r}: plan searches Llama-family decoders "
                         f"(llama, mistral, qwen2), whose formulas estimate has")
    if seq > cfg.max_position_embeddings:
        raise ValueError(f"seq must be <= max_position_embeddings {cfg.max_position_embeddings}, got {seq}")
    P = param_count(cfg)
    if task in ("pretrain", "finetune"):
        plans = _train_plans(cfg, s, P, g, gpus, seq, batch, task == "pretrain")
    elif task in ("lora", "qlora"):
        plans = _adapter_plans(cfg, s, P, g, gpus, seq, batch, task == "qlora")
    else:
        plans = _serve_plans(cfg, s, P, g, gpus, seq, batch)
    if task == "serve":
        plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s, p.peak_bytes))
    else:
        plans.sort(key=lambda p: (not p.fits, p.step_time_s if p.fits else p.peak_bytes, p.peak_bytes))
    name = model if isinstance(model, str) else getattr(cfg, "name_or_path", "") or cfg.model_type
    question = dict(model=str(name), task=task, gpu=g["name"], gpus=gpus, seq=seq, batch=batch,
                    memory=g["memory"], source=g["source"], params=P)
    return Plans(plans, question)


def recipes():
    """The published recipes of data/recipes.csv (what tests/test_plan.py holds the planner to)."""
    with open(DATA / "recipes.csv", newline="") as f:
        return list(csv.DictReader(f))
