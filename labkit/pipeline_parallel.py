"""Pipeline parallelism: a model cut into stages, and its schedules counted in units of work.

`Stage` is a run of a transformers Llama's decoder layers (the embedding on the first stage, the norm and
the LM head on the last) that `torch.distributed.pipelining.PipelineStage` runs on one rank; `loss_fn` is
the loss its last stage computes. `balanced_split` cuts the layers into stages of equal cost; `gpipe` and
`one_f_one_b` are the two schedules' per-stage orders of forward and backward chunks; `replay` times any
such order in units of work, so a bubble is counted instead of clocked. The ranks import this module from
`labkit/scripts/pipeline_parallel.py`, started by `torchrun` (`labkit.launch`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .checks import count, flag, number

__all__ = ["Stage", "loss_fn", "balanced_split", "gpipe", "one_f_one_b", "replay"]


class Stage(torch.nn.Module):
    """Decoder layers [lo, hi) of a transformers Llama, with the embedding or the head where they belong."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        n = len(model.model.layers)
        lo, hi = count("lo", lo, 0), count("hi", hi, 0)
        if not lo < hi <= n:
            raise ValueError(f"lo and hi must give 0 <= lo < hi <= {n} (the model's layers), got lo={lo}, hi={hi}")
        first, last = flag("first", first), flag("last", last)
        self.embed = model.model.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(model.model.layers[lo:hi])
        self.rotary = model.model.rotary_emb
        self.norm, self.head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x):                      # ids (B, T) on the first stage, hidden (B, T, h) after
        h = self.embed(x) if self.embed is not None else x
        pe = self.rotary(h, torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1))
        for layer in self.layers:              # attention_mask=None: SDPA's causal path
            h = layer(h, position_embeddings=pe, attention_mask=None)
        return self.head(self.norm(h)) if self.head is not None else h


def loss_fn(logits, ids):
    """The causal LM loss transformers computes: each position predicts the next token, in fp32."""
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (batch, tokens) with at least 2 tokens (one to predict), got shape {tuple(ids.shape)}")
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _largest_stage(candidate):                      # (largest stage cost, cuts) -> what balanced_split minimises
    return candidate[0]


