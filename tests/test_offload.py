"""labkit.offload and labkit.copies' counters: activation offload (host, disk, bf16), HostAdam, bandwidth, cross-device
copies, the seed's Swapper as written beside the corrected one, saved bytes by device, hooks counted from outside."""
import copy
import logging
import tracemalloc

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import labkit as lk
from labkit import copies, offload
from labkit.copies import CountedHooks, CrossDeviceCopies, GradWeightCopies, SavedBytesByDevice
from labkit.offload import ActivationOffload, HostAdam, SeedSwapper, Swapper


@pytest.fixture(scope="module")
def llama():
    return lk.models.build("llama-2-7b", "tiny", num_hidden_layers=2)


@pytest.fixture(scope="module")
def batch():
    return next(lk.data.batches(2, 64))


def step(model, ids, hooks=None):
    model.zero_grad(set_to_none=True)
    with lk.track(model) as mem:
        if hooks is None:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        else:
            with hooks:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return mem, loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def plain(llama, batch):
    return step(llama, batch)


@pytest.mark.parametrize("to", ["host", "disk"])
def test_lossless_offload_gives_equal_gradients_and_counts_bytes(llama, batch, plain, to, tmp_path):
    mem0, loss0, grads0 = plain
    off = ActivationOffload(to, keep=llama, folder=tmp_path)
    mem, loss, grads = step(llama, batch, off)
    assert torch.equal(loss, loss0) and all(torch.equal(g, r) for g, r in zip(grads, grads0))
    assert off.packs > 0 and off.bytes_out == off.offloaded_bytes > 0
    assert off.unpacks == off.packs + off.shared and off.bytes_in >= off.bytes_out
    assert mem.at("forward end")["activations"] < mem0.at("forward end")["activations"] - off.bytes_out // 2
    assert mem.peak < mem0.peak
    assert not list(tmp_path.iterdir()), "no files left once the graph is freed"


def test_offloaded_bytes_equal_what_autograd_saved(llama, batch):
    """Every byte of every tensor handed to pack is counted once, independently of the offloader's books."""
    seen = {}
    rules = ActivationOffload("host", keep=llama)

    def observe(t):
        if rules.offloads(t):
            key = (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            seen[key] = (t, t.numel() * t.element_size())     # holding t: no storage id is reused meanwhile
        return rules.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(observe, rules.unpack):
        loss = llama(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    assert rules.bytes_out == sum(n for _, n in seen.values()) and rules.packs == len(seen)


def test_parameters_integers_and_small_tensors_stay(llama):
    off = ActivationOffload("host", keep=llama, min_bytes=1024)
    weight = llama.lm_head.weight
    assert not off.offloads(weight) and not off.offloads(weight.t())          # a view of a parameter too
    assert not off.offloads(torch.arange(4096))                                # labels, ids
    assert not off.offloads(torch.ones(8))                                     # 32 bytes
    assert off.offloads(torch.ones(1024))
    assert off.pack(torch.arange(5)) is not None and off.kept == 1


def test_bf16_error_is_bounded_and_halves_the_bytes(llama, batch, plain):
    _, loss0, grads0 = plain
    off = ActivationOffload("bf16", keep=llama)
    _, loss, grads = step(llama, batch, off)
    assert torch.equal(loss, loss0)
    rel = max(((g - r).norm() / r.norm()).item() for g, r in zip(grads, grads0))
    assert 0 < rel < 0.05
    assert off.bytes_out * 2 == off.offloaded_bytes
    x = torch.randn(1000) * 100
    back = off.unpack(off.pack(x))
    assert ((back - x).abs() <= x.abs() * 2 ** -8).all()                      # one rounding: 2**-9 relative


def test_roundtrip_keeps_strides_and_values():
    off = ActivationOffload("host")
    for t in (torch.randn(64, 32).t(), torch.randn(4, 8, 16).permute(2, 0, 1), torch.randn(64, 64)[::2]):
        back = off.unpack(off.pack(t))
        assert torch.equal(back, t)
        if offload._dense(t):
            assert back.stride() == t.stride()
    assert off.bytes_out == off.bytes_in


def test_shared_tensor_packed_once():
    off = ActivationOffload("host", min_bytes=0)
    x = torch.randn(256, requires_grad=True)
    y = torch.randn(256)
    with off:
        h = x * 2
        out = (h * y).sum() + (h * h).sum()         # h saved by two ops (three references)
    out.backward()
    assert off.shared >= 1 and off.packs + off.shared == off.unpacks
    assert torch.equal(x.grad, 2 * y + 8 * x.detach())


def test_offload_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="to must be"):
        ActivationOffload("gpu")
    with pytest.raises(ValueError, match="folder"):
        ActivationOffload("disk")
    with pytest.raises(ValueError, match="min_bytes"):
        ActivationOffload("host", min_bytes=-1)
    with pytest.raises(TypeError, match="keep"):
        ActivationOffload("host", keep="model")
    for bad, where in ((object(), "keep "), (np.ones(3), "keep "), ([5], r"keep\[0\]"), ([torch.nn.Linear(2, 2), "x"], r"keep\[1\]")):
        with pytest.raises(TypeError, match=where):
            ActivationOffload("host", keep=bad)


def test_offload_keeps_what_an_iterator_of_parameters_names():
    """keep=model.parameters() (a generator) keeps the weights, as keep=model does: none of them is moved."""
    model = torch.nn.Linear(64, 64)
    assert len(ActivationOffload("host", keep=model.parameters())._keep) == 2
    assert ActivationOffload("host", keep=model.parameters())._keep == ActivationOffload("host", keep=model)._keep


def test_host_adam_matches_adamw_and_keeps_no_state_on_the_device(llama, batch):
    a, b = copy.deepcopy(llama), copy.deepcopy(llama)
    ref = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    host = HostAdam(b.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        for model, opt in ((a, ref), (b, host)):
            model(input_ids=batch, labels=batch, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    nbytes = sum(p.numel() * 4 for p in b.parameters())
    assert host.bytes_to_host == host.bytes_to_device == 3 * nbytes
    assert host.host_bytes() == 3 * nbytes
    assert not host.state                                      # nothing in torch's books
    b(input_ids=batch, labels=batch, use_cache=False).loss.backward()
    with lk.track(b, host) as mem:
        host.step()
    assert mem.max_parts["optimizer"] == 0


def test_host_adam_rejects_bad_arguments():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="lr"):
        HostAdam(p, lr=-1)
    with pytest.raises(ValueError, match="betas"):
        HostAdam(p, betas=(0.9, 1.5))
    with pytest.raises(TypeError, match="float32"):
        HostAdam([torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))])


