"""lk.oom_guard and lk.budget: an out-of-memory error caught, partial gradients cleared, the names that keep a graph
alive said, memory back where it was; and lk.requires, lk.free."""
import pytest
import torch

import labkit as lk


def test_budget_oom_is_caught_and_memory_returns(tiny_llama, capsys):
    model, opt, step = tiny_llama
    with lk.track(model, opt) as outer:
        before = outer.live
        with lk.oom_guard() as guard:
            with lk.budget(4 * 2**20, model, opt):
                step()
        opt.zero_grad(set_to_none=True)
        after = outer.live
    assert guard.oom and "budget 4.00 MiB exceeded" in guard.message
    assert after == before
    assert "OutOfMemoryError caught" in capsys.readouterr().out


def test_budget_64_mib_around_a_step_that_needs_more():
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.AdamW(model.parameters())
    ids = next(lk.data.batches(8, 256))
    with lk.track(model, opt) as outer:
        before = outer.live
        with lk.oom_guard(quiet=True) as guard:
            with lk.budget("64 MiB", model, opt):
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
        opt.zero_grad(set_to_none=True)
        after = outer.live
    assert guard.oom and after == before


def test_budget_that_fits_and_other_errors_pass_through(tiny_llama):
    model, opt, step = tiny_llama
    with lk.budget("1 GiB", model, opt) as mem:
        step()
    assert 0 < mem.peak < 2**30
    with pytest.raises(ZeroDivisionError):
        with lk.oom_guard():
            1 / 0
    with lk.oom_guard() as g:
        pass
    assert not g.oom and g.message is None


@pytest.mark.parametrize("bad, says", [(-5, "size must be positive"), (1.5, "size must be a whole number of bytes, got 1.5"),
                                       (0.5, "size must be a whole number of bytes, got 0.5"),
                                       (float("nan"), "size must be a finite number of bytes, got nan"),
                                       (float("inf"), "size must be a finite number of bytes, got inf"),
                                       ("2 Gb", "size '2 Gb' is in bits"), ("0.1", "size must be at least 1 byte"),
                                       ("2.5 B", "size must be a whole number of bytes, got '2.5 B'")])
def test_budget_bad_size(bad, says):
    with pytest.raises(ValueError, match=says):
        with lk.budget(bad):
            pass


def _two_layers():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _backward_that_runs_out(model):
    """A backward that stops half-way: the last layer's grads are in, the first layer's never come."""
    h = model[0](torch.randn(4, 8))

    def oom(grad):
        raise torch.OutOfMemoryError()                   # an OOM with an empty message
    h.register_hook(oom)
    model[1](h).sum().backward()


def test_oom_guard_clears_partial_grads_of_what_it_was_given(capsys):
    model, opt = _two_layers()
    with lk.oom_guard(model, opt) as guard:
        _backward_that_runs_out(model)
    assert guard.oom and guard.message == "OutOfMemoryError (no message)"
    assert guard.cleared == 2 and all(p.grad is None for p in model.parameters())
    assert "Cleared the partial .grad of 2 tensors" in capsys.readouterr().out
    with lk.oom_guard() as guard:                        # not given the model: it says what may be left
        _backward_that_runs_out(model)
    assert guard.oom and model[1].weight.grad is not None
    assert "parameters may hold partial .grads" in capsys.readouterr().out


def test_oom_guard_given_a_generator_of_parameters_clears_their_partial_grads():
    model, _ = _two_layers()
    with lk.oom_guard(model.parameters(), quiet=True) as guard:
        h = model[0](torch.randn(4, 8))
        h.register_hook(_oom)
        model[1](h).sum().backward()
    assert guard.oom and guard.cleared == 2
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("bad", [iter([1, 2]), (x for x in "ab")])
def test_an_iterator_of_something_else_is_refused_naming_what_it_held(bad):
    with pytest.raises(TypeError, match=r"oom_guard\(\) argument 0 is an iterator of (int|str)"):
        lk.oom_guard(bad)
    with pytest.raises(TypeError, match=r"track\(\) argument 0 is an iterator of"):
        lk.track(iter([1.5]))


