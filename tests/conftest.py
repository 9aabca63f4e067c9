import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

if not torch.cuda.is_available():          # before anything imports triton (see labkit/flash.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


def steady_step(model, opt, ids):
    """A training step function on a fixed batch, already run once (so the optimizer state exists)."""
    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    return step


@pytest.fixture
def tiny_llama():
    """A tiny Llama, an AdamW optimizer, and its steady-state step."""
    import labkit as lk
    model = lk.models.build("llama-2-7b", "tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    return model, opt, steady_step(model, opt, next(lk.data.batches(2, 64)))