def test_bandwidth_measures_and_rejects(tmp_path):
    for route in ("device->host", "host->device", "host->disk", "disk->host"):
        rate = offload.bandwidth(route, "1 MiB", folder=tmp_path, repeat=2)
        assert rate > 0
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="route"):
        offload.bandwidth("host->moon")
    with pytest.raises(ValueError, match="folder"):
        offload.bandwidth("host->disk")
    with pytest.raises(ValueError, match="repeat"):
        offload.bandwidth("device->host", repeat=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            offload.bandwidth("pinned->device")
    with pytest.raises(TypeError, match="fresh"):
        offload.bandwidth("device->host", fresh="yes")


def test_bandwidth_runs_one_rate_per_copy_into_a_warm_or_a_fresh_buffer(tmp_path, monkeypatch):
    """`bandwidth` is the median of `bandwidth_runs`; fresh=True allocates a new destination for every copy
    (as a pack hook does), fresh=False one for all of them (the warm-up copy included)."""
    made = []
    empty = np.empty
    monkeypatch.setattr(offload.np, "empty", lambda *a, **k: made.append(1) or empty(*a, **k))
    for fresh, buffers in ((False, 1), (True, 1 + 4)):          # one warm-up and three timed copies, + the source
        made.clear()
        rates = offload.bandwidth_runs("device->host", "1 MiB", repeat=3, fresh=fresh)
        assert len(rates) == 3 and all(r > 0 for r in rates)
        assert len(made) == buffers, (fresh, len(made))

def test_cross_device_copies_and_the_swapper():
    layer = torch.nn.Linear(64, 64)
    swap = Swapper(layer, "cpu", "cpu")
    x = torch.randn(8, 64, requires_grad=True)
    with CrossDeviceCopies() as moved:
        swap(x).sum().backward()
    assert moved.bytes == 0 and moved.copies == 0                 # same device: nothing moves
    assert torch.equal(swap(x), layer(x))
    with CrossDeviceCopies() as moved:
        torch.ones(10).to("meta")
    assert moved.routes == {"cpu->meta": 40}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_swapper_moves_activations_not_weights():
    layer = torch.nn.Linear(64, 64).cuda()
    x = torch.randn(8, 64, requires_grad=True)
    with CrossDeviceCopies() as moved:
        Swapper(layer, "cuda")(x).sum().backward()
    act = 8 * 64 * 4
    assert moved.routes == {"cpu->cuda": 2 * act, "cuda->cpu": 2 * act}


def mlps(device, n=2):
    return [layer.mlp for layer in lk.models.build("llama-2-7b", "tiny", device=device, num_hidden_layers=n).model.layers]


def test_the_seeds_swapper_as_written_fails_on_a_module_on_the_device():
    """`x = x.cpu(); x = self.module(x); return x.cuda()` with the module on the device ("meta" standing in
    for a GPU under FakeTensorMode) is an op across two devices: refused, as on a GPU."""
    stack = torch.nn.Sequential(*(SeedSwapper(m, "meta") for m in mlps("meta")))
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(2, 8, lk.models.config("llama-2-7b", "tiny").hidden_size, device="meta")
        # torch 2.13's words; 2.11's FakeTensor says "found two different devices cpu, meta"
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device|two different devices"):
            stack(x)


def test_the_seeds_swapper_runs_the_layer_on_the_host_and_the_corrected_one_on_the_device():
    """With the module on the host the seed's version runs it there: its saved tensors are all on the host;
    the corrected Swapper keeps them on the device. Both move each layer's input and output once each way."""
    h = lk.models.config("llama-2-7b", "tiny").hidden_size
    out = {}
    for name, wrapper, where, start in (("seed", SeedSwapper, "cpu", "meta"), ("fixed", Swapper, "meta", "cpu")):
        stack = torch.nn.Sequential(*(wrapper(m, "meta", host="cpu") for m in mlps(where)))
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.randn(2, 8, h, device=start, requires_grad=True)
            with CrossDeviceCopies() as moved, SavedBytesByDevice() as saved:
                stack(x).sum().backward()
        out[name] = moved.routes, saved.bytes
    act = 2 * 8 * h * 4
    assert out["seed"][0] == {"meta->cpu": 2 * 2 * act, "cpu->meta": 2 * 2 * act} == out["fixed"][0]
    assert set(out["seed"][1]) == {"cpu"} and out["fixed"][1] == {"meta": out["seed"][1]["cpu"]}


def test_saved_bytes_by_device_counts_a_storage_saved_twice_once():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)
    with SavedBytesByDevice() as saved:
        (x @ w).sum() + (x @ w.t()).sum()         # x saved by both matmuls, w by neither (x needs no grad)
    assert saved.bytes == {"cpu": x.nbytes}


