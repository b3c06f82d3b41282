"""fs.linear_cross_entropy: the language model head's loss, cross_entropy(x @ W^T + b, target), without the
full (N, V) logits: rows of x go through in chunks, each chunk's logits made by one cuBLAS GEMM into one
reused buffer, and the cross-entropy kernels (triton/cross_entropy.py) run on it there.

Traffic and work, N tokens, d features, V classes, chunks of R rows (the buffer: R x V logits):
  lce_chunked    forward with gradients wanted: per chunk x_c @ W^T, ce_fwd (1 read of the logits), ce_bwd
                 in place (1 read + 1 write: now dlogits, for a unit upstream gradient), dx_c = dl @ W,
                 dW += dl^T @ x_c (cuBLAS accumulating into dW: beta = 1), db += column sums; 3 GEMMs in all,
                 as the unfused loss. The backward scales dx, dW, db by the upstream gradient, in place.
  lce_recompute  forward: per chunk x_c @ W^T and ce_fwd (loss and logsumexp per row, kept); backward: per
                 chunk the logits again, then as above with the upstream gradient of each row: 4 GEMMs. For
                 reduction='none' (the upstream gradient differs per row and is known only then).
  lce_sliced     (the Triton loss, where heuristics/lm_head.layout's time model prefers it for a small
                 ``memory=``, or for a skip_eps unless its tiles' host time alone passes row chunks' time)
                 groups of rows, each swept over slices of the
                 classes: the loss (x_g @ W_s^T, ce_fwd on the slice) then, where gradients are computed, the
                 logits again, ce_bwd in place, dW_s (+)= dl^T @ x_g once a group, dx_g += dl @ W_s in fp32
                 sums (cuBLAS out_dtype), rounded once a group: 4 GEMMs, dW passed once a group.
  lce_fused      the same tiles with no logits in memory (triton/lm_head.py): the loss in one GEMM launch
                 over every row and class, a tile's dlogits straight from one GEMM; fewer launches a tile,
                 slower GEMMs: where the model finds lce_sliced's tiles host-bound (a small problem at a
                 small budget).
Without gradients (no_grad, nothing requires grad) each is the forward alone: 1 GEMM and a loss kernel a
chunk or slice. Peak memory above the inputs: the chunk buffer (``memory=`` bytes, else
heuristics/lm_head.chunk_rows; lce_sliced: a slice of a group's logits and its fp32 dx sums, within
``memory=``, with skip_eps its gathered rows and its pairs' flags too), dx and dW themselves (dW in W's
dtype: rounded once a chunk or group), O(N) statistics.

Logits are computed in x's dtype, as F.linear gives them; the loss and its statistics in fp32 (fp64 for
fp64). torch.func transforms and create_graph=True run torch ops (F.linear, then the loss's torch ops);
under autocast x, W and b are cast to the autocast dtype, as torch does for F.linear, and the loss is fp32.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .. import dispatch, heuristics
from ..core import checks, compose, dtypes, options
from ..core.layout import flat_target, storage_problem, values
from ..heuristics import lm_head as rules
from ..heuristics.device import selected
from ..kernels.lm_head_steps import TorchSteps, TritonSteps
from ..kernels.torch_loss import chunk_logits, tile_grads
from .cross_entropy import composite as ce_composite
from .lm_head_sliced import sliced_sweep


def _loss_impl(x, backend: str):
    triton = dispatch.select_loss(backend, x, fn="linear_cross_entropy")[0].name == "triton"
    return TritonSteps if triton else TorchSteps


def _wants(want_x: bool, want_w: bool, want_b: bool, bias) -> tuple[bool, bool, bool]:
    """The gradients a sweep makes, (dx, dW, db): db only where there is a bias."""
    return want_x, want_w, want_b and bias is not None


def _layout(x, v: int, memory, design: str, skip: float, grads: bool, backend: str, forced) -> tuple[str, float]:
    """(layout, skip) of the forward's sweep over x's rows against v classes (rules.layout; the torch loss:
    row chunks): a skip where the design computes gradients in the forward and tiles run, else 0; a skip
    whose tiles cost the host more than row chunks gives way to the layout picked without it. The backward
    asks again with the forward's arguments and force (_lce_grad): its logits must be made as the forward's
    were, by lce_fused's kernels or by cuBLAS."""
    n, d = x.shape
    if not n or _loss_impl(x, backend) is not TritonSteps:
        return rules.ROWS, 0.0
    skip = skip if design == "lce_chunked" and grads else 0.0
    recompute = design == "lce_recompute"
    lay = rules.layout(n, d, v, x.element_size(), memory, forced, skip > 0, recompute, fusable=True)
    if skip and lay == rules.ROWS:  # (the skip's tiles cost the host more than row chunks: exact, as without it)
        skip, lay = 0.0, rules.layout(n, d, v, x.element_size(), memory, forced, False, recompute, fusable=True)
    return lay, (skip if lay != rules.ROWS else 0.0)


