import pytest
import torch

import labkit as lk
from labkit.units import GiB, MiB


def test_counts_allocations_frees_and_views_once():
    with lk.track() as mem:
        a = torch.empty(256, 1024)             # 1 MiB
        v = a[:10].T                           # a view: no new storage
        b = a + 1                              # 1 MiB more
        del a
        assert mem.live == 2 * MiB             # the view keeps a's storage alive
        del v
        assert mem.live == MiB
    assert mem.peak == 2 * MiB
    assert mem.peak_parts["other"] == 2 * MiB
    del b


def test_pre_existing_storage_seen_through_a_view_is_not_new():
    big = torch.zeros(1000)
    with lk.track() as mem:
        part = big[:10]
        part2 = part + 0
    assert mem.peak == part2.untyped_storage().nbytes()


def test_categories_of_a_training_step(tiny_llama):
    model, opt, step = tiny_llama
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with lk.track(model, opt) as mem:
        step()
    assert mem.max_parts["gradients"] == weights
    assert mem.at("step end")["gradients"] == weights
    assert mem.at("end")["gradients"] == 0                       # zero_grad(set_to_none=True)
    assert mem.at("forward end")["activations"] > 0
    assert mem.at("start")["optimizer"] == pytest.approx(2 * weights, rel=0.01)   # + the step counters
    assert [t for _, t in mem.marks][:3] == ["start", "forward", "forward end"]


def test_peak_equals_pytorch_memtracker(tiny_llama):
    from torch.distributed._tools.mem_tracker import MemTracker
    model, opt, step = tiny_llama
    ref = MemTracker()
    ref.track_external(model, opt)
    with ref:
        step()
    with lk.track(model, opt) as mem:
        step()
    assert mem.peak == ref.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_fake_7b_training_step_foreach_false_and_true():
    peaks = {}
    for foreach in (False, True):
        model = lk.models.build("llama-2-7b", "full", dtype=torch.bfloat16, device="fake")
        with model.fake_mode:
            opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
            ids = torch.randint(0, 32000, (1, 512))
            with lk.track(model, opt) as mem:
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                opt.step()
        peaks[foreach] = mem
    m = peaks[False]
    assert m.max_parts["gradients"] == 6_738_415_616 * 2                          # 12.55 GiB
    assert m.max_parts["optimizer"] == pytest.approx(2 * 6_738_415_616 * 2, rel=1e-4)   # 25.1 GiB
    assert 2.8 * GiB < m.at("forward end")["activations"] < 3.1 * GiB
    assert 50 * GiB < m.peak < 52 * GiB
    extra = peaks[True].max_parts["other"] - m.max_parts["other"]
    assert extra == pytest.approx(6_738_415_616 * 2, rel=0.05)                # one parameter-sized copy


def test_meta_device_is_counted():
    # transformers' models read mask values in forward (data-dependent), so on meta use plain modules;
    # FakeTensorMode (device="fake") runs the transformers models.
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
        x = torch.empty(8, 1024)
    with lk.track(model) as mem:
        model(x).sum().backward()
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert mem.at("start")["parameters"] == weights
    assert mem.at("forward end")["activations"] >= 2 * 8 * 4096 * 4       # the GELU's input and output
    assert mem.max_parts["gradients"] == weights


def test_kv_cache_category_from_generate():
    model = lk.models.build("llama-2-7b", "tiny").eval()
    ids = torch.randint(0, 4096, (1, 8))
    with torch.no_grad(), lk.track(model) as mem:
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    mem.label(out.cache, "kv_cache")
    assert mem.at("end")["kv_cache"] == lk.kv_cache_bytes(model.config, 1, out.sequences.shape[1] - 1, "fp32")


def test_budget_raises_out_of_memory_naming_budget_and_live():
    with pytest.raises(torch.OutOfMemoryError, match=r"budget 1.00 MiB exceeded: live 2.00 MiB"):
        with lk.track(budget="1 MiB"):
            a = torch.empty(512, 1024)      # 2 MiB
    with lk.track(budget="4 MiB") as mem:
        b = torch.empty(512, 1024)
    assert mem.peak == 2 * MiB


