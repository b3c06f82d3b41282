"""fs.cross_entropy: torch.nn.functional.cross_entropy's semantics for logits with the classes along the last
dim ((M, V), or (..., V) with targets shaped (...)), from one read of the logits forward (a loss and a
logsumexp per row) and one read + one write backward (dlogits from the saved logsumexp).

Targets outside [0, V) that are not ignore_index raise: on a GPU at a device-side assertion (no host
synchronisation: the error surfaces at the next synchronising call, as CUDA's own asserts do); on the CPU
at once. On the Triton path on a GPU the check is the forward's last program's (it asserts on the device),
so a forward is two launches (rows, then ce_finish; one where a program holds every row and finishes too)
and a backward one; the kernels never address memory with a bad target. reduction='mean' divides by the
number of rows not ignored (all ignored: NaN, as torch). Label smoothing e: loss = (1 - e) * nll +
e * mean_j(-log p_j), as torch.

A call: the arguments checked once, autocast's loss dtype, the route; a plain call goes straight to
dispatch.cross_entropy, the others through the custom ops below (core/compose.Op), whose implementations are
dispatch.py's functions of the same names. The loss options travel as flat arguments (a custom op's schema
holds ints, floats, strings and tensors); options.Loss gathers them again below the op.
"""

from __future__ import annotations

import torch

from .. import dispatch, heuristics
from ..core import checks, compose, dtypes
from ..core.layout import flat
from ..core.options import Loss
from ..kernels.torch_loss import (
    capped,
    dlogits_options,
    kept_rows,
    loss_rows_torch,
    max_log_sum,
    no_z_term,
    reduce_terms,
    row_grads,
)

