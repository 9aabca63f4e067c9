"""What `plan` returns: `Plan` (one combination of levers: its memory per GPU by category, the host's share,
fit, seconds) and `Plans` (the ranked list with the question it answers, printable, never silent: when
nothing fits it says the smallest peak, the category that breaks the budget and what would shrink it)."""
from __future__ import annotations

import dataclasses
import json

from ..checks import count
from ..units import fmt_bytes
from .capacity import CUDA_CONTEXT, HOST_BUFFER
from .cost import CPU_GBPS, HBM_UTIL, MFU, OUTPUT_TOKENS

__all__ = ["CATS", "SHRINKS", "shrinks", "Plan", "Plans"]

CATS = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other", "allocator")
# what shrinks each category, for the answer when nothing fits: (what, the lever and value that mean the
# closest plan already uses it, or None)
SHRINKS = {
    "parameters": [("more GPUs to shard the weights over (ZeRO-3/FSDP, tensor or pipeline parallelism)", None),
                   ("weights in 8 or 4 bits (task qlora; serving)", ("weights", "nf4")),
                   ("parameter offload with more host memory", ("offload", "parameters"))],
    "gradients": [("the optimizer step fused into backward", ("fused_step", True)),
                  ("ZeRO-2 over more GPUs", None), ("optimizer offload", ("offload", "optimizer"))],
    "optimizer": [("8-bit or paged optimizer state", ("optimizer", ("adamw-8bit", "paged-adamw-8bit"))),
                  ("ZeRO-1 over more GPUs", None), ("optimizer offload", ("offload", "optimizer"))],
    "activations": [("a smaller micro-batch or sequence", ("micro_batch", 1)),
                    ("full recomputation", ("recompute", True)), ("activation offload", ("activation_offload", True)),
                    ("tensor parallelism (sequence-parallel activations)", None)],
    "kv_cache": [("fewer concurrent sequences", None), ("an 8-bit cache", ("kv_dtype", "int8")),
                 ("more GPUs (tensor parallelism)", None)],
    "other": [("chunked cross-entropy (the logits' gradient)", ("chunked_ce", True)),
              ("a smaller micro-batch", ("micro_batch", 1))],
    "allocator": [("a smaller micro-batch (the allocator's blocks follow the largest tensors)", ("micro_batch", 1))],
    "host": [("more host memory (host_memory=, --host-mem)", None), ("a plan that offloads less", None)],
}


def shrinks(category, levers=None):
    """What would shrink `category`, less what a plan with `levers` already uses, as one phrase."""
    levers = levers or {}
    ways = [what for what, used in SHRINKS[category]
            if used is None or levers.get(used[0]) not in (used[1] if isinstance(used[1], tuple) else (used[1],))]
    if not ways:
        return "nothing this plan does not use already"
    return ways[0] if len(ways) == 1 else ", ".join(ways[:-1]) + " or " + ways[-1]


@dataclasses.dataclass
class Plan:
    """One combination of levers: its techniques, memory per GPU by category (`parts`, summing to
    `peak_bytes`: what the card must hold, the allocator's share included), what it puts on the host
    (`host`, per category for one rank; `host_bytes` for the node), fit, and cost (seconds)."""
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
    host: dict = dataclasses.field(default_factory=dict)
    host_bytes: int = 0
    host_budget: int = 0
    counted_bytes: int = 0        # what PyTorch's counters see at the peak: peak_bytes less paged state
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self):
        return dataclasses.asdict(self)


def why_not(parts, budget, host_bytes=0, host_budget=None):
    """The first category, in CATS order, at which the running sum passes the budget; else the host."""
    total = 0
    for c in CATS:
        total += parts.get(c, 0)
        if parts.get(c, 0) and total > budget:
            return f"over at {c}: {fmt_bytes(total)} > {fmt_bytes(budget)}"
    if host_budget is not None and host_bytes > host_budget:
        return f"host memory: {fmt_bytes(host_bytes)} > {fmt_bytes(host_budget)}"
    return ""


