"""labkit.pipeline_parallel: GPipe's and 1F1B's orders replayed (the bubble formula, the dependencies), layers split
into balanced stages; and one torchrun of two ranks running the tensor-parallel layers, then the pipeline."""
from fractions import Fraction

import numpy as np
import pytest
import torch

import labkit as lk
from labkit.launch import launch
from labkit.pipeline_parallel import Stage, balanced_split, gpipe, loss_fn, one_f_one_b, replay


def bubbles(timeline):
    step = max(end for stage in timeline for *_, end in stage)
    return [1 - Fraction(sum(end - start for *_, start, end in stage), step) for stage in timeline]


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p, m", [(2, 2), (2, 8), (3, 5), (4, 4), (4, 16)])
def test_replay_gives_the_bubble_formula_on_equal_stages(schedule, p, m):
    timeline = replay(schedule(p, m), [{"F": 1, "B": 2}] * p)
    assert bubbles(timeline) == [Fraction(p - 1, m + p - 1)] * p
    for s, stage in enumerate(timeline):                # every chunk once, none overlapping on a stage
        assert sorted((k, c) for k, c, *_ in stage) == sorted(schedule(p, m)[s])
        assert all(a[3] <= b[2] for a, b in zip(stage, stage[1:]))


def test_replay_respects_dependencies_and_rejects_bad_orders():
    timeline = replay(gpipe(2, 1), [{"F": 1, "B": 2}, {"F": 3, "B": 4}])
    assert timeline == [[("F", 0, 0, 1), ("B", 0, 8, 10)], [("F", 0, 1, 4), ("B", 0, 4, 8)]]
    with pytest.raises(ValueError, match="deadlock"):
        replay([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]], [{"F": 1, "B": 1}] * 2)
    with pytest.raises(ValueError, match="chunk kind must be 'F' or 'B', got 'W' on stage 0"):
        replay([[("W", 0)]], [{"F": 1, "B": 1}])
    good = [{"F": 1, "B": 1}] * 2
    for orders, costs, words in (
            (gpipe(2, 2), good[:1], "costs must be a list of 2"),                      # a stage without costs
            (gpipe(2, 2), [{"F": 1}] * 2, r"costs\[0\] must be"),                    # no backward's cost
            (gpipe(2, 2), [{"F": -1, "B": 1}] * 2, r"costs\[0\]\['F'\] must be a finite number >= 0, got -1"),
            (gpipe(2, 2), [{"F": float("nan"), "B": 1}] * 2, r"costs\[0\]\['F'\].*nan"),
            ([[("F", 0), ("F", 0), ("B", 0)], gpipe(1, 1)[0]], good, r"orders\[0\] must hold"),   # a chunk twice
            ([[("F", 0)], [("F", 0), ("B", 0)]], good, r"orders\[0\] must hold"),    # a backward on one stage only
            ([[("F", "0"), ("B", "0")]], good[:1], "micro-batch on stage 0 must be an int")):
        with pytest.raises(ValueError, match=words):
            replay(orders, costs)


def test_replay_times_a_forward_only_schedule():
    """Forwards only on every stage (notebook 09 replays the seed's loop so): a pipeline of p stages over m
    micro-batches ends at (m + p - 1) forwards; no backward's cost is needed."""
    timeline = replay([[("F", c) for c in range(3)] for _ in range(2)], [{"F": 1}] * 2)
    assert [[(k, c, start) for k, c, start, _ in stage] for stage in timeline] == [
        [("F", 0, 0), ("F", 1, 1), ("F", 2, 2)], [("F", 0, 1), ("F", 1, 2), ("F", 2, 3)]]


def test_schedules_and_stages_refuse_bad_counts():
    for schedule in (gpipe, one_f_one_b):
        for p, m in ((0, 3), (2, -1), (True, 2), (2.5, 2)):
            with pytest.raises(ValueError, match="p must|m must"):
                schedule(p, m)
    assert one_f_one_b(np.int64(2), np.int64(2)) == one_f_one_b(2, 2)
    assert all(type(c) is int for order in one_f_one_b(np.int64(2), 2) for _, c in order)
    for costs in ([1, float("nan"), 3], [1, -2], {1: 2, 3: 4}, "123"):
        with pytest.raises(ValueError, match="costs"):
            balanced_split(costs, 2)
    llama = lk.models.build("llama-2-7b", "tiny")
    n = len(llama.model.layers)
    for lo, hi in ((1, 1), (-1, 1), (0, n + 1)):
        with pytest.raises(ValueError, match="lo"):
            Stage(llama, lo, hi, first=True, last=True)
    with pytest.raises(ValueError, match="first must be True or False"):
        Stage(llama, 0, n, first="no", last=True)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        loss_fn(torch.zeros(1, 1, 8), torch.zeros(1, 1, dtype=torch.long))


def test_balanced_split_minimises_the_largest_stage_and_refuses_bad_parts():
    assert balanced_split([1, 1, 1, 3.5], 2) == [(0, 3), (3, 4)]
    assert balanced_split([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert balanced_split([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    assert balanced_split([2, 3], 1) == [(0, 2)]
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=f"parts must be .*, got {bad!r}"):
            balanced_split([2, 3], bad)
    with pytest.raises(ValueError, match="parts must be at most the 2 layers .*got 3"):
        balanced_split([2, 3], 3)


def test_one_torchrun_runs_the_sharded_layers_then_the_pipeline_on_two_ranks():
    """One torchrun for both scripts (labkit.scripts.chain): starting the ranks costs more than their work."""
    # the scripts assert outputs, gradients and weight-gradient shards (rtol 1e-4) and the pipeline's loss
    r, pp = launch(["labkit.scripts.tensor_parallel", "labkit.scripts.pipeline_parallel"], nproc=2, timeout=300)
    tokens, h = r["tokens"], r["hidden"]
    for block in ("mlp", "attention"):
        assert r[block]["param_bytes"] * 2 == r[block]["full_param_bytes"]        # 1/N per rank
        assert r[block]["forward_bytes"] == r[block]["backward_bytes"] == tokens * h * 4
        assert r[block]["calls"] == 2                                            # one all-reduce each way
    assert r["dtensor"]["loss"] == pytest.approx(r["dtensor"]["reference_loss"], abs=1e-5)
    assert r["dtensor"]["local_param_bytes"] < r["dtensor"]["full_param_bytes"]

    rows = {(x["schedule"], x["m"], x["rank"]): x for x in pp["runs"]}
    assert len(rows) == 2 * len(pp["microbatches"]) * 2
    head, layer = pp["block_flops"][-1]["F"], pp["block_flops"][0]["F"]
    assert head > layer and pp["split"][0][1] - pp["split"][0][0] > pp["split"][1][1] - pp["split"][1][0]
    for (name, m, rank), x in rows.items():             # what the schedule ran, replayed in unit time
        assert sorted(x["events"])[0][2] >= 0 and len(x["events"]) == 2 * m
        ran = [(k, c) for k, c, *_ in x["events"]]
        assert ran == {"GPipe": gpipe, "1F1B": one_f_one_b}[name](2, m)[rank], (name, m, rank, "torch's order is labkit's")
    for name in ("GPipe", "1F1B"):
        for m in pp["microbatches"]:
            orders = [[(k, c) for k, c, *_ in rows[(name, m, s)]["events"]] for s in range(2)]
            assert bubbles(replay(orders, [{"F": 1, "B": 2}] * 2)) == [Fraction(1, m + 1)] * 2
