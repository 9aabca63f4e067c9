"""Verify a plan by measurement: its step for the real model, run on fake tensors, beside the planner's formula.

`verify(plans)` takes the top plan of `plan(...)` and runs its training or serving step for the question's model
on FakeTensorMode tensors (shapes and dtypes, no data: a 70B step measured on a laptop), with every lever that
fake tensors can run, under `lk.track`. What runs here and what does not:

    measured     precision (fp32, autocast bf16, pure bf16, bf16 weights with fp32 master weights), recomputation
                 (every layer; "selective": the attention core re-run in backward, as Megatron-LM's selective
                 recomputation checkpoints `core_attention`), eager or SDPA attention, activation offload (what
                 autograd saves leaves the device in pack and comes back in unpack, notebook 04), LoRA adapters at
                 any rank on any targets (fp32 by default, as peft keeps them beside a 16-bit base), chunked
                 cross-entropy (labkit.kernels, notebook 12; or torchtune's chunked output), the optimizer step
                 fused into backward (one AdamW per parameter stepped in a post-accumulate-grad hook: PyTorch's
                 tutorial, torchtune's optimizer_in_bwd), micro-batches with gradient accumulation, ZeRO-Offload's
                 (and parameter offload's) gradients streamed to the host as backward makes them; ZeRO-2/3 and a
                 sharded frozen base as one
                 rank of FSDP2 over a fake process group, counted by PyTorch's own `FSDPMemTracker`
                 (torch.distributed._tools: torchtitan's memory estimator does the same)
    formulas     8-bit and paged optimizer state (bitsandbytes has no fake-tensor kernels: the step runs AdamW and
                 the state is the formula's; `measure` on real tensors runs bitsandbytes itself), int8/NF4 weights
                 (run as bf16, their bytes the formula's), an 8-bit KV cache and paged blocks, ZeRO-1, what
                 parameter offload keeps on the host (its weights, gradients and state: the formula's), tensor and
                 pipeline parallelism (one rank of those is not run: nothing is measured), the allocator's share
                 (only a GPU measures it), and how much of a paged state stays resident (what the card leaves
                 beside the measured step; `Verification.gap` compares what PyTorch's allocator serves)

PyTorch's other tools in torch.distributed._tools: `MemTracker` counts the same unsharded step beside lk.track
when asked (`torch_tracker=True`: it revisits every module's books on every op, minutes for a 7B step);
`RuntimeEstimator` prices the step's ops by a roofline at the GPU's peak (`runtime=True`; it reads a CUDA GPU's
peak FLOP/s and bandwidth, so it runs where one is present) beside the planner's compute seconds. Its
`SACEstimator` and the integer program that picks what selective checkpointing saves (`sac_ilp.sac_milp`) are not
used, for reasons read in torch 2.13's source: SACEstimator must run under FakeTensorMode and prices every op it
sees with RuntimeEstimator, whose roofline (`_roofline_estimate`, the default) raises unless
`torch.cuda.is_available()` and whose benchmark mode times each op with CUDA events, so without a CUDA GPU it
stops at the first op; `sac_ilp` imports `pulp` when it is imported (an ImportError without it), and the
per-module trade-off curves the program reads come from `ilp_utils.aggregate_stats`, which fits them with
`pwlf` (`SACEstimator.pwlf_sac_tradeoff_curve`). So the program needs a CUDA GPU, pulp and pwlf; neither
package is in labkit/lock.txt (this environment or the GPU image). A plan's "selective" is measured as run.

Micro-batches after the second repeat the second one (the same tensors are alive), so at most two run. The
optimizer state is made before the measured step (AdamW on zero gradients), so one step shows the steady state.
`Step` is the training step itself, for fake and real tensors alike (notebook 13 runs it on a real tiny Llama).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import time
import warnings

import numpy as np
import torch

from .. import checks
from ..estimate.config import build_model
from ..launch import fake_ranks
from ..units import fmt_bytes

__all__ = ["verify", "Verification", "measure", "Step", "prepare", "weights_dtype", "levers_with_defaults", "LoRALinear",
           "add_lora", "SavedToHost", "TRAIN_DEFAULTS", "ADAPTER_DEFAULTS", "SERVE_DEFAULTS"]

CATS = ("parameters", "gradients", "optimizer", "activations", "kv_cache", "other")
ALL_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")
TRAIN_DEFAULTS = dict(dtype="mixed", optimizer="adamw", fused_step=False, recompute=False, activation_offload=False,
                      chunked_ce=False, attention="sdpa", dp=1, zero=0, tp=1, pp=1, offload=None, micro_batch=1,
                      grad_accum=1)
ADAPTER_DEFAULTS = dict(weights="bf16", rank=16, targets=ALL_LINEARS, optimizer="adamw", fused_step=False,
                        recompute=False, activation_offload=False, shard_base=False, dp=1, micro_batch=1,
                        grad_accum=1, chunked_ce=False, attention="sdpa", adapter_dtype="fp32", lora_dropout=0.0,
                        quantized_saves_input=False)
SERVE_DEFAULTS = dict(weights="bf16", kv_dtype="bf16", tp=1, replicas=1, block_size=16)


# ---- the result ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Verification:
    """A plan beside its measurement: bytes per category of one GPU at the peak, where each came from."""
    model: str
    task: str
    techniques: list
    levers: dict
    formula: dict              # the plan's parts without the allocator's share
    measured: dict | None      # the measured parts (categories the source names "formula" copied from the plan)
    source: dict               # category -> "measured" or "formula (<lever>)"
    formula_only: list         # "<lever>: why it is not measured here"
    tools: dict                # PyTorch's own trackers on the same step: name -> bytes
    notes: list
    seconds: float
    allocator: int = 0         # the planner's allocator share (formula on both sides)
    paged: tuple = (0, 0)      # a paged optimizer's state resident on the card: (plan, beside the measured step)
    paged_host: int = 0        # the rest of that state, on the host (the plan's)

    @property
    def formula_peak(self):
        return sum(self.formula.values())

    @property
    def measured_peak(self):
        return None if self.measured is None else sum(self.measured.values())

    @property
    def gap(self):
        """measured / formula - 1 of what PyTorch's allocator serves at the peak (the live bytes, a paged
        optimizer's state apart: it lives outside the allocator and fills what the card leaves, so both sides
        would reach the card's size); None when nothing was measured."""
        if self.measured is None:
            return None
        return (self.measured_peak - self.paged[1]) / (self.formula_peak - self.paged[0]) - 1

    def table(self):
        lines = [f"verify: {self.model}, {self.task}: {', '.join(self.techniques)}",
                 f"{'category':<12} {'plan (formula)':>15} {'verify':>12}  source"]
        for c in CATS:
            f, m = self.formula.get(c, 0), (self.measured or {}).get(c)
            if f or m:
                lines.append(f"{c:<12} {fmt_bytes(f):>15} {fmt_bytes(m) if m is not None else '-':>12}  {self.source.get(c, '')}")
        if self.measured is None:
            lines.append(f"{'peak':<12} {fmt_bytes(self.formula_peak):>15} {'-':>12}  not measured")
        elif any(self.paged):
            f, m = self.formula_peak - self.paged[0], self.measured_peak - self.paged[1]
            lines.append(f"{'served':<12} {fmt_bytes(f):>15} {fmt_bytes(m):>12}  gap {self.gap:+.1%} (what PyTorch's "
                         f"allocator serves: live bytes, the paged state apart; + its own {fmt_bytes(self.allocator)} "
                         f"by formula)")
            lines.append(f"{'paged state':<12} {fmt_bytes(self.paged[0]):>15} {fmt_bytes(self.paged[1]):>12}  resident: "
                         f"what the card leaves of {fmt_bytes(self.paged[0] + self.paged_host)} (formula)")
        else:
            lines.append(f"{'peak':<12} {fmt_bytes(self.formula_peak):>15} {fmt_bytes(self.measured_peak):>12}  "
                         f"gap {self.gap:+.1%} (live bytes; + the allocator's {fmt_bytes(self.allocator)} by formula)")
        for name, value in self.tools.items():
            lines.append(f"  {name}: {fmt_bytes(value) if isinstance(value, int) else value}")
        for what in self.formula_only:
            lines.append(f"  formula only: {what}")
        lines += [f"  {n}" for n in self.notes]
        lines.append(f"  ({self.seconds:.1f} s on fake tensors)")
        return "\n".join(lines)

    __str__ = table

    def to_dict(self):
        out = dataclasses.asdict(self)
        out.update(formula_peak=self.formula_peak, measured_peak=self.measured_peak, gap=self.gap)
        return out


