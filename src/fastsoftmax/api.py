"""softmax(), log_softmax(), their backward and their nn.Modules: argument checks, torch's autocast policy,
then the custom ops (ops.py), which route the call. A call with no mask, scale or causal first tries the
eager replay on CUDA (fastpath.py; torch.compile traces past it) and the CPU's direct path (_cpu below)."""

from __future__ import annotations

import torch

from . import checks, compose, dispatch, dtensor, dtypes, fastpath, ops

_compiling = compose.dynamo_compiling
_FLOATS = frozenset(dtypes.FLOATS)
_PLAIN = compose.PLAIN_TYPES


def _cpu_ok(x, dim, dtype, backend) -> bool:
    """Whether a call with no mask, scale or causal on x can take the CPU's direct path: backend 'auto', a
    plain CPU tensor with elements, arguments that checks.softmax passes (anything else takes the full path,
    which raises its errors), and no route other than plain or eager autograd (compose.route's checks,
    inline: a small call's host time is mostly Python calls). Autocast needs no check: on the CPU torch's
    softmax keeps x's dtype, as the library does."""
    if backend != "auto" or type(x) not in _PLAIN or not x.is_cpu or x.dtype not in _FLOATS or type(dim) is not int:
        return False
    if not compose.eager():
        return False
    nd = x.dim()
    if not (nd and -nd <= dim < nd and (dtype is None or dtype in _FLOATS) and x.numel() and x.data_ptr()):
        return False
    return "cpu" in dispatch.DEVICES  # (a device without a path: the full path raises)


def _cpu(x, dim, dtype, log: bool, backend):
    """The CPU's direct path (see _cpu_ok): the row kernels, or torch's own kernels, with the conventions
    applied (dispatch.cpu_softmax); under autograd, for a contiguous x and no other output dtype, a C++ graph
    (torch's own for fp32, the row kernels' for bf16) where its output has no NaN row
    (dispatch.cpu_softmax_graph), else the eager Function, whose passes reach the same kernels. None: the
    full path runs."""
    if not _cpu_ok(x, dim, dtype, backend):
        return None
    if x.requires_grad and torch.is_grad_enabled():
        if (dtype is None or dtype == x.dtype) and x.is_contiguous():
            if (y := dispatch.cpu_softmax_graph(x, dim % x.dim(), log)) is not None:
                return y
        return ops.softmax.eager.apply(x, dim, log, dtype, backend)
    return dispatch.cpu_softmax(x, dim % x.dim(), log, dtype or x.dtype)


def _cpu_backward(dy, y, dim, dtype, log: bool, backend):
    """softmax_backward's counterpart of _cpu; calls that need autograd take the full path."""
    if type(dy) not in _PLAIN or not _cpu_ok(y, dim, dtype, backend) or not dy.is_cpu:
        return None
    if dy.dtype not in _FLOATS or dy.shape != y.shape or not dy.data_ptr():
        return None
    if (y.requires_grad or dy.requires_grad) and torch.is_grad_enabled():
        return None
    return dispatch.cpu_softmax_backward(dy, y, dim % y.dim(), log, dtype or y.dtype)


