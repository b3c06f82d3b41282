"""The one dispatch point: every call that runs kernels (or torch ops) comes here with its arguments
checked, and select() is the only place that chooses a backend (``auto``: on CUDA tensors what the GPU's
tuning table names for the problem, else the Triton kernels when they can run it; everything else takes
torch ops). Where the CUDA backend fails to load or launch under ``auto``, the call runs on the Triton
kernels instead (and the CUDA backend stays off for the process: backends/cuda.py).

Also here, shared by every backend: 0-d and empty inputs, masks moved to the last dim, the recording of a
plain call for the eager replay (fastpath.py), and cross-entropy's flattening and target checks.
"""

from __future__ import annotations

import torch

from . import dtypes, fastpath, heuristics, masking
from .backends.cuda import CudaBackend
from .backends.torch import (
    NATIVE,
    NATIVE_CE,
    NATIVE_CE_GRAPH,
    NATIVE_GRAPH,
    TorchBackend,
    native_cross_entropy,
    native_cross_entropy_backward,
    native_cross_entropy_graph,
    native_softmax,
    native_softmax_backward,
    native_softmax_graph,
)
from .backends.triton import TritonBackend
from .errors import BackendFailed
from .heuristics import device, tables
from .layout import storage_problem

BACKENDS = {b.name: b for b in (TritonBackend(), CudaBackend(), TorchBackend())}
NAMES = ("auto", *BACKENDS)
DEVICES = ("cpu", "cuda")
LOSS_BACKENDS = ("auto", "triton", "torch")


def fallback(x, out_dtype, dy=None):
    """auto's choice without a table: the Triton kernels where they can run, else torch ops."""
    return BACKENDS["triton" if BACKENDS["triton"].unavailable(x, out_dtype, dy) is None else "torch"]


def select(name: str, x: torch.Tensor, out_dtype: torch.dtype, dy=None, dim: int = -1, masked: bool = False):
    """(backend, path or None) that runs x (forward) or y and dy (backward) along dim: the named backend
    (raising if it cannot) with its own path choice; or for 'auto', on a CUDA tensor, what the GPU's tuning
    table (heuristics/tables.py) names for this problem when that backend can run it, else the Triton
    kernels when they can; torch ops for everything else."""
    if name == "auto":
        if x.device.type != "cuda":
            return BACKENDS["torch"], None
        if x.dim() and x.numel() and not masked:
            facts = device.of_tensor(x)
            n = x.shape[dim]
            pass_ = "bwd" if dy is not None else "fwd"
            pick = tables.choose(
                tables.for_device(facts), pass_, dtypes.NAME[x.dtype], n, x.numel() // n, facts.sm_count
            )
            if pick and pick[0] in BACKENDS and BACKENDS[pick[0]].unavailable(x, out_dtype, dy, dim) is None:
                return BACKENDS[pick[0]], pick[1]
        return fallback(x, out_dtype, dy), None
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(repr(n) for n in NAMES)}")
    why = backend.unavailable(x, out_dtype, dy, dim)
    if masked and backend.name == "cuda":
        why = "it has no masks, scale or causal yet (backend='triton' or 'auto' fuses them)"
    if why:
        raise RuntimeError(f"backend={name!r} cannot run this tensor ({x.device}, {x.dtype}): {why}")
    return backend, None


def _run(impl, requested: str, method: str, args: tuple, spec, like, out_dtype, dy=None):
    """impl's pass, and where the CUDA backend fails to load or launch under 'auto', the Triton kernels (or
    torch ops) for this call instead."""
    extra = () if spec is None else (spec,)
    try:
        return getattr(impl, method)(*args, *extra)
    except BackendFailed:
        if requested != "auto" or impl.name != "cuda":
            raise
    return getattr(fallback(like, out_dtype, dy), method)(*args[:-1], None, *extra)


# ---- softmax ------------------------------------------------------------------------------------------


def _logical_rows(t: torch.Tensor) -> bool:
    """Whether t's rows (every dim but the last) sit in memory in their logical order at one stride, so
    that a row's flat index is its position: what the masked kernels address the mask by."""
    dims = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True) if size != 1]
    return all(a[1] == b[1] * b[0] for a, b in zip(dims, dims[1:], strict=False))


