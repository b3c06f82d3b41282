"""The LM-head loss's own Triton kernels (ops/lm_head.py), beside the cross-entropy kernels it runs on its
chunks and slices of logits (cross_entropy.py): the loss's forward with no logits in memory (lse_gemm, then
lse_merge: lce_fused), and the backward's scaling by the upstream gradient."""

from __future__ import annotations

import triton
import triton.language as tl

from ...heuristics import lm_head as rules
from ...heuristics import poisoning
from ...heuristics.device import of_tensor
from .cross_entropy import weight_sum
from .launch import launch
from .loss_terms import dlogits, row_grads, row_terms, store_lse
from .rows import LN2, merge_stats, row_exp, safe_max, softcapped


@triton.jit
def logits_block(x_ptr, w_ptr, b_ptr, r64, row_ok, c, c_ok, d, sxn, sxk, swv, swk, cap, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                 PRECISION: tl.constexpr, WIDEN: tl.constexpr):  # fmt: skip
    """A BM x BN block of logits, x's rows r64 against W's classes c: x @ W^T (+ b) by tl.dot over d in BK
    steps, fp32 sums rounded to x's dtype as F.linear rounds them, softcapped with SOFTCAP, -inf past the
    classes (c_ok). lse_gemm and dlogits_gemm both make their logits here, with the same launch shape, so
    the backward's logits are the forward's bit for bit. WIDEN (Triton's interpreter, whose 16-bit tl.dot
    returns garbage): the operands widened to fp32 first, the same products and fp32 sums."""
    ks = tl.arange(0, BK)
    c64 = c.to(tl.int64)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, d, BK):
        k = k0 + ks
        k_ok = k < d
        a = tl.load(x_ptr + r64[:, None] * sxn + k[None, :] * sxk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + c64[None, :] * swv + k[:, None] * swk, mask=c_ok[None, :] & k_ok[:, None], other=0.0)
        if WIDEN:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    z = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    if SOFTCAP:
        z = softcapped(z, cap)
    return tl.where(c_ok[None, :], z, float("-inf"))


