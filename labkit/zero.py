"""ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054) from scratch on torch.distributed, collectives counted.

Every parameter is flattened, padded with zeros to a multiple of the world size N and cut into N equal
shards (`shard`); rank r owns shard r of each. Mixed-precision Adam keeps, per parameter, 16-bit
weights (2 bytes), 16-bit gradients (2) and fp32 master weights, momentum and variance (K = 12):

    stage 0 (DDP)  all-reduce the gradients, every rank updates every weight             2 + 2 + 12   B/param
    stage 1        reduce-scatter the gradients after backward, update this rank's
                   shard of the master weights, all-gather the 16-bit weights            2 + 2 + 12/N
    stage 2        the same, but each gradient is reduce-scattered as soon as backward
                   made it, and the full gradient freed                                  2 + 14/N
    stage 3        weights sharded too: a unit's (a layer's) weights are all-gathered
                   before its forward and freed after it; what backward needs is
                   gathered again (saved-tensor hooks); the gather's backward
                   reduce-scatters the gradient                                          16/N

Communication per step in the paper's units (sec. 7): an all-reduce moves 2x its buffer (it is a
reduce-scatter followed by an all-gather), a reduce-scatter or all-gather 1x; a ring sends (N - 1)/N of
that per rank. `COMM` adds up, per rank and per kind, the bytes of the buffer of every collective this
module calls; `comm_volume()` sums them the paper's way.
The optimizer is `torch.optim.AdamW` itself, run on this rank's fp32 master shards: the same arithmetic
per element as a single process, so the sharded run can be compared with it.

Each stage is its own small class, written as what it changes in the one before (picotron gives each
variant its own class): `DDP` (stage 0), `Zero1(DDP)`, `Zero2(Zero1)`, `Zero3(Zero1)`; `STAGES` maps a stage
to its class and `engine(model, stage)` builds one.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from .checks import count, index

__all__ = ["COMM", "reset_comm", "comm_volume", "shard_size", "shard", "unshard", "all_reduce", "reduce_scatter",
           "all_gather", "Gather", "DDP", "Zero1", "Zero2", "Zero3", "STAGES", "engine"]

COMM = {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 0, "all_gather_backward": 0, "calls": 0}


def reset_comm():
    """Zero the counters (call it at the start of the step to count)."""
    for k in COMM:
        COMM[k] = 0


def comm_volume():
    """Bytes moved this rank counted the paper's way: 2x an all-reduce's buffer, 1x a reduce-scatter's
    input, 1x an all-gather's output (forward and backward gathers)."""
    return 2 * COMM["all_reduce"] + COMM["reduce_scatter"] + COMM["all_gather"] + COMM["all_gather_backward"]


def _count(kind, nbytes):
    COMM[kind] += nbytes
    COMM["calls"] += 1


def shard_size(numel, world):
    """Elements per rank of a tensor of `numel` elements: ceil(numel / world) (the last shard padded)."""
    return -(-count("numel", numel, 0) // count("world", world))


def shard(t, rank, world):
    """Rank `rank`'s 1-D shard of `t`: elements [rank*S, (rank+1)*S) of the flattened tensor padded with
    zeros to world*S elements, S = shard_size(t.numel(), world). A copy, so the full tensor can be freed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    world = count("world", world)
    rank = index("rank", rank, world)
    s = shard_size(t.numel(), world)
    flat = t.detach().reshape(-1)
    out = torch.zeros(s, dtype=t.dtype, device=t.device)
    lo, hi = min(rank * s, flat.numel()), min((rank + 1) * s, flat.numel())
    out[: hi - lo] = flat[lo:hi]
    return out


def unshard(shards, shape):
    """The inverse of `shard`: concatenate the ranks' shards, drop the padding, reshape to `shape`."""
    shape = [count(f"shape[{i}]", n, 0) for i, n in enumerate(shape)]
    numel = torch.Size(shape).numel()
    return torch.cat([s.reshape(-1) for s in shards])[:numel].reshape(shape)


# ---- collectives, counted ----------------------------------------------------------------------------
# torch 2.13 names the one-tensor collectives all_gather_single / reduce_scatter_single (and warns on the old
# names); torch 2.11, the GPU image's, has only all_gather_into_tensor / reduce_scatter_tensor.
def _reduce_scatter_single(out, flat):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, flat)