def _masked_problem(impl, tensors, dim, mask, scale, causal, backend, fn):
    """(backend, the tensors with dim moved last, masking.Spec): the first tensor's rows in logical order for
    the kernels (copied when they are not); the torch backend where the mask needs more than 4 row dims."""
    moved = [t.movedim(dim, -1) for t in tensors]
    mw = mask.expand(tensors[0].shape).movedim(dim, -1) if mask is not None else None
    spec = masking.spec(moved[0], mw, scale, causal)
    if spec is None:
        if backend not in ("auto", "torch"):
            raise RuntimeError(
                f"{fn}: backend={backend!r} addresses masks over at most 4 row dims; this "
                f"mask of shape {tuple(mask.shape)} needs more (backend='torch' runs it)"
            )
        impl = BACKENDS["torch"]
        spec = masking.Spec(1 if mask.dtype == torch.bool else 2, mw, scale, causal, (1, 1, 1), (0,) * 4, 0, 0)
    if impl.name != "torch" and not _logical_rows(moved[0]):
        moved[0] = moved[0].contiguous()
    return impl, tuple(moved), spec


def _like_empty_like(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """out in the layout torch.empty_like(like) gives (what the custom ops' fake implementations promise): as
    it is when it has it, else copied once (the masked path on rows not in logical order: x was copied too)."""
    if (like.is_contiguous() and out.is_contiguous()) or (
        out.stride() == torch.empty_like(like, dtype=out.dtype, device="meta").stride()
    ):
        return out
    return torch.empty_like(like, dtype=out.dtype).copy_(out)


def softmax(
    x, dim, log, out_dtype, backend, *, want_lse=False, fn="softmax", key=None, mask=None, scale=None, causal=False
):
    """(softmax or log_softmax of x along dim in out_dtype, its fp32 logsumexp per row or None) for checked
    arguments (``dim`` non-negative). ``key``: the call's fastpath key, to record its launches for replay.
    ``mask``, ``scale``, ``causal``: see masking.py."""
    masked = mask is not None or scale is not None or causal is not False
    if why := storage_problem(x, mask):
        raise RuntimeError(f"{fn}: {why}")
    if backend == "auto" and x.is_cpu and not (masked or want_lse) and x.dim() and x.numel():
        return cpu_softmax(x, dim, log, out_dtype), None  # (select's torch backend, its native path)
    impl, path = select(backend, x, out_dtype, dim=dim, masked=masked)
    if x.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        y, lse = softmax(
            x.reshape(1), 0, log, out_dtype, impl.name, want_lse=want_lse, fn=fn, mask=m, scale=scale, causal=causal
        )
        return y.reshape(()), (lse.reshape(()) if lse is not None else None)
    if x.numel() == 0:
        heuristics.record(heuristics.Plan(impl.name, "empty"))
        lse = None
        if want_lse:  # an empty row is fully masked: lse = -inf
            lse = torch.full(x.shape[:dim] + x.shape[dim + 1 :], float("-inf"), device=x.device)
        return torch.empty_like(x, dtype=out_dtype), lse
    if masked:  # softmax(scale * x + mask) along dim, causal over the last two dims
        impl, (xw,), spec = _masked_problem(impl, (x,), dim, mask, scale, causal, backend, fn)
        y, lse = _run(impl, backend, "forward", (xw, x.dim() - 1, out_dtype, log, want_lse, path), spec, xw, out_dtype)
        return _like_empty_like(y.movedim(-1, dim), x), lse
    args = (x, dim, out_dtype, log, want_lse, path)
    key = None if want_lse else key  # (the replay writes no logsumexp)
    return _recorded(key, lambda: _run(impl, backend, "forward", args, None, x, out_dtype), x, None, out_dtype)


def softmax_backward(
    dy, y, dim, log, out_dtype, backend, *, fn="softmax_backward", key=None, mask=None, scale=None, causal=False
):
    """The gradient of softmax (log_softmax) from its output y and the output gradient dy, in out_dtype,
    computed in fp32, for checked arguments. ``key``, ``mask``, ``scale``, ``causal``: as softmax's
    (dx = scale * dz, 0 at masked positions)."""
    masked = mask is not None or scale is not None or causal is not False
    if why := storage_problem(y, dy, mask):
        raise RuntimeError(f"{fn}: {why}")
    if backend == "auto" and y.is_cpu and not masked and y.dim() and y.numel():
        return cpu_softmax_backward(dy, y, dim, log, out_dtype)
    impl, path = select(backend, y, out_dtype, dy, dim=dim, masked=masked)
    if y.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        return softmax_backward(
            dy.reshape(1), y.reshape(1), 0, log, out_dtype, impl.name, fn=fn, mask=m, scale=scale, causal=causal
        ).reshape(())
    if y.numel() == 0:
        heuristics.record(heuristics.Plan(impl.name, "empty"))
        return torch.empty_like(y, dtype=out_dtype)
    if masked:
        impl, (yw, dyw), spec = _masked_problem(impl, (y, dy), dim, mask, scale, causal, backend, fn)
        dx = _run(impl, backend, "backward", (dyw, yw, y.dim() - 1, out_dtype, log, path), spec, yw, out_dtype, dyw)
        return _like_empty_like(dx.movedim(-1, dim), y)
    args = (dy, y, dim, out_dtype, log, path)
    return _recorded(key, lambda: _run(impl, backend, "backward", args, None, y, out_dtype, dy), y, dy, out_dtype)


def cpu_softmax(x, dim, log, out_dtype):
    """A CPU call under 'auto' with no mask, scale, causal or logsumexp, checked (x with elements, ``dim``
    non-negative): the torch backend (select's choice) on its native path, torch's own kernels with the
    conventions applied (backends/torch.py), without the layers between."""
    heuristics.record(NATIVE)
    return native_softmax(x, dim, log, out_dtype)


def cpu_softmax_graph(x, dim, log):
    """cpu_softmax of a contiguous x that requires grad, in x's dtype, with torch's autograd graph
    (backends/torch.py's native_softmax_graph); None where the eager Function must run."""
    if (y := native_softmax_graph(x, dim, log)) is not None:
        heuristics.record(NATIVE_GRAPH)
    return y


def cpu_softmax_backward(dy, y, dim, log, out_dtype):
    """softmax_backward's counterpart of cpu_softmax."""
    heuristics.record(NATIVE)
    return native_softmax_backward(dy, y, dim, log, out_dtype)


def _recorded(key, run, x, d, out_dtype):
    """run(), its launches recorded for the eager replay under ``key`` (a plain call's fastpath key; None:
    nothing to record). ``x``, ``d``: the call's anchor input and dy (None for a forward)."""
    rec = fastpath.start(key) if key is not None else None
    if rec is None:
        return run()
    try:
        out = run()
    except BaseException:
        fastpath.abort()
        raise
    fastpath.finish(rec, key, x, d, out if d is not None else out[0], out_dtype)
    return out


# ---- cross-entropy ------------------------------------------------------------------------------------


def loss_backend(x: torch.Tensor, backend: str):
    """The backend the loss kernels of x run on (the Triton kernels, or torch ops for float64 and where
    Triton cannot run under 'auto')."""
    if backend == "torch" or x.dtype == torch.float64:
        return BACKENDS["torch"]
    why = BACKENDS["triton"].unavailable(x, x.dtype)
    if backend == "triton" and why:
        raise RuntimeError(f"cross_entropy: backend='triton' cannot run this tensor ({x.device}, {x.dtype}): {why}")
    if backend == "auto" and (x.device.type != "cuda" or why):
        return BACKENDS["torch"]
    return BACKENDS["triton"]


def flat(logits, target):
    """(M, V) logits with unit stride along V, and the (M,) targets in memory order (what the kernels index:
    a strided or expanded target is copied, M integers)."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, flat_target(target)


def flat_target(target):
    """The targets as (M,) in memory order (a strided or expanded target is copied: M integers)."""
    t = target.reshape(-1)
    if t.numel() > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return t


def assert_targets(t: torch.Tensor, v, ignore_index: int, fn: str = "cross_entropy") -> None:
    """Raise when a target is outside [0, v) and not ignore_index (``v``: an int or a 0-d tensor), comparing
    as int64 whatever the target's integer dtype (uint8 would wrap -100 to 156). On a GPU through
    torch._assert_async (no host synchronisation: the error surfaces at the next synchronising call)."""
    t = t.long()
    bad = ((t < 0) | (t >= v)) & (t != ignore_index)
    if t.is_cuda:
        torch._assert_async(~bad.any(), f"{fn}: a target is outside [0, V) and not ignore_index")
    elif bad.any():
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"{fn}: target {int(t[i])} at row {i} is outside [0, {int(v)}) and not ignore_index")


def raise_bad_targets(stats: torch.Tensor, m: int, t: torch.Tensor, v: int, ignore_index: int) -> None:
    """After the Triton forward: stats[m + 1] is 1 when every target not ignored was in [0, v). On CUDA the
    forward's last kernel (ce_finish) has asserted that on the device already."""
    if not t.is_cuda and not stats[m + 1].item():
        assert_targets(t, v, ignore_index)


def cross_entropy(logits, target, class_weight, o, backend, out_dtype):
    """(loss in out_dtype, z-loss in out_dtype, stats) for checked arguments (``o``: options.Loss): stats
    (M + 3,) holds each row's logsumexp, then the number of rows not ignored, 1.0 if every target was in
    range, and the weight of the rows kept (the mean's divisors, for the backward). On the Triton path the
    range check is a by-product of the forward's last kernel."""
    if why := storage_problem(logits, target, class_weight):
        raise RuntimeError(f"cross_entropy: {why}")
    x, t = flat(logits, target)
    w = class_weight.contiguous() if class_weight is not None else None
    m, v = x.shape
    impl = loss_backend(x, backend) if m else BACKENDS["torch"]
    if impl.name == "torch":
        assert_targets(t, v, o.ignore_index)
    loss, z, stats = impl.cross_entropy(x, t, w, o, out_dtype)
    if impl.name != "torch":
        raise_bad_targets(stats, m, t, v, o.ignore_index)
    if o.reduction == "none":
        loss, z = loss.reshape(target.shape), z.reshape(target.shape)
    return loss, z, stats


def cpu_flat(logits, target, class_weight):
    """(M, V) logits with unit stride along V, int64 targets (M,), the class weights in the loss's compute
    dtype (fp32; fp64 for fp64 logits) or None: what the CPU's native cross-entropy takes."""
    x = logits if logits.dim() == 2 and logits.stride(1) == 1 else flat(logits, target)[0]
    t = target if target.dim() == 1 and (target.stride(0) == 1 or target.shape[0] == 1) else flat_target(target)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = class_weight.detach().to(wide).contiguous() if class_weight is not None else None  # (no gradient)
    return x, (t if t.dtype == torch.int64 else t.long()), w


def cpu_cross_entropy(x, t, w, ignore_index: int, reduction: str, smoothing: float):
    """A CPU call under 'auto' with no softcap or z-loss, checked and flattened (cpu_flat): torch's loss
    (backends/torch.py's native cross-entropy), in the logits' dtype. The target check is a by-product of
    torch's loss, as of the Triton forward: a bad target raises the library's error (assert_targets), and
    the call records no plan."""
    return _checked(native_cross_entropy, NATIVE_CE, x, t, w, ignore_index, reduction, smoothing)


def cpu_cross_entropy_graph(x, t, w, ignore_index: int, reduction: str, rows_only: bool = False):
    """cpu_cross_entropy on logits that require grad, without smoothing, with a C++ autograd graph for the
    backward (native_cross_entropy_graph; rows_only: past one chunk, the row kernels' alone); None where it
    cannot be had (then cpu_cross_entropy under a Function)."""
    return _checked(native_cross_entropy_graph, NATIVE_CE_GRAPH, x, t, w, ignore_index, reduction, rows_only)


def _checked(run, plan, x, t, w, ignore_index: int, *args):
    """run(x, t, w, ignore_index, *args), its plan recorded if it gives a loss; the library's error for a
    target out of range, which torch's loss finds first (its IndexError)."""
    try:
        loss = run(x, t, w, ignore_index, *args)
    except IndexError as e:
        assert_targets(t, x.shape[-1], ignore_index)
        raise e
    if loss is not None:
        heuristics.record(plan)
    return loss


def cpu_cross_entropy_backward(x, t, w, grad, ignore_index: int, reduction: str, smoothing: float):
    """dlogits (M, V) of cpu_cross_entropy's loss for its upstream gradient."""
    heuristics.record(NATIVE_CE)
    return native_cross_entropy_backward(x, t, w, grad, ignore_index, reduction, smoothing)


def cross_entropy_backward(logits, target, class_weight, stats, grad, o, backend):
    """dlogits (logits' shape and dtype, contiguous) from the forward's stats and the loss's gradient."""
    if why := storage_problem(logits, target, stats, grad, class_weight):
        raise RuntimeError(f"cross_entropy: {why}")
    x, t = flat(logits, target)
    w = class_weight.contiguous() if class_weight is not None else None
    m = x.shape[0]
    impl = loss_backend(x, backend) if m else BACKENDS["torch"]
    dx = impl.cross_entropy_backward(x, t, w, stats, grad, o, logits.dtype)
    return dx.reshape(logits.shape)


__all__ = [
    "BACKENDS",
    "NAMES",
    "assert_targets",
    "cpu_cross_entropy",
    "cpu_cross_entropy_backward",
    "cpu_cross_entropy_graph",
    "cpu_flat",
    "cpu_softmax",
    "cpu_softmax_backward",
    "cpu_softmax_graph",
    "cross_entropy",
    "cross_entropy_backward",
    "flat",
    "flat_target",
    "loss_backend",
    "raise_bad_targets",
    "select",
    "softmax",
    "softmax_backward",
]
