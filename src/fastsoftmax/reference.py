"""The torch path and the float64 oracle: one function, written with torch ops, with the library's
conventions (see README): max subtracted first; an all -inf row gives zeros / -inf (torch.softmax gives
NaN); NaN or +inf in a row gives NaN across it. It runs on any device torch runs on.
"""

from __future__ import annotations

import torch


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


def oracle(x: torch.Tensor, dim: int = -1, log: bool = False) -> torch.Tensor:
    """The float64 reference the tests compare every path against (on the CPU)."""
    x64 = x.detach().to("cpu", torch.float64)
    if x64.dim() == 0:
        return oracle(x64.reshape(1), 0, log).reshape(())
    if x64.numel() == 0:
        return torch.empty_like(x64)
    return softmax_torch(x64, dim, log, torch.float64, torch.float64)[0]


def oracle_lse(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    x64 = x.detach().to("cpu", torch.float64)
    return softmax_torch(x64, dim, False, torch.float64, torch.float64)[1]
