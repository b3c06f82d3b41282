"""softmax(), log_softmax(), their nn.Modules and info(): argument checks, then the dispatch point."""

from __future__ import annotations

import operator
import platform

import torch

from . import cache, compose, dispatch, fastpath, heuristics, masking
from .layout import storage_problem
from .reference import grad_torch

_fast = fastpath.fast

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(fn: str, x, dim, dtype, backend) -> tuple[int, torch.dtype]:
    """Every check that can fail, before any launch. Returns (dim made non-negative, output dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"{fn}: expected a floating-point tensor (float16, bfloat16, float32 or float64), got {x.dtype}"
        )
    if dtype is not None and dtype not in _FLOATS:
        raise TypeError(f"{fn}: dtype must be None, float16, bfloat16, float32 or float64, got {dtype}")
    if isinstance(dim, bool):
        raise TypeError(f"{fn}: dim must be an int, got bool")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{fn}: dim must be an int, got {type(dim).__name__}") from None
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{fn}: dim out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    if not isinstance(backend, str) or backend not in dispatch.NAMES:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid: {', '.join(map(repr, dispatch.NAMES))}")
    if x.device.type not in dispatch.DEVICES and x.device.type != "meta":  # meta: the custom op's fake
        raise RuntimeError(
            f"{fn}: no path for tensors on device '{x.device}'; fastsoftmax runs cuda tensors (Triton "
            "kernels or torch ops) and cpu tensors (torch ops; Triton under TRITON_INTERPRET=1)"
        )
    return dim % ndim, (dtype or x.dtype)


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
        if backend != "auto":
            raise RuntimeError(f"{fn}: backend={backend!r} addresses masks over at most 4 row dims; this "
                               f"mask of shape {tuple(mask.shape)} needs more (backend='torch' runs it)")  # fmt: skip
        impl = dispatch.BACKENDS["torch"]
        spec = masking.Spec(1 if mask.dtype == torch.bool else 2, mw, scale, causal, (1, 1, 1), (0,) * 4, 0, 0)
    if impl.name != "torch" and not _logical_rows(moved[0]):
        moved[0] = moved[0].contiguous()
    return impl, tuple(moved), spec


def forward(
    x, dim=-1, *, log=False, dtype=None, backend="auto", want_lse=False, fn="softmax", key=None, mask=None,
    scale=None, causal=False,
):  # fmt: skip
    """softmax / log_softmax with, on request, the per-row logsumexp (fp32, x's shape without dim) that a
    backward pass, a loss or another GPU's shard can consume. Returns (y, lse or None). ``key``: the call's
    fastpath key, to record its launches for replay. ``mask``, ``scale``, ``causal``: see masking.py."""
    dim, out_dtype = _check(fn, x, dim, dtype, backend)
    if mask is not None or scale is not None or causal is not False:
        masking.check(fn, x, dim, mask, scale, causal)
    return _forward(x, dim, log, dtype, out_dtype, backend, want_lse, fn, key, mask, scale, causal)


def _forward(x, dim, log, dtype, out_dtype, backend, want_lse, fn, key, mask, scale, causal):
    """forward() past its checks (``dim`` non-negative, ``out_dtype`` resolved)."""
    masked = mask is not None or scale is not None or causal is not False
    if why := storage_problem(x, mask):
        raise RuntimeError(f"{fn}: {why}")
    impl, path = dispatch.select(backend, x, out_dtype, dim=dim, masked=masked)
    if x.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        y, lse = forward(x.reshape(1), 0, log=log, dtype=dtype, backend=impl.name, want_lse=want_lse, fn=fn, mask=m,
                         scale=scale, causal=causal)  # fmt: skip
        return y.reshape(()), (lse.reshape(()) if lse is not None else None)
    if x.numel() == 0:
        heuristics.record(heuristics.Plan(impl.name, "empty"))
        lse = None
        if want_lse:  # an empty row is fully masked: lse = -inf
            lse = torch.full(x.shape[:dim] + x.shape[dim + 1 :], float("-inf"), device=x.device)
        return torch.empty_like(x, dtype=out_dtype), lse
    if masked:  # softmax(scale * x + mask) along dim, causal over the last two dims
        impl, (xw,), spec = _masked_problem(impl, (x,), dim, mask, scale, causal, backend, fn)
        y, lse = dispatch.forward(impl, backend, xw, x.dim() - 1, out_dtype, log, want_lse, path, spec)
        return _like_empty_like(y.movedim(-1, dim), x), lse
    rec = fastpath.start(key) if key is not None and not want_lse else None
    if rec is None:
        return dispatch.forward(impl, backend, x, dim, out_dtype, log, want_lse, path)
    try:
        y, lse = dispatch.forward(impl, backend, x, dim, out_dtype, log, want_lse, path)
    except BaseException:
        fastpath.abort()
        raise
    fastpath.finish(rec, key, x, None, y, out_dtype)
    return y, lse


def _like_empty_like(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """out in the layout torch.empty_like(like) gives (what the custom ops' fake implementations promise): as
    it is when it has it, else copied once (the masked path on rows not in logical order: x was copied too)."""
    if (like.is_contiguous() and out.is_contiguous()) or (
        out.stride() == torch.empty_like(like, dtype=out.dtype, device="meta").stride()
    ):
        return out
    return torch.empty_like(like, dtype=out.dtype).copy_(out)


def _check_backward(fn, dy, y, dim, dtype, backend, mask, scale, causal) -> tuple[int, torch.dtype]:
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"{fn}: expected dy to be a torch.Tensor, got {type(dy).__name__}")
    dim, out_dtype = _check(fn, y, dim, dtype, backend)
    if dy.dtype not in _FLOATS:
        raise TypeError(f"{fn}: dy must be floating point (float16, bfloat16, float32 or float64), got {dy.dtype}")
    if dy.shape != y.shape:
        raise ValueError(f"{fn}: dy has shape {tuple(dy.shape)} but y has {tuple(y.shape)}")
    if dy.device != y.device:
        raise ValueError(f"{fn}: dy is on {dy.device} but y is on {y.device}")
    if mask is not None or scale is not None or causal is not False:
        masking.check(fn, y, dim, mask, scale, causal)
    return dim, out_dtype


def backward(
    dy, y, dim=-1, *, log=False, dtype=None, backend="auto", fn="softmax_backward", key=None, mask=None, scale=None,
    causal=False,
):  # fmt: skip
    """The gradient of softmax (log_softmax) from its output y and the output gradient dy; dx in ``dtype``
    (default y's dtype), computed in fp32. ``key``: as forward's. ``mask``, ``scale``, ``causal``: the
    forward's (masking.py): dx = scale * dz, 0 at masked positions."""
    dim, out_dtype = _check_backward(fn, dy, y, dim, dtype, backend, mask, scale, causal)
    return _backward(dy, y, dim, log, dtype, out_dtype, backend, fn, key, mask, scale, causal)


def _backward(dy, y, dim, log, dtype, out_dtype, backend, fn, key, mask, scale, causal):
    """backward() past its checks."""
    masked = mask is not None or scale is not None or causal is not False
    if why := storage_problem(y, dy, mask):
        raise RuntimeError(f"{fn}: {why}")
    impl, path = dispatch.select(backend, y, out_dtype, dy, dim=dim, masked=masked)
    if y.dim() == 0:
        m = mask.reshape(1) if mask is not None else None
        return backward(dy.reshape(1), y.reshape(1), 0, log=log, dtype=dtype, backend=impl.name, fn=fn, mask=m,
                        scale=scale, causal=causal).reshape(())  # fmt: skip
    if y.numel() == 0:
        heuristics.record(heuristics.Plan(impl.name, "empty"))
        return torch.empty_like(y, dtype=out_dtype)
    if masked:
        impl, (yw, dyw), spec = _masked_problem(impl, (y, dy), dim, mask, scale, causal, backend, fn)
        dx = dispatch.backward(impl, backend, dyw, yw, y.dim() - 1, out_dtype, log, path, spec)
        return _like_empty_like(dx.movedim(-1, dim), y)
    rec = fastpath.start(key) if key is not None else None
    if rec is None:
        return dispatch.backward(impl, backend, dy, y, dim, out_dtype, log, path)
    try:
        dx = dispatch.backward(impl, backend, dy, y, dim, out_dtype, log, path)
    except BaseException:
        fastpath.abort()
        raise
    fastpath.finish(rec, key, y, dy, dx, out_dtype)
    return dx


def _public_forward(x, dim, log, fn, mask, scale, causal, dtype, backend):
    """The route (compose.py) of a public softmax / log_softmax call, after torch's autocast policy."""
    d, _ = _check(fn, x, dim, dtype, backend)
    masked = mask is not None or scale is not None or causal is not False
    if masked:
        masking.check(fn, x, d, mask, scale, causal)
    dtype = compose.softmax_dtype(x, dtype)
    route = compose.route(x, mask)
    if route == "plain":
        # (the public functions tried fastpath.fast first: the key here records this call for later replays)
        key = None if masked else fastpath.key(x, None, dim, dtype, log, backend)
        return _forward(x, d, log, dtype, dtype or x.dtype, backend, False, fn, key, mask, scale, causal)[0]
    from . import ops

    if route == "func":
        if masked:  # torch ops, differentiable in x and the mask, which the transforms see through
            return ops.softmax_masked_torch(x, d, log, dtype, mask, scale, causal)
        return ops.SoftmaxEager.apply(x, dim, log, dtype, backend)
    if masked:
        return torch.ops.fastsoftmax.softmax_masked(x, dim, log, dtype, backend, mask, scale, causal)
    if route == "op":
        return torch.ops.fastsoftmax.softmax(x, dim, log, dtype, backend)
    return ops.SoftmaxEager.apply(x, dim, log, dtype, backend)


def softmax(x, dim=-1, *, mask=None, scale=None, causal=False, dtype=None, backend="auto") -> torch.Tensor:
    """Softmax of x along dim. See the README for the conventions on -inf, NaN and +inf rows.

    mask: bool (True = keep) or floating (added), broadcastable to x, read in place; scale: a float
    multiplied into x first; causal: over the last two dims (query, key), bottom-right aligned.
    dtype: output dtype (computed in fp32 from x as given, written once in dtype).
    backend: 'auto' (CUDA tensors: the tuning table's choice, else Triton kernels; CPU: torch ops), 'triton',
    'cuda' or 'torch'.
    Differentiable (only the output, and the mask, are saved for backward)."""
    if mask is None and scale is None and causal is False:  # no mask: perhaps a replay
        if (y := _fast(x, None, dim, dtype, False, backend)) is not None:
            return y
    return _public_forward(x, dim, False, "softmax", mask, scale, causal, dtype, backend)


def log_softmax(x, dim=-1, *, mask=None, scale=None, causal=False, dtype=None, backend="auto") -> torch.Tensor:
    """Log-softmax of x along dim; arguments and conventions as softmax()."""
    if mask is None and scale is None and causal is False:  # no mask: perhaps a replay
        if (y := _fast(x, None, dim, dtype, True, backend)) is not None:
            return y
    return _public_forward(x, dim, True, "log_softmax", mask, scale, causal, dtype, backend)


def _public_backward(dy, y, dim, log, fn, mask, scale, causal, dtype, backend):
    d, out_dtype = _check_backward(fn, dy, y, dim, dtype, backend, mask, scale, causal)
    masked = mask is not None or scale is not None or causal is not False
    route = compose.route(y, dy, mask)
    if route == "plain":
        key = None if masked else fastpath.key(y, dy, dim, dtype, log, backend)
        return _backward(dy, y, d, log, dtype, out_dtype, backend, fn, key, mask, scale, causal)
    if route == "op":
        if masked:
            return torch.ops.fastsoftmax.softmax_backward_masked(dy, y, dim, log, out_dtype, backend, mask, scale,
                                                                 causal)  # fmt: skip
        return torch.ops.fastsoftmax.softmax_backward(dy, y, dim, log, out_dtype, backend)
    # autograd through the gradient itself, or a torch.func transform: torch ops, differentiable in dy and y
    heuristics.record(heuristics.Plan("torch", "composite"))
    return grad_torch(dy, y, d, log, out_dtype, mask, scale, causal)


def softmax_backward(dy, y, dim=-1, *, mask=None, scale=None, causal=False, dtype=None, backend="auto"):
    """dx = y * (dy - sum(y * dy)) along dim, from softmax's output y; 0 on fully masked rows (y all 0).
    mask, scale, causal: the forward's (dx = scale * dz, 0 at masked positions)."""
    if mask is None and scale is None and causal is False:  # no mask: perhaps a replay
        if (dx := _fast(y, dy, dim, dtype, False, backend)) is not None:
            return dx
    return _public_backward(dy, y, dim, False, "softmax_backward", mask, scale, causal, dtype, backend)


def log_softmax_backward(dy, y, dim=-1, *, mask=None, scale=None, causal=False, dtype=None, backend="auto"):
    """dx = dy - exp(y) * sum(dy) along dim, from log_softmax's output y; 0 on fully masked rows (y all -inf).
    mask, scale, causal: as softmax_backward."""
    if mask is None and scale is None and causal is False:  # no mask: perhaps a replay
        if (dx := _fast(y, dy, dim, dtype, True, backend)) is not None:
            return dx
    return _public_backward(dy, y, dim, True, "log_softmax_backward", mask, scale, causal, dtype, backend)


class Softmax(torch.nn.Module):
    """Drop-in for torch.nn.Softmax (dim defaults to -1)."""

    def __init__(self, dim: int = -1, *, scale=None, causal=False, dtype=None, backend: str = "auto"):
        super().__init__()
        self.dim, self.scale, self.causal, self.dtype, self.backend = dim, scale, causal, dtype, backend

    def forward(self, x, mask=None):
        return softmax(x, self.dim, mask=mask, scale=self.scale, causal=self.causal, dtype=self.dtype,
                       backend=self.backend)  # fmt: skip

    def extra_repr(self):
        extra = (f", scale={self.scale}" if self.scale is not None else "") + (", causal=True" if self.causal else "")
        return f"dim={self.dim}{extra}, backend={self.backend!r}"


class LogSoftmax(Softmax):
    """Drop-in for torch.nn.LogSoftmax (dim defaults to -1)."""

    def forward(self, x, mask=None):
        return log_softmax(x, self.dim, mask=mask, scale=self.scale, causal=self.causal, dtype=self.dtype,
                           backend=self.backend)  # fmt: skip


# What the kernels compute with; the CUDA backend will add its own family with its build flags.
KERNEL_FAMILIES = {
    "triton.softmax_fwd": {
        "paths": list(heuristics.PATHS),
        "exp": "exp2((x - max) * log2(e)): ex2.approx.f32 on NVIDIA GPUs, fp32",
        "log": "log2(s) * ln(2): lg2.approx.f32, once per row",
        "division": "one IEEE reciprocal per row (div.rn.f32), then a multiply per element",
        "accumulation": "fp32",
        "build_flags": "Triton defaults (no fast-math flag; exp/log are the approximate units above)",
    },
    "triton.softmax_bwd": {
        "paths": list(heuristics.PATHS),
        "exp": "log_softmax only: exp2(y * log2(e)), ex2.approx.f32",
        "division": "none",
        "accumulation": "fp32 (sum(y*dy) or sum(dy) per row)",
        "build_flags": "Triton defaults (no fast-math flag)",
    },
    "cuda.softmax": {
        "paths": list(heuristics.CUDA_PATHS),
        "exp": "__expf (ex2.approx.f32 of x*log2(e)), fp32; the online and staged forwards: ex2.approx.ftz.f32 "
        "(results below 2^-126 flushed to 0), outputs exp2(fma(x - max, log2(e), -log2(sum)))",
        "log": "logf and log2f (IEEE), once per row",
        "division": "warp, block, cluster: one IEEE division 1/sum per row, then a multiply per element; online "
        "and staged: none (log2(sum) in the exponent)",
        "accumulation": "fp32",
        "build_flags": "NVRTC --std=c++17, no -use_fast_math (fast_math: False); compiled to a cubin for the GPU",
        "fast_math": False,
        "fast_exp": True,
    },
    "torch": {
        "exp": "torch.exp in fp32 (fp64 for fp64)",
        "division": "true division per element",
        "accumulation": "fp32 (fp64 for fp64)",
        "build_flags": "PyTorch's own build",
    },
}


def _nvrtc_version() -> str | None:
    if dispatch.cuda_import_error():
        return None
    from .cuda.build import nvrtc_version

    try:
        return ".".join(map(str, nvrtc_version()))
    except Exception:  # the bindings import but libnvrtc is missing
        return None


def info() -> dict:
    """Versions, which backends can run here, and how each kernel family computes. Queries the device
    when called, never at import."""
    from . import __version__

    triton_version = None
    if not dispatch.triton_import_error():
        import triton

        triton_version = triton.__version__
    cuda = torch.cuda.is_available()
    interp = dispatch.triton_interpreted()
    return {
        "fastsoftmax": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "triton_interpreter": interp,
        "backends": {
            "triton": {
                "cuda": bool(cuda and triton_version and not interp),
                "cpu": bool(triton_version and interp),
            },
            "cuda": {
                "cuda": bool(cuda and not dispatch.cuda_import_error() and not dispatch.cuda_failure()),
                "cpu": False,
                "off": dispatch.cuda_import_error() or dispatch.cuda_failure(),
            },
            "torch": {"cuda": cuda, "cpu": True},
        },
        "nvrtc": _nvrtc_version(),
        "kernels": KERNEL_FAMILIES,
        "replay": _replay_launch(),
        "cache": {"directory": str(cache.root()) if cache.root() else None, "refused": cache.problems()},
    }


def _replay_launch() -> str:
    """How the eager fast path (fastpath.py) launches a replayed call."""
    if not fastpath.ENABLED:
        return "off (FASTSOFTMAX_FAST_LAUNCH=0)"
    from .cuda.launch import describe

    return describe()
