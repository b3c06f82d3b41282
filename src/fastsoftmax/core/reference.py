"""The torch path and the float64 oracle: one function, written with torch ops, with the library's
conventions (see README): max subtracted first; an all -inf row gives zeros / -inf (torch.softmax gives
NaN); NaN or +inf in a row gives NaN across it. It runs on any device torch runs on.
"""

from __future__ import annotations

import math

import torch

from . import dtypes


def softmax_torch(
    x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype, compute_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax or log_softmax of x along dim, logsumexp per row), computed in ``compute_dtype``
    (default: float32, or float64 for float64 in or out). Precondition: x has at least one element and
    x.shape[dim] > 0 (the caller returns empty results itself)."""
    if compute_dtype is None:
        wide = torch.float64 in (x.dtype, out_dtype)
        compute_dtype = torch.float64 if wide else torch.float32
    xc = x.to(compute_dtype)
    m = xc.amax(dim, keepdim=True)  # amax propagates NaN
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    z = xc - m_safe
    e = z.exp()
    s = e.sum(dim, keepdim=True)
    # s == 0 only for an all -inf row, where z = -inf and e = 0 already give -inf / 0 with s taken as 1.
    s_safe = torch.where(s == 0, 1.0, s)
    y = z - s_safe.log() if log else e / s_safe
    lse = (m_safe + s.log()).squeeze(dim)
    return y.to(out_dtype), lse.to(torch.float32 if compute_dtype != torch.float64 else torch.float64)


def logsumexp_torch(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Per-row logsumexp with softmax_torch's conventions, fp32 (fp64 for fp64 x): -inf for an all -inf row,
    NaN for a row holding NaN or +inf. Precondition: x.shape[dim] > 0."""
    m, s = max_sum_torch(x, dim)
    return torch.where(m == float("-inf"), 0.0, m) + s.log()