def test_device_filter_and_bad_input():
    with lk.track(device="meta") as mem:
        torch.empty(100)
        torch.empty(100, device="meta")
    assert mem.peak == 400
    with pytest.raises(ValueError, match="device must be"):
        lk.track(device="toaster")
    with pytest.raises(ValueError, match="budget must look like"):
        lk.track(budget="much")
    with lk.track() as mem:
        pass
    with pytest.raises(ValueError, match="category must be one of .*'weights'"):
        mem.label(torch.zeros(1), "weights")
    with pytest.raises(ValueError, match="mark must be one of .*'nowhere'"):
        mem.at("nowhere")


def test_timeline_shape_and_repr():
    with lk.track() as mem:
        x = torch.ones(10)
        y = x * 2
        del x
    tl = mem.timeline
    assert set(tl) == set(lk.CATEGORIES) | {"total"}
    assert tl["total"].max() == mem.peak == 80 and tl["total"][-1] == 40
    assert "peak 80 B" in repr(mem)


def test_sparse_outputs_are_skipped_not_fatal():
    with lk.track() as mem:
        s = torch.eye(64).to_sparse()
        d = s.to_dense()
    assert mem.peak >= d.nbytes


def _global_module_hooks():
    from torch.nn.modules import module
    return len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)


def _tiny_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    return model, torch.optim.AdamW(model.parameters(), foreach=False)


def test_track_keeps_nothing_alive():
    import gc
    import weakref
    hooks = _global_module_hooks()
    model, opt = _tiny_mlp()
    with lk.track(model, opt) as mem:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    alive = weakref.ref(model), weakref.ref(opt), weakref.ref(model[0].weight)
    del model, opt
    gc.collect()
    assert [r() for r in alive] == [None, None, None]       # collected while `mem` lives
    assert mem.peak > 0 and mem.max_parts["optimizer"] > 0
    assert _global_module_hooks() == hooks


def test_timeline_is_built_once_and_rebuilt_after_a_new_label(tiny_llama):
    model, opt, step = tiny_llama
    with lk.track(model, opt) as mem:
        step()
    for _ in range(3):
        mem.peak_parts, mem.max_parts, mem.at("forward end"), mem.timeline, repr(mem)
    assert mem._builds == 1
    assert mem.timeline["total"].max() == mem.peak and sum(mem.peak_parts.values()) == mem.peak
    mem.label(model, "other")                              # a new label: the next read rebuilds
    assert mem.peak_parts["parameters"] == 0 and mem._builds == 2


def test_budget_exceeded_on_entry_says_what_is_held_and_leaks_no_hooks():
    model, opt = _tiny_mlp()
    held = lk.fmt_bytes(sum(p.nbytes for p in model.parameters()))          # 129.25 KiB of weights
    hooks = _global_module_hooks()
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError, match=rf"budget 64.00 KiB exceeded before the block ran: "
                           rf"what was passed in already holds {held} \(parameters {held}\)"):
            with lk.track(model, opt, budget="64 KiB"):
                pass
    assert _global_module_hooks() == hooks


def test_reading_the_model_output_cache_warns_nothing(monkeypatch):
    from transformers.utils import generic
    asked = []
    original = generic.ModelOutput._replace_old_cache_name
    monkeypatch.setattr(generic.ModelOutput, "_replace_old_cache_name",
                        lambda self, key: (asked.append(key), original(self, key))[1])
    model = lk.models.build("llama-2-7b", "tiny").eval()
    with torch.no_grad(), lk.track(model) as mem:
        out = model(input_ids=torch.randint(0, 4096, (1, 8)), use_cache=True)
    assert "past_key_values" not in asked                  # the key transformers warns about
    assert mem.at("end")["kv_cache"] == lk.kv_cache_bytes(model.config, 1, 8, "fp32")
    del out


def _compiled():
    return torch.compile(lambda x: (x * 2).relu().sum(), backend="eager")   # fresh: Dynamo skips it for good


