"""softmax, log_softmax, their backward and their nn.Modules.

A call: the arguments checked once (core/checks.py), torch's autocast policy for the output dtype
(core/compose.py), then its route. A plain call goes straight to dispatch.py; the others go through the
custom ops below (core/compose.Op: the custom op with its fake and autograd, an eager autograd Function, and
for softmax a transform Function with vmap and jvp rules):

    fs.softmax -> dispatch.softmax -> kernels/triton/softmax_fwd.forward -> triton/launch.launch -> the driver

Each op's implementation is dispatch.py's function of the same name, under the schema written here.
Traffic: forward 1 read of x + 1 write of y where the row fits on chip; backward 2 reads + 1 write.
"""

from __future__ import annotations

import torch

from .. import dispatch, heuristics
from ..core import checks, compose
from ..core.reference import grad_torch, softmax_torch

_PLAIN = compose.PLAIN_TYPES
_route = compose.route
_replayed = dispatch.replayed


def _call(x, dim, log, mask, scale, causal, dtype, backend):
    """The public forward functions' one body: a plain call seen before replayed, else checks, autocast,
    route, then dispatch or the ops."""
    if (
        mask is None
        and scale is None
        and causal is False
        and (y := _replayed(x, None, dim, log, dtype, backend, False)) is not None
    ):
        return y
    fn = "log_softmax" if log else "softmax"
    d, _ = checks.softmax(fn, x, dim, dtype, backend)
    if type(x) not in _PLAIN and compose.is_dtensor(x) and mask is None and scale is None and not causal:
        from ..distributed import dtensor  # (sharded on the classes: fastsoftmax.distributed)

        return dtensor.softmax(x, d, log, dtype, backend, fn)
    masked = mask is not None or scale is not None or causal is not False
    if masked:
        scale = checks.masked(fn, x, d, mask, scale, causal)  # (a float from here: the custom ops' schema)
    dtype = dtype or compose.softmax_dtype(x)
    route = _route(x) if mask is None else _route(x, mask)
    if route == "plain":
        return dispatch.softmax(x, d, log, dtype, backend, mask, scale, causal)
    if route == "function" and not masked and (y := dispatch.softmax_graph(x, d, log, dtype, backend)) is not None:
        return y  # (torch's own autograd nodes, where they compute the library's gradient: CPU tensors)
    op, args = (
        (SOFTMAX_MASKED, (x, d, log, dtype, backend, mask, scale, causal))
        if masked
        else (SOFTMAX, (x, d, log, dtype, backend))
    )
    if route == "function":  # (eager autograd: the Function itself, one frame less)
        return op.eager.apply(*args)
    return op.call(route, *args)


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
    return _call(x, dim, False, mask, scale, causal, dtype, backend)


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
    return _call(x, dim, True, mask, scale, causal, dtype, backend)


