"""Launch preparation shared by every Triton kernel family: the heuristics table's shape (or the test
overrides), 16-byte vector plan, 32/64-bit index choice, grid, split segments.

The kernels all take the same leading arguments: an anchor input ``x`` (forward: x; backward: y) and an
output, rows (b, i) x N with strides from layout.py; see rows.row_geometry."""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from ... import heuristics
from ...core.errors import BackendFailed
from ...core.layout import Layout
from ...heuristics import device
from ...heuristics import softmax_triton as rules
from .. import launch as fastlaunch

_INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (triton.cdiv is a JIT function: ~6 us per call from Python)."""
    return -(-a // b)


def vector_plan(elsize: int, x_addr: int, y_addr: int, lay: Layout) -> tuple[int, bool, bool, int]:
    """(VEC, EDGES, Y_VEC, x_mis) for x and y at these addresses: 16-byte vectors along contiguous rows;
    the edge code when some row is not 16-byte aligned and rows are long enough (>= 4 vectors) to gain.
    x_mis: elements from the 16-byte boundary below x's first element to it.

    Without edges, the JIT's divisibility-by-16 specialisation of n and the strides proves alignment."""
    (sxb, sxn, sxi), (syb, _, syi), n = lay.sx, lay.sy, lay.N
    if sxn != 1 or n < 2:
        return 1, False, False, 0
    vec = 16 // elsize
    if x_addr % 16 == 0 and y_addr % 16 == 0 and not (n % 16 or sxb % 16 or sxi % 16 or syb % 16 or syi % 16):
        return vec, False, False, 0
    if n < 4 * vec:
        return 1, False, False, 0
    x_mis = (x_addr // elsize) % vec
    y_vec = y_addr % 16 == 0 and not x_mis and (sxb - syb) % vec == 0 and (sxi - syi) % vec == 0
    return vec, True, y_vec, x_mis


def aligned_view(t: torch.Tensor, mis: int) -> torch.Tensor:
    """A view of t's storage starting ``mis`` elements before t: the 16-byte boundary the kernels address
    t from when its first element is not aligned."""
    return t.as_strided((1,), (1,), t.storage_offset() - mis) if mis else t


@dataclass(frozen=True)
class LaunchArgs:
    plan: heuristics.Plan
    x_arg: torch.Tensor  # the anchor input as passed to the kernel (aligned_view when x_mis)
    x_mis: int
    grid: tuple
    rows_args: tuple  # (B, N, I, tiles_i)
    strides: tuple  # (sxb, sxn, sxi, syb, syn, syi)
    flags: dict  # ROWS, BLOCK_N, VEC, INNER, EDGES, IDX64
    y_vec: bool
    chunks_per_split: int
    n_rows: int


def prepare(x: torch.Tensor, y: torch.Tensor, lay: Layout, inputs: int = 1, path: str | None = None) -> LaunchArgs:
    """Everything a launch needs for anchor x and output y in layout ``lay``; records the plan. ``path``:
    the tuning table's choice (heuristics.force overrides it). The plan is a pure function of the layout,
    the addresses modulo 16 and the overrides, and is cached on them (the host cost of a call matters)."""
    overrides = heuristics.forced() or {}
    if path is not None and "path" not in overrides:
        overrides = {**overrides, "path": path}
    x_mod = x.data_ptr() % 16
    st = x.untyped_storage().data_ptr() % 16 if x_mod else 0  # matters only for a misaligned x
    plan, x_mis, grid, rows_args, flags, y_vec, chunks = _plan(
        lay,
        x.element_size(),
        device.of_tensor(x).sm_count,
        inputs,
        tuple(sorted(overrides.items())),
        x_mod,
        y.data_ptr() % 16,
        st,
    )
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    return LaunchArgs(
        plan=heuristics.record(plan),
        x_arg=aligned_view(x, x_mis),
        x_mis=x_mis,
        grid=grid,
        rows_args=rows_args,
        strides=(sxb, sxn, sxi, syb, syn, syi),
        flags=flags,
        y_vec=y_vec,
        chunks_per_split=chunks,
        n_rows=lay.B * lay.I,
    )


@functools.lru_cache(maxsize=4096)
def _plan(lay: Layout, elsize: int, sms: int, inputs: int, overrides: tuple, x_mod: int, y_mod: int, st: int):
    overrides = dict(overrides)
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    n, inner, n_rows = lay.N, lay.I > 1, lay.B * lay.I
    rows_contiguous = (sxi == 1) if inner else (sxb == 1 and sxn != 1)
    if overrides.get("path", "rowblock") not in heuristics.PATHS:
        raise ValueError(
            f"the Triton backend has no path {overrides['path']!r}; its paths: {', '.join(heuristics.PATHS)}"
        )
    vec, edges, y_vec, x_mis = vector_plan(elsize, x_mod, y_mod, lay)
    if x_mis and st:
        vec, edges, y_vec, x_mis = 1, False, False, 0  # the storage itself is unaligned: scalar code
    shape = rules.launch_shape(n, n_rows, elsize, rows_contiguous, sms, overrides.get("path"), inputs, vec)
    path, block, rows, warps, splits = (overrides.get(k, v) for k, v in zip(shape._fields, shape, strict=True))
    if "block_n" in overrides and "splits" not in overrides:
        splits = rules.split_count(n, block, n_rows, sms, path)
    if path == "rowblock" and block < (body := rules.row_body(n, vec)):  # (the edge code holds the rest)
        raise ValueError(f"rowblock needs block_n >= N's aligned body ({body} of N={n}); got {block}")
    # Offsets within a program are 32-bit unless its rows and columns could reach 2^31 elements.
    row_stride = max(abs(sxi), abs(syi)) if inner else max(abs(sxb), abs(syb))
    idx64 = rows * row_stride + max(abs(sxn), abs(syn)) * (n + block) + 16 > _INT32_MAX
    tiles_i = _cdiv(lay.I, rows) if inner else 1
    grid = lay.B * tiles_i if inner else _cdiv(lay.B, rows)
    if grid > _INT32_MAX:
        raise ValueError(f"too many rows for one launch ({n_rows})")
    chunks_per_split = _cdiv(_cdiv(n, block), splits)
    splits = _cdiv(_cdiv(n, block), chunks_per_split)  # no empty segments
    plan = heuristics.Plan("triton", path, block, rows, warps, vec, edges, inner, lay.copied, splits)
    flags = dict(ROWS=rows, BLOCK_N=block, VEC=vec, INNER=inner, EDGES=edges, IDX64=idx64)
    grid = (grid, splits) if path == "split" else (grid,)
    return plan, x_mis, grid, (lay.B, n, lay.I, tiles_i), flags, y_vec, chunks_per_split


# ---- the launch itself -----------------------------------------------------------------------------------
# On CUDA tensors a kernel launches through fastsoftmax's own prepared launch (fastsoftmax/launch.py, the
# CUDA backend's too): Triton compiles (or finds) the kernel for these arguments without launching it
# (JITFunction.run(..., warmup=True), the same in Triton 3.6 to 3.9), its CompiledKernel's cubin handle and
# signature become a launch.Launch (built once per kernel, grid and non-pointer values), called with the
# tensors' addresses on torch's current stream. Triton's own launcher is used in two cases only: under its
# interpreter (CPU tensors: not a GPU launch), and while launch hooks are registered with Triton
# (triton.knobs.runtime.launch_enter_hook / launch_exit_hook, what profilers such as proton register:
# they must see every launch). A compiled kernel that needs what launch.py does not make (Triton's global or
# profile scratch buffers, TMA descriptors, clusters (num_ctas > 1), a cooperative grid, programmatic
# dependent launch, GSan's arguments, or a scalar type not packed here) raises errors.BackendFailed at its
# first launch; none of fastsoftmax's kernels needs any of them.

# Triton signature types -> the ctypes storage of the parameter. Integers narrower than 32 bits are stored in
# 32 bits (sign- or zero-extended): the driver reads a parameter's declared size from the start of its
# storage, little-endian, so this is right whether the kernel declares an i1 as 8 bits (Triton 3.6's
# launcher passes int8_t) or 32 (Triton 3.8 and 3.9 pass int32_t).
_SCALARS = {
    "i1": ctypes.c_int32,
    "i8": ctypes.c_int32,
    "i16": ctypes.c_int32,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u1": ctypes.c_uint32,
    "u8": ctypes.c_uint32,
    "u16": ctypes.c_uint32,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "f32": ctypes.c_float,
    "fp64": ctypes.c_double,
}
_FLOATS = ("fp32", "f32", "fp64")
_MAX_SHARED = 228 * 1024  # above it Triton's launcher adds an attribute (oversized shared memory) launch.py does not


class KernelPlan:
    """How one CompiledKernel's launches are made: its runtime parameters (name, default, signature type, in
    order; constexprs dropped), which of them are pointers (address slots), which are scalars, the trailing
    scratch pointers Triton's launcher appends (null: none is needed), the block and shared memory."""

    def __init__(self, ck, names, defaults):
        name = getattr(ck, "name", None) or getattr(getattr(ck, "metadata", None), "name", "?")
        self.what = f"the Triton kernel {name}'s launch"
        md = ck.metadata
        sig = getattr(getattr(ck, "src", None), "signature", None)

        def refuse(why):
            raise BackendFailed(
                f"the Triton kernel {name} {why}, which fastsoftmax's launcher (fastsoftmax/launch.py) "
                "does not make; only launches through it are supported"
            )

        if not isinstance(sig, dict) or len(sig) != len(names):
            refuse(f"has a signature ({sig!r}) that is not one type per argument ({len(names)})")
        ctas = getattr(md, "num_ctas", None)
        if ctas is None:  # Triton before 3.4: the cluster's shape
            ctas = 1
            for c in getattr(md, "cluster_dims", ()) or ():
                ctas *= c
        if ctas != 1:
            refuse(f"launches clusters of {ctas} CTAs (num_ctas > 1)")
        if getattr(md, "launch_cooperative_grid", False):
            refuse("needs a cooperative grid")
        if getattr(md, "launch_pdl", False):
            refuse("needs programmatic dependent launch (launch_pdl)")
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            refuse(
                f"needs a global or profile scratch buffer ({getattr(md, 'global_scratch_size', 0)}, "
                f"{getattr(md, 'profile_scratch_size', 0)} bytes per program)"
            )
        if getattr(md, "tensordesc_meta", None):
            refuse("takes TMA descriptors")
        if "gsan" in str(getattr(md, "instrumentation_mode", "") or ""):
            refuse("is instrumented by GSan (extra launch arguments)")
        if md.shared > _MAX_SHARED:
            refuse(f"needs {md.shared} bytes of shared memory (oversized shared memory)")
        self.runtime = []  # (index, name, default) of each runtime argument, in the kernel's order
        self.types = []
        for i, (ty, n, dflt) in enumerate(zip(sig.values(), names, defaults, strict=True)):
            if ty == "constexpr":
                continue
            if not isinstance(ty, str):
                refuse(f"takes a tuple argument {n} ({ty})")
            if ty.startswith(("tensordesc", "nvTmaDesc")):
                refuse(f"takes TMA descriptors ({n}: {ty})")
            if not ty.startswith("*") and ty not in _SCALARS:
                refuse(f"takes an argument {n} of type {ty}")
            self.runtime.append((i, n, dflt))
            self.types.append(ty)
        self.pointers = [k for k, ty in enumerate(self.types) if ty.startswith("*")]
        self.scalars = [k for k, ty in enumerate(self.types) if not ty.startswith("*")]
        self.floats = [k for k, ty in enumerate(self.types) if ty in _FLOATS]
        # Triton's launchers append a global scratch pointer (since 3.2) and a profile scratch pointer (since
        # 3.5) to every kernel's arguments; the metadata names the buffers its launcher passes.
        self.trailing = sum(hasattr(md, f) for f in ("global_scratch_size", "profile_scratch_size"))
        params, _ = self.params([0] * len(self.types))
        if why := fastlaunch.problem(params, [[(k, 0)] for k in self.pointers]):
            refuse(f"has more arguments than a prepared launch holds ({why})")
        if getattr(ck, "function", None) is None:
            ck._init_handles()  # the cubin loaded into this device's context (Triton raises OutOfResources here)
        self.function = int(ck.function)
        self.block = 32 * md.num_warps
        self.smem = md.shared

    def params(self, values):
        """The kernel's parameter list for these runtime values (pointers null: address slots) and the slots."""
        params, slots = [], []
        for ty, v in zip(self.types, values, strict=True):
            if ty.startswith("*"):
                slots.append([(len(params), 0)])
                params.append((ctypes.c_uint64, 0))
            else:
                params.append((_SCALARS[ty], float(v) if ty in _FLOATS else int(v)))
        params += [(ctypes.c_uint64, 0)] * self.trailing
        return params, slots

    def launch(self, grid: tuple, values) -> fastlaunch.Launch:
        params, slots = self.params(values)
        g = tuple(grid) + (1,) * (3 - len(grid))
        return fastlaunch.Launch(self.function, g, self.block, self.smem, 1, params, slots)


_plans: dict = {}  # CompiledKernel -> its KernelPlan (CompiledKernels live as long as Triton's caches)


def kernel_plan(kernel, ck) -> KernelPlan:
    plan = _plans.get(ck)
    if plan is None:
        params = getattr(kernel, "params", None)
        defaults = [p.default if p.has_default else None for p in params] if params else [None] * len(kernel.arg_names)
        plan = _plans[ck] = KernelPlan(ck, kernel.arg_names, defaults)
    return plan


_I32, _I64 = 2**31, 2**63


def specs(kernel, device: int, args: tuple, kwargs: dict) -> tuple:
    """The key compiled() looks a kernel up under: the kernel, the device, the keyword arguments (constexprs
    and options) and what Triton may specialise on for each argument value, and more: a tensor's dtype and
    16-byte alignment; an int's == 1, divisibility by 16 and 32/64-bit range; a float's type (Triton
    specialises none); anything else (bool, None, a constexpr value) exactly. One loop, no frame an argument:
    every launch off the replay makes it."""
    key = [kernel, device]
    for k, v in kwargs.items():
        key.append((k, (v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor) else v))
    for v in args:
        t = type(v)
        if t is int:
            key.append((v == 1, v % 16 == 0, -_I32 <= v < _I32, v < _I64))
        elif t is float:
            key.append(float)
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        else:
            key.append((t, v))
    return tuple(key)


_compiled: dict = {}  # specs() -> CompiledKernel
MAX_COMPILED = 4096


def compiled(kernel, grid: tuple, args: tuple, kwargs: dict, device: int):
    """The CompiledKernel Triton would launch for these arguments, without Triton's argument binding (about
    20 us a call on Triton 3.6): looked up under a key at least as fine as Triton's specialisation, and
    asked of Triton (kernel.run(warmup=True): compiled if need be) the first time."""
    key = specs(kernel, device, args, kwargs)
    ck = _compiled.get(key)
    if ck is None:
        ck = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if ck is not None and hasattr(ck, "result"):  # an asynchronous compile's future
            ck = ck.result()
        if ck is None:
            raise BackendFailed(f"Triton compiled no kernel for {kernel} (a jit_cache_hook skipped it)")
        if len(_compiled) >= MAX_COMPILED:
            _compiled.clear()
        _compiled[key] = ck
    return ck


def launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """kernel[grid](*args, **kwargs) on the GPU through launch.Launch (recorded for the replay (replay.py) when a
    recording is on); Triton's own launch under its interpreter and while launch hooks are registered."""
    x = args[0]
    if not x.is_cuda or not fastlaunch.hooks_idle():
        kernel[grid](*args, **kwargs)
        fastlaunch.unrecorded()  # (a replay would hide later launches from the hooks)
        return
    index = x.get_device()
    ck = compiled(kernel, grid, args, kwargs, index)
    plan = _plans.get(ck) or kernel_plan(kernel, ck)
    n = len(args)
    values = [args[i] if i < n else kwargs.get(name, d) for i, name, d in plan.runtime]
    key = (ck, grid, *[values[k] for k in plan.scalars])
    if plan.floats:  # (-0.0 == 0.0: the key tells them apart)
        key += tuple(float(values[k]).hex() for k in plan.floats)
    ln = fastlaunch.cached(key, lambda: plan.launch(grid, values))
    pointers = [values[k] for k in plan.pointers]
    addresses = [v if type(v) is int else 0 if v is None else v.data_ptr() for v in pointers]
    stream = fastlaunch.raw_stream()(index)
    if code := ln.call(stream, *addresses):  # (the launch itself, from this frame)
        fastlaunch.retry(ln, code, stream, addresses, index, plan.what)
    fastlaunch.recorded(ln, pointers)