def _all_gather_single(out, local):
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local)


def all_reduce(t):
    """Sum of `t` over ranks, in place (counted in COMM)."""
    _count("all_reduce", t.nbytes)
    dist.all_reduce(t)
    return t


def reduce_scatter(full, world):
    """Sum over ranks of `full` (any shape), this rank's shard of it: padded to world * S elements first."""
    s = shard_size(full.numel(), world)
    flat = full.reshape(-1)
    if flat.numel() != s * world:
        flat = torch.cat([flat, flat.new_zeros(s * world - flat.numel())])
    out = flat.new_empty(s)
    _count("reduce_scatter", flat.nbytes)
    _reduce_scatter_single(out, flat)
    return out


def all_gather(local, world, kind="all_gather"):
    """The ranks' shards side by side: a (world * S,) tensor, padding included."""
    out = local.new_empty(local.numel() * world)
    _count(kind, out.nbytes)
    _all_gather_single(out, local)
    return out


class Gather(torch.autograd.Function):
    """ZeRO-3's parameter: forward all-gathers the full weight from the shards, backward reduce-scatters
    its gradient back to this rank's shard (averaged over ranks)."""

    @staticmethod
    def forward(ctx, local, engine, i):
        ctx.engine, ctx.i = engine, i
        full = all_gather(local, engine.world)
        engine._note_gathered(full, i)
        return full[: engine.numel[i]].view(engine.shape[i])

    @staticmethod
    def backward(ctx, grad):
        engine = ctx.engine
        engine._regathered.pop(ctx.i, None)           # its backward is done: free the copy gathered for it
        g = reduce_scatter(grad, engine.world).div_(engine.world)
        engine._label(g, "gradients")
        return g, None, None


class _SavedWeight:
    """What a ZeRO-3 unit saves for backward instead of a gathered weight: which one, and the view's layout."""

    def __init__(self, i, t):
        self.i, self.size, self.stride, self.offset = i, t.size(), t.stride(), t.storage_offset()


def _trainable(model):
    """model's named parameters, once model is known to be a module with parameters, all trained, on ranks."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__} {model!r:.60}")
    if not dist.is_initialized():
        raise RuntimeError("labkit.zero needs a process group: labkit.launch.init() on ranks torchrun started, "
                           "or `with labkit.launch.fake_ranks(n):` to measure one rank in this process")
    named = list(model.named_parameters())
    frozen = [n for n, p in named if not p.requires_grad]
    if not named or frozen:
        raise ValueError(f"model must have parameters, all of them trained (these engines update every one), got "
                         + (f"{len(frozen)} frozen: {', '.join(frozen[:3])}" if frozen else "none"))
    return named


# ---- stage 0: DDP ------------------------------------------------------------------------------------
class DDP:
    """Stage 0, plain data parallelism for `model` on the default process group: every rank holds the whole
    model state, all-reduces the gradients after backward and updates every weight (AdamW on fp32 masters).

    Usage per step: `loss.backward(); engine.step()`. `model` holds the weights in their compute dtype
    (bf16 for mixed precision, fp32 for an exact comparison with a single process); each rank feeds it
    its own part of the batch, and the gradients are averaged over ranks.
    adamw: arguments for `torch.optim.AdamW` (lr, weight_decay, ...; its defaults otherwise).
    """

    stage = 0

    def __init__(self, model, **adamw):
        named = _trainable(model)
        self.model, self.tracker = model, None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.weights = self.params                             # what this rank keeps of the weights
        self.numel = [p.numel() for p in self.params]
        self.shape = [p.shape for p in self.params]
        self.master = [self.master_of(p).requires_grad_() for p in self.params]   # fp32 (S,)
        self.opt = torch.optim.AdamW(self.master, **{"foreach": False, **adamw})

    def master_of(self, p):
        """The fp32 master weight of `p` this rank updates: DDP's is all of it (one "shard" of one)."""
        return shard(p.float(), 0, 1)

    def local_grad(self, i):
        """This rank's averaged gradient of parameter i, as the optimizer needs it (fp32, master's shape)."""
        g = self._present(self.params[i].grad, i)
        return all_reduce(g).div_(self.world).reshape(-1).float()   # DDP: the whole averaged gradient

    @torch.no_grad()
    def step(self):
        """Average the gradients over ranks, update this rank's master weights, give the model the new weights."""
        for i, m in enumerate(self.master):
            m.grad = self.local_grad(i)
        self.opt.step()
        for i, m in enumerate(self.master):
            m.grad = None
            self.update(i, m)

    def update(self, i, m):
        """Parameter i takes its updated master weight m; its gradient is done."""
        self.params[i].copy_(m.view(self.shape[i]))
        self.params[i].grad = None

    # ---- what each rank holds, by category ----------------------------------------------------------
    def gradients(self):
        """The gradients this rank holds now."""
        return [p.grad for p in self.weights if p.grad is not None]

    def states(self):
        """{category: tensors} this rank holds between steps: weights, gradients, optimizer (master + moments)."""
        return {"parameters": list(self.weights), "gradients": self.gradients(),
                "optimizer": list(self.master) + [t for st in self.opt.state.values() for t in st.values()]}

    def watch(self, tracker):
        """Label this engine's tensors in an `lk.track()` report, also those it makes later (or None)."""
        if tracker is not None and not callable(getattr(tracker, "label", None)):
            raise TypeError(f"tracker must be what lk.track() gives (or None), got {type(tracker).__name__} {tracker!r:.60}")
        self.tracker = tracker
        if tracker is not None:
            for category, tensors in self.states().items():
                tracker.label(tensors, category)

    def _label(self, t, category):
        if self.tracker is not None:
            self.tracker.label(t, category)

    def _present(self, g, i):
        if g is None:
            raise RuntimeError(f"parameter {self.names[i]} has no gradient: call backward() before step()")
        return g