_PLAIN = compose.PLAIN_TYPES
_replayed = dispatch.replayed_loss


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
    Under torch.autocast the loss is float32 (as torch's); target: int64, int32, int16, int8 or uint8, any strides.
    class_weight: torch's ``weight=``; softcap: logits become softcap * tanh(logits / softcap) first;
    z_loss: adds z_loss * logsumexp^2 per kept row. return_z_loss=True returns (loss, the z-loss term alone,
    reduced the same way; it carries no gradient)."""
    if (  # a plain call seen before: what it ran, again (options of the types the key was recorded with)
        type(logits) is torch.Tensor
        and type(ignore_index) is int
        and type(label_smoothing) is float
        and type(z_loss) is float
        and (softcap is None or type(softcap) is float)
        and type(return_z_loss) is bool
        and (out := _replayed(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap,
                              z_loss, backend)) is not None
    ):  # fmt: skip
        if not return_z_loss:
            return out[0]
        return out[0], (out[1] if out[1] is not None else no_z_term(out[0], target, ignore_index, reduction))
    if type(logits) not in _PLAIN and compose.is_dtensor(logits):  # sharded on the classes: distributed
        from ..distributed import dtensor

        opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        opts |= dict(softcap=softcap, z_loss=z_loss, backend=backend)
        return dtensor.cross_entropy(logits, target, class_weight, return_z_loss, **opts)
    checks.cross_entropy(logits, target, ignore_index, reduction, label_smoothing, backend)
    checks.loss_extras("cross_entropy", logits, class_weight, softcap, z_loss, return_z_loss)
    eps, cap, zl = float(label_smoothing), None if softcap is None else float(softcap), float(z_loss)
    args = (logits, target, class_weight, ignore_index, reduction, eps, cap, zl, backend, compose.loss_dtype(logits))
    route = compose.route(logits, target, class_weight)
    if route == "plain":
        loss, z, _ = dispatch.cross_entropy(*args, stats=False)
    elif route == "function":  # (eager autograd: torch's own nodes where they hold, else the Function)
        loss, z, *_ = dispatch.cross_entropy_graph(*args) or CROSS_ENTROPY.eager.apply(*args)
    else:
        loss, z, _ = CROSS_ENTROPY.call(route, *args)
    if not return_z_loss:
        return loss
    return loss, (z if z is not None else no_z_term(loss.detach(), target, ignore_index, reduction))  # (none made)


# ---- the custom ops ----------------------------------------------------------------------------------------

_OPTS = "int ignore_index, str reduction, float label_smoothing, float? softcap, float z_loss, str backend"


def _fake(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
          out_dtype):  # fmt: skip
    rows = logits.numel() // logits.shape[-1]
    shape = target.shape if reduction == "none" else ()
    loss = logits.new_empty(shape, dtype=out_dtype)
    return loss, torch.empty_like(loss), logits.new_empty((rows + 3,), dtype=torch.float64)  # dispatch's


def _setup(ctx, inputs, output):
    logits, target, class_weight, *opts, backend, _ = inputs
    ctx.save_for_backward(logits, target, class_weight, output[2])  # the logits; per row lse, the counts
    ctx.opts, ctx.backend = tuple(opts), backend
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)  # (no zeros made for them in the backward)


def _grad(ctx, grad_loss, _grad_z, _grad_stats):
    logits, target, class_weight, stats = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 10
    if compose.torch_backward(grad_loss):  # create_graph=True, torch.func, batched grads: torch ops
        dx = dlogits_differentiable(logits, target, class_weight, stats, grad_loss, *ctx.opts)
    else:
        args = (logits, target, class_weight, stats, grad_loss, *ctx.opts, ctx.backend)
        route = compose.route(logits, grad_loss)
        dx = dispatch.cross_entropy_backward(*args) if route == "plain" else CROSS_ENTROPY_BACKWARD.call(route, *args)
    return dx, None, None, None, None, None, None, None, None, None


def dlogits_differentiable(logits, target, class_weight, stats, grad, *opts):
    """dlogits in torch ops, differentiable in the logits (the logsumexp recomputed from them, not the saved
    one: the Hessian's -p p^T term) and in grad: create_graph=True and torch.func transforms."""
    o = Loss(*opts)
    x, t = flat(logits, target)
    m = x.shape[0]
    g_ce, g_z = row_grads(grad, stats[m], stats[m + 2], o.reduction, m)
    top, ls = max_log_sum(capped(x.to(dtypes.wide(x.dtype)), o.softcap))
    dx = dlogits_options(x, t, top.double() + ls.double(), g_ce, g_z, o, class_weight)
    return dx.to(logits.dtype).reshape(logits.shape)


def composite(
    logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, backend, out_dtype,
    fn="cross_entropy",
):  # fmt: skip
    """The loss in torch ops, differentiable to any order (torch.func transforms), as (loss, z-loss, None);
    targets checked first, the error naming ``fn`` (one made inside the transform, which vmap may batch, by
    a gather that raises: checks.targets)."""
    heuristics.record(heuristics.Plan("torch", "composite"))
    o = Loss(ignore_index, reduction, smoothing, softcap, z_loss)
    # (the target as given, not t: under torch.func.grad even a reshape of a plain tensor is wrapped; not asked
    # under torch.compile, whose Dynamo cannot trace is_functorch_wrapped_tensor: checks.targets asserts there)
    readable = compose.compiling() or not torch._C._functorch.is_functorch_wrapped_tensor(target)
    x, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    checks.targets(t, x.shape[-1], ignore_index, fn, readable)
    ce, zr, _ = loss_rows_torch(x, t, o, class_weight)
    kept, w_kept = kept_rows(t, ignore_index, class_weight, x.shape[-1], ce.dtype)
    loss, z = reduce_terms(ce, zr, kept, w_kept, reduction, out_dtype)
    if reduction == "none":
        loss, z = loss.reshape(target.shape), z.reshape(target.shape)
    return loss, z.detach(), None


def _checked(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
             out_dtype):  # fmt: skip
    """The custom op's implementation when called directly (torch.ops.fastsoftmax.cross_entropy): the public
    function's checks, then dispatch.py's."""
    checks.cross_entropy(logits, target, ignore_index, reduction, label_smoothing, backend)
    checks.loss_extras("cross_entropy", logits, class_weight, softcap, z_loss)
    return dispatch.cross_entropy(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap,
                                  z_loss, backend, out_dtype)  # fmt: skip


CROSS_ENTROPY = compose.Op(
    "cross_entropy",
    dispatch.cross_entropy,
    _fake,
    f"(Tensor logits, Tensor target, Tensor? class_weight, {_OPTS}, ScalarType out_dtype) -> (Tensor, Tensor, Tensor)",
    setup_context=_setup,
    backward=_grad,
    func=composite,
    checked=_checked,
)


def _backward_fake(logits, target, class_weight, stats, grad, *_):
    return logits.new_empty(logits.shape)  # contiguous, as dispatch writes it


CROSS_ENTROPY_BACKWARD = compose.Op(
    "cross_entropy_backward",
    dispatch.cross_entropy_backward,
    _backward_fake,
    f"(Tensor logits, Tensor target, Tensor? class_weight, Tensor stats, Tensor grad, {_OPTS}) -> Tensor",
    func=lambda *a: dlogits_differentiable(*a[:10]),
)
