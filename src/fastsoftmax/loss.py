"""fs.cross_entropy: torch.nn.functional.cross_entropy's semantics for logits with the classes along the last
dim ((M, V), or (..., V) with targets shaped (...)), from one read of the logits forward (a loss and a
logsumexp per row) and one read + one write backward (dlogits from the saved logsumexp).

Targets outside [0, V) that are not ignore_index raise: on a GPU at a device-side assertion (no host
synchronisation: the error surfaces at the next synchronising call, as CUDA's own asserts do); on the CPU
at once. On the Triton path the check is the forward's last kernel's (ce_finish asserts on CUDA), so a
forward is two launches (rows, finish) and a backward one; the kernels never address memory with a bad
target. reduction='mean' divides by the number of rows not ignored (all ignored:
NaN, as torch). Label smoothing e: loss = (1 - e) * nll + e * mean_j(-log p_j), as torch.
"""

from __future__ import annotations

import torch

from . import checks, compose, dispatch, dtensor, dtypes, fastpath, ops
from .backends.torch import CHUNK, native_dlogits_differentiable


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.cross_entropy for logits with the classes along the last dim; see the module.
    Under torch.autocast the loss is float32 (as torch's); target: any integer dtype, any strides.
    class_weight: torch's ``weight=``; softcap, z_loss: see the module. return_z_loss=True returns (loss,
    the z-loss term alone, reduced the same way; it carries no gradient)."""
    k = None
    if not _compiling():  # (torch.compile traces past the replay: dynamo folds this call)
        opts = (ignore_index, reduction, label_smoothing, softcap, z_loss, return_z_loss, backend)
        if (out := fastpath.loss_cpu(logits, target, class_weight, *opts)) is not None:
            return out  # the CPU's direct path in C (its common calls)
        k = fastpath.loss_key(logits, target, class_weight, *opts)
        if k is not None and (out := fastpath.loss_fast(k, logits, target)) is not None:
            return out  # a call seen before, replayed (fastpath.py)
    if backend == "auto" and softcap is None and type(z_loss) in _NUM and z_loss == 0 and return_z_loss is False:
        if (out := _cpu(logits, target, class_weight, ignore_index, reduction, label_smoothing)) is not None:
            return out
    if type(logits) not in _PLAIN and dtensor.is_dtensor(logits):  # sharded on the classes: distributed.py
        opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        opts |= dict(softcap=softcap, z_loss=z_loss, backend=backend)
        return dtensor.cross_entropy(logits, target, class_weight, return_z_loss, **opts)
    checks.cross_entropy(logits, target, ignore_index, reduction, label_smoothing, backend)
    checks.loss_extras("cross_entropy", logits, class_weight, softcap, z_loss, return_z_loss)
    eps, out_dtype = float(label_smoothing), compose.loss_dtype(logits)
    cap = None if softcap is None else float(softcap)
    args = (logits, target, class_weight, ignore_index, reduction, eps, cap, float(z_loss), backend, out_dtype)
    if k is not None:
        run = lambda: ops.cross_entropy(*args)  # noqa: E731
        loss, z, _ = fastpath.loss_record(
            k, logits, target, run, ops.cross_entropy_backward, ops.dlogits_differentiable
        )
    else:
        loss, z, _ = ops.cross_entropy(*args)
    return (loss, z) if return_z_loss else loss


_compiling = compose.dynamo_compiling


# ---- the CPU's direct path -----------------------------------------------------------------------------
# On CPU tensors under backend='auto', a call with no softcap and no z-loss runs torch's loss and a chunked
# dlogits (backends/torch.py's native cross-entropy) straight from here: plain, or with eager autograd
# through CpuCrossEntropyFunction; logits without smoothing instead keep a C++ autograd graph, whose
# backward costs less than any Python one, unless a row's softmax is NaN: the row kernels' (fp32 and bf16, no
# class weights: any size), else torch's own (log_softmax, nll_loss) within one chunk. softcap and z-loss
# calls, other routes (torch.compile, torch.func, fake tensors, dispatch modes, autocast) and arguments the
# full checks must see take the full path.

_FLOATS, _TARGETS = frozenset(dtypes.FLOATS), frozenset(dtypes.TARGETS)
_PLAIN = compose.PLAIN_TYPES
_NUM = (int, float)
_GRAPH_MAX = CHUNK  # logits elements up to which torch's autograd graph runs the backward (one chunk)
_ROWS = (torch.float32, torch.bfloat16)  # the row kernels' dtypes: their graph past one chunk too


def _cpu_ok(logits, target, class_weight, ignore_index, reduction, smoothing) -> bool:
    """Whether the call can take the CPU's direct path, with arguments that checks.cross_entropy and
    checks.loss_extras pass."""
    if type(logits) not in _PLAIN or type(target) not in _PLAIN or not logits.is_cpu or not target.is_cpu:
        return False
    if not compose.eager() or compose.any_autocast():
        return False
    if logits.dtype not in _FLOATS or target.dtype not in _TARGETS or not logits.dim() or not logits.numel():
        return False
    if type(ignore_index) is not int or reduction not in checks.REDUCTIONS or type(smoothing) not in _NUM:
        return False
    if not 0.0 <= smoothing <= 1.0 or target.shape != logits.shape[:-1] or not logits.data_ptr():
        return False
    if not target.data_ptr() or "cpu" not in dispatch.DEVICES:
        return False
    if class_weight is not None:
        w = class_weight
        if type(w) not in _PLAIN or not w.is_cpu or not w.dtype.is_floating_point or w.shape != logits.shape[-1:]:
            return False
        if not w.data_ptr():
            return False
    return True


def _cpu(logits, target, class_weight, ignore_index, reduction, smoothing):
    if not _cpu_ok(logits, target, class_weight, ignore_index, reduction, smoothing):
        return None
    opts = (ignore_index, reduction, float(smoothing))
    grad = logits.requires_grad and torch.is_grad_enabled()
    large = logits.numel() > _GRAPH_MAX  # (under autograd: only the row kernels' graph, which has no M x V)
    if grad and (smoothing or (large and (class_weight is not None or logits.dtype not in _ROWS))):
        return CpuCrossEntropyFunction.apply(logits, target, class_weight, opts)
    x, t, w = dispatch.cpu_flat(logits, target, class_weight)
    if not grad:
        loss = dispatch.cpu_cross_entropy(x, t, w, *opts)
    elif (loss := dispatch.cpu_cross_entropy_graph(x, t, w, ignore_index, reduction, large)) is None:
        return CpuCrossEntropyFunction.apply(logits, target, class_weight, opts)  # (a row of NaN softmax)
    return loss.reshape(target.shape) if reduction == "none" else loss


class CpuCrossEntropyFunction(torch.autograd.Function):
    """The CPU's direct path under eager autograd: the loss; dlogits recomputed from the logits in the
    backward (nothing but the inputs is kept), or in differentiable torch ops where create_graph asks
    (double backward). class_weight gets no gradient, as on every path."""

    @staticmethod
    def forward(ctx, logits, target, class_weight, opts):
        x, t, w = dispatch.cpu_flat(logits, target, class_weight)
        ctx.save_for_backward(logits)
        ctx.x, ctx.t, ctx.w, ctx.opts = x, t, w, opts  # (not inputs: the flattened views and copies)
        ctx.set_materialize_grads(False)
        loss = dispatch.cpu_cross_entropy(x, t, w, *opts)
        return loss.reshape(target.shape) if opts[1] == "none" else loss

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            return None, None, None, None
        (logits,) = ctx.saved_tensors
        if torch.is_grad_enabled():
            dx = native_dlogits_differentiable(logits, ctx.t, ctx.w, grad, *ctx.opts)
        else:
            dx = dispatch.cpu_cross_entropy_backward(ctx.x, ctx.t, ctx.w, grad, *ctx.opts).reshape(logits.shape)
        return dx, None, None, None