def test_counted_hooks_count_what_activation_offload_moves_from_outside():
    """CountedHooks around ActivationOffload: every moved save is unpacked once, and the bytes unpack returns
    equal ActivationOffload's bytes back (host), twice them for bf16 (it comes back as fp32)."""
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=2)
    ids = next(lk.data.batches(2, 32))
    for to in ("host", "bf16"):
        off = ActivationOffload(to, keep=model)
        with CountedHooks(off) as counted:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        t = counted.tally
        assert t["copied"] == off.packs + off.shared > 0 and t["unpacked"] == t["copied"]
        assert t["unpacked_bytes"] == off.bytes_in * (2 if to == "bf16" else 1)
        assert not off._packed, "its exit clears the offloader's sharing table"


def test_counted_hooks_see_that_save_on_cpu_copies_nothing_on_a_cpu():
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=1)
    ids = next(lk.data.batches(2, 16))
    with CountedHooks(torch.autograd.graph.save_on_cpu(), weights=model.parameters()) as counted:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counted.tally["saved"] > 0 and counted.tally["copied"] == 0


def test_grad_weight_copies_and_numpy_bytes_see_host_adam_move_its_state():
    layer = torch.nn.Linear(32, 32)
    opt = HostAdam(layer.parameters(), lr=1e-3)
    tracemalloc.start()
    try:
        with GradWeightCopies(layer) as moved:
            layer(torch.randn(4, 32)).sum().backward()
            opt.step()
        held = copies.numpy_bytes()
    finally:
        tracemalloc.stop()
    weights = sum(p.nbytes for p in layer.parameters())
    assert moved.from_grads == moved.into_weights == weights
    assert held >= 3 * weights                     # master copy and two moments, numpy on the host
    assert copies.numpy_bytes() == 0              # not tracing: nothing seen


def test_count_weight_reads_with_disk_offload(tmp_path):
    from accelerate import disk_offload
    logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
    model = lk.models.build("llama-2-7b", "tiny", num_hidden_layers=2).eval()
    ids = next(lk.data.batches(1, 16))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    offloaded = disk_offload(copy.deepcopy(model), tmp_path / "disk", execution_device="cpu")
    with copies.count_weight_reads(offloaded) as reads, torch.no_grad():
        out = offloaded(input_ids=ids, use_cache=False).logits
    assert torch.equal(out, ref) and reads["bytes"] == weight_bytes
    with pytest.raises(ValueError, match="offload hooks"):
        with copies.count_weight_reads(model):
            pass


def test_to_host_is_outside_torch():
    t = torch.randn(1000)
    with lk.track() as mem:
        buf, dtype, shape = offload.to_host(t)
    assert mem.peak == 0 and isinstance(buf, np.ndarray) and buf.nbytes == 4000
    with lk.track() as mem:
        back = offload.from_host(buf, dtype, shape)
    assert mem.peak == 4000 and torch.equal(back, t)
