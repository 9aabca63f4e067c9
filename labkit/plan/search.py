"""The search: every combination of levers for a task, each priced for memory (labkit.estimate's formulas
with the levers of labkit.plan.levers and .adapters, the allocator's share from labkit.plan.capacity)
and for time (labkit.plan.cost). One function per task family; `plan` in __init__ calls them."""
from __future__ import annotations

import itertools

from ..checks import count
from ..estimate.formulas import dtype_bytes, training_step
from ..units import fmt_bytes
from ..estimate.sharding import Parallel, layout_problem, make_layout
from .adapters import (adapter_state_bytes, check_targets, frozen_base_saving, gathered_unit_bytes,
                       lora_activation_bytes, lora_params, quantized_input_bytes, quantized_weight_bytes)
from .capacity import host_bytes, state_rounding
from .cost import (HBM_UTIL, MFU, OUTPUT_TOKENS, attention_flops, ce_recompute_flops, data_parallel_bytes,
                   host_seconds, link_bps, offload_seconds, train_flops)
from .levers import OPTIMIZERS, paged_optimizer
from .plans import CATS, Plan, why_not
from .serving import BLOCK_SIZE, kv_bytes
from .shapes import linears

__all__ = ["DTYPES", "RECOMPUTE", "RANKS", "TARGET_SETS", "LEVERS", "VALUES", "COUNTS", "check_levers", "layouts",
           "micro_batches", "choose",
           "train_plans", "adapter_plans", "serve_plans"]

RECOMPUTE = {False: "no recompute", "selective": "selective recompute", True: "full recompute"}
DTYPES = {"fp32": "fp32", "amp-bf16": "autocast bf16", "mixed": "bf16 + fp32 master (mixed)",
          "bf16": "pure bf16 (no fp32 master: quality risk)"}
OPT_NAMES = {"adamw": "AdamW", "adamw-8bit": "8-bit AdamW", "paged-adamw-8bit": "paged 8-bit AdamW",
             "paged-adamw": "paged AdamW"}
CE_NAMES = {False: "", True: "chunked cross-entropy", "output": "chunked output loss"}
# LoRA's rank and targets decide what the adapters can learn, not only their bytes: the search does not
# trade them away for speed; unless plan(..., levers=) fixes them, every plan adapts all linear layers
# (QLoRA, Dettmers et al. 2023, sec. 4: needed to match full fine-tuning) at rank 16
RANKS = (16,)
TARGET_SETS = ("all",)
# the levers of each kind of plan (Plan.levers' keys), which plan(..., levers={...}) may fix
LEVERS = {
    "train": ("dtype", "optimizer", "fused_step", "recompute", "activation_offload", "chunked_ce", "attention",
              "dp", "zero", "tp", "pp", "offload", "micro_batch", "grad_accum"),
    "adapter": ("weights", "rank", "targets", "optimizer", "recompute", "activation_offload", "chunked_ce",
                "attention", "shard_base", "dp", "micro_batch", "grad_accum", "adapter_dtype", "lora_dropout",
                "quantized_saves_input"),
    "serve": ("weights", "kv_dtype", "tp", "replicas", "block_size"),
}


# the values a fixed lever may take (plan(..., levers=)); integers >= 1 and the targets are checked apart
VALUES = {"dtype": tuple(DTYPES), "optimizer": tuple(OPT_NAMES), "fused_step": (False, True),
          "recompute": tuple(RECOMPUTE), "activation_offload": (False, True), "chunked_ce": tuple(CE_NAMES),
          "attention": ("sdpa", "eager"), "zero": (0, 1, 2, 3), "offload": (None, "optimizer", "parameters"),
          "weights": ("bf16", "int8", "nf4"), "shard_base": (False, True), "adapter_dtype": ("fp32", "bf16"),
          "quantized_saves_input": (False, True), "kv_dtype": ("bf16", "int8")}
COUNTS = ("dp", "tp", "pp", "micro_batch", "grad_accum", "rank", "replicas", "block_size")


