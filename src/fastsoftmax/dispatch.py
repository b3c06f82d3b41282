"""The one dispatch point: every call that runs kernels or torch ops comes here with its arguments checked
(core/checks.py, once, by the public function), and select() and select_loss() are the only places that
choose a backend and its path, each with its reason (one exception: a mask over more than 4 row dims, which
the kernels cannot address, goes to torch ops in _masked, under 'auto'; a named kernel backend refuses it):

  backend='auto', CUDA tensor   what the GPU's tuning table names for the problem, when that backend can
                                run it; else the Triton kernels, when they can; else torch ops
  backend='auto', CPU tensor    torch's own kernels with the library's conventions (the torch backend's
                                native path); masks and logsumexp outputs: its reference path
  a named backend               that backend, or a RuntimeError saying why it cannot run the tensor

Where the CUDA backend fails to load or launch under 'auto', the call runs on the Triton kernels instead (and
the CUDA backend stays off for the process: kernels/cuda/backend.py).

Also here, shared by every backend: 0-d and empty inputs, masks moved to the last dim, cross-entropy's
flattening, and the eager replay of plain calls (kernels/replay.py): a call whose key was seen before runs
what the first one ran (its recorded launches on a GPU, the torch backend's call on the CPU), also before
any check (replayed, replayed_loss).
"""

from __future__ import annotations

import torch

from . import heuristics
from .core import checks, dtypes, masking
from .core.compose import loss_dtype, softmax_dtype
from .core.compose import route as _route
from .core.errors import BackendFailed
from .core.layout import flat, storage_problem, values
from .core.options import Loss
from .heuristics import device, tables
from .kernels import replay, torch_native
from .kernels.cuda.backend import CudaBackend
from .kernels.torch_ops import TorchBackend
from .kernels.triton.backend import TritonBackend

BACKENDS = {b.name: b for b in (TritonBackend(), CudaBackend(), TorchBackend())}
assert ("auto", *BACKENDS) == checks.BACKENDS  # (the names the checks accept are the backends here)
_Tensor = torch.Tensor
_softmax_key, _loss_key, _replayable, _lookup = replay.softmax_key, replay.loss_key, replay.replayable, replay.lookup


def fallback(x, out_dtype, dy=None):
    """auto's choice on a GPU without a table entry: the Triton kernels where they can run, else torch ops."""
    return BACKENDS["triton" if BACKENDS["triton"].unavailable(x, out_dtype, dy) is None else "torch"]


def select(name: str, x, out_dtype, dy=None, dim: int = -1, masked: bool = False, lse: bool = False,
           fn: str = "softmax"):  # fmt: skip
    """(backend, path or None) that runs x (forward) or y and dy (backward) along dim; see the module. ``fn``:
    the public function, named in the refusal of a backend that cannot run the tensors."""
    if name == "auto":
        if not x.is_cuda:
            return BACKENDS["torch"], (None if masked or lse else "native")
        if x.dim() and x.numel() and not masked:
            facts = device.of_tensor(x)
            n = x.shape[dim]
            pass_ = "bwd" if dy is not None else "fwd"
            pick = tables.choose(tables.for_device(facts), pass_, dtypes.NAME[x.dtype], n, x.numel() // n,
                                 facts.sm_count)  # fmt: skip
            if pick and pick[0] in BACKENDS and BACKENDS[pick[0]].unavailable(x, out_dtype, dy, dim) is None:
                return BACKENDS[pick[0]], pick[1]
        return fallback(x, out_dtype, dy), None
    backend = BACKENDS[name]
    why = backend.unavailable(x, out_dtype, dy, dim)
    if masked and backend.name == "cuda":
        why = "it has no masks, scale or causal yet (backend='triton' or 'auto' fuses them)"
    if why:
        raise RuntimeError(f"{fn}: backend={name!r} cannot run this tensor ({x.device}, {x.dtype}): {why}")
    return backend, None


