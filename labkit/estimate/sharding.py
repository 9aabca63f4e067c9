"""One rank's share of a step spread over devices: `Parallel` (the degrees), and the division of each
category of memory by them (data parallelism with ZeRO, tensor and pipeline parallelism, offload to the
host). No torch: plain arithmetic on the bytes the formulas (or a measured step) give for one device.

    weights      / tp*pp, and / dp with ZeRO-3        gradients   / tp*pp, and / dp with ZeRO >= 2
    optimizer    / tp*pp, and / dp with ZeRO >= 1     activations / tp (sequence parallelism)
    kv cache     / the KV heads a tp rank holds       ZeRO-3 adds the largest module, gathered whole
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..checks import count

__all__ = ["Parallel", "ZERO_STAGES", "OFFLOADS", "as_parallel", "make_layout", "check_layout", "layout_problem",
           "divisors", "shard", "per_rank", "gathered", "move_to_host", "parallel_note"]

ZERO_STAGES = (0, 1, 2, 3)
OFFLOADS = (None, "optimizer", "parameters")


@dataclass(frozen=True)
class Parallel:
    """How a training step is spread over dp x tp x pp devices; `estimate(..., parallel=...)` gives one rank.

    dp: data-parallel ranks (the estimate's batch is one rank's micro-batch). zero: the ZeRO stage over them
    (Rajbhandari et al. 2020): 1 shards the optimizer state, 2 the gradients too, 3 the weights too.
    tp, pp: tensor- and pipeline-parallel degrees. offload: None, "optimizer" (ZeRO-Offload: the optimizer
    state, fp32 master weights and, with zero >= 2, the gradient partitions in CPU memory) or "parameters"
    (ZeRO-Infinity on CPU, FSDP's CPUOffloadPolicy: the weight partitions too; needs zero=3).
    Checked here; what depends on the model (tp divides the heads, pp <= layers) is checked by estimate.
    """
    dp: int = 1
    zero: int = 0
    tp: int = 1
    pp: int = 1
    offload: str | None = None

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            object.__setattr__(self, name, count(name, getattr(self, name), 1))
        if isinstance(self.zero, bool) or self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES} (the ZeRO stage), got {self.zero!r}")
        if self.offload not in OFFLOADS:
            raise ValueError(f"offload must be None, 'optimizer' or 'parameters', got {self.offload!r}")
        if self.offload == "parameters" and self.zero != 3:
            raise ValueError(f"offload='parameters' offloads the weight partitions of ZeRO-3 (FSDP); use zero=3, "
                             f"got zero={self.zero!r}")

    @property
    def world(self):
        """Devices in all: dp x tp x pp."""
        return self.dp * self.tp * self.pp


def as_parallel(parallel=None, **flat):
    """The Parallel a call runs with: `parallel` itself, or one made of the flat keywords (dp=, zero=, tp=,
    pp=, offload=; None: not given). Both at once is an error: which one would hold?"""
    given = {name: value for name, value in flat.items() if value is not None}
    if parallel is None:
        return Parallel(**given)
    if not isinstance(parallel, Parallel):
        raise ValueError(f"parallel must be a labkit.estimate.Parallel, e.g. Parallel(dp=8, zero=3), got {parallel!r}")
    if given:
        flat_text = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(f"pass the parallel degrees either as parallel={parallel!r} or as keywords, not both: "
                         f"got {flat_text} too")
    return parallel


def make_layout(parallel, shape=None):
    """The dict the division below reads (est.parallel): dp, tp, pp, zero, offload, and, from a model's
    `shape` (config.model_shape), the KV heads it has and that each tp rank holds, after `check_layout`."""
    out = {"dp": parallel.dp, "tp": parallel.tp, "pp": parallel.pp, "zero": parallel.zero,
           "offload": parallel.offload}
    if shape is not None:
        check_layout(shape, out)
    return out


def layout_problem(shape, tp, pp):
    """Why a tp x pp layout cannot exist for this model (`shape`: config.model_shape), or "" if it can.

    Every tp rank holds whole attention heads, so tp must divide num_attention_heads. With tp at most
    the KV heads, tp must divide them too (each rank holds kv/tp); with tp above them, each rank holds
    one KV head, replicated tp/kv times, so kv must divide tp (Megatron-LM's and vLLM's rule:
    vllm/model_executor/layers/linear.py QKVParallelLinear). pp stages hold whole layers: pp <= layers.
    """
    a, kv, L = shape["a"], shape["kv"], shape["L"]
    if tp > 1 and a and a % tp:
        return f"tp={tp} must divide num_attention_heads {a} (each rank holds whole heads)"
    if tp > 1 and kv and (kv % tp if tp <= kv else tp % kv):
        return (f"tp={tp} and num_key_value_heads {kv}: one must divide the other (each rank holds "
                f"{'kv/tp' if tp <= kv else 'one'} KV head{'s' if tp <= kv else ', replicated'})")
    if pp > 1 and L and pp > L:
        return f"pp={pp} is more pipeline stages than num_hidden_layers {L} (a stage holds whole layers)"
    return ""


def check_layout(shape, layout):
    """Refuse a tp x pp layout that cannot exist for this model (`layout_problem`); note the KV heads each
    tp rank holds."""
    problem = layout_problem(shape, layout["tp"], layout["pp"])
    if problem:
        raise ValueError(problem)
    kv, tp = shape["kv"], layout["tp"]
    if kv:
        layout["kv_heads"], layout["kv_heads_per_rank"] = kv, max(1, kv // tp)


def divisors(layout):
    """What each category is divided by on one rank (a KV cache replicated when tp > kv heads)."""
    mp, dp, z = layout["tp"] * layout["pp"], layout["dp"], layout["zero"]
    kv, per_rank = layout.get("kv_heads"), layout.get("kv_heads_per_rank")
    cache = mp
    if kv and per_rank:                     # an int where it divides evenly (a search calls this often)
        cache = kv * layout["pp"] // per_rank if kv * layout["pp"] % per_rank == 0 else Fraction(kv * layout["pp"], per_rank)
    return {"parameters": mp * (dp if z >= 3 else 1), "gradients": mp * (dp if z >= 2 else 1),
            "optimizer": mp * (dp if z >= 1 else 1), "activations": layout["tp"],
            "kv_cache": cache, "other": layout["tp"]}


def shard(moment, layout, phase=""):
    """One moment's bytes per category on one rank. Inside step() "other" is the optimizer's temporaries,
    sharded as its state; elsewhere it is the loss gradient, split over the vocabulary by tp."""
    div = divisors(layout)
    if phase == "optimizer step":
        div["other"] = div["optimizer"]
    return {c: -(-v // div[c]) for c, v in moment.items()}


def per_rank(est, layout, w=2, grad_accum=False):
    """An estimate made for one device, divided as `shard` says (the measured and inference paths), with
    ZeRO-3's gathered layer and what `offload` moves to the host."""
    if all(layout[k] == 1 for k in ("dp", "tp", "pp")) and not layout["zero"] and not layout.get("offload"):
        return est
    before = max(sum(est.peak_parts.values()), 1)
    if layout["zero"] >= 3 and grad_accum:     # the fp32 partition alone: no w-byte gradient partition
        est.parts["gradients"] -= min(est.parts["gradients"], w * est.params)
        if est.phase == "optimizer step":      # the only moment that holds every w-byte gradient
            est.peak_parts["gradients"] -= min(est.peak_parts["gradients"], w * est.params)
    est.parts = shard(est.parts, layout)
    est.peak_parts = shard(est.peak_parts, layout, est.phase)
    extra = gathered(est.largest_layer, w, layout)
    est.parts, est.host = move_to_host(est.parts, layout, extra, extra)
    in_step = est.phase == "optimizer step"
    est.peak_parts, _ = move_to_host(est.peak_parts, layout, 0 if in_step else extra, 0 if in_step else extra,
                                     est.phase)
    est.total = sum(est.peak_parts.values())
    scale = est.total / before
    est.first_step, est.steady = int(est.first_step * scale), int(est.steady * scale)
    est.parallel = dict(layout)
    est.notes.append(parallel_note(layout))
    return est


def gathered(largest, w, layout):
    """ZeRO-3: the largest module's weights gathered whole on every rank while it runs (its tp share)."""
    return -(-w * largest // layout["tp"]) if layout["zero"] >= 3 else 0


def move_to_host(moment, layout, weights_gathered, grads_gathered, phase=""):
    """(what one rank's device holds, what its CPU holds) for one moment: ZeRO-3's gathered layer added,
    then `offload`'s categories moved to the host (the gathered buffers stay on the device)."""
    out, host, where = dict(moment), {}, layout.get("offload")
    moved = {"optimizer": ("optimizer",) + (("gradients",) if layout["zero"] >= 2 else ()),
             "parameters": ("optimizer", "gradients", "parameters")}.get(where, ())
    for c in moved:
        host[c], out[c] = out[c], 0
    if where and phase == "optimizer step":      # the step runs on the CPU: its temporaries are there
        host["other"], out["other"] = out.get("other", 0), 0
    out["parameters"] += weights_gathered
    out["gradients"] += grads_gathered
    return out, host


def parallel_note(layout):
    """The note an estimate carries about the layout it is one rank of."""
    where = layout.get("offload")
    return (f"per rank of dp={layout['dp']} x tp={layout['tp']} x pp={layout['pp']}, "
            f"ZeRO stage {layout['zero']}" + (f", {where} offloaded to CPU memory (est.host)" if where else ""))

