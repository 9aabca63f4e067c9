"""The training levers beyond notebooks 01-10's: each a small function with its source. Four change what a
step keeps and live in labkit.estimate.levers, used where the moments of a step are built (re-exported
here); the others are priced here. tests/test_plan.py holds each to a measurement of the real thing at
tiny size (lk.track around PyTorch's, bitsandbytes' or labkit's own implementation).

    fused_step            the optimizer step inside backward: one parameter's gradient at a time
    adam8bit_state_bytes  bitsandbytes' 8-bit AdamW, block by block, small tensors kept in 32 bits
    paged_optimizer       bitsandbytes' paged state: resident while the card has room, else on the host
    offloaded_activations the layers' saved activations in pinned host memory (notebook 04's hooks)
    loss_terms            chunked or fused cross-entropy: the logits' bytes at a large vocabulary
    eager_score_bytes     eager attention keeps the score matrix; SDPA's flash kernel does not
"""
from __future__ import annotations

from ..estimate.levers import (CE_CHUNK, OFFLOAD_IN_FLIGHT, OUTPUT_CHUNKS, eager_score_bytes, fused_step_moments,
                               loss_terms, offloaded_activations)

__all__ = ["OPTIMIZERS", "MIN_8BIT_SIZE", "BLOCK_8BIT", "CE_CHUNK", "OUTPUT_CHUNKS", "OFFLOAD_IN_FLIGHT",
           "fused_step_moments", "eager_score_bytes", "loss_terms", "offloaded_activations",
           "adam8bit_state_bytes", "paged_optimizer", "fused_step_possible"]

# what the planner searches (labkit.estimate prices each; "paged-" ones are bitsandbytes' paged versions)
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit")
# bitsandbytes Optimizer8bit: tensors with fewer elements than min_8bit_size=4096 keep 32-bit state;
# the others are quantized in blocks of 256 with one fp32 absmax each (bitsandbytes/optim/optimizer.py)
MIN_8BIT_SIZE, BLOCK_8BIT = 4096, 256


def adam8bit_state_bytes(numels, per_parameter=False):
    """Bytes of bitsandbytes' AdamW8bit state for parameters of `numels` elements: per tensor of at least
    MIN_8BIT_SIZE elements, two uint8 moments and two fp32 absmax per block of BLOCK_8BIT (2 + 8/256
    bytes per element); smaller tensors (norms at small widths) two fp32 moments (8 bytes per element).
    Each optimizer holding 8-bit state has its two 256-entry fp32 quantization maps (2 KiB), shared by
    its tensors: once for one optimizer over every parameter; once per 8-bit tensor with `per_parameter`,
    one optimizer per parameter as the step fused into backward makes them (torchtune's optimizer_in_bwd,
    labkit.plan.verify.Step)."""
    total, eight = 0, 0
    for n in numels:
        if n < MIN_8BIT_SIZE:
            total += 8 * n
        else:
            total += 2 * n + 2 * 4 * -(-n // BLOCK_8BIT)
            eight += 1
    return total + 2 * 256 * 4 * (eight if per_parameter else min(eight, 1))


def paged_optimizer(state_bytes, device_free):
    """(resident, on the host) bytes of a paged optimizer's state (bitsandbytes' paged optimizers,
    Dettmers et al. 2023 sec. 3 "Paged Optimizers": NVIDIA unified memory, cudaMallocManaged). The state
    lives outside PyTorch's caching allocator (torch.cuda.max_memory_allocated never counts it): while the
    card has room it stays resident and nothing changes; when it does not, the driver evicts pages to the
    host and pages them back as the step reads them. `device_free`: what the step leaves of the card."""
    resident = max(0, min(state_bytes, device_free))
    return resident, state_bytes - resident


def fused_step_possible(levers):
    """Whether the optimizer step can run inside backward: not with accumulation (each gradient must be
    complete when its hook steps it: torchtune's optimizer_in_bwd "Requires gradient_accumulation_steps=1")
    and not with an optimizer that runs on the host (offload already steps there)."""
    return levers.get("grad_accum", 1) == 1 and not levers.get("offload")