def test_compiled_code_under_the_dispatch_tracker_is_refused():
    f, x = _compiled(), torch.randn(1024)
    with pytest.raises(RuntimeError, match=r"compiled code ran inside lk.track\(\).*backend='profiler'"):
        with lk.track():
            f(x)


def test_compiled_code_inside_nested_trackers_is_refused_by_each():
    """Each tracker listened for Dynamo's note with its own log filter, and the outer one's swallowed the note
    before the inner one heard it: only the outer tracker refused."""
    @torch.compile(backend="eager")                      # its own code object: Dynamo skips a code once
    def triple_cos(x):
        return (x * 3).cos()

    x = torch.randn(1024)
    with pytest.raises(RuntimeError, match=r"so triple_cos ran eagerly"):
        with lk.track():
            with pytest.raises(RuntimeError, match=r"so triple_cos ran eagerly"):
                with lk.track():
                    triple_cos(x)
    with lk.track():                                     # the listener is gone with the trackers
        pass


def test_profiler_backend_equals_dispatch_backend_in_eager(tiny_llama):
    model, opt, step = tiny_llama
    with lk.track(model, opt) as ref:
        step()
    with lk.track(model, opt, backend="profiler") as mem:
        step()
    assert mem.peak == ref.peak and mem.live == ref.live and mem.start == ref.start
    assert mem.peak_parts == ref.peak_parts                 # to the byte, category by category
    assert [t for _, t in mem.marks] == [t for _, t in ref.marks]
    for mark in ("forward end", "step end", "end"):
        assert mem.at(mark) == ref.at(mark)
    assert abs(mem.max_parts["other"] - ref.max_parts["other"]) <= 4096   # the profiler also sees scalars


def test_profiler_backend_counts_compiled_code():
    f, x = _compiled(), torch.randn(256, 1024)               # 1 MiB in
    f(x)                                                     # compiled here, outside any tracker
    with lk.track(x, backend="profiler") as mem:
        f(x)
    assert mem.start == MiB and mem.peak >= 2 * MiB          # x and at least one 1 MiB intermediate
    assert mem.live == MiB
    with pytest.raises(ValueError, match="budget needs backend='dispatch'"):
        lk.track(budget="1 GiB", backend="profiler")
    with pytest.raises(ValueError, match="backend must be one of .*'nvml'"):
        lk.track(backend="nvml")
    with pytest.raises(ValueError, match="fake or meta tensors need backend='dispatch'"):
        with lk.track(torch.empty(4, device="meta"), backend="profiler"):
            pass


def test_what_the_dispatch_tracker_cannot_see(capfd):
    import threading
    kept = []
    for backend in ("dispatch", "profiler"):
        born_before = torch.zeros(256)
        with lk.track(backend=backend) as mem:
            born_before.resize_(256 * 1024)                  # 1 MiB now, for a storage born before the block
            other = threading.Thread(target=lambda: kept.append(torch.ones(256, 1024)))
            other.start()
            other.join()                                     # 1 MiB made by another thread
        if backend == "dispatch":
            assert mem.peak == 0                             # neither is seen (both said in the docstring)
        else:
            assert mem.peak == MiB                           # the profiler sees the resize_, not the thread
    assert "unknown size" not in capfd.readouterr().err     # the profiler's one-time C++ note is dropped


def test_profiler_backend_on_a_compiled_module_has_marks_and_warns_nothing():
    import warnings
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    compiled, x = torch.compile(model, backend="eager"), torch.randn(8, 64)
    compiled(x).sum().backward()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with lk.track(compiled, backend="profiler") as mem:
            compiled(x).sum().backward()
    assert [str(w.message) for w in said] == []             # not torch's note on global hooks
    assert [t for _, t in mem.marks] == ["start", "forward", "forward end", "backward", "end"]
    weights = sum(p.nbytes for p in model.parameters())
    assert mem.at("start")["parameters"] == weights and mem.max_parts["gradients"] == weights