def _sweep(x, weight, bias, t, cw, o, backend, memory, design, wants, g=None, stats=None, out_dtype=None, skip=0.0,
           fused=False):  # fmt: skip
    """One pass over the chunks. Forward (``stats`` None): returns (loss, z-loss, stats, dx, dw, db), the
    gradients for ``wants`` (x, weight, bias) for a unit upstream gradient when the design is lce_chunked,
    else empty. Backward (``stats`` given, ``g`` the upstream gradient): returns (dx, dw, db); ``fused``: the
    forward ran lce_fused (its logits are made alike here), else the backward never does."""
    n, v = x.shape[0], weight.shape[0]
    # what the kernels read: memory, not lazily negated views; the bias and class weights indexed densely
    x, weight, bias, t, cw = values(x), values(weight), values(bias), values(t), values(cw)
    bias = bias.contiguous() if bias is not None and bias.stride(0) != 1 else bias
    cw = cw.contiguous() if cw is not None else None
    forward = stats is None
    wide = dtypes.wide(x.dtype)
    loss_impl = _loss_impl(x, backend) if n else TorchSteps
    if forward and not (t.is_cuda and loss_impl is TritonSteps):  # (the Triton loss asserts on the device)
        checks.targets(t, v, o.ignore_index, "linear_cross_entropy")  # (before any chunk)
    k = loss_impl(x, t, cw, o, v)
    forced = (heuristics.forced() or {}).get("path")
    if forward:
        lay, skip = _layout(x, v, memory, design, skip, any(wants), backend, forced)
    else:  # (lce_recompute's backward: lce_fused where the forward ran it, never otherwise)
        lay = rules.layout(n, x.shape[1], v, x.element_size(), memory, forced, recompute=True)
        lay = rules.FUSED if fused else rules.SLICED if lay == rules.FUSED else lay
    sliced = k.name == "triton" and lay != rules.ROWS
    if skip and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("linear_cross_entropy: skip_eps synchronises with the host: not in a CUDA graph")
    if forward:  # (each row's logsumexp in fp64: its max plus the log of its sum, exact; the kernels split it)
        stats = torch.empty(n + 3, dtype=torch.float64, device=x.device)
        rows_loss = torch.empty(n, dtype=wide, device=x.device)
        rows_z = torch.empty(n, dtype=wide, device=x.device)  # (unread without a z-loss on the Triton path)
        if heuristics.poisoning():
            stats.fill_(float("nan"))
        k.start(stats, rows_loss, rows_z, n, v)
        grads = design == "lce_chunked" and any(wants)
        if grads:
            g = torch.ones((), dtype=wide, device=x.device)
    else:
        grads, rows_loss, rows_z = any(wants), None, None
    dx = x.new_empty(x.shape) if grads and wants[0] else x.new_empty(0)  # (contiguous: chunks of rows)
    dw = torch.zeros_like(weight) if grads and wants[1] and n == 0 else None
    db = torch.zeros(v, dtype=wide, device=x.device) if grads and wants[2] else None
    sweep = (x, weight, bias, k, stats, rows_loss, rows_z, g, forward, grads, wants, dx, dw, db, memory)
    dw = sliced_sweep(*sweep, skip, lay == rules.FUSED) if sliced else _row_chunks(*sweep, design)
    dw = dw if dw is not None else weight.new_empty(0)
    db = db.to(weight.dtype) if db is not None else weight.new_empty(0)
    if not forward:
        return dx, dw, db
    out = torch.empty(n if o.reduction == "none" else (), dtype=out_dtype, device=x.device)
    zout = torch.empty_like(out)
    k.finish(rows_loss, rows_z, stats, out, zout, n, v)
    return out, zout, stats, dx, dw, db


