"""Exercise checks refuse the wrong answers a learner could plausibly write (issue 37's list, each one tried)
and the answers that call the code the exercise teaches (bypasses.py).

For every wrong answer below the notebook runs as the answer key up to that exercise's check; right after the
check, a cell defines the wrong answer in place of the solution and a copy of the check runs on it: that copy
must fail (an AssertionError, ValueError or TypeError from the check, never "not attempted"). A bypass is
tried the same way, and its copy must fail naming the taught call; the check once more with `forbid=`
dropped must pass it (else the bypass proves nothing). Then the solution cell runs again, so the cells after
it see the answer key. A wrong answer here is one a learner might really write (a constant, the unsharded
computation, a copy that saves nothing, a number typed in instead of measured), not deliberate
introspection: a check in the learner's own process cannot stop that, and graded courses use nbgrader's
hidden tests (docs/instructor.md). Cells after the last check are dropped to save time; one kernel per
notebook for both kinds.
"""
import pathlib
import textwrap

import nbformat
import pytest
from nbclient import NotebookClient

from bypasses import BYPASSES, UNGUARDED

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = {p.name[:2]: p for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}

# notebook -> [(exercise id, why it is wrong, the answer's source)]: the answer replaces the solution cell.
WRONG = {
    "00": [
        ("00-ex1", "views skipped (t._base is None): a view whose base tensor is not in the list goes uncounted", """
            def storage_bytes(tensors):
                return sum(t.untyped_storage().nbytes() for t in tensors if t._base is None)
            """),
        ("00-ex2", "8.0 typed in after an untracked step", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return 8.0
            """),
        ("00-ex2", "the whole peak per parameter: activations and the loss gradient included", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                with lk.track(model, optimizer) as m:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                return m.peak / sum(p.numel() for p in model.parameters())
            """),
        ("00-ex2", "the states at the step's peak (peak_parts), when no gradient exists yet", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                with lk.track(model, optimizer) as m:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                states = m.peak_parts["parameters"] + m.peak_parts["gradients"] + m.peak_parts["optimizer"]
                return states / sum(p.numel() for p in model.parameters())
            """),
        ("00-ex2", "a step of the notebook's AdamW, not of the optimizer it was given", """
            def states_per_param(make_optimizer):
                ids = next(batches)
                with lk.track(model, opt) as m:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                states = m.max_parts["parameters"] + m.max_parts["gradients"] + m.max_parts["optimizer"]
                return states / sum(p.numel() for p in model.parameters())
            """),
        ("00-ex2", "8 or 12 typed in by whether the optimizer has momentum, after an untracked step", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return 12.0 if optimizer.defaults.get("momentum") else 8.0
            """),
        ("00-ex2", "8 bytes plus 4 per entry of the optimizer's state, counted after an untracked step", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return 8.0 + 4.0 * len(optimizer.state[next(model.parameters())])
            """),
        ("00-ex2", "numbers typed in by the optimizer's name after a step, 16 for one not listed", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return {"sgd": 8.0, "sgd_momentum": 12.0, "adam": 16.0}.get(make_optimizer.__name__, 16.0)
            """),
        ("00-ex2", "numbers typed in by the optimizer's name after a step, Adafactor's factored state taken for none", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                return {"sgd": 8.0, "sgd_momentum": 12.0, "adam": 16.0}.get(make_optimizer.__name__, 8.0)
            """),
        ("00-ex2", "4 x (2 + the parameter-sized tensors in the optimizer's state), counted after an untracked step", """
            def states_per_param(make_optimizer):
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                p = next(model.parameters())
                return 4.0 * (2 + sum(torch.is_tensor(t) and t.shape == p.shape for t in optimizer.state[p].values()))
            """),
        ("00-ex3", "a constant: the answer for one limit", """
            def largest_batch(limit):
                return 9
            """),
        ("00-ex3", "the batch scaled with the limit, as if the model states grew with it", """
            def largest_batch(limit):
                return int(BATCH * limit / mem.peak)
            """),
        ("00-ex3", "off by one: the first batch that does not fit", """
            def largest_batch(limit):
                batch = 1
                while lk.estimate(model.config, batch=batch, seq=SEQ, dtype="fp32", optimizer="adamw").total <= limit:
                    batch += 1
                return batch
            """),
        ("00-ex3", "the published 7B (PRESET) estimated instead of this run's model", """
            def largest_batch(limit):
                batch = 1
                while lk.estimate(PRESET, batch=batch + 1, seq=SEQ, dtype="fp32", optimizer="adamw").total <= limit:
                    batch += 1
                return batch
            """),
    ],
    "01": [
        ("01-ex2", "every save counted: a storage saved by several operations counted again", """
            def saved_bytes(model, ids):
                weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
                total = []
                def pack(t):
                    if t.untyped_storage().data_ptr() not in weights:
                        total.append(t.untyped_storage().nbytes())
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(total)
            """),
        ("01-ex2", "the weights a matmul saves counted as activations", """
            def saved_bytes(model, ids):
                saved = {}
                def pack(t):
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(saved.values())
            """),
        ("01-ex2", "the forward run under no_grad: autograd saves nothing", """
            def saved_bytes(model, ids):
                saved = {}
                def pack(t):
                    saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                    return t
                with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(saved.values())
            """),
        ("01-ex2", "lk.track's activations at the end of forward: labkit's count, not yours", """
            def saved_bytes(model, ids):
                with lk.track(model) as m:
                    out = model(input_ids=ids, use_cache=False)
                return m.at("forward end")["activations"]
            """),
        ("01-ex2", "saved storages keyed by the tensor's data_ptr(): views at an offset into one storage counted again", """
            def saved_bytes(model, ids):
                weights = {p.data_ptr() for p in model.parameters()}
                saved = {}

                def pack(t):
                    if t.data_ptr() not in weights:
                        saved[t.data_ptr()] = t.untyped_storage().nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(saved.values())
            """),
        ("01-ex2", "saves keyed by the tensor's data_ptr(), each at t.nbytes: Phi-3's v, a slice of the fused qkv", """
            def saved_bytes(model, ids):
                weights = {p.data_ptr() for p in model.parameters()}
                saved = {}

                def pack(t):
                    if t.data_ptr() not in weights:
                        saved[t.data_ptr()] = t.nbytes
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(saved.values())
            """),
        ("01-ex2", "each storage counted once but at the saved tensor's size (t.nbytes): a view smaller than its storage", """
            def saved_bytes(model, ids):
                weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
                saved = {}

                def pack(t):
                    if t.untyped_storage().data_ptr() not in weights:
                        saved[t.untyped_storage().data_ptr()] = t.nbytes
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                return sum(saved.values())
            """),
        ("01-ex2", "only floating-point saves counted: the int64 routing indices of a mixture of experts left out", """
            def saved_bytes(model, ids):
                weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
                saved = {}

                def pack(t):
                    s = t.untyped_storage()
                    if s.data_ptr() not in weights and t.dtype in (torch.float32, torch.bfloat16, torch.float16):
                        saved[s.data_ptr()] = s.nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = model(input_ids=ids, use_cache=False)
                del out
                return sum(saved.values())
            """),
        ("01-ex1", "autocast thought to copy every parameter but the embedding: the RMSNorm weights get a bf16 copy too", """
            def amp_state_bytes(model):
                states = sum(4 * p.numel() * p.element_size() for p in model.parameters())
                copies = sum(2 * p.numel() for n, p in model.named_parameters()
                             if "embed" not in n and p.dtype != torch.bfloat16)
                return states, copies
            """),
        ("01-ex1", "every parameter at 4 bytes, whatever its dtype (the bf16 MLPs counted as fp32); (states, copies)", """
            def amp_state_bytes(model):
                states = sum(4 * p.numel() * 4 for p in model.parameters())
                return states, sum(2 * m.weight.numel() for m in model.modules()
                                   if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16)
            """),
        ("01-ex1", "a constant 16 bytes per parameter (ZeRO's count), no copies; (states, copies)", """
            def amp_state_bytes(model):
                return 16 * sum(p.numel() for p in model.parameters()), 0
            """),
        ("01-ex1", "autocast's copies forgotten: the states alone; (states, copies)", """
            def amp_state_bytes(model):
                return sum(4 * p.numel() * p.element_size() for p in model.parameters()), 0
            """),
        ("01-ex1", "every parameter cast, not only the matmul (nn.Linear) weights; (states, copies)", """
            def amp_state_bytes(model):
                return (sum(4 * p.numel() * p.element_size() for p in model.parameters()),
                        sum(2 * p.numel() for p in model.parameters()))
            """),
        ("01-ex1", "a copy of every Linear weight, the bf16 ones too; (states, copies)", """
            def amp_state_bytes(model):
                states = sum(4 * p.numel() * p.element_size() for p in model.parameters())
                return states, sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
            """),
        ("01-ex1", "the copies counted in the weight's own dtype (4 bytes for an fp32 weight); (states, copies)", """
            def amp_state_bytes(model):
                states = sum(4 * p.numel() * p.element_size() for p in model.parameters())
                return states, sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                                   if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16)
            """),
        ("01-ex1", "off by one: weight, gradient and one moment (3 copies); (states, copies)", """
            def amp_state_bytes(model):
                states = sum(3 * p.numel() * p.element_size() for p in model.parameters())
                return states, sum(2 * m.weight.numel() for m in model.modules()
                                   if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16)
            """),
        ("01-ex1", "off by one: a fifth copy (fp32 master weights on top of fp32 weights); (states, copies)", """
            def amp_state_bytes(model):
                states = sum(5 * p.numel() * p.element_size() for p in model.parameters())
                return states, sum(2 * m.weight.numel() for m in model.modules()
                                   if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16)
            """),
        ("01-ex1", "the old interface: the sum states + copies, one number", """
            def amp_state_bytes(model):
                states = sum(4 * p.numel() * p.element_size() for p in model.parameters())
                return states + sum(2 * m.weight.numel() for m in model.modules()
                                    if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16)
            """),
    ],
    "02": [
        ("02-ex1", "gradients never unscaled before the step", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    finite = all(torch.isfinite(g).all() for g in grads)
                    if finite:
                        optimizer.step()
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex1", "the step taken even when a gradient overflowed", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = all(torch.isfinite(g).all() for g in grads)
                    optimizer.step()
                    if finite:
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex1", "the count of clean steps not reset after a backoff", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = all(torch.isfinite(g).all() for g in grads)
                    if finite:
                        optimizer.step()
                        self.clean += 1
                        if self.clean % self.interval == 0:
                            self.scale = self.scale * self.growth
                    else:
                        self.scale = self.scale * self.backoff
                    return finite
            """),
        ("02-ex1", "the scale grown one clean step late (the count checked before it is raised)", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = all(torch.isfinite(g).all() for g in grads)
                    if finite:
                        optimizer.step()
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                        self.clean += 1
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex2", "labkit.zero.DDP: fp32 masters, AdamW and the copy back, found in the library", """
            import tempfile
            import torch.distributed as dist
            from labkit.zero import DDP

            class MasterWeights:
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    if not dist.is_initialized():
                        dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
                    holder = torch.nn.Module()
                    holder.weights = torch.nn.ParameterList(self.params)
                    self.engine = DDP(holder, lr=lr, **adamw)
                    self.master = self.engine.master

                def step(self):
                    self.engine.step()

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex2", "fp32 master copies updated but never copied back into the bf16 weights", """
            class MasterWeights:
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    self.master = [p.detach().float() for p in self.params]
                    self.adamw = torch.optim.AdamW(self.master, lr=lr, **adamw)

                @torch.no_grad()
                def step(self):
                    for p, m in zip(self.params, self.master):
                        m.grad = p.grad.float()
                    self.adamw.step()

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex2", "master copies kept in bf16: the updates round away in them too", """
            class MasterWeights:
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    self.master = [p.detach().clone() for p in self.params]
                    self.adamw = torch.optim.AdamW(self.master, lr=lr, **adamw)

                @torch.no_grad()
                def step(self):
                    for p, m in zip(self.params, self.master):
                        m.grad = p.grad.clone()
                    self.adamw.step()
                    for p, m in zip(self.params, self.master):
                        p.copy_(m)

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex2", "AdamW stepped on the bf16 weights, the fp32 copies refreshed from them afterwards", """
            class MasterWeights:
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    self.master = [p.detach().float() for p in self.params]
                    self.adamw = torch.optim.AdamW(self.params, lr=lr, **adamw)

                @torch.no_grad()
                def step(self):
                    self.adamw.step()
                    for p, m in zip(self.params, self.master):
                        m.copy_(p)

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex2", "the masters' fp32 gradients kept after the step: 4 bytes per weight more", """
            class MasterWeights:
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    self.master = [p.detach().float() for p in self.params]
                    self.adamw = torch.optim.AdamW(self.master, lr=lr, **adamw)

                @torch.no_grad()
                def step(self):
                    for p, m in zip(self.params, self.master):
                        m.grad = p.grad.float()
                    self.adamw.step()
                    for p, m in zip(self.params, self.master):
                        p.copy_(m)

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex1", "an overflow detected by NaN only: a step whose gradients hold inf and no NaN is taken", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = not any(torch.isnan(g).any() for g in grads)
                    if finite:
                        optimizer.step()
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex1", "gradients zeroed on overflow and the step taken anyway: momentum and weight decay still move the weights", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = all(torch.isfinite(g).all() for g in grads)
                    if finite:
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        for g in grads:
                            g.zero_()
                        self.scale, self.clean = self.scale * self.backoff, 0
                    optimizer.step()
                    return finite
            """),
        ("02-ex2", "masters copied back before AdamW steps them: the bf16 weights stay one step behind", """
            class MasterWeights:
                \"\"\"AdamW for 16-bit weights through fp32 master copies (mixed precision's master weights).\"\"\"
                def __init__(self, params, lr, **adamw):
                    self.params = list(params)
                    self.master = [p.detach().float() for p in self.params]
                    self.adamw = torch.optim.AdamW(self.master, lr=lr, **adamw)

                @torch.no_grad()
                def step(self):
                    for p, m in zip(self.params, self.master):
                        m.grad = p.grad.float()
                        p.copy_(m)
                    self.adamw.step()
                    for m in self.master:
                        m.grad = None

                def zero_grad(self, set_to_none=True):
                    for p in self.params:
                        p.grad = None
            """),
        ("02-ex1", "a per-parameter skip: an overflowing parameter's gradient dropped and the others stepped", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    finite = True
                    for group in optimizer.param_groups:
                        for p in group["params"]:
                            if p.grad is None:
                                continue
                            p.grad.div_(self.scale)
                            if not torch.isfinite(p.grad).all():
                                p.grad, finite = None, False
                    optimizer.step()
                    if finite:
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex1", "overflow looked for in the first gradient only", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = bool(torch.isfinite(grads[0]).all())
                    if finite:
                        optimizer.step()
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
        ("02-ex1", "overflow looked for in the last gradient only", """
            class LossScaler:
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self.scale, self.growth, self.backoff, self.interval = scale, growth, backoff, interval
                    self.clean = 0

                def scale_loss(self, loss):
                    return loss * self.scale

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    for g in grads:
                        g.div_(self.scale)
                    finite = bool(torch.isfinite(grads[-1]).all())
                    if finite:
                        optimizer.step()
                        self.clean += 1
                        if self.clean == self.interval:
                            self.scale, self.clean = self.scale * self.growth, 0
                    else:
                        self.scale, self.clean = self.scale * self.backoff, 0
                    return finite
            """),
    ],
    "03": [
        ("03-ex1", "the graph kept from forward and reused: nothing recomputed, nothing saved", """
            class Recompute(torch.autograd.Function):
                @staticmethod
                def forward(ctx, fn, x):
                    ctx.save_for_backward(x)
                    with torch.enable_grad():
                        ctx.x = x.detach().requires_grad_(True)
                        ctx.y = fn(ctx.x)
                    return ctx.y.detach()

                @staticmethod
                def backward(ctx, grad_y):
                    torch.autograd.backward(ctx.y, grad_y)
                    return None, ctx.x.grad
            """),
        ("03-ex1", "backward takes the gradient of x alone: the weights get none", """
            class Recompute(torch.autograd.Function):
                @staticmethod
                def forward(ctx, fn, x):
                    ctx.fn = fn
                    ctx.save_for_backward(x)
                    with torch.no_grad():
                        return fn(x)

                @staticmethod
                def backward(ctx, grad_y):
                    (x,) = ctx.saved_tensors
                    x = x.detach().requires_grad_(True)
                    with torch.enable_grad():
                        y = ctx.fn(x)
                    (grad_x,) = torch.autograd.grad(y, x, grad_y)
                    return None, grad_x
            """),
        ("03-ex2", "the model returned unchanged", """
            def checkpoint_mlps(model):
                return model
            """),
        ("03-ex2", "the whole decoder layer checkpointed, not its MLP", """
            def checkpoint_mlps(model):
                class Checkpointed(torch.nn.Module):
                    def __init__(self, layer):
                        super().__init__()
                        self.layer = layer

                    def forward(self, *args, **kwargs):
                        return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)

                model.model.layers = torch.nn.ModuleList(Checkpointed(layer) for layer in model.model.layers)
                return model
            """),
        ("03-ex2", "reentrant checkpointing: no early stop, down_proj recomputed too", """
            def checkpoint_mlps(model):
                class CheckpointedMLP(torch.nn.Module):
                    def __init__(self, mlp):
                        super().__init__()
                        self.mlp = mlp

                    def forward(self, x):
                        return checkpoint(self.mlp, x, use_reentrant=True)

                for layer in model.model.layers:
                    layer.mlp = CheckpointedMLP(layer.mlp)
                return model
            """),
        ("03-ex2", "gate_proj and up_proj checkpointed one by one: their outputs are still kept", """
            def checkpoint_mlps(model):
                class Checkpointed(torch.nn.Module):
                    def __init__(self, linear):
                        super().__init__()
                        self.linear = linear

                    def forward(self, x):
                        return checkpoint(self.linear, x, use_reentrant=False)

                for layer in model.model.layers:
                    layer.mlp.gate_proj = Checkpointed(layer.mlp.gate_proj)
                    layer.mlp.up_proj = Checkpointed(layer.mlp.up_proj)
                return model
            """),
        ("03-ex1", "the weights' gradients taken with autograd.grad and assigned: .grad overwritten, not accumulated (breaks gradient accumulation and shared weights)", """
            class Recompute(torch.autograd.Function):
                @staticmethod
                def forward(ctx, fn, x):
                    ctx.fn = fn
                    ctx.save_for_backward(x)
                    with torch.no_grad():
                        return fn(x)

                @staticmethod
                def backward(ctx, grad_y):
                    (x,) = ctx.saved_tensors
                    x = x.detach().requires_grad_(True)
                    params = list(ctx.fn.parameters())
                    with torch.enable_grad():
                        y = ctx.fn(x)
                    grads = torch.autograd.grad(y, [x] + params, grad_y)
                    for p, g in zip(params, grads[1:]):
                        p.grad = g
                    return None, grads[0]
            """),
        ("03-ex2", "the post-attention norm checkpointed with the MLP: more than the MLP's four tensors no longer kept", """
            def checkpoint_mlps(model):
                class NormAndMLP(torch.nn.Module):
                    def __init__(self, norm, mlp):
                        super().__init__()
                        self.norm, self.mlp = norm, mlp

                    def forward(self, x):
                        return checkpoint(lambda t: self.mlp(self.norm(t)), x, use_reentrant=False)

                for layer in model.model.layers:
                    layer.mlp = NormAndMLP(layer.post_attention_layernorm, layer.mlp)
                    layer.post_attention_layernorm = torch.nn.Identity()
                return model
            """),
        ("03-ex1", "recomputes on the saved x without detaching it: the nested backward runs through the graph before x (fills a leaf's .grad, but with a residual path fails 'backward through the graph a second time')", """
            class Recompute(torch.autograd.Function):
                @staticmethod
                def forward(ctx, fn, x):
                    ctx.fn = fn
                    ctx.save_for_backward(x)
                    with torch.no_grad():
                        return fn(x)

                @staticmethod
                def backward(ctx, grad_y):
                    (x,) = ctx.saved_tensors
                    with torch.enable_grad():
                        y = ctx.fn(x)
                    torch.autograd.backward(y, grad_y)
                    return None, None
            """),
        ("03-ex1", "recomputes on the saved x without detaching, retain_graph=True as PyTorch's error suggests: the nested backward runs the whole graph before x (every earlier layer) once per checkpointed layer", """
            class Recompute(torch.autograd.Function):
                @staticmethod
                def forward(ctx, fn, x):
                    ctx.fn = fn
                    ctx.save_for_backward(x)
                    with torch.no_grad():
                        return fn(x)

                @staticmethod
                def backward(ctx, grad_y):
                    (x,) = ctx.saved_tensors
                    with torch.enable_grad():
                        y = ctx.fn(x)
                    torch.autograd.backward(y, grad_y, retain_graph=True)
                    return None, None
            """),
    ],
    "04": [
        ("04-ex1", "every saved tensor to bf16, no rules: integer labels come back as floats", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes = weights, min_bytes

                def pack(self, t):
                    return (t.to(torch.bfloat16),)

                def unpack(self, packed):
                    return packed[0].float()
            """),
        ("04-ex1", "the rules but no sharing: a tensor saved by several ops is compressed once per op", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes = weights, min_bytes

                def pack(self, t):
                    if t.dtype != torch.float32 or t.nbytes < self.min_bytes or t.untyped_storage().data_ptr() in self.weights:
                        return t
                    return (t.to(torch.bfloat16),)

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "the weights compressed too: backward multiplies by rounded weights", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    if t.dtype != torch.float32 or t.nbytes < self.min_bytes:
                        return t
                    key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    if key not in self.packed:
                        self.packed[key] = (t.to(torch.bfloat16),)
                    return self.packed[key]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "hooks that compress nothing (a copy that saves nothing)", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    pass

                def pack(self, t):
                    return t.clone()

                def unpack(self, packed):
                    return packed
            """),
        ("04-ex1", "the bf16 copy packed and the fp32 tensor kept beside it", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    if t.dtype != torch.float32 or t.nbytes < self.min_bytes or t.untyped_storage().data_ptr() in self.weights:
                        return t
                    key = (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    if key not in self.packed:
                        self.packed[key] = (t.to(torch.bfloat16), t)
                    return self.packed[key]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "fp16 instead of bf16", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or t.nbytes < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.half(),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "copies shared by data pointer alone: two views of one storage get one copy", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    if t.dtype != torch.float32 or t.nbytes < self.min_bytes or t.untyped_storage().data_ptr() in self.weights:
                        return t
                    if t.data_ptr() not in self.packed:
                        self.packed[t.data_ptr()] = (t.to(torch.bfloat16),)
                    return self.packed[t.data_ptr()]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "the min_bytes rule left out: small tensors compressed too (issue 37 reader)", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex2", "a file of zeros the right size, the values kept in memory", """
            import os, uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                np.zeros(t.numel(), dtype=np.float32).tofile(path)
                return path, t.detach().cpu().numpy().copy(), t.shape

            def unpack_from_disk(packed):
                path, values, shape = packed
                os.remove(path)
                return torch.from_numpy(values).view(shape)
            """),
        ("04-ex2", "the right file, but unpack reads a copy kept in numpy", """
            import os, uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                values = t.detach().cpu().numpy().copy()
                values.tofile(path)
                return path, values, t.shape

            def unpack_from_disk(packed):
                path, values, shape = packed
                os.remove(path)
                return torch.from_numpy(values).view(shape)
            """),
        ("04-ex2", "the file written, the tensor itself kept", """
            import os, uuid

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                t.detach().cpu().numpy().tofile(path)
                return path, t

            def unpack_from_disk(packed):
                path, t = packed
                os.remove(path)
                return t
            """),
        ("04-ex2", "the values read back, the file never deleted", """
            import uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                t.detach().cpu().numpy().tofile(path)
                return path, t.shape

            def unpack_from_disk(packed):
                path, shape = packed
                return torch.from_numpy(np.fromfile(path, dtype=np.float32)).view(shape)
            """),
        ("04-ex2", "the values written, and a numpy view of the tensor (torch's own memory) kept for unpack", """
            import os, uuid

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                values = t.detach().cpu().numpy()
                values.tofile(path)
                return path, values

            def unpack_from_disk(packed):
                path, values = packed
                os.remove(path)
                return torch.from_numpy(values)
            """),
        ("04-ex2", "read back with numpy's default dtype (float64)", """
            import os, uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                t.detach().cpu().numpy().tofile(path)
                return path, t.shape

            def unpack_from_disk(packed):
                path, shape = packed
                values = torch.from_numpy(np.fromfile(path))
                os.remove(path)
                return values.view(shape)
            """),
        ("04-ex2", "read back flat: the shape never restored", """
            import os, uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                t.detach().cpu().numpy().tofile(path)
                return path

            def unpack_from_disk(path):
                values = torch.from_numpy(np.fromfile(path, dtype=np.float32))
                os.remove(path)
                return values
            """),
        ("04-ex1", "any float dtype compressed (fp64, fp16 and bf16 too), not only fp32", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if not t.is_floating_point() or t.numel() * t.element_size() < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "min_bytes compared with the number of elements, not bytes", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or t.numel() < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "the storage offset left out of the key: two same-shaped views of one storage share a copy", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or t.numel() * t.element_size() < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex2", "unpack reads every file as float32 and gives it back on the CPU: dtype and device lost", """
            import os
            import uuid
            import numpy as np

            def pack_to_disk(t, folder):
                path = folder / f"{uuid.uuid4().hex}.bin"
                t.detach().cpu().numpy().tofile(path)
                return path, t.shape

            def unpack_from_disk(packed):
                path, shape = packed
                values = torch.from_numpy(np.fromfile(path, dtype=np.float32)).view(shape)
                os.remove(path)
                return values
            """),
        ("04-ex1", "the bf16 copy returned unwrapped, and unpack turns every bf16 tensor into fp32: a kept bf16 tensor comes back as fp32", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or t.numel() * t.element_size() < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), t.to(torch.bfloat16))
                    return hit[1]

                def unpack(self, packed):
                    return packed.float() if packed.dtype == torch.bfloat16 else packed
            """),
        ("04-ex1", "a tensor of exactly min_bytes bytes kept (<= instead of <): only smaller ones stay", """
            import weakref

            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or t.numel() * t.element_size() <= self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
        ("04-ex1", "min_bytes measured on the whole storage, not the tensor: a small view of a large storage is compressed", """
            class Bf16Hooks:
                def __init__(self, weights, min_bytes=1024):
                    self.weights, self.min_bytes, self.packed = weights, min_bytes, {}

                def pack(self, t):
                    import weakref
                    st = t.untyped_storage()
                    if t.dtype != torch.float32 or st.nbytes() < self.min_bytes or st.data_ptr() in self.weights:
                        return t
                    key = (id(st), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                    hit = self.packed.get(key)
                    if hit is None or hit[0]() is not st:
                        hit = self.packed[key] = (weakref.ref(st), (t.to(torch.bfloat16),))
                    return hit[1]

                def unpack(self, packed):
                    return packed if isinstance(packed, torch.Tensor) else packed[0].float()
            """),
    ],
    "05": [
        ("05-ex1", "the smallest block that fits, the max_split_size rules left out", """
            def my_best_fit(free_blocks, size, max_split=None):
                fits = [b for b in free_blocks if b[0] >= size]
                return min(fits) if fits else None
            """),
        ("05-ex1", "first fit: the first block in the list that is large enough", """
            def my_best_fit(free_blocks, size, max_split=None):
                return next((b for b in free_blocks if b[0] >= size), None)
            """),
        ("05-ex1", "oversize blocks kept from small requests, but no limit on how much larger a big request's block may be", """
            def my_best_fit(free_blocks, size, max_split=None):
                fits = [b for b in free_blocks if b[0] >= size]
                if not fits:
                    return None
                best = min(fits)
                if max_split is not None and size < max_split and best[0] >= max_split:
                    return None
                return best
            """),
        ("05-ex1", "equal sizes taken in the list's order, not by the lowest address", """
            def my_best_fit(free_blocks, size, max_split=None):
                fits = [b for b in free_blocks if b[0] >= size]
                if not fits:
                    return None
                best = min(fits, key=lambda b: b[0])
                if max_split is not None:
                    if size < max_split and best[0] >= max_split:
                        return None
                    if size >= max_split and best[0] >= size + 20 * MiB:
                        return None
                return best
            """),
        ("05-ex1", "a large request takes a block exactly max_non_split_rounding larger (> for >=)", """
            def my_best_fit(free_blocks, size, max_split=None):
                fits = [b for b in free_blocks if b[0] >= size]
                if not fits:
                    return None
                best = min(fits)
                if max_split is not None:
                    if size < max_split and best[0] >= max_split:
                        return None
                    if size >= max_split and best[0] > size + 20 * MiB:
                        return None
                return best
            """),
        ("05-ex2", "every size rounded to a multiple of 512, the divisions ignored", """
            def my_round_size(size, divisions):
                return max(512, -(-size // 512) * 512)
            """),
        ("05-ex2", "every size rounded up to the next power of two", """
            def my_round_size(size, divisions):
                return max(512, 1 << (size - 1).bit_length())
            """),
        ("05-ex2", "divisions applied to every size, small ones too", """
            def my_round_size(size, divisions):
                if size < 512:
                    return 512
                if divisions > 1:
                    floor = 1 << (size.bit_length() - 1)
                    if floor == size:
                        return size
                    step = max(1, floor // divisions)
                    return -(-size // step) * step
                return -(-size // 512) * 512
            """),
        ("05-ex2", "divisions used without checking there are more than one (0 divisions divides by zero)", """
            def my_round_size(size, divisions):
                if size < 512:
                    return 512
                if size > 512 * divisions:
                    floor = 1 << (size.bit_length() - 1)
                    if floor == size:
                        return size
                    step = floor // divisions
                    return -(-size // step) * step
                return -(-size // 512) * 512
            """),
        ("05-ex2", "one step too far: (size // step + 1) * step, wrong where the size is an exact multiple of a step (issue 37 reader)", """
            def my_round_size(size, divisions):
                if size < 512:
                    return 512
                if divisions > 1 and size > 512 * divisions:
                    floor = 1 << (size.bit_length() - 1)
                    if floor == size:
                        return size
                    step = floor // divisions
                    return (size // step + 1) * step
                return -(-size // 512) * 512
            """),
        ("05-ex1", "max_non_split_rounding typed as 20_000_000 bytes (19.07 MiB), not 20 << 20", """
            def my_best_fit(free_blocks, size, max_split=None):
                fits = [b for b in free_blocks if b[0] >= size]
                if not fits:
                    return None
                best = min(fits)
                if max_split is not None:
                    if size < max_split and best[0] >= max_split:
                        return None
                    if size >= max_split and best[0] >= size + 20_000_000:
                        return None
                return best
            """),
    ],
    "06": [
        ("06-ex1", "the two codes of a byte in the wrong order (the first in the low nibble)", """
            def nf4_quantize(w, block=BLOCK):
                x = w.reshape(-1, block).float()
                absmax = x.abs().amax(dim=1)
                codes = (x[..., None] / absmax[:, None, None] - NF4).abs().argmin(-1).flatten().to(torch.uint8)
                return codes[0::2] | (codes[1::2] << 4), absmax
            """),
        ("06-ex1", "one absmax for the whole tensor instead of one per block", """
            def nf4_quantize(w, block=BLOCK):
                x = w.reshape(-1, block).float()
                absmax = x.abs().max().expand(x.shape[0]).clone()
                codes = (x[..., None] / absmax[:, None, None] - NF4).abs().argmin(-1).flatten().to(torch.uint8)
                return (codes[0::2] << 4) | codes[1::2], absmax
            """),
        ("06-ex1", "uniform 4-bit codes (16 even steps over [-1, 1]), not the nearest NF4 level", """
            def nf4_quantize(w, block=BLOCK):
                x = w.reshape(-1, block).float()
                absmax = x.abs().amax(dim=1)
                codes = torch.round((x / absmax[:, None] + 1) * 7.5).flatten().to(torch.uint8)
                return (codes[0::2] << 4) | codes[1::2], absmax
            """),
        ("06-ex2", "no second scale: the absmax rounded to 127 levels of [0, 1] as if they never exceeded 1", """
            def double_quant(absmax, block=256):
                return torch.round(127 * absmax).clamp(-127, 127).to(torch.int8), torch.ones(absmax.numel() // block)

            def double_dequant(codes, scales, block=256):
                return codes.float() / 127
            """),
        ("06-ex2", "blocks of 64 absmax, not 256: four times the fp32 scales", """
            def double_quant(absmax, block=64):
                x = absmax.reshape(-1, block)
                scales = x.abs().amax(dim=1)
                return torch.round(127 * x / scales[:, None]).to(torch.int8).flatten(), scales

            def double_dequant(codes, scales, block=64):
                return (codes.reshape(-1, block).float() / 127 * scales[:, None]).flatten()
            """),
        ("06-ex2", "one scale for all the absmax (per tensor), not one per block of 256", """
            def double_quant(absmax, block=256):
                scale = absmax.abs().max()
                return torch.round(127 * absmax / scale).to(torch.int8), scale.reshape(1)

            def double_dequant(codes, scales, block=256):
                return codes.float() / 127 * scales
            """),
        ("06-ex2", "one scale per tensor, repeated for every block of 256 (the bytes right, the scales not)", """
            def double_quant(absmax, block=256):
                scale = absmax.abs().max()
                return torch.round(127 * absmax / scale).to(torch.int8), scale.repeat(absmax.numel() // block)

            def double_dequant(codes, scales, block=256):
                return (codes.reshape(-1, block).float() / 127 * scales[:, None]).flatten()
            """),
        ("06-ex1", "a constant: every code 0, the right scales", """
            def nf4_quantize(w, block=BLOCK):
                x = w.reshape(-1, block).float()
                return torch.zeros(w.numel() // 2, dtype=torch.uint8), x.abs().amax(dim=1)
            """),
        ("06-ex1", "the block's signed maximum as its scale (abs forgotten)", """
            def nf4_quantize(w, block=BLOCK):
                x = w.reshape(-1, block).float()
                absmax = x.amax(dim=1)
                codes = (x[..., None] / absmax[:, None, None] - NF4).abs().argmin(-1).flatten().to(torch.uint8)
                return (codes[0::2] << 4) | codes[1::2], absmax
            """),
        ("06-ex2", "the absmax kept in fp32 as their own codes: no double quantization (4.5 bits)", """
            def double_quant(absmax, block=256):
                return absmax.clone(), absmax.reshape(-1, block).abs().amax(dim=1)

            def double_dequant(codes, scales, block=256):
                return codes
            """),
        ("06-ex2", "a constant: every code 0, the right scales", """
            def double_quant(absmax, block=256):
                return torch.zeros(absmax.numel(), dtype=torch.int8), absmax.reshape(-1, block).abs().amax(dim=1)

            def double_dequant(codes, scales, block=256):
                return (codes.reshape(-1, block).float() / 127 * scales[:, None]).flatten()
            """),
        ("06-ex2", "rounded toward zero (trunc), not to the nearest level", """
            def double_quant(absmax, block=256):
                x = absmax.reshape(-1, block)
                scales = x.abs().amax(dim=1)
                return (127 * x / scales[:, None]).to(torch.int8).flatten(), scales

            def double_dequant(codes, scales, block=256):
                return (codes.reshape(-1, block).float() / 127 * scales[:, None]).flatten()
            """),
        ("06-ex2", "decoded without the 1/127: codes times scales", """
            def double_quant(absmax, block=256):
                x = absmax.reshape(-1, block)
                scales = x.abs().amax(dim=1)
                return torch.round(127 * x / scales[:, None]).to(torch.int8).flatten(), scales

            def double_dequant(codes, scales, block=256):
                return (codes.reshape(-1, block).float() * scales[:, None]).flatten()
            """),
        ("06-ex2", "the scales kept in bf16: 16 bits per 256 absmax, not the fp32 bitsandbytes stores", """
            def double_quant(absmax, block=256):
                x = absmax.reshape(-1, block)
                scales = x.abs().amax(dim=1)
                return torch.round(127 * x / scales[:, None]).to(torch.int8).flatten(), scales.bfloat16()

            def double_dequant(codes, scales, block=256):
                return (codes.reshape(-1, block).float() / 127 * scales[:, None].float()).flatten()
            """),
        ("06-ex3", "the two codes of a byte decoded in the wrong order (low nibble first)", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed & 0xF, self.packed >> 4], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the adapter's alpha / rank scale forgotten", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + x @ self.A.T @ self.B.T
            """),
        ("06-ex3", "the scale alpha, not alpha / rank", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale * self.A.shape[0]
            """),
        ("06-ex3", "B initialised at random like A: the layer does not start as its base", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))
                    self.B = torch.nn.Parameter(torch.randn(shape[0], rank) / math.sqrt(rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the base forgotten: the adapter alone", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    return (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "one absmax for the whole weight instead of one per block", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes] * self.absmax.max()).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the decoded weight made a trainable Parameter: the base gets a gradient", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    codes = torch.stack([packed.flatten() >> 4, packed.flatten() & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * absmax.flatten()[:, None]).reshape(shape)
                    self.weight = torch.nn.Parameter(w)
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    return x @ self.weight.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "decoded once and kept as a frozen Parameter: a copy that saves nothing, no buffer counted", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    codes = torch.stack([packed.flatten() >> 4, packed.flatten() & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * absmax.flatten()[:, None]).reshape(shape)
                    self.weight = torch.nn.Parameter(w, requires_grad=False)
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    return x @ self.weight.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the 4-bit bytes kept, and a decoded copy too, in a list attribute", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    self.cache = [(NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(shape)]
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    return x @ self.cache[0].T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "decoded at the first forward and cached for the next ones", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale, self.w = tuple(shape), alpha / rank, None
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    if self.w is None:
                        codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                        self.w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ self.w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "decoded once into an fp32 buffer: a copy that saves nothing", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    codes = torch.stack([packed.flatten() >> 4, packed.flatten() & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * absmax.flatten()[:, None]).reshape(shape)
                    self.register_buffer("weight", w)
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    return x @ self.weight.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "A initialised with zeros like B: neither factor gets a gradient, the adapter never trains", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.zeros(rank, shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "alpha // rank (integer division): rank 64, alpha 16 gives a scale of 0", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha // rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the 4-bit bytes and absmax kept as plain attributes: state_dict() loses the base, .to() leaves it behind", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.packed, self.absmax = packed.flatten(), absmax.flatten()
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "the bytes a buffer but the absmax a plain attribute: state_dict() loses the scales", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.absmax = absmax.flatten()
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
        ("06-ex3", "A drawn at unit variance, not with a standard deviation of order 1/sqrt(in) as the text asks", """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):
                    codes = torch.stack([self.packed >> 4, self.packed & 0xF], dim=-1).flatten().long()
                    w = (NF4[codes].reshape(-1, BLOCK) * self.absmax[:, None]).reshape(self.shape)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
    ],
    "07": [
        ("07-ex1", "each block hashed alone, without the hash before it", """
            def my_block_hashes(token_ids, block_size):
                return [hash(tuple(token_ids[i:i + block_size]))
                        for i in range(0, len(token_ids) - block_size + 1, block_size)]
            """),
        ("07-ex1", "the partly filled last block hashed too", """
            def my_block_hashes(token_ids, block_size):
                hashes, previous = [], None
                for start in range(0, len(token_ids), block_size):
                    previous = hash((previous, tuple(token_ids[start:start + block_size])))
                    hashes.append(previous)
                return hashes
            """),
        ("07-ex2", "NOW whenever the blocks are free: the watermark ignored", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                if need > total_blocks:
                    return NEVER
                return NOW if need <= free_blocks else LATER
            """),
        ("07-ex2", "NEVER judged by the free blocks instead of the whole pool", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                if free_blocks - need >= watermark_blocks:
                    return NOW
                return NEVER
            """),
        ("07-ex3", "at most one new block per call", """
            def my_append(allocator, table, length, count):
                if count and length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex3", "new blocks for the count alone, the room left in the last block ignored", """
            def my_append(allocator, table, length, count):
                for _ in range(-(-count // allocator.block_size)):
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex4", "a copy of every partly filled last block, shared or not", """
            def my_write_token(allocator, table, length, copies):
                if length % allocator.block_size:
                    fresh = allocator.allocate()
                    copies.append((table[-1], fresh))
                    allocator.free(table[-1])
                    table[-1] = fresh
                else:
                    table.append(allocator.allocate())
                return length + 1
            """),
        ("07-ex4", "the copy made, the shared block's reference never given back", """
            def my_write_token(allocator, table, length, copies):
                if length % allocator.block_size and allocator.ref_count[table[-1]] > 1:
                    fresh = allocator.allocate()
                    copies.append((table[-1], fresh))
                    table[-1] = fresh
                elif length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                return length + 1
            """),
        ("07-ex1", "the whole prefix's tokens hashed for each block, no chain of hashes", """
            def my_block_hashes(token_ids, block_size):
                return [hash(tuple(token_ids[:end]))
                        for end in range(block_size, len(token_ids) + 1, block_size)]
            """),
        ("07-ex1", "off by one: a prompt of whole blocks loses its last block", """
            def my_block_hashes(token_ids, block_size):
                hashes, previous = [], None
                for start in range(0, len(token_ids) - block_size, block_size):
                    previous = hash((previous, tuple(token_ids[start:start + block_size])))
                    hashes.append(previous)
                return hashes
            """),
        ("07-ex2", "> instead of >=: a request that leaves exactly the watermark free waits", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                if total_blocks - need < watermark_blocks:
                    return NEVER
                return NOW if free_blocks - need > watermark_blocks else LATER
            """),
        ("07-ex2", "<= instead of <: a request that fits the empty pool with exactly the watermark left is NEVER", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                if total_blocks - need <= watermark_blocks:
                    return NEVER
                return NOW if free_blocks - need >= watermark_blocks else LATER
            """),
        ("07-ex2", "never NEVER: a request larger than the pool waits forever", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                return NOW if free_blocks - need >= watermark_blocks else LATER
            """),
        ("07-ex2", "NOW judged by the whole pool instead of the free blocks", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                if total_blocks - need < watermark_blocks:
                    return NEVER
                return NOW if total_blocks - need >= watermark_blocks else LATER
            """),
        ("07-ex3", "one block per token", """
            def my_append(allocator, table, length, count):
                for _ in range(count):
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex3", "a new block when the last one is exactly full but nothing is written to it yet (<=)", """
            def my_append(allocator, table, length, count):
                while len(table) * allocator.block_size <= length + count:
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex3", "not all or nothing: blocks taken one by one until the pool runs dry", """
            def my_append(allocator, table, length, count):
                while len(table) * allocator.block_size < length + count:
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex3", "off by one: OutOfBlocks when the request needs exactly the free blocks", """
            def my_append(allocator, table, length, count):
                need = -(-(length + count) // allocator.block_size) - len(table)
                if need > 0 and need >= allocator.num_free:
                    raise OutOfBlocks(f"{need} blocks needed, {allocator.num_free} are free")
                for _ in range(need):
                    table.append(allocator.allocate())
                return length + count
            """),
        ("07-ex4", "a shared last block copied even when it is full (a new block was due)", """
            def my_write_token(allocator, table, length, copies):
                if table and allocator.ref_count[table[-1]] > 1:
                    fresh = allocator.allocate()
                    copies.append((table[-1], fresh))
                    allocator.free(table[-1])
                    table[-1] = fresh
                elif length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                return length + 1
            """),
        ("07-ex4", "a private block taken, the copy never handed to the engine: the values are lost", """
            def my_write_token(allocator, table, length, copies):
                if length % allocator.block_size and allocator.ref_count[table[-1]] > 1:
                    fresh = allocator.allocate()
                    allocator.free(table[-1])
                    table[-1] = fresh
                elif length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                return length + 1
            """),
        ("07-ex4", "shared means exactly two owners: a block three sequences hold is written in place", """
            def my_write_token(allocator, table, length, copies):
                if length % allocator.block_size and allocator.ref_count[table[-1]] == 2:
                    fresh = allocator.allocate()
                    copies.append((table[-1], fresh))
                    allocator.free(table[-1])
                    table[-1] = fresh
                elif length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                return length + 1
            """),
        ("07-ex4", "every shared block of the table copied, not only the last one written into", """
            def my_write_token(allocator, table, length, copies):
                if length % allocator.block_size == 0:
                    table.append(allocator.allocate())
                for i, block in enumerate(table):
                    if allocator.ref_count[block] > 1:
                        fresh = allocator.allocate()
                        copies.append((block, fresh))
                        allocator.free(block)
                        table[i] = fresh
                return length + 1
            """),
        ("07-ex2", "a request needing no new block admitted NOW even when fewer blocks than the watermark are free", """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                \"\"\"NOW, LATER or NEVER for a request needing `need` new blocks, keeping `watermark_blocks` free.\"\"\"
                if need == 0:
                    return NOW
                if total_blocks - need < watermark_blocks:
                    return NEVER
                if free_blocks - need >= watermark_blocks:
                    return NOW
                return LATER
            """),
        ("07-ex3", "blocks taken straight off the free list keep reference count 0: the pool thinks they are free to share or free", """
            def my_append(allocator, table, length, count):
                need = -(-(length + count) // allocator.block_size) - len(table)
                if need > len(allocator.free_list):
                    raise OutOfBlocks("out")
                for _ in range(need):
                    table.append(allocator.free_list.pop())
                return length + count
            """),
    ],
    "08": [
        ("08-ex1", "the running sum and accumulator not rescaled when the maximum grows", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, i + block, block):
                        kb, vb = k[..., j:j + block, :].float(), v[..., j:j + block, :].float()
                        s = (qi @ kb.transpose(-1, -2)) * scale
                        cols = torch.arange(j, j + kb.shape[-2], device=q.device)
                        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                        m = torch.maximum(m, s.amax(-1))
                        p = torch.exp(s - m[..., None])
                        l, acc = l + p.sum(-1), acc + p @ vb
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex1", "the diagonal masked too: query i attends to keys j < i", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, i + block, block):
                        kb, vb = k[..., j:j + block, :].float(), v[..., j:j + block, :].float()
                        s = (qi @ kb.transpose(-1, -2)) * scale
                        cols = torch.arange(j, j + kb.shape[-2], device=q.device)
                        s = s.masked_fill(cols[None, :] >= rows[:, None], float("-inf"))
                        m_new = torch.maximum(m, s.amax(-1))
                        p = torch.exp(s - m_new[..., None])
                        alpha = torch.exp(m - m_new)
                        l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ vb, m_new
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex2", "D = rowsum(dO), O left out", """
            def attention_backward(q, k, v, o, lse, do):
                scale = 1 / math.sqrt(q.shape[-1])
                p = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])
                dv = p.transpose(-1, -2) @ do
                dp = do @ v.transpose(-1, -2)
                ds = p * (dp - do.sum(-1, keepdim=True))
                return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv
            """),
        ("08-ex2", "the scale left out of dq and dk", """
            def attention_backward(q, k, v, o, lse, do):
                scale = 1 / math.sqrt(q.shape[-1])
                p = torch.exp(q @ k.transpose(-1, -2) * scale - lse[..., None])
                dv = p.transpose(-1, -2) @ do
                ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
                return ds @ k, ds.transpose(-1, -2) @ q, dv
            """),
        ("08-ex3", "the splits' outputs averaged, without their log-sum-exp weights", """
            def combine(o_parts, lse_parts):
                return o_parts.mean(-2)
            """),
        ("08-ex3", "each split weighted by exp(lse) without dividing by their sum", """
            def combine(o_parts, lse_parts):
                return (torch.exp(lse_parts)[..., None] * o_parts).sum(-2)
            """),
        ("08-ex1", "no running maximum: exp(s) summed as it is, inf once a score passes 88 (REVIEW8)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, i + block, block):
                        kb, vb = k[..., j:j + block, :].float(), v[..., j:j + block, :].float()
                        s = (qi @ kb.transpose(-1, -2)) * scale
                        cols = torch.arange(j, j + kb.shape[-2], device=q.device)
                        p = torch.exp(s.masked_fill(cols[None, :] > rows[:, None], float("-inf")))
                        l, acc = l + p.sum(-1), acc + p @ vb
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex2", "P from a softmax written out by hand: the log-sum-exp the forward saved never read (REVIEW8)", """
            def attention_backward(q, k, v, o, lse, do):
                scale = 1 / math.sqrt(q.shape[-1])
                s = q @ k.transpose(-1, -2) * scale
                e = torch.exp(s - s.amax(-1, keepdim=True))
                p = e / e.sum(-1, keepdim=True)
                dv = p.transpose(-1, -2) @ do
                ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
                return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv
            """),
        ("08-ex3", "the formula written literally, L = log(sum(exp(lse))): inf once an lse passes 88 (REVIEW8)", """
            def combine(o_parts, lse_parts):
                total = torch.log(torch.exp(lse_parts).sum(-1))
                return (torch.exp(lse_parts - total[..., None])[..., None] * o_parts).sum(-2)
            """),
        ("08-ex1", "chunks of queries each scored against all keys, exact row max and sum, P @ V over key tiles: no online softmax (reader's probe)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = []
                for i in range(0, N, block):
                    s = (q[..., i:i+block, :] @ k.transpose(-1, -2)) * scale
                    rows = torch.arange(i, min(i + block, N))[:, None]
                    s = s.masked_fill(torch.arange(N)[None, :] > rows, float("-inf"))
                    p = torch.exp(s - s.amax(-1, keepdim=True)); l = p.sum(-1, keepdim=True)
                    o = sum(p[..., :, j:j+block] @ v[..., j:j+block, :] for j in range(0, N, block))
                    out.append(o / l)
                return torch.cat(out, -2)
            """),
        ("08-ex1", "every query against every key tile, masked: the tiles above the diagonal computed for nothing", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                rows = torch.arange(N, device=q.device)
                m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
                l = torch.zeros(q.shape[:-1], device=q.device)
                acc = torch.zeros(q.shape, device=q.device)
                for start in range(0, N, block):
                    kb, vb = k[..., start:start + block, :].float(), v[..., start:start + block, :].float()
                    s = (q.float() @ kb.transpose(-1, -2)) * scale
                    cols = torch.arange(start, start + kb.shape[-2], device=q.device)
                    s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                    m_new = torch.maximum(m, s.amax(-1))
                    p = torch.exp(s - m_new[..., None])
                    alpha = torch.exp(m - m_new)
                    l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ vb, m_new
                return (acc / l[..., None]).to(q.dtype)
            """),
        ("08-ex1", "each tile's masked scores joined into a block x N strip, max and sum taken over it whole: no online softmax (issue 37 reader)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    tiles = []
                    for j in range(0, i + block, block):
                        s = (qi @ k[..., j:j + block, :].float().transpose(-1, -2)) * scale
                        cols = torch.arange(j, min(j + block, N), device=q.device)
                        tiles.append(s.masked_fill(cols[None, :] > rows[:, None], float("-inf")))
                    s = torch.cat(tiles, -1)
                    p = torch.exp(s - s.amax(-1, keepdim=True))
                    acc = sum(p[..., j:j + block] @ v[..., j:j + block, :].float() for j in range(0, s.shape[-1], block))
                    out[..., i:i + block, :] = acc / p.sum(-1)[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex3", "torch.softmax over the log-sum-exps, then a weighted sum: the max-subtraction left to softmax (issue 37 reader)", """
            def combine(o_parts, lse_parts):
                return (torch.softmax(lse_parts, dim=-1)[..., None] * o_parts).sum(-2)
            """),
        ("08-ex3", "weights from logsumexp: exp(lse - logsumexp(lse)), the max-subtraction left to logsumexp", """
            def combine(o_parts, lse_parts):
                return (torch.exp(lse_parts - lse_parts.logsumexp(-1, keepdim=True))[..., None] * o_parts).sum(-2)
            """),
        ("08-ex1", "the running max started at 0 instead of -inf: NaN once every score of a row is below about -104 (issue 37 reader)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    m = torch.zeros(qi.shape[:-1], device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, i + block, block):
                        kb, vb = k[..., j:j + block, :].float(), v[..., j:j + block, :].float()
                        s = (qi @ kb.transpose(-1, -2)) * scale
                        cols = torch.arange(j, j + kb.shape[-2], device=q.device)
                        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                        m_new = torch.maximum(m, s.amax(-1))
                        p = torch.exp(s - m_new[..., None])
                        alpha = torch.exp(m - m_new)
                        l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ vb, m_new
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex1", "two key tiles' scores joined into a block x 2 block strip before each update: an operation wider than a tile (passed at block = 32 = d / 2; issue 37 reader)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, i + block, 2 * block):
                        starts = [jj for jj in (j, j + block) if jj < min(i + block, N)]
                        tiles = []
                        for jj in starts:
                            s = (qi @ k[..., jj:jj + block, :].float().transpose(-1, -2)) * scale
                            cols = torch.arange(jj, min(jj + block, N), device=q.device)
                            tiles.append(s.masked_fill(cols[None, :] > rows[:, None], float("-inf")))
                        s = torch.cat(tiles, -1)
                        m_new = torch.maximum(m, s.amax(-1))
                        p = torch.exp(s - m_new[..., None])
                        alpha = torch.exp(m - m_new)
                        pv = sum(p[..., n * block:(n + 1) * block] @ v[..., jj:jj + block, :].float() for n, jj in enumerate(starts))
                        l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + pv, m_new
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
        ("08-ex2", "P = exp(S) / exp(lse): reads the saved log-sum-exp, but exp(S) overflows fp32 once a score passes ~88 (issue 37 reader)", """
            def attention_backward(q, k, v, o, lse, do):
                scale = 1 / math.sqrt(q.shape[-1])
                p = torch.exp(q @ k.transpose(-1, -2) * scale) / torch.exp(lse)[..., None]
                dv = p.transpose(-1, -2) @ do
                dp = do @ v.transpose(-1, -2)
                ds = p * (dp - (do * o).sum(-1, keepdim=True))
                return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv
            """),
        ("08-ex3", "weights shifted by the first split's log-sum-exp, not the largest: inf once another split's is ~88 above it (issue 37 reader)", """
            def combine(o_parts, lse_parts):
                top = lse_parts[..., :1]
                weights = torch.exp(lse_parts - top)
                return (weights[..., None] * o_parts).sum(-2) / weights.sum(-1)[..., None]
            """),
        ("08-ex3", "weights shifted by the mean log-sum-exp, not the largest: inf once one split's is ~88 above the mean (issue 37 reader)", """
            def combine(o_parts, lse_parts):
                top = lse_parts.mean(-1, keepdim=True)
                weights = torch.exp(lse_parts - top)
                return (weights[..., None] * o_parts).sum(-2) / weights.sum(-1)[..., None]
            """),
        ("08-ex1", "key tiles up to one past the diagonal: range(0, min(i + block + 1, N), block) computes a masked tile per query tile (issue 37 reader)", """
            def tiled_causal(q, k, v, block=64):
                N, scale = q.shape[-2], 1 / math.sqrt(q.shape[-1])
                out = torch.empty(q.shape, device=q.device)
                for i in range(0, N, block):
                    qi, rows = q[..., i:i + block, :].float(), torch.arange(i, min(i + block, N), device=q.device)
                    m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)
                    l = torch.zeros(qi.shape[:-1], device=q.device)
                    acc = torch.zeros(qi.shape, device=q.device)
                    for j in range(0, min(i + block + 1, N), block):
                        kb, vb = k[..., j:j + block, :].float(), v[..., j:j + block, :].float()
                        s = (qi @ kb.transpose(-1, -2)) * scale
                        cols = torch.arange(j, j + kb.shape[-2], device=q.device)
                        s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
                        m_new = torch.maximum(m, s.amax(-1))
                        p = torch.exp(s - m_new[..., None])
                        alpha = torch.exp(m - m_new)
                        l, acc, m = l * alpha + p.sum(-1), acc * alpha[..., None] + p @ vb, m_new
                    out[..., i:i + block, :] = acc / l[..., None]
                return out.to(q.dtype)
            """),
    ],
    "09": [
        ("09-ex1", "the bias added by every rank before the all-reduce", """
            def row_parallel(x, weight, bias, world):
                return sum(xr @ wr.T + bias for xr, wr in zip(x.chunk(world, dim=-1), weight.chunk(world, dim=1)))
            """),
        ("09-ex1", "W split by its rows (column-parallel): each product still sees every input feature", """
            def row_parallel(x, weight, bias, world):
                return torch.cat([x @ wr.T for wr in weight.chunk(world, dim=0)], dim=-1) + bias
            """),
        ("09-ex1", "torch.chunk's shards: 10 ranks on 384 features get nine of 39 and one of 33, not shards within one", """
            def row_parallel(x, weight, bias, world):
                partials = [xr @ wr.T for xr, wr in zip(x.chunk(world, dim=-1), weight.chunk(world, dim=1))]
                return sum(partials) + bias
            """),
        ("09-ex1", "the unsharded layer: one product over every input feature", """
            def row_parallel(x, weight, bias, world):
                return F.linear(x, weight, bias)
            """),
        ("09-ex1", "the remainder all on the last rank: n // world features each, the rest to rank world - 1", """
            def row_parallel(x, weight, bias, world):
                n, size = weight.shape[1], weight.shape[1] // world
                bounds = [r * size for r in range(world)] + [n]
                return sum(x[..., a:b] @ weight[:, a:b].T for a, b in zip(bounds, bounds[1:])) + bias
            """),
        ("09-ex1", "off-by-one boundaries: each slice runs one feature past its end, overlapping the next rank's", """
            def row_parallel(x, weight, bias, world):
                n = weight.shape[1]
                bounds = [r * (n // world) + min(r, n % world) for r in range(world + 1)]
                return sum(x[..., a:b + 1] @ weight[:, a:b + 1].T for a, b in zip(bounds, bounds[1:])) + bias
            """),
        ("09-ex1", "the remainder dropped: world slices of n // world features, the last n % world never multiplied", """
            def row_parallel(x, weight, bias, world):
                size = weight.shape[1] // world
                return sum(x[..., r * size:(r + 1) * size] @ weight[:, r * size:(r + 1) * size].T for r in range(world)) + bias
            """),
        ("09-ex2", "Megatron's bubble fraction (p - 1) / m, not the idle share of the step", """
            def smallest_microbatches(p, target):
                m = 1
                while (p - 1) / m >= target:
                    m += 1
                return m
            """),
        ("09-ex2", "a bubble equal to the target counted as under it", """
            def smallest_microbatches(p, target):
                m = 1
                while (p - 1) / (m + p - 1) > target:
                    m += 1
                return m
            """),
        ("09-ex2", "a number typed in (the answer for 8 stages and 10%)", """
            def smallest_microbatches(p, target):
                return 64
            """),
        ("09-ex2", "the closed form in floats: 7 * 0.9 / 0.1 rounds to 62.99..., one m short (REVIEW8)", """
            def smallest_microbatches(p, target):
                t = float(target)
                return int((p - 1) * (1 - t) / t) + 1
            """),
        ("09-ex3", "f without the all-reduce of its gradient", """
            class Copy(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.view_as(x)

                @staticmethod
                def backward(ctx, grad):
                    return grad


            class Reduce(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return all_reduce(x)

                @staticmethod
                def backward(ctx, grad):
                    return grad
            """),
        ("09-ex3", "f and g swapped: the all-reduce in Copy's forward and in Reduce's backward (REVIEW8)", """
            class Copy(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return all_reduce(x)

                @staticmethod
                def backward(ctx, grad):
                    return grad


            class Reduce(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.view_as(x)

                @staticmethod
                def backward(ctx, grad):
                    return all_reduce(grad)
            """),
        ("09-ex4", "GPipe's order: all forwards, then all backwards", """
            def one_f_one_b_order(p, m):
                return [[("F", c) for c in range(m)] + [("B", c) for c in range(m)] for _ in range(p)]
            """),
        ("09-ex4", "a warm-up one forward too long (p - s)", """
            def one_f_one_b_order(p, m):
                orders = []
                for s in range(p):
                    warm = min(p - s, m)
                    order = [("F", c) for c in range(warm)]
                    for c in range(m - warm):
                        order += [("F", warm + c), ("B", c)]
                    order += [("B", c) for c in range(m - warm, m)]
                    orders.append(order)
                return orders
            """),
        ("09-ex1", "round-robin shards: rank r takes features r, r + world, r + 2 world, ... (same shard sizes, same sum, but not the contiguous slice the column-parallel layer before it hands each rank; reader)", """
            def row_parallel(x, weight, bias, world):
                partials = [x[..., r::world] @ weight[:, r::world].T for r in range(world)]
                y = sum(partials)
                return y if bias is None else y + bias
            """),
        ("09-ex1", "the remainder to the last ranks: the last n % world shards one feature longer", """
            def row_parallel(x, weight, bias, world):
                n = weight.shape[1]
                sizes = [n // world + (r >= world - n % world) for r in range(world)]
                bounds = [sum(sizes[:r]) for r in range(world + 1)]
                return sum(x[..., a:b] @ weight[:, a:b].T for a, b in zip(bounds, bounds[1:])) + bias
            """),
        ("09-ex2", "the closed form with ceil, in exact fractions: m where the bubble equals the target, not below it", """
            import math
            def smallest_microbatches(p, target):
                return max(1, math.ceil(Fraction(p - 1) * (1 - target) / target))
            """),
        ("09-ex2", "the bubble with p, not p - 1, stages of fill and drain", """
            def smallest_microbatches(p, target):
                m = 1
                while Fraction(p, m + p) >= target:
                    m += 1
                return m
            """),
        ("09-ex4", "a warm-up of p - 1 - s forwards not capped at m: chunks that do not exist when m < p", """
            def one_f_one_b_order(p, m):
                orders = []
                for s in range(p):
                    warm = p - 1 - s
                    order = [("F", c) for c in range(warm)]
                    for c in range(m - warm):
                        order += [("F", warm + c), ("B", c)]
                    order += [("B", c) for c in range(max(m - warm, 0), m)]
                    orders.append(order)
                return orders
            """),
        ("09-ex4", "the steady state backward first: B then F in each pair", """
            def one_f_one_b_order(p, m):
                orders = []
                for s in range(p):
                    warm = min(p - 1 - s, m)
                    order = [("F", c) for c in range(warm)]
                    for c in range(m - warm):
                        order += [("B", c), ("F", warm + c)]
                    order += [("B", c) for c in range(m - warm, m)]
                    orders.append(order)
                return orders
            """),
        ("09-ex2", "the closed form in floats: (p - 1) / t rounds below an integer where the exact answer is one more", """
            def smallest_microbatches(p, target):
                t = float(target)
                return int((p - 1) / t - (p - 1)) + 1
            """),
    ],
    "10": [
        ("10-ex1", "the sum over the ranks, not the average", """
            def my_reduce_scatter(grads, rank):
                world = len(grads)
                total = torch.stack(grads).sum(0).reshape(-1)
                size = -(-total.numel() // world)
                padded = torch.cat([total, total.new_zeros(size * world - total.numel())])
                return padded[rank * size:(rank + 1) * size]
            """),
        ("10-ex1", "torch.chunk's pieces: no padding, the last rank's shorter", """
            def my_reduce_scatter(grads, rank):
                return torch.stack(grads).mean(0).reshape(-1).chunk(len(grads))[rank]
            """),
        ("10-ex1", "the rank's own gradient cut into its shard, never reduced over the ranks (REVIEW8)", """
            def my_reduce_scatter(grads, rank):
                world = len(grads)
                own = grads[rank].reshape(-1)
                size = -(-own.numel() // world)
                padded = torch.cat([own, own.new_zeros(size * world - own.numel())])
                return padded[rank * size:(rank + 1) * size]
            """),
        ("10-ex2", "K = 8: Adam's two moments without the fp32 master weights", """
            def states_per_param(stage, n):
                weights, grads, adam = 2, 2, 8
                if stage >= 1:
                    adam /= n
                if stage >= 2:
                    grads /= n
                if stage >= 3:
                    weights /= n
                return {"parameters": weights, "gradients": grads, "optimizer": adam}
            """),
        ("10-ex2", "ZeRO-2 sharding the weights too", """
            def states_per_param(stage, n):
                weights, grads, adam = 2, 2, 12
                if stage >= 1:
                    adam /= n
                if stage >= 2:
                    grads /= n
                    weights /= n
                return {"parameters": weights, "gradients": grads, "optimizer": adam}
            """),
        ("10-ex2", "ZeRO-2 sharding the weights instead of the gradients (the same total)", """
            def states_per_param(stage, n):
                weights, grads, adam = 2, 2, 12
                if stage >= 1:
                    adam /= n
                if stage >= 2:
                    weights /= n
                if stage >= 3:
                    grads /= n
                return {"parameters": weights, "gradients": grads, "optimizer": adam}
            """),
        ("10-ex2", "the fp32 master weights counted as parameters, not optimizer state (the same total)", """
            def states_per_param(stage, n):
                weights, grads, adam = 6, 2, 8
                if stage >= 1:
                    adam /= n
                    weights = 2 + 4 / n
                if stage >= 2:
                    grads /= n
                if stage >= 3:
                    weights = 6 / n
                return {"parameters": weights, "gradients": grads, "optimizer": adam}
            """),
        ("10-ex2", "the total in one number, not by category", """
            def states_per_param(stage, n):
                return 2 + (2 if stage < 2 else 2 / n) + (12 if stage < 1 else 12 / n) - (0 if stage < 3 else 2 - 2 / n)
            """),
        ("10-ex2", "DDP's 16 bytes whatever the stage: the sharding left out (REVIEW8)", """
            def states_per_param(stage, n):
                return {"parameters": 2, "gradients": 2, "optimizer": 12}
            """),
        ("10-ex3", "a note that keeps a full copy of the weight: nothing saved", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return (t.clone(), tuple(t.shape), t.stride(), t.storage_offset())
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                _, size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
        ("10-ex3", "pack keeps every tensor as it is", """
            def pack(t):
                return t

            def unpack(saved):
                return saved
            """),
        ("10-ex3", "a note holding a detached view: the same storage, so the gathered copy stays alive (REVIEW8)", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return ("note", t.detach())
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                return saved[1]
            """),
        ("10-ex4", "each rank keeps the whole master and optimizer state, updates everything, returns its slice", """
            def zero1_init(flat, rank, world, make_optimizer):
                master = flat.detach().clone()
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                world = len(grads)
                master.grad = torch.stack(grads).mean(0)
                opt.step()
                size = -(-master.numel() // world)
                return torch.cat([master, master.new_zeros(size * world - master.numel())])[rank * size:(rank + 1) * size]
            """),
        ("10-ex4", "off-by-one boundaries: floor(numel / N) per rank, the last rank takes the rest", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = flat.numel() // world
                hi = flat.numel() if rank == world - 1 else (rank + 1) * size
                master = flat.detach()[rank * size:hi].clone()
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                world = len(grads)
                mean = torch.stack(grads).mean(0)
                size = mean.numel() // world
                hi = mean.numel() if rank == world - 1 else (rank + 1) * size
                master.grad = mean[rank * size:hi].clone()
                opt.step()
                return master
            """),
        ("10-ex4", "torch.chunk's pieces: no padding, the last rank's shorter", """
            def zero1_init(flat, rank, world, make_optimizer):
                master = flat.detach().clone().chunk(world)[rank].clone()
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                master.grad = torch.stack(grads).mean(0).chunk(len(grads))[rank].clone()
                opt.step()
                return master
            """),
        ("10-ex4", "the master a view of a padded copy of the whole: right values, nothing saved", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = -(-flat.numel() // world)
                padded = torch.cat([flat.detach(), flat.new_zeros(size * world - flat.numel())])
                master = padded[rank * size:(rank + 1) * size]
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                master.grad = my_reduce_scatter(grads, rank).float()
                opt.step()
                master.grad = None
                return master
            """),
        ("10-ex4", "the sum of the ranks' gradients, not the average (SGD with momentum tells them apart)", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = -(-flat.numel() // world)
                master = torch.zeros(size)
                piece = flat.detach()[rank * size:(rank + 1) * size]
                master[:piece.numel()] = piece
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                master.grad = my_reduce_scatter(grads, rank) * len(grads)
                opt.step()
                return master
            """),
        ("10-ex4", "the rank's own gradient's shard, never reduced over the ranks", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = -(-flat.numel() // world)
                master = torch.zeros(size)
                piece = flat.detach()[rank * size:(rank + 1) * size]
                master[:piece.numel()] = piece
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                world, size = len(grads), master.numel()
                own = torch.cat([grads[rank], grads[rank].new_zeros(size * world - grads[rank].numel())])
                master.grad = own[rank * size:(rank + 1) * size]
                opt.step()
                return master
            """),
        ("10-ex4", "a constant: the shard returned as it was, never stepped", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = -(-flat.numel() // world)
                master = torch.zeros(size)
                piece = flat.detach()[rank * size:(rank + 1) * size]
                master[:piece.numel()] = piece
                return master, make_optimizer([master])

            def zero1_step(master, opt, grads, rank):
                return master
            """),
        ("10-ex3", "pack keyed on t.data_ptr(), not the storage's: a view at a non-zero offset (w[1:]) is kept, and the gathered copy with it", """
            def pack(t):
                if t.data_ptr() in gathered:
                    return (tuple(t.shape), t.stride(), t.storage_offset())
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
        ("10-ex3", "a constant note, and unpack hard-codes the transposed weight: right for w.t() only", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return "W3"
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                return gather().t()
            """),
        ("10-ex3", "a note that keeps a bf16 copy of the saved view: half the weight's bytes still held", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return (t.detach().to(torch.bfloat16), tuple(t.shape), t.stride(), t.storage_offset())
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                _, size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
        ("10-ex3", "the storage offset dropped: w[1:] comes back as the weight's first 47 rows", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return (tuple(t.shape), t.stride())
                return t

            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                size, stride = saved
                return gather().as_strided(size, stride)
            """),
        ("10-ex4", "the optimizer steps a clone of the master: the master returned by zero1_init never moves", """
            def zero1_init(flat, rank, world, make_optimizer):
                size = -(-flat.numel() // world)
                master = torch.zeros(size, dtype=torch.float32)
                piece = flat.detach()[rank * size:(rank + 1) * size]
                master[:piece.numel()] = piece
                return master, make_optimizer([master.clone().requires_grad_()])

            def zero1_step(master, opt, grads, rank):
                p = opt.param_groups[0]["params"][0]
                p.grad = my_reduce_scatter(grads, rank).float()
                opt.step()
                p.grad = None
                return p
            """),
        ("10-ex3", "the gathered weight told by requires_grad: in a ZeRO-3 engine it requires a gradient, and a saved constant does not", """
            def pack(t):
                if not t.requires_grad:
                    return (tuple(t.shape), t.stride(), t.storage_offset())
                return t


            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
        ("10-ex3", "the gathered weight told by its storage's size: a constant of the same size is taken for it", """
            def pack(t):
                if t.untyped_storage().nbytes() == W3.nbytes:
                    return (tuple(t.shape), t.stride(), t.storage_offset())
                return t


            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
        ("10-ex3", "backward's gathered copy cached in a global and never dropped: a full copy stays alive after backward", """
            _cache = []

            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return (tuple(t.shape), t.stride(), t.storage_offset())
                return t


            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                if not _cache:
                    _cache.append(gather())
                size, stride, offset = saved
                return _cache[0].as_strided(size, stride, offset)
            """),
        ("10-ex3", "a meta tensor as the note, unpacked to a view of the global W3: right values, but nothing gathered again is used", """
            def pack(t):
                if t.untyped_storage().data_ptr() in gathered:
                    return torch.empty_strided(t.shape, t.stride(), device="meta")
                return t


            def unpack(saved):
                if saved.device.type != "meta":
                    return saved
                gather()
                return W3.as_strided(saved.shape, saved.stride(), 0 if saved.stride() == (1, 64) else 64)
            """),
        ("10-ex3", "every saved view taken for the gathered weight (t._base is not None): a view of another storage too", """
            def pack(t):
                if t._base is not None:
                    return (tuple(t.shape), t.stride(), t.storage_offset())
                return t


            def unpack(saved):
                if isinstance(saved, torch.Tensor):
                    return saved
                size, stride, offset = saved
                return gather().as_strided(size, stride, offset)
            """),
    ],
    "11": [
        ("11-ex1", "every input but the incoming gradient: the weights and the layer's input counted too", """
            def kept_intermediates(graph):
                count = nbytes = 0
                for node in graph.nodes:
                    value = node.meta.get("val")
                    if node.op == "placeholder" and isinstance(value, torch.Tensor) and not node.name.startswith("tangents"):
                        count += 1
                        nbytes += value.numel() * value.element_size()
                return count, nbytes
            """),
        ("11-ex1", "four bytes per element, whatever the dtype", """
            def kept_intermediates(graph):
                count = nbytes = 0
                for node in graph.nodes:
                    value = node.meta.get("val")
                    if node.op == "placeholder" and isinstance(value, torch.Tensor) and not node.name.startswith(("primals", "tangents")):
                        count += 1
                        nbytes += value.numel() * 4
                return count, nbytes
            """),
        ("11-ex1", "the tensors the backward computes, not the ones it receives", """
            def kept_intermediates(graph):
                made = [n.meta["val"] for n in graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
                return len(made), sum(t.numel() * t.element_size() for t in made)
            """),
        ("11-ex1", "the count of the real graph and the bytes lk.track printed, typed in", """
            def kept_intermediates(graph):
                return 14, mincut["kept"]
            """),
        ("11-ex2", "silu(gate) kept on ctx beside the two saved tensors: nothing saved", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    ctx.save_for_backward(gate, up)
                    ctx.silu = torch.nn.functional.silu(gate)
                    return ctx.silu * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, up = ctx.saved_tensors
                    s = torch.sigmoid(gate)
                    return grad_out * up * s * (1 + gate * (1 - s)), grad_out * ctx.silu
            """),
        ("11-ex2", "all three saved, as eager autograd does", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    silu = torch.nn.functional.silu(gate)
                    ctx.save_for_backward(gate, up, silu)
                    return silu * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, up, silu = ctx.saved_tensors
                    s = torch.sigmoid(gate)
                    return grad_out * up * s * (1 + gate * (1 - s)), grad_out * silu
            """),
        ("11-ex2", "gate and up kept as attributes of ctx, not with save_for_backward: nothing counted as saved", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    ctx.gate, ctx.up = gate, up
                    return torch.nn.functional.silu(gate) * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, up = ctx.gate, ctx.up
                    s = torch.sigmoid(gate)
                    return grad_out * up * s * (1 + gate * (1 - s)), grad_out * gate * s
            """),
        ("11-ex2", "sigmoid(gate) saved beside gate and up, so that backward need not recompute it", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    s = torch.sigmoid(gate)
                    ctx.save_for_backward(gate, up, s)
                    return gate * s * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, up, s = ctx.saved_tensors
                    return grad_out * up * s * (1 + gate * (1 - s)), grad_out * gate * s
            """),
        ("11-ex2", "SiLU's derivative taken as sigmoid(gate) alone", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    ctx.save_for_backward(gate, up)
                    return torch.nn.functional.silu(gate) * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, up = ctx.saved_tensors
                    s = torch.sigmoid(gate)
                    return grad_out * up * s, grad_out * gate * s
            """),
        ("11-ex3", "no reuse at all: every buffer a slot of its own", """
            def plan_buffers(buffers):
                return sum(nbytes for nbytes, _, _ in buffers), list(range(len(buffers)))
            """),
        ("11-ex3", "off by one: a slot taken as free at its buffer's last read, while the op still reads it", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] <= first and sizes[s] >= nbytes]
                    if free:
                        slot = min(free, key=lambda s: (sizes[s], s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "a free slot reused whatever its size: a buffer written into a slot too small for it", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first]
                    if free:
                        slot = min(free, key=lambda s: (sizes[s], s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "a free slot grown to fit the buffer: slots do not keep their size", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first]
                    if free:
                        slot = min(free, key=lambda s: (abs(sizes[s] - nbytes), s))
                        sizes[slot] = max(sizes[slot], nbytes)
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "first fit: the lowest-numbered free slot that fits, not the smallest", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] >= nbytes]
                    if free:
                        slot = free[0]
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "only a free slot of exactly the buffer's size reused (Inductor's run-time rule), not a larger one", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] == nbytes]
                    if free:
                        slot = free[0]
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "the peak taken as the most bytes live at once, not the bytes the plan's slots reserve", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] >= nbytes]
                    if free:
                        slot = min(free, key=lambda s: (sizes[s], s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                steps = range(max(last for _, _, last in buffers) + 1)
                return max(sum(n for n, f, l in buffers if f <= t <= l) for t in steps), slots
            """),
        ("11-ex3", "the largest buffer as the peak, every buffer in slot 0", """
            def plan_buffers(buffers):
                return max(nbytes for nbytes, _, _ in buffers), [0] * len(buffers)
            """),
        ("11-ex3", "the answer asked of Inductor's own memory planner's module (its LiveRange)", """
            def plan_buffers(buffers):
                from torch._inductor.codegen.memory_planning import LiveRange
                ranges = [LiveRange(first, last + 1) for _, first, last in buffers]
                apart = lambda a, b: len(a.join(b)) >= len(a) + len(b)
                sizes, slots = [], []
                for i, (nbytes, first, last) in enumerate(buffers):
                    free = [s for s in range(len(sizes)) if all(apart(ranges[j], ranges[i]) for j, t in enumerate(slots) if t == s) and sizes[s] >= nbytes]
                    slot = min(free, key=lambda s: (sizes[s], s)) if free else len(sizes)
                    sizes += [nbytes] * (slot == len(sizes))
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex2", "only gate saved, up kept on ctx: one tensor saved", """
            class SiluMul(torch.autograd.Function):
                @staticmethod
                def forward(ctx, gate, up):
                    ctx.save_for_backward(gate)
                    ctx.up = up
                    return torch.nn.functional.silu(gate) * up

                @staticmethod
                def backward(ctx, grad_out):
                    gate, = ctx.saved_tensors
                    s = torch.sigmoid(gate)
                    return grad_out * ctx.up * s * (1 + gate * (1 - s)), grad_out * gate * s
            """),
        ("11-ex3", "ties broken by the highest slot number, not the lowest", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] >= nbytes]
                    if free:
                        slot = min(free, key=lambda s: (sizes[s], -s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "ties broken by the most recently freed slot (a LIFO free list)", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] >= nbytes]
                    if free:
                        slot = min(free, key=lambda s: (sizes[s], -last_read[s], s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
        ("11-ex3", "worst fit: the largest free slot that fits", """
            def plan_buffers(buffers):
                sizes, last_read, slots = [], [], []
                for nbytes, first, last in buffers:
                    free = [s for s in range(len(sizes)) if last_read[s] < first and sizes[s] >= nbytes]
                    if free:
                        slot = max(free, key=lambda s: (sizes[s], -s))
                    else:
                        slot = len(sizes)
                        sizes.append(nbytes)
                        last_read.append(last)
                    last_read[slot] = last
                    slots.append(slot)
                return sum(sizes), slots
            """),
    ],
    "12": [
        ("12-ex1", "row-major order: group_m ignored", """
            def my_program_of(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
                return pid_m * num_pid_n + pid_n
            """),
        ("12-ex1", "every group taken as group_m rows, the last one too", """
            def my_program_of(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
                first_m = (pid_m // group_m) * group_m
                return first_m * num_pid_n + pid_n * group_m + (pid_m - first_m)
            """),
        ("12-ex1", "column-major order", """
            def my_program_of(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
                return pid_n * num_pid_m + pid_m
            """),
        ("12-ex1", "the last group's size taken from pid_m instead of the group's first tile-row", """
            def my_program_of(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
                first_m = (pid_m // group_m) * group_m
                rows_here = min(num_pid_m - pid_m, group_m)
                return first_m * num_pid_n + pid_n * rows_here + (pid_m - first_m)
            """),
        ("12-ex2", "all the logits at once", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                return F.cross_entropy(hidden @ weight.T, targets, reduction="none")
            """),
        ("12-ex2", "chunks of logits kept in a list, then joined: the full logits again", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                pieces = [hidden[s:s + chunk] @ weight.T for s in range(0, hidden.shape[0], chunk)]
                logits = torch.cat(pieces)
                return torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[:, None])[:, 0]
            """),
        ("12-ex2", "all the logits in NumPy, where lk.track does not look", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                logits = hidden.cpu().numpy() @ weight.cpu().numpy().T
                top = logits.max(axis=1, keepdims=True)
                lse = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
                return torch.from_numpy(lse - logits[np.arange(len(logits)), targets.cpu().numpy()]).to(hidden.device)
            """),
        ("12-ex2", "a log-sum-exp without each row's max: exp() overflows for logits above 88", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                losses = []
                for s in range(0, hidden.shape[0], chunk):
                    logits = hidden[s:s + chunk] @ weight.T
                    losses.append(torch.log(torch.exp(logits).sum(dim=-1)) - logits.gather(1, targets[s:s + chunk, None])[:, 0])
                return torch.cat(losses)
            """),
        ("12-ex2", "the last, shorter chunk dropped (range(N // chunk))", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                losses = []
                for i in range(hidden.shape[0] // chunk):
                    logits = hidden[i * chunk:(i + 1) * chunk] @ weight.T
                    losses.append(torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[i * chunk:(i + 1) * chunk, None])[:, 0])
                return torch.cat(losses)
            """),
        ("12-ex2", "each row's log-sum-exp, the target's logit forgotten", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                return torch.cat([torch.logsumexp(hidden[s:s + chunk] @ weight.T, dim=-1)
                                  for s in range(0, hidden.shape[0], chunk)])
            """),
        ("12-ex2", "chunks twice the size asked for: under half the full logits, but not `chunk` rows at a time", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                losses = []
                for s in range(0, hidden.shape[0], 2 * chunk):
                    logits = hidden[s:s + 2 * chunk] @ weight.T
                    losses.append(torch.logsumexp(logits, dim=-1) - logits.gather(1, targets[s:s + 2 * chunk, None])[:, 0])
                return torch.cat(losses)
            """),
        ("12-ex2", "chunked, but every chunk's logits kept alive until the end", """
            def chunked_ce_forward(hidden, weight, targets, chunk):
                losses, kept = [], []
                for s in range(0, hidden.shape[0], chunk):
                    kept.append(hidden[s:s + chunk] @ weight.T)
                    losses.append(torch.logsumexp(kept[-1], dim=-1) - kept[-1].gather(1, targets[s:s + chunk, None])[:, 0])
                return torch.cat(losses)
            """),
    ],
    "13": [
        ("13-ex1", "the block scales (absmax) left out", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "the paper's blocks of 2048 values, not bitsandbytes' 256", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 8 * -(-n // 2048)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "one scale per block for the two moments together", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 4 * -(-n // 256)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "the scale's 32 bits counted as bytes", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 2 * 32 * -(-n // 256)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "every tensor quantized: the fp32 state under min_8bit_size left out", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total = sum(2 * n + 8 * -(-n // 256) for n in numels)
                return total + (len(numels) if per_parameter else 1) * 2048
            """),
        ("13-ex1", "AdamW's two fp32 moments: the 8-bit lever not applied", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                return 8 * sum(numels)
            """),
        ("13-ex1", "the tiny Llama's answer typed in", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                return 3_871_744
            """),
        ("13-ex1", "2 + 8/256 bytes per value on average: no tensor's rounding, fallback or maps", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                return int(sum(numels) * (2 + 8 / 256))
            """),
        ("13-ex1", "the last, partial block not counted (floor, not ceiling)", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 8 * (n // 256)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "a tensor of exactly min_8bit_size values kept in fp32 (<=, not <)", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n <= 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 8 * -(-n // 256)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 2048
            """),
        ("13-ex1", "the quantization maps once, even with one optimizer per parameter", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total = 2048
                for n in numels:
                    total += 8 * n if n < 4096 else 2 * n + 8 * -(-n // 256)
                return total
            """),
        ("13-ex1", "the quantization maps left out", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                return sum(8 * n if n < 4096 else 2 * n + 8 * -(-n // 256) for n in numels)
            """),
        ("13-ex1", "the maps counted per tensor even with one optimizer", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total = 0
                for n in numels:
                    total += 8 * n if n < 4096 else 2 * n + 8 * -(-n // 256) + 2048
                return total
            """),
        ("13-ex1", "maps also for the optimizers of fp32 tensors, which hold none", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total = sum(8 * n if n < 4096 else 2 * n + 8 * -(-n // 256) for n in numels)
                return total + (len(numels) if per_parameter else 1) * 2048
            """),
        ("13-ex1", "one map (1 KiB), not one per moment", """
            def my_adam8bit_state_bytes(numels, per_parameter=False):
                total, eight = 0, 0
                for n in numels:
                    if n < 4096:
                        total += 8 * n
                    else:
                        total += 2 * n + 8 * -(-n // 256)
                        eight += 1
                return total + (eight if per_parameter else min(eight, 1)) * 1024
            """),
        ("13-ex2", "the spec sheet's bidirectional PCIe figure for one direction", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved, moved / pcie_bps, 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "the CPU's Adam update left out", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved, moved / (pcie_bps / 2), 0.0
            """),
        ("13-ex2", "the gradients sent once per step, not once per micro-batch", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params + 2 * params
                return moved, moved / (pcie_bps / 2), 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "the weights brought back every micro-batch, not once per step", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params * accum
                return moved, moved / (pcie_bps / 2), 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "fp32 gradients and weights over PCIe", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 4 * params * accum + 4 * params
                return moved, moved / (pcie_bps / 2), 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "fp32 gradients and weights over the bidirectional figure (the two errors cancel in the sum)", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 4 * params * accum + 4 * params
                return moved, moved / pcie_bps, 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "one number, not the three terms", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved / (pcie_bps / 2) + 2 * 16 * params / cpu_bps
            """),
        ("13-ex2", "the CPU reads Adam's 16 bytes but never writes them back", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved, moved / (pcie_bps / 2), 16 * params / cpu_bps
            """),
        ("13-ex2", "the L4's PCIe and the planner's CPU speed typed in: the card and CPU arguments ignored", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved, moved / 32e9, 2 * 16 * params / 50e9
            """),
        ("13-ex2", "the seconds moved from PCIe to the CPU term: the sum right, the terms wrong", """
            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = 2 * params * accum + 2 * params
                return moved, 2 * params * accum / (pcie_bps / 2), 2 * params / (pcie_bps / 2) + 2 * 16 * params / cpu_bps
            """),
        ("13-ex3", "the step after backward: every gradient alive at once", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                opts = [torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    for opt in opts:
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    losses.append(loss.item())
                return losses
            """),
        ("13-ex3", "hooks that step but leave the gradient in .grad (nothing saved)", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                hooks = [p.register_post_accumulate_grad_hook(lambda p: opts[p].step()) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "gradients zeroed in the hook, not freed (zero_grad(set_to_none=False))", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=False)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "one AdamW over all parameters, stepped in the last hook", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                params = [p for p in model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=lr, foreach=False)
                seen = []
                def step(p):
                    seen.append(p)
                    if len(seen) == len(params):
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                        seen.clear()
                hooks = [p.register_post_accumulate_grad_hook(step) for p in params]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "every gradient from torch.autograd.grad at once, then each parameter stepped", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                params = [p for p in model.parameters() if p.requires_grad]
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in params}
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    for p, g in zip(params, torch.autograd.grad(loss, params)):
                        p.grad = g
                        opts[p].step()
                        p.grad = None
                    losses.append(loss.item())
                return losses
            """),
        ("13-ex3", "nothing done: None returned", """
            def train_fused(model, batches, lr):
                pass
            """),
        ("13-ex3", "no step: the losses of the unchanged model", """
            def train_fused(model, batches, lr):
                return [model(input_ids=ids, labels=ids, use_cache=False).loss.item() for ids in batches]
            """),
        ("13-ex3", "labkit's own fused step (labkit.plan.verify.Step)", """
            def train_fused(model, batches, lr):
                from labkit.plan.verify import Step, prepare
                step = Step(prepare(model, "finetune", dict(recompute=True)), dict(dtype="bf16", fused_step=True),
                            DEVICE.type, opt_state=False, lr=lr)
                losses = [step.micro_batch(ids).item() for ids in batches]
                for hook in step.hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "the fused step without recomputation", """
            def train_fused(model, batches, lr):
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "the MLPs checkpointed alone (notebook 03's exercise 2), not full recomputation", """
            from torch.utils.checkpoint import checkpoint

            class Checkpointed(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, *args, **kwargs):
                    return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

            def train_fused(model, batches, lr):
                for layer in model.model.layers:
                    layer.mlp = Checkpointed(layer.mlp)
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "the attention checkpointed alone, not full recomputation", """
            from torch.utils.checkpoint import checkpoint

            class Checkpointed(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner = inner

                def forward(self, *args, **kwargs):
                    return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)

            def train_fused(model, batches, lr):
                for layer in model.model.layers:
                    layer.self_attn = Checkpointed(layer.self_attn)
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "new optimizers (and hooks) for every batch: Adam's moments lost", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                losses = []
                for ids in batches:
                    opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                    def step(p, opts=opts):
                        opts[p].step()
                        opts[p].zero_grad(set_to_none=True)
                    hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                    for hook in hooks:
                        hook.remove()
                return losses
            """),
        ("13-ex3", "SGD written by hand in the hook, not AdamW", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                def step(p):
                    with torch.no_grad():
                        p.add_(p.grad, alpha=-lr)
                    p.grad = None
                hooks = [p.register_post_accumulate_grad_hook(step) for p in model.parameters() if p.requires_grad]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "the hooks left on the model: every later backward still steps", """
            def train_fused(model, batches, lr):
                model.gradient_checkpointing_enable(dict(use_reentrant=False))
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                for p in opts:
                    p.register_post_accumulate_grad_hook(step)
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                return losses
            """),
        ("13-ex3", "AdamW's default learning rate: the lr argument ignored", """
            def train_fused(model, batches, lr):
                on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                on({"use_reentrant": False})
                opts = {p: torch.optim.AdamW([p], foreach=False) for p in model.parameters() if p.requires_grad}

                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)

                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "the whole forward checkpointed as ONE segment: nothing kept after forward, the plain peak in backward", """
            def train_fused(model, batches, lr):
                from torch.utils.checkpoint import checkpoint
                opts = {p: torch.optim.AdamW([p], lr=lr, foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = checkpoint(lambda x: model(input_ids=x, labels=x, use_cache=False).loss, ids, use_reentrant=False)
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
        ("13-ex3", "AdamW with an LLM recipe's betas (0.9, 0.95), not the default the exercise names", """
            def train_fused(model, batches, lr):
                on = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
                on({"use_reentrant": False})
                opts = {p: torch.optim.AdamW([p], lr=lr, betas=(0.9, 0.95), foreach=False) for p in model.parameters() if p.requires_grad}
                def step(p):
                    opts[p].step()
                    opts[p].zero_grad(set_to_none=True)
                hooks = [p.register_post_accumulate_grad_hook(step) for p in opts]
                losses = []
                for ids in batches:
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    losses.append(loss.item())
                for hook in hooks:
                    hook.remove()
                return losses
            """),
    ],
}


def _cell_index(nb, grade_id):
    found = [i for i, c in enumerate(nb.cells) if c.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(found) == 1, f"expected one cell with nbgrader grade_id {grade_id!r}, found {len(found)}"
    return found[0]


def _text(cell):
    parts = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}")
        elif "text/plain" in o.get("data", {}):
            parts.append(o.data["text/plain"])
    return "".join(parts)


def _prepared(path, bypasses=()):
    """The answer key with, after each check, (wrong answer, copy of the check) pairs, (bypass, copy of the check,
    the check without forbid=) triples, and the solution again; cut after the last of them."""
    nb = nbformat.read(path, as_version=4)
    tries, refusals = [], []    # (copied check, exercise id, why); (copied check, unguarded check, exercise id, names)
    by_exercise = {}
    for exercise, why, source in WRONG.get(path.name[:2], []):
        by_exercise.setdefault(exercise, []).append(("wrong", why, source))
    for exercise, names, source in bypasses:
        by_exercise.setdefault(exercise, []).append(("bypass", names, source))
    tail = None                                 # the last cell added, wherever later insertions put it
    for exercise, answers in by_exercise.items():
        solution = nb.cells[_cell_index(nb, f"{exercise}-solution")]
        check = nb.cells[_cell_index(nb, f"{exercise}-check")]
        assert "lk.exercise(" in check.source, f"{path.name} {exercise}-check does not call lk.exercise"
        at = next(i for i, c in enumerate(nb.cells) if c is check) + 1
        added = []
        for kind, why, source in answers:
            copy = nbformat.v4.new_code_cell(check.source)
            copy.metadata["tags"] = ["raises-exception"]
            added += [nbformat.v4.new_code_cell(textwrap.dedent(source).strip()), copy]
            if kind == "wrong":
                tries.append((copy, exercise, why))
            else:
                control = nbformat.v4.new_code_cell(UNGUARDED + check.source.replace("lk.exercise(", "_unguarded("))
                control.metadata["tags"] = ["raises-exception"]
                added.append(control)
                refusals.append((copy, control, exercise, why))
        added.append(nbformat.v4.new_code_cell(solution.source))       # the answer key again for what follows
        nb.cells[at:at] = added
        if tail is None or at > next(i for i, c in enumerate(nb.cells) if c is tail):
            tail = added[-1]
    del nb.cells[next(i for i, c in enumerate(nb.cells) if c is tail) + 1:]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("nbgrader", None)
    return nb, tries, refusals


def _refused_as_calling(copy, control, exercise, names):
    """What is wrong with a bypass's outcome: it passed the guarded check, failed without forbid=, or was
    refused for another reason ("" when it was refused as it must be)."""
    n = int(exercise.split("ex")[1])
    where = f"{exercise} (bypass naming {names[0]})"
    refused, unguarded = _text(copy), _text(control)
    if f"Exercise {n}: passed" not in unguarded:
        return (f"{where}: the bypass does not answer the exercise even without forbid=, so it proves nothing "
                f"(update it to the notebook's check):\n{unguarded[-2000:]}")
    errors = [o for o in copy.outputs if o.output_type == "error"]
    if not errors:
        return f"{where}: the check ACCEPTED an answer that calls the taught code:\n{refused[-2000:]}"
    if errors[0].ename != "AssertionError" or "your answer calls" not in errors[0].evalue:
        return f"{where}: the check failed, but not by refusing the call:\n{refused[-2000:]}"
    if not any(name in errors[0].evalue for name in names):
        return f"{where}: refused naming another call: {errors[0].evalue}"
    return ""


@pytest.mark.parametrize("number", sorted(set(WRONG) | set(BYPASSES)))
def test_every_exercise_check_refuses_the_wrong_answers_and_the_bypasses(number):
    path = NOTEBOOKS[number]
    nb, tries, refusals = _prepared(path, BYPASSES.get(number, ()))
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()   # any other cell's error raises
    accepted = []
    for copy, exercise, why in tries:
        text = _text(copy)
        errors = [o for o in copy.outputs if o.output_type == "error"]
        if not errors or "not attempted" in text:
            accepted.append(f"{exercise} accepted a wrong answer ({why}):\n{text[-1500:]}")
        elif errors[0].ename not in ("AssertionError", "ValueError", "TypeError"):
            accepted.append(f"{exercise} failed on a wrong answer ({why}) by a crash, not a check: "
                            f"{errors[0].ename}: {errors[0].evalue}")
    accepted += filter(None, (_refused_as_calling(*r) for r in refusals))
    assert not accepted, "\n\n".join(accepted)
