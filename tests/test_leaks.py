"""labkit.leaks: planted leaks (the seed's three: unreleased intermediates, a cache growing in a loop, an RNN's
undetached hidden state; and a reference cycle) are found with what holds them; a correct loop shows no growth."""
import pytest
import torch

from labkit import leaks

torch.manual_seed(0)
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
X = torch.randn(32, 64)
OUT_BYTES = 32 * 4                           # one output: 32 x 1 fp32

total = torch.zeros(())
outputs = []
callbacks = []


def correct_step():
    with torch.no_grad():
        loss = MODEL(X).mean()
    return loss.item()


def leak_sum_loss_with_grad():               # an eval loop that sums loss without no_grad
    global total
    total = total + MODEL(X).mean()


def leak_append_outputs():
    outputs.append(MODEL(X))


def leak_closure():
    h = MODEL(X)
    callbacks.append(lambda: h.mean())


def leak_cycle():
    node = {"out": MODEL(X)}
    node["self"] = node                      # a reference cycle: only gc.collect() frees it


def test_correct_loop_shows_no_growth():
    r = leaks.find(correct_step, steps=3)
    assert r.growth_per_step == 0 and not r.grows and r.survivors == [] and r.cycle_bytes_per_step == 0
    assert "nothing survives" in str(r)


def test_eval_loop_without_no_grad_keeps_graphs_alive():
    r = leaks.find(leak_sum_loss_with_grad, steps=3)
    assert r.grows and r.growth_per_step >= 32 * 256 * 4       # the saved ReLU output, every step
    graph = [s for s in r.survivors if s.saved_for_backward]
    assert graph and "autograd graph" in graph[0].holder and "'total'" in graph[0].holder
    assert all("test_leaks.py" in s.line for s in r.survivors)


def test_appended_outputs_are_held_by_the_list():
    outputs.clear()
    r = leaks.find(leak_append_outputs, steps=3)
    assert r.grows
    top = next(s for s in r.survivors if "outputs.append" not in s.holder and "'outputs'" in s.holder)
    assert "list" in top.holder and "leak_append_outputs" in top.line
    outputs.clear()


def test_closure_over_a_tensor_is_found_through_the_cell():
    callbacks.clear()
    r = leaks.find(leak_closure, steps=3)
    assert r.grows
    held = [s for s in r.survivors if "'callbacks'" in s.holder]
    assert held and "closure cell" in held[0].holder and "function" in held[0].holder
    callbacks.clear()


def test_reference_cycle_is_freed_only_by_gc_collect():
    r = leaks.find(leak_cycle, steps=3)
    assert r.growth_per_step == 0 and r.survivors == []
    assert r.cycle_bytes_per_step >= OUT_BYTES


RNN = torch.nn.GRU(8, 16, batch_first=True)
RNN_X = torch.randn(2, 4, 8)
hidden = None
memo = {}


def leak_rnn_hidden_not_detached():         # each step's graph hangs on the previous one's
    global hidden
    out, hidden = RNN(RNN_X, hidden)
    out.pow(2).mean().backward(retain_graph=True)


def fixed_rnn_detached():                   # truncated backpropagation through time
    global hidden
    out, hidden = RNN(RNN_X, None if hidden is None else hidden.detach())
    out.pow(2).mean().backward()


def leak_growing_cache():                   # memoised by a key that never repeats
    with torch.no_grad():
        memo[len(memo)] = MODEL(X)


def test_rnn_hidden_state_never_detached_grows_and_names_the_hidden_state():
    global hidden
    hidden = None
    r = leaks.find(leak_rnn_hidden_not_detached, steps=3)
    assert r.grows and r.growth_per_step > 0
    assert any("autograd graph" in s.holder and "'hidden'" in s.holder for s in r.survivors)
    assert r.survivors[0].line.endswith("in leak_rnn_hidden_not_detached")
    hidden = None


def test_detached_rnn_hidden_state_stays_one_step():
    global hidden
    hidden = None
    r = leaks.find(fixed_rnn_detached, steps=3)
    assert r.growth_per_step == 0 and not r.grows
    assert r.live_after[0] == r.live_after[-1] <= 2 * 16 * 4 * 2, "at most the last hidden state (and its output view)"
    hidden = None


def test_a_survivor_of_one_step_is_held_once_not_per_step():
    """The detached hidden state: the last step's survives, replaced by the next. It is no growth, so it is not
    spread over the steps as "B/step" (it read 341 B/step beside a growth of 0)."""
    global hidden
    hidden = None
    r = leaks.find(fixed_rnn_detached, steps=3)
    assert r.survivors and all(s.steps == 1 and s.bytes_per_step == 0 and s.bytes > 0 for s in r.survivors)
    assert sum(s.bytes for s in r.survivors) == r.live_after[-1]
    assert "/step" not in str(r.survivors[0]) and "once" in str(r.survivors[0])
    hidden = None


def test_cache_growing_in_a_loop_is_held_by_the_dict():
    memo.clear()
    r = leaks.find(leak_growing_cache, steps=3)
    assert r.grows and r.growth_per_step == OUT_BYTES, "exactly one output per step, no graph (no_grad)"
    assert "'memo'" in r.survivors[0].holder and "dict" in r.survivors[0].holder
    memo.clear()


def test_bad_input():
    with pytest.raises(TypeError, match="step must be a callable"):
        leaks.find(3)
    with pytest.raises(ValueError, match="steps must be an int >= 2"):
        leaks.find(correct_step, steps=1)


def test_a_leak_kept_in_a_local_list_is_named_by_the_list():
    """A list local to the function that runs the check (the step appends to it through a closure): no global
    holds it, and the frame that does was invisible to gc.get_referrers, so the holder read "unknown"."""
    model, x = torch.nn.Linear(64, 64), torch.randn(8, 64)
    kept = []

    def step():
        with torch.no_grad():
            kept.append(model(x))

    report = leaks.find(step, steps=3)
    holder = report.survivors[0].holder
    assert holder.startswith("local 'kept' in test_a_leak_kept_in_a_local_list_is_named_by_the_list"), holder
    assert holder.endswith("list[4] -> Tensor(8, 64)"), holder
