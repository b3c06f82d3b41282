"""Cross-entropy over rows of logits in Triton: the forward reads each row once and writes one loss and one
logsumexp per row; the backward reads each row once more and writes dlogits once, from the saved logsumexp.

Per row i with target t, V classes and label smoothing e:
  lse   = log sum_j exp(x_j)                     (max subtracted first; an all -inf row gives -inf)
  loss  = lse - (1 - e) * x_t - (e / V) * sum_j x_j     (0 for rows whose target is ignore_index)
  dx_j  = g * (exp(x_j - lse) - (1 - e) * [j == t] - e / V)     (g: the row's upstream gradient; 0 ignored)
Rows are (M, V) with unit stride along V; programs take ROWS rows and sweep V in BLOCK_N chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..heuristics import poisoning
from .softmax_fwd import _exp, _merge, _safe_max

LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def ce_fwd(
    x_ptr, t_ptr, loss_ptr, lse_ptr, n_rows, v, sx, ignore_index, smoothing,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
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
        s2 = tl.sum(_exp(x - _safe_max(m2)[:, None]), axis=1)
        m, s = _merge(m, s, m2, s2)
        if SMOOTH:
            sum_x += tl.sum(tl.where(ok, x, 0.0), axis=1)
    lse = _safe_max(m) + tl.math.log2(s) * LN2
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    x_t = tl.load(base + tl.where(keep, t, 0), mask=keep, other=0.0).to(tl.float32)
    loss = lse - x_t
    if SMOOTH:
        loss = lse - (1.0 - smoothing) * x_t - smoothing * (sum_x / v)
    tl.store(loss_ptr + row, tl.where(keep, loss, 0.0), mask=row_ok)
    tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def ce_bwd(
    x_ptr, t_ptr, lse_ptr, g_ptr, dx_ptr, n_rows, v, sx, sdx, g_stride, ignore_index, smoothing,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0)
    g = tl.load(g_ptr + row * g_stride, mask=keep, other=0.0).to(tl.float32)
    g = tl.where(keep, g, 0.0)
    lse_safe = _safe_max(lse)  # an all -inf row: exp(-inf - 0) = 0
    c = tl.arange(0, BLOCK_N)[None, :]
    for j in range(0, tl.cdiv(v, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < v)
        x = tl.load(x_ptr + row[:, None] * sx + cols, mask=ok, other=float("-inf")).to(tl.float32)
        p = _exp(x - lse_safe[:, None])
        hot = (cols == t[:, None]).to(tl.float32)
        if SMOOTH:
            d = p - (1.0 - smoothing) * hot - smoothing / v
        else:
            d = p - hot
        d = tl.where(keep[:, None], d * g[:, None], 0.0)
        tl.store(dx_ptr + row[:, None] * sdx + cols, d.to(dx_ptr.dtype.element_ty), mask=ok)


def _shape(v: int) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps): whole short rows per program, 4096-wide chunks for long ones."""
    block = min(triton.next_power_of_2(v), 4096)
    rows = max(1, min(16, 4096 // block))
    return rows, block, 4 if block * rows <= 2048 else 8


def forward(x, t, ignore_index: int, smoothing: float, shape: tuple[int, int, int]):
    """(loss per row fp32, lse per row fp32) of (M, V) logits x (unit stride along V) and (M,) targets;
    ``shape``: (ROWS, BLOCK_N, num_warps)."""
    import torch

    m, v = x.shape
    loss = torch.empty(m, dtype=torch.float32, device=x.device)
    lse = torch.empty(m, dtype=torch.float32, device=x.device)
    if poisoning():  # tests: every output element must be written by the kernel
        loss.fill_(float("nan"))
        lse.fill_(float("nan"))
    rows, block, warps = shape
    ce_fwd[(triton.cdiv(m, rows),)](x, t, loss, lse, m, v, x.stride(0), ignore_index, float(smoothing),
                                    ROWS=rows, BLOCK_N=block, SMOOTH=smoothing != 0.0, num_warps=warps)  # fmt: skip
    return loss, lse


def backward(x, t, lse, g, ignore_index: int, smoothing: float, dx, shape: tuple[int, int, int]):
    """Write dlogits of (M, V) logits into dx from the saved lse and the per-row upstream gradient g."""
    m, v = x.shape
    if poisoning():
        dx.fill_(float("nan"))
    rows, block, warps = shape
    ce_bwd[(triton.cdiv(m, rows),)](x, t, lse, g, dx, m, v, x.stride(0), dx.stride(0), g.stride(0) if g.dim() else 0,
                                    ignore_index, float(smoothing), ROWS=rows, BLOCK_N=block,
                                    SMOOTH=smoothing != 0.0, num_warps=warps)  # fmt: skip
    return dx