def _row_chunks(x, weight, bias, k, stats, rows_loss, rows_z, g, forward, grads, wants, dx, dw, db, memory, design):
    """lce_chunked / lce_recompute: chunks of rows, each with all V classes. Returns dW (None: not wanted)."""
    n, v = x.shape[0], weight.shape[0]
    rows = rules.rows_per_chunk(x, v, memory)
    buf = torch.empty((min(rows, n), v), dtype=x.dtype, device=x.device) if n else None
    if grads and wants[1] and dw is None:
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device)  # (the first chunk writes it)
    chunks = 0
    for r0 in range(0, n, rows):
        r1 = min(r0 + rows, n)
        xc, logits = x[r0:r1], buf[: r1 - r0]
        chunk_logits(xc, weight, bias, logits)
        if forward:
            k.forward(logits, r0, r1, stats, rows_loss, rows_z)
        if grads:
            k.backward(logits, r0, r1, stats, g, n)  # logits -> dlogits, in place
            tile_grads(logits, xc, weight, dw if wants[1] else None, dx[r0:r1] if wants[0] else None, db,
                       add_dw=r0 > 0, add_dx=False)  # fmt: skip
        chunks += 1
    heuristics.record(heuristics.Plan(k.name, design, rows=rows, splits=chunks))
    return dw


# ---- the custom op ------------------------------------------------------------------------------------


