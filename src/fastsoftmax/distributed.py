"""Softmax, log_softmax and cross-entropy over logits split along the last dim across a torch.distributed
process group: rank r holds a contiguous slice of the classes (slices may differ in width, be empty of
finite values, or be empty), in rank order.

Two collectives per forward, the same on every rank whatever its inputs: an all-gather of each rank's
signature (its slice's width, its row count, its dtype and a digest of the call's options), from which every
rank checks that the ranks agree and finds its slice's offset in the vocabulary, as a device tensor; then an
all-gather of per-row statistics (its slice's logsumexp, and for cross-entropy the target logit if the target
falls in its slice and the sum of its logits), merged into the row's global logsumexp. Megatron-LM's
vocabulary-parallel cross-entropy uses three all-reduces (max, sum of exp, target logit); a logsumexp carries
max and sum in one number. No host synchronisation (a forward can be captured in a CUDA graph): ranks that
disagree (rows, dtype, options) raise the same ValueError on every rank for CPU tensors (gloo), and on CUDA
tensors every rank stops at the same device-side assertion (torch._assert_async) before the statistics move.

Backward: softmax and log_softmax need one all-reduce of a per-row sum (sum(y*dy), or sum(dy)); the
cross-entropy backward needs none (dlogits come from the saved global logsumexp).

Conventions as the rest of the library: a row that is -inf on every rank gives zeros (softmax) / -inf
(log_softmax), NaN or +inf anywhere in a row gives NaN across it. Works with NCCL (CUDA tensors) and gloo
(CPU tensors). The local arithmetic is torch ops on the shard (one read for the statistics, one read and
one write for the output).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from . import checks, dtypes
from .backends.torch import dlogits_torch, reduce_terms, row_grads
from .dispatch import assert_targets
from .reference import logsumexp_torch


def _gather(stats: torch.Tensor, group) -> torch.Tensor:
    """(world, *stats.shape): every rank's stats, in rank order (one all-gather)."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(stats) for _ in range(world)]
    dist.all_gather(out, stats.contiguous(), group=group)
    return torch.stack(out)


def _local_lse(x: torch.Tensor) -> torch.Tensor:
    """Per-row logsumexp of a shard (reference.logsumexp_torch), -inf for an empty slice."""
    if x.shape[-1] == 0:
        stat = torch.float64 if x.dtype == torch.float64 else torch.float32
        return x.new_full(x.shape[:-1], float("-inf"), dtype=stat)
    return logsumexp_torch(x)


