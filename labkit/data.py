"""The training corpus (Python standard-library source, built by data/build_corpus.py) and its tokenizer."""
from __future__ import annotations

import functools
import os
import pathlib

import torch
from .checks import count

__all__ = ["DATA_DIR", "text", "tokenizer", "hf_tokenizer", "tokens", "batches"]

_HERE = pathlib.Path(__file__).resolve().parent
# A checkout reads data/ at the repository's root; an installed wheel carries the same files as labkit/_data/.
_CHECKOUT = _HERE.parent / "data"
DATA_DIR = pathlib.Path(os.environ.get("LABKIT_DATA")
                        or (_CHECKOUT if (_CHECKOUT / "corpus.txt").exists() else _HERE / "_data"))


def _file(name):
    path = DATA_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `python data/build_corpus.py` or set LABKIT_DATA")
    return path


@functools.cache
def text():
    """The corpus as one string (about 1 MB)."""
    return _file("corpus.txt").read_text(encoding="utf-8")


@functools.cache
def tokenizer():
    """The byte-level BPE tokenizer trained on the corpus (`tokenizers.Tokenizer`, vocab 4096)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(_file("tokenizer.json")))


@functools.cache
def hf_tokenizer():
    """The same tokenizer wrapped for `transformers` (`PreTrainedTokenizerFast`, pad token set)."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer(), eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<pad>")


@functools.cache
def tokens():
    """The whole corpus as token ids, a 1-D int64 tensor."""
    return torch.tensor(tokenizer().encode(text()).ids, dtype=torch.long)


def batches(batch, seq, steps=None, split="train", seed=0, device="cpu"):
    """Random (batch, seq) windows of token ids from the train (first 90%) or val split; `steps` of them.

    For causal language models, pass the same tensor as input_ids and labels.
    """
    batch, seq = count("batch", batch), count("seq", seq)
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    ids = tokens()
    cut = int(len(ids) * 0.9)
    ids = ids[:cut] if split == "train" else ids[cut:]
    if seq >= len(ids):
        raise ValueError(f"seq must be shorter than the {split} split ({len(ids)} tokens), got {seq}")
    gen = torch.Generator().manual_seed(seed)
    step = 0
    while steps is None or step < steps:
        yield _window(ids, batch, seq, gen).to(device)   # no tensor stays alive in this frame
        step += 1


def _window(ids, batch, seq, gen):
    starts = torch.randint(0, len(ids) - seq, (batch,), generator=gen).tolist()
    return torch.stack([ids[s:s + seq] for s in starts])
