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
