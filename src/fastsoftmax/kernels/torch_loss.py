"""The loss formulas in torch ops, differentiable where they say so: the torch backend's cross-entropy, the
LM-head loss's chunks on the CPU and in float64, the distributed path's merge, and the composites that
torch.func and create_graph run. The Triton kernels (kernels/triton/cross_entropy.py) compute the same.
Also the LM head's chunk of logits (one cuBLAS GEMM), for lm_head.py and the distributed head."""

from __future__ import annotations

import torch

from .. import heuristics
from ..core import dtypes
from ..core.reference import max_sum_torch


def capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _target_weight(t, keep, w, v: int, dtype):
    """(each row's target, clamped into [0, v) where ignored or out of range; its class weight or 1)."""
    tt = torch.where(keep, t, 0).clamp(0, max(v - 1, 0))
    return tt, (w.to(dtype)[tt] if w is not None else torch.ones((), dtype=dtype, device=t.device))


def max_log_sum(z):
    """(m, ls) per row of z: its max (max_sum_torch's, 0 where the row is all -inf) and the log of its sum of
    exp(z - m). The logsumexp is m + ls: -inf for an all -inf row, NaN for a row holding NaN or +inf.
    Differentiable to any order with finite gradients for an all -inf row (torch.func, create_graph)."""
    m, s = max_sum_torch(z)
    empty = s == 0  # (an all -inf row: the log of 1 there, whose gradient is 0, where log(0)'s would be 0 / 0)
    ls = torch.where(empty, float("-inf"), torch.where(empty, 1.0, s).log())
    return torch.where(m == float("-inf"), 0.0, m), ls


def split_lse(lse, wide):
    """A logsumexp (float64 from the stats, or ``wide``) as ``wide`` (hi, lo), hi + lo = lse: exp((z - hi) - lo)
    keeps its precision however large hi is (triton/loss_terms.split_lse). lo is 0 where hi is not finite."""
    hi = lse.to(wide)
    if lse.dtype == wide:
        return hi, None
    return hi, torch.where(hi.isfinite(), (lse - hi.to(lse.dtype)).to(wide), 0.0)


def loss_rows_torch(x, t, o, w=None):
    """(ce per row, z-loss per row, lse per row) of (M, V) logits, fp32 (fp64 for fp64 logits; lse fp64: the
    row's max plus the log of its sum, exact), with torch ops differentiable in x: the formulas of
    triton/cross_entropy.py (0 on ignored rows), lse - z_t taken as (max - z_t) + log(sum) (row_terms)."""
    wide = dtypes.wide(x.dtype)
    z = capped(x.to(wide), o.softcap)
    m, ls = max_log_sum(z)
    lse = m + ls
    t = t.long()
    keep = t != o.ignore_index
    tt, w_t = _target_weight(t, keep, w, x.shape[-1], wide)
    ce = w_t * ((m - z.gather(-1, tt[:, None]).squeeze(-1)) + ls)
    if o.smoothing:
        v = x.shape[-1]
        zw = z * w.to(wide) if w is not None else z
        wsum = w.to(wide).sum() if w is not None else v
        ce = (1 - o.smoothing) * ce + (o.smoothing / v) * (lse * wsum - zw.sum(-1))
    zr = torch.zeros_like(lse)  # (no z-loss: 0, not 0 * inf on a -inf row)
    if o.z_loss:  # (an all -inf row: inf, as the kernels', with a tangent of 0 rather than -inf * 0)
        dead = lse == float("-inf")
        finite = torch.where(dead, 0.0, lse)
        zr = torch.where(dead, float("inf"), o.z_loss * finite * finite)
    return torch.where(keep, ce, 0.0), torch.where(keep, zr, 0.0), m.double() + ls.double()


def kept_rows(t, ignore_index: int, w, v: int, dtype):
    """(the rows not ignored, their class weight) as 0-d tensors of ``dtype``: the mean's divisors."""
    keep = t.long() != ignore_index
    kept = keep.sum().to(dtype)
    if w is None:
        return kept, kept
    _, w_t = _target_weight(t.long(), keep, w, v, dtype)
    return kept, torch.where(keep, w_t, 0.0).sum()


def no_z_term(loss, t, ignore_index: int, reduction: str):
    """The z-loss term of a loss that has none (z_loss 0), as the reduction gives it: zeros like the loss,
    and the mean over no kept rows 0 / 0 = NaN (as the loss's own mean and the kernels' term)."""
    z = torch.zeros_like(loss)
    return z / (t != ignore_index).sum() if reduction == "mean" else z


def reduce_terms(ce, zr, kept, w_kept, reduction: str, out_dtype):
    """(loss, z-loss) as the reduction asks: the mean divides ce by the rows' weight and z-loss by their
    number (as Liger's lse_square_scale; the same without class weights). zr None: no z-loss term (the
    z-loss returned is then None)."""
    if zr is None:
        zr = torch.zeros((), dtype=ce.dtype, device=ce.device)
        return reduce_terms(ce, zr, kept, w_kept, reduction, out_dtype)[0], None
    if reduction == "none":
        return (ce + zr).to(out_dtype), zr.to(out_dtype)
    c, z = ce.sum(), zr.sum()
    if reduction == "mean":  # (kept weights summing to 0: NaN, as torch's 0 / 0 of its nll part)
        c, z = torch.where(w_kept == 0, float("nan"), c / w_kept), z / kept
    return (c + z).to(out_dtype), z.to(out_dtype)


