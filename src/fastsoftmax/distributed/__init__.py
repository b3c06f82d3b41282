"""Softmax, log_softmax, cross-entropy and the LM head's loss with the classes split across a torch.distributed
process group (tensor parallelism): rank r holds a contiguous slice of the classes (of the logits' last dim,
or of the LM head's weight rows), in rank order; slices may differ in width, hold no finite value, or be empty.

Per forward, the same collectives on every rank whatever its inputs:
  1. an all-gather of each rank's signature (its slice's width, its row count, its dtype, a digest of the
     call's options, a digest of its targets, whether its argument checks failed, the sum of its class
     weights, and for the LM head a sample of x's values), from which every rank checks that the ranks
     agree and finds its slice's offset in the vocabulary, as a device tensor; a rank whose checks fail
     sends it flagged, then raises;
  2. an all-gather of per-row statistics of each slice (its max and sum of exp(x - max), and for the losses
     the target's logit and class weight where the target falls in the slice, and the weighted sum of its
     logits for label smoothing), merged into the row's global numbers. Megatron-LM's vocabulary-parallel
     cross-entropy sends three all-reduces (max, sum of exp, target logit); one all-gather carries them.
     The outputs are (x - max) - log(sum), whose error does not grow with the logits (merge.py).
The backward of the losses needs no collective but the LM head's one all-reduce of dx; softmax and
log_softmax need one all-reduce of a per-row sum. No host synchronisation anywhere (a step can be captured
in a CUDA graph): on CUDA tensors ranks that disagree stop at the same device-side assertion before the
statistics move; on CPU tensors (gloo) every rank raises the same ValueError.

The collectives, their merge and the slice's own work (the kernels', or torch ops') are merge.py's;
this module holds the public functions, their checks and their autograd Functions.

Conventions as the rest of the library: a row that is -inf on every rank gives zeros (softmax) / -inf
(log_softmax) and a zero gradient; NaN or +inf anywhere in a row gives NaN across it. Loss options as
fs.cross_entropy's, with ``class_weight`` this rank's slice of the class weights. Not supported: double
backward (create_graph=True through a backward raises: the second derivative crosses ranks), torch.func
transforms of these functions, and fake, meta or other subclass tensors (a dispatch mode over the ranks' own
tensors, FlopCounterMode say, runs).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from .. import dispatch, heuristics
from ..core import checks, compose, dtypes, options
from ..core.layout import flat_target
from ..heuristics import lm_head as rules
from ..kernels.torch_loss import chunk_logits, no_z_term, reduce_terms, tile_grads
from . import merge as shard_merge


def _no_double_backward(fn: str) -> None:
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{fn}: double backward (create_graph=True) is not supported: the second derivative crosses ranks"
        )


# ---- softmax and log_softmax --------------------------------------------------------------------------------


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, group, dtype, backend, grad):
        fn = "distributed.log_softmax" if log else "distributed.softmax"
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if dtype == torch.float64:  # (computed in float64 then, as fs.softmax does: torch ops)
            x2 = x2.double()
        shard_merge.agree(fn, x, x2.shape[1], x2.shape[0], group, (log, str(dtype), grad))
        impl = shard_merge.slice_work(x2, backend)
        top, sum_e, _ = shard_merge.slice_stats(impl, x2, None, None, False)
        m, ls = shard_merge.merge_max_sum(shard_merge.gather(torch.stack([top, sum_e], -1), group))
        out = shard_merge.empty_out(x2.shape, dtype or x.dtype, x.device)
        y = impl.normalise(x2, m, ls, log, out) if x2.numel() else out
        ctx.save_for_backward(y, m)
        ctx.log, ctx.group, ctx.x_dtype, ctx.backend, ctx.fn = log, group, x.dtype, backend, fn
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward(ctx.fn)
        y, m = ctx.saved_tensors
        dy2 = dy.reshape(y.shape)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        impl = shard_merge.slice_work(y, ctx.backend, backward=True)
        s = impl.dot(y, dy2, ctx.log) if y.numel() else torch.zeros(y.shape[0], dtype=m.dtype, device=y.device)
        dist.all_reduce(s, group=ctx.group)
        dx = shard_merge.empty_out(y.shape, ctx.x_dtype, y.device)
        if y.numel():
            impl.softmax_backward(y, dy2, s.to(m.dtype), m, ctx.log, dx)
        return dx.reshape(dy.shape), None, None, None, None, None


def _makes_fake() -> bool:
    """A dispatch mode that makes fake tensors (FakeTensorMode, a tracer's), asked of one it makes; a mode
    over the ranks' own tensors (FlopCounterMode, a logging mode) runs the collectives as every other op."""
    return bool(compose.dispatch_modes()) and type(torch.empty(0)) not in compose.PLAIN_TYPES


def _collectives_run() -> bool:
    """Whether this rank can take part in a collective: a process group, and neither a torch.func transform
    nor a dispatch mode that makes fake tensors."""
    return dist.is_initialized() and not compose.transforms_active() and not _makes_fake()


@contextlib.contextmanager
def _local_checks(fn: str, x, group):
    """The block's argument checks, local to this rank. Where one fails and collectives can run, this rank
    still takes part in the first collective, flagged (merge.refuse), so that every other rank raises
    there, naming this one, instead of waiting in it; then this rank raises its own error."""
    try:
        yield
    except Exception:
        if _collectives_run():
            shard_merge.refuse(fn, x, group)
        raise


def _need_group(fn: str, group, *tensors) -> None:
    """An initialised process group, no torch.func transform and no fake, meta or other subclass tensor: the
    statistics cross ranks through collectives, which carry none of these. Where this rank can still take
    part in one (a meta tensor, say), it does, flagged, so that the other ranks raise too."""
    blocked = compose.transforms_active() or _makes_fake()  # (_collectives_run's, asked once)
    if blocked or any(t is not None and (type(t) not in compose.PLAIN_TYPES or t.is_meta) for t in tensors):
        if not blocked and dist.is_initialized():
            shard_merge.refuse(fn, tensors[0], group)
        raise NotImplementedError(
            f"{fn}: torch.func transforms and fake, meta or other subclass tensors are not supported (the "
            "statistics cross ranks through collectives); call it outside them, on the ranks' own tensors"
        )
    if not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialised (init_process_group first)")
    if group is not None and dist.get_rank(group) < 0:  # (-1: this rank is not one of the group's)
        raise ValueError(f"{fn}: this rank ({dist.get_rank()}) is not in the group; call it on the group's ranks")


def softmax(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax along the last dim of logits whose last dim is split across ``group`` (this rank's slice)."""
    with _local_checks("distributed.softmax", x, group):
        checks.shard("distributed.softmax", x, backend, dtype=dtype)
        dispatch.loss_backend_runs("distributed.softmax", backend, x)
    _need_group("distributed.softmax", group, x)
    return _Softmax.apply(x, False, group, dtype, backend, _grad(x))


def log_softmax(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Log-softmax along the last dim of logits whose last dim is split across ``group``."""
    with _local_checks("distributed.log_softmax", x, group):
        checks.shard("distributed.log_softmax", x, backend, dtype=dtype)
        dispatch.loss_backend_runs("distributed.log_softmax", backend, x)
    _need_group("distributed.log_softmax", group, x)
    return _Softmax.apply(x, True, group, dtype, backend, _grad(x))


# ---- the losses -----------------------------------------------------------------------------------------------


def _loss_out(rows: shard_merge.Rows, ce, zr, out_dtype):
    loss, z = reduce_terms(ce, zr, rows.kept, rows.w_kept, rows.o.reduction, out_dtype)
    return loss, (z if z is not None else no_z_term(loss.detach(), rows.t, rows.o.ignore_index, rows.o.reduction))


def _grad(x) -> bool:
    """Whether x's gradient will be asked for: part of the ranks' agreement, as the backward's all-reduce of it
    (softmax's sums, the LM head's dx) needs every rank (a rank whose x needs none would leave it waiting)."""
    return x.requires_grad and torch.is_grad_enabled()


def _options_key(o, w, extra=()) -> tuple:
    return (o.ignore_index, o.reduction, o.smoothing, o.softcap, o.z_loss, w is not None, *extra)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, w, o, group, backend, out_dtype, grad):
        fn = "distributed.cross_entropy"
        t = flat_target(target)
        xf = x.reshape(t.shape[0], x.shape[-1])
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        offset, v_total, w_total = shard_merge.agree(
            fn, x, xf.shape[1], t.shape[0], group, _options_key(o, w, (grad,)), w, t
        )
        checks.targets(t, v_total, o.ignore_index, fn)
        rows = shard_merge.Rows(t, o, offset, xf.shape[-1], w)
        impl = shard_merge.slice_work(xf, backend)
        gathered = shard_merge.gather(rows.local_stats(impl, xf, dtypes.wide(xf.dtype)), group)
        ce, zr = rows.merge(gathered, v_total, w_total)
        loss, z = _loss_out(rows, ce, zr, out_dtype)
        ctx.mark_non_differentiable(z)
        ctx.save_for_backward(xf)
        ctx.rows, ctx.backend, ctx.shape = rows, backend, x.shape
        if o.reduction == "none":
            loss, z = loss.reshape(target.shape), z.reshape(target.shape)
        return loss, z

    @staticmethod
    def backward(ctx, grad, _grad_z):
        _no_double_backward("distributed.cross_entropy")
        (xf,) = ctx.saved_tensors
        rows = ctx.rows
        a, b, cc = rows.coefficients(grad)
        dx = shard_merge.empty_out(xf.shape, xf.dtype, xf.device)
        if xf.numel():
            impl = shard_merge.slice_work(xf, ctx.backend, backward=True)
            o = rows.o
            impl.dlogits(xf, rows.m, rows.ls, a, b, cc, rows.code, rows.w_local, o.softcap, o.smoothing != 0, dx)
        return dx.reshape(ctx.shape), None, None, None, None, None, None, None


def _loss_checks(fn, ignore_index, reduction, label_smoothing, backend, v_device, class_weight, softcap, z_loss, ret_z):
    checks.cross_entropy_options(fn, ignore_index, reduction, label_smoothing, backend)
    checks.loss_extras(fn, v_device, class_weight, softcap, z_loss, ret_z)
    return options.Loss(
        ignore_index, reduction, float(label_smoothing), None if softcap is None else float(softcap), float(z_loss)
    )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fs.cross_entropy of the full logits (classes along the last dim, split across ``group``; ``logits``
    is this rank's slice and ``class_weight`` its slice of the class weights) with global class indices as
    targets, on every rank."""
    fn = "distributed.cross_entropy"
    with _local_checks(fn, logits, group):
        checks.shard(fn, logits, tgt=target)
        extras = (class_weight, softcap, z_loss, return_z_loss)
        o = _loss_checks(
            fn, ignore_index, reduction, label_smoothing, backend, (logits.shape[-1], logits.device), *extras
        )
        dispatch.loss_backend_runs(fn, backend, logits)
    _need_group(fn, group, logits, target, class_weight)
    w = class_weight.contiguous() if class_weight is not None else None
    loss, z = _CrossEntropy.apply(logits, target, w, o, group, backend, compose.loss_dtype(logits), _grad(logits))
    return (loss, z) if return_z_loss else loss


class _LinearCrossEntropy(torch.autograd.Function):
    """The LM head with W split on the classes: chunks of rows through x_c @ W_r^T into one buffer (the
    rows per chunk from ``memory``, as fs.linear_cross_entropy), the slice's statistics of each, one gather;
    the backward computes the logits again, turns them into dlogits in place, and accumulates dx (then
    all-reduced once), dW_r and db_r: in the same row chunks, or, for a ``memory`` too small for chunks to
    pay their passes over dW_r, in row groups x slices of the classes (rules.sliced decides)."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, w, o, group, backend, memory, out_dtype, grad):
        fn = "distributed.linear_cross_entropy"
        t = flat_target(target)
        x2 = x.reshape(t.shape[0], x.shape[-1])
        n, v_local = x2.shape[0], weight.shape[0]
        key = _options_key(o, w, (x.shape[-1], grad))
        offset, v_total, w_total = shard_merge.agree(fn, x2, v_local, n, group, key, w, t, shared=x2)
        checks.targets(t, v_total, o.ignore_index, fn)
        rows = shard_merge.Rows(t, o, offset, v_local, w)
        wide = dtypes.wide(x2.dtype)
        local = torch.empty((n, 5), dtype=wide, device=x.device)
        step = rules.rows_per_chunk(x2, v_local, memory) if n and v_local else max(n, 1)
        if n and v_local:
            buf = torch.empty((min(step, n), v_local), dtype=x2.dtype, device=x.device)
            impl = shard_merge.slice_work(buf, backend)
            for r0 in range(0, n, step):
                r1 = min(r0 + step, n)
                local[r0:r1] = rows.local_stats(impl, chunk_logits(x2[r0:r1], weight, bias, buf[: r1 - r0]), wide, r0)
        else:
            local.copy_(rows.local_stats(shard_merge.TorchOps(), x2.new_empty((n, 0)), wide))
        ce, zr = rows.merge(shard_merge.gather(local, group), v_total, w_total)
        loss, z = _loss_out(rows, ce, zr, out_dtype)
        ctx.mark_non_differentiable(z)
        ctx.save_for_backward(x2, weight, bias)
        ctx.rows, ctx.group, ctx.backend, ctx.step, ctx.x_shape = rows, group, backend, step, x.shape
        ctx.memory = memory
        if o.reduction == "none":
            loss, z = loss.reshape(target.shape), z.reshape(target.shape)
        return loss, z

    @staticmethod
    def backward(ctx, grad, _grad_z):
        _no_double_backward("distributed.linear_cross_entropy")

        x2, weight, bias = ctx.saved_tensors
        rows, step = ctx.rows, ctx.step
        need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
        need_b = need_b and bias is not None
        n, v_local = x2.shape[0], weight.shape[0]
        a, b, cc = rows.coefficients(grad)
        wide = dtypes.wide(x2.dtype)
        forced = (heuristics.forced() or {}).get("path")
        sliced = n and v_local and rules.sliced(n, x2.shape[1], v_local, x2.element_size(), ctx.memory, forced,
                                                recompute=True)  # fmt: skip
        # (dx contiguous whatever x's strides: NCCL all-reduces contiguous tensors only; dW_r written whole by
        # the first chunk or group, added to by the others)
        dx = torch.zeros(x2.shape, dtype=x2.dtype, device=x2.device) if need_x else None
        dw = (
            (torch.empty if n and v_local else torch.zeros)(weight.shape, dtype=weight.dtype, device=x2.device)
            if need_w
            else None
        )
        db = torch.zeros(v_local, dtype=wide, device=x2.device) if need_b else None
        if n and v_local:
            coef = (rows.m, rows.ls, a, b, cc)
            if sliced:
                _slices_backward(x2, weight, bias, rows, coef, ctx.memory, ctx.backend, dx, dw, db)
            else:
                _chunks_backward(x2, weight, bias, rows, coef, step, ctx.backend, dx, dw, db)
        if need_x:
            dist.all_reduce(dx, group=ctx.group)  # (every rank's slice of the classes contributes to dx)
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, None, (db.to(bias.dtype) if need_b else None), None, None, None, None, None, None, None


def _chunks_backward(x2, weight, bias, rows, coef, step, backend, dx, dw, db):
    """The head's backward in chunks of ``step`` rows, each with all the slice's classes: the logits again,
    dlogits in place, dx's rows, dW_r written by the first chunk and added to by the others, db_r."""
    n, v_local = x2.shape[0], weight.shape[0]
    top, ls, a, b, cc = coef
    o = rows.o
    buf = torch.empty((min(step, n), v_local), dtype=x2.dtype, device=x2.device)
    impl = shard_merge.slice_work(buf, backend, backward=True)
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        xc, s = x2[r0:r1], slice(r0, r1)
        logits = chunk_logits(xc, weight, bias, buf[: r1 - r0])
        code, w_local, smooth = rows.code[s], rows.w_local, o.smoothing != 0
        impl.dlogits(logits, top[s], ls[s], a[s], b[s], cc[s], code, w_local, o.softcap, smooth, logits)
        tile_grads(logits, xc, weight, dw, dx[r0:r1] if dx is not None else None, db, add_dw=r0 > 0, add_dx=False)
    heuristics.record(heuristics.Plan(impl.name, "lce_recompute", rows=step, splits=-(-n // step)))


def _slices_backward(x2, weight, bias, rows, coef, memory, backend, dx, dw, db):
    """The head's backward in groups of rows x slices of this rank's classes (lm_head.py's lce_sliced
    layout, rules.slice_plan): per tile the logits again and dlogits in place; each slice's dW_r rows
    written by the first group's GEMM and added to by the others' (one pass over dW_r a group, where row
    chunks make one a chunk); a group's dx summed over the slices in fp32, then rounded once."""
    n, d = x2.shape
    v_local = weight.shape[0]
    top, ls, a, b, cc = coef
    o, w_local = rows.o, rows.w_local
    group, cols = rules.slice_plan(n, d, v_local, x2.element_size(), memory)
    buf = torch.empty(group * cols, dtype=x2.dtype, device=x2.device)
    impl = shard_merge.slice_work(buf.view(group, cols), backend, backward=True)
    acc = torch.empty((group, d), dtype=top.dtype, device=x2.device) if dx is not None else None
    if heuristics.poisoning() and dw is not None:  # (tests: the first group's GEMMs must write all of dW_r)
        dw.fill_(float("nan"))
    tiles = 0
    for r0 in range(0, n, group):
        r1 = min(r0 + group, n)
        xg, s, m = x2[r0:r1], slice(r0, r1), r1 - r0
        for v0 in range(0, v_local, cols):
            v1 = min(v0 + cols, v_local)
            w_s = weight[v0:v1]
            logits = chunk_logits(xg, w_s, bias[v0:v1] if bias is not None else None, buf[: m * (v1 - v0)].view(m, -1))
            ws = w_local[v0:v1] if w_local is not None else None
            impl.dlogits(logits, top[s], ls[s], a[s], b[s], cc[s], rows.code_in(s, v0, v1), ws, o.softcap,
                         o.smoothing != 0, logits)  # fmt: skip
            dw_s, db_s = (dw[v0:v1] if dw is not None else None), (db[v0:v1] if db is not None else None)
            tile_grads(logits, xg, w_s, dw_s, acc[:m] if acc is not None else None, db_s, add_dw=r0 > 0, add_dx=v0 > 0)
            tiles += 1
        if acc is not None:
            dx[r0:r1].copy_(acc[:m])
    heuristics.record(heuristics.Plan(impl.name, rules.SLICED, block_n=cols, rows=group, splits=tiles))


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    memory: int | None = None,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fs.linear_cross_entropy with the LM head's weight split on the classes across ``group``: ``weight``
    (V_r, d) is this rank's rows of W (``bias`` and ``class_weight`` its slices), x (..., d) the same on
    every rank. The loss on every rank; x's gradient whole on every rank (one all-reduce in the backward),
    the weight's and bias's this rank's slice. memory: bytes of logits a chunk may hold, as
    fs.linear_cross_entropy's."""
    fn = "distributed.linear_cross_entropy"
    with _local_checks(fn, x, group):
        checks.linear_cross_entropy(x, weight, target, bias, memory, autocast=True, fn=fn, min_v=0)
        extras = (class_weight, softcap, z_loss, return_z_loss)
        o = _loss_checks(
            fn, ignore_index, reduction, label_smoothing, backend, (weight.shape[0], weight.device), *extras
        )
        x, weight, bias = checks.linear_autocast(x, weight, bias, fn)  # (as fs.linear_cross_entropy's)
        dispatch.loss_backend_runs(fn, backend, x)
    _need_group(fn, group, x, weight, target, bias, class_weight)
    w = class_weight.contiguous() if class_weight is not None else None
    out_dtype = compose.loss_dtype(x)
    loss, z = _LinearCrossEntropy.apply(x, weight, target, bias, w, o, group, backend, memory, out_dtype, _grad(x))
    return (loss, z) if return_z_loss else loss
