"""Will it fit? `plan(model, task, gpu, gpus=1, seq=2048, batch=1)` answers as published runs answer it.

It tries every combination of the levers practitioners use, prices each combination's memory on one GPU
(labkit.estimate's formulas: no fake tensors, so a 70B search takes seconds) and on the host, and its
time, and ranks them: plans that fit first, by the stated rule. When nothing fits it says the smallest
peak, the category that breaks the budget and what would shrink it; inputs it cannot price are refused
with the reason. Notebook 13 teaches it; `verify=True` measures the top plan (labkit.plan.verify).

One idea per module:
    shapes.py     the sizes a Llama-family config gives (matrices, parameters, a decoder layer)
    levers.py     training levers: fused optimizer step, 8-bit and paged optimizers, activation offload,
                  chunked cross-entropy, eager attention (with labkit.estimate.levers, their source)
    adapters.py   LoRA and QLoRA at any rank and targets; a frozen base in 16/8/4 bits, sharded or not
    serving.py    the paged KV cache; a card's KV capacity as vLLM sizes it
    capacity.py   the card less the CUDA context, the caching allocator's share, host memory
    cost.py       seconds per step from FLOPs and bytes; the ranking rule
    plans.py      Plan and Plans: the table, the answer when nothing fits, JSON
    search.py     the combinations tried for each task
    recipes.py    the published recipes of data/recipes.csv, and the planner's answer to each
"""
from __future__ import annotations

import copy

from ..checks import count
from ..estimate.levers import ATTENTION_KERNELS as ATTENTION_IMPLEMENTATIONS   # what each kernel is priced as
from .adapters import (ALL_TARGETS, ATTENTION_TARGETS, TARGETS, adapter_state_bytes, frozen_base_saving,
                       gathered_unit_bytes, int8_bits, lora_activation_bytes, lora_params, nf4_bits,
                       quantized_input_bytes, quantized_weight_bytes)
from .capacity import (CUDA_CONTEXT, HOST_BUFFER, HOST_MIN, HOST_PER_GPU_MEMORY, allocator_overhead,
                       default_host_memory, gpu_names, gpu_spec, host_bytes, state_rounding, step_fragmentation)
from .cost import (CPU_GBPS, HBM_UTIL, MFU, OUTPUT_TOKENS, attention_flops, data_parallel_bytes, host_seconds,
                   offload_bytes, offload_seconds, quality_tier, rank_key, train_flops)
from .levers import (adam8bit_state_bytes, eager_score_bytes, fused_step_moments, loss_terms, offloaded_activations,
                     paged_optimizer)
from .plans import CATS, SHRINKS, Plan, Plans
from .recipes import LAST_TIME, parse_levers, recipe_answer, recipes, recipes_table
from .search import LEVERS, adapter_plans, check_levers, serve_plans, train_plans
from .serving import BLOCK_SIZE, kv_bytes, kv_capacity_tokens, paged_kv_tokens
from .shapes import LINEARS

__all__ = ["plan", "Plan", "Plans", "TASKS", "LEVERS", "CATS", "LINEARS", "ALL_TARGETS", "ATTENTION_TARGETS",
           "TARGETS", "gpu_spec", "gpu_names", "default_host_memory", "host_bytes", "CUDA_CONTEXT", "HOST_BUFFER",
           "HOST_MIN", "HOST_PER_GPU_MEMORY", "state_rounding", "step_fragmentation", "allocator_overhead",
           "nf4_bits", "int8_bits", "lora_params", "quantized_weight_bytes", "frozen_base_saving",
           "lora_activation_bytes", "quantized_input_bytes", "adapter_state_bytes", "gathered_unit_bytes",
           "adam8bit_state_bytes",
           "paged_optimizer", "fused_step_moments", "eager_score_bytes", "loss_terms", "offloaded_activations",
           "paged_kv_tokens", "kv_bytes", "kv_capacity_tokens", "BLOCK_SIZE", "train_flops", "attention_flops",
           "offload_bytes", "offload_seconds", "host_seconds", "data_parallel_bytes", "quality_tier", "rank_key",
           "MFU", "HBM_UTIL", "CPU_GBPS", "OUTPUT_TOKENS", "SHRINKS", "recipes", "recipe_answer", "recipes_table",
           "parse_levers", "LAST_TIME", "check_levers", "ATTENTION_IMPLEMENTATIONS"]

TASKS = ("pretrain", "finetune", "lora", "qlora", "serve")
FAMILIES = ("llama", "mistral", "qwen2")
# config options the formulas cannot price, with the reason (a Llama layer without dropout)
UNPRICED = {"attention_dropout": "dropout on the attention probabilities", "resid_pdrop": "residual dropout",
            "embd_pdrop": "embedding dropout", "hidden_dropout": "hidden-state dropout"}


def _config(model):
    """The config, or a one-line ValueError naming what is wrong with it."""
    from ..estimate import load_config
    try:
        cfg = load_config(model)
    except (TypeError, FileNotFoundError) as err:
        raise ValueError(f"model {model!r}: {err}") from None
    if cfg.model_type not in FAMILIES:
        raise ValueError(f"model {model!r} is a {cfg.model_type!r}: plan searches Llama-family decoders "
                         f"({', '.join(FAMILIES)}), whose formulas estimate has")
    for key, what in UNPRICED.items():
        value = getattr(cfg, key, 0) or 0
        if value > 0:
            raise ValueError(f"model {model!r} sets {key}={value}: {what} the planner cannot price (its Llama "
                             f"formulas have none); set {key} to 0 for the plan, or measure the step with "
                             f"lk.estimate(..., method='fake')")
    a, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if a % kv:
        raise ValueError(f"model {model!r}: num_attention_heads {a} is not a multiple of num_key_value_heads "
                         f"{kv} (each KV head serves a whole group of query heads)")
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        if impl not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"model {model!r} asks for attn_implementation {impl!r}, which the planner cannot price; "
                             f"it prices {', '.join(ATTENTION_IMPLEMENTATIONS)}")
        cfg = copy.deepcopy(cfg)              # the formulas read an SDPA layer; `plan` prices eager's scores apart
        cfg._attn_implementation = "sdpa"
        cfg.labkit_attention = ATTENTION_IMPLEMENTATIONS[impl]
    return cfg


