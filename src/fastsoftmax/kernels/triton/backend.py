"""The Triton backend: the Triton kernels of this package, for CUDA tensors, and for CPU tensors under
Triton's interpreter. Its methods are the kernel modules' launchers, imported on first use."""

from __future__ import annotations

import functools
import importlib
import os

from ...core import dtypes


def dtype_problem(family: str, x, out_dtype, dy) -> str | None:
    """Why the kernels of ``family`` cannot take these dtypes, or None."""
    got = (x.dtype, out_dtype) + ((dy.dtype,) if dy is not None else ())
    if any(d not in dtypes.KERNEL for d in got):
        return (
            f"the {family} kernels take {dtypes.KERNEL_NAMES} (got {', '.join(map(str, got))}); "
            "float64 runs on backend='torch', which 'auto' picks"
        )
    return None


@functools.cache
def kernels(name: str):
    """A Triton kernel module, imported on first use: that first import decides, from TRITON_INTERPRET,
    whether its kernels are compiled or interpreted."""
    return importlib.import_module(f".{name}", __package__)


@functools.cache
def import_error() -> str | None:
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
    on 1-element arrays for loop bounds, which numpy 2.4 refuses."""
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


def interpreted() -> bool:
    """Whether the Triton kernels run in Triton's interpreter: fixed when the kernel module is first
    imported, from TRITON_INTERPRET at that moment."""
    if _interpreted:
        return _interpreted[0]
    if kernels.cache_info().currsize:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted.append(isinstance(kernels("softmax_fwd").softmax_fwd_rowblock, InterpretedFunction))
        return _interpreted[0]
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend:
    name = "triton"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        if why := dtype_problem("Triton", x, out_dtype, dy):
            return why
        if import_error():
            return import_error()
        if x.device.type == "cpu" and not interpreted():
            return (
                "CPU tensors run the Triton kernels only in Triton's interpreter: set TRITON_INTERPRET=1 "
                "before fastsoftmax's first call"
            )
        if x.device.type == "cpu" and interpreter_problem():
            return interpreter_problem()
        if x.device.type == "cuda" and interpreted():
            return "the Triton kernels were loaded for the interpreter (TRITON_INTERPRET=1); CUDA needs them compiled"
        return None

    def __getattr__(self, name: str):
        """forward, backward, cross_entropy, cross_entropy_backward: the kernel modules' launchers, imported on
        first use (that first import decides, from TRITON_INTERPRET, whether they compile or interpret)."""
        if name not in _ENTRIES:
            raise AttributeError(name)
        fn = getattr(kernels(_ENTRIES[name][0]), _ENTRIES[name][1])
        setattr(self, name, fn)
        return fn


_ENTRIES = {
    "forward": ("softmax_fwd", "forward"),
    "backward": ("softmax_bwd", "backward"),
    "cross_entropy": ("cross_entropy", "forward"),
    "cross_entropy_backward": ("cross_entropy", "backward"),
}