# ---- the public entry point ---------------------------------------------------------------------------
def verify(plans, index=0, config=None, max_micro_batches=2, torch_tracker=False, runtime=False):
    """Measure plan `index` (default: the top plan) of `plans` for the real model on fake tensors.

    plans: what `labkit.plan.plan` returns (its `question` names the model, task and sequence length).
    config: the model's config when `question["model"]` is not something `lk.estimate` loads by name.
    torch_tracker: also count the (unsharded) step with torch's MemTracker, beside lk.track (it visits every
    module's books on every op: minutes for a 7B step; sharded steps are always counted by FSDPMemTracker).
    runtime: also price the step with torch's RuntimeEstimator (a roofline at this machine's CUDA GPU).
    Returns a Verification; `print(v)` shows the measurement beside the formula, with the gap."""
    from ..estimate import load_config
    if not hasattr(plans, "question") or not isinstance(plans, list):
        raise TypeError(f"plans must be what labkit.plan.plan returns (Plans), got {type(plans).__name__}")
    index = checks.index("index", index, len(plans))
    q = plans.question
    top = plans[index]
    config = load_config(config if config is not None else q.get("config", q["model"]))
    start = time.perf_counter()
    measured, source, only, tools, notes = measure(config, q["task"], top.levers, q["seq"], batch=q["batch"],
                                                   device="fake", max_micro_batches=max_micro_batches,
                                                   plan_parts=top.parts, torch_tracker=torch_tracker, runtime=runtime)
    if runtime and "compute" in top.cost:
        tools["the planner's compute seconds (its GPU, at MFU " + str(_mfu()) + ")"] = f"{top.cost['compute']:.2f} s"
    formula = {c: int(top.parts.get(c, 0)) for c in CATS}
    allocator = int(top.parts.get("allocator", 0))
    # a paged optimizer's state (outside PyTorch's allocator) stays resident as far as the card has room beside
    # what the allocator serves (labkit.plan.paged_optimizer): the plan's share, and the share the measured
    # step leaves (the measured side took the plan's; it is recomputed here)
    paged, paged_host = (0, 0), int(top.host.get("paged", 0))
    resident = int(top.peak_bytes - top.counted_bytes)
    if measured is not None and (resident or paged_host):
        served = sum(measured.values()) - resident + allocator
        now = max(0, min(resident + paged_host, top.budget - served))
        measured["optimizer"] += now - resident
        paged = (resident, now)
        source["optimizer"] += "; resident: what the card leaves"
    return Verification(model=str(q["model"]), task=q["task"], techniques=list(top.techniques), levers=dict(top.levers),
                        formula=formula, measured=measured, source=source, formula_only=only, tools=tools,
                        notes=notes, seconds=time.perf_counter() - start, allocator=allocator, paged=paged,
                        paged_host=paged_host)


