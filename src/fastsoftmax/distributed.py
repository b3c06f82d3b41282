"""Softmax, log_softmax, cross-entropy and the LM head's loss with the classes split across a torch.distributed
process group (tensor parallelism): rank r holds a contiguous slice of the classes (of the logits' last dim,
or of the LM head's weight rows), in rank order; slices may differ in width, hold no finite value, or be empty.

Per forward, the same collectives on every rank whatever its inputs:
  1. an all-gather of each rank's signature (its slice's width, its row count, its dtype, a digest of the
     call's options, the sum of its class weights), from which every rank checks that the ranks agree and
     finds its slice's offset in the vocabulary, as a device tensor;
  2. an all-gather of per-row statistics of each slice (its logsumexp, and for the losses the target's
     logit and class weight where the target falls in the slice, and the weighted sum of its logits for
     label smoothing), merged into the row's global numbers. Megatron-LM's vocabulary-parallel
     cross-entropy sends three all-reduces (max, sum of exp, target logit); a logsumexp carries the max
     and the sum in one number.
The backward of the losses needs no collective but the LM head's one all-reduce of dx; softmax and
log_softmax need one all-reduce of a per-row sum. No host synchronisation anywhere (a step can be captured
in a CUDA graph): on CUDA tensors ranks that disagree stop at the same device-side assertion before the
statistics move; on CPU tensors (gloo) every rank raises the same ValueError.

The slice's own work is the kernels' (triton/shard.py: one read of the slice for its statistics, one read
and one write for the output or dlogits) on CUDA tensors, torch ops on the CPU and for float64 (``backend``
as fs.cross_entropy's). Between the two collectives is O(rows) work in torch ops.

Conventions as the rest of the library: a row that is -inf on every rank gives zeros (softmax) / -inf
(log_softmax) and a zero gradient; NaN or +inf anywhere in a row gives NaN across it. Loss options as
fs.cross_entropy's, with ``class_weight`` this rank's slice of the class weights. Not supported: double
backward (create_graph=True through a backward raises: the second derivative crosses ranks) and torch.func
transforms of these functions.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from . import checks, compose, dispatch, dtypes, heuristics, options
from .backends.torch import capped, reduce_terms, row_grads
from .lm_head import chunk_logits, rows_per_chunk
from .reference import logsumexp_torch

# ---- the collectives and the merge -------------------------------------------------------------------------


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (its name from torch 2.13)


def _gather(stats: torch.Tensor, group) -> torch.Tensor:
    """(world, *stats.shape): every rank's stats, in rank order (one all-gather)."""
    world = dist.get_world_size(group)
    out = torch.empty(world * stats.numel(), dtype=stats.dtype, device=stats.device)
    _all_gather(out, stats.contiguous().reshape(-1), group=group)
    return out.reshape(world, *stats.shape)


def _merge_lse(lses: torch.Tensor) -> torch.Tensor:
    """Merge per-rank logsumexps (dim 0): -inf if all are, NaN if any is NaN or +inf (the library's rule for
    a row holding NaN or +inf)."""
    bad = lses.isnan().any(0) | (lses == float("inf")).any(0)
    m = lses.amax(0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    out = m_safe + (lses - m_safe).exp().sum(0).log()
    return torch.where(bad, float("nan"), out)


def _agree(fn: str, x: torch.Tensor, width: int, rows: int, group, opts: tuple, w_local=None):
    """The first collective: every rank's (width of its slice, rows, x's dtype, options digest, class-weight
    sum), checked for agreement. Returns (this rank's offset in the vocabulary, the vocabulary's size, the
    sum of the class weights over every rank or None), 0-d tensors on x's device."""
    digest = float(int(hashlib.sha256(repr(opts).encode()).hexdigest()[:13], 16))  # < 2^52: exact in float64
    sig = torch.empty(5, dtype=torch.float64, device=x.device)
    for i, v in enumerate((width, rows, dtypes.CODE[x.dtype], digest, 0.0)):
        sig[i].fill_(v)  # a fill kernel each: no host-to-device copy, so a CUDA graph can capture it
    if w_local is not None:
        sig[4].copy_(w_local.sum(dtype=torch.float64))
    every = _gather(sig, group)  # (world, 5)
    same = (every[:, 1:4] == every[:1, 1:4]).all()
    if x.is_cuda:
        torch._assert_async(same, f"{fn}: the ranks disagree on the row count, dtype or options")
    elif not bool(same):
        names = {v: dtypes.NAME[k] for k, v in dtypes.CODE.items()}
        seen = []
        for r, (_, rows_r, code, digest_r, _) in enumerate(every.tolist()):
            other = "" if digest_r == every[0, 3] else ", other options"
            seen.append(f"rank {r}: {int(rows_r)} rows of {names[int(code)]}{other}")
        raise ValueError(
            f"{fn}: the ranks must pass shards of the same rows and dtype, with the same options ({'; '.join(seen)})"
        )
    widths = every[:, 0].long()
    w_total = every[:, 4].sum() if w_local is not None else None
    return widths[: dist.get_rank(group)].sum(), widths.sum(), w_total


def _no_double_backward(fn: str) -> None:
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"{fn}: double backward (create_graph=True) is not supported: the second derivative crosses ranks"
        )