def row_grads(grad, kept, w_kept, reduction: str, m: int):
    """(each row's upstream gradient of its ce, of its z-loss)."""
    if reduction == "none":
        g = grad.reshape(m)
        return g, g
    g = grad.reshape(()).expand(m)
    if reduction == "mean":
        return g / w_kept, g / kept
    return g, g


def dlogits_options(x, t, lse, g_ce, g_z, o, w=None):
    """dlogits of whole rows x (every class: a wide lse is made again from them) with torch ops, in fp32 (fp64
    for fp64 x), with every loss option (triton/cross_entropy.py's formulas) from the rows' logsumexp (fp64,
    or x's wide dtype: split_lse); differentiable in x, g_ce and g_z."""
    wide = dtypes.wide(x.dtype)
    z = capped(x.to(wide), o.softcap)
    lse, lo = split_lse(lse, wide)
    lse = torch.where(lse == float("-inf"), 0.0, lse)  # (a fully masked row: p = 0, its z-loss term adds 0)
    if lo is None:  # (a logsumexp in z's own dtype has no lower part: z - lse would lose |max| * eps, so the
        top, ls = max_log_sum(z)  # rows' max and log-sum are made again from z, as torch's x - max)
        p = ((z - top[:, None]) - torch.where(ls == float("-inf"), 0.0, ls)[:, None]).exp()
    else:
        p = ((z - lse[:, None]) - lo[:, None]).exp()
    g_ce, g_z = g_ce.to(wide), g_z.to(wide)
    t = t.long()
    keep = t != o.ignore_index
    v = x.shape[-1]
    tt, w_t = _target_weight(t, keep, w, v, wide)
    hot = torch.arange(v, device=x.device) == tt[:, None]
    b = g_ce.to(wide) * w_t
    a = b
    d = None
    if o.smoothing:
        cc = g_ce.to(wide) * (o.smoothing / v)
        b = (1 - o.smoothing) * b
        wj = w.to(wide) if w is not None else torch.ones((), dtype=wide, device=x.device)
        a = b + cc * (wj.sum() if w is not None else v)
        d = -cc[:, None] * wj
    if o.z_loss:
        a = a + g_z.to(wide) * (2 * o.z_loss) * torch.where(keep, lse, 0.0)
    dz = a[:, None] * p - b[:, None] * hot.to(wide)
    if d is not None:
        dz = dz + d
    if o.softcap is not None:
        dz = dz * (1 - (z / o.softcap) ** 2)
    return torch.where(keep[:, None], dz, 0.0)


def dlogits_torch(x, t, lse, g, ignore_index: int, smoothing: float, offset: int = 0, v_total=None):
    """dlogits with torch ops, in lse's dtype, for the classes [offset, offset + V) of v_total (a slice of
    a vocabulary split across ranks; by default the whole row)."""
    xc = x.to(lse.dtype)
    p = (xc - torch.where(lse == float("-inf"), 0.0, lse)[:, None]).exp()
    t = t.long()
    keep = t != ignore_index
    local = t - offset
    own = keep & (local >= 0) & (local < x.shape[-1])
    hot = (torch.arange(x.shape[-1], device=x.device) == local[:, None]) & own[:, None]
    n = x.shape[-1] if v_total is None else v_total  # a 0-d tensor for a vocabulary split across ranks
    d = p - (1 - smoothing) * hot.to(p.dtype) - smoothing / (n.to(p.dtype) if isinstance(n, torch.Tensor) else n)
    return torch.where(keep[:, None], d * g.to(d.dtype)[:, None], 0.0)


def chunk_logits(xc, weight, bias, out):
    """out = xc @ weight^T (+ bias): one cuBLAS GEMM into the chunk buffer (NaN first under
    heuristics.force(poison=True): the GEMM must write it all)."""
    if heuristics.poisoning():
        out.fill_(float("nan"))
    if bias is not None:
        return torch.addmm(bias, xc, weight.t(), out=out)
    return torch.mm(xc, weight.t(), out=out)


def tile_grads(dl, x_rows, w_cols, dw, dx, db, add_dw: bool, add_dx: bool) -> None:
    """The LM-head loss's gradient GEMMs of one tile (rows x classes) from its dlogits ``dl``: dW's rows for
    those classes (dw = or += dl^T @ x_rows), dx's rows (dx = or += dl @ w_cols: fp32 sums over the slices
    where dx is fp32) and db's entries (+= dl's column sums); None: not wanted. Row chunks add to dW after the
    first chunk; slices add to dW after the first group and to dx after the first slice."""
    if dw is not None:
        gemm_into(dw, dl.t(), x_rows, add=add_dw)
    if dx is not None:
        gemm_into(dx, dl, w_cols, add=add_dx)
    if db is not None:
        db += dl.sum(0, dtype=db.dtype)


def gemm_into(out, a, b, add: bool) -> None:
    """out = a @ b, or out += a @ b, one cuBLAS GEMM: low-precision a and b summed into an fp32 out by the GEMM
    itself on CUDA (torch's out_dtype)."""
    beta = 1 if add else 0
    if a.dtype == out.dtype:
        torch.addmm(out, a, b, beta=beta, out=out)
    elif a.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, beta=beta, out=out)
    else:  # (the CPU under Triton's interpreter: the tests)
        torch.addmm(out, a.to(out.dtype), b.to(out.dtype), beta=beta, out=out)
