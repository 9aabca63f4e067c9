"""Log the ATen operations a block of code runs: what an exercise check reads to see *how* an answer computed.

    with OpLog() as log:
        answer(q, k, v)
    log.names()             # ["mm", "div", "_softmax", ...], in the order they ran
    log.matmuls()           # [(shape of A, shape of B)] of every matrix product (mm, bmm, addmm, baddbmm)
    log.read(lse)           # True if some operation took `lse` (or a view of it) as an argument

A `TorchDispatchMode` sees every operation below autograd, whatever Python called it (`@`, `torch.matmul`,
`F.linear`, an nn.Module). Each `Op` keeps names, shapes and data pointers, never a tensor, so logging
changes no tensor's lifetime and a `lk.track()` around the same block measures the same peak.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpLog", "Op", "MATMULS"]

# The matrix products that `@`, matmul, linear and einsum run as, and where their two operands sit
# among the tensor arguments: addmm(bias, A, B) and baddbmm(bias, A, B) add a first one.
MATMULS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


@dataclasses.dataclass
class Op:
    """One ATen operation: its name (the overload packet's: "mm", "_softmax"), the shapes and data pointers
    of its tensor arguments in order, those in lists and keywords included (a pointer is None where a tensor
    has no data: fake, meta or empty), and
    whether autograd was recording when it ran."""
    name: str
    shapes: list
    pointers: list
    grad: bool


def _pointer(t):
    try:
        return t.data_ptr() or None             # meta and empty tensors: 0
    except RuntimeError:                        # FakeTensor: a shape without storage
        return None


class OpLog(TorchDispatchMode):
    """Every ATen operation that runs inside the block, in order, as `Op`s in `ops`."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]   # cat's lists, out=
        self.ops.append(Op(func.overloadpacket.__name__, [tuple(t.shape) for t in tensors],
                           [_pointer(t) for t in tensors], torch.is_grad_enabled()))
        return func(*args, **(kwargs or {}))

    def names(self):
        """The operations' names, in the order they ran."""
        return [op.name for op in self.ops]

    def matmuls(self):
        """(shape of A, shape of B) of every matrix product A @ B that ran, in order."""
        return [(op.shapes[MATMULS[op.name][0]], op.shapes[MATMULS[op.name][1]])
                for op in self.ops if op.name in MATMULS]

    def read(self, tensor):
        """True if an operation took `tensor`, or a view of it starting at its first element, as an argument."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        pointer = _pointer(tensor)
        return pointer is not None and any(pointer in op.pointers for op in self.ops)
