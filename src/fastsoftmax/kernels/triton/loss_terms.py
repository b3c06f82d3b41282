"""The loss kernels' per-row terms (cross_entropy.py, lm_head.py): the loss (row_terms), the logsumexp kept
for the backward (store_lse, split_lse: fp64 in the cross-entropy stats, exact), the backward's numbers
(row_grads) and dlogits. Formulas: cross_entropy.py's docstring."""

from __future__ import annotations

import triton
import triton.language as tl

from .rows import row_exp, safe_max


@triton.jit
def row_terms(m, ls, z_t, sum_z, t, keep, inside, w_ptr, wsum_ptr, v, smoothing, zl, SMOOTH: tl.constexpr,
              WEIGHT: tl.constexpr, ZLOSS: tl.constexpr):  # fmt: skip
    """Each row's (ce, z-loss, w_t) from its logsumexp as m + ls (m: the row's max, 0 where it is -inf;
    ls: the log of its sum of exp(z - m)), target logit and (SMOOTH) sum of w_j * z_j, by the module's
    formulas; 0 for rows not kept (ignored, or past the end). lse - z_t is taken as (m - z_t) + ls: exact in
    m - z_t, so the loss keeps its precision whatever the logits' common offset."""
    w_t = 1.0
    if WEIGHT:
        w_t = tl.load(w_ptr + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    lse = m + ls
    loss = w_t * ((m - z_t) + ls)
    if SMOOTH:
        wsum = v * 1.0  # (v == 1 arrives as a constexpr)
        if WEIGHT:
            wsum = tl.load(wsum_ptr)
        loss = (1.0 - smoothing) * loss + (smoothing / v) * (lse * wsum - sum_z)
    loss = tl.where(keep, loss, 0.0)
    zr = tl.zeros_like(lse)
    if ZLOSS:
        zr = tl.where(keep, zl * lse * lse, 0.0)
    return loss, zr, w_t


@triton.jit
def store_lse(lse_ptr, m, ls, mask):
    """Store each row's logsumexp m + ls, summed in lse_ptr's dtype: a float64 stats buffer holds it exactly
    (m is a logit), and the backward splits it again (split_lse)."""
    ty = lse_ptr.dtype.element_ty
    tl.store(lse_ptr, m.to(ty) + ls.to(ty), mask=mask)


@triton.jit
def split_lse(lse):
    """A logsumexp as loaded (float64 from a stats buffer, or float32) as float32 (hi, lo), hi + lo = lse to
    within float32's precision of lo: p = exp((z - hi) - lo) keeps its precision however large hi is. lo is 0
    where hi is not finite (an all -inf row, +inf, NaN)."""
    hi = lse.to(tl.float32)
    lo = (lse - hi).to(tl.float32)
    return hi, tl.where((hi > float("-inf")) & (hi < float("inf")), lo, 0.0)


@triton.jit
def row_grads(row, row_ok, t_ptr, lse_ptr, g_ptr, g_stride, cnt_ptr, w_ptr, wsum_ptr, ignore_index, v, smoothing, zl,
              idx_ptr, MEAN: tl.constexpr, SMOOTH: tl.constexpr, WEIGHT: tl.constexpr, ZLOSS: tl.constexpr,
              PICKED: tl.constexpr):  # fmt: skip
    """The backward's numbers of each row: (t, keep, inside, lse, lo, a, b, cc), dz_j = a p_j - b [j == t] - cc w_j
    (the module's formula; g_ce and g_z divided for the mean by cnt_ptr[2] and cnt_ptr[0]). PICKED: row i's
    target, logsumexp and upstream gradient are those of row idx_ptr[i] (int64; the LM-head loss's skip
    gathers a tile's live rows, and its dlogits read their numbers in place)."""
    if PICKED:
        row = tl.load(idx_ptr + row, mask=row_ok, other=0)
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    inside = keep & (t >= 0) & (t < v)
    lse, lo = split_lse(tl.load(lse_ptr + row, mask=row_ok, other=0.0))
    g = tl.where(keep, tl.load(g_ptr + row * g_stride, mask=keep, other=0.0).to(tl.float32), 0.0)
    g_ce = g
    g_z = g
    if MEAN:
        g_ce = g / tl.load(cnt_ptr + 2).to(tl.float32)  # (the counts: float64 in the stats)
        g_z = g / tl.load(cnt_ptr).to(tl.float32)
    w_t = 1.0
    if WEIGHT:
        w_t = tl.load(w_ptr + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    b = g_ce * w_t
    a = b
    cc = g_ce * 0.0
    if SMOOTH:
        wsum = v * 1.0  # (v == 1 arrives as a constexpr)
        if WEIGHT:
            wsum = tl.load(wsum_ptr)
        b = (1.0 - smoothing) * b
        cc = g_ce * (smoothing / v)
        a = b + cc * wsum
    if ZLOSS:  # (a fully masked row: p = 0 and lse taken as 0, as in dlogits, so 2 k lse p adds 0, not NaN)
        a += g_z * 2.0 * zl * safe_max(lse)
    return t, keep, inside, lse, lo, a, b, cc


@triton.jit
def dlogits(z, hot, lse_safe, lo, a, b, cc, wj, keep, cap, SMOOTH: tl.constexpr, WEIGHT: tl.constexpr,
            SOFTCAP: tl.constexpr):  # fmt: skip
    """A block's dlogits from its (softcapped) logits z, where each row's target is (hot), the rows' numbers
    (row_grads: the logsumexp as lse_safe + lo) and the classes' weights wj (SMOOTH and WEIGHT; a row of
    them); 0 in rows not kept."""
    p = row_exp((z - lse_safe[:, None]) - lo[:, None])
    d = a[:, None] * p - b[:, None] * hot.to(tl.float32)
    if SMOOTH:
        if WEIGHT:
            d -= cc[:, None] * wj
        else:
            d -= cc[:, None]
    if SOFTCAP:
        r = z / cap
        d = d * (1.0 - r * r)
    return tl.where(keep[:, None], d, 0.0)
