import json
import os
import pathlib

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


NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


def code_cells(path):
    """(index, source) of each code cell of the notebook at `path`, IPython magics and shell escapes left out."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            # IPython magics and shell escapes are not Python
            yield i, "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))


def notebook_cell(name, text):
    """The source of the one code cell of notebook `name` (in notebooks/) that contains `text`."""
    found = [src for _, src in code_cells(NOTEBOOKS_DIR / name) if text in src]
    assert len(found) == 1, f"{name}: {len(found)} code cells contain {text!r}"
    return found[0]
