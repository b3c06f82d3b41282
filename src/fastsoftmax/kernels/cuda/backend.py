"""The CUDA backend: the CUDA C kernels (softmax.cu), compiled by NVRTC at first use, for CUDA tensors on sm_80
and newer. Its forward and backward are kernels.py's, imported on first use.

Its compiler comes with an extra matched to the driver (`fastsoftmax[cu13]`, `fastsoftmax[cu12]`): without
it, or with an NVRTC newer than the driver's CUDA major version (whose cubins that driver cannot load:
checked before any module is loaded), the backend is off and `auto` runs the Triton kernels (off() says
why). A load or launch failure turns it off for the rest of the process too (failure() says why); under
backend='auto' dispatch then runs the call on the Triton kernels instead.
"""

from __future__ import annotations

import functools
import importlib

from ...core.errors import BackendFailed
from ...heuristics import device
from ..triton.backend import dtype_problem

MAX_N = (1 << 31) - 1  # softmax.cu's row length is a 32-bit int


INSTALL = "pip install 'fastsoftmax[cu13]' (a CUDA 13 driver, 580 or newer) or 'fastsoftmax[cu12]' (CUDA 12)"


@functools.cache
def import_error() -> str | None:
    """Why the CUDA backend's Python dependencies cannot be imported here (None: they can)."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError as e:
        return f"its compiler is not installed (cuda-python's bindings: {e}); {INSTALL}"
    return None


def versions() -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """(the driver's CUDA version, NVRTC's), each (major, minor), None where it cannot be read."""
    from cuda.bindings import driver

    from .build import nvrtc_version

    try:
        err, v = driver.cuDriverGetVersion()
        drv = (v // 1000, v % 1000 // 10) if int(err) == 0 and v else None
    except Exception:  # no libcuda here (a machine without the driver)
        drv = None
    try:
        rtc = nvrtc_version()
    except Exception:  # the bindings import, libnvrtc does not load
        rtc = None
    return drv, rtc


@functools.cache
def version_problem() -> str | None:
    """Why this NVRTC's cubins cannot run on this driver (None: they can), from the versions alone: a cubin
    loads on any driver of NVRTC's CUDA major version or newer (minor-version compatibility), never on an
    older major. Checked before any module is loaded; needs no GPU context."""
    if import_error():
        return import_error()
    drv, rtc = versions()
    if rtc is None:
        return f"NVRTC's library does not load (the nvidia-cuda-nvrtc package is missing or broken); {INSTALL}"
    if drv is None:
        return "no CUDA driver answers cuDriverGetVersion"
    if drv[0] < rtc[0]:
        return (
            f"NVRTC {rtc[0]}.{rtc[1]} makes cubins that this CUDA {drv[0]}.{drv[1]} driver cannot load; pip install "
            f"'fastsoftmax[cu{drv[0]}]' for its CUDA major version, or a CUDA {rtc[0]} driver"
        )
    return None


def off() -> str | None:
    """Why the CUDA backend cannot run here (not installed, versions, an earlier failure), or None."""
    return import_error() or version_problem() or failure()


_failure: list[str] = []  # why the CUDA backend failed to load or launch in this process (then it is off)


def failure() -> str | None:
    """Why the CUDA backend is off for the rest of this process (a load or launch failed), or None."""
    return _failure[0] if _failure else None


def reset_failure() -> None:
    """Turn the CUDA backend on again after a failure (tests)."""
    _failure.clear()


class CudaBackend:
    name = "cuda"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        if why := dtype_problem("CUDA", x, out_dtype, dy):
            return why
        if x.device.type != "cuda":
            return f"the CUDA kernels run on CUDA tensors only (got a {x.device.type} tensor)"
        if why := version_problem():
            return why
        if _failure:
            return f"it failed earlier in this process and is off ({_failure[0]})"
        if x.dim() and x.shape[dim] > MAX_N:
            return f"its rows hold at most 2^31 - 1 elements (this one: {x.shape[dim]}; the Triton kernels: any)"
        cc = device.of_tensor(x).cc
        if cc < 80:
            return f"the CUDA kernels need compute capability 8.0 or newer (this GPU: {cc // 10}.{cc % 10})"
        return None

    def failed(self, e: BackendFailed) -> None:
        """Turn the backend off for the rest of the process after ``e`` (dispatch.py, before it falls back)."""
        if not _failure:
            _failure.append(str(e))

    def __getattr__(self, name: str):
        """forward and backward: the launcher's (kernels.py), imported on first use."""
        if name not in ("forward", "backward"):
            raise AttributeError(name)
        fn = getattr(importlib.import_module(".kernels", __package__), name)
        setattr(self, name, fn)
        return fn
