"""Pipeline parallelism on N ranks (torchrun -m labkit.scripts.pipeline_parallel): GPipe and 1F1B.

A tiny Llama is split into one stage per rank (the embedding on the first, the norm and LM head on the
last). For each schedule and number of micro-batches m, every rank records when its stage ran each
forward and backward chunk and its peak memory; the last rank checks the loss against the unsplit model.
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import labkit as lk
from labkit.parallel import init, write_result

BATCH, SEQ = 16, 64
MICROBATCHES = (2, 4, 8)


class Stage(torch.nn.Module):
    """Decoder layers [lo, hi) of a transformers Llama, with the embedding or the head where they belong."""

    def __init__(self, model, lo, hi, first, last):
        super().__init__()
        self.embed = model.model.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(model.model.layers[lo:hi])
        self.rotary = model.model.rotary_emb
        self.norm, self.head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x):                      # ids (B, T) on the first stage, hidden (B, T, h) after
        h = self.embed(x) if self.embed is not None else x
        pe = self.rotary(h, torch.arange(h.shape[1], device=h.device)[None].expand(h.shape[0], -1))
        for layer in self.layers:              # attention_mask=None: SDPA's causal path
            h = layer(h, position_embeddings=pe, attention_mask=None)
        return self.head(self.norm(h)) if self.head is not None else h


def loss_fn(logits, ids):                      # the causal LM loss transformers computes
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def timed(stage, events):
    """Record (kind, chunk, start, end) of each forward and backward chunk this stage runs."""
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        original = getattr(stage, name)
        def wrapper(chunk, *args, _original=original, _kind=kind, **kwargs):
            t0 = time.perf_counter()
            out = _original(chunk, *args, **kwargs)
            events.append((_kind, chunk, t0, time.perf_counter()))
            return out
        setattr(stage, name, wrapper)


def main():
    dev = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = lk.models.build("llama-2-7b", "tiny", seed=0, num_hidden_layers=2 * world, device=dev)
    per = model.config.num_hidden_layers // world
    module = Stage(model, rank * per, (rank + 1) * per, rank == 0, rank == world - 1)
    ids = next(lk.data.batches(BATCH, SEQ, seed=0, device=dev))
    reference = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    runs = []
    for name, cls in (("GPipe", ScheduleGPipe), ("1F1B", Schedule1F1B)):
        for m in MICROBATCHES:
            stage = PipelineStage(module, rank, world, dev)
            schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn)
            for _ in range(2):                          # the first step warms up; the second is recorded
                events, losses = [], []
                timed(stage, events)
                module.zero_grad(set_to_none=True)
                dist.barrier()
                with lk.track(module) as mem:
                    t0 = time.perf_counter()
                    if rank == 0:
                        schedule.step(ids)
                    elif rank == world - 1:
                        schedule.step(target=ids, losses=losses)
                    else:
                        schedule.step()
                    t1 = time.perf_counter()
                stage = PipelineStage(module, rank, world, dev)   # fresh wrappers each time
                schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn)
            if rank == world - 1:
                loss = torch.stack(losses).mean().item()
                assert abs(loss - reference) < 1e-5, (name, m, loss, reference)
            busy = sum(e - s for _, _, s, e in events)
            runs.append(dict(schedule=name, m=m, rank=rank, start=t0, total=t1 - t0, busy=busy,
                             events=[(k, c, s - t0, e - t0) for k, c, s, e in events],
                             peak=mem.peak, peak_activations=mem.max_parts["activations"]))
    gathered = [None] * world
    dist.gather_object(runs, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        write_result(dict(world=world, microbatches=list(MICROBATCHES), reference_loss=reference,
                          runs=[r for per_rank in gathered for r in per_rank]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