def _lce(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    memory: int,
    backend: str,
    design: str,
    skip_eps: float,
    want_x: bool,
    want_w: bool,
    want_b: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, z-loss, stats, dx, dw, db) of 2-d x and 1-d targets (checked by the public function; memory 0:
    the rule's choice): the gradients for a unit upstream gradient where lce_chunked computed them, else
    empty."""
    o = options.Loss(ignore_index, reduction, label_smoothing, softcap, z_loss)
    if why := storage_problem(x, weight, target, bias, class_weight):
        raise RuntimeError(f"linear_cross_entropy: {why}")
    wants = _wants(want_x, want_w, want_b, bias)
    with selected(x):
        return _sweep(x, weight, bias, target, class_weight, o, backend, memory, design, wants, out_dtype=out_dtype,
                      skip=skip_eps)  # fmt: skip


def _lce_fake(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, design, *rest):
    _, want_x, want_w, want_b, out_dtype = rest
    n = x.shape[0]
    grads = design == "lce_chunked"
    loss = x.new_empty(target.shape if reduction == "none" else (), dtype=out_dtype)
    dx = x.new_empty(x.shape if grads and want_x else (0,))
    dw = weight.new_empty(weight.shape if grads and want_w else (0,))
    db = weight.new_empty((weight.shape[0],) if grads and want_b and bias is not None else (0,))
    return loss, torch.empty_like(loss), x.new_empty((n + 3,), dtype=torch.float64), dx, dw, db


def _lce_setup(ctx, inputs, output):
    x, weight, target, bias, class_weight, *opts = inputs
    ctx.opts = tuple(opts)
    ctx.forced = (heuristics.forced() or {}).get("path")  # (the forward's: its layout, asked again by _lce_grad)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # (else autograd makes zeros shaped like dx and dW for the backward)
    ctx.save_for_backward(x, weight, target, bias, class_weight, *output[2:])


def _lce_grad(ctx, grad_loss, *_):
    x, weight, target, bias, class_weight, stats, dx, dw, db = ctx.saved_tensors
    ii, reduction, eps, cap, zl, memory, backend, design, skip_eps, want_x, want_w, want_b, _ = ctx.opts
    need = ctx.needs_input_grad
    if grad_loss is None:
        return (None,) * 18
    if compose.torch_backward(grad_loss):  # create_graph=True, torch.func, batched grads: torch ops
        return _composite_grads(ctx, grad_loss, x, weight, target, bias, class_weight)
    made = (not need[0] or dx.shape == x.shape) and (not need[1] or dw.shape == weight.shape)
    made = made and (not need[3] or bias is None or db.shape == bias.shape)  # (by the forward: lce_chunked's)
    if design == "lce_chunked" and made and not getattr(ctx, "scaled", False):
        gx, gw, gb = _scaled(ctx, grad_loss, backend, dx, dw, db)
        return (gx if need[0] else None), (gw if need[1] else None), None, (gb if need[3] else None), *([None] * 14)
    wants = _wants(need[0], need[1], need[3], bias)  # lce_recompute, or lce_chunked's second backward
    # (or one its forward did not make: a captured graph's, made without gradients)
    grads = any(_wants(want_x, want_w, want_b, bias))  # (the forward's: its skip, so its layout)
    fused = _layout(x, weight.shape[0], memory, design, skip_eps, grads, backend, ctx.forced)[0] == rules.FUSED
    args = (x, weight, target, bias, class_weight, stats, grad_loss, ii, reduction, eps, cap, zl, memory, backend)
    args += (fused,)
    route = compose.route(x, weight, grad_loss)
    gx, gw, gb = _lce_backward(*args, *wants) if route == "plain" else LCE_BACKWARD.call(route, *args, *wants)
    return (gx if need[0] else None), (gw if need[1] else None), None, (gb if wants[2] else None), *([None] * 14)


def _scaled(ctx, grad_loss, backend, *grads):
    """lce_chunked's gradients (for a unit upstream gradient) times grad_loss. Eagerly in place, through
    .data (no second dW in memory; the saved tensors' versions stay, so autograd does not refuse a second
    backward through a retained graph, which recomputes: ctx.scaled). Traced (torch.compile), out of place."""
    if compose.compiling() or any(type(g) is not torch.Tensor for g in grads):
        return tuple(g * grad_loss.to(g.dtype) if g.numel() else g for g in grads)
    ctx.scaled = True
    if grads[0].is_cuda and dispatch.select_loss(backend, grads[0], fn="linear_cross_entropy")[0].name == "triton":
        from ..kernels.triton.backend import kernels  # (the kernels import Triton)

        g = grad_loss.reshape(()).to(torch.float32)
        with selected(grads[0]):
            for t in grads:
                kernels("lm_head").scale_(t.data, g)  # no pass over dW when grad_loss == 1
        return grads
    return tuple(t.data.mul_(grad_loss) if t.numel() else t for t in grads)


def _composite_grads(ctx, grad_loss, x, weight, target, bias, class_weight):
    """The backward in torch ops through the loss's composite, differentiable (double backward)."""
    need = ctx.needs_input_grad
    inputs = [
        t for t, want in zip((x, weight, bias), (need[0], need[1], need[3]), strict=True) if want and t is not None
    ]
    with torch.enable_grad():
        loss = composite(x, weight, target, bias, class_weight, *ctx.opts)[0]
        it = iter(torch.autograd.grad(loss, inputs, grad_loss, create_graph=True))
    gx = next(it) if need[0] else None
    gw = next(it) if need[1] else None
    gb = next(it) if need[3] and bias is not None else None
    return gx, gw, None, gb, *([None] * 14)


def composite(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, design, *rest):
    """The loss in torch ops (F.linear, then the loss's torch ops), differentiable to any order: torch.func
    transforms and create_graph=True. Holds the full logits."""
    out_dtype = rest[-1]
    logits = torch.nn.functional.linear(x, weight, bias)
    loss, z, _ = ce_composite(
        logits, target, class_weight, ii, reduction, eps, cap, zl, backend, out_dtype, "linear_cross_entropy"
    )
    heuristics.record(heuristics.Plan("torch", "composite"))
    empty = x.new_empty(0)
    return loss, z, None, empty, empty, empty


def _option_checks(fn, v_device, ignore_index, reduction, label_smoothing, backend, class_weight=None, softcap=None,
                   z_loss=0.0, return_z_loss=False, skip_eps=0.0) -> None:  # fmt: skip
    """The loss options' checks (all but memory=, which checks.linear_cross_entropy checks with the tensors), for
    the public function, the module's constructor and the custom ops called directly; ``v_device``: (V, the
    weight's device)."""
    checks.cross_entropy_options(fn, ignore_index, reduction, label_smoothing, backend)
    checks.skip_eps(fn, skip_eps, reduction, label_smoothing)
    checks.loss_extras(fn, v_device, class_weight, softcap, z_loss, return_z_loss)


def _op_checks(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, skip_eps=0.0):
    """The public function's checks of the custom ops' arguments (x 2-d: the ops take rows; memory 0: the
    rule's choice), for the ops called directly (torch.ops.fastsoftmax.linear_cross_entropy*)."""
    fn = "linear_cross_entropy"
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"{fn}: the custom op takes 2-d x (rows, features), got {tuple(x.shape)}")
    checks.linear_cross_entropy(x, weight, target, bias, memory or None)
    _option_checks(fn, (weight.shape[0], weight.device), ii, reduction, eps, backend, class_weight, cap, zl,
                   skip_eps=skip_eps)  # fmt: skip