def forward(
    x: torch.Tensor,
    dim: int = -1,
    *,
    log: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    want_lse: bool = False,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softmax or log_softmax of x, its fp32 logsumexp per row (x's shape without dim) or None): what a
    backward pass, a loss or another GPU's shard can consume. Checked as softmax(). An eager call with no
    autograd (outputs never require grad, on every backend); refused under torch.compile, fake tensors,
    dispatch modes and torch.func, where fs.softmax composes."""
    fn = "log_softmax" if log else "softmax"
    d, out_dtype = checks.softmax(fn, x, dim, dtype, backend)
    checks.masked(fn, x, d, mask, scale, causal)
    if compose.route(x, mask) in ("op", "func"):
        raise RuntimeError(
            f"fastsoftmax.api.forward is an eager call with no autograd and no custom op: under torch.compile, "
            f"fake tensors, dispatch modes and torch.func use fs.{fn}"
        )
    with torch.no_grad():
        return dispatch.softmax(
            x, d, log, out_dtype, backend, want_lse=want_lse, fn=fn, mask=mask, scale=scale, causal=causal
        )


def _forward(x, dim, log, fn, mask, scale, causal, dtype, backend):
    if type(x) not in compose.PLAIN_TYPES and dtensor.is_dtensor(x) and mask is None and scale is None and not causal:
        return dtensor.softmax(x, dim, log, dtype, backend, fn)  # (sharded on the classes: distributed.py)
    d, _ = checks.softmax(fn, x, dim, dtype, backend)
    masked = checks.masked(fn, x, d, mask, scale, causal)
    dtype = compose.softmax_dtype(x, dtype)
    if masked:
        return ops.softmax_masked(x, dim, log, dtype, backend, mask, scale, causal)
    return ops.softmax(x, dim, log, dtype, backend)


def softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax of x along dim. See the README for the conventions on -inf, NaN and +inf rows.

    mask: bool (True = keep) or floating (added), broadcastable to x, read in place; scale: a float
    multiplied into x first; causal: over the last two dims (query, key), bottom-right aligned.
    dtype: output dtype (computed in fp32 from x as given, written once in dtype).
    backend: 'auto' (CUDA tensors: the tuning table's choice, else Triton kernels; CPU: torch ops), 'triton',
    'cuda' or 'torch'.
    Differentiable (only the output, and the mask, are saved for backward)."""
    if mask is None and scale is None and causal is False:  # no mask: a replay (fastpath), or the CPU's direct path
        if not _compiling() and (y := fastpath.fast(x, None, dim, dtype, False, backend)) is not None:
            return y
        if (y := _cpu(x, dim, dtype, False, backend)) is not None:
            return y
    return _forward(x, dim, False, "softmax", mask, scale, causal, dtype, backend)


def log_softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Log-softmax of x along dim; arguments and conventions as softmax()."""
    if mask is None and scale is None and causal is False:  # no mask: a replay (fastpath), or the CPU's direct path
        if not _compiling() and (y := fastpath.fast(x, None, dim, dtype, True, backend)) is not None:
            return y
        if (y := _cpu(x, dim, dtype, True, backend)) is not None:
            return y
    return _forward(x, dim, True, "log_softmax", mask, scale, causal, dtype, backend)


def _backward(dy, y, dim, log, fn, mask, scale, causal, dtype, backend):
    d, out_dtype = checks.softmax_backward(fn, dy, y, dim, dtype, backend)
    if checks.masked(fn, y, d, mask, scale, causal):
        return ops.softmax_backward_masked(dy, y, dim, log, out_dtype, backend, mask, scale, causal)
    return ops.softmax_backward(dy, y, dim, log, dtype, backend)


def softmax_backward(
    dy: torch.Tensor,
    y: torch.Tensor,
    dim: int = -1,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """dx = y * (dy - sum(y * dy)) along dim, from softmax's output y; 0 on fully masked rows (y all 0).
    mask, scale, causal: the forward's (dx = scale * dz, 0 at masked positions)."""
    if mask is None and scale is None and causal is False and dy is not None:  # a replay, or the CPU's direct path
        if not _compiling() and (dx := fastpath.fast(y, dy, dim, dtype, False, backend)) is not None:
            return dx
        if (dx := _cpu_backward(dy, y, dim, dtype, False, backend)) is not None:
            return dx
    return _backward(dy, y, dim, False, "softmax_backward", mask, scale, causal, dtype, backend)


def log_softmax_backward(
    dy: torch.Tensor,
    y: torch.Tensor,
    dim: int = -1,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """dx = dy - exp(y) * sum(dy) along dim, from log_softmax's output y; 0 on fully masked rows (y all -inf).
    mask, scale, causal: as softmax_backward."""
    if mask is None and scale is None and causal is False and dy is not None:  # a replay, or the CPU's direct path
        if not _compiling() and (dx := fastpath.fast(y, dy, dim, dtype, True, backend)) is not None:
            return dx
        if (dx := _cpu_backward(dy, y, dim, dtype, True, backend)) is not None:
            return dx
    return _backward(dy, y, dim, True, "log_softmax_backward", mask, scale, causal, dtype, backend)


class Softmax(torch.nn.Module):
    """Drop-in for torch.nn.Softmax (dim defaults to -1)."""

    def __init__(
        self,
        dim: int = -1,
        *,
        scale: float | None = None,
        causal: bool = False,
        dtype: torch.dtype | None = None,
        backend: str = "auto",
    ):
        super().__init__()
        self.dim, self.scale, self.causal, self.dtype, self.backend = dim, scale, causal, dtype, backend

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return softmax(
            x, self.dim, mask=mask, scale=self.scale, causal=self.causal, dtype=self.dtype, backend=self.backend
        )

    def extra_repr(self) -> str:
        extra = (f", scale={self.scale}" if self.scale is not None else "") + (", causal=True" if self.causal else "")
        return f"dim={self.dim}{extra}, backend={self.backend!r}"


class LogSoftmax(Softmax):
    """Drop-in for torch.nn.LogSoftmax (dim defaults to -1)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return log_softmax(
            x, self.dim, mask=mask, scale=self.scale, causal=self.causal, dtype=self.dtype, backend=self.backend
        )