def check_levers(kind, levers, gpus=1, task=None):
    """The levers plan(..., levers=) fixes, checked for a plan of `kind` ("train", "adapter", "serve"; `task`
    names it in errors): each a lever of that kind with a value the search can price, else a ValueError naming
    the lever and the value."""
    from .adapters import check_targets
    if levers is None:
        return {}
    if not isinstance(levers, dict):
        raise ValueError(f"levers must be a dict of lever -> value, got {levers!r}")
    fix = dict(levers)
    unknown = sorted(set(fix) - set(LEVERS[kind]))
    if unknown:
        raise ValueError(f"levers {unknown} are not levers of a {task or kind} plan; these are: "
                         f"{', '.join(LEVERS[kind])}")
    for name, value in fix.items():
        if name in VALUES and not any(value is v or (value == v and type(value) is type(v)) for v in VALUES[name]):
            raise ValueError(f"levers[{name!r}] must be one of {VALUES[name]}, got {value!r}")
        if name in COUNTS:
            fix[name] = count(f"levers[{name!r}]", value)
    if "targets" in fix:
        fix["targets"] = check_targets(fix["targets"])
    dropout = fix.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"levers['lora_dropout'] must be a probability in [0, 1), got {dropout!r}")
    if kind == "adapter" and fix.get("dp", gpus) != gpus:
        raise ValueError(f"levers['dp'] must be gpus={gpus} for a LoRA/QLoRA plan (data-parallel over every GPU), "
                         f"got {fix['dp']!r}")
    if kind == "train" and fix.get("offload") == "parameters" and fix.get("zero", 3) != 3:
        raise ValueError(f"levers offload='parameters' needs zero=3 (it offloads ZeRO-3's weight partitions), "
                         f"got zero={fix['zero']!r}")
    return fix


def choose(ctx, name, searched):
    """The values of lever `name` to try: the one plan(..., levers=) fixes, else those searched."""
    fix = ctx["fix"]
    return (fix[name],) if name in fix else tuple(searched)


def layouts(gpus, s, tp_ok=True):
    """(dp, tp, pp) with dp x tp x pp = gpus that the model `s` can have (labkit.estimate.sharding's rule:
    tp divides the heads, and the KV heads or they it; pp <= layers)."""
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if gpus % (tp * pp) or (tp > 1 and not tp_ok) or layout_problem(s, tp, pp):
                continue
            yield gpus // (tp * pp), tp, pp