# ---- the slice's work: the kernels, or torch ops ------------------------------------------------------------


def _wide(x) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Kernels:
    """The slice's statistics and outputs by triton/shard.py's kernels."""

    def __init__(self, x, backward: bool):
        from .backends.triton import ce_shape, kernels  # noqa: PLC0415 (the kernels import Triton)

        self.k, self.shape = kernels("shard"), ce_shape(x, backward)

    def stats(self, x, w, cap, smooth):
        """(each row's logsumexp of capped x, its sum of w * z or None), fp32."""
        m = x.shape[0]
        lse = _out(m, torch.float32, x.device)
        sums = _out(m, torch.float32, x.device) if smooth else lse
        self.k.stats(x, None, w, lse, sums, cap, self.shape, smooth=smooth)
        return lse, (sums if smooth else None)

    def dot(self, y, dy, log: bool):
        """Each row's sum of dy (log) or of y * dy, fp32."""
        s = _out(y.shape[0], torch.float32, y.device)
        self.k.stats(y, dy, None, s, s, None, self.shape, dot=not log, logdot=log)
        return s

    def normalise(self, x, lse, log: bool, out):
        self.k.apply(1 if log else 0, x, None, out, lse, lse, lse, lse, lse, None, None, self.shape)
        return out

    def dlogits(self, x, lse, a, b, cc, t, w, cap, smooth, out):
        self.k.apply(2, x, None, out, lse, a, b, cc, t, w, cap, self.shape, smooth=smooth)
        return out

    def softmax_backward(self, y, dy, s, lse, log: bool, out):
        self.k.apply(4 if log else 3, y, dy, out, lse, s, s, s, s, None, None, self.shape)
        return out


class _TorchOps:
    """The same in torch ops (the CPU, float64, backend='torch')."""

    def stats(self, x, w, cap, smooth):
        z = capped(x.to(_wide(x)), cap)
        lse = logsumexp_torch(z)
        if not smooth:
            return lse, None
        return lse, (z * w.to(z.dtype) if w is not None else z).sum(-1)

    def dot(self, y, dy, log: bool):
        wide = _wide(y) if dy.dtype != torch.float64 else torch.float64
        return (dy.to(wide) if log else y.to(wide) * dy.to(wide)).sum(-1)

    def normalise(self, x, lse, log: bool, out):
        d = x.to(lse.dtype) - _safe(lse)[:, None]
        return out.copy_(d if log else d.exp())

    def dlogits(self, x, lse, a, b, cc, t, w, cap, smooth, out):
        z = capped(x.to(lse.dtype), cap)
        hot = torch.arange(x.shape[-1], device=x.device) == t[:, None]
        d = a[:, None] * (z - _safe(lse)[:, None]).exp() - b[:, None] * hot
        if smooth:
            d = d - cc[:, None] * (w.to(d.dtype) if w is not None else 1.0)
        if cap is not None:
            d = d * (1 - (z / cap) ** 2)
        return out.copy_(torch.where((t != -2)[:, None], d, 0.0))

    def softmax_backward(self, y, dy, s, lse, log: bool, out):
        yc, dyc = y.to(s.dtype), dy.to(s.dtype)
        dx = dyc - yc.exp() * s[:, None] if log else yc * (dyc - s[:, None])
        return out.copy_(torch.where((lse == float("-inf"))[:, None], 0.0, dx))


def _safe(lse):
    return torch.where(lse == float("-inf"), 0.0, lse)


def _impl(x, backend: str, backward: bool = False):
    """The slice's worker for x: the kernels where the loss kernels run x (dispatch.loss_backend), else
    torch ops; a slice without rows or columns is torch ops' (nothing to launch). Recorded (Plan 'shard')."""
    kernels = x.numel() and dispatch.loss_backend(x, backend).name == "triton"
    impl = _Kernels(x, backward) if kernels else _TorchOps()
    heuristics.record(heuristics.Plan("triton" if kernels else "torch", "shard"))
    return impl