CHOICES = dict(dtype=("fp32", "amp-bf16", "mixed", "bf16"), recompute=(False, True, "selective"),
               chunked_ce=(False, True, "output"), attention=("sdpa", "eager"), offload=(None, "optimizer", "parameters"),
               weights=("bf16", "int8", "nf4"), kv_dtype=("bf16", "int8"), adapter_dtype=("fp32", "bf16"))


def levers_with_defaults(task, levers):
    """(the plan's levers with every missing one at its default, the names verify does not know). The planner
    adds levers over time; a known lever with a value verify cannot run is refused, naming it."""
    if not isinstance(levers, dict):
        raise TypeError(f"levers must be a dict of lever -> setting (a Plan's .levers), got {type(levers).__name__}")
    defaults = SERVE_DEFAULTS if task == "serve" else ADAPTER_DEFAULTS if task in ("lora", "qlora") else TRAIN_DEFAULTS
    unknown = sorted(set(levers) - set(defaults))
    out = dict(defaults, **{k: v for k, v in levers.items() if v is not None or k == "offload"})
    for name, allowed in CHOICES.items():
        if name in out and not any(out[name] is a or (out[name] == a and type(out[name]) is type(a)) for a in allowed):
            raise ValueError(f"levers[{name!r}] must be one of {allowed}, got {out[name]!r}")
    for name in ("micro_batch", "grad_accum", "dp", "tp", "pp", "rank", "replicas", "block_size"):
        if name in out:
            out[name] = checks.count(f"levers[{name!r}]", out[name])
    if "optimizer" in out and out["optimizer"] not in ("adamw", "adamw-8bit", "paged-adamw-8bit", "paged-adamw"):
        raise ValueError(f"levers['optimizer'] must be AdamW or one of its 8-bit or paged versions, got {out['optimizer']!r}")
    return out, unknown


def _mfu():
    from .cost import MFU
    return MFU