# ---- stage 1: the optimizer state sharded ------------------------------------------------------------
class Zero1(DDP):
    """ZeRO-1: as DDP, but this rank keeps the fp32 master weights and Adam's moments of its shard only; the
    gradients are reduce-scattered (this rank gets its shard of the average) and the updated 16-bit shards
    all-gathered back into every rank's whole model."""

    stage = 1

    def master_of(self, p):
        return shard(p.float(), self.rank, self.world)

    def local_grad(self, i):
        g = self._present(self.params[i].grad, i)
        return reduce_scatter(g, self.world).div_(self.world).float()   # only this rank's shard of the average

    def update(self, i, m):
        full = all_gather(m.to(self.params[i].dtype), self.world)        # every rank's updated shard
        self.params[i].copy_(full[: self.numel[i]].view(self.shape[i]))
        self.params[i].grad = None


# ---- stage 2: the gradients sharded too --------------------------------------------------------------
class Zero2(Zero1):
    """ZeRO-2: as ZeRO-1, but each gradient is reduce-scattered as soon as backward has made it (a hook on
    the parameter) and the full one freed, so no rank ever holds all the gradients."""

    stage = 2

    def __init__(self, model, **adamw):
        super().__init__(model, **adamw)
        self.grad_shards = [None] * len(self.params)
        self._hooks = [p.register_post_accumulate_grad_hook(functools.partial(self._reduce_hook, i))
                       for i, p in enumerate(self.params)]

    def reduce_now(self, i):
        """Called as backward finishes parameter i's gradient: keep only this rank's shard of it."""
        p = self.params[i]
        self.grad_shards[i] = reduce_scatter(p.grad, self.world).div_(self.world)
        self._label(self.grad_shards[i], "gradients")
        p.grad = None                                          # the full gradient is freed now

    def _reduce_hook(self, i, param):                          # register_post_accumulate_grad_hook calls hook(param)
        self.reduce_now(i)

    def local_grad(self, i):
        return self._present(self.grad_shards[i], i).float()   # reduce-scattered during backward

    def update(self, i, m):
        super().update(i, m)
        self.grad_shards[i] = None

    def gradients(self):
        return super().gradients() + [g for g in self.grad_shards if g is not None]


