"""Masks, scale and causal: softmax(scale * x + mask) along the last dim, the mask read in place.

Semantics (every backend; the float64 reference is `logits()` below followed by the usual softmax):
  z = scale * x                      (scale: a Python float, default 1; computed in fp32, not in x's dtype)
  bool mask:     z = z where mask (True = keep), -inf elsewhere (x's value there is ignored, NaN too)
  float mask:    z = z + mask       (additive, e.g. 0 / -inf, or ALiBi-style biases)
  causal=True:   z[..., q, k] = -inf where k > q + (Sk - Sq)   (bottom-right aligned, as FlashAttention)
then softmax / log_softmax of z with the library's conventions: masked positions give exactly 0 / -inf,
and a fully masked row gives zeros / -inf (never NaN).

Gradients: dx = scale * dz, 0 at masked positions (False in a bool mask, -inf in an additive one, above
the causal diagonal) and on fully masked rows; a floating mask that requires grad gets dz, summed over
the dims it is broadcast along (ops/softmax.py); the scale gets none. (torch's autograd of
`log_softmax(x + mask)` would give dy at additive -inf positions; here every masked position gets 0.)

The mask is broadcast to x's shape as a view (stride 0 along broadcast dims) and never expanded in memory:
the kernels address it through per-row strides over at most four row dimensions (adjacent dims are merged
where the mask's strides allow, which covers (B, 1, 1, S) padding masks, (S, S) masks and per-head masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dtypes

MAX_ROW_DIMS = 4  # row dimensions the kernels decompose a row index into, for the mask and causal


@dataclass(frozen=True)
class Spec:
    """What the kernels apply at their load step. ``kind``: 0 no mask, 1 bool, 2 additive."""

    kind: int
    mask: torch.Tensor | None  # x's shape (a broadcast view), softmax dim last
    scale: float | None
    causal: bool
    dims: tuple[int, int, int]  # sizes of the last three row dims (the first is implied)
    strides: tuple[int, int, int, int]  # mask element strides of the four row dims
    col_stride: int  # mask element stride along the softmax dim
    causal_offset: int  # Sk - Sq

    @property
    def active(self) -> bool:
        return self.kind != 0 or self.causal or self.scale is not None


NONE = Spec(0, None, None, False, (1, 1, 1), (0, 0, 0, 0), 0, 0)


def check(fn: str, x: torch.Tensor, dim: int, mask, causal) -> None:
    """Clear errors about the mask and causal before any launch (the scale's: core/checks.masked). ``dim``
    is non-negative."""
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: causal must be a bool, got {type(causal).__name__}")
    if causal:
        if x.dim() < 2:
            raise ValueError(f"{fn}: causal=True needs at least 2 dims (query, key), got shape {tuple(x.shape)}")
        if dim != x.dim() - 1:
            raise ValueError(f"{fn}: causal=True applies over the last two dims (query, key): dim must be -1")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{fn}: mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"{fn}: mask must be bool (True = keep) or floating point (added to the logits), got {mask.dtype}"
        )
    if mask.device != x.device:
        raise ValueError(f"{fn}: mask is on {mask.device} but x is on {x.device}")
    try:
        shape = torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        shape = None
    if shape != x.shape:
        raise ValueError(f"{fn}: mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}")


def _coalesce(sizes, strides, keep_last: bool) -> list[list[int]]:
    """Merge adjacent row dims (outer to inner) whose mask strides allow it, dropping size-1 dims; with
    ``keep_last`` the innermost dim (the query dim, for causal) stays its own, whatever its size."""
    items = list(zip(sizes, strides, strict=True))
    last = list(items.pop()) if keep_last else None
    out: list[list[int]] = []
    for size, stride in items:
        if size == 1:
            continue
        if out and out[-1][1] == stride * size:
            out[-1][0] *= size
            out[-1][1] = stride
        else:
            out.append([size, stride])
    if last is not None:
        out.append(last)
    return out


def spec(x: torch.Tensor, mask, scale, causal: bool) -> Spec | None:
    """The kernels' view of (mask, scale, causal) for x with the softmax along its last dim; None when the
    mask needs more than MAX_ROW_DIMS row dims (the caller then runs the torch path)."""
    if mask is None and scale is None and not causal:
        return NONE
    kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    lead = tuple(x.shape[:-1])
    if kind:
        m = mask.expand(x.shape)
        strides, col = m.stride()[:-1], m.stride(-1) if x.shape[-1] != 1 else 0
    else:
        m, strides, col = None, (0,) * len(lead), 0
    groups = _coalesce(lead, strides, keep_last=causal)
    if len(groups) > MAX_ROW_DIMS:
        return None
    groups = [[1, 0]] * (MAX_ROW_DIMS - len(groups)) + groups
    dims = tuple(g[0] for g in groups[1:])
    offset = x.shape[-1] - x.shape[-2] if causal else 0
    return Spec(
        kind, m, None if scale is None else float(scale), causal, dims, tuple(g[1] for g in groups), col, offset
    )


def causal_keep(x: torch.Tensor) -> torch.Tensor:
    """(Sq, Sk) bool: key k is visible from query q when k <= q + (Sk - Sq) (bottom-right aligned)."""
    sq, sk = x.shape[-2], x.shape[-1]
    return torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril(sk - sq)


def logits(x: torch.Tensor, mask, scale, causal, dtype=None) -> torch.Tensor:
    """z = scale * x, masked, causal, in ``dtype`` (default fp32, fp64 for fp64): the torch path and the
    reference. Removed positions are -inf."""
    dtype = dtype or dtypes.wide(x.dtype)
    z = x.to(dtype)
    if scale is not None:
        z = z * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            z = torch.where(mask, z, float("-inf"))
        else:
            z = z + mask.to(dtype)
    if causal:
        z = z.masked_fill(~causal_keep(x), float("-inf"))
    return z


def removed(x: torch.Tensor, mask, causal) -> torch.Tensor | None:
    """The masked positions, broadcastable to x (or None): False in a bool mask, -inf in an additive one,
    above the causal diagonal. Their gradient is 0."""
    out = None
    if mask is not None:
        out = ~mask if mask.dtype == torch.bool else mask == float("-inf")
    if causal:
        c = ~causal_keep(x)
        out = c if out is None else (out | c)
    return out


def finish_grad(dz: torch.Tensor, y: torch.Tensor, mask, scale, causal) -> torch.Tensor:
    """dx from the plain gradient dz (torch ops): times scale, 0 at the masked positions."""
    if scale is not None:
        dz = dz * scale
    gone = removed(y, mask, causal)
    return dz if gone is None else dz.masked_fill(gone, 0.0)