def _out(shape, dtype, device):
    """An output the kernels write whole (NaN first under heuristics.force(poison=True): a test hook)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if heuristics.poisoning() else out


def _stats(impl, x, w, cap, smooth):
    """impl.stats, or for an empty slice -inf logsumexps and zero sums."""
    if x.shape[-1] == 0 or x.shape[0] == 0:
        lse = torch.full(x.shape[:1], float("-inf"), dtype=_wide(x), device=x.device)
        return lse, (torch.zeros_like(lse) if smooth else None)
    return impl.stats(x, w, cap, smooth)


# ---- softmax and log_softmax --------------------------------------------------------------------------------


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, group, dtype, backend):
        fn = "distributed.log_softmax" if log else "distributed.softmax"
        x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if dtype == torch.float64:  # (computed in float64 then, as fs.softmax does: torch ops)
            x2 = x2.double()
        _agree(fn, x, x2.shape[1], x2.shape[0], group, (log, str(dtype)))
        impl = _impl(x2, backend)
        lse = _merge_lse(_gather(_stats(impl, x2, None, None, False)[0], group))
        out = _out(x2.shape, dtype or x.dtype, x.device)
        y = impl.normalise(x2, lse.to(_wide(x2)), log, out) if x2.numel() else out
        ctx.save_for_backward(y, lse)
        ctx.log, ctx.group, ctx.x_dtype, ctx.backend, ctx.fn = log, group, x.dtype, backend, fn
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward(ctx.fn)
        y, lse = ctx.saved_tensors
        dy2 = dy.reshape(y.shape)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        impl = _impl(y, ctx.backend, backward=True)
        s = impl.dot(y, dy2, ctx.log) if y.numel() else torch.zeros(y.shape[0], dtype=lse.dtype, device=y.device)
        dist.all_reduce(s, group=ctx.group)
        dx = _out(y.shape, ctx.x_dtype, y.device)
        if y.numel():
            impl.softmax_backward(y, dy2, s.to(lse.dtype), lse, ctx.log, dx)
        return dx.reshape(dy.shape), None, None, None, None


def _check_shard(fn, x, backend=None, target=None):
    """The shard's (and the target's, and a softmax's backend) checks: what can fail before a collective,
    with _need_group. (The losses' backend: checks.cross_entropy_options, in _loss_checks.)"""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{fn}: expected a floating-point torch.Tensor shard")
    if x.dim() < 1:
        raise ValueError(f"{fn}: the shard needs the split class dim (the last)")
    if backend is not None and backend not in dispatch.LOSS_BACKENDS:
        raise ValueError(f"{fn}: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if target is not None:
        checks.target(fn, x, target)


def _need_group(fn: str) -> None:
    """An initialised process group, and no torch.func transform or dispatch mode (fake tensors): the
    statistics cross ranks through collectives, which neither can carry."""
    if compose.transforms_active() or compose.dispatch_modes():
        raise NotImplementedError(
            f"{fn}: torch.func transforms, fake tensors and dispatch modes are not supported (the statistics "
            "cross ranks through collectives); call it outside them"
        )
    if not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialised (init_process_group first)")


def softmax(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax along the last dim of logits whose last dim is split across ``group`` (this rank's slice)."""
    _check_shard("distributed.softmax", x, backend)
    _need_group("distributed.softmax")
    return _Softmax.apply(x, False, group, dtype, backend)


def log_softmax(
    x: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Log-softmax along the last dim of logits whose last dim is split across ``group``."""
    _check_shard("distributed.log_softmax", x, backend)
    _need_group("distributed.log_softmax")
    return _Softmax.apply(x, True, group, dtype, backend)


# ---- the losses -----------------------------------------------------------------------------------------------


class _Rows:
    """One loss call's rows: the targets as this slice sees them, the merged statistics, the mean's divisors."""

    def __init__(self, t, o, offset, v_local: int, w_local):
        self.t, self.o = t.long(), o
        self.keep = self.t != o.ignore_index
        local = self.t - offset
        own = self.keep & (local >= 0) & (local < v_local)
        self.own = own
        self.local = torch.where(own, local, 0)
        self.code = torch.where(own, local, torch.where(self.keep, -1, -2)).to(torch.int32)  # (shard.py's t)
        self.w_local = w_local

    def local_stats(self, impl, x, stats_dtype, r0: int = 0):
        """(m, 4) this slice's [logsumexp, target's z, target's class weight, sum of w * z] for x (m, V_r):
        rows r0 to r0 + m of the call."""
        o = self.o
        smooth = o.smoothing != 0.0
        lse, swz = _stats(impl, x, self.w_local, o.softcap, smooth)
        m = x.shape[0]
        if x.shape[-1] and m:
            own, local = self.own[r0 : r0 + m], self.local[r0 : r0 + m]
            z_t = capped(x.gather(-1, local[:, None])[:, 0].to(stats_dtype), o.softcap)
            w_t = self.w_local.to(stats_dtype)[local] if self.w_local is not None else 1.0
            z_t, w_t = torch.where(own, z_t, 0.0), torch.where(own, w_t, 0.0)
        else:
            z_t = w_t = torch.zeros(m, dtype=stats_dtype, device=x.device)
        swz = swz if swz is not None else torch.zeros(m, dtype=stats_dtype, device=x.device)
        return torch.stack([lse.to(stats_dtype), z_t, w_t, swz.to(stats_dtype)], -1)

    def merge(self, gathered, v_total, w_total):
        """The loss per row, and the numbers its backward needs, from every rank's local_stats (world, M, 4)."""
        o = self.o
        self.lse = _merge_lse(gathered[..., 0])
        z_t, self.w_t, swz = gathered[..., 1].sum(0), gathered[..., 2].sum(0), gathered[..., 3].sum(0)
        self.v_total = v_total.to(self.lse.dtype)
        self.w_total = w_total.to(self.lse.dtype) if w_total is not None else self.v_total
        ce = self.w_t * (self.lse - z_t)
        if o.smoothing:
            ce = (1 - o.smoothing) * ce + (o.smoothing / self.v_total) * (self.lse * self.w_total - swz)
        ce = torch.where(self.keep, ce, 0.0)
        zr = torch.where(self.keep, o.z_loss * self.lse * self.lse, 0.0) if o.z_loss else None
        self.kept = self.keep.sum().to(self.lse.dtype)
        self.w_kept = torch.where(self.keep, self.w_t, 0.0).sum()
        return ce, zr

    def coefficients(self, grad):
        """Each row's (a, b, cc) of dlogits = a * p - b * [j == t] - cc * w_j for the upstream gradient."""
        o = self.o
        g_ce, g_z = row_grads(grad.to(self.lse.dtype), self.kept, self.w_kept, o.reduction, self.t.shape[0])
        b = g_ce * (1 - o.smoothing) * self.w_t
        cc = g_ce * (o.smoothing / self.v_total) if o.smoothing else torch.zeros_like(b)
        a = b + cc * self.w_total if o.smoothing else b
        if o.z_loss:
            a = a + g_z * (2 * o.z_loss) * _safe(self.lse)
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        return tuple(torch.where(self.keep, c, zero).contiguous() for c in (a, b, cc))


def _loss_out(rows: _Rows, ce, zr, out_dtype):
    loss, z = reduce_terms(ce, zr, rows.kept, rows.w_kept, rows.o.reduction, out_dtype)
    return loss, (z if z is not None else torch.zeros_like(loss))


def _options_key(o, w, extra=()) -> tuple:
    return (o.ignore_index, o.reduction, o.smoothing, o.softcap, o.z_loss, w is not None, *extra)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, w, o, group, backend, out_dtype):
        fn = "distributed.cross_entropy"
        t = dispatch.flat_target(target)
        xf = x.reshape(t.shape[0], x.shape[-1])
        if xf.stride(-1) != 1:
            xf = xf.contiguous()
        offset, v_total, w_total = _agree(fn, x, xf.shape[1], t.shape[0], group, _options_key(o, w), w)
        dispatch.assert_targets(t, v_total, o.ignore_index, fn)
        rows = _Rows(t, o, offset, xf.shape[-1], w)
        impl = _impl(xf, backend)
        gathered = _gather(rows.local_stats(impl, xf, _wide(xf)), group)
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
        dx = _out(xf.shape, xf.dtype, xf.device)
        if xf.numel():
            impl = _impl(xf, ctx.backend, backward=True)
            o = rows.o
            impl.dlogits(xf, rows.lse.to(_wide(xf)), a, b, cc, rows.code, rows.w_local, o.softcap, o.smoothing != 0, dx)
        return dx.reshape(ctx.shape), None, None, None, None, None, None


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
    _check_shard(fn, logits, target=target)
    v_device = (logits.shape[-1], logits.device)
    o = _loss_checks(
        fn, ignore_index, reduction, label_smoothing, backend, v_device, class_weight, softcap, z_loss, return_z_loss
    )
    _need_group(fn)
    w = class_weight.contiguous() if class_weight is not None else None
    loss, z = _CrossEntropy.apply(logits, target, w, o, group, backend, compose.loss_dtype(logits))
    return (loss, z) if return_z_loss else loss


class _LinearCrossEntropy(torch.autograd.Function):
    """The LM head with W split on the classes: chunks of rows through x_c @ W_r^T into one buffer (the
    rows per chunk from ``memory``, as fs.linear_cross_entropy), the slice's statistics of each, one gather;
    the backward recomputes each chunk's logits, turns them into dlogits in place, and accumulates dx (then
    all-reduced once), dW_r and db_r."""

    @staticmethod
    def forward(ctx, x, weight, target, bias, w, o, group, backend, memory, out_dtype):
        fn = "distributed.linear_cross_entropy"
        t = dispatch.flat_target(target)
        x2 = x.reshape(t.shape[0], x.shape[-1])
        n, v_local = x2.shape[0], weight.shape[0]
        offset, v_total, w_total = _agree(fn, x2, v_local, n, group, _options_key(o, w, (x.shape[-1],)), w)
        dispatch.assert_targets(t, v_total, o.ignore_index, fn)
        rows = _Rows(t, o, offset, v_local, w)
        wide = _wide(x2)
        local = torch.empty((n, 4), dtype=wide, device=x.device)
        step = rows_per_chunk(x2, v_local, memory) if n and v_local else max(n, 1)
        if n and v_local:
            buf = torch.empty((min(step, n), v_local), dtype=x2.dtype, device=x.device)
            impl = _impl(buf, backend)
            for r0 in range(0, n, step):
                r1 = min(r0 + step, n)
                local[r0:r1] = rows.local_stats(impl, chunk_logits(x2[r0:r1], weight, bias, buf[: r1 - r0]), wide, r0)
        else:
            local.copy_(rows.local_stats(_TorchOps(), x2.new_empty((n, 0)), wide))
        ce, zr = rows.merge(_gather(local, group), v_total, w_total)
        loss, z = _loss_out(rows, ce, zr, out_dtype)
        ctx.mark_non_differentiable(z)
        ctx.save_for_backward(x2, weight, bias)
        ctx.rows, ctx.group, ctx.backend, ctx.step, ctx.x_shape = rows, group, backend, step, x.shape
        if o.reduction == "none":
            loss, z = loss.reshape(target.shape), z.reshape(target.shape)
        return loss, z

    @staticmethod
    def backward(ctx, grad, _grad_z):
        _no_double_backward("distributed.linear_cross_entropy")

        x2, weight, bias = ctx.saved_tensors
        rows, o, step = ctx.rows, ctx.rows.o, ctx.step
        need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
        need_b = need_b and bias is not None
        n, v_local = x2.shape[0], weight.shape[0]
        a, b, cc = rows.coefficients(grad)
        wide = _wide(x2)
        dx = torch.zeros_like(x2) if need_x else None
        dw = torch.zeros_like(weight) if need_w else None
        db = torch.zeros(v_local, dtype=wide, device=x2.device) if need_b else None
        if n and v_local:
            buf = torch.empty((min(step, n), v_local), dtype=x2.dtype, device=x2.device)
            impl = _impl(buf, ctx.backend, backward=True)
            lse = rows.lse.to(wide)
            for r0 in range(0, n, step):
                r1 = min(r0 + step, n)
                xc = x2[r0:r1]
                logits = chunk_logits(xc, weight, bias, buf[: r1 - r0])
                s = slice(r0, r1)
                w = rows.w_local
                impl.dlogits(logits, lse[s], a[s], b[s], cc[s], rows.code[s], w, o.softcap, o.smoothing != 0, logits)
                if need_x:
                    torch.mm(logits, weight, out=dx[r0:r1])
                if need_w:
                    dw.addmm_(logits.t(), xc)
                if need_b:
                    db += logits.sum(0, dtype=wide)
        if need_x:
            dist.all_reduce(dx, group=ctx.group)  # (every rank's slice of the classes contributes to dx)
            dx = dx.reshape(ctx.x_shape)
        return dx, dw, None, (db.to(bias.dtype) if need_b else None), None, None, None, None, None, None


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
    checks.linear_cross_entropy(x, weight, target, bias, memory, fn=fn, min_v=0)
    v_device = (weight.shape[0], weight.device)
    o = _loss_checks(
        fn, ignore_index, reduction, label_smoothing, backend, v_device, class_weight, softcap, z_loss, return_z_loss
    )
    _need_group(fn)
    w = class_weight.contiguous() if class_weight is not None else None
    out_dtype = compose.loss_dtype(x)
    loss, z = _LinearCrossEntropy.apply(x, weight, target, bias, w, o, group, backend, memory, out_dtype)
    return (loss, z) if return_z_loss else loss
