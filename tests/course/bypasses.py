"""Answers that call the code an exercise teaches (issue 27's bypasses): the checks must refuse each one.

Each answer is a real one (imported, aliased, held in a default argument, reached through PyTorch's private
kernels) that only the check's `forbid=` stops: `test_wrong_answers.py` runs it through the real check, which
must fail with lk.exercise's "your answer calls ...", and through the same check with `forbid=` dropped
(`UNGUARDED`), which must pass (a bypass that fails for another reason would prove nothing).
"""
# (exercise id, what the refusal must name (any one of these), the answer that calls the taught code)
BYPASSES = {
    "00": [
        ("00-ex1", ["labkit.estimate.step.storage_bytes"], """
            from labkit.estimate.step import storage_bytes as counted

            def storage_bytes(tensors, _count=counted):
                return _count(tensors)
            """),
        ("00-ex2", ["labkit.estimate"], """
            def states_per_param(make_optimizer):           # a step, so the weights move, then the formula
                optimizer = make_optimizer(model.parameters())
                ids = next(batches)
                with lk.track(model, optimizer) as m:
                    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if type(optimizer).__name__ == "Adafactor":   # lk.estimate has none: the measurement
                    states = sum(m.max_parts[c] for c in ("parameters", "gradients", "optimizer"))
                    return states / sum(p.numel() for p in model.parameters())
                kind = "sgd-momentum" if optimizer.defaults.get("momentum") else "sgd"
                e = lk.estimate(model.config, batch=BATCH, seq=SEQ, dtype="fp32", optimizer=kind)
                return (e.parts["parameters"] + e.parts["gradients"] + e.parts["optimizer"]) / e.params
            """),
    ],
    "02": [
        ("02-ex1", ["_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"], """
            class LossScaler:
                \"\"\"GradScaler's own kernels behind the exercise's interface.\"\"\"
                def __init__(self, scale=2.0**16, growth=2.0, backoff=0.5, interval=2000):
                    self._scale = torch.full((), scale, dtype=torch.float32)
                    self._clean = torch.zeros((), dtype=torch.int32)
                    self.growth, self.backoff, self.interval = growth, backoff, interval

                @property
                def scale(self):
                    return self._scale.item()

                def scale_loss(self, loss):
                    return loss * self._scale.to(loss.device)

                def step(self, optimizer):
                    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
                    found = torch.zeros(1, device=grads[0].device)
                    scale = self._scale.to(grads[0].device)
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale.double().reciprocal().float())
                    stepped = found.item() == 0
                    if stepped:
                        optimizer.step()
                    clean = self._clean.to(grads[0].device)
                    torch._amp_update_scale_(scale, clean, found, self.growth, self.backoff, self.interval)
                    self._scale, self._clean = scale.cpu(), clean.cpu()
                    return stepped
            """),
        ("02-ex2", ["labkit.zero"], """
            import tempfile
            import torch.distributed as dist
            from labkit.zero import DDP

            class MasterWeights:
                \"\"\"labkit's ZeRO engine at stage 0 (one rank): fp32 masters, AdamW and the copy back.\"\"\"
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
    ],
    "06": [
        ("06-ex3", ["bitsandbytes"], """
            class LoRA4bit(torch.nn.Module):
                def __init__(self, packed, absmax, shape, rank, alpha):
                    super().__init__()
                    self.register_buffer("packed", packed.flatten())
                    self.register_buffer("absmax", absmax.flatten())
                    self.shape, self.scale = tuple(shape), alpha / rank
                    self.A = torch.nn.Parameter(torch.randn(rank, shape[1]) / math.sqrt(shape[1]))
                    self.B = torch.nn.Parameter(torch.zeros(shape[0], rank))

                def forward(self, x):                   # bitsandbytes decodes the base
                    state = bnbf.QuantState(absmax=self.absmax, shape=torch.Size(self.shape), blocksize=BLOCK,
                                            code=bnbf.get_4bit_type("nf4", device="cpu"), quant_type="nf4",
                                            dtype=torch.float32)
                    w = bnbf.dequantize_4bit(self.packed.view(-1, 1), state)
                    return x @ w.T + (x @ self.A.T @ self.B.T) * self.scale
            """),
    ],
    "07": [
        ("07-ex1", ["labkit.paged.prefix.block_hashes"], """
            def my_block_hashes(token_ids, block_size, _lib=paged.block_hashes):
                return _lib(token_ids, block_size)
            """),
        ("07-ex2", ["labkit.paged"], """
            def admission(free_blocks, total_blocks, need, watermark_blocks):
                tables = serving_tables(BlockAllocator(total_blocks, BLOCK), watermark=(watermark_blocks + 0.5) / total_blocks)
                if total_blocks > free_blocks:
                    tables.add("others", (total_blocks - free_blocks) * BLOCK)
                return tables.can_allocate(need * BLOCK)
            """),
        ("07-ex3", ["labkit.paged.tables"], """
            def my_append(allocator, table, length, count):
                tables = BlockTables(allocator)
                tables.tables["s"], tables.lengths["s"] = table, length
                tables.append("s", count)
                return tables.lengths["s"]
            """),
        ("07-ex4", ["labkit.paged.tables"], """
            def my_write_token(allocator, table, length, copies):
                tables = BlockTables(allocator)
                tables.tables["s"], tables.lengths["s"] = table, length
                tables.append("s", 1)
                copies.extend(tables.take_copies())
                return tables.lengths["s"]
            """),
    ],
    "08": [
        ("08-ex1", ["labkit.flash"], """
            def tiled_causal(q, k, v, block=64):
                return flash.flash_attention(q, k, v, causal=True)
            """),
        ("08-ex2", ["labkit.flash.backward_torch"], """
            def attention_backward(q, k, v, o, lse, do):
                return flash.backward_torch(q, k, v, o, lse, do, False, 1 / math.sqrt(q.shape[-1]), 32, 32)
            """),
        ("08-ex3", ["labkit.flash.combine_splits"], """
            from labkit.flash import combine_splits as combine_parts

            def combine(o_parts, lse_parts):
                return combine_parts(o_parts, lse_parts)[0]
            """),
    ],
    "09": [
        ("09-ex2", ["gpipe_bubble"], """
            def smallest_microbatches(p, target):        # a search with the check's own replay of GPipe
                m = 1
                while gpipe_bubble(p, m) >= Fraction(str(target)):    # the replay counts in exact fractions
                    m += 1
                return m
            """),
        ("09-ex3", ["labkit.tensor_parallel.CopyToParallel.backward", "labkit.tensor_parallel.ReduceFromParallel.forward"], """
            import labkit.tensor_parallel as _par

            _par.counted_all_reduce = all_reduce        # labkit's f and g, their all-reduce the simulated one
            Copy, Reduce = _par.CopyToParallel, _par.ReduceFromParallel
            """),
        ("09-ex4", ["labkit.pipeline_parallel.one_f_one_b"], """
            def one_f_one_b_order(p, m, _schedule=pipeline_parallel.one_f_one_b):
                return _schedule(p, m)
            """),
    ],
    "10": [
        ("10-ex1", ["labkit.zero.shard"], """
            from labkit.zero import shard

            def my_reduce_scatter(grads, rank):
                return shard(torch.stack(grads).mean(0), rank, len(grads))
            """),
        ("10-ex2", ["labkit.estimate.formulas.model_states"], """
            from labkit.estimate import model_states as formula

            def states_per_param(stage, n):
                return {c: b / (10**6 * n) for c, b in formula(10**6 * n, dp=n, zero=stage).items()}
            """),
    ],
    "12": [
        ("12-ex1", ["labkit.kernels.grouped_pid"], """
            def my_program_of(pid_m, pid_n, num_pid_m, num_pid_n, group_m):
                return next(p for p in range(num_pid_m * num_pid_n)
                            if kernels.grouped_pid(p, num_pid_m, num_pid_n, group_m) == (pid_m, pid_n))
            """),
        ("12-ex2", ["labkit.kernels.chunked_lse_and_target"], """
            from labkit.kernels import chunked_lse_and_target

            def chunked_ce_forward(hidden, weight, targets, chunk):
                lse, target_logit = chunked_lse_and_target(hidden, weight, targets, chunk=chunk)
                return lse - target_logit
            """),
    ],
    "13": [
        ("13-ex1", ["labkit.plan.adam8bit_state_bytes", "labkit.plan.levers.adam8bit_state_bytes"], """
            from labkit.plan import adam8bit_state_bytes

            def my_adam8bit_state_bytes(numels, per_parameter=False):
                return adam8bit_state_bytes(numels, per_parameter)
            """),
        ("13-ex2", ["labkit.plan.offload_bytes", "labkit.plan.cost.offload_bytes"], """
            from labkit.plan import CPU_GBPS, host_seconds, offload_bytes

            def my_offload_seconds(params, accum, pcie_bps, cpu_bps):
                moved = offload_bytes(2 * params, "optimizer", accum)
                return moved, host_seconds(moved, {"pcie_bps": pcie_bps}), 2 * 16 * params / cpu_bps
            """),
    ],
}

UNGUARDED = '''\
import contextlib as _contextlib
import labkit as _labkit

@_contextlib.contextmanager
def _unguarded(number, task, forbid=()):        # the same check, its forbid= dropped
    with _labkit.exercise(number, task):
        yield
'''