def _lce_checked(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, design, *rest):
    """The custom op's implementation when called directly: the checks, the design's too, then _lce."""
    _op_checks(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, rest[0])
    if design not in rules.DESIGNS:
        raise ValueError(f"linear_cross_entropy: unknown design {design!r}; valid: {', '.join(rules.DESIGNS)}")
    if design == "lce_chunked" and reduction == "none":
        raise ValueError("linear_cross_entropy: lce_chunked needs a scalar loss (reduction 'none': lce_recompute)")
    return _lce(x, weight, target, bias, class_weight, ii, reduction, eps, cap, zl, memory, backend, design, *rest)


LINEAR_CROSS_ENTROPY = compose.Op(
    "linear_cross_entropy", _lce, _lce_fake, None, setup_context=_lce_setup, backward=_lce_grad, func=composite,
    checked=_lce_checked,
)  # fmt: skip


def _lce_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    stats: torch.Tensor,
    grad: torch.Tensor,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    softcap: float | None,
    z_loss: float,
    memory: int,
    backend: str,
    fused: bool,
    want_x: bool,
    want_w: bool,
    want_b: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lce_recompute's backward: (dx, dw, db) for ``grad``, the loss's upstream gradient (empty where not
    wanted); ``fused``: the forward ran lce_fused (the logits made again as it made them)."""
    o = options.Loss(ignore_index, reduction, label_smoothing, softcap, z_loss)
    wide = dtypes.wide(x.dtype)
    grad = values(grad)
    g = grad.reshape(-1).to(wide).contiguous() if reduction == "none" else grad.reshape(()).to(wide)
    with selected(x):
        return _sweep(x, weight, bias, target, class_weight, o, backend, memory, "lce_recompute",
                      _wants(want_x, want_w, want_b, bias), g, values(stats), fused=fused)  # fmt: skip


def _lce_backward_fake(x, weight, target, bias, class_weight, stats, grad, *rest):
    want_x, want_w, want_b = rest[-3:]
    dx = x.new_empty(x.shape if want_x else (0,))
    dw = weight.new_empty(weight.shape if want_w else (0,))
    db = weight.new_empty((weight.shape[0],) if want_b and bias is not None else (0,))
    return dx, dw, db


def _lce_backward_checked(x, weight, target, bias, class_weight, stats, grad, *rest):
    """The backward op's implementation when called directly: the checks, and stats' and grad's shapes."""
    _op_checks(x, weight, target, bias, class_weight, *rest[:7])
    n, reduction = x.shape[0], rest[1]
    if not isinstance(stats, torch.Tensor) or stats.shape != (n + 3,) or not stats.dtype.is_floating_point:
        raise ValueError(f"linear_cross_entropy: stats must be the forward's ({n + 3},) floating tensor")
    if not isinstance(grad, torch.Tensor) or grad.numel() != (n if reduction == "none" else 1):
        raise ValueError(f"linear_cross_entropy: grad must be the loss's gradient ({n if reduction == 'none' else 1})")
    return _lce_backward(x, weight, target, bias, class_weight, stats, grad, *rest)


LCE_BACKWARD = compose.Op(
    "linear_cross_entropy_backward", _lce_backward, _lce_backward_fake, None, checked=_lce_backward_checked
)


