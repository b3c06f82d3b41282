"""Where rows and the softmax dimension sit in memory.

Every kernel sees the same canonical problem: rows indexed by (b, i) with b < B and i < I, each row holding
N elements along the softmax dimension, element (b, n, i) of x at ``b*sxb + n*sxn + i*sxi`` (elements, not
bytes) and likewise for y. Row dimensions are merged where both x's and y's strides allow it, in any order
(rows are independent), so contiguous, transposed, channels-last and most sliced or expanded tensors map
onto at most two row groups without a copy. Anything else is copied once to a contiguous tensor, and the
layout says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from ..heuristics import poisoning


@dataclass(frozen=True)
class Layout:
    B: int  # outer row group
    I: int  # noqa: E741  inner row group; 1 means rows run along b only
    N: int  # softmax length
    sx: tuple[int, int, int]  # x strides (b, n, i)
    sy: tuple[int, int, int]  # y strides (b, n, i)
    stat_strides: tuple[int, ...]  # strides of a per-row tensor (x's shape without dim) in (b, i) order
    copied: bool  # x had to be made contiguous first (one extra read + write)


def _merge(dims):
    """Merge (size, x_stride, y_stride, dim) row dimensions, outer to inner, where both tensors allow.
    Returns groups as [size, x_stride, y_stride, [dims outer to inner]]."""
    out = []
    for size, sx, sy, d in sorted(dims, key=lambda t: (t[2], t[1]), reverse=True):
        if out:
            g = out[-1]
            if g[1] == sx * size and g[2] == sy * size:
                g[0], g[1], g[2] = g[0] * size, sx, sy
                g[3].append((d, size))
                continue
        out.append([size, sx, sy, [(d, size)]])
    return out


def canonical(x: torch.Tensor, y: torch.Tensor, dim: int) -> Layout | None:
    """The (B, N, I) view of x and y along ``dim`` (non-negative), or None if it needs more row groups."""
    return _canonical(tuple(x.shape), x.stride(), y.stride(), dim)


@functools.lru_cache(maxsize=4096)
def _canonical(shape: tuple, xs: tuple, ys: tuple, dim: int) -> Layout | None:
    n = shape[dim]
    dims = [(shape[d], xs[d], ys[d], d) for d in range(len(shape)) if d != dim and shape[d] != 1]
    groups = _merge(dims)
    if len(groups) > 2:
        return None
    # One group: rows run along b, so the kernels can pack consecutive rows.
    while len(groups) < 2:
        groups.append([1, 0, 0, []])
    (b, sxb, syb, bdims), (i, sxi, syi, idims) = groups
    stat = {}
    for members, outer in ((idims, 1), (bdims, i)):
        for d, size in reversed(members):
            stat[d] = outer
            outer *= size
    stat_strides = tuple(stat.get(d, 1) for d in range(len(shape)) if d != dim)
    sxn, syn = (xs[dim], ys[dim]) if n != 1 else (0, 0)
    return Layout(b, i, n, (sxb, sxn, sxi), (syb, syn, syi), stat_strides, False)


def plan_layout(x: torch.Tensor, y: torch.Tensor, dim: int) -> tuple[torch.Tensor, Layout]:
    """The canonical layout, copying x once when no two-group view exists (y is then contiguous)."""
    lay = canonical(x, y, dim)
    if lay is not None:
        return x, lay
    xc = x.contiguous()
    lay = canonical(xc, y, dim)
    assert lay is not None, "contiguous x and y always merge into at most two row groups"
    return xc, replace(lay, copied=True)


def alloc(like: torch.Tensor, dtype: torch.dtype, shape=None, strides=None) -> torch.Tensor:
    """An output: x's layout when x is dense (as torch.empty_like), else contiguous; or the given shape and
    strides. NaN-filled under test poisoning, so an element no kernel wrote fails the tests."""
    if shape is None:
        out = torch.empty_like(like, dtype=dtype)
    else:
        out = torch.empty_strided(shape, strides, dtype=dtype, device=like.device)
    return out.fill_(float("nan")) if poisoning() else out


def storage_problem(*tensors) -> str | None:
    """Why one of ``tensors`` (None entries skipped) has no data to read: elements but no storage (resized to
    0 bytes), which torch's own ops refuse too. None: every one has."""
    for t in tensors:
        if t is not None and not t.data_ptr() and t.numel() and not t.is_meta:
            return f"a tensor of shape {tuple(t.shape)} has no storage (was it resized to 0 bytes?)"
    return None


def values(t):
    """t with its values in memory, as the kernels read it: a lazily negated view (torch._neg_view, which
    autograd's formulas make), whose memory holds -t, resolved into a copy; t itself otherwise (None too)."""
    return t.resolve_neg() if t is not None and t.is_neg() else t


def flat(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, V) logits with unit stride along V (copied if they have not), and the (M,) targets in memory order
    (flat_target), their values in memory (values()): what the loss kernels index."""
    logits, target = values(logits), values(target)
    if logits.dim() == 2 and target.dim() == 1 and logits.stride(1) == 1 and target.stride(0) == 1:
        return logits, target  # (already so: the common case, without a reshape)
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, flat_target(target)


def flat_target(target: torch.Tensor) -> torch.Tensor:
    """The targets as (M,) in memory order (a strided or expanded target is copied: M integers)."""
    t = target.reshape(-1)
    if t.numel() > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return t
