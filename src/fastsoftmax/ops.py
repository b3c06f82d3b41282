"""softmax / log_softmax and their backward as torch.library custom ops, so that autograd, torch.compile
(no graph break: each pass is one opaque op with a fake implementation) and torch.library.opcheck see
them. One implementation serves every device: it calls the dispatch point, which picks the backend.

Registering the ops is the only thing this module does at import (no device query, no compile).
"""

from __future__ import annotations

import torch

from . import api, compose, heuristics, loss, masking
from .reference import grad_torch, softmax_torch


def _softmax(x, dim, log, dtype, backend):
    return api.forward(x, dim, log=log, dtype=dtype, backend=backend, fn="log_softmax" if log else "softmax")[0]


def _softmax_backward(dy, y, dim, log, dtype, backend):
    return api.backward(dy, y, dim, log=log, dtype=dtype, backend=backend)


@torch.library.custom_op("fastsoftmax::softmax", mutates_args=())
def softmax(x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None, backend: str) -> torch.Tensor:
    return _softmax(x, dim, log, dtype, backend)


@softmax.register_fake
def _(x, dim, log, dtype, backend):
    return torch.empty_like(x, dtype=dtype or x.dtype)


@torch.library.custom_op("fastsoftmax::softmax_backward", mutates_args=())
def softmax_backward(
    dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype, backend: str
) -> torch.Tensor:
    return _softmax_backward(dy, y, dim, log, dtype, backend)


@softmax_backward.register_fake
def _(dy, y, dim, log, dtype, backend):
    return torch.empty_like(y, dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, dim, log, dtype, backend = inputs
    ctx.save_for_backward(output)  # only the output: the gradient needs y, never x
    ctx.dim, ctx.log, ctx.x_dtype, ctx.backend = dim, log, x.dtype, backend


def _differentiable() -> bool:
    """Whether a backward must itself be differentiable: create_graph=True, or a torch.func transform (whose
    tensors the kernels cannot take) is active."""
    return torch.is_grad_enabled() or compose.transformed()


def _backward(ctx, dy, kernel_backward=None):
    """``kernel_backward``: what computes dx without create_graph (default: the softmax_backward op)."""
    (y,) = ctx.saved_tensors
    if _differentiable():
        # create_graph=True: a gradient made of torch ops, itself differentiable, so double backward works.
        dx = grad_torch(dy, y, ctx.dim % max(y.dim(), 1), ctx.log, ctx.x_dtype)
    else:
        dx = (kernel_backward or softmax_backward)(dy, y, ctx.dim, ctx.log, ctx.x_dtype, ctx.backend)
    return dx, None, None, None, None


softmax.register_autograd(_backward, setup_context=_setup_context)


# Eager autograd: the custom ops' forward, context and backward without the ops' dispatch layers. Under
# torch.profiler on the H200 (dev/profile_ce.py; the profiler's own overhead included) the ops' wrappers
# held ~0.4 ms of CPU time per call, more than the kernels of 500 MB of logits; without them fp32
# cross-entropy fwd+bwd at 8192x32000 went from 73% to 93% of copy (bench/results/h200_ce*.txt).
# torch.compile traces the custom ops instead (api.py and loss.py choose).


class SoftmaxEager(torch.autograd.Function):
    """Also what torch.func transforms and forward-mode AD see (compose.py's 'func' route): a vmap rule (the
    batch is more rows: one launch of the kernels) and a jvp rule in torch ops (softmax's tangent is
    y * (t - sum(y * t)), log_softmax's t - sum(exp(y) * t); 0 on fully masked rows)."""

    @staticmethod
    def forward(x, dim, log, dtype, backend):
        return _softmax(x, dim, log, dtype, backend)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.save_for_forward(output)

    @staticmethod
    def backward(ctx, dy):
        return _backward(ctx, dy, _softmax_backward)

    @staticmethod
    def jvp(ctx, x_t, *_):
        (y,) = ctx.saved_tensors
        if y.dim() == 0:  # softmax of a scalar is constant
            return torch.zeros_like(y)
        wide = torch.float64 if torch.float64 in (y.dtype, x_t.dtype) else torch.float32
        t, p = x_t.to(wide), y.to(wide)
        p = p.exp() if ctx.log else p
        s = (p * t).sum(ctx.dim, keepdim=True)
        out = t - s if ctx.log else p * (t - s)
        return torch.where(p.sum(ctx.dim, keepdim=True) == 0, 0.0, out).to(y.dtype)  # fully masked rows: 0

    @staticmethod
    def vmap(info, in_dims, x, dim, log, dtype, backend):
        if in_dims[0] is None:
            return SoftmaxEager.apply(x, dim, log, dtype, backend), None
        x = x.movedim(in_dims[0], 0)
        if x.dim() == 1:  # a batch of 0-d tensors: each a row of one element
            return SoftmaxEager.apply(x[:, None], 1, log, dtype, backend)[:, 0], 0
        return SoftmaxEager.apply(x, dim % (x.dim() - 1) + 1, log, dtype, backend), 0


def softmax_masked_torch(x, dim, log, dtype, mask, scale, causal):
    """Masked softmax in torch ops, differentiable in x and a floating mask (torch.func transforms): the
    library's conventions (removed positions exactly 0 / -inf with gradient 0, fully masked rows zeros /
    -inf). ``dim`` non-negative."""
    heuristics.record(heuristics.Plan("torch", "composite"))
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


@torch.library.custom_op("fastsoftmax::softmax_masked", mutates_args=())
def softmax_masked(
    x: torch.Tensor, dim: int, log: bool, dtype: torch.dtype | None, backend: str, mask: torch.Tensor | None,
    scale: float | None, causal: bool,
) -> torch.Tensor:  # fmt: skip
    return api.forward(x, dim, log=log, dtype=dtype, backend=backend, fn="log_softmax" if log else "softmax",
                       mask=mask, scale=scale, causal=causal)[0]  # fmt: skip


@softmax_masked.register_fake
def _(x, dim, log, dtype, backend, mask, scale, causal):
    return torch.empty_like(x, dtype=dtype or x.dtype)


def _setup_masked(ctx, inputs, output):
    x, dim, log, dtype, backend, mask, scale, causal = inputs
    ctx.save_for_backward(output, mask)  # the output and the mask (a broadcast view), never x
    ctx.dim, ctx.log, ctx.x_dtype, ctx.backend, ctx.scale, ctx.causal = dim, log, x.dtype, backend, scale, causal


@torch.library.custom_op("fastsoftmax::softmax_backward_masked", mutates_args=())
def softmax_backward_masked(
    dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, dtype: torch.dtype, backend: str,
    mask: torch.Tensor | None, scale: float | None, causal: bool,
) -> torch.Tensor:  # fmt: skip
    return api.backward(dy, y, dim, log=log, dtype=dtype, backend=backend, mask=mask, scale=scale, causal=causal)


@softmax_backward_masked.register_fake
def _(dy, y, dim, log, dtype, backend, mask, scale, causal):
    return torch.empty_like(y, dtype=dtype)


def _backward_masked(ctx, dy):
    """dx = scale * dz (dz: the plain backward), 0 at masked positions (one fused pass on the Triton
    backend); a floating mask that requires grad gets dz, summed over the dims it is broadcast along."""
    y, mask = ctx.saved_tensors
    want_mask = ctx.needs_input_grad[5] and mask is not None and mask.dtype.is_floating_point
    args = (ctx.dim, ctx.log)
    if not _differentiable():
        if not want_mask:
            dx = softmax_backward_masked(dy, y, *args, ctx.x_dtype, ctx.backend, mask, ctx.scale, ctx.causal)
            return dx, None, None, None, None, None, None, None
        wide = torch.float64 in (y.dtype, dy.dtype, ctx.x_dtype, mask.dtype)
        dz = softmax_backward_masked(dy, y, *args, torch.float64 if wide else torch.float32, ctx.backend, mask, None,
                                     ctx.causal)  # fmt: skip
    else:  # create_graph=True: torch ops, differentiable again
        wide = torch.float64 in (y.dtype, dy.dtype, ctx.x_dtype)
        dz = grad_torch(dy, y, ctx.dim % max(y.dim(), 1), ctx.log, torch.float64 if wide else torch.float32, mask,
                        None, ctx.causal)  # fmt: skip
    dx = (dz * ctx.scale if ctx.scale is not None else dz).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    dmask = dz.sum_to_size(mask.shape).to(mask.dtype) if want_mask else None
    return dx, None, None, None, None, dmask, None, None


softmax_masked.register_autograd(_backward_masked, setup_context=_setup_masked)


@torch.library.custom_op("fastsoftmax::cross_entropy", mutates_args=())
def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    backend: str, out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return loss._forward(logits, target, ignore_index, reduction, label_smoothing, backend, out_dtype)


@cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, label_smoothing, backend, out_dtype):
    rows = logits.numel() // logits.shape[-1]
    stat = torch.float64 if logits.dtype == torch.float64 else torch.float32
    shape = target.shape if reduction == "none" else ()
    return logits.new_empty(shape, dtype=out_dtype), logits.new_empty((rows + 2,), dtype=stat)  # loss._forward's