def _check_split(task, batch, gpus, s):
    """Refuse a batch that no layout of the GPUs can split, naming why."""
    from .search import layouts
    if task in ("lora", "qlora"):
        if batch % gpus:
            raise ValueError(f"batch {batch} is not divisible by gpus={gpus}: LoRA and QLoRA plans are data-parallel "
                             f"over every GPU (each holds batch / gpus sequences); use a batch that is a multiple "
                             f"of {gpus}")
        return
    if task == "serve":
        return
    degrees = sorted({dp for dp, tp, pp in layouts(gpus, s)})
    if not degrees:
        raise ValueError(f"gpus={gpus}: no dp x tp x pp layout exists for this model (tp must divide "
                         f"{s['a']} heads and {s['kv']} KV heads, pp at most {s['L']} layers)")
    if not any(batch % dp == 0 for dp in degrees):
        raise ValueError(f"batch {batch} cannot be split over {gpus} GPUs: every layout the model allows needs a "
                         f"data-parallel degree in {degrees} (tensor parallelism must divide the {s['a']} heads), "
                         f"and batch must be a multiple of it; use batch {degrees[0]} or a multiple, or gpus that "
                         f"divide the heads")


def plan(model, task, gpu, gpus=1, seq=2048, batch=1, *, host_memory=None, attention="sdpa", levers=None,
         verify=False):
    """Every combination of levers for `task` on `gpus` x `gpu`, ranked (labkit.plan.cost states the rule).

    model: anything labkit.estimate takes (preset, family, config.json) of the Llama family; task:
    "pretrain", "finetune" (full), "lora", "qlora" or "serve" (batch = concurrent sequences, seq = their
    context); "pretrain" and "finetune" price the same full training step (what differs between them, the
    data and the number of steps, takes no memory); gpu: a name of data/gpus.csv or a memory size as the
    driver reports it; batch: sequences per step, all GPUs together (micro-batches and accumulation are searched); host_memory: bytes or "512 GiB"
    of the node's CPU memory (default: labkit.plan.capacity.default_host_memory, stated in the table);
    attention: "sdpa" (flash) or "eager" (the score matrix kept; a config that names eager implies it);
    levers: {name: value} fixing any of LEVERS[kind] (e.g. {"rank": 16, "targets": ("q", "v")}) instead of
    searching it; verify: measure the top plan with labkit.plan.verify.verify(plans) and show it.
    Returns Plans (a list of Plan) that is never empty; inputs no plan can express raise ValueError.
    """
    from ..estimate import model_shape
    from ..estimate.params import n_params
    from ..units import parse_bytes
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    g = gpu_spec(gpu)
    gpus, seq, batch = count("gpus", gpus), count("seq", seq), count("batch", batch)
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    cfg = _config(model)
    kind = "serve" if task == "serve" else "adapter" if task in ("lora", "qlora") else "train"
    fix = check_levers(kind, levers, gpus, task)
    attention = fix.get("attention", getattr(cfg, "labkit_attention", attention))
    if seq > cfg.max_position_embeddings:
        raise ValueError(f"seq must be <= max_position_embeddings {cfg.max_position_embeddings} of this config, "
                         f"got {seq}")
    default_host = host_memory is None
    host = default_host_memory(g, gpus) if default_host else parse_bytes(host_memory, "host_memory")
    s = model_shape(cfg)
    _check_split(task, batch, gpus, s)
    from .shapes import param_shapes
    ctx = dict(config=cfg, shape=s, gpu=g, gpus=gpus, seq=seq, batch=batch,
               params=n_params(s), host_memory=host, attention=attention, fix=fix, numels=param_shapes(s),
               # the allocator's excess for this model's step at micro-batch 1 (it barely moves with the
               # micro-batch or the depth: tests/test_plan.py), replayed once per question
               fragmentation=step_fragmentation(cfg, 1, seq, training=task != "serve")["fit"])
    if task in ("pretrain", "finetune"):
        plans = train_plans(ctx)                 # the same search: the task only names the question
    elif task in ("lora", "qlora"):
        plans = adapter_plans(ctx, task == "qlora")
    else:
        plans = serve_plans(ctx)
    if not plans:
        raise ValueError(f"no plan can express these levers for {task} on {gpus} x {g['name']}: {fix} "
                         f"(batch {batch} = dp x micro_batch x grad_accum, dp x tp x pp = gpus; a fused step "
                         f"needs no accumulation and no offload; offload='parameters' needs zero=3)")
    plans.sort(key=lambda p: rank_key(p, task))
    name = model if isinstance(model, str) else getattr(cfg, "name_or_path", "") or cfg.model_type
    question = dict(model=str(name), task=task, gpu=g["name"], gpus=gpus, seq=seq, batch=batch, memory=g["memory"],
                    usable=g["usable"], memory_source=g["memory_source"], host_memory=host,
                    host_default=default_host, attention=attention, source=g["source"], params=ctx["params"],
                    levers=fix, config=cfg)
    out = Plans(plans, question)
    if verify:
        try:
            from .verify import verify as run_verify
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.verify":
                raise
            raise ImportError("plan(..., verify=True) needs labkit.plan.verify, which is not there yet") from None
        out.verification = run_verify(out)
    return out
