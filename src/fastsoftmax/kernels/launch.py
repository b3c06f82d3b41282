"""The one way fastsoftmax launches a GPU kernel, for both backends: a prepared driver launch.

A `Launch` is built once: the kernel's CUfunction, grid, block, dynamic shared memory, cluster size, the
kernel's argument bytes (packed here as the compiler lays out a parameter list) and its address slots: for
each address a call passes, the byte offsets it fills. ``call(stream, *addresses)`` hands these to
fastlaunch.c, a C function built on first use with the C compiler (the one Triton builds its own launchers
with; cached beside the cubins, fastsoftmax/cache.py, and loaded from a private temporary copy of the
verified entry), which copies the bytes onto its stack, writes the addresses and calls libcuda's
cuLaunchKernel (cuLaunchKernelEx for a cluster). The CUDA backend's kernels (cuda/kernels.py: one by-value
struct parameter) and the Triton kernels (triton/launch.py: the compiled kernel's cubin handle and
signature) launch through it alike, on the full path and in the eager replay (replay.py). Where there is
no C compiler (and no cached build), Triton cannot build its own launchers either: a launch raises
errors.BackendFailed naming what is missing. libcuda and the compiler are touched on first use only; ctypes
serves only the driver calls that are not launches (the current context, error names).

The replay's recording lives here too, at the lowest layer: while replay.py records a call (`start`), every
launch of the full path appends (`recorded`) the Launch it launched and, per address slot, the tensor (or
address) that filled it; `scratch` marks a workspace the call's kernels write before they read; on CPU
tensors, `recorded_call` keeps the torch call the torch backend made.
"""

from __future__ import annotations

import ctypes
import functools
import threading

_U32 = ctypes.c_uint
_PTR = ctypes.c_void_p
INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context current on this thread

_lib = []
_lib_lock = threading.Lock()


def libcuda():
    """libcuda.so.1 with the prototypes of the driver calls made here (opened once, on first use)."""
    if not _lib:
        with _lib_lock:
            if not _lib:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_PTR)]
                lib.cuCtxSetCurrent.argtypes = [_PTR]
                lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
                lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(_PTR), ctypes.c_int]
                lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                for f in (
                    lib.cuCtxGetCurrent,
                    lib.cuCtxSetCurrent,
                    lib.cuDeviceGet,
                    lib.cuDevicePrimaryCtxRetain,
                    lib.cuGetErrorName,
                ):
                    f.restype = ctypes.c_int
                _lib.append(lib)
    return _lib[0]


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    try:
        if libcuda().cuGetErrorName(code, ctypes.byref(name)) != 0 or not name.value:
            return f"CUresult {code}"
    except OSError:  # no driver library
        return f"CUresult {code}"
    return name.value.decode()


MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS = 64, 1024, 16, 32  # fastlaunch.c's (shard_apply: 10 addresses)


class Desc(ctypes.Structure):
    """fastlaunch.c's Desc, field for field."""

    _fields_ = [
        ("function", ctypes.c_uint64),
        ("grid", _U32 * 3),
        ("block", _U32),
        ("smem", _U32),
        ("cluster", _U32),
        ("n_params", _U32),
        ("n_bytes", _U32),
        ("n_slots", _U32),
        ("n_fills", _U32),
        ("offsets", _U32 * MAX_PARAMS),
        ("fill_offset", _U32 * MAX_FILLS),
        ("fill_slot", _U32 * MAX_FILLS),
        ("bytes", ctypes.c_char * MAX_BYTES),
    ]