def measure(config, task, levers, seq, batch=1, device="fake", max_micro_batches=2, plan_parts=None, seed=0,
            torch_tracker=False, runtime=False):
    """The step of `task` with `levers` for `config`, measured on `device` ("fake", "cpu" or "cuda"); for
    serving, `batch` concurrent sequences of `seq` tokens over the plan's replicas.

    Returns (parts, source, formula_only, tools, notes): parts is bytes per category at the peak of one GPU
    (None when the layout is not run here), with the categories that formulas give taken from `plan_parts`
    (source says which). On real devices the same step runs on real tensors (tests and notebook 13 check the
    fake measurement against them)."""
    if task not in ("pretrain", "finetune", "lora", "qlora", "serve"):
        raise ValueError(f"task must be 'pretrain', 'finetune', 'lora', 'qlora' or 'serve', got {task!r}")
    if device not in ("fake", "cpu", "cuda"):
        raise ValueError(f"device must be 'fake', 'cpu' or 'cuda', got {device!r}")
    lv, unknown = levers_with_defaults(task, levers)
    notes = [f"levers verify does not know yet, left out of the measurement: {unknown}"] if unknown else []
    only = formula_only(task, lv, device)
    plan_parts = plan_parts or {}
    if task == "serve":
        return _serve(config, lv, seq, -(-batch // lv["replicas"]), device, only, notes, plan_parts)
    if task not in ("lora", "qlora") and (lv["tp"] > 1 or lv["pp"] > 1):
        notes.append(f"tp={lv['tp']}, pp={lv['pp']}: one rank of tensor or pipeline parallelism is not run here")
        return None, {}, only, {}, notes
    if lv.get("fused_step") and lv["grad_accum"] > 1:
        raise ValueError(f"levers fused_step=True with grad_accum={lv['grad_accum']}: a step fused into backward "
                         f"cannot accumulate gradients over micro-batches (torchtune refuses the pair)")
    parts, tools = _train(config, task, lv, seq, device, max_micro_batches, notes, seed, torch_tracker, runtime)
    source = {c: "measured" for c in CATS}
    ran = sum(parts.values())
    for cat, why in _formula_categories(task, lv, device).items():
        if cat in plan_parts:
            parts[cat] = int(plan_parts[cat])
            source[cat] = f"formula ({why})"
    if sum(parts.values()) != ran:
        tools = {"lk.track's peak of the step that ran (before the formula's categories)": ran, **tools}
    return parts, source, only, tools, notes


def bnb_runs(lv, device):
    """Whether bitsandbytes' own 8-bit optimizer can run the plan's step here: real tensors, and the package."""
    if device == "fake" or "8bit" not in str(lv.get("optimizer")):
        return False
    import importlib.util
    return importlib.util.find_spec("bitsandbytes") is not None


def formula_only(task, lv, device="fake"):
    """The plan's levers that this measurement takes from the planner's formulas, each with why."""
    out = []
    if task == "serve":
        if lv["weights"] != "bf16":
            out.append(f"weights={lv['weights']!r}: bitsandbytes' kernels do not run on fake tensors (run as bf16)")
        if lv["kv_dtype"] != "bf16":
            out.append(f"kv_dtype={lv['kv_dtype']!r}: the cache is measured in bf16 and halved by formula")
        out.append(f"paged KV blocks of {lv['block_size']}: the cache of {lv['block_size']}-token blocks by formula")
        if lv["tp"] > 1:
            out.append(f"tp={lv['tp']}: one rank of tensor parallelism is not run here")
        return out
    if ("8bit" in str(lv["optimizer"]) or "paged" in str(lv["optimizer"])) and not bnb_runs(lv, device):
        out.append(f"optimizer={lv['optimizer']!r}: bitsandbytes has no fake-tensor kernels (or is not installed); "
                   f"AdamW runs and the state's bytes are the formula's")
    if "paged" in str(lv["optimizer"]):
        out.append("paging (bitsandbytes' unified memory): what stays resident and what the driver moves to the "
                   "host is the formula's; a paged state lives outside PyTorch's allocator")
    if task in ("lora", "qlora"):
        if lv["weights"] != "bf16":
            out.append(f"weights={lv['weights']!r}: the frozen base runs in bf16; its bytes are the formula's")
        if lv.get("quantized_saves_input"):
            out.append("quantized_saves_input: what bitsandbytes' matmul saves is the formula's")
        return out
    if lv["zero"] == 1:
        out.append("zero=1: the optimizer state's share of one rank is the formula's (FSDP runs stages 2 and 3)")
    if lv["offload"] == "parameters" or lv["offload"] and lv["dp"] > 1:
        out.append(f"offload={lv['offload']!r} over dp={lv['dp']}: what leaves the device is the formula's")
    if lv["dp"] > 1 and not lv["zero"]:
        out.append(f"dp={lv['dp']} without ZeRO: one replica is measured; DDP's gradient buckets are left out")
    return out


def _formula_categories(task, lv, device):
    """Categories whose bytes come from the plan (the formula), by lever."""
    out = {}
    if ("8bit" in str(lv["optimizer"]) and not bnb_runs(lv, device)) or "paged" in str(lv["optimizer"]):
        out["optimizer"] = lv["optimizer"]
    if task in ("lora", "qlora") and lv["weights"] != "bf16":
        out["parameters"] = f"{lv['weights']} weights"
    if task not in ("lora", "qlora") and lv["zero"] == 1:
        out["optimizer"] = "zero=1"
    if task not in ("lora", "qlora") and (lv["offload"] == "parameters" or lv["offload"] and lv["dp"] > 1):
        out.update(parameters=f"offload={lv['offload']}", gradients=f"offload={lv['offload']}",
                   optimizer=f"offload={lv['offload']}")
    return out


# ---- building the model (labkit.estimate.config.build_model) ------------------------------------------

def attention_name(config, attention, recompute):
    """The attention implementation to build with: `attention` ("sdpa", "eager"), or for recompute="selective"
    that function wrapped in torch.utils.checkpoint (Korthikanti et al. 2022's selective recomputation: the
    attention core re-runs in backward; Megatron-LM checkpoints its core_attention), registered under a name."""
    if recompute != "selective":
        return attention
    from transformers import AttentionInterface
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    if attention == "eager":             # the eager function of the model's own module (modeling_llama, ...)
        inner = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__].eager_attention_forward
    else:
        inner = AttentionInterface._global_mapping[attention]

    def checkpointed(module, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(inner, module, *args, use_reentrant=False, **kwargs)

    name = f"labkit_selective_{config.model_type}_{attention}"
    AttentionInterface.register(name, checkpointed)
    return name


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus B A dropout(x) (alpha / r) (Hu et al. 2021), as peft's LoRA layer computes it:
    A and B in `dtype` (fp32: peft keeps adapters in fp32 beside a 16-bit base), the input cast to it for them
    and the sum cast back to the base's dtype."""

    def __init__(self, base, rank, alpha=None, dtype=torch.float32, dropout=0.0):
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        kw = dict(dtype=dtype, device=base.weight.device)
        self.lora_A = torch.nn.Parameter(torch.empty(rank, base.in_features, **kw))      # r x d_in
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, **kw))     # d_out x r
        if base.weight.device.type != "meta":
            torch.nn.init.kaiming_uniform_(self.lora_A, a=5 ** 0.5)
        self.scaling = (alpha or 2 * rank) / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()

    def forward(self, x):
        out = self.base(x)
        x = self.dropout(x.to(self.lora_A.dtype))
        lora = torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_A), self.lora_B)
        return (out + lora * self.scaling).to(out.dtype)