def max_sum_torch(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, its max and its sum of exp(x - max), fp32 (fp64 for fp64 x): -inf and 0 for an all -inf row,
    NaN in the sum for a row holding NaN or +inf (the logsumexp is their max + log(sum)). Precondition:
    x.shape[dim] > 0."""
    xc = x.to(dtypes.wide(x.dtype))
    m = xc.amax(dim, keepdim=True)
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    return m.squeeze(dim), (xc - m_safe).exp().sum(dim)


def softmax_backward_torch(
    dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype, compute_dtype=None
) -> torch.Tensor:
    """Gradient of softmax (log_softmax) from its output y and output gradient dy, with torch ops:
    dx = a - f * sum(a), a = y*dy, f = y (softmax) or a = dy, f = exp(y) (log_softmax); 0 on fully masked
    rows (sum(f) == 0), whatever dy holds. Differentiable in dy and y (double backward)."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if torch.float64 in (y.dtype, dy.dtype, out_dtype) else torch.float32
    yc, dyc = y.to(compute_dtype), dy.to(compute_dtype)
    f = yc.exp() if log else yc
    a = dyc if log else yc * dyc
    s = a.sum(dim, keepdim=True)
    t = f.sum(dim, keepdim=True)
    return torch.where(t == 0, 0.0, a - f * s).to(out_dtype)


def grad_torch(dy, y, dim: int, log: bool, out_dtype, mask=None, scale=None, causal=False) -> torch.Tensor:
    """dx of softmax (log_softmax) along dim (non-negative) in torch ops, differentiable in dy and y: the torch
    backend's, create_graph's and torch.func's. Computed in fp32 (fp64 where y, dy or out_dtype is), masked
    positions 0 and scale applied (masking.finish_grad), returned in out_dtype; 0-d tensors are rows of one."""
    from .masking import finish_grad

    if y.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        return grad_torch(dy.reshape(1), y.reshape(1), 0, log, out_dtype, m, scale, causal).reshape(())
    wide = torch.float64 in (y.dtype, dy.dtype, out_dtype)
    dz = softmax_backward_torch(dy, y, dim, log, torch.float64 if wide else torch.float32)
    if mask is not None or scale is not None or causal:
        dz = finish_grad(dz, y, mask, scale, causal)
    return dz.to(out_dtype)


def oracle(x: torch.Tensor, dim: int = -1, log: bool = False) -> torch.Tensor:
    """The float64 reference the tests compare every path against, computed on x's device."""
    x64 = x.detach().to(torch.float64)
    if x64.dim() == 0:
        return oracle(x64.reshape(1), 0, log).reshape(())
    if x64.numel() == 0:
        return torch.empty_like(x64)
    return softmax_torch(x64, dim, log, torch.float64, torch.float64)[0]


def oracle_backward(dy: torch.Tensor, y: torch.Tensor, dim: int = -1, log: bool = False) -> torch.Tensor:
    """The float64 gradient the tests compare every backward path against, on y's device."""
    return softmax_backward_torch(dy.detach(), y.detach(), dim, log, torch.float64, torch.float64)


def oracle_lse(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x64 = x.detach().to(torch.float64)
    return softmax_torch(x64, dim, False, torch.float64, torch.float64)[1]


# One tolerance rule, shared by the tests and `fastsoftmax check`:
# |y - ref| <= atol + rtol·|ref| per element, by output dtype: one ulp of the output format relative (the
# final rounding dominates 16-bit outputs), plus an absolute floor for values that are noise (fp16
# subnormals, fp32 ex2.approx on tiny values). fp32 outputs must also stay within twice the error of
# fp32 torch ops plus atol. NaN exactly where the oracle has NaN, infinities exactly.
TOLERANCE = {
    torch.float32: (2e-5, 1e-6),
    torch.bfloat16: (2**-7, 1e-6),
    torch.float16: (2**-10, 1e-6),
    torch.float64: (1e-12, 1e-15),
}


def compare(y: torch.Tensor, x: torch.Tensor, dim: int, log: bool, out_dtype=None) -> tuple[float, str | None]:
    """(worst error as a fraction of the tolerance, <= 1 passes; a description of the first violation or
    None) of y against the float64 oracle of x."""
    out_dtype = out_dtype or x.dtype
    if y.dtype != out_dtype or y.shape != x.shape:
        return float("nan"), f"got {y.dtype} {tuple(y.shape)}, expected {out_dtype} {tuple(x.shape)}"
    ref = oracle(x, dim, log)
    got = y.detach().to(ref.device, torch.float64)
    nan_ref, inf_ref = ref.isnan(), ref.isinf()
    if not torch.equal(nan_ref, got.isnan()):
        return float("nan"), f"NaN where the oracle has none or vice versa, at {_where(nan_ref != got.isnan())}"
    if not torch.equal(inf_ref, got.isinf()) or not torch.equal(ref[inf_ref], got[inf_ref]):
        return float("nan"), f"infinities differ at {_where(inf_ref != got.isinf())}"
    fin = ~(nan_ref | inf_ref)
    err = (got - ref).abs()[fin]
    if not err.numel():
        return 0.0, None
    rtol, atol = TOLERANCE[out_dtype]
    bound = atol + rtol * ref.abs()[fin]
    ratio = (err / bound).max().item()
    if not bool((err <= bound).all()):
        i = (err - bound).argmax()
        return ratio, f"error {err[i].item():.3g} > {bound[i].item():.3g} at value {ref[fin][i].item():.6g}"
    worst_err = err.max().item()
    if out_dtype == torch.float32 and x.dim() > 0:
        t = softmax_torch(x.detach(), dim % x.dim(), log, out_dtype)[0].to(torch.float64)
        t_err = (t - ref).abs()[fin].max().item()
        if worst_err > 2 * t_err + atol:
            return ratio, f"max error {worst_err:.3g} > 2 × torch's {t_err:.3g} + {atol:g}"
    return ratio, None


def compare_grad(dx: torch.Tensor, dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, out_dtype=None):
    """(worst err/tol, problem or None) of a gradient against the float64 oracle. dx = a - f·sum(a) with
    a = y·dy, f = y (softmax) or a = dy, f = exp(y) (log_softmax). Per element:
    |err| <= atol + rtol·|ref| + 2·(error of fp32 torch ops on that element) + |f|·sum|a|·u·(log2 N + 2),
    u = 2^-24: the row sum cancels (ref can be far smaller than its terms) and its fp32 accumulation, in any
    order, is the accuracy limit; the last term bounds a tree sum's rounding. NaN and infinities exactly;
    a finite gradient beyond the output dtype's range (it can be: |y·dy| is not bounded by 1) may be the
    same-signed infinity where the oracle plus the tolerance rounds to it, or a finite value within the bound."""
    out_dtype = out_dtype or y.dtype
    if dx.dtype != out_dtype or dx.shape != y.shape:
        return float("nan"), f"got {dx.dtype} {tuple(dx.shape)}, expected {out_dtype} {tuple(y.shape)}"
    ref = oracle_backward(dy, y, dim, log)
    got = dx.detach().to(ref.device, torch.float64)
    bad_nan = ref.isnan() != got.isnan()
    if bad_nan.any():
        return float("nan"), f"NaN where the oracle has none or vice versa, at {_where(bad_nan)}"
    rtol, atol = TOLERANCE[out_dtype]
    inf_ref = ref.isinf()
    overflow = got.isinf() & ref.isfinite() & (got.sign() == ref.sign())
    overflow &= (ref.abs() * (1 + rtol) + atol).to(out_dtype).isinf()  # the oracle rounds to it, within tolerance
    if not torch.equal(inf_ref, got.isinf() & ~overflow) or not torch.equal(ref[inf_ref], got[inf_ref]):
        return float("nan"), f"infinities differ at {_where(inf_ref != (got.isinf() & ~overflow))}"
    fin = ~(ref.isnan() | inf_ref | overflow)
    if not fin.any():
        return 0.0, None
    t32 = softmax_backward_torch(dy.detach(), y.detach(), dim, log, torch.float32, torch.float32).to(torch.float64)
    err = (got - ref).abs()[fin]
    y64, dy64 = y.detach().to(ref.device, torch.float64), dy.detach().to(ref.device, torch.float64)
    a, f = (dy64, y64.exp()) if log else (y64 * dy64, y64)
    n = y.shape[dim] if y.dim() else 1
    row_abs = a.abs().sum(dim, keepdim=True) if y.dim() else a.abs()
    accum = f.abs() * row_abs * 2.0**-24 * (math.log2(max(n, 1)) + 2)
    accum = torch.where(accum.isfinite(), accum, 0.0)  # rows holding inf or NaN: exact checks above
    bound = atol + rtol * ref.abs()[fin] + 2 * (t32 - ref).abs()[fin] + accum[fin]
    ratio = (err / bound).max().item()
    if ratio > 1:
        i = (err - bound).argmax()
        return ratio, f"error {err[i].item():.3g} > {bound[i].item():.3g} at value {ref[fin][i].item():.6g}"
    return ratio, None


def _where(mask: torch.Tensor) -> list:
    return mask.nonzero()[:3].tolist()  # the first few indices, for the message


def special_rows(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows every path must get right: all -inf, one finite among -inf, NaN, +inf, NaN among -inf, all
    equal, logits near the dtype's top (fp16 ~6e4, else 1e4) with a spread, -inf sprinkled, and large
    negative logits."""
    big = 6.0e4 if dtype == torch.float16 else 1.0e4
    rows = torch.randn(9, n, generator=gen, dtype=torch.float32) * 3
    inf, nan = float("inf"), float("nan")
    rows[0] = -inf
    rows[1] = -inf
    rows[1, n // 2] = 1.5
    rows[2, (n * 2) // 3] = nan
    rows[3, n - 1] = inf
    rows[4] = -inf
    rows[4, 0] = nan
    rows[5] = 0.25
    rows[6] = big - torch.rand(n, generator=gen) * 20
    rows[7, :: max(1, n // 5)] = -inf
    rows[8] = -big + torch.rand(n, generator=gen) * 20
    return rows.to(dtype)


def random_logits(shape, dtype, gen: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """Gaussian logits with ~1% outliers multiplied by 20, so a broken max subtraction cannot pass."""
    x = torch.randn(shape, generator=gen) * scale
    outliers = torch.rand(shape, generator=gen) < 0.01
    return torch.where(outliers, x * 20, x).to(dtype)