def select_loss(name: str, x, o: Loss | None = None, fn: str = "cross_entropy"):
    """(backend, path or None) of the loss kernels on (M, V) logits x: the Triton kernels on CUDA tensors
    they can run; torch ops for float64, for CPU tensors (under 'auto' the native path where no softcap or
    z-loss asks for the library's own formulas) and where Triton cannot run under 'auto'."""
    if name == "auto" and not x.is_cuda and x.shape[0]:
        native = o is not None and o.softcap is None and not o.z_loss
        return BACKENDS["torch"], ("native" if native else None)
    if name == "torch" or x.dtype == torch.float64 or not x.shape[0]:
        return BACKENDS["torch"], None
    loss_backend_runs(fn, name, x)
    if name == "auto" and BACKENDS["triton"].unavailable(x, x.dtype):
        return BACKENDS["torch"], None
    return BACKENDS["triton"], None


def loss_backend_runs(fn: str, name: str, x) -> None:
    """select_loss's refusal, for tensors like x whatever their shape: a RuntimeError where ``name`` is
    'triton' and the Triton kernels cannot run x's device and dtype (float64 runs torch ops). Also for
    fastsoftmax.distributed, before its first collective on every rank: a rank whose slice holds no classes
    launches nothing, while the others' slices would fail after that collective."""
    if name == "triton" and x.dtype != torch.float64 and (why := BACKENDS["triton"].unavailable(x, x.dtype)):
        raise RuntimeError(f"{fn}: backend='triton' cannot run this tensor ({x.device}, {x.dtype}): {why}")


# ---- softmax ------------------------------------------------------------------------------------------


def replayed(x, dy, dim, log, dtype, backend, backward: bool):
    """A plain call of the softmax family with no mask, scale or causal whose key was recorded, replayed
    before any check: its output, or None (the full path then runs, checks first). The key holds everything
    the checks read (each tensor's shape, strides, dtype and device, dim, the output dtype, the backend's
    name), so a call recorded under it passed them; it is the key softmax() and softmax_backward() record
    under (dim made non-negative, the output dtype autocast's). ``backward``: x is y, and ``dy`` its
    gradient (a dy that is not a tensor is the checks' to refuse: never the forward's replay). A dtype that is
    not None is keyed as given: a falsy bad one (0, False, '') must reach the checks, not pass for None."""
    if type(x) is not _Tensor or type(dim) is not int:
        return None
    nd = x.dim()
    if not -nd <= dim < nd:
        return None
    try:
        if backward:
            if type(dy) is not _Tensor or _route(dy, x) != "plain":
                return None
            r = _lookup(_softmax_key(x, dy, dim % nd, x.dtype if dtype is None else dtype, log, backend))
        else:
            if _route(x) != "plain":
                return None
            r = _lookup(_softmax_key(x, None, dim % nd, softmax_dtype(x) if dtype is None else dtype, log, backend))
    except (TypeError, RuntimeError):  # (an argument that cannot be hashed, a sparse or nested tensor's missing
        return None  # address or sizes: the checks' to refuse)
    if r is None:
        return None
    return r(x, dy) if backward else r(x)


def _logical_rows(t: torch.Tensor) -> bool:
    """Whether t's rows (every dim but the last) sit in memory in their logical order at one stride, so
    that a row's flat index is its position: what the masked kernels address the mask by."""
    dims = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1], strict=True) if size != 1]
    return all(a[1] == b[1] * b[0] for a, b in zip(dims, dims[1:], strict=False))


def _masked(impl, tensors, dim, mask, scale, causal, backend, fn):
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


