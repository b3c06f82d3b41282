"""The LM-head loss's own Triton kernels (ops/lm_head.py), beside the cross-entropy kernels it runs on its
chunks of logits (cross_entropy.py): the forward over vocabulary slices (lce_sliced), whose rows' statistics
are merged slice by slice, and the backward's scaling by the upstream gradient."""

from __future__ import annotations

import triton
import triton.language as tl

from .cross_entropy import LN2, _flags, _scalars, row_lse, softcapped, store_rows
from .launch import launch
from .rows import row_exp, safe_max


@triton.jit
def ce_fwd_slice(
    x_ptr,
    t_ptr,
    w_ptr,
    wsum_ptr,
    run_ptr,
    part_ptr,
    loss_ptr,
    z_ptr,
    lse_ptr,
    n_rows,
    v,
    nc,
    col0,
    sx,
    ignore_index,
    smoothing,
    cap,
    zl,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ZLOSS: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    PART: tl.constexpr,
):
    """ce_fwd over the rows' classes [col0, col0 + nc) of v, x_ptr their logits (nc columns a row): the
    slice's logsumexp, target logit and (SMOOTH) sum of w_j * z_j merged into the running ones at run_ptr
    (3 x n_rows fp32; FIRST: none yet). LAST (the rows' last slice): the rows' loss, z-loss and logsumexp
    stored as ce_fwd stores them, else the running numbers. PART: each row's largest z on the slice stored
    at part_ptr too (the skip's test, lm_head.py)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    base = x_ptr + row * sx
    lse, sum_z, top = row_lse(base, row_ok, nc, w_ptr + col0, cap, ROWS, BLOCK_N, SMOOTH, WEIGHT, SOFTCAP)
    if PART:
        tl.store(part_ptr + row, top, mask=row_ok)
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    inside = keep & (t >= 0) & (t < v)
    here = inside & (t >= col0) & (t < col0 + nc)
    z_t = tl.load(base + tl.where(here, t - col0, 0), mask=here, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = softcapped(z_t, cap)
    z_t = tl.where(here, z_t, 0.0)
    if not FIRST:  # lse = log(exp(running) + exp(slice's)), -inf where both are
        run_lse = tl.load(run_ptr + row, mask=row_ok, other=0.0)
        m = tl.maximum(run_lse, lse)
        ms = safe_max(m)
        lse = ms + tl.math.log2(row_exp(run_lse - ms) + row_exp(lse - ms)) * LN2
        lse = tl.where(m == float("-inf"), m, lse)
        z_t += tl.load(run_ptr + n_rows + row, mask=row_ok, other=0.0)
        if SMOOTH:
            sum_z += tl.load(run_ptr + 2 * n_rows + row, mask=row_ok, other=0.0)
    if LAST:
        tt = tl.where(inside, t, 0)
        store_rows(row, row_ok, keep, inside, tt, lse, z_t, sum_z, w_ptr, wsum_ptr, loss_ptr, z_ptr, lse_ptr, v,
                   smoothing, zl, SMOOTH, WEIGHT, ZLOSS)  # fmt: skip
    else:
        tl.store(run_ptr + row, lse, mask=row_ok)
        tl.store(run_ptr + n_rows + row, z_t, mask=row_ok)
        if SMOOTH:
            tl.store(run_ptr + 2 * n_rows + row, sum_z, mask=row_ok)


def slice_forward(x, t, w, wsum, o, run, rows_loss, rows_z, lse, col0: int, v: int, shape, part=None) -> None:
    """ce_fwd_slice over (M, nc) logits x, the classes [col0, col0 + nc) of v, slices taken in order: the
    running numbers in run (3, M) until the last slice, which stores the (M,) buffers as rows_forward; each
    row's largest z on the slice into part (M,) where given."""
    m, nc = x.shape
    rows, block, warps, _ = shape
    eps, cap, zl = _scalars(o)
    args = (x, t, w if w is not None else x, wsum, run, part if part is not None else run, rows_loss, rows_z, lse)
    args += (m, v, nc, col0, x.stride(0))
    meta = dict(ROWS=rows, BLOCK_N=block, num_warps=warps, FIRST=col0 == 0, LAST=col0 + nc == v, PART=part is not None)
    meta |= _flags(o, w)
    launch(ce_fwd_slice, (-(-m // rows),), args + (o.ignore_index, eps, cap, zl), meta)


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
