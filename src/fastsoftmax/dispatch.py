"""The one dispatch point. Every backend registers in BACKENDS with the same methods, and select() is
the only place that chooses between them (``auto``: on CUDA tensors what the GPU's tuning table names for
the problem, else the Triton kernels when they can run it; everything else takes torch ops).

    unavailable(x, out_dtype, dy=None, dim=-1) -> str | None   why this backend cannot run x along dim (None:
        it can)
    forward(x, dim, out_dtype, log, want_lse, path=None) -> (y, lse | None)
        x non-empty, at least 1-d, dim non-negative; lse is fp32 logsumexp per row, x's shape without dim;
        path: the tuning table's choice for this backend, or None for its own
    backward(dy, y, dim, out_dtype, log, path=None) -> dx
        same preconditions, on y; dy has y's shape
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os

import torch

from . import heuristics, masking, tuning
from .errors import BackendFailed
from .layout import alloc
from .reference import grad_torch, softmax_torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEVICES = ("cpu", "cuda")


class TorchBackend:
    """torch ops, float32 accumulation (float64 for float64): the reference path, any device torch runs."""

    name = "torch"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        if spec.active:
            x = masking.logits(x, spec.mask, spec.scale, spec.causal, torch.float64 if x.dtype == torch.float64
                               or out_dtype == torch.float64 else torch.float32)  # fmt: skip
        y, lse = softmax_torch(x, dim, log, out_dtype)
        # In the layout every backend promises (and the custom op's fake implementation states).
        return alloc(x, out_dtype).copy_(y), (lse.to(torch.float32) if want_lse else None)

    def backward(self, dy, y, dim, out_dtype, log, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        return alloc(y, out_dtype).copy_(grad_torch(dy, y, dim, log, out_dtype, spec.mask, spec.scale, spec.causal))


def _dtype_problem(family: str, x, out_dtype, dy) -> str | None:
    dtypes = (x.dtype, out_dtype) + ((dy.dtype,) if dy is not None else ())
    if any(d not in KERNEL_DTYPES for d in dtypes):
        return (
            f"the {family} kernels take float16, bfloat16 and float32 (got {', '.join(map(str, dtypes))}); "
            "float64 runs on backend='torch', which 'auto' picks"
        )
    return None


@functools.cache
def _kernels(name: str):
    """A Triton kernel module, imported on first use: that first import decides, from TRITON_INTERPRET,
    whether its kernels are compiled or interpreted."""
    return importlib.import_module(f".triton.{name}", __package__)


@functools.cache
def triton_import_error() -> str | None:
    """Why triton cannot be imported here (None: it can). Under TRITON_INTERPRET=1 importing triton also
    imports numpy, for the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton cannot be imported ({e})"
    return None


@functools.cache
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here (None: it can): Triton before 3.8 calls int()
    on 1-element arrays for loop bounds, which numpy 2.4 refuses (seen on the H200 image: triton 3.6.0,
    numpy 2.4)."""
    import re

    import numpy
    import triton

    def version(v):
        return tuple(int(p) for p in re.findall(r"\d+", v)[:2])

    if version(triton.__version__) < (3, 8) and version(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter cannot run loops with numpy {numpy.__version__}: "
            "pip install 'numpy<2.4' (or triton>=3.8)"
        )
    return None


_interpreted: list[bool] = []  # filled once the kernels are imported, when the answer can no longer change


def triton_interpreted() -> bool:
    """Whether the Triton kernels run in Triton's interpreter: fixed when the kernel module is first
    imported, from TRITON_INTERPRET at that moment."""
    if _interpreted:
        return _interpreted[0]
    if _kernels.cache_info().currsize:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted.append(isinstance(_kernels("softmax_fwd").softmax_fwd_rowblock, InterpretedFunction))
        return _interpreted[0]
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it t's for the launch when it is not already."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


class TritonBackend:
    """The Triton kernels: CUDA tensors, and CPU tensors under Triton's interpreter."""

    name = "triton"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        if why := _dtype_problem("Triton", x, out_dtype, dy):
            return why
        if triton_import_error():
            return triton_import_error()
        if x.device.type == "cpu" and not triton_interpreted():
            return (
                "CPU tensors run the Triton kernels only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before fastsoftmax's first call"
            )
        if x.device.type == "cpu" and interpreter_problem():
            return interpreter_problem()
        if x.device.type == "cuda" and triton_interpreted():
            return "the Triton kernels were loaded for the interpreter (TRITON_INTERPRET=1); CUDA needs them compiled"
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE):
        y = alloc(x, out_dtype)
        with _on_device(x):
            return y, _kernels("softmax_fwd").forward(x, y, dim, log, want_lse, path, spec)[1]

    def backward(self, dy, y, dim, out_dtype, log, path=None, spec=masking.NONE):
        dx = alloc(y, out_dtype)
        with _on_device(y):
            _kernels("softmax_bwd").backward(dy, y, dx, dim, log, path, spec)
        return dx


