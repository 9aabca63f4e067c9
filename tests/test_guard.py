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


def test_budget_bad_size():
    with pytest.raises(ValueError, match="size must be positive"):
        with lk.budget(-5):
            pass


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