@triton.jit
def lse_gemm(
    x_ptr,
    w_ptr,
    b_ptr,
    t_ptr,
    cw_ptr,
    part_ptr,
    top_ptr,
    n,
    v,
    d,
    sxn,
    sxk,
    swv,
    swk,
    per,
    cols,
    splits,
    ignore_index,
    cap,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BIAS: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TOPS: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    """BM rows of x against the classes [s * per, s * per + per) of W (s: the program's split): the logits
    z = x @ W^T (+ b) made BN classes at a time by tl.dot in fp32, rounded to x's dtype as F.linear rounds
    them (then softcapped with SOFTCAP), each block folded into the rows' running max and sum of exponentials,
    their target's z and (SMOOTH) their sum of w_j * z_j (w = 1 without WEIGHT); the four stored per split
    at part_ptr (4, splits, n) for lse_merge. TOPS (the skip): each row's largest z on each slice of
    ``cols`` classes into top_ptr (slices, n), per a multiple of cols."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < n
    r64 = rows.to(tl.int64)
    cs = tl.arange(0, BN)
    t = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    z_t = tl.zeros([BM], tl.float32)
    sum_z = tl.zeros([BM], tl.float32)
    top = tl.full([BM], float("-inf"), tl.float32)
    split = tl.program_id(1)
    v_lo = split * per
    v_hi = tl.minimum(v_lo + per, v)
    for v0 in range(v_lo, v_hi, BN):
        c = v0 + cs
        c_ok = c < v_hi
        z = logits_block(x_ptr, w_ptr, b_ptr, r64, row_ok, c, c_ok, d, sxn, sxk, swv, swk, cap, BM, BN, BK, BIAS,
                         SOFTCAP, PRECISION, WIDEN)  # fmt: skip
        z_t += tl.sum(tl.where(c[None, :] == t[:, None], z, 0.0), axis=1)
        if SMOOTH:
            if WEIGHT:
                wj = tl.load(cw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
                sum_z += tl.sum(tl.where(c_ok[None, :], z * wj[None, :], 0.0), axis=1)
            else:
                sum_z += tl.sum(tl.where(c_ok[None, :], z, 0.0), axis=1)
        m2 = tl.max(z, axis=1)
        m, s = merge_stats(m, s, m2, tl.sum(row_exp(z - safe_max(m2)[:, None]), axis=1))
        if TOPS:
            top = tl.maximum(top, m2)
            if (v0 + BN - v_lo) % cols == 0 or v0 + BN >= v_hi:  # the slice's last block
                tl.store(top_ptr + (v0 // cols) * n + r64, top, mask=row_ok)
                top = tl.full([BM], float("-inf"), tl.float32)
    out = part_ptr + split * n + r64
    tl.store(out, m, mask=row_ok)
    tl.store(out + splits * n, s, mask=row_ok)
    tl.store(out + 2 * splits * n, z_t, mask=row_ok)
    if SMOOTH:
        tl.store(out + 3 * splits * n, sum_z, mask=row_ok)


@triton.jit
def lse_merge(
    part_ptr,
    t_ptr,
    cw_ptr,
    wsum_ptr,
    loss_ptr,
    z_ptr,
    lse_ptr,
    n,
    v,
    splits,
    ignore_index,
    smoothing,
    zl,
    ROWS: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    ZLOSS: tl.constexpr,
):
    """lse_gemm's splits merged per row, then each row's ce (loss_ptr), z-loss (z_ptr, with ZLOSS) and
    logsumexp (lse_ptr), as ce_fwd's last slice writes them."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n
    r64 = rows.to(tl.int64)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    z_t = tl.zeros([ROWS], tl.float32)
    sum_z = tl.zeros([ROWS], tl.float32)
    for j in range(0, splits):
        at = part_ptr + j * n + r64
        m2 = tl.load(at, mask=row_ok, other=float("-inf"))
        s2 = tl.load(at + splits * n, mask=row_ok, other=0.0)
        m, s = merge_stats(m, s, m2, s2)
        z_t += tl.load(at + 2 * splits * n, mask=row_ok, other=0.0)
        if SMOOTH:
            sum_z += tl.load(at + 3 * splits * n, mask=row_ok, other=0.0)
    m = safe_max(m)
    ls = tl.math.log2(tl.where(row_ok, s, 1.0)) * LN2  # (rows past n: no log of 0)
    t = tl.load(t_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    inside = keep & (t >= 0) & (t < v)
    loss, zr, _ = row_terms(m, ls, z_t, sum_z, t, keep, inside, cw_ptr, wsum_ptr, v, smoothing, zl, SMOOTH, WEIGHT,
                            ZLOSS)  # fmt: skip
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    if ZLOSS:
        tl.store(z_ptr + rows, zr, mask=row_ok)
    store_lse(lse_ptr + rows, m, ls, row_ok)


@triton.jit
def dlogits_gemm(
    x_ptr,
    w_ptr,
    b_ptr,
    t_ptr,
    cw_ptr,
    wsum_ptr,
    lse_ptr,
    cnt_ptr,
    g_ptr,
    dl_ptr,
    idx_ptr,
    m,
    nc,
    col0,
    v,
    d,
    sxn,
    sxk,
    swv,
    swk,
    sdl,
    g_stride,
    ignore_index,
    smoothing,
    cap,
    zl,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BIAS: tl.constexpr,
    SMOOTH: tl.constexpr,
    MEAN: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ZLOSS: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    PICKED: tl.constexpr,
):
    """A tile's dlogits without its logits in memory: m rows of x against the nc classes of W's slice that
    starts at class col0 of v (w_ptr, b_ptr, cw_ptr at the slice; t_ptr, lse_ptr, g_ptr at the rows), each
    program a BM x BN block: its logits by logits_block (as lse_gemm made them), then ce_bwd's formula
    (row_grads, dlogits) from the rows' logsumexp and the counts at cnt_ptr; stored in x's dtype at dl_ptr
    (m, nc; row stride sdl) for the tile's gradient GEMMs. PICKED: row i's numbers are row idx_ptr[i]'s
    (row_grads; x's rows are gathered already)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row_ok = rows < m
    r64 = rows.to(tl.int64)
    c = tl.program_id(1) * BN + tl.arange(0, BN)
    c_ok = c < nc
    z = logits_block(x_ptr, w_ptr, b_ptr, r64, row_ok, c, c_ok, d, sxn, sxk, swv, swk, cap, BM, BN, BK, BIAS, SOFTCAP,
                     PRECISION, WIDEN)  # fmt: skip
    cw_all = cw_ptr - col0  # (the class weights from class 0: row_grads reads w_t)
    t, keep, inside, lse, lo, a, b, cc = row_grads(
        r64, row_ok, t_ptr, lse_ptr, g_ptr, g_stride, cnt_ptr, cw_all, wsum_ptr, ignore_index, v, smoothing, zl,
        idx_ptr, MEAN, SMOOTH, WEIGHT, ZLOSS, PICKED,
    )  # fmt: skip
    wj = 0.0
    if SMOOTH and WEIGHT:
        wj = tl.load(cw_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    hot = (c[None, :] + col0) == t[:, None]
    dl = dlogits(z, hot, safe_max(lse), lo, a, b, cc, wj, keep, cap, SMOOTH, WEIGHT, SOFTCAP)
    ok = row_ok[:, None] & c_ok[None, :]
    tl.store(dl_ptr + r64[:, None] * sdl + c[None, :], dl.to(dl_ptr.dtype.element_ty), mask=ok)


MERGE_ROWS = 256


def _gemm_meta(x, bias, o, cw, shape) -> dict:
    """The constexprs lse_gemm and dlogits_gemm share: their logits_block must compile alike."""
    import torch

    widen = not x.is_cuda
    precision = "ieee" if widen or x.dtype == torch.float32 else "tf32"  # (16-bit operands: unused)
    meta = dict(BM=shape.bm, BN=shape.bn, BK=shape.bk, num_warps=shape.warps, num_stages=shape.stages)
    meta |= dict(BIAS=bias is not None, SMOOTH=o.smoothing != 0.0, WEIGHT=cw is not None, SOFTCAP=o.softcap is not None)
    return meta | dict(PRECISION=precision, WIDEN=widen)


def loss_forward(x, weight, bias, t, cw, o, rows_loss, rows_z, lse, tops=None, cols: int = 0) -> None:
    """The LM-head loss's forward over every row and class in two launches, no logits in memory: each row's
    ce into rows_loss, z-loss into rows_z (with a z-loss), logsumexp into lse; with ``tops`` (slices, n),
    each row's largest z on each slice of ``cols`` classes (the skip)."""
    import torch

    n, d = x.shape
    v = weight.shape[0]
    shape = rules.fused_shape(n, v, x.element_size(), cols if tops is not None else 0, of_tensor(x).sm_count)
    part = torch.empty((4, shape.splits, n), dtype=torch.float32, device=x.device)
    meta = _gemm_meta(x, bias, o, cw, shape) | dict(TOPS=tops is not None)
    args = (x, weight, bias if bias is not None else x, t, cw if cw is not None else x, part)
    args += (tops if tops is not None else part,)
    args += (n, v, d, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), shape.per, max(cols, 1))
    args += (shape.splits, o.ignore_index, float(o.softcap or 1.0))
    launch(lse_gemm, (-(-n // shape.bm), shape.splits), args, meta)
    wsum = weight_sum(o, cw, part)
    meta = dict(ROWS=MERGE_ROWS, SMOOTH=meta["SMOOTH"], WEIGHT=meta["WEIGHT"], ZLOSS=o.z_loss != 0.0, num_warps=4)
    args = (part, t, cw if cw is not None else part, wsum, rows_loss, rows_z, lse, n, v, shape.splits, o.ignore_index)
    launch(lse_merge, (-(-n // MERGE_ROWS),), args + (float(o.smoothing), float(o.z_loss)), meta)


def slice_dlogits(x, w_s, b_s, t, cw, wsum, o, lse, tail, g, dl, col0: int, v: int, rows=None) -> None:
    """dlogits_gemm on one tile: rows x (x, t, lse, g: the group's) against the slice w_s (b_s) of classes
    from col0, into dl (rows, slice); cw the whole class weights, tail the counts (stats[n:]); ``rows``: x's
    row i is row rows[i] of t, lse and g (rows_backward's)."""
    m, d = x.shape
    nc = w_s.shape[0]
    shape = rules.fused_shape(m, v, x.element_size(), 0, of_tensor(x).sm_count)
    meta = _gemm_meta(x, b_s, o, cw, shape) | dict(MEAN=o.reduction == "mean", ZLOSS=o.z_loss != 0.0)
    meta["PICKED"] = rows is not None
    cw_s = cw[col0:] if cw is not None else x
    if poisoning():  # (tests: every element must be written by the kernel)
        dl.fill_(float("nan"))
    args = (x, w_s, b_s if b_s is not None else x, t, cw_s, wsum, lse, tail, g, dl, rows if rows is not None else t)
    args += (m, nc, col0, v, d, x.stride(0))
    args += (x.stride(1), w_s.stride(0), w_s.stride(1), dl.stride(0), g.stride(0) if g.dim() else 0, o.ignore_index)
    args += (float(o.smoothing), float(o.softcap or 1.0), float(o.z_loss))
    launch(dlogits_gemm, (-(-m // shape.bm), -(-nc // shape.bn)), args, meta)


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