def test_oom_guard_catches_a_real_cpu_allocation_failure_and_is_reusable():
    guard = lk.oom_guard(quiet=True)
    with guard:
        torch.empty(2**50, dtype=torch.uint8)            # 1 PiB: "DefaultCPUAllocator: can't allocate memory"
    assert guard.oom and "allocate" in guard.message
    with guard:
        pass
    assert not guard.oom and guard.message is None       # a new block starts clean
    with pytest.raises(RuntimeError, match="unrelated"):
        with guard:
            raise RuntimeError("unrelated")


def test_budget_exceeded_on_entry_leaves_nothing_registered(tiny_llama):
    from torch.nn.modules import module
    model, opt, step = tiny_llama
    before = len(module._global_forward_pre_hooks), len(module._global_forward_hooks)
    for _ in range(3):
        with lk.oom_guard(quiet=True) as guard:
            with lk.budget("64 KiB", model, opt):
                step()
        assert guard.oom and "exceeded before the block ran: what was passed in already holds" in guard.message
        assert "after allocating" not in guard.message
    assert (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)) == before


def test_requires(capsys):
    assert lk.requires("transformers", skipped="x") is True
    assert lk.requires("flash_attn", "transformers", skipped="the flash-attn kernels") is lk.has("flash_attn")
    if not lk.has("flash_attn"):
        assert "Skipped: the flash-attn kernels. It needs flash_attn" in capsys.readouterr().out
    with pytest.raises(ValueError, match="at least one feature"):
        lk.requires()
    with pytest.raises(ValueError, match="name must be one of"):
        lk.requires("teleport")


def test_free_runs():
    lk.free()


def _oom(grad):
    raise torch.OutOfMemoryError("simulated")


def test_a_graph_named_in_a_function_is_freed_by_the_del_the_guard_advises():
    """The guard reads the block's names to say which holds a graph. On Python < 3.13 reading a function's
    f_locals leaves a snapshot dict on its frame: it kept every tensor it saw alive after `del` (the graph of
    an OOM'd forward and backward: 3.86 MiB in the probe, 16 KiB here)."""
    model, _ = _two_layers()
    x = torch.randn(512, 8)

    def train():
        with lk.track(model) as mem:
            before = mem.live
            with lk.oom_guard(model, quiet=True) as guard:
                h = model[0](x)
                h.register_hook(_oom)
                loss = model[1](h).sum()
                loss.backward()
            assert guard.oom and guard.graphs == ["h", "loss"]
            del h, loss
            return mem.live - before

    assert train() == 0


def test_after_an_oom_the_guard_names_the_variable_that_keeps_the_graph_alive(capsys):
    model, _ = _two_layers()
    x = torch.randn(4, 8)
    with lk.oom_guard(model) as guard:
        h = model[0](x)
        h.register_hook(_oom)
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


def test_the_guard_names_a_model_output_that_holds_a_graph(capsys):
    from transformers.modeling_outputs import CausalLMOutput
    model, _ = _two_layers()
    with lk.oom_guard(model) as guard:
        h = model[0](torch.randn(4, 8)).detach().requires_grad_()
        h.register_hook(_oom)
        out = CausalLMOutput(loss=model[1](h).sum())            # what model(...) returns: a dict of tensors
        pair = (out.loss, 1)
        out.loss.backward()
    assert guard.oom and guard.graphs == ["out", "pair"] and "`del out, pair`" in capsys.readouterr().out
    del out, pair


def test_objects_given_in_a_list_or_dict_are_held_weakly():
    """The docstring says held weakly: a list or dict of them was kept whole, and the model with it."""
    import gc
    import weakref
    model, opt = _two_layers()
    alive = weakref.ref(model)
    guard = lk.oom_guard([model], {"opt": opt})
    del model, opt
    gc.collect()
    assert alive() is None
    with guard:
        raise torch.OutOfMemoryError("simulated")
    assert guard.oom and guard.cleared == 0