def _call_backward(dy, y, dim, log, mask, scale, causal, dtype, backend):
    if (
        mask is None
        and scale is None
        and causal is False
        and (dx := _replayed(y, dy, dim, log, dtype, backend, True)) is not None
    ):
        return dx  # (a plain call seen before)
    fn = ("log_softmax" if log else "softmax") + "_backward"
    d, dtype = checks.softmax_backward(fn, dy, y, dim, dtype, backend)
    masked = mask is not None or scale is not None or causal is not False
    if masked:
        scale = checks.masked(fn, y, d, mask, scale, causal)  # (a float from here: the custom ops' schema)
    route = _route(dy, y) if mask is None else _route(dy, y, mask)
    if route == "plain":
        return dispatch.softmax_backward(dy, y, d, log, dtype, backend, mask, scale, causal)
    if masked:
        return SOFTMAX_BACKWARD_MASKED.call(route, dy, y, d, log, dtype, backend, mask, scale, causal)
    return SOFTMAX_BACKWARD.call(route, dy, y, d, log, dtype, backend)


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
    mask, scale, causal: the forward's (dx = scale * dz, 0 at masked positions). dtype: dx's (default y's)."""
    return _call_backward(dy, y, dim, False, mask, scale, causal, dtype, backend)


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
    return _call_backward(dy, y, dim, True, mask, scale, causal, dtype, backend)


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
    scale = checks.masked(fn, x, d, mask, scale, causal)
    if _route(x, mask) in ("op", "func"):
        raise RuntimeError(
            f"fastsoftmax.ops.softmax.forward is an eager call with no autograd and no custom op: under "
            f"torch.compile, fake tensors, dispatch modes and torch.func use fs.{fn}"
        )
    with torch.no_grad():
        out = dispatch.softmax(x, d, log, out_dtype, backend, mask, scale, causal, want_lse=want_lse)
    return out if want_lse else (out, None)


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
        extra = f", scale={self.scale!r}" if self.scale is not None else ""
        extra += f", causal={self.causal!r}" if self.causal is not False else ""
        extra += f", dtype={self.dtype!r}" if self.dtype is not None else ""
        return f"dim={self.dim!r}{extra}, backend={self.backend!r}"


class LogSoftmax(Softmax):
    """Drop-in for torch.nn.LogSoftmax (dim defaults to -1)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return log_softmax(
            x, self.dim, mask=mask, scale=self.scale, causal=self.causal, dtype=self.dtype, backend=self.backend
        )


# ---- the custom ops --------------------------------------------------------------------------------------
# Their arguments are checked (by the public functions above); dim is non-negative and dtype the output's.


def _fake(x, dim, log, dtype, backend, *masking):
    return torch.empty_like(x, dtype=dtype or x.dtype)


def _fake_backward(dy, y, dim, log, dtype, backend, *masking):
    return torch.empty_like(y, dtype=dtype or y.dtype)


def _setup(ctx, inputs, output):
    x, dim, log, dtype, backend = inputs
    ctx.save_for_backward(output)  # only the output: the gradient needs y, never x
    ctx.save_for_forward(output)  # the jvp's (the transform Function under torch.func)
    ctx.dim, ctx.log, ctx.x_dtype, ctx.backend = dim, log, x.dtype, backend


def _grad(ctx, dy):
    (y,) = ctx.saved_tensors
    if compose.torch_backward(dy):  # create_graph=True, torch.func, batched grads: torch ops, differentiable
        dx = grad_torch(dy, y, ctx.dim % max(y.dim(), 1), ctx.log, ctx.x_dtype)
    else:
        dx = _call_backward(dy, y, ctx.dim, ctx.log, None, None, False, ctx.x_dtype, ctx.backend)
    return dx, None, None, None, None


def _jvp(ctx, x_t, *_):
    """softmax's tangent y * (t - sum(y * t)), log_softmax's t - sum(exp(y) * t); 0 on fully masked rows."""
    (y,) = ctx.saved_tensors
    if y.dim() == 0:  # softmax of a scalar is constant
        return torch.zeros_like(y)
    wide = torch.float64 if torch.float64 in (y.dtype, x_t.dtype) else torch.float32
    t, p = x_t.to(wide), y.to(wide)
    p = p.exp() if ctx.log else p
    s = (p * t).sum(ctx.dim, keepdim=True)
    out = t - s if ctx.log else p * (t - s)
    return torch.where(p.sum(ctx.dim, keepdim=True) == 0, 0.0, out).to(y.dtype)


def _vmap(info, in_dims, x, dim, log, dtype, backend):
    """The batch is more rows: one launch of the kernels."""
    apply = SOFTMAX.transform.apply
    if in_dims[0] is None:
        return apply(x, dim, log, dtype, backend), None
    x = x.movedim(in_dims[0], 0)
    if x.dim() == 1:  # a batch of 0-d tensors: each a row of one element
        return apply(x[:, None], 1, log, dtype, backend)[:, 0], 0
    return apply(x, dim % (x.dim() - 1) + 1, log, dtype, backend), 0


def _checked(x, dim, log, dtype, backend, mask=None, scale=None, causal=False):
    """The custom ops' implementation when called directly (torch.ops.fastsoftmax.softmax[_masked]): the
    public functions' checks, then dispatch.py's."""
    fn = "log_softmax" if log else "softmax"
    d, _ = checks.softmax(fn, x, dim, dtype, backend)
    scale = checks.masked(fn, x, d, mask, scale, causal)
    return dispatch.softmax(x, d, log, dtype, backend, mask, scale, causal)


def _checked_backward(dy, y, dim, log, dtype, backend, mask=None, scale=None, causal=False):
    fn = ("log_softmax" if log else "softmax") + "_backward"
    d, dtype = checks.softmax_backward(fn, dy, y, dim, dtype, backend)
    scale = checks.masked(fn, y, d, mask, scale, causal)
    return dispatch.softmax_backward(dy, y, d, log, dtype, backend, mask, scale, causal)


_S = "Tensor x, int dim, bool log, ScalarType? dtype, str backend"
_B = "Tensor dy, Tensor y, int dim, bool log, ScalarType? dtype, str backend"
_M = "Tensor? mask, float? scale, bool causal"

SOFTMAX = compose.Op("softmax", dispatch.softmax, _fake, f"({_S}) -> Tensor", setup_context=_setup,
                     backward=_grad, jvp=_jvp, vmap=_vmap, checked=_checked)  # fmt: skip


def _backward_composite(dy, y, dim, log, dtype, backend, mask=None, scale=None, causal=False):
    """Autograd through the gradient itself, or a torch.func transform: torch ops, differentiable in dy and y."""
    heuristics.record(heuristics.Plan("torch", "composite"))
    return grad_torch(dy, y, dim % max(y.dim(), 1), log, dtype or y.dtype, mask, scale, causal)


SOFTMAX_BACKWARD = compose.Op("softmax_backward", dispatch.softmax_backward, _fake_backward, f"({_B}) -> Tensor",
                              func=_backward_composite, checked=_checked_backward)  # fmt: skip


def _masked_setup(ctx, inputs, output):
    x, dim, log, dtype, backend, mask, scale, causal = inputs
    ctx.save_for_backward(output, mask)  # the output and the mask (a broadcast view), never x
    ctx.dim, ctx.log, ctx.x_dtype, ctx.backend, ctx.scale, ctx.causal = dim, log, x.dtype, backend, scale, causal


def _masked_grad(ctx, dy):
    """dx = scale * dz (dz: the plain backward), 0 at masked positions (one fused pass on the Triton
    backend); a floating mask that requires grad gets dz, summed over the dims it is broadcast along."""
    y, mask = ctx.saved_tensors
    want_mask = ctx.needs_input_grad[5] and mask is not None and mask.dtype.is_floating_point
    # float64 where an input is, and for a float64 mask where the backend may run torch ops (the named kernel
    # backends write no float64: their forward read the mask in fp32, and dz is made in fp32 there too)
    f64_mask = want_mask and mask.dtype == torch.float64 and ctx.backend in ("auto", "torch")
    wide = torch.float64 in (y.dtype, dy.dtype, ctx.x_dtype) or f64_mask
    dtype = torch.float64 if wide else torch.float32
    if compose.torch_backward(dy):  # create_graph=True, torch.func, batched grads: torch ops, differentiable
        dz = grad_torch(dy, y, ctx.dim % max(y.dim(), 1), ctx.log, dtype, mask, None, ctx.causal)
    elif not want_mask:
        dx = _call_backward(dy, y, ctx.dim, ctx.log, mask, ctx.scale, ctx.causal, ctx.x_dtype, ctx.backend)
        return dx, None, None, None, None, None, None, None
    else:
        dz = _call_backward(dy, y, ctx.dim, ctx.log, mask, None, ctx.causal, dtype, ctx.backend)
    dx = (dz * ctx.scale if ctx.scale is not None else dz).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    dmask = dz.sum_to_size(mask.shape).to(mask.dtype) if want_mask else None
    return dx, None, None, None, None, dmask, None, None


def masked_composite(x, dim, log, dtype, backend, mask, scale, causal):
    """Masked softmax in torch ops, differentiable in x and a floating mask (torch.func transforms): the
    library's conventions (removed positions exactly 0 / -inf with gradient 0, fully masked rows zeros /
    -inf)."""
    from ..core import masking

    heuristics.record(heuristics.Plan("torch", "composite"))
    dim = dim % max(x.dim(), 1)
    out_dtype = dtype or x.dtype
    wide = torch.float64 in (x.dtype, out_dtype) or (mask is not None and mask.dtype == torch.float64)
    xm = x.movedim(dim, -1)
    mm = mask.expand(x.shape).movedim(dim, -1) if mask is not None else None
    z = masking.logits(xm, mm, scale, causal, torch.float64 if wide else torch.float32)
    y = softmax_torch(z, -1, log, out_dtype, z.dtype)[0]
    gone = masking.removed(xm, mm, causal)
    if gone is not None:
        y = y.masked_fill(gone, float("-inf") if log else 0.0)
    return y.movedim(-1, dim)


SOFTMAX_MASKED = compose.Op("softmax_masked", dispatch.softmax, _fake, f"({_S}, {_M}) -> Tensor",
                            setup_context=_masked_setup, backward=_masked_grad, func=masked_composite,
                            checked=_checked)  # fmt: skip
SOFTMAX_BACKWARD_MASKED = compose.Op("softmax_backward_masked", dispatch.softmax_backward, _fake_backward,
                                     f"({_B}, {_M}) -> Tensor", func=_backward_composite,
                                     checked=_checked_backward)  # fmt: skip
