"""torch ops: the reference path, on any device torch runs, float32 accumulation (float64 for float64)."""

from __future__ import annotations

import torch

from .. import heuristics, masking
from ..layout import alloc
from ..reference import grad_torch, logsumexp_torch, softmax_torch


class TorchBackend:
    name = "torch"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        if spec.active:
            wide = torch.float64 in (x.dtype, out_dtype)
            x = masking.logits(x, spec.mask, spec.scale, spec.causal, torch.float64 if wide else torch.float32)
        y, lse = softmax_torch(x, dim, log, out_dtype)
        # In the layout every backend promises (and the custom op's fake implementation states).
        return alloc(x, out_dtype).copy_(y), (lse.to(torch.float32) if want_lse else None)

    def backward(self, dy, y, dim, out_dtype, log, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        return alloc(y, out_dtype).copy_(grad_torch(dy, y, dim, log, out_dtype, spec.mask, spec.scale, spec.causal))

    def cross_entropy(self, x, t, ignore_index, smoothing, reduction, out_dtype):
        """(loss, stats) as the Triton kernels give them (stats: lse per row, rows kept, 1.0)."""
        m = x.shape[0]
        if m:
            heuristics.record(heuristics.Plan("torch", "cross_entropy"))
            loss_rows, lse = loss_rows_torch(x, t, ignore_index, smoothing)
        else:
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # the fake's stats dtype
            loss_rows = lse = torch.zeros(0, dtype=wide, device=x.device)
        kept = (t.long() != ignore_index).sum().to(lse.dtype)
        stats = torch.cat([lse, kept[None], torch.ones(1, dtype=lse.dtype, device=x.device)])
        return reduce_loss(loss_rows, kept, reduction, out_dtype), stats

    def cross_entropy_backward(self, x, t, stats, grad, ignore_index, smoothing, reduction, out_dtype):
        m = x.shape[0]
        if m:
            heuristics.record(heuristics.Plan("torch", "cross_entropy"))
        g = row_grad(grad, stats[m], reduction, m).to(stats.dtype)  # stats[m]: the forward's kept-row count
        return dlogits_torch(x, t, stats[:m], g, ignore_index, smoothing).to(out_dtype)


def loss_rows_torch(x, t, ignore_index: int, smoothing: float):
    """(loss per row, lse per row), fp32 (fp64 for fp64 logits), with torch ops (differentiable in x)."""
    lse = logsumexp_torch(x)
    xc = x.to(lse.dtype)
    t = t.long()
    keep = t != ignore_index
    x_t = xc.gather(-1, torch.where(keep, t, 0).long()[:, None]).squeeze(-1)
    loss = lse - x_t if smoothing == 0 else lse - (1 - smoothing) * x_t - smoothing * xc.mean(-1)
    return torch.where(keep, loss, 0.0), lse


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


def reduce_loss(loss_rows, kept, reduction, out_dtype):
    """``kept``: the number of rows not ignored (a 0-d tensor), the mean's divisor."""
    if reduction == "none":
        return loss_rows.to(out_dtype)
    total = loss_rows.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    return (total / kept).to(out_dtype)


def row_grad(grad, kept, reduction, m):
    """The upstream gradient of each row's loss (``kept``: as reduce_loss's)."""
    if reduction == "none":
        return grad.reshape(m)
    g = grad.reshape(()).expand(m)
    if reduction == "mean":
        g = g / kept
    return g
