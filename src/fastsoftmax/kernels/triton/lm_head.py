"""The LM-head loss's own Triton kernel (ops/lm_head.py), beside the cross-entropy kernels it runs on its
chunks and slices of logits (cross_entropy.py): the backward's scaling by the upstream gradient."""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import launch


@triton.jit
def scale_by(x_ptr, n, g_ptr, BLOCK: tl.constexpr):
    """x *= g in place, g read from device memory; nothing read or written when g == 1 (the usual upstream
    gradient of a loss): the LM-head loss's backward costs a launch then, not a pass over dW."""
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        v = tl.load(x_ptr + i, mask=ok).to(tl.float32)
        tl.store(x_ptr + i, (v * g).to(x_ptr.dtype.element_ty), mask=ok)


SCALE_BLOCK = 4096


def scale_(x, g) -> None:
    """x (contiguous) *= g (a 0-d tensor on x's device)."""
    n = x.numel()
    if n:
        launch(scale_by, (-(-n // SCALE_BLOCK),), (x, n, g), dict(BLOCK=SCALE_BLOCK, num_warps=4))