def _edges(x, dim, log, dtype, backend, impl, mask, scale, causal, want_lse):
    """softmax of a 0-d tensor (a row of one element) or of an empty one (no launch)."""
    if x.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        out = softmax(x.reshape(1), 0, log, dtype, backend, m, scale, causal, want_lse)
        return tuple(t.reshape(()) for t in out) if want_lse else out.reshape(())
    heuristics.record(heuristics.Plan(impl.name, "empty"))
    y = torch.empty_like(x, dtype=dtype)
    if not want_lse:
        return y
    return y, torch.full(x.shape[:dim] + x.shape[dim + 1 :], float("-inf"), dtype=torch.float32, device=x.device)


def softmax(x, dim, log, dtype, backend, mask=None, scale=None, causal=False, want_lse=False):
    """softmax (log_softmax) of x along dim in dtype (None: x's), for checked arguments; with ``want_lse``
    (y, its fp32 logsumexp per row, x's shape without dim). mask, scale, causal: core/masking.py.
    The custom ops' implementation (softmax and softmax_masked; their schemas leave want_lse out)."""
    dtype, dim = dtype or x.dtype, dim % (x.dim() or 1)
    masked = mask is not None or scale is not None or causal is not False
    key = None
    if not (masked or want_lse) and _replayable(x):  # a call seen before: what it ran, again
        key = _softmax_key(x, None, dim, dtype, log, backend)
        if (r := _lookup(key)) is not None and (y := r(x)) is not None:
            return y
    if (not x.data_ptr() or mask is not None) and (why := storage_problem(x, mask)):
        raise RuntimeError(f"{'log_softmax' if log else 'softmax'}: {why}")
    impl, path = select(backend, x, dtype, dim=dim, masked=masked, lse=want_lse, fn="log_softmax" if log else "softmax")
    if not x.numel() or not x.dim():
        return _edges(x, dim, log, dtype, backend, impl, mask, scale, causal, want_lse)
    spec, xk = masking.NONE, values(x)
    if masked:  # softmax(scale * x + mask) along dim, causal over the last two dims
        fn = "log_softmax" if log else "softmax"
        impl, (xk,), spec = _masked(impl, (xk,), dim, values(mask), scale, causal, backend, fn)
    args = (xk, xk.dim() - 1 if masked else dim, dtype, log, want_lse)
    rec = replay.start(key)
    try:
        y, lse = impl.forward(*args, path, spec)
    except BackendFailed as e:
        if impl.name == "cuda":
            impl.failed(e)  # (off for the rest of the process)
        if backend != "auto" or impl.name != "cuda":
            raise
        y, lse = fallback(xk, dtype).forward(*args, None, spec)
    finally:
        if rec is not None:
            replay.stop()
    if masked:
        y = _like_empty_like(y.movedim(-1, dim), x)
    elif rec is not None:
        replay.store(key, rec, (x,), (y,))
    return (y, lse) if want_lse else y


def softmax_backward(dy, y, dim, log, dtype, backend, mask=None, scale=None, causal=False):
    """The gradient of softmax (log_softmax) along dim from its output y and the output gradient dy, in dtype
    (None: y's), computed in fp32, for checked arguments (dx = scale * dz, 0 at masked positions). The custom
    ops' implementation (softmax_backward and softmax_backward_masked)."""
    dtype, dim = dtype or y.dtype, dim % (y.dim() or 1)
    masked = mask is not None or scale is not None or causal is not False
    key = None
    if not masked and _replayable(y, dy):
        key = _softmax_key(y, dy, dim, dtype, log, backend)
        if (r := _lookup(key)) is not None and (dx := r(y, dy)) is not None:
            return dx
    fn = ("log_softmax" if log else "softmax") + "_backward"
    if (not y.data_ptr() or not dy.data_ptr() or mask is not None) and (why := storage_problem(y, dy, mask)):
        raise RuntimeError(f"{fn}: {why}")
    impl, path = select(backend, y, dtype, dy, dim=dim, masked=masked, fn=fn)
    if not y.dim():
        m = mask.reshape(1) if mask is not None else None
        return softmax_backward(dy.reshape(1), y.reshape(1), 0, log, dtype, backend, m, scale, causal).reshape(())
    if not y.numel():
        heuristics.record(heuristics.Plan(impl.name, "empty"))
        return torch.empty_like(y, dtype=dtype)
    spec, yk, dyk = masking.NONE, values(y), values(dy)
    if masked:
        impl, (yk, dyk), spec = _masked(impl, (yk, dyk), dim, values(mask), scale, causal, backend, fn)
    args = (dyk, yk, yk.dim() - 1 if masked else dim, dtype, log)
    rec = replay.start(key)
    try:
        dx = impl.backward(*args, path, spec)
    except BackendFailed as e:
        if impl.name == "cuda":
            impl.failed(e)  # (off for the rest of the process)
        if backend != "auto" or impl.name != "cuda":
            raise
        dx = fallback(yk, dtype, dyk).backward(*args, None, spec)
    finally:
        if rec is not None:
            replay.stop()
    if masked:
        return _like_empty_like(dx.movedim(-1, dim), y)
    if rec is not None:
        replay.store(key, rec, (y, dy), (dx,))
    return dx