# ---- the public function and module -----------------------------------------------------------------------


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    memory: int | None = None,
    backend: str = "auto",
    skip_eps: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """fs.cross_entropy(F.linear(x, weight, bias), target, ...) without the full logits; see the module.
    x (..., d), weight (V, d), bias (V,) or None, target x's shape without d; the options as
    fs.cross_entropy's. memory: bytes of logits a chunk may hold (None: chosen from the problem and the free
    memory). return_z_loss=True returns (loss, the z-loss term alone). skip_eps > 0 (a scalar loss without
    label smoothing, opt-in): the gradient skips a row's slice of classes wherever each of its probabilities
    there is below skip_eps, its target's slice never (lce_sliced; docs/semantics.md gives the error bound)."""
    if compose.is_dtensor(weight):  # sharded on the classes: fastsoftmax.distributed
        from ..distributed import dtensor

        opts = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
        opts |= dict(softcap=softcap, z_loss=z_loss, memory=memory, backend=backend)
        if skip_eps:
            raise NotImplementedError("linear_cross_entropy: skip_eps with a weight sharded across ranks")
        return dtensor.linear_cross_entropy(x, weight, target, bias, class_weight, return_z_loss, **opts)
    checks.linear_cross_entropy(x, weight, target, bias, memory, autocast=True)  # (mixed dtypes under autocast)
    _option_checks("linear_cross_entropy", (weight.shape[0], weight.device), ignore_index, reduction,
                   label_smoothing, backend, class_weight, softcap, z_loss, return_z_loss, skip_eps)  # fmt: skip
    x, weight, bias = checks.linear_autocast(x, weight, bias)  # (as F.linear's autocast casts them)
    out_dtype = compose.loss_dtype(x)
    x2, t = x.reshape(target.numel(), x.shape[-1]), flat_target(target)  # (d may be 0)
    grad_on = torch.is_grad_enabled()
    wants = (grad_on and x.requires_grad, grad_on and weight.requires_grad)
    wants += (grad_on and bias is not None and bias.requires_grad,)
    design = rules.design(reduction, (heuristics.forced() or {}).get("path"))
    cap = None if softcap is None else float(softcap)
    route = compose.route(x2, weight, t, bias, class_weight)
    if route == "op" and not compose.compiling():  # (a graph captured by make_fx, jit.trace or non-strict
        wants = (False, False, False)  # export serves any flags: its backward computes; Dynamo guards on them)
    args = (x2, weight, t, bias, class_weight, ignore_index, reduction, float(label_smoothing), cap, float(z_loss))
    args += (int(memory or 0), backend, design, float(skip_eps), *wants, out_dtype)
    if route == "plain":
        loss, z, *_ = _lce(*args)
    elif route == "function":
        loss, z, *_ = LINEAR_CROSS_ENTROPY.eager.apply(*args)
    else:  # (func: the composite flattens x and the target itself, the target as given says if it is readable)
        args = (x, weight, target, *args[3:]) if route == "func" else args
        loss, z, *_ = LINEAR_CROSS_ENTROPY.call(route, *args)
    if reduction == "none":
        loss, z = loss.reshape(target.shape), z.reshape(target.shape)
    return (loss, z) if return_z_loss else loss


class LinearCrossEntropy(torch.nn.Module):
    """An LM head and its loss in one: ``forward(x, target)`` is fs.linear_cross_entropy(x, self.weight,
    target, self.bias, **options); weight (out_features, in_features), initialised as nn.Linear's. A
    class_weight option is a buffer (moves with .to(), saved in the state_dict), as nn.CrossEntropyLoss's."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, device=None, dtype=None, **options):
        super().__init__()
        defaults = _options()
        bad = set(options) - set(defaults)
        if bad:
            raise TypeError(f"LinearCrossEntropy: unknown options {sorted(bad)}; valid: {sorted(defaults)}")
        o = defaults | options  # (the values checked now, as the call will: not at the first forward)
        memory = o.pop("memory")
        checks.memory_budget("LinearCrossEntropy", memory)
        lin = torch.nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        _option_checks("LinearCrossEntropy", (out_features, lin.weight.device), **o)
        self.weight = lin.weight
        self.bias = lin.bias
        self.register_buffer("class_weight", options.pop("class_weight", None))
        self.in_features, self.out_features, self.options = in_features, out_features, options

    def forward(self, x: torch.Tensor, target: torch.Tensor):
        return linear_cross_entropy(x, self.weight, target, self.bias, class_weight=self.class_weight, **self.options)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@functools.cache
def _options() -> dict:
    """linear_cross_entropy's options (its keyword-only parameters) and their defaults: what
    LinearCrossEntropy(**options) takes."""
    params = inspect.signature(linear_cross_entropy).parameters.values()
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
