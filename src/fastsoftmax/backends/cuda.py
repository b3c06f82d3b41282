"""The CUDA C kernels (cuda/softmax.cu), compiled by NVRTC at first use: CUDA tensors on sm_80 and newer.

A load or launch failure turns the backend off for the rest of the process (failure() says why); under
backend='auto' dispatch then runs the call on the Triton kernels instead.
"""

from __future__ import annotations

import functools
import importlib

from ..errors import BackendFailed
from ..heuristics import device
from ..layout import alloc
from .triton import dtype_problem

MAX_N = (1 << 31) - 1  # softmax.cu's row length is a 32-bit int


@functools.cache
def import_error() -> str | None:
    """Why the CUDA backend's Python dependencies cannot be imported here (None: they can)."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError as e:
        return (
            f"cuda-python's bindings cannot be imported ({e}); pip install 'cuda-bindings>=13' 'nvidia-cuda-nvrtc>=13'"
        )
    return None


def _kernels():
    return importlib.import_module("..cuda.kernels", __package__)


_failure: list[str] = []  # why the CUDA backend failed to load or launch in this process (then it is off)


def failure() -> str | None:
    """Why the CUDA backend is off for the rest of this process (a load or launch failed), or None."""
    return _failure[0] if _failure else None


def reset_failure() -> None:
    """Turn the CUDA backend on again after a failure (tests)."""
    _failure.clear()


def _failed(e: BackendFailed) -> None:
    if not _failure:
        _failure.append(str(e))


class CudaBackend:
    name = "cuda"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        if why := dtype_problem("CUDA", x, out_dtype, dy):
            return why
        if x.device.type != "cuda":
            return f"the CUDA kernels run on CUDA tensors only (got a {x.device.type} tensor)"
        if import_error():
            return import_error()
        if _failure:
            return f"it failed earlier in this process and is off ({_failure[0]})"
        if x.dim() and x.shape[dim] > MAX_N:
            return f"its rows hold at most 2^31 - 1 elements (this one: {x.shape[dim]}; the Triton kernels: any)"
        cc = device.of_tensor(x).cc
        if cc < 80:
            return f"the CUDA kernels need compute capability 8.0 or newer (this GPU: {cc // 10}.{cc % 10})"
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None):  # no masks: dispatch keeps them off
        y = alloc(x, out_dtype)
        with device.selected(x):
            try:
                return y, _kernels().forward(x, y, dim, log, want_lse, path)
            except BackendFailed as e:
                _failed(e)
                raise

    def backward(self, dy, y, dim, out_dtype, log, path=None):
        dx = alloc(y, out_dtype)
        with device.selected(y):
            try:
                _kernels().backward(dy, y, dx, dim, log, path)
            except BackendFailed as e:
                _failed(e)
                raise
        return dx
