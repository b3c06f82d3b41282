"""Compile softmax.cu with NVRTC (cuda-python's cuda.bindings.nvrtc), cached in memory and on disk.

Output is a cubin for the GPU's exact architecture (sm_90a on an H100/H200), never PTX for the driver to
JIT: NVRTC writes PTX in its own ISA version (NVRTC 13.5: ISA 9.5) and a driver older than that NVRTC
rejects it, while a cubin from any NVRTC of the driver's CUDA major version loads (CUDA minor-version
compatibility; checked: NVRTC 13.5 cubins on driver 580, bench/results/investigations/cubin_compat.json). A
driver of an older major version than NVRTC (say driver 12.x with NVRTC 13) cannot load either, and the
launch error says so. PTX is produced only for reading (``fastsoftmax asm``).

Cache key: sha256 of the source, the NVRTC version, the target, the -D configuration and the options.
Disk cache: fastsoftmax/cache.py (private to the user, atomic, verified; a refused entry is compiled again).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from importlib import resources

from ... import cache

OPTIONS = ("--std=c++17", "-Xptxas=-v")  # no -use_fast_math: exp is __expf by choice, division is IEEE
FAST_MATH = False

KINDS = {"fwd": 1, "bwd": 2, "fwd3": 3, "bwd3": 4}
ENTRY = {"fwd": "fs_fwd", "bwd": "fs_bwd", "fwd3": "fs_fwd3", "bwd3": "fs_bwd3"}
TYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}


class CompileError(RuntimeError):
    """NVRTC rejected the source; the message carries the compiler log."""


@dataclass(frozen=True)
class Config:
    """One compiled kernel: softmax.cu's -D configuration (see the header of softmax.cu)."""

    kind: str  # fwd, bwd, fwd3, bwd3
    in_t: str  # x (forward) or y (backward): float32, bfloat16, float16
    out_t: str
    d_t: str = "float32"  # dy (backward)
    group: int = 256
    rows: int = 1
    cluster: int = 1
    k: int = 1
    online: bool = False  # the two-pass variant (any length)
    staged: bool = False
    min_ctas: int = 0  # CTAs per SM ptxas must fit (registers); 0: softmax.cu's rule (512 threads per SM)

    def defines(self) -> dict[str, int]:
        return {
            "FS_KIND": KINDS[self.kind],
            "IN_T": TYPE_CODES[self.in_t],
            "OUT_T": TYPE_CODES[self.out_t],
            "D_T": TYPE_CODES[self.d_t],
            "GROUP": self.group,
            "ROWS": self.rows,
            "CLUSTER": self.cluster,
            "K": self.k,
            "ONLINE": int(self.online),
            "STAGED": int(self.staged),
            **({"MIN_CTAS_SET": self.min_ctas} if self.min_ctas else {}),
        }

    @property
    def entry(self) -> str:
        return ENTRY[self.kind]

    def entry_for(self, log: bool) -> str:
        """The kernel's name for softmax or log_softmax: the forwards and backwards of FS_KIND 1 and 2 have
        one entry point each (fs_fwd, fs_fwd_log, fs_bwd, fs_bwd_log); the seed kernels read the flag from
        their parameters."""
        return self.entry + "_log" if log and self.kind in ("fwd", "bwd") else self.entry


@dataclass(frozen=True)
class Compiled:
    binary: bytes  # cubin, or PTX text as bytes
    log: str  # NVRTC's log, with ptxas -v lines (registers, spills) when compiled to a cubin
    key: str
    from_disk: bool = False  # read from the disk cache (not compiled by this process)


def source() -> bytes:
    return resources.files(__package__).joinpath("softmax.cu").read_bytes()


def nvrtc():
    """cuda.bindings.nvrtc, or an ImportError that says what to install."""
    try:
        from cuda.bindings import nvrtc as mod
    except ImportError as e:
        raise ImportError(
            f"the CUDA backend needs cuda-python's bindings and NVRTC ({e}): the extras of "
            "pip install 'fastsoftmax[cu13]' (or [cu12])"
        ) from e
    return mod