def add_lora(model, rank, targets=ALL_LINEARS, dtype=torch.float32, dropout=0.0):
    """Every parameter frozen, then each target linear (q_proj ... down_proj) of every layer wrapped in a LoRALinear."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = {f"{t}_proj" for t in targets}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in names and isinstance(child, torch.nn.Linear):
                setattr(module, name, LoRALinear(child, rank, dtype=dtype, dropout=dropout))
    return model


def weights_dtype(task, levers):
    """The dtype the model's weights are built in for a plan: fp32 under "fp32" and autocast, else bf16 (pure bf16,
    bf16 weights beside fp32 masters, a LoRA/QLoRA base)."""
    if task in ("lora", "qlora", "serve"):
        return torch.bfloat16
    return torch.float32 if levers.get("dtype", TRAIN_DEFAULTS["dtype"]) in ("fp32", "amp-bf16") else torch.bfloat16


def prepare(model, task, levers):
    """The plan's model-side levers on a built model: LoRA adapters, full recomputation (selective recomputation
    and eager attention are chosen when the model is built: `attention_name`)."""
    lv = levers_with_defaults(task, levers)[0]
    if task in ("lora", "qlora"):
        add_lora(model, lv["rank"], lv["targets"], {"fp32": torch.float32, "bf16": torch.bfloat16}[lv["adapter_dtype"]],
                 lv["lora_dropout"])
    if lv["recompute"] is True:
        on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        on({"use_reentrant": False})
    model.train()
    return model


# ---- the training step --------------------------------------------------------------------------------
def _train(config, task, lv, seq, device, max_micro_batches, notes, seed, torch_tracker, runtime=False):
    from ..estimate.fake import fake_friendly_moe
    adapters = task in ("lora", "qlora")
    sharded = lv["dp"] > 1 and (lv["shard_base"] if adapters else lv["zero"] in (2, 3) and not lv["offload"])
    if sharded:
        return _fsdp_step(config, task, lv, seq, device, max_micro_batches, notes, seed)
    dtype = weights_dtype(task, lv)
    torch.manual_seed(seed)
    model = build_model(config, device, dtype, attention_name(config, lv["attention"], lv["recompute"]))
    with getattr(model, "fake_mode", contextlib.nullcontext()), fake_friendly_moe():
        step = Step(prepare(model, task, lv), lv, device)
        return step.run(seq, max_micro_batches, notes, torch_tracker, runtime)


class Step:
    """One training step of `model` with the plan's levers: its optimizers (one AdamW per parameter: the shape
    of the fused step, and the bytes of one AdamW(foreach=False), which also steps one parameter at a time),
    fp32 master weights for "mixed", the hooks of a fused step or of ZeRO-Offload's gradient stream."""

    def __init__(self, model, lv, device, opt_state=True, lr=1e-4):
        self.model, self.lv, self.fake, self.lr = model, lv, device == "fake", lr
        self.device = "cpu" if self.fake else device           # where tensors go (fake ones: on a fake CPU)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = lv.get("dtype") == "mixed"
        self.accumulate = lv.get("grad_accum", 1) > 1
        # ZeRO-Offload on one GPU: Adam on the host, each gradient sent there as backward makes it; parameter
        # offload (ZeRO-Infinity) does the same with its gradients (its weights' bytes are the formula's)
        self.offload = lv.get("offload") in ("optimizer", "parameters")
        self.host_grads, self.host_adam = {}, None
        if lv.get("offload") == "parameters" and not self.fake:
            raise NotImplementedError("offload='parameters' keeps the weights on the host, which this step does not "
                                      "do on real tensors: it is measured on fake tensors, its weights by formula")
        if self.offload and not self.fake:
            from ..offload import HostAdam
            if any(p.dtype != torch.float32 for p in self.params):
                raise NotImplementedError(f"ZeRO-Offload on real tensors runs labkit.offload.HostAdam, which keeps "
                                          f"fp32 weights only; dtype={lv.get('dtype')!r} is measured on fake tensors")
            self.host_adam = HostAdam(self.params, lr=lr)
        # fp32 master weights for "mixed" (on the host, with Adam, under ZeRO-Offload)
        self.masters = {p: p.detach().float() for p in self.params} if self.mixed and not self.offload else {}
        self.moved, self.tracker = 0, None
        self.opts = {} if self.offload else {p: self.optimizer([self.masters.get(p, p)]) for p in self.params}
        if opt_state:                              # the state exists before the measured step: a steady step
            for p, opt in self.opts.items():
                target = self.masters.get(p, p)
                target.grad = torch.zeros_like(target)
                opt.step()
                target.grad = None
        self.hooks = []
        if lv.get("fused_step") or self.offload:
            for p in self.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self.to_host if self.offload else self.update))

    def optimizer(self, params):
        """AdamW (foreach=False, as lk.estimate assumes), or bitsandbytes' 8-bit AdamW where it runs (real
        tensors; its paged version needs CUDA's unified memory: on a CPU the plain one holds the same bytes)."""
        if bnb_runs(self.lv, "fake" if self.fake else self.device):
            import bitsandbytes as bnb
            paged = "paged" in self.lv["optimizer"] and self.device == "cuda"
            return (bnb.optim.PagedAdamW8bit if paged else bnb.optim.AdamW8bit)(params, lr=self.lr)
        return torch.optim.AdamW(params, lr=self.lr, foreach=False)

    def to_host(self, p):
        """ZeRO-Offload: the gradient leaves the device as soon as backward has made it; on real tensors the host
        sums the micro-batches' gradients in numpy and labkit.offload.HostAdam updates there (notebook 04)."""
        self.moved += p.grad.numel() * p.grad.element_size()
        if self.tracker is not None:               # a gradient, while it lives (not "other"): what leaves the
            self.tracker.label(p.grad, "gradients")    # device is the formula's, so it is not counted twice
        if not self.fake:
            from ..offload import to_host
            g = to_host(p.grad)[0].view(np.float32)
            self.host_grads[p] = g if p not in self.host_grads else self.host_grads[p] + g
        p.grad = None

    def host_step(self):
        """HostAdam's update on the host, one parameter's gradient brought back at a time (its state never
        comes to the device); the new weights are copied into the device's."""
        from ..offload import from_host
        for p in self.params:
            g = self.host_grads.pop(p).view(np.uint8)
            p.grad = from_host(g, p.dtype, tuple(p.shape), device=p.device)
            self.host_adam.step()
            p.grad = None

    def update(self, p):
        """AdamW for one parameter (on its fp32 master for "mixed", copied back), then its gradient is freed."""
        master = self.masters.get(p)
        if master is not None:
            if master.grad is None:                # no accumulation buffer: this micro-batch's gradient, in fp32
                master.grad = p.grad.float()
            p.grad = None
        self.opts[p].step()
        self.opts[p].zero_grad(set_to_none=True)
        p.grad = None
        if master is not None:
            with torch.no_grad():
                p.copy_(master)

    def loss(self, ids):
        """The micro-batch's loss under the plan's autocast and activation offload; the cross-entropy as the plan
        says: transformers' (chunked_ce=False), labkit.kernels.linear_cross_entropy (True: CE_CHUNK rows of
        logits at a time, notebook 12), or torchtune's CEWithChunkedOutputLoss ("output": the logits in
        OUTPUT_CHUNKS chunks of the sequence, each upcast and differentiated on its own)."""
        from ..estimate.levers import CE_CHUNK, OUTPUT_CHUNKS
        lv, model = self.lv, self.model
        amp = torch.autocast(self.device, dtype=torch.bfloat16) if lv.get("dtype") == "amp-bf16" else contextlib.nullcontext()
        saved = SavedToHost(model) if lv.get("activation_offload") else contextlib.nullcontext()
        ce = lv.get("chunked_ce", False)
        with amp, saved:
            if ce is False:
                return model(input_ids=ids, labels=ids, use_cache=False).loss
            hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
            targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], 1)
            head = model.get_output_embeddings()
            if ce is True:
                from ..kernels import linear_cross_entropy
                return linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, targets.reshape(-1),
                                            chunk=CE_CHUNK)
            total = 0.0
            for h, t in zip(hidden.chunk(OUTPUT_CHUNKS, dim=1), targets.chunk(OUTPUT_CHUNKS, dim=1)):
                logits = head(h)
                total = total + torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                                  t.reshape(-1), reduction="sum")
            return total / (targets != -100).sum()

    def micro_batch(self, ids):
        """Forward and backward of one micro-batch (its loss divided by the number of micro-batches, so their
        gradients sum to the whole batch's mean); returns the micro-batch's loss."""
        loss = self.loss(ids)
        (loss / self.lv.get("grad_accum", 1)).backward()
        if self.masters and self.accumulate:       # the fp32 accumulation buffer is the master's .grad
            for p in self.params:
                m = self.masters[p]
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        return loss.detach()

    def step(self):
        """The optimizer step after the last micro-batch (a fused step and ZeRO-Offload have none on the device)."""
        if self.host_adam is not None:
            self.host_step()
        elif not (self.lv.get("fused_step") or self.offload):
            for p in self.params:
                self.update(p)

    @contextlib.contextmanager
    def track(self):
        """lk.track of this step's model and optimizers, the fp32 master weights counted as optimizer state."""
        from ..memory import track
        with track(self.model, *self.opts.values()) as mem:
            mem.label(list(self.masters.values()), "optimizer")
            self.tracker = mem
            try:
                yield mem
            finally:
                self.tracker = None

    def runtime(self, ids, runs):
        """torch's RuntimeEstimator around one more step of these fake tensors: each op priced by a roofline at this
        machine's CUDA GPU (its peak FLOP/s or its memory bandwidth, whichever binds). Seconds for the whole step
        (the micro-batches that did not run priced as the last), or why it did not run."""
        if not torch.cuda.is_available():
            return "not run: its roofline reads a CUDA GPU's peak FLOP/s and bandwidth, and there is none here"
        if not self.fake:
            return "not run: it prices fake tensors only"
        from torch.distributed._tools.runtime_estimator import RuntimeEstimator
        est = RuntimeEstimator()
        try:
            with contextlib.redirect_stdout(io.StringIO()), est("operator-level-cost-model"):
                for _ in range(runs):
                    self.micro_batch(ids)
                self.step()
        except Exception as err:              # a tool of torch's private namespace: say what stopped it
            return f"not run: {type(err).__name__}: {err}"
        seconds = est.total_runtime / 1e3 * self.lv.get("grad_accum", 1) / runs
        return f"{seconds:.2f} s of compute on {torch.cuda.get_device_name()} (a roofline at its peak, no MFU)"

    def run(self, seq, max_micro_batches, notes, torch_tracker=False, runtime=False):
        """lk.track (and torch's MemTracker beside it) around one step of at most `max_micro_batches`."""
        from torch.distributed._tools.mem_tracker import MemTracker
        lv = self.lv
        runs = min(lv["grad_accum"], max_micro_batches)
        if runs < lv["grad_accum"]:
            notes.append(f"micro-batches 3 to {lv['grad_accum']} repeat the second (the same tensors are alive): "
                         f"{runs} of {lv['grad_accum']} run")
        ids = torch.zeros(lv["micro_batch"], seq, dtype=torch.long, device=self.device)
        # torch's MemTracker beside lk.track; it hooks every parameter's gradient, so a frozen one stops it
        frozen = any(not p.requires_grad for p in self.model.parameters())
        theirs = MemTracker() if torch_tracker and not frozen else contextlib.nullcontext()
        with warnings.catch_warnings(), self.track() as mem, theirs:
            # MemTracker warns for every gradient that a hook has already taken away (None): expected here
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable wrapper-subclass")
            if torch_tracker and not frozen:
                theirs.track_external(self.model, *self.opts.values(), *self.masters.values())
            for _ in range(runs):
                self.micro_batch(ids)
                if torch_tracker and not frozen:
                    theirs.reset_mod_stats()           # MemTracker's per-module books; its peak stays
            self.step()
        for h in self.hooks:
            h.remove()
        name = "torch MemTracker's peak (same step)"
        tools = {} if not torch_tracker else {name: int(next(iter(theirs.get_tracker_snapshot("peak").values()))["Total"])} \
            if not frozen else {name: "not run: it registers a gradient hook on every parameter, frozen ones too"}
        if self.offload:
            notes.append(f"gradients streamed to the host: {fmt_bytes(self.moved)} in {runs} micro-batch(es)")
        if runtime:
            tools["torch RuntimeEstimator"] = self.runtime(ids, runs)
        return {c: int(mem.peak_parts.get(c, 0)) for c in CATS}, tools


