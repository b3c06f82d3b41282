"""Kernels on one rank's slice of logits split along the classes across ranks (distributed/merge.py): the slice is
(M, V_r) of the full (M, V) rows. The statistics that cross ranks are per row, so each kernel is a row sweep
over the slice alone, and the merge of the ranks' statistics is O(M) work between them.

Traffic, on the slice:
  shard_stats   1 read: each row's max of z (z = c * tanh(x / c) with a softcap, else x) and sum of
                exp(z - max), and with SMOOTH the row's sum of w_j * z_j (w = 1 without class weights); or
                with DOT the row's sum of x_j * d_j (d = dy, x = y: the softmax backward's) or of d_j
                (LOGDOT: log_softmax's).
  shard_apply   1 read + 1 write (2 reads for the backwards), from per-row numbers merged across ranks, the
                row's max m and log of its sum of exp(z - m), ls (their sum, the logsumexp, is never formed:
                rounded to fp32 it would cost x - lse an error that grows with |x|):
                MODE 0 softmax   y = exp((x - m) - ls)
                MODE 1 log       y = (x - m) - ls
                MODE 2 dlogits   d = a * p - b * [j == t] - cc * w_j, p = exp((z - m) - ls); times
                                 (1 - (z / c)^2) with a softcap (the cross-entropy's, see cross_entropy.py)
                MODE 3 softmax backward      dx = y * (dy - s)
                MODE 4 log_softmax backward  dx = dy - exp(y) * s
A row whose max is -inf (-inf on every rank; its ls is 0) gives softmax 0, log_softmax -inf; t holds each
row's target within the slice, -1 where another rank holds it and -2 where the row is ignored (dlogits 0).
Rows are (M, V_r) with unit stride along V_r; programs take ROWS rows and sweep V_r in BLOCK_N chunks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import launch
from .rows import row_exp, row_max_sum, safe_max, softcapped


@triton.jit
def shard_stats(
    x_ptr,
    d_ptr,
    w_ptr,
    m_ptr,
    s_ptr,
    sum_ptr,
    n_rows,
    v,
    sx,
    sd,
    cap,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    LOGDOT: tl.constexpr,
):
    """m_ptr, s_ptr: each row's max z and sum of exp(z - max) (not with DOT or LOGDOT); sum_ptr: its weighted
    sum of z (SMOOTH), of x * d (DOT) or of d (LOGDOT), fp32."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    if DOT or LOGDOT:
        c = tl.arange(0, BLOCK_N)[None, :]
        acc = tl.zeros([ROWS], tl.float32)
        for j in range(0, tl.cdiv(v, BLOCK_N)):
            cols = j * BLOCK_N + c
            ok = row_ok[:, None] & (cols < v)
            d = tl.load(d_ptr + row[:, None] * sd + cols, mask=ok, other=0.0).to(tl.float32)
            if DOT:
                d = tl.load(x_ptr + row[:, None] * sx + cols, mask=ok, other=0.0).to(tl.float32) * d
            acc += tl.sum(d, axis=1)
        tl.store(sum_ptr + row, acc, mask=row_ok)
    else:
        m, s, acc = row_max_sum(x_ptr + row * sx, row_ok, v, w_ptr, cap, ROWS, BLOCK_N, SMOOTH, WEIGHT, SOFTCAP)
        tl.store(m_ptr + row, m, mask=row_ok)
        tl.store(s_ptr + row, s, mask=row_ok)
        if SMOOTH:
            tl.store(sum_ptr + row, acc, mask=row_ok)


