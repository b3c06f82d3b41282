"""Kernel launches through libcuda's own entry points, for a launch to cost what the driver costs.

cuda.bindings builds Python wrapper objects for every argument of every call, and Triton 3.6's generated C
launcher parses each of a kernel's arguments again on every call (5.2 us for a 37-argument kernel on the
H200, dev/logs/2026-11-30b-h200-host-parts-2.txt). A `Launch` is prepared once: function, grid, block,
dynamic shared memory, cluster size, the kernel's argument bytes and the byte offsets where the call's
addresses go (x, y, dy, a workspace), in one `Desc`; a call passes the stream and the addresses.

Two ways to make the call: fastlaunch.c, a six-integer C function built on first use with the C compiler
(the one Triton builds its launchers with; cached beside the cubins, fastsoftmax/cache.py, and loaded from a
private temporary copy of the verified entry), which copies the
bytes onto its stack, writes the addresses and calls cuLaunchKernel(Ex); or, where it cannot be built,
ctypes (about 3 us more per call, measured on the H200), which writes the addresses into the Desc under a
lock. FASTSOFTMAX_NATIVE_LAUNCH=0 keeps ctypes. libcuda and the compiler are touched on first use only.
"""

from __future__ import annotations

import ctypes
import functools
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


def _cluster_config(grid: tuple[int, int, int], block: int, smem: int, cluster: int, stream: int = 0):
    """(CUlaunchConfig, its CUlaunchAttribute) of a cluster launch; the config points at the attribute, so
    keep both."""
    attr = _Attribute(id=CLUSTER_DIMENSION, x=cluster, y=1, z=1)
    cfg = _Config(grid_x=grid[0], grid_y=grid[1], grid_z=grid[2], block_x=block, block_y=1, block_z=1, smem=smem,
                  stream=stream, attrs=ctypes.addressof(attr), num_attrs=1)  # fmt: skip
    return cfg, attr


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if libcuda().cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
        return f"CUresult {code}"
    return name.value.decode()


MAX_PARAMS, MAX_BYTES, MAX_SLOTS = 64, 1024, 4  # fastlaunch.c's
ROLES = ("x", "y", "d", "ws")  # the addresses a call passes, in fastlaunch.c's slot order


class Desc(ctypes.Structure):
    """fastlaunch.c's Desc, field for field."""

    _fields_ = [("function", ctypes.c_uint64), ("grid", _U32 * 3), ("block", _U32), ("smem", _U32),
                ("cluster", _U32), ("n_params", _U32), ("n_bytes", _U32), ("offsets", _U32 * MAX_PARAMS),
                ("slots", (ctypes.c_int * MAX_SLOTS) * 4), ("bytes", ctypes.c_char * MAX_BYTES)]  # fmt: skip