# ---- stage 3: the weights sharded too ----------------------------------------------------------------
class Zero3(Zero1):
    """ZeRO-3: the weights sharded too. After `__init__` the model holds no parameters and `self.local` holds
    this rank's shards; hooks gather a unit's weights just before its forward (`Gather`) and drop them after
    it, and `Gather`'s backward reduce-scatters each gradient during backward, as ZeRO-2's hook does.

    units: the modules whose weights are gathered together (default: every module that owns parameters);
    their parameters must cover the model's, each parameter in exactly one unit."""

    stage = 3

    def __init__(self, model, units=None, **adamw):
        super().__init__(model, **adamw)
        # the storages of the weights gathered for the running unit: a view of one, saved for backward, is
        # replaced by a note (keyed by the storage itself, which real, fake and meta tensors all have)
        self._hooks, self._gathered, self._regathered = [], WeakIdKeyDictionary(), {}
        self._shard_weights(units)

    def local_grad(self, i):
        return self._present(self.local[i].grad, i).float()    # reduce-scattered by Gather's backward

    def update(self, i, m):
        self.local[i].copy_(m)
        self.local[i].grad = None

    def _shard_weights(self, units):
        """Replace every parameter by this rank's shard; hooks gather a unit's weights around its forward."""
        model = self.model
        units = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))] if units is None else list(units)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.local = [shard(p, self.rank, self.world).requires_grad_() for p in self.params]
        self.owners = {}                                       # unit -> [(module, attribute name, i)]
        for unit in units:
            for mod in unit.modules():
                for name, p in list(mod._parameters.items()):
                    if p is None:
                        continue
                    if id(p) not in index:
                        raise ValueError(f"parameter {name} of {type(mod).__name__} is in two units")
                    self.owners.setdefault(unit, []).append((mod, name, index.pop(id(p))))
        if index:
            missing = [self.names[i] for i in index.values()]
            raise ValueError(f"units must cover every parameter; not in any unit: {missing[:5]}")
        for unit, owned in self.owners.items():
            for mod, name, _ in owned:
                del mod._parameters[name]
                setattr(mod, name, None)
            self._hooks.append(unit.register_forward_pre_hook(self.before_forward))
            self._hooks.append(unit.register_forward_hook(self._after_forward, always_call=True))
        self.params, self.weights = [], self.local            # nothing full is kept between steps

    def before_forward(self, unit, args):
        for mod, name, i in self.owners[unit]:
            setattr(mod, name, Gather.apply(self.local[i], self, i))
        unit._zero_saved = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        unit._zero_saved.__enter__()

    def _after_forward(self, unit, args, out):
        unit._zero_saved.__exit__(None, None, None)
        for mod, name, i in self.owners[unit]:
            setattr(mod, name, None)                          # the gathered weight dies here
        self._gathered.clear()

    def _note_gathered(self, full, i):
        self._gathered[full.untyped_storage()] = i
        self._label(full, "parameters")
        if self.tracker is not None:
            self.tracker.mark("all-gather")

    def pack(self, t):
        """A tensor saved for backward: a gathered weight (or a view of it) is replaced by a note."""
        i = self._gathered.get(t.untyped_storage())
        return t if i is None else _SavedWeight(i, t)

    def unpack(self, saved):
        """In backward: gather the weight again (once per unit's backward) and rebuild the saved view."""
        if not isinstance(saved, _SavedWeight):
            return saved
        full = self._regathered.get(saved.i)
        if full is None:
            full = self._regathered[saved.i] = all_gather(self.local[saved.i].detach(), self.world, "all_gather_backward")
            self._label(full, "parameters")
            if self.tracker is not None:
                self.tracker.mark("all-gather (backward)")
        return full.as_strided(saved.size, saved.stride, saved.offset)


STAGES = {0: DDP, 1: Zero1, 2: Zero2, 3: Zero3}


def engine(model, stage, units=None, **adamw):
    """The engine of ZeRO stage `stage` (0 is DDP) for `model`: STAGES[stage](model, **adamw), and `units` for
    stage 3 (the modules gathered together; the other stages keep whole weights and ignore it)."""
    if count("stage", stage, 0) not in STAGES:
        raise ValueError(f"stage must be one of {tuple(STAGES)}, got {stage!r}")
    if stage == 3:
        return Zero3(model, units=units, **adamw)
    return STAGES[stage](model, **adamw)
