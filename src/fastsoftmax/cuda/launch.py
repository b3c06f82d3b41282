"""Kernel launches through libcuda's own C entry points (ctypes), for a launch to cost what the driver costs.

cuda.bindings builds Python wrapper objects for every argument of every call, and Triton 3.6's generated C
launcher parses each of a kernel's arguments again on every call (5.2 us for a 37-argument kernel on the
H200, dev/logs/2026-11-30b-h200-host-parts-2.txt). A `Launch` is prepared once: function, grid, block,
dynamic shared memory, cluster size, and the kernel's argument bytes in one buffer; a call writes the
tensors' addresses into their slots and calls cuLaunchKernel (cuLaunchKernelEx for a cluster).

libcuda is opened on first use, never at import. A Launch's buffer is shared by the threads that call it:
each call fills and launches under the Launch's lock (the driver copies the arguments before it returns).
"""

from __future__ import annotations

import ctypes
import threading

_U32 = ctypes.c_uint
_PTR = ctypes.c_void_p
CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread

_lib = []
_lib_lock = threading.Lock()


def libcuda():
    """libcuda.so.1 with the prototypes used here (opened once, on first use)."""
    if not _lib:
        with _lib_lock:
            if not _lib:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuLaunchKernel.argtypes = [_PTR] + [_U32] * 7 + [_PTR] * 3
                lib.cuLaunchKernelEx.argtypes = [_PTR, _PTR, _PTR, _PTR]
                lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_PTR)]
                lib.cuCtxSetCurrent.argtypes = [_PTR]
                lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
                lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(_PTR), ctypes.c_int]
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                for f in (lib.cuLaunchKernel, lib.cuLaunchKernelEx, lib.cuCtxGetCurrent, lib.cuCtxSetCurrent,
                          lib.cuDeviceGet, lib.cuDevicePrimaryCtxRetain, lib.cuGetErrorName):  # fmt: skip
                    f.restype = ctypes.c_int
                _lib.append(lib)
    return _lib[0]


class _Attribute(ctypes.Structure):
    """CUlaunchAttribute holding a cluster dimension (id, 4 bytes of padding, a 64-byte value union)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("x", _U32), ("y", _U32), ("z", _U32),
                ("rest", ctypes.c_char * 52)]  # fmt: skip


class _Config(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", _U32), ("grid_y", _U32), ("grid_z", _U32), ("block_x", _U32), ("block_y", _U32),
                ("block_z", _U32), ("smem", _U32), ("stream", _PTR), ("attrs", _PTR), ("num_attrs", _U32)]  # fmt: skip


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if libcuda().cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {code}"
    return name.value.decode()


def pack(args):
    """The bytes of a kernel's parameters ``args`` ((ctypes type, value) pairs; a Structure value is copied
    whole), each at its type's alignment as the compiler lays out a parameter list: (buffer, offsets)."""
    offsets, end = [], 0
    for t, _ in args:
        end = -(-end // ctypes.alignment(t)) * ctypes.alignment(t)
        offsets.append(end)
        end += ctypes.sizeof(t)
    buf = (ctypes.c_char * max(end, 8))()
    for (t, v), off in zip(args, offsets, strict=True):
        if isinstance(v, ctypes.Structure):
            ctypes.memmove(ctypes.addressof(buf) + off, ctypes.addressof(v), ctypes.sizeof(v))
        else:
            t.from_buffer(buf, off).value = v
    return buf, offsets


class Launch:
    """One kernel launch, prepared: ``args`` is the kernel's parameter list as (ctypes type, value) pairs
    (a ctypes.Structure instance is one parameter, passed by value). ``slot(i, offset)`` is a 64-bit view
    of parameter i at byte ``offset`` in it, for a call to fill (an address)."""

    def __init__(self, function: int, grid: tuple[int, int, int], block: int, smem: int, cluster: int, args):
        self._buf, offsets = pack(args)
        base = ctypes.addressof(self._buf)
        self._offsets = offsets
        self._params = (_PTR * max(len(args), 1))(*[base + off for off in offsets])
        self.lock = threading.Lock()
        self.function = function
        lib = libcuda()
        if cluster == 1:
            self._call = lib.cuLaunchKernel
            self._head = (function, grid[0], grid[1], grid[2], block, 1, 1, smem)
            self._tail = (ctypes.addressof(self._params), None)
            self._config = None
        else:
            self._attr = _Attribute(id=CLUSTER_DIMENSION, x=cluster, y=1, z=1)
            self._config = _Config(grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=block, block_y=1,
                                   block_z=1, smem=smem, attrs=ctypes.addressof(self._attr), num_attrs=1)  # fmt: skip
            self._call = lib.cuLaunchKernelEx
            self._head = (ctypes.addressof(self._config), function, ctypes.addressof(self._params), None)

    def slot(self, index: int, offset: int = 0) -> ctypes.c_uint64:
        return ctypes.c_uint64.from_buffer(self._buf, self._offsets[index] + offset)

    def __call__(self, stream: int) -> int:
        """Launch on ``stream`` (callers hold self.lock while they fill the slots and call): the CUresult."""
        if self._config is None:
            return self._call(*self._head, stream, *self._tail)
        self._config.stream = stream
        return self._call(*self._head)


def ensure_context(index: int) -> None:
    """Make device ``index``'s primary context (torch's) current on this thread when none is: the driver
    API's calls need one, and a thread that has not yet made a CUDA runtime call has none."""
    lib = libcuda()
    ctx = _PTR()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if ctx.value:
        return
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed: {error_name(code)}")


def launch_once(function: int, grid: int, block: int, cluster: int, params: ctypes.Structure, stream: int,
                smem: int, index: int) -> None:  # fmt: skip
    """Launch ``function`` once with one by-value parameter ``params`` (the full path: no Launch kept),
    making device ``index``'s context current first if this thread has none; raises on a driver error."""
    lib = libcuda()
    args = (_PTR * 1)(ctypes.addressof(params))
    for attempt in (0, 1):
        if cluster == 1:
            code = lib.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, smem, stream, ctypes.addressof(args), None)
        else:
            attr = _Attribute(id=CLUSTER_DIMENSION, x=cluster, y=1, z=1)
            cfg = _Config(grid_x=grid, grid_y=1, grid_z=1, block_x=block, block_y=1, block_z=1, smem=smem,
                          stream=stream, attrs=ctypes.addressof(attr), num_attrs=1)  # fmt: skip
            code = lib.cuLaunchKernelEx(ctypes.addressof(cfg), function, ctypes.addressof(args), None)
        if code == INVALID_CONTEXT and attempt == 0:
            ensure_context(index)
            continue
        what = "launch" if cluster == 1 else f"cluster launch ({cluster} CTAs per cluster)"
        _check(code, what)
        return