@torch.library.custom_op("fastsoftmax::cross_entropy_backward", mutates_args=())
def cross_entropy_backward(
    logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor, grad: torch.Tensor, ignore_index: int,
    reduction: str, label_smoothing: float, backend: str,
) -> torch.Tensor:  # fmt: skip
    return loss._backward(logits, target, stats, grad, ignore_index, reduction, label_smoothing, backend)


@cross_entropy_backward.register_fake
def _(logits, target, stats, grad, ignore_index, reduction, label_smoothing, backend):
    return logits.new_empty(logits.shape)  # contiguous, as loss._backward writes it


def _setup_ce(ctx, inputs, output):
    logits, target, ignore_index, reduction, label_smoothing, backend, _ = inputs
    ctx.save_for_backward(logits, target, output[1])  # the logits; one logsumexp per row, the rows kept
    ctx.args = (ignore_index, reduction, label_smoothing, backend)
    ctx.mark_non_differentiable(output[1])


def _backward_ce(ctx, grad_loss, _grad_lse, kernel_backward=None):
    logits, target, stats = ctx.saved_tensors
    if _differentiable():  # create_graph=True: torch ops, differentiable in the logits and grad_loss
        dx = loss.dlogits_differentiable(logits, target, stats, grad_loss, *ctx.args[:3])
    else:
        dx = (kernel_backward or cross_entropy_backward)(logits, target, stats, grad_loss, *ctx.args)
    return dx, None, None, None, None, None, None


cross_entropy.register_autograd(_backward_ce, setup_context=_setup_ce)


class CrossEntropyEager(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, label_smoothing, backend, out_dtype):
        inputs = (logits, target, ignore_index, reduction, label_smoothing, backend, out_dtype)
        out = loss._forward(*inputs)
        _setup_ce(ctx, inputs, out)
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        return _backward_ce(ctx, grad_loss, grad_lse, loss._backward)