@triton.jit
def shard_apply(
    x_ptr,
    d_ptr,
    out_ptr,
    m_ptr,
    ls_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    t_ptr,
    w_ptr,
    n_rows,
    v,
    sx,
    sd,
    so,
    cap,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """out = MODE's function of the slice x (and d: dy in the backwards) and the row's merged numbers: m
    (every mode: a row whose m is -inf is masked), ls (modes 0-2), a, b, cc and t (mode 2), s in a_ptr
    (modes 3, 4). out may be x (in place)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    m = tl.load(m_ptr + row, mask=row_ok, other=0.0)
    masked = m == float("-inf")  # (a row -inf on every rank: exp(-inf) = 0; its gradient 0, whatever dy holds)
    m = safe_max(m)
    if MODE <= 2:
        ls = tl.load(ls_ptr + row, mask=row_ok, other=0.0)
    if MODE >= 2:
        a = tl.load(a_ptr + row, mask=row_ok, other=0.0)
    if MODE == 2:
        b = tl.load(b_ptr + row, mask=row_ok, other=0.0)
        cc = tl.load(c_ptr + row, mask=row_ok, other=0.0)
        t = tl.load(t_ptr + row, mask=row_ok, other=-2).to(tl.int32)
        keep = t != -2
    c = tl.arange(0, BLOCK_N)[None, :]
    for j in range(0, tl.cdiv(v, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < v)
        x = tl.load(x_ptr + row[:, None] * sx + cols, mask=ok, other=0.0).to(tl.float32)
        if MODE == 0:
            y = row_exp((x - m[:, None]) - ls[:, None])
        elif MODE == 1:
            y = (x - m[:, None]) - ls[:, None]
        elif MODE == 2:
            if SOFTCAP:
                x = softcapped(x, cap)
            y = a[:, None] * row_exp((x - m[:, None]) - ls[:, None]) - b[:, None] * (cols == t[:, None]).to(tl.float32)
            if SMOOTH:
                if WEIGHT:
                    y -= cc[:, None] * tl.load(w_ptr + cols, mask=cols < v, other=0.0).to(tl.float32)
                else:
                    y -= cc[:, None]
            if SOFTCAP:
                r = x / cap
                y = y * (1.0 - r * r)
            y = tl.where(keep[:, None], y, 0.0)
        else:
            dy = tl.load(d_ptr + row[:, None] * sd + cols, mask=ok, other=0.0).to(tl.float32)
            if MODE == 3:
                y = tl.where(masked[:, None], 0.0, x * (dy - a[:, None]))
            else:
                y = tl.where(masked[:, None], 0.0, dy - row_exp(x) * a[:, None])
        tl.store(out_ptr + row[:, None] * so + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def stats(x, d, w, m, s, sums, cap, shape, *, smooth=False, dot=False, logdot=False) -> None:
    """shard_stats over (M, V_r) x (and d) into the (M,) fp32 buffers m, s and sums (placeholders where the
    flags do not ask for them)."""
    n, v = x.shape
    rows, block, warps, _ = shape
    d = d if d is not None else x
    args = (x, d, w if w is not None else x, m, s, sums, n, v, x.stride(0), d.stride(0), float(cap or 1.0))
    meta = dict(ROWS=rows, BLOCK_N=block, num_warps=warps, SMOOTH=smooth, WEIGHT=w is not None)
    meta |= dict(SOFTCAP=cap is not None, DOT=dot, LOGDOT=logdot)
    launch(shard_stats, (-(-n // rows),), args, meta)


def apply(mode: int, x, d, out, m, ls, a, b, cc, t, w, cap, shape, *, smooth=False) -> None:
    """shard_apply: out (M, V_r) from x (and d) and the per-row numbers (placeholders where MODE reads
    none)."""
    n, v = x.shape
    rows, block, warps, _ = shape
    d = d if d is not None else x
    args = (x, d, out, m, ls, a, b, cc, t, w if w is not None else x, n, v, x.stride(0), d.stride(0))
    args += (out.stride(0), float(cap or 1.0))
    meta = dict(ROWS=rows, BLOCK_N=block, num_warps=warps, MODE=mode, SMOOTH=smooth, WEIGHT=w is not None)
    meta |= dict(SOFTCAP=cap is not None)
    launch(shard_apply, (-(-n // rows),), args, meta)