class Plans(list):
    """The ranked plans (see labkit.plan.cost for the rule), with the question they answer.

    question: model, task, gpu, gpus, seq, batch, memory (the card's bytes as the driver reports them),
    usable (less the CUDA context), host_memory, host_default, attention, levers (those fixed), source,
    memory_source, params, config (the transformers config, not in to_json). verification: what
    labkit.plan.verify found for the top plan (plan(..., verify=True)), else None."""

    def __init__(self, plans, question, notes=()):
        super().__init__(plans)
        self.question = question
        self.notes = list(notes)
        self.verification = None

    @property
    def best(self):
        """The top plan if it fits, else None."""
        return self[0] if self and self[0].fits else None

    def advice(self):
        """When nothing fits: the smallest peak found, the category that breaks the budget, what would come
        closest and what would shrink it. None when a plan fits."""
        if self.best is not None or not self:
            return None
        q = self.question
        on_card = [p for p in self if p.counted_bytes <= p.budget]
        if on_card:                                      # the card holds them: the host does not
            closest = min(on_card, key=lambda p: (p.host_bytes, p.counted_bytes))
            return (f"nothing fits: every plan that fits the card needs more host memory; the closest, "
                    f"{', '.join(closest.techniques)}, needs {fmt_bytes(closest.host_bytes)} of host memory, "
                    f"{fmt_bytes(q['host_memory'])} available. What would help: {shrinks('host')}.")
        closest = min(self, key=lambda p: (p.counted_bytes, p.host_bytes))
        worst = max((c for c in CATS if c != "allocator"), key=lambda c: closest.parts.get(c, 0))
        return (f"nothing fits: the smallest peak found is {fmt_bytes(closest.counted_bytes)} per GPU against "
                f"{fmt_bytes(closest.budget)} usable ({fmt_bytes(closest.counted_bytes - closest.budget)} over), "
                f"with {', '.join(closest.techniques)}; it is {closest.why}; its largest category is {worst} "
                f"({fmt_bytes(closest.parts[worst])}). What would shrink {worst}: {shrinks(worst, closest.levers)}.")

    def table(self, rows=10):
        """The ranked plans as text: the first `rows` distinct ones, the answer when nothing fits, the
        capacity and the cost model's constants."""
        rows = count("rows", rows)
        q = self.question
        serve = q["task"] == "serve"
        lines = [f"{q['model']}: {q['task']} on {q['gpus']} x {q['gpu']}, seq {q['seq']}, batch {q['batch']}; "
                 f"{len(self)} plans, {sum(p.fits for p in self)} fit",
                 f"{'#':>3} {'fits':<4} {'peak/GPU':>10} {'host':>10} {'tok/s' if serve else 'step s':>9}  "
                 f"techniques / why   (peak/GPU: what PyTorch's allocator serves, its own share included; "
                 f"paged optimizer state apart)"]
        shown, hidden = set(), 0
        for n, p in enumerate(self, 1):
            key = (p.fits, p.peak_bytes, round(p.step_time_s, 3), p.host_bytes)
            if key in shown:           # the same memory and time as a plan above
                hidden += 1
                continue
            if len(shown) == rows:
                break
            shown.add(key)
            speed = f"{p.tokens_per_s:>9,.0f}" if serve else f"{p.step_time_s:>9.2f}"
            lines.append(f"{n:>3} {'yes' if p.fits else 'no':<4} {fmt_bytes(p.counted_bytes):>10} "
                         f"{fmt_bytes(p.host_bytes) if p.host_bytes else '-':>10} {speed}  "
                         f"{', '.join(p.techniques)}" + ("" if p.fits else f"  <- {p.why}"))
        if hidden:
            lines.append(f"    ({hidden} plans with the same memory and time as one above not shown)")
        advice = self.advice()
        if advice:
            lines.append(advice)
        lines += self.notes
        if self.verification is not None:
            v = self.verification
            lines.append(v.table() if hasattr(v, "table") else str(v))
        lines.append(f"capacity: {fmt_bytes(q['memory'])} per card as the driver reports it ({q['memory_source']}), "
                     f"less {fmt_bytes(CUDA_CONTEXT)} of CUDA context; allocator's share from labkit.alloc's replay "
                     f"of the step; host memory {fmt_bytes(q['host_memory'])}"
                     f"{' (default: stated in labkit.plan.capacity)' if q['host_default'] else ''}, offloaded "
                     f"states x {HOST_BUFFER} (DeepSpeed's buffer factor)")
        lines.append(f"cost model: MFU {MFU}, HBM at {HBM_UTIL:.0%}, CPU Adam at {CPU_GBPS} GB/s"
                     + (f", {OUTPUT_TOKENS} generated tokens per request" if serve else "")
                     + "; no overlap of compute, transfers and communication (an upper bound); pure bf16 ranks "
                     "after plans with fp32 master weights; spec-sheet FLOP/s and bandwidths from data/gpus.csv")
        return "\n".join(lines)

    def to_json(self, rows=None):
        """The question, the answer when nothing fits and the first `rows` plans (all by default) as JSON."""
        rows = None if rows is None else count("rows", rows)
        chosen = list(self) if rows is None else list(self)[:rows]
        question = {k: v for k, v in self.question.items() if k != "config"}    # the config object stays out
        out = dict(question=question, fits=sum(p.fits for p in self), count=len(self),
                   advice=self.advice(), notes=self.notes, plans=[p.to_dict() for p in chosen])
        if self.verification is not None:
            v = self.verification
            out["verification"] = v.to_dict() if hasattr(v, "to_dict") else str(v)
        return json.dumps(out, indent=1, default=str)
