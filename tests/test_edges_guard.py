"""Edges of oom_guard and track: iterators of parameters, a graph kept alive by a name, bad arguments."""
import pytest
import torch

import labkit as lk


def _two_layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))


def _oom_hook(grad):
    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_oom_guard_given_a_generator_of_parameters_clears_their_partial_grads():
    model = _two_layers()
    with lk.oom_guard(model.parameters(), quiet=True) as guard:
        h = model[0](torch.randn(4, 8))
        h.register_hook(_oom_hook)
        model[1](h).sum().backward()
    assert guard.oom and guard.cleared == 2
    assert all(p.grad is None for p in model.parameters())


def test_track_given_a_generator_of_parameters_counts_them_as_parameters():
    model = _two_layers()
    size = sum(p.numel() * 4 for p in model.parameters())
    with lk.track(model.parameters()) as mem:
        model(torch.randn(4, 8)).sum().backward()
    assert mem.peak_parts["parameters"] == size
    assert mem.max_parts["gradients"] == size           # the grads born in backward, seen by the hooks


@pytest.mark.parametrize("bad", [iter([1, 2]), (x for x in "ab")])
def test_an_iterator_of_something_else_is_refused_naming_what_it_held(bad):
    with pytest.raises(TypeError, match=r"oom_guard\(\) argument 0 is an iterator of (int|str)"):
        lk.oom_guard(bad)
    with pytest.raises(TypeError, match=r"track\(\) argument 0 is an iterator of"):
        lk.track(iter([1.5]))


@pytest.mark.parametrize("bad", [3, "model", None])
def test_a_number_string_or_none_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match=rf"argument 1 is {type(bad).__name__} {bad!r}"):
        lk.track(torch.zeros(1), bad)


def test_after_an_oom_the_guard_names_the_variable_that_keeps_the_graph_alive(capsys):
    model = _two_layers()
    x = torch.randn(4, 8)
    with lk.oom_guard(model) as guard:
        h = model[0](x)
        h.register_hook(_oom_hook)
        loss = model[1](h).sum()
        loss.backward()
    out = capsys.readouterr().out
    assert guard.oom and "`h`, `loss` still hold their autograd graph" in out and "`del h, loss`" in out
    assert guard.graphs == ["h", "loss"]
    del h, loss
    with lk.oom_guard(model, quiet=True) as guard:     # backward on the unnamed expression: nothing named holds it
        model[1](model[0](x)).sum().backward()
        raise torch.OutOfMemoryError("simulated")
    assert guard.oom and guard.graphs == []


def test_a_training_forward_with_use_cache_on_counts_k_and_v_as_activations():
    """use_cache left at its default in a training loop: the cache holds the K/V that attention saved for
    backward. track files them as activations (as lk.estimate does); the same forward without a graph
    keeps them as a cache for later tokens."""
    model = lk.models.build("llama-2-7b", "tiny")
    ids = next(lk.data.batches(2, 32))
    with lk.track(model) as cached:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    with lk.track(model) as plain:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    assert cached.max_parts["kv_cache"] == 0
    assert cached.at("forward end")["activations"] == plain.at("forward end")["activations"]
    with torch.no_grad(), lk.track(model) as infer:
        out = model(input_ids=ids)
    cfg = model.config
    want = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4 * ids.numel()
    assert infer.max_parts["kv_cache"] == want
    del out


def test_track_given_a_state_dicts_values_counts_them():
    model = _two_layers()
    with lk.track(model.state_dict().values()) as mem:
        pass
    assert mem.peak == sum(p.numel() * 4 for p in model.parameters())