def nvrtc_version() -> tuple[int, int]:
    err, major, minor = nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def _check(err, what: str, log: str = ""):
    if int(err) != 0:
        raise CompileError(f"{what} failed: {err}" + (f"\n{log}" if log else ""))


_memory: dict[str, Compiled] = {}
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def compile_kernel(cfg: Config, arch: str, output: str = "cubin", fresh: bool = False) -> Compiled:
    """The cubin (``output="cubin"``) or PTX of ``cfg`` for ``arch`` (e.g. "sm_90a"), from the memory
    cache, the disk cache, or NVRTC, in that order; ``fresh``: from NVRTC (replacing both caches' entries:
    a cached cubin the driver could not load)."""
    if output not in ("cubin", "ptx"):
        raise ValueError(f"output must be 'cubin' or 'ptx', got {output!r}")
    src = source()
    opts = [f"--gpu-architecture={arch}", *OPTIONS, *(f"-D{k}={v}" for k, v in sorted(cfg.defines().items()))]
    ident = repr((nvrtc_version(), output, opts, cache.FORMAT)).encode()
    key = hashlib.sha256(src + b"\0" + ident).hexdigest()[:32]
    hit = None if fresh else _memory.get(key)
    if hit is not None:
        return hit
    with _guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        hit = None if fresh else _memory.get(key)
        if hit is None:
            hit = (None if fresh else _load_disk(key, output)) or _store_disk(_nvrtc(src, opts, output, key), output)
            _memory[key] = hit
    return hit


def _read(get, prog, size: int) -> bytes:
    """What NVRTC writes through ``get(prog, buffer)`` into a buffer of ``size`` bytes, as bytes: a fresh
    mutable buffer each time. (Never an immutable object: ``b" " * size`` is CPython's shared one-byte
    object for size 1, an empty log, and NVRTC's terminating NUL would overwrite it.)"""
    buf = bytearray(max(size, 1))
    _check(get(prog, buf)[0], get.__name__)
    return bytes(buf[:size])


def _nvrtc(src: bytes, opts: list[str], output: str, key: str) -> Compiled:
    mod = nvrtc()
    err, prog = mod.nvrtcCreateProgram(src, b"softmax.cu", 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = mod.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        e2, size = mod.nvrtcGetProgramLogSize(prog)
        _check(e2, "nvrtcGetProgramLogSize")
        log = _read(mod.nvrtcGetProgramLog, prog, size).rstrip(b"\0 ").decode(errors="replace")
        _check(err, f"NVRTC compile of softmax.cu with {' '.join(opts)}", log)
        if output == "cubin":
            e2, size = mod.nvrtcGetCUBINSize(prog)
            _check(e2, "nvrtcGetCUBINSize")
            out = _read(mod.nvrtcGetCUBIN, prog, size)
        else:
            e2, size = mod.nvrtcGetPTXSize(prog)
            _check(e2, "nvrtcGetPTXSize")
            out = _read(mod.nvrtcGetPTX, prog, size).rstrip(b"\0")
        return Compiled(out, log, key)
    finally:
        mod.nvrtcDestroyProgram(prog)


def _load_disk(key: str, output: str) -> Compiled | None:
    log, binary = cache.load(f"{key}.log"), cache.load(f"{key}.{output}")
    if log is None or binary is None:
        return None
    return Compiled(binary, log.decode(errors="replace"), key, from_disk=True)


def _store_disk(c: Compiled, output: str) -> Compiled:
    """The log first: the binary's entry marks the pair complete."""
    if cache.store(f"{c.key}.log", c.log.encode()) is not None:
        cache.store(f"{c.key}.{output}", c.binary)
    return c


def ptxas_facts(log: str) -> dict:
    """Registers, spills and stack frame from the ptxas -v lines of an NVRTC log."""
    from ...ptxas import facts

    return facts(log)