def micro_batches(batch, dp):
    """Micro-batch sizes of one data-parallel rank: 1 (the least memory, the most accumulation) and the
    whole share, batch / dp (no accumulation); others with plan(..., levers={"micro_batch": m})."""
    return sorted({1, batch // dp})


def _finish(ctx, parts, allocator, levers, techniques, cost, host=None, paged=0, tokens_per_s=None, notes=()):
    """A Plan from device bytes per category at the peak (paged state counted resident), the allocator's
    share, and what goes to the host; fit on the card (usable bytes) and on the host."""
    g, host = ctx["gpu"], dict(host or {})
    parts = {c: int(parts.get(c, 0)) for c in CATS if c != "allocator"}
    parts["allocator"] = int(allocator)
    counted = sum(parts.values())                       # what PyTorch's allocator serves
    if paged:                                           # paged state: outside the allocator, resident if room
        counted -= paged
        resident, spilled = paged_optimizer(paged, g["usable"] - counted)
        parts["optimizer"] += resident - paged
        techniques = techniques + [f"paged state {fmt_bytes(resident)} resident" +
                                   (f", {fmt_bytes(spilled)} paged to the host each step" if spilled else "")]
        if spilled:
            host["paged"] = spilled
            cost["paging"] = 2 * host_seconds(spilled, g)
    peak = sum(parts.values())
    need = host_bytes(host, ctx["gpus"])
    fits = counted <= g["usable"] and need <= ctx["host_memory"]
    return Plan(techniques=techniques, levers=levers, peak_bytes=peak, fits=fits,
                step_time_s=float(sum(cost.values())), parts=parts, cost=cost, budget=g["usable"],
                why="" if fits else why_not(parts, g["usable"], need, ctx["host_memory"]),
                tokens_per_s=tokens_per_s, host=host, host_bytes=need, host_budget=ctx["host_memory"],
                counted_bytes=counted, notes=list(notes))


def _rounding(ctx, dtype, optimizer, fused, sharded):
    """state_rounding of the long-lived tensors a rank holds whole (none when ZeRO or offload flattens
    them into shards: FSDP and DeepSpeed allocate flat buffers)."""
    if sharded:
        return 0
    numels = ctx["numels"]
    w = dtype_bytes(dtype)
    moments = {"adamw": 4 if dtype in ("mixed", "fp32", "amp-bf16") else w}.get(optimizer, 0)
    out = state_rounding(numels, w) * (1 if fused else 2)          # weights (and gradients)
    if moments:
        out += 2 * state_rounding(numels, moments) + (state_rounding(numels, 4) if dtype == "mixed" else 0)
    return out


def train_plans(ctx):
    """Full training, "pretrain" and "finetune" alike (a step holds the same weights, gradients, optimizer
    state and activations whether its weights started random or pretrained): precision, optimizer (8-bit,
    paged), the step fused into backward, recomputation, activation offload, chunked cross-entropy, ZeRO
    stage and offload, micro-batches, dp x tp x pp."""
    s = ctx["shape"]
    seq, batch, gpus, attention = ctx["seq"], ctx["batch"], ctx["gpus"], ctx["attention"]
    out, fix = [], ctx["fix"]
    for dp, tp, pp in layouts(gpus, s):
        if batch % dp or any(name in fix and fix[name] != v for name, v in (("dp", dp), ("tp", tp), ("pp", pp))):
            continue
        combos = [(None, 0)] + [(None, z) for z in (1, 2, 3) if dp > 1] + [("optimizer", 2), ("parameters", 3)]
        combos = [(o, z) for o, z in combos if fix.get("offload", o) == o and fix.get("zero", z) == z]
        for mb in choose(ctx, "micro_batch", micro_batches(batch, dp)):
            if batch % (dp * mb):
                continue
            accum = batch // (dp * mb)
            if fix.get("grad_accum", accum) != accum:
                continue
            frag = ctx["fragmentation"]
            for dtype, (offload, zero), rc, act, ce in itertools.product(
                    choose(ctx, "dtype", DTYPES), combos, choose(ctx, "recompute", RECOMPUTE),
                    choose(ctx, "activation_offload", (False, True)), choose(ctx, "chunked_ce", (False, True))):
                if act and rc is not True and "activation_offload" not in fix:
                    continue        # searched with full recomputation (torchtune's advice): else every
                                    # saved tensor crosses PCIe twice
                layout = make_layout(Parallel(dp, zero, tp, pp, offload), s)
                for opt in choose(ctx, "optimizer", OPTIMIZERS if not offload else ("adamw",)):
                    if offload and opt != "adamw":
                        continue
                    for fused in choose(ctx, "fused_step", (False, True) if accum == 1 and not offload else (False,)):
                        if fused and (accum > 1 or offload):
                            continue
                        est = training_step(s, mb, seq, dtype, opt, rc, False, accum > 1 and dtype == "mixed",
                                            "cuda", layout, fused_step=fused, chunked_ce=ce, attention=attention,
                                            activation_offload=act, accumulate=accum > 1)
                        levers = dict(dtype=dtype, optimizer=opt, fused_step=fused, recompute=rc,
                                      activation_offload=act, chunked_ce=ce, attention=attention, dp=dp, zero=zero,
                                      tp=tp, pp=pp, offload=offload, micro_batch=mb, grad_accum=accum)
                        out.append(_train_plan(ctx, est, levers, frag))
    return out


def _train_plan(ctx, est, levers, frag):
    s, g, P, gpus, seq = ctx["shape"], ctx["gpu"], ctx["params"], ctx["gpus"], ctx["seq"]
    dtype, opt, dp, tp, pp = levers["dtype"], levers["optimizer"], levers["dp"], levers["tp"], levers["pp"]
    mb, accum, offload, zero = levers["micro_batch"], levers["grad_accum"], levers["offload"], levers["zero"]
    tokens = ctx["batch"] * seq
    peak_flops = g["fp32_flops"] if dtype == "fp32" else g["bf16_flops"]
    flops = train_flops(P, tokens, levers["recompute"]) + attention_flops(s, seq, tokens, levers["recompute"])
    flops += ce_recompute_flops(s, tokens, levers["chunked_ce"])
    cost = {"compute": flops / (peak_flops * MFU * gpus)}
    w = dtype_bytes(dtype)
    grad = (4 if dtype in ("fp32", "amp-bf16") else 2) * P / (tp * pp)       # one rank's gradient bytes
    link = link_bps(g, gpus)
    comm = data_parallel_bytes(dp, zero, w * P / (tp * pp), grad, accum) / link
    if tp > 1:
        comm += 4 * s["L"] / pp * 2 * (tp - 1) / tp * mb * seq * s["h"] * 2 * accum / link
    if comm:
        cost["comm"] = comm
    if offload:
        cost["offload"] = offload_seconds(grad / dp, offload, accum, P // (tp * pp * dp), g)
    host = dict(est.host)
    if levers["activation_offload"]:
        cost["activation offload"] = 2 * host_seconds(host.get("activations", 0), g) * accum
    if pp > 1:
        cost["bubble"] = cost["compute"] * (pp - 1) / max(accum, 1)
    paged = 0
    if opt.startswith("paged-"):           # bitsandbytes pages its moments; mixed's fp32 master stays put
        paged = est.peak_parts["optimizer"] * ((2 + 8 / 256) / (6 + 8 / 256) if dtype == "mixed" else 1)
    sharded = bool(zero or offload or tp > 1 or pp > 1)
    allocator = frag + _rounding(ctx, dtype, opt, levers["fused_step"], sharded)
    tech = [DTYPES[dtype], OPT_NAMES[opt], RECOMPUTE[levers["recompute"]]]
    tech += ["optimizer step fused into backward"] * levers["fused_step"] + ["activation offload"] * \
        levers["activation_offload"] + [CE_NAMES[levers["chunked_ce"]]] * bool(levers["chunked_ce"])
    tech += ["eager attention"] * (levers["attention"] == "eager")
    tech += [f"dp={dp}"] * (dp > 1) + [f"ZeRO-{zero}"] * bool(zero) + [f"tp={tp}"] * (tp > 1) + \
        [f"pp={pp}"] * (pp > 1) + [f"{offload} offload"] * bool(offload) + \
        [f"micro-batch {mb} x {accum} accumulation"] * (accum > 1)
    return _finish(ctx, est.peak_parts, allocator, levers, tech, cost, host=host, paged=paged)


def adapter_plans(ctx, quantized):
    """LoRA / QLoRA: the frozen base in 16, 8 or 4 bits, replicated or sharded over the GPUs (FSDP of a LoRA
    model), adapters of any rank on any targets with their optimizer state, recomputation, activation
    offload, chunked cross-entropy, micro-batches."""
    s = ctx["shape"]
    seq, batch, gpus = ctx["seq"], ctx["batch"], ctx["gpus"]
    if batch % gpus:
        return []
    targets = tuple(check_targets(t) for t in choose(ctx, "targets", TARGET_SETS))
    out = []
    for mb in choose(ctx, "micro_batch", micro_batches(batch, gpus)):
        if batch % (gpus * mb):
            continue
        accum = batch // (gpus * mb)
        if ctx["fix"].get("grad_accum", accum) != accum:
            continue
        frag = ctx["fragmentation"]
        for rc, act, ce in itertools.product(choose(ctx, "recompute", RECOMPUTE),
                                             choose(ctx, "activation_offload", (False, True)),
                                             choose(ctx, "chunked_ce", (False, True))):
            if act and rc is not True and "activation_offload" not in ctx["fix"]:
                continue                                # as for full training: with full recomputation
            est = training_step(s, mb, seq, "bf16", None, rc, False, False, "cuda", None, chunked_ce=ce,
                                attention=ctx["attention"], activation_offload=act, frozen=True)
            for weights, rank, tgt, opt, shard, adapter_dtype, dropout in itertools.product(
                    choose(ctx, "weights", ("nf4", "int8") if quantized else ("bf16",)), choose(ctx, "rank", RANKS),
                    targets, choose(ctx, "optimizer", ("adamw", "adamw-8bit")),
                    choose(ctx, "shard_base", (False, True) if gpus > 1 else (False,)),
                    choose(ctx, "adapter_dtype", ("fp32",)), choose(ctx, "lora_dropout", (0.0,))):
                levers = dict(weights=weights, rank=rank, targets=tgt, optimizer=opt, recompute=rc,
                              activation_offload=act, chunked_ce=ce, attention=ctx["attention"], shard_base=shard,
                              dp=gpus, micro_batch=mb, grad_accum=accum, adapter_dtype=adapter_dtype,
                              lora_dropout=dropout,
                              quantized_saves_input=weights != "bf16"
                              and ctx["fix"].get("quantized_saves_input", False))
                out.append(adapter_plan(ctx, est, levers, frag))
    return out


def adapter_plan(ctx, est, levers, frag):
    """One LoRA/QLoRA plan from a frozen-base step's moments (`est`: training_step with no optimizer) and
    its levers; also what labkit.plan.recipes uses for a published recipe's exact settings."""
    s, g, P, gpus, seq = ctx["shape"], ctx["gpu"], ctx["params"], ctx["gpus"], ctx["seq"]
    weights, rank, tgt, opt = levers["weights"], levers["rank"], levers["targets"], levers["optimizer"]
    rc, shard, mb, accum = levers["recompute"], levers["shard_base"], levers["micro_batch"], levers["grad_accum"]
    A = lora_params(s["config"], rank, tgt)
    aw, ag, ao = adapter_state_bytes(A, opt, levers["adapter_dtype"])
    split = gpus if shard else 1
    base = quantized_weight_bytes(s["config"], weights) / split + (gathered_unit_bytes(s, weights) if shard else 0)
    delta = lora_activation_bytes(s, rank, tgt, 2, levers["adapter_dtype"], levers["lora_dropout"]) - \
        frozen_base_saving(s)
    if levers.get("quantized_saves_input"):            # bitsandbytes < 0.44 (labkit.plan.quantized_input_bytes)
        delta += quantized_input_bytes(s, tgt, 2, levers["adapter_dtype"])
    # layers whose adapters keep their activations as backward starts: all (or those in flight under
    # activation offload); none with full recomputation, where only the recomputed one holds them
    kept = 0 if rc is True else min(2, s["L"]) if levers["activation_offload"] else s["L"]
    tokens_mb = mb * seq
    largest = max(a * b for a, b in linears(s).values())
    dequant = 2 * 2 * largest if weights != "bf16" else 0         # a dequantized 16-bit matrix (and its transpose)
    best = None
    for name, m in est.moments.items():
        # the adapters' gradients: all of them in the optimizer step and once a layer's backward has run;
        # as backward starts, only those of earlier micro-batches
        m = dict(m, parameters=base + aw / split, optimizer=ao / split,
                 gradients=ag / split if name != "start of backward" or accum > 1 else 0)
        if name == "optimizer step":
            m.update(activations=0, other=0)
        elif name == "recomputation":           # one layer recomputed, a base matrix dequantized in its backward
            m["activations"] += tokens_mb * delta
            m["other"] += dequant
        else:
            m["activations"] += tokens_mb * kept * delta
        if best is None or sum(m.values()) > sum(best.values()):
            best = m
    tokens = ctx["batch"] * seq
    flops = train_flops(P, tokens, rc, frozen=True) + attention_flops(s, seq, tokens, rc)
    flops += ce_recompute_flops(s, tokens, levers["chunked_ce"])
    cost = {"compute": flops / (g["bf16_flops"] * MFU * gpus)}
    if weights != "bf16":
        passes = 3 if rc is True else 2        # forward, backward (and the recomputed forward)
        cost["dequant"] = passes * accum * s["L"] * sum(a * b for a, b in linears(s).values()) * 4 / g["hbm_bps"]
    link = link_bps(g, gpus)
    if gpus > 1:
        f = (gpus - 1) / gpus
        gathers = 2 * f * quantized_weight_bytes(s["config"], weights) * accum if shard else 0   # per micro-batch
        cost["comm"] = (2 * f * ag + gathers) / link
    host = {}
    if levers["activation_offload"]:
        host["activations"] = est.host.get("activations", 0)
        cost["activation offload"] = 2 * host_seconds(host["activations"], g) * accum
    paged = best["optimizer"] if opt.startswith("paged-") else 0
    tech = ([{"nf4": "NF4 base (double quant)", "int8": "int8 base"}[weights]] if weights != "bf16" else ["bf16 base"])
    tech += [f"LoRA r={rank} on {'+'.join(tgt)}", OPT_NAMES[opt], RECOMPUTE[rc]]
    tech += ["activation offload"] * levers["activation_offload"] + [CE_NAMES[levers["chunked_ce"]]] * \
        bool(levers["chunked_ce"]) + ["eager attention"] * (levers["attention"] == "eager")
    tech += [f"base sharded over {gpus} GPUs (FSDP)" if shard else f"dp={gpus}"] * (gpus > 1)
    tech += [f"micro-batch {mb} x {accum} accumulation"] * (accum > 1)
    return _finish(ctx, best, frag, levers, tech, cost, host=host, paged=paged)


def serve_plans(ctx):
    """Serving `batch` concurrent sequences of `seq` tokens: weights (16, 8 or 4 bits), a paged KV cache
    (16 or 8 bits), one prefill's activations; replicas x tensor parallelism; prefill and decode priced."""
    from ..estimate import estimate
    s, cfg, g, P = ctx["shape"], ctx["config"], ctx["gpu"], ctx["params"]
    seq, batch, gpus = ctx["seq"], ctx["batch"], ctx["gpus"]
    frag = ctx["fragmentation"]
    prompt = max(seq - OUTPUT_TOKENS, 1)
    out = []
    for replicas, tp, pp in layouts(gpus, s):
        if pp > 1 or ctx["fix"].get("tp", tp) != tp or ctx["fix"].get("replicas", replicas) != replicas:
            continue
        users = -(-batch // replicas)                    # sequences per replica
        prefill = estimate(cfg, batch=1, seq=seq, dtype="bf16", training=False, method="formula", tp=tp)
        kv_share = max(1, s["kv"] // tp) / s["kv"]
        for weights, kv_dtype, block in itertools.product(choose(ctx, "weights", ("bf16", "int8", "nf4")),
                                                          choose(ctx, "kv_dtype", ("bf16", "int8")),
                                                          choose(ctx, "block_size", (BLOCK_SIZE,))):
            kv = kv_bytes(cfg, users, seq, kv_dtype, block) * kv_share
            w = quantized_weight_bytes(cfg, weights) / tp
            parts = dict(parameters=w, kv_cache=kv, activations=prefill.peak_parts["activations"],
                         other=prefill.peak_parts["other"])
            flop_rate = g["bf16_flops"] * MFU
            cost = {"prefill": (2 * P / tp * users * prompt + attention_flops(s, prompt, users * prompt) / 3 / tp)
                    / flop_rate}
            kv_mid = kv_bytes(cfg, users, prompt + OUTPUT_TOKENS // 2, kv_dtype, block) * kv_share
            step = max((w + kv_mid) / (g["hbm_bps"] * HBM_UTIL), 2 * P / tp * users / flop_rate)
            cost["decode"] = OUTPUT_TOKENS * step
            if weights != "bf16":
                cost["dequant"] = OUTPUT_TOKENS * (P / tp) * 4 / g["hbm_bps"]
            if tp > 1:
                cost["comm"] = OUTPUT_TOKENS * 2 * s["L"] * 2 * (tp - 1) / tp * users * s["h"] * 2 / link_bps(g, gpus)
            tps = users * replicas * OUTPUT_TOKENS / sum(cost.values())
            tech = [{"bf16": "bf16 weights", "int8": "int8 weights", "nf4": "NF4 weights"}[weights],
                    f"{'bf16' if kv_dtype == 'bf16' else '8-bit'} paged KV (blocks of {block})"]
            tech += [f"tp={tp}"] * (tp > 1) + [f"{replicas} replicas"] * (replicas > 1)
            levers = dict(weights=weights, kv_dtype=kv_dtype, tp=tp, replicas=replicas, block_size=block)
            out.append(_finish(ctx, parts, frag, levers, tech, cost, tokens_per_s=tps))
    return out