class SavedToHost(torch.autograd.graph.saved_tensors_hooks):
    """Activation offload on any tensors, fake ones included (notebook 04's ActivationOffload("host") moves the
    values; here only what the device holds matters): what autograd saves leaves the device in pack and is made
    again in unpack. As there: weights, integer tensors and tensors under 1 KiB stay; a storage leaves once while
    it lives; each unpack makes its own tensor. `bytes_out` counts what left."""

    def __init__(self, model):
        self.keep = {id(p.untyped_storage()) for p in model.parameters()}
        self.packed, self.bytes_out = {}, 0
        super().__init__(self.pack, self.unpack)

    def pack(self, t):
        nbytes = t.numel() * t.element_size()
        if not t.is_floating_point() or nbytes < 1024 or id(t.untyped_storage()) in self.keep:
            return t
        key = (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        if key not in self.packed:
            self.bytes_out += nbytes
            self.packed[key] = (tuple(t.shape), tuple(t.stride()) if _dense(t) else None, t.dtype, t.device)
        return self.packed[key]

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        shape, stride, dtype, device = packed
        if stride is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def __exit__(self, *exc):
        self.packed.clear()
        return super().__exit__(*exc)


def _dense(t):
    from ..offload import _dense as dense
    return dense(t)


# ---- one rank of FSDP2 over a fake process group (labkit.launch.fake_ranks) ---------------------------
FSDP_CATEGORIES = {"Sharded Param": "parameters", "Unsharded Param": "parameters", "Buffer": "parameters",
                   "Sharded Grad": "gradients", "Unsharded Grad": "gradients", "OptState": "optimizer",
                   "Activation": "activations", "Temp": "activations", "All Gather": "other",
                   "Reduce Scatter": "other", "Inputs": "other"}


def _fsdp_step(config, task, lv, seq, device, max_micro_batches, notes, seed):
    """One rank of dp: every decoder layer and the root wrapped by fully_shard (resharded after forward for
    ZeRO-3 and a sharded base; not for ZeRO-2: FSDP's SHARD_GRAD_OP), "mixed" as fp32 shards computed in bf16
    (MixedPrecisionPolicy), counted by FSDPMemTracker (lk.track counts a DTensor's global size, not its shard)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ..estimate.fake import fake_friendly_moe
    adapters = task in ("lora", "qlora")
    dtype = torch.bfloat16 if adapters or lv.get("dtype") == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if lv.get("dtype") == "mixed" else MixedPrecisionPolicy()
    dev = "cpu" if device == "fake" else device
    runs = min(lv["grad_accum"], max_micro_batches)
    reshard = adapters or lv["zero"] == 3
    fake = FakeTensorMode(allow_non_fake_inputs=True) if device == "fake" else contextlib.nullcontext()
    with fake_ranks(lv["dp"]):
        mesh = init_device_mesh(dev, (lv["dp"],))              # outside FakeTensorMode (it reads real ranks)
        torch.manual_seed(seed)
        with fake, fake_friendly_moe():
            model = prepare(build_model(config, "meta", dtype, attention_name(config, lv["attention"], lv["recompute"])),
                            task, lv)
            for layer in model.get_decoder().layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
            model.to_empty(device=dev)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
            for p in params:                           # the state exists before the measured step
                p.grad = torch.zeros_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ids = torch.zeros(lv["micro_batch"], seq, dtype=torch.long, device=dev)
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((ids,))
            step = Step(model, dict(lv, dtype="bf16" if lv.get("dtype") == "mixed" else lv.get("dtype"),
                                    fused_step=False, offload=None, grad_accum=1), device, opt_state=False)
            with tracker:
                for _ in range(runs):
                    step.loss(ids).backward()
                    tracker.reset_mod_stats()          # a second root forward is the next micro-batch
                opt.step()
                opt.zero_grad(set_to_none=True)
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    parts = dict.fromkeys(CATS, 0)
    for kind, nbytes in peak.items():
        name = getattr(kind, "value", kind)
        if name in FSDP_CATEGORIES:
            parts[FSDP_CATEGORIES[name]] += int(nbytes)
    notes.append(f"one rank of {lv['dp']} (FSDP2 over a fake process group, ZeRO-{3 if reshard else 2}), counted by "
                 f"torch's FSDPMemTracker; its categories mapped to the plan's (Temp -> activations, All Gather, "
                 f"Reduce Scatter and Inputs -> other)")
    if runs < lv["grad_accum"]:
        notes.append(f"micro-batches 3 to {lv['grad_accum']} repeat the second: {runs} of {lv['grad_accum']} run")
    return parts, {"FSDPMemTracker's peak of one rank": int(peak["Total"])}


# ---- serving ------------------------------------------------------------------------------------------
def _serve(config, lv, seq, users, device, only, notes, plan_parts):
    """Weights, the KV cache of the replica's sequences and one prefill: one sequence's prefill measured, the other
    sequences' caches as many times its measured cache (paged rounding and an 8-bit cache by formula)."""
    from ..estimate.step import measure_inference
    from . import paged_kv_tokens
    if lv["tp"] > 1:
        notes.append(f"tp={lv['tp']}: one rank of tensor parallelism is not run here")
        return None, {}, only, {}, notes
    model = build_model(config, device, torch.bfloat16, "sdpa")
    fake = getattr(model, "fake_mode", contextlib.nullcontext())
    dev = "cpu" if device == "fake" else device
    with fake:
        model.eval()
        ids = torch.zeros(1, seq, dtype=torch.long, device=dev)
        mem = measure_inference(model, ids, seq, 1, False, False)
    kv_one = mem.at("end")["kv_cache"]
    kv = kv_one * paged_kv_tokens(seq, lv["block_size"]) / seq * (0.5 if lv["kv_dtype"] != "bf16" else 1.0)
    parts = {c: int(mem.peak_parts.get(c, 0)) for c in CATS}
    parts["kv_cache"] = int(kv * users)
    source = {c: "measured" for c in CATS}
    source["kv_cache"] = f"measured for one sequence x {users} (paged rounding{', 8-bit' if lv['kv_dtype'] != 'bf16' else ''} by formula)"
    if lv["weights"] != "bf16" and "parameters" in plan_parts:
        parts["parameters"] = int(plan_parts["parameters"])
        source["parameters"] = f"formula ({lv['weights']} weights)"
    return parts, source, only, {}, notes