@functools.cache
def cuda_import_error() -> str | None:
    """Why the CUDA backend's Python dependencies cannot be imported here (None: they can)."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError as e:
        return (
            f"cuda-python's bindings cannot be imported ({e}); pip install 'cuda-bindings>=13' 'nvidia-cuda-nvrtc>=13'"
        )
    return None


def _cuda_kernels():
    return importlib.import_module(".cuda.kernels", __package__)


_cuda_failure: list[str] = []  # why the CUDA backend failed to load or launch in this process (then it is off)


def cuda_failure() -> str | None:
    """Why the CUDA backend is off for the rest of this process (a load or launch failed), or None."""
    return _cuda_failure[0] if _cuda_failure else None


def reset_cuda_failure() -> None:
    """Turn the CUDA backend on again after a failure (tests)."""
    _cuda_failure.clear()


CUDA_MAX_N = (1 << 31) - 1  # softmax.cu's row length is a 32-bit int


class CudaBackend:
    """CUDA C kernels (fastsoftmax/cuda/softmax.cu) compiled by NVRTC at first use: CUDA tensors on sm_80+."""

    name = "cuda"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        if why := _dtype_problem("CUDA", x, out_dtype, dy):
            return why
        if x.device.type != "cuda":
            return f"the CUDA kernels run on CUDA tensors only (got a {x.device.type} tensor)"
        if cuda_import_error():
            return cuda_import_error()
        if _cuda_failure:
            return f"it failed earlier in this process and is off ({_cuda_failure[0]})"
        if x.dim() and x.shape[dim] > CUDA_MAX_N:
            return f"its rows hold at most 2^31 - 1 elements (this one: {x.shape[dim]}; the Triton kernels: any)"
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        cc = _cuda_kernels()._device_facts(index)[1]
        if cc < 80:
            return f"the CUDA kernels need compute capability 8.0 or newer (this GPU: {cc // 10}.{cc % 10})"
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None):  # no masks: select() keeps them off
        y = alloc(x, out_dtype)
        with _on_device(x):
            try:
                return y, _cuda_kernels().forward(x, y, dim, log, want_lse, path)
            except BackendFailed as e:
                _failed(e)
                raise

    def backward(self, dy, y, dim, out_dtype, log, path=None):
        dx = alloc(y, out_dtype)
        with _on_device(y):
            try:
                _cuda_kernels().backward(dy, y, dx, dim, log, path)
            except BackendFailed as e:
                _failed(e)
                raise
        return dx


def _failed(e: BackendFailed) -> None:
    """A load or launch failure of the CUDA backend: it is off for the rest of the process."""
    if not _cuda_failure:
        _cuda_failure.append(str(e))


def forward(impl, requested: str, x, dim, out_dtype, log, want_lse, path=None, spec=None):
    """impl.forward, and where the CUDA backend fails to load or launch under 'auto', the Triton kernels (or
    torch ops) for this call instead (and, through cuda_failure(), for the rest of the process)."""
    extra = () if spec is None else (spec,)
    try:
        return impl.forward(x, dim, out_dtype, log, want_lse, path, *extra)
    except BackendFailed:
        if requested != "auto":
            raise
    return _fallback(x, out_dtype).forward(x, dim, out_dtype, log, want_lse, None, *extra)


def backward(impl, requested: str, dy, y, dim, out_dtype, log, path=None, spec=None):
    """impl.backward, with forward()'s fallback."""
    extra = () if spec is None else (spec,)
    try:
        return impl.backward(dy, y, dim, out_dtype, log, path, *extra)
    except BackendFailed:
        if requested != "auto":
            raise
    return _fallback(y, out_dtype, dy).backward(dy, y, dim, out_dtype, log, None, *extra)


def _fallback(x, out_dtype, dy=None):
    """auto's choice without a table: the Triton kernels where they can run, else torch ops."""
    return BACKENDS["triton" if BACKENDS["triton"].unavailable(x, out_dtype, dy) is None else "torch"]


BACKENDS = {b.name: b for b in (TritonBackend(), CudaBackend(), TorchBackend())}

NAMES = ("auto", *BACKENDS)


@functools.cache
def _gpu(index: int) -> tuple[str, int]:
    """(name, SM count) of a GPU, read once."""
    p = torch.cuda.get_device_properties(index)
    return p.name, p.multi_processor_count


def select(
    name: str, x: torch.Tensor, out_dtype: torch.dtype, dy: torch.Tensor | None = None, dim: int = -1, masked=False
):
    """(backend, path or None) that runs x (forward) or y and dy (backward) along dim: the named backend
    (raising if it cannot) with its own path choice; or for 'auto', on a CUDA tensor, what the GPU's tuning
    table (tuning.py) names for this problem when that backend can run it, else the Triton kernels when
    they can; torch ops for everything else."""
    if name == "auto":
        if x.device.type != "cuda":
            return BACKENDS["torch"], None
        if x.dim() and x.numel() and not masked:
            gpu_name, sms = _gpu(x.device.index if x.device.index is not None else torch.cuda.current_device())
            n = x.shape[dim]
            pick = tuning.choose(
                tuning.table(gpu_name), "bwd" if dy is not None else "fwd", str(x.dtype)[6:], n, x.numel() // n, sms
            )
            if pick and pick[0] in BACKENDS and BACKENDS[pick[0]].unavailable(x, out_dtype, dy, dim) is None:
                return BACKENDS[pick[0]], pick[1]
        return _fallback(x, out_dtype, dy), None
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is None:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(repr(n) for n in NAMES)}")
    why = backend.unavailable(x, out_dtype, dy, dim)
    if masked and backend.name == "cuda":
        why = "it has no masks, scale or causal yet (backend='triton' or 'auto' fuses them)"
    if why:
        raise RuntimeError(f"backend={name!r} cannot run this tensor ({x.device}, {x.dtype}): {why}")
    return backend, None
