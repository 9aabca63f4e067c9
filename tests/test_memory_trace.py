"""track()'s allocation trace: every allocation and free in order, by category, also on fake tensors."""
import torch

import labkit as lk
from labkit.alloc import replay


def test_trace_lists_allocations_and_frees_in_order():
    with lk.track() as mem:
        a = torch.empty(256)                   # 1 KiB
        b = a + 1                              # 1 KiB
        v = b[:10]                             # a view: nothing new
        del a
        c = torch.empty(0)                     # zero bytes: no allocation on CUDA either
    sa, sb = (s for s, n, _ in mem.trace[:2])
    assert mem.trace == [(sa, 1024, "other"), (sb, 1024, "other"), (sa, -1024, "other")]
    assert sum(n for _, n, _ in mem.trace) == mem.live
    del b, v, c


def test_trace_categories_and_running_sum_match_the_timeline():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    with lk.track(model, opt) as mem:
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    cats = {c for _, _, c in mem.trace}
    assert {"parameters", "activations", "gradients", "optimizer"} <= cats
    running, peak = 0, 0
    for _, n, _ in mem.trace:
        running += n
        peak = max(peak, running)
    assert peak == mem.peak and running == mem.live
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert sum(n for _, n, c in mem.trace if c == "gradients" and n > 0) == weights


def test_resize_is_a_new_allocation_of_the_new_size():
    with lk.track() as mem:
        x = torch.empty(10)
        x.resize_(100)
    s = mem.trace[0][0]
    assert mem.trace == [(s, 40, "other"), (s, 400, "other")]
    r = replay(mem.trace)
    assert r.peak_allocated == 512 + 512 and r.allocated[-1] == 512        # old block freed after the copy


def test_trace_under_fake_tensor_mode_replays():
    model = lk.models.build("llama-2-7b", "tiny", dtype=torch.bfloat16, device="fake")
    with model.fake_mode:
        ids = torch.randint(0, 4096, (2, 64))
        with lk.track(model) as mem:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(mem.trace) > 100 and all(isinstance(n, int) and n != 0 for _, n, _ in mem.trace)
    r = replay(mem)                                           # a report is a trace too
    assert r.ok and r.peak_reserved >= r.peak_allocated >= mem.peak
