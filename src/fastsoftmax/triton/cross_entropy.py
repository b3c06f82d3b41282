"""Cross-entropy over rows of logits in Triton: the forward reads each row once and writes one loss and one
logsumexp per row; the backward reads each row once more and writes dlogits once, from the saved logsumexp.

Per row i with target t, V classes and label smoothing e:
  lse   = log sum_j exp(x_j)                     (max subtracted first; an all -inf row gives -inf)
  loss  = lse - (1 - e) * x_t - (e / V) * sum_j x_j     (0 for rows whose target is ignore_index)
  dx_j  = g * (exp(x_j - lse) - (1 - e) * [j == t] - e / V)     (g: the row's upstream gradient; 0 ignored)
Rows are (M, V) with unit stride along V; programs take ROWS rows and sweep V in BLOCK_N chunks.

A forward is two launches: ce_fwd (the rows), then ce_finish (one program: the reduction over rows, the
number of rows not ignored, and whether every target is in range), so that the caller adds only
torch._assert_async; a backward is one (ce_bwd reads the upstream gradient, and for the mean the count,
from device memory). A target outside [0, V) never addresses memory (its row's x_t is taken as 0); the
caller raises from ce_finish's flag.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..heuristics import poisoning
from .launch import launch
from .softmax_fwd import merge_stats, row_exp, safe_max

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def ce_fwd(
    x_ptr,
    t_ptr,
    loss_ptr,
    lse_ptr,
    n_rows,
    v,
    sx,
    ignore_index,
    smoothing,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    base = x_ptr + row * sx
    c = tl.arange(0, BLOCK_N)[None, :]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    sum_x = tl.zeros([ROWS], tl.float32)
    for j in range(0, tl.cdiv(v, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < v)
        x = tl.load(base[:, None] + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m2 = tl.max(x, axis=1)
        s2 = tl.sum(row_exp(x - safe_max(m2)[:, None]), axis=1)
        m, s = merge_stats(m, s, m2, s2)
        if SMOOTH:
            sum_x += tl.sum(tl.where(ok, x, 0.0), axis=1)
    lse = safe_max(m) + tl.math.log2(s) * LN2
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    inside = keep & (t >= 0) & (t < v)  # an out-of-range target reads nothing (ce_finish flags it)
    x_t = tl.load(base + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    loss = lse - x_t
    if SMOOTH:
        loss = lse - (1.0 - smoothing) * x_t - smoothing * (sum_x / v)
    tl.store(loss_ptr + row, tl.where(keep, loss, 0.0), mask=row_ok)
    tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def ce_finish(
    loss_ptr, t_ptr, out_ptr, stats_ptr, n_rows, v, ignore_index, REDUCTION: tl.constexpr, BLOCK: tl.constexpr
):
    """One program over all rows, in a fixed order (deterministic): REDUCTION 0 writes each row's loss in
    out's dtype, 1 their sum, 2 their mean over rows not ignored (0 / 0 = NaN when all are, as torch);
    stats_ptr[0] = the number of rows not ignored, stats_ptr[1] = 1 if every target not ignored is in
    [0, v), else 0 (both as fp32)."""
    acc = tl.zeros([BLOCK], tl.float32)
    kept = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        ok = r < n_rows
        t = tl.load(t_ptr + r, mask=ok, other=ignore_index).to(tl.int64)
        keep = ok & (t != ignore_index)
        kept += keep.to(tl.int32)
        bad += (keep & ((t < 0) | (t >= v))).to(tl.int32)
        row_loss = tl.load(loss_ptr + r, mask=ok, other=0.0)
        if REDUCTION == 0:
            tl.store(out_ptr + r, row_loss.to(out_ptr.dtype.element_ty), mask=ok)
        else:
            acc += row_loss
    n_kept = tl.sum(kept, axis=0).to(tl.float32)
    if REDUCTION != 0:
        total = tl.sum(acc, axis=0)
        if REDUCTION == 2:
            total = total / n_kept
        tl.store(out_ptr, total.to(out_ptr.dtype.element_ty))
    tl.store(stats_ptr, n_kept)
    tl.store(stats_ptr + 1, (tl.sum(bad, axis=0) == 0).to(tl.float32))


@triton.jit
def ce_bwd(
    x_ptr,
    t_ptr,
    lse_ptr,
    g_ptr,
    dx_ptr,
    n_rows,
    v,
    sx,
    sdx,
    g_stride,
    ignore_index,
    smoothing,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    MEAN: tl.constexpr,
):
    """g_ptr: the upstream gradient, per row (g_stride 1) or one for all rows (g_stride 0); MEAN divides it by
    the number of rows not ignored, which the forward left at lse_ptr[n_rows]."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + row * g_stride, mask=keep, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.load(lse_ptr + n_rows)
    g = tl.where(keep, g, 0.0)
    lse_safe = safe_max(lse)  # an all -inf row: exp(-inf - 0) = 0
    c = tl.arange(0, BLOCK_N)[None, :]
    for j in range(0, tl.cdiv(v, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < v)
        x = tl.load(x_ptr + row[:, None] * sx + cols, mask=ok, other=float("-inf")).to(tl.float32)
        p = row_exp(x - lse_safe[:, None])
        hot = (cols == t[:, None]).to(tl.float32)
        if SMOOTH:
            d = p - (1.0 - smoothing) * hot - smoothing / v
        else:
            d = p - hot
        d = tl.where(keep[:, None], d * g[:, None], 0.0)
        tl.store(dx_ptr + row[:, None] * sdx + cols, d.to(dx_ptr.dtype.element_ty), mask=ok)


FINISH_BLOCK = 1024
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def forward(x, t, ignore_index: int, smoothing: float, reduction: str, out_dtype, shape: tuple[int, int, int]):
    """(loss, stats) of (M, V) logits x (unit stride along V) and (M,) targets: loss as the reduction asks
    (rows, or a scalar) in out_dtype; stats (M + 2,) fp32: each row's logsumexp, then the number of rows not
    ignored, then 1.0 if every target not ignored is in [0, V) (else 0.0). ``shape``: (ROWS, BLOCK_N,
    num_warps) of ce_fwd."""
    import torch

    m, v = x.shape
    rows_loss = torch.empty(m, dtype=torch.float32, device=x.device)
    stats = torch.empty(m + 2, dtype=torch.float32, device=x.device)
    out = torch.empty(m if reduction == "none" else (), dtype=out_dtype, device=x.device)
    if poisoning():  # tests: every output element must be written by the kernels
        for o in (rows_loss, stats, out):
            o.fill_(float("nan"))
    rows, block, warps = shape
    launch(
        ce_fwd,
        (-(-m // rows),),
        (x, t, rows_loss, stats, m, v, x.stride(0), ignore_index, float(smoothing)),
        dict(ROWS=rows, BLOCK_N=block, SMOOTH=smoothing != 0.0, num_warps=warps),
    )
    launch(
        ce_finish,
        (1,),
        (rows_loss, t, out, stats[m:], m, v, ignore_index),
        dict(REDUCTION=REDUCTIONS[reduction], BLOCK=FINISH_BLOCK, num_warps=4),
    )
    return out, stats


def backward(x, t, stats, g, ignore_index: int, smoothing: float, mean: bool, dx, shape: tuple[int, int, int]):
    """Write dlogits of (M, V) logits into dx from the forward's stats and the upstream gradient g: (M,) per
    row, or a 0-d tensor for every row (divided by the count of rows not ignored when ``mean``)."""
    m, v = x.shape
    if poisoning():
        dx.fill_(float("nan"))
    rows, block, warps = shape
    args = (
        x,
        t,
        stats,
        g,
        dx,
        m,
        v,
        x.stride(0),
        dx.stride(0),
        g.stride(0) if g.dim() else 0,
        ignore_index,
        float(smoothing),
    )
    launch(
        ce_bwd,
        (-(-m // rows),),
        args,
        dict(ROWS=rows, BLOCK_N=block, SMOOTH=smoothing != 0.0, MEAN=mean, num_warps=warps),
    )
    return dx