def softmax_graph(x, dim, log, dtype, backend):
    """softmax (log_softmax) of x that requires grad, with torch's own autograd nodes where the backend is
    the torch backend's native path and they compute the library's gradient (kernels/torch_native.py's
    softmax_graph); None otherwise: the caller runs its autograd Function."""
    if x.is_cuda or dtype is not x.dtype or not x.numel() or not x.dim():
        return None
    impl, path = select(backend, x, dtype, dim=dim, fn="log_softmax" if log else "softmax")
    if path != "native":
        return None
    if (y := torch_native.softmax_graph(x, dim, log)) is not None:
        heuristics.record(torch_native.NATIVE_GRAPH)
    return y


# ---- cross-entropy ------------------------------------------------------------------------------------


def replayed_loss(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend):
    """A plain cross-entropy call whose key was recorded, replayed before any check, as replayed() does for
    the softmax family: (loss, z-loss, stats), or None (the full path then runs, checks first). The caller
    passes the options as the kernels take them (floats; the key holds their values, not their types)."""
    if type(target) is not _Tensor or _route(logits, target, class_weight) != "plain":
        return None
    if class_weight is not None and type(class_weight) is not _Tensor:
        return None
    try:
        r = _lookup(_loss_key((logits, target, class_weight), ignore_index, reduction, label_smoothing, softcap, z_loss,
                              backend, loss_dtype(logits), False))  # fmt: skip
    except (TypeError, RuntimeError):  # (as replayed())
        return None
    if r is None or (out := r(logits, target) if class_weight is None else r(logits, target, class_weight)) is None:
        return None
    return _shaped(out, target, reduction)


def _shaped(out, target, reduction):
    """(loss, z-loss, stats) with a loss per row (and its z-loss, where made) in the targets' shape."""
    if reduction != "none":
        return out
    loss, z, st = out
    return loss.reshape(target.shape), (None if z is None else z.reshape(target.shape)), st