def _layout(params) -> tuple[list[int], int]:
    """Each parameter's offset, at its type's alignment as the compiler lays out a parameter list, and the
    end of the last one."""
    offsets, end = [], 0
    for t, _ in params:
        end = -(-end // ctypes.alignment(t)) * ctypes.alignment(t)
        offsets.append(end)
        end += ctypes.sizeof(t)
    return offsets, end


def pack(params) -> tuple[bytes, list[int]]:
    """The bytes of a kernel's parameters ``params`` ((ctypes type, value) pairs; a Structure value is copied
    whole), laid out by _layout: (bytes, offsets)."""
    offsets, end = _layout(params)
    buf = (ctypes.c_char * max(end, 8))()
    for (t, v), off in zip(params, offsets, strict=True):
        if isinstance(v, ctypes.Structure):
            ctypes.memmove(ctypes.addressof(buf) + off, ctypes.addressof(v), ctypes.sizeof(v))
        else:
            t.from_buffer(buf, off).value = v
    return bytes(buf), offsets


def problem(params, slots) -> str | None:
    """Why a Desc cannot hold these parameters and address slots (None: it can). ``slots``: per address, a
    list of (parameter index, byte offset in that parameter) it fills, 8 bytes each."""
    offsets, end = _layout(params)
    if len(params) > MAX_PARAMS or end > MAX_BYTES:
        return f"{len(params)} parameters of {end} bytes (a Desc holds {MAX_PARAMS}, of {MAX_BYTES} bytes)"
    places = sum(map(len, slots))
    if len(slots) > MAX_ADDRESSES or places > MAX_FILLS:
        return f"{len(slots)} addresses filling {places} places (a Desc holds {MAX_ADDRESSES}, filling {MAX_FILLS})"
    for fills in slots:
        for i, off in fills:
            if not 0 <= i < len(params) or off < 0 or off + 8 > ctypes.sizeof(params[i][0]):
                return f"an address slot at parameter {i}, byte {off}, outside the parameter"
    return None


class Launch:
    """One kernel launch, prepared: ``params`` is the kernel's parameter list as (ctypes type, value) pairs
    (a ctypes.Structure instance is one parameter, passed by value); ``slots`` lists, per address the call
    passes, where it goes: [(parameter index, byte offset in it), ...]. ``call(stream, *addresses)`` launches
    with exactly len(slots) addresses and returns the CUresult (0: launched). Raises errors.BackendFailed
    where fastlaunch.c cannot be built, ValueError where a Desc cannot hold the launch."""

    def __init__(
        self, function: int, grid: tuple[int, int, int], block: int, smem: int, cluster: int, params, slots=()
    ):
        if why := problem(params, slots):
            raise ValueError(f"more than a Desc holds: {why}")
        raw, offsets = pack(params)
        self.fills = [[offsets[i] + off for i, off in fills] for fills in slots]  # per slot, byte offsets
        self._build(function, tuple(grid), block, smem, cluster, offsets, raw)

    def _build(self, function, grid, block, smem, cluster, offsets, raw):
        self.function, self.grid, self.block, self.smem, self.cluster = function, grid, block, smem, cluster
        self.offsets, self.raw = offsets, raw
        fills = [(off, k) for k, offs in enumerate(self.fills) for off in offs]
        d = self.desc = Desc(
            function=function,
            block=block,
            smem=smem,
            cluster=cluster,
            n_params=len(offsets),
            n_bytes=len(raw),
            n_slots=len(self.fills),
            n_fills=len(fills),
        )
        d.grid[:] = list(grid)
        d.offsets[: len(offsets)] = offsets
        d.fill_offset[: len(fills)] = [off for off, _ in fills]
        d.fill_slot[: len(fills)] = [k for _, k in fills]
        ctypes.memmove(ctypes.addressof(d) + Desc.bytes.offset, raw, len(raw))
        self.call = functools.partial(native().launch, ctypes.addressof(d))
        self.call.desc = d  # the call holds what its address points to: a caller may keep only the call

    @property
    def n_slots(self) -> int:
        return len(self.fills)

    def regroup(self, groups) -> Launch:
        """This launch with its address slots merged: ``groups`` lists, per new slot, the old slots whose
        places it fills (an empty list: a slot that fills nothing); an old slot in no group keeps null
        (0) in its places."""
        raw = bytearray(self.raw)
        for k, offs in enumerate(self.fills):
            if not any(k in g for g in groups):
                for off in offs:
                    raw[off : off + 8] = bytes(8)
        new = Launch.__new__(Launch)
        new.fills = [[off for k in g for off in self.fills[k]] for g in groups]
        if len(new.fills) > MAX_ADDRESSES or sum(map(len, new.fills)) > MAX_FILLS:
            raise ValueError("more address slots than a Desc holds")
        new._build(self.function, self.grid, self.block, self.smem, self.cluster, self.offsets, bytes(raw))
        return new


# The full path's launch is three steps in the launching frame (triton/launch.py, cuda/kernels.py), so that
# no frame stands between the kernel module and the driver: code = ln.call(stream, *addresses); retry() where
# that is not 0; recorded() once it launched.


def retry(ln: Launch, code: int, stream: int, addresses, index: int, what: str) -> None:
    """After a launch of ``ln`` returned ``code`` (not 0): where this thread had no current context, make
    device ``index``'s primary context current and launch once more; raise errors.BackendFailed, naming
    ``what`` and the driver's error, where that fails too or the error was another."""
    if code == INVALID_CONTEXT:
        ensure_context(index)
        code = ln.call(stream, *addresses)
    if code != 0:
        from ..core.errors import BackendFailed

        raise BackendFailed(f"{what} failed: {error_name(code)}")


def recorded(ln: Launch, values) -> None:
    """Append a launch that succeeded (``values``: what filled each address slot: a tensor, an integer
    address, or None) to this thread's recording, when one is open."""
    rec = getattr(_state, "rec", None)
    if rec is not None:  # recorded once launched: a failed launch is never replayed
        rec.launches.append((ln, tuple(values)))


def raw_stream():
    """torch's current stream of a device as its raw handle, a function of the device index: what Triton's own
    launchers call (torch._C._cuda_getCurrentRawStream, in CUDA builds of torch only). Every launch of both
    backends takes its stream from it (a replay binds it once)."""
    import torch

    f = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if f is None:
        from ..core.errors import BackendFailed

        raise BackendFailed(f"this torch ({torch.__version__}) is not built with CUDA")
    return f


_launches: dict = {}
MAX_LAUNCHES = 4096


def cached(key, make) -> Launch:
    """The Launch stored under ``key``, else ``make()`` stored there (a bounded cache: the full paths keep
    their prepared launches in it, keyed by what determines the launch's bytes other than its addresses)."""
    ln = _launches.get(key)
    if ln is None:
        ln = make()
        if len(_launches) >= MAX_LAUNCHES:
            _launches.clear()
        _launches[key] = ln
    return ln


# ---- recording, for the eager replay (replay.py) -----------------------------------------------------

_state = threading.local()


class Recording:
    def __init__(self):
        self.launches = []  # (Launch, the value that filled each address slot)
        self.scratch = {}  # data_ptr -> (numel, dtype): workspaces (scratch())
        self.ok = True  # False: the call launched something that was not recorded (not replayable)
        self.call = None  # (fn, args, swap): the torch call a CPU tensor's call made (recorded_call())
        self.forces = None  # heuristics.forces_opened() as the call began (replay.py's start and store)


def recording() -> Recording | None:
    return getattr(_state, "rec", None)


def start() -> Recording:
    """Record this thread's launches until abort()."""
    rec = _state.rec = Recording()
    return rec


def abort() -> None:
    """Stop recording (the recording, if any, is left to whoever holds it)."""
    _state.rec = None


def unrecorded() -> None:
    """A launch the recording cannot replay (Triton's own) happened: the call is not replayable."""
    rec = getattr(_state, "rec", None)
    if rec is not None:
        rec.ok = False


def recorded_call(fn, args: tuple, swap: bool = False) -> None:
    """The torch call a call on CPU tensors made (the torch backend's native path: no launch), which the
    replay can make again: fn(*inputs, *args), the replay's two inputs swapped where ``swap``."""
    rec = getattr(_state, "rec", None)
    if rec is not None:
        rec.call = (fn, args, swap)


def scratch(t):
    """Mark tensor t as a workspace the kernels write before they read it: a replay allocates a new one."""
    rec = getattr(_state, "rec", None)
    if rec is not None:
        rec.scratch[t.data_ptr()] = (t.numel(), t.dtype)
    return t


_runtime_knobs: list = []


def hooks_idle() -> bool:
    """No launch hooks registered with Triton (a profiler's hooks must see every launch: then Triton's own
    launch runs, triton/launch.py, and nothing is replayed)."""
    if not _runtime_knobs:
        from triton import knobs

        _runtime_knobs.append(knobs.runtime)
    r = _runtime_knobs[0]
    a, b = r.launch_enter_hook, r.launch_exit_hook  # HookChains (a plain callable counts as registered)
    return (a is None or not getattr(a, "calls", True)) and (b is None or not getattr(b, "calls", True))


# ---- fastlaunch.c ----------------------------------------------------------------------------------------

_native_mod: list = []  # [the module] once built and loaded, or [the BackendFailed that says why not]


def native():
    """fastlaunch (fastlaunch.c built or loaded from the cache once); raises errors.BackendFailed, the same
    each time, where it cannot be."""
    if not _native_mod:
        with _lib_lock:
            if not _native_mod:
                from ..core.errors import BackendFailed

                try:
                    _native_mod.append(_load_native())
                except BackendFailed as e:
                    _native_mod.append(e)
                except Exception as e:  # the compiler's or the loader's failure, named
                    _native_mod.append(
                        BackendFailed(
                            f"fastlaunch.c, fastsoftmax's kernel launcher, cannot be built or loaded here: {e}"
                        )
                    )
    mod = _native_mod[0]
    if isinstance(mod, Exception):
        raise mod
    return mod


def describe() -> str:
    """How kernels (and replays) are launched here, for fs.info() (builds nothing)."""
    if not _native_mod:
        return "fastlaunch.c (built on first launch)"
    mod = _native_mod[0]
    if isinstance(mod, Exception):
        return f"unavailable ({mod})"
    return "fastlaunch.c"


def native_entry() -> str:
    """The cache entry name of fastlaunch.c built for this Python (its sources, ABI and the cache format)."""
    import hashlib
    import sysconfig
    from pathlib import Path

    from .. import cache

    code = Path(__file__).with_name("fastlaunch.c").read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return f"fastlaunch-{hashlib.sha256(code + suffix.encode() + bytes([cache.FORMAT])).hexdigest()[:16]}{suffix}"


def compiler() -> tuple[list[str] | None, str | None]:
    """(the C compiler's command, the directory of Python.h) fastlaunch.c is built with: $CC (a command, its
    flags included) where set, else cc or gcc on PATH; None for either not found."""
    import os
    import shlex
    import shutil
    import sysconfig
    from pathlib import Path

    cc = shlex.split(os.environ.get("CC", ""))
    path = shutil.which(cc[0]) if cc else shutil.which("cc") or shutil.which("gcc")
    include = sysconfig.get_paths().get("include")
    return ([path, *cc[1:]] if path else None), (include if include and Path(include, "Python.h").exists() else None)


def _load_native():
    """fastlaunch: the verified cache entry loaded where there is one, else fastlaunch.c compiled (and
    stored); raises errors.BackendFailed when neither can be had."""
    from pathlib import Path

    from ..core.errors import BackendFailed

    def command(so):
        cc, include = compiler()
        if cc is None or include is None:
            missing = "a C compiler (cc or gcc on PATH, or $CC)" if cc is None else "Python's headers (Python.h)"
            raise BackendFailed(
                f"fastsoftmax launches its kernels through fastlaunch.c, which needs {missing} to be built once "
                "(Triton needs the same to build its own launchers); install one (e.g. gcc and the python3-dev "
                "package)"
            )
        return [*cc, "-O2", "-shared", "-fPIC", f"-I{include}", str(Path(__file__).with_name("fastlaunch.c")),
                "-o", str(so), "-ldl"]  # fmt: skip

    return load_built(native_entry(), "fastlaunch", command, _checked, "fastlaunch.c, fastsoftmax's kernel launcher")


def load_built(name: str, module: str, command, check, what: str, timeout: int = 120):
    """Extension module ``module``: the verified cache entry ``name`` loaded (from a private temporary copy)
    where there is one, else built by the command ``command(path)`` returns and stored; ``check(module)``
    returns it or raises. Raises errors.BackendFailed when neither can be had."""
    import subprocess
    import tempfile
    import warnings
    from pathlib import Path

    from .. import cache
    from ..core.errors import BackendFailed

    data = cache.load(name)
    with tempfile.TemporaryDirectory(prefix="fastsoftmax-") as tmp:  # mode 0700: nobody else writes here
        so = Path(tmp, name)
        if data is not None:  # the verified entry's bytes, loaded from a file only this process wrote
            so.write_bytes(data)
            try:
                return check(_import(so, module))
            except Exception as e:  # an entry this interpreter cannot load: built again below
                warnings.warn(
                    f"fastsoftmax: the cached {name} did not load ({e}); rebuilding it", RuntimeWarning, stacklevel=4
                )
                cache.forget(name)
                so = Path(tmp, "rebuilt-" + name)
        cmd = command(so)
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise BackendFailed(f"{what} did not compile with {cmd[0]}: {(out.stderr or out.stdout).strip()[-2000:]}")
        mod = check(_import(so, module))
        cache.store(name, so.read_bytes())
    return mod


def _import(so, module: str):
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(module, str(so))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(module, loader))
    loader.exec_module(mod)
    return mod


def _checked(mod):
    """mod, when its Desc is launch.Desc (never launch from bytes the C side reads otherwise)."""
    if mod.desc_size() != ctypes.sizeof(Desc) or mod.limits() != (MAX_PARAMS, MAX_BYTES, MAX_ADDRESSES, MAX_FILLS):
        raise RuntimeError(f"its Desc ({mod.desc_size()} bytes, limits {mod.limits()}) is not launch.Desc's")
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