def balanced_split(costs, parts):
    """Cut `costs` (one number per layer, in order) into `parts` contiguous, non-empty stages whose
    largest total is as small as possible. Returns [(lo, hi), ...], layer indices [lo, hi) per stage."""
    if not isinstance(costs, (list, tuple)):
        raise ValueError(f"costs must be a list of numbers, one per layer, got {type(costs).__name__} {costs!r:.80}")
    costs = [number(f"costs[{i}]", c) for i, c in enumerate(costs)]
    n = len(costs)
    parts = count("parts", parts)
    if parts > n:
        raise ValueError(f"parts must be at most the {n} layers (one layer per stage at least), got {parts!r}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: (largest stage cost, cuts) for the first i layers in k stages
    best = {(1, i): (prefix[i], [0, i]) for i in range(1, n + 1)}
    for k in range(2, parts + 1):
        for i in range(k, n + 1):
            best[k, i] = min(((max(best[k - 1, j][0], prefix[i] - prefix[j]), best[k - 1, j][1] + [i])
                              for j in range(k - 1, i)), key=_largest_stage)
    cuts = best[parts, n][1]
    return list(zip(cuts[:-1], cuts[1:]))


def gpipe(p, m):
    """GPipe's order (Huang et al. 2019): on every one of `p` stages, the forwards of all `m` micro-batches,
    then their backwards. Per stage a list of ("F" | "B", micro-batch) chunks, as `replay` reads them."""
    p, m = count("p", p), count("m", m)
    return [[("F", c) for c in range(m)] + [("B", c) for c in range(m)] for _ in range(p)]


def one_f_one_b(p, m):
    """1F1B, PipeDream-Flush's order (Narayanan et al. 2021, sec. 2.2), what `Schedule1F1B` runs: stage s starts
    with p - 1 - s forwards (warm-up), then alternates one forward, one backward, and ends with the backwards
    left (cool-down). A stage holds at most p - s micro-batches' activations instead of GPipe's m."""
    p, m = count("p", p), count("m", m)
    orders = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        order = [("F", c) for c in range(warm)]
        for c in range(m - warm):                           # steady state: one forward, one backward
            order += [("F", warm + c), ("B", c)]
        order += [("B", c) for c in range(m - warm, m)]     # cool-down
        orders.append(order)
    return orders


def replay(orders, costs):
    """Time a pipeline schedule in units of work instead of seconds.

    orders: per stage, its ("F" | "B", micro-batch) chunks in the order the schedule ran them.
    costs:  per stage, {"F": units, "B": units}: how long one chunk takes there.
    A chunk starts when its stage is free and its input is ready: F(s, c) needs F(s-1, c); B(s, c)
    needs B(s+1, c), or F(s, c) on the last stage. Returns per stage [(kind, chunk, start, end)].
    """
    _check_schedule(orders, costs)
    p = len(orders)
    done, free, pos = {}, [0] * p, [0] * p
    timeline = [[] for _ in range(p)]
    moved = True
    while moved:
        moved = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, chunk = orders[s][pos[s]]
                if kind == "F":
                    dep = ("F", s - 1, chunk) if s > 0 else None
                elif kind == "B":
                    dep = ("B", s + 1, chunk) if s < p - 1 else ("F", s, chunk)
                else:
                    raise AssertionError(kind)                  # _check_schedule refused it
                if dep is not None and dep not in done:
                    break                                   # wait for the other stage
                start = max(free[s], done.get(dep, 0))
                free[s] = done[kind, s, chunk] = start + costs[s][kind]
                timeline[s].append((kind, chunk, start, free[s]))
                pos[s] += 1
                moved = True
    stuck = {s: orders[s][pos[s]] for s in range(p) if pos[s] < len(orders[s])}
    if stuck:
        raise ValueError(f"the orders deadlock: stage -> chunk it waits on {stuck}")
    return timeline


def _check_schedule(orders, costs):
    """replay's arguments, before any work: on every stage exactly one forward and one backward of each of the
    same micro-batches 0..m-1 (or forwards only, on every stage: a schedule's forward half, as notebook 09
    replays the seed's loop), and one cost per stage for each kind of chunk that runs, finite and >= 0."""
    if not isinstance(orders, (list, tuple)) or not orders:
        raise ValueError(f"orders must be a non-empty list, one order per stage, got {orders!r:.80}")
    for s, order in enumerate(orders):
        for chunk in order:
            if not (isinstance(chunk, tuple) and len(chunk) == 2):
                raise ValueError(f"chunks must be ('F' | 'B', micro-batch) pairs, got {chunk!r} on stage {s}")
            if chunk[0] not in ("F", "B"):
                raise ValueError(f"chunk kind must be 'F' or 'B', got {chunk[0]!r} on stage {s}")
            count(f"a micro-batch on stage {s}", chunk[1], 0)
    kinds = ("F", "B") if any(kind == "B" for order in orders for kind, _ in order) else ("F",)
    m = len(orders[0]) // len(kinds)
    for s, order in enumerate(orders):
        if sorted(order) != sorted((k, c) for k in kinds for c in range(m)):
            raise ValueError(f"orders[{s}] must hold {' and '.join(f'({k!r}, c)' for k in kinds)} once each for c in "
                             f"0..{m - 1} (as stage 0 does; backwards on every stage or on none), got {order!r:.120}")
    if not isinstance(costs, (list, tuple)) or len(costs) != len(orders):
        raise ValueError(f"costs must be a list of {len(orders)} {{'F': units, 'B': units}} (one per stage), got {costs!r:.80}")
    for s, cost in enumerate(costs):
        for kind in kinds:
            if not isinstance(cost, dict) or kind not in cost:
                raise ValueError(f"costs[{s}] must be {{'F': units, 'B': units}}, got {cost!r:.80}")
            number(f"costs[{s}][{kind!r}]", cost[kind])