def cross_entropy(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
                  out_dtype, stats=True):  # fmt: skip
    """(loss in out_dtype, z-loss in out_dtype, stats) for checked arguments: stats (M + 3,) holds each row's
    logsumexp, then the number of rows not ignored, 1.0 if every target was in range, and the weight of the
    rows kept (the mean's divisors, for the backward); None without ``stats`` where the path need not make
    them (for a call without autograd: the CPU's native path, and the Triton one-program forward, which
    then makes no z-loss either where there is none: None). The custom op's implementation (its schema
    leaves ``stats`` out). A plain call is recorded for replayed_loss, under the key it looks up."""
    key, w = None, class_weight
    if _replayable(logits, target, w):
        key = _loss_key((logits, target, w), ignore_index, reduction, label_smoothing, softcap, z_loss, backend,
                        out_dtype, stats)  # fmt: skip
        if (r := _lookup(key)) is not None and (out := r(logits, target) if w is None else r(logits, target, w)):
            return _shaped(out, target, reduction)
    x, t = flat(logits, target)
    w = values(w)
    if why := storage_problem(logits, target, class_weight):
        raise RuntimeError(f"cross_entropy: {why}")
    o = Loss(ignore_index, reduction, label_smoothing, softcap, z_loss)
    v = x.shape[1]
    impl, path = select_loss(backend, x, o)
    if w is not None and not w.is_contiguous():
        w = w.contiguous()
    if (impl.name == "torch" and path is None) or (impl.name == "triton" and not x.is_cuda):
        checks.targets(t, v, ignore_index)  # (on a GPU the Triton forward's last program asserts on the device)
    rec = replay.start(key)
    try:
        loss, z, st = impl.cross_entropy(x, t, w, o, out_dtype, path, stats)
    except IndexError:  # (torch's loss on the native path found a target out of range: the library's error)
        checks.targets(t, v, ignore_index)
        raise
    finally:
        if rec is not None:
            replay.stop()
    if rec is not None:
        replay.store(key, rec, (logits, target) if w is None else (logits, target, class_weight), (loss, z, st))
    return _shaped((loss, z, st), target, reduction)


def cross_entropy_graph(logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss,
                        backend, out_dtype):  # fmt: skip
    """(loss, None: no z-loss) of logits that require grad with torch's own autograd nodes, where the backend
    is the torch backend's native path and they compute the library's gradient (no smoothing, no softcap or
    z-loss, within one chunk: kernels/torch_native.py's cross_entropy_graph); None otherwise: the caller runs
    its autograd Function."""
    if logits.is_cuda or label_smoothing or storage_problem(logits, target, class_weight):
        return None
    x, t = flat(logits, target)
    o = Loss(ignore_index, reduction, label_smoothing, softcap, z_loss)
    impl, path = select_loss(backend, x, o)
    if path != "native":
        return None
    try:
        loss = torch_native.cross_entropy_graph(x, t, class_weight, ignore_index, reduction, out_dtype)
    except IndexError:  # (torch's loss found a target out of range: the library's error)
        checks.targets(t, x.shape[1], ignore_index)
        raise
    if loss is None:
        return None
    heuristics.record(torch_native.NATIVE_GRAPH)
    if reduction == "none":
        loss = loss.reshape(target.shape)
    return loss, None  # (no z-loss here: the public function makes its term where it is returned)


def cross_entropy_backward(logits, target, class_weight, stats, grad, ignore_index, reduction, label_smoothing,
                           softcap, z_loss, backend):  # fmt: skip
    """dlogits (logits' shape and dtype, contiguous) from the forward's stats and the loss's gradient. The
    custom op's implementation."""
    key = None
    if class_weight is None and _replayable(logits, target, stats, grad):
        key = _loss_key((logits, target, stats, grad), ignore_index, reduction, label_smoothing, softcap, z_loss,
                        backend)  # fmt: skip
        if (r := _lookup(key)) is not None and (dx := r(logits, target, stats, grad)) is not None:
            return dx if logits.dim() == 2 else dx.reshape(logits.shape)
    x, t = flat(logits, target)
    w, st, g = values(class_weight), values(stats), values(grad)
    if why := storage_problem(logits, target, stats, grad, class_weight):
        raise RuntimeError(f"cross_entropy: {why}")
    o = Loss(ignore_index, reduction, label_smoothing, softcap, z_loss)
    impl, path = select_loss(backend, x, o)
    if w is not None and not w.is_contiguous():
        w = w.contiguous()
    rec = replay.start(key)
    try:
        dx = impl.cross_entropy_backward(x, t, w, st, g, o, logits.dtype, path)
    finally:
        if rec is not None:
            replay.stop()
    if rec is not None:
        replay.store(key, rec, (logits, target, stats, grad), (dx,))
    return dx.reshape(logits.shape)