def _layout(args) -> tuple[list[int], int]:
    """Each parameter's offset, at its type's alignment as the compiler lays out a parameter list, and the
    end of the last one."""
    offsets, end = [], 0
    for t, _ in args:
        end = -(-end // ctypes.alignment(t)) * ctypes.alignment(t)
        offsets.append(end)
        end += ctypes.sizeof(t)
    return offsets, end


def pack(args) -> tuple[bytes, list[int]]:
    """The bytes of a kernel's parameters ``args`` ((ctypes type, value) pairs; a Structure value is copied
    whole), laid out by _layout: (bytes, offsets)."""
    offsets, end = _layout(args)
    buf = (ctypes.c_char * max(end, 8))()
    for (t, v), off in zip(args, offsets, strict=True):
        if isinstance(v, ctypes.Structure):
            ctypes.memmove(ctypes.addressof(buf) + off, ctypes.addressof(v), ctypes.sizeof(v))
        else:
            t.from_buffer(buf, off).value = v
    return bytes(buf), offsets


def preparable(args, slots) -> bool:
    """Whether a Desc holds these parameters and address slots."""
    per_role = [sum(1 for _, _, r in slots if r == role) for role in ROLES]
    return len(args) <= MAX_PARAMS and _layout(args)[1] <= MAX_BYTES and max(per_role, default=0) <= MAX_SLOTS


class Launch:
    """One kernel launch, prepared: ``args`` is the kernel's parameter list as (ctypes type, value) pairs
    (a ctypes.Structure instance is one parameter, passed by value); ``slots`` lists (parameter index, byte
    offset in it, role): where a call's address for role (ROLES) goes. ``call(stream, x, y, d, ws)`` launches
    with those addresses (0 for a role the launch has none of) and returns the CUresult."""

    def __init__(self, function: int, grid: tuple[int, int, int], block: int, smem: int, cluster: int, args,
                 slots=()):  # fmt: skip
        if not preparable(args, slots):
            raise ValueError("more kernel parameters, argument bytes or address slots than a Desc holds")
        raw, offsets = pack(args)
        d = self.desc = Desc(function=function, block=block, smem=smem, cluster=cluster, n_params=len(args),
                             n_bytes=len(raw))  # fmt: skip
        d.grid[:] = list(grid)
        d.offsets[: len(offsets)] = offsets
        ctypes.memmove(ctypes.addressof(d) + Desc.bytes.offset, raw, len(raw))
        for k in range(4):
            d.slots[k][:] = [-1] * MAX_SLOTS
        filled = [0] * 4
        for i, off, role in slots:
            k = ROLES.index(role)
            d.slots[k][filled[k]] = offsets[i] + off
            filled[k] += 1
        native = _native()
        if native is not None:
            self.call = functools.partial(native.launch, ctypes.addressof(d))
            self.call.desc = d  # the call holds what its address points to: a caller may keep only the call
            return
        base = ctypes.addressof(d) + Desc.bytes.offset
        self._views = [[ctypes.c_uint64.from_address(base + o) for o in d.slots[k] if o >= 0] for k in range(4)]
        self._params = (_PTR * max(len(args), 1))(*[base + off for off in offsets])
        self._lock = threading.Lock()
        lib = libcuda()
        if cluster == 1:
            self._launch = lib.cuLaunchKernel
            self._head = (function, grid[0], grid[1], grid[2], block, 1, 1, smem)
            self._tail = (ctypes.addressof(self._params), None)
            self._config = None
        else:
            self._config, self._attr = _cluster_config(grid, block, smem, cluster)
            self._launch = lib.cuLaunchKernelEx
            self._head = (ctypes.addressof(self._config), function, ctypes.addressof(self._params), None)
        self.call = self._call_ctypes

    def _call_ctypes(self, stream: int, *addresses: int) -> int:
        with self._lock:  # the Desc's bytes are shared: fill and launch as one step
            for views, a in zip(self._views, addresses, strict=True):
                for v in views:
                    v.value = a
            if self._config is None:
                return self._launch(*self._head, stream, *self._tail)
            self._config.stream = stream
            return self._launch(*self._head)


_native_mod = []


def _native():
    """fastlaunch (fastlaunch.c built and loaded once), or None where it cannot be built or is turned off."""
    if not _native_mod:
        with _lib_lock:
            if not _native_mod:
                _native_mod.append(_build_native())
    return _native_mod[0]


def _native_off() -> bool:
    import os

    return os.environ.get("FASTSOFTMAX_NATIVE_LAUNCH", "1") == "0"


def describe() -> str:
    """How prepared launches are made here, for fs.info() (builds nothing)."""
    if _native_off():
        return "ctypes (FASTSOFTMAX_NATIVE_LAUNCH=0)"
    if not _native_mod:
        return "fastlaunch.c (built on the first replay)"
    return "fastlaunch.c" if _native_mod[0] is not None else "ctypes (fastlaunch.c could not be built here)"


def _build_native():
    """fastlaunch, or None where it cannot be built or loaded (any failure: ctypes launches instead)."""
    if _native_off():
        return None
    try:
        return _load_native()
    except Exception:  # no compiler, headers, cache or loader: never worse than ctypes
        return None


def native_entry() -> str:
    """The cache entry name of fastlaunch.c built for this Python (its source, ABI and the cache format)."""
    import hashlib
    import sysconfig
    from pathlib import Path

    from .. import cache

    code = Path(__file__).with_name("fastlaunch.c").read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return f"fastlaunch-{hashlib.sha256(code + suffix.encode() + bytes([cache.FORMAT])).hexdigest()[:16]}{suffix}"


def _load_native():
    import importlib.machinery
    import importlib.util
    import os
    import shutil
    import subprocess
    import sysconfig
    import tempfile
    from pathlib import Path

    from .. import cache

    src = Path(__file__).with_name("fastlaunch.c")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths().get("include")
    if cc is None or not include or not Path(include, "Python.h").exists():
        return None
    name = native_entry()
    data = cache.load(name)
    with tempfile.TemporaryDirectory(prefix="fastsoftmax-") as tmp:  # mode 0700: nobody else writes here
        so = Path(tmp, name)
        if data is None:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(src), "-o", str(so), "-ldl"],
                           check=True, capture_output=True, timeout=120)  # fmt: skip
            cache.store(name, so.read_bytes())
        else:  # the verified entry's bytes, loaded from a file only this process wrote
            so.write_bytes(data)
        loader = importlib.machinery.ExtensionFileLoader("fastlaunch", str(so))
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader("fastlaunch", loader))
        loader.exec_module(mod)
    if mod.desc_size() != ctypes.sizeof(Desc):
        return None  # a layout mismatch: never launch from bytes the C side reads otherwise
    return mod


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
            cfg, _attr = _cluster_config((grid, 1, 1), block, smem, cluster, stream)
            code = lib.cuLaunchKernelEx(ctypes.addressof(cfg), function, ctypes.addressof(args), None)
        if code == INVALID_CONTEXT and attempt == 0:
            ensure_context(index)
            continue
        if code != 0:
            from ..errors import BackendFailed

            what = "launch" if cluster == 1 else f"cluster launch ({cluster} CTAs per cluster)"
            raise BackendFailed(f"the CUDA backend's {what} failed: {error_name(code)}")
        return