def _merge_lse(lses: torch.Tensor) -> torch.Tensor:
    """Merge per-rank logsumexps (dim 0): -inf if all are, NaN if any is NaN or +inf (the library's rule for
    a row holding NaN or +inf)."""
    bad = lses.isnan().any(0) | (lses == float("inf")).any(0)
    m = lses.amax(0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    out = m_safe + (lses - m_safe).exp().sum(0).log()
    return torch.where(bad, float("nan"), out)


def _normalise(x: torch.Tensor, lse: torch.Tensor, log: bool, dtype) -> torch.Tensor:
    xc = x.to(lse.dtype)
    full_masked = (lse == float("-inf"))[..., None]
    if log:
        y = torch.where(full_masked, float("-inf"), xc - lse[..., None])
    else:
        y = (xc - torch.where(full_masked, 0.0, lse[..., None])).exp()
    return y.to(dtype)


def _agree(fn: str, x: torch.Tensor, group, options: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The first collective: every rank's (width, rows, dtype, options digest), checked for agreement; returns
    (this rank's offset in the vocabulary, the vocabulary's size), 0-d int64 tensors on x's device."""
    rows = math.prod(x.shape[:-1])
    digest = float(int(hashlib.sha256(repr(options).encode()).hexdigest()[:13], 16))  # < 2^52: exact in float64
    sig = torch.empty(4, dtype=torch.float64, device=x.device)
    for i, v in enumerate((x.shape[-1], rows, dtypes.CODE[x.dtype], digest)):
        sig[i].fill_(v)  # a fill kernel each: no host-to-device copy, so a CUDA graph can capture it
    every = _gather(sig, group)  # (world, 4)
    same = (every[:, 1:] == every[:1, 1:]).all()
    if x.is_cuda:
        torch._assert_async(same, f"{fn}: the ranks disagree on the row count, dtype or options")
    elif not bool(same):
        names = {v: dtypes.NAME[k] for k, v in dtypes.CODE.items()}
        seen = []
        for r, (_, rows_r, code, opts) in enumerate(every.tolist()):
            other = "" if opts == every[0, 3] else ", other options"
            seen.append(f"rank {r}: {int(rows_r)} rows of {names[int(code)]}{other}")
        raise ValueError(
            f"{fn}: the ranks must pass shards of the same rows and dtype, with the same options ({'; '.join(seen)})"
        )
    widths = every[:, 0].long()
    return widths[: dist.get_rank(group)].sum(), widths.sum()


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, group, dtype):
        _agree("distributed.softmax", x, group, (log, str(dtype)))
        lse = _merge_lse(_gather(_local_lse(x), group))
        y = _normalise(x, lse, log, dtype or x.dtype)
        ctx.save_for_backward(y)
        ctx.log, ctx.group, ctx.x_dtype = log, group, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        wide = torch.float64 if torch.float64 in (y.dtype, dy.dtype) else torch.float32
        yc, dyc = y.to(wide), dy.to(wide)
        f = yc.exp() if ctx.log else yc
        a = dyc if ctx.log else yc * dyc
        sums = torch.stack([a.sum(-1), f.sum(-1)])
        dist.all_reduce(sums, group=ctx.group)
        s, t = sums[0], sums[1]
        dx = torch.where((t == 0)[..., None], 0.0, a - f * s[..., None])
        return dx.to(ctx.x_dtype), None, None, None


def _check_shard(fn, x, group, target=None):
    """The shard's (and the target's) checks, then the process group's: what can fail before a collective."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{fn}: expected a floating-point torch.Tensor shard")
    if x.dim() < 1:
        raise ValueError(f"{fn}: the shard needs the split class dim (the last)")
    if target is not None:
        checks.target(fn, x, target)
    if not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialised (init_process_group first)")


def softmax(
    x: torch.Tensor, *, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Softmax along the last dim of logits whose last dim is split across ``group`` (this rank's slice)."""
    _check_shard("distributed.softmax", x, group)
    return _Softmax.apply(x, False, group, dtype)


def log_softmax(
    x: torch.Tensor, *, group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Log-softmax along the last dim of logits whose last dim is split across ``group``."""
    _check_shard("distributed.log_softmax", x, group)
    return _Softmax.apply(x, True, group, dtype)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, ignore_index, reduction, smoothing, group):
        v_local = x.shape[-1]
        t = target.reshape(-1).long()
        xf = x.reshape(t.shape[0], v_local)
        offset, v_total = _agree("distributed.cross_entropy", x, group, (ignore_index, reduction, smoothing))
        assert_targets(t, v_total, ignore_index)
        lse = _local_lse(xf)
        local_t = t - offset
        own = (t != ignore_index) & (local_t >= 0) & (local_t < v_local)
        x_t = torch.zeros_like(lse)
        if v_local:
            x_t = torch.where(own, xf.gather(-1, torch.where(own, local_t, 0)[:, None])[:, 0].to(lse.dtype), 0.0)
        sum_x = xf.to(lse.dtype).sum(-1) if smoothing else torch.zeros_like(lse)
        g = _gather(torch.stack([lse, x_t, sum_x], -1), group)  # (world, M, 3): the statistics
        lse_g = _merge_lse(g[..., 0])
        x_t_g = g[..., 1].sum(0)
        keep = t != ignore_index
        if smoothing:
            loss = lse_g - (1 - smoothing) * x_t_g - smoothing * g[..., 2].sum(0) / v_total
        else:
            loss = lse_g - x_t_g
        loss = torch.where(keep, loss, 0.0)
        ctx.save_for_backward(x, target, lse_g, offset, v_total)
        ctx.args = (ignore_index, reduction, smoothing)
        kept = keep.sum()
        out = reduce_terms(loss, None, kept, kept, reduction, x.dtype)[0]
        return out.reshape(target.shape) if reduction == "none" else out

    @staticmethod
    def backward(ctx, grad):
        x, target, lse, offset, v_total = ctx.saved_tensors
        ignore_index, reduction, smoothing = ctx.args
        t = target.reshape(-1).long()
        kept = (t != ignore_index).sum()
        g = row_grads(grad, kept, kept, reduction, t.shape[0])[0].to(lse.dtype)
        dx = dlogits_torch(x.reshape(t.shape[0], x.shape[-1]), t, lse, g, ignore_index, smoothing, offset, v_total)
        return dx.to(x.dtype).reshape(x.shape), None, None, None, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """torch.nn.functional.cross_entropy of the full logits (classes along the last dim, split across
    ``group``; ``logits`` is this rank's slice) with global class indices as targets, on every rank."""
    checks.loss_options("distributed.cross_entropy", ignore_index, reduction, label_smoothing)
    _check_shard("distributed.cross_entropy", logits, group, target)
    return _CrossEntropy.apply(logits, target, ignore_index, reduction, float(label_smoothing), group)
