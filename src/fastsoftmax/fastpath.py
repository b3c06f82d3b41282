"""The eager fast path: replaying a call's launches without re-planning them.

Everything a launch depends on (the layout, the backend's and path's choice, the kernel, its grid and its
integer arguments) is a pure function of the inputs' shapes, strides, dtypes, device and addresses modulo
16, of dim, of the output dtype and of the backend asked for. So the first call with a given key runs the
full path (checks, dispatch, planning, Triton's own launch) while recording what it launched; later calls
with the same key allocate the output and launch the recorded kernels with the new tensors' addresses.
That leaves a dict lookup, an allocation and the launch itself on the host (a plain Triton launch binds and
specialises every argument again: most of a call's host time). The launch itself is prepared once
(cuda/launch.py: the kernel's argument bytes built at recording; a replay passes the stream and addresses to
fastlaunch.c, which calls libcuda's cuLaunchKernel, or where that cannot be built fills them in through
ctypes): entry kind "prepared". Where a recorded Triton launch is of a kind not built there, the replay
calls Triton's C launch function ("direct") or CompiledKernel.run ("run").

A call is recorded only when it is plain (compose.py's 'plain' route, and no autocast region): CUDA tensors
that need no autograd, no heuristics.force or test
poisoning active, no logsumexp output, inputs used in place (not copied into another layout, not addressed
from a 16-byte boundary before them), and only kernels whose launcher call is known (Triton 3.6's, the
CUDA backend's). Everything else always takes the full path. Profiler hooks registered with Triton turn
the replay off (they must see every launch). FASTSOFTMAX_FAST_LAUNCH=0 turns it off.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.autograd.forward_ad as _fwad

from . import compose, heuristics

ENABLED = os.environ.get("FASTSOFTMAX_FAST_LAUNCH", "1") != "0"
TRITON_VERSIONS = ("3.6.",)  # Triton releases whose CompiledKernel.run call below has been checked on a GPU
MAX_ENTRIES = 4096

_cache: dict = {}
_state = threading.local()
# roles of tensors in a recorded launch; ("scratch", index, numel, dtype) for the call's index-th workspace
_X, _D, _Y = "x", "d", "y"


def key(x, d, dim, dtype, log: bool, backend):
    """The cache key of a call: None when it cannot take the fast path (or the arguments are not plain:
    the full path checks them and raises). Callers have ruled out autograd and torch.compile tracing."""
    if not ENABLED or type(x) is not torch.Tensor or not x.is_cuda:
        return None
    if type(dim) is not int or not (dtype is None or isinstance(dtype, torch.dtype)) or type(backend) is not str:
        return None
    if d is not None and (type(d) is not torch.Tensor or not d.is_cuda):
        return None
    px = x.data_ptr()
    if not px:  # no storage (resized to 0 bytes): the full path raises
        return None
    k = (x.shape, x.stride(), x.dtype, x.get_device(), px % 16, dim, dtype, log, backend)
    if d is not None:
        pd = d.data_ptr()
        if not pd:
            return None
        k += (d.stride(), d.dtype, pd % 16, (pd - px) % 16, d.shape, d.get_device())
    return k


def fast(x, d, dim, dtype, log: bool, backend):
    """The public functions' first step for a call with no mask, scale or causal: the replayed output, or
    None (then the full path runs: autograd, torch.compile tracing, a call not recorded yet, anything the
    replay must not take). compose.route's checks for a plain call, autocast's and the replay's in one
    frame: a small call's host time is mostly Python calls."""
    if type(x) is not torch.Tensor or (x.requires_grad and torch.is_grad_enabled()) or _compiling():
        return None
    if _transforms() or _fwad._current_level >= 0 or _modes() or _tracing() is not None or _autocast():
        return None
    if d is not None and d.requires_grad and torch.is_grad_enabled():
        return None
    k = key(x, d, dim, dtype, log, backend)
    entry = _cache.get(k) if k is not None else None
    if entry is None or heuristics.overridden() or not hooks_idle() or torch._C._cuda_getDevice() != k[3]:
        return None
    return entry(x, d, k[3])


_compiling = torch.compiler.is_compiling
_transforms = compose._transforms_active
_modes = compose._dispatch_modes
_tracing = compose._tracing
_autocast = compose._any_autocast


# ---- recording ----------------------------------------------------------------------------------------


class _Recording:
    def __init__(self):
        self.launches = []  # (kind, handle, launch data)
        self.scratch = {}  # data_ptr -> (numel, dtype)
        self.ok = True


def recording() -> _Recording | None:
    return getattr(_state, "rec", None)


def start(k) -> _Recording | None:
    if k is None or heuristics.overridden() or len(_cache) >= MAX_ENTRIES:
        return None
    rec = _state.rec = _Recording()
    return rec


def abort() -> None:
    _state.rec = None


def scratch(t: torch.Tensor) -> torch.Tensor:
    """Mark t as a workspace the kernels write before they read it: a replay allocates a new one."""
    rec = recording()
    if rec is not None:
        rec.scratch[t.data_ptr()] = (t.numel(), t.dtype)
    return t


def triton_launched(ck, grid: tuple, args: tuple, kwargs: dict, names) -> None:
    """Record a Triton launch (ck: the CompiledKernel that kernel[grid](...) returned)."""
    rec = recording()
    if rec is None:
        return
    import triton

    if not (triton.__version__.startswith(TRITON_VERSIONS) and hasattr(ck, "packed_metadata") and names):
        rec.ok = False
        return
    if not all(n in kwargs for n in names[len(args) :]):
        rec.ok = False
        return
    vals = list(args) + [kwargs[n] for n in names[len(args) :]]
    g = tuple(grid) + (1,) * (3 - len(grid))
    rec.launches.append(("triton", ck, (g, vals)))


def cuda_launched(fn, grid: int, block: int, cluster: int, params, smem: int = 0) -> None:
    rec = recording()
    if rec is not None:
        rec.launches.append(("cuda", fn, (grid, block, cluster, params, smem)))


def finish(rec: _Recording | None, k, x, d, y, out_dtype) -> None:
    """Store the replay of the call just recorded, when every tensor it launched with has a role."""
    _state.rec = None
    if rec is None or not rec.ok or not rec.launches:
        return
    plan = heuristics.last_plan()
    if plan is None or plan.copied:
        return
    ptrs = {x.data_ptr(): _X, y.data_ptr(): _Y}
    if d is not None:
        if d.data_ptr() in ptrs:
            return  # dy aliasing y: replay would still be right, but keep such calls on the full path
        ptrs[d.data_ptr()] = _D

    def role(v: torch.Tensor):
        p = v.data_ptr()
        if p in ptrs:
            return ptrs[p]
        if p in rec.scratch:  # one workspace per recorded one: the launches that share it share its copy
            return ("scratch", list(rec.scratch).index(p), *rec.scratch[p])
        raise LookupError  # a tensor made during the call that is not a workspace: not replayable

    if y.stride() != x.stride():
        return  # x not dense: its output is laid out otherwise; keep such calls on the full path
    tensors = {_X: x, _D: d, _Y: y}
    steps = []
    try:
        for kind, handle, data in rec.launches:
            if kind == "triton":
                g, vals = data
                slots = []
                for i, v in enumerate(vals):
                    if isinstance(v, torch.Tensor):
                        r = role(v)
                        if not isinstance(r, tuple) and v.dtype != tensors[r].dtype:
                            return
                        slots.append((i, r))
                kept = [None if isinstance(v, torch.Tensor) else v for v in vals]  # hold no tensor alive
                steps.append(("triton", handle, g, kept, slots))
            else:
                grid, block, cluster, params, smem = data
                fields = {}
                for f in ("x", "y", "d", "lse"):
                    p = getattr(params, f)
                    if p:
                        if p not in ptrs:
                            return
                        fields[f] = ptrs[p]
                steps.append(("cuda", handle, (grid, block, cluster, smem), bytes(params), fields))
    except LookupError:
        return
    _cache[k] = _make_replay(steps, plan, None if out_dtype in (None, x.dtype) else out_dtype)


def _direct(ck):
    """Triton 3.6's C launch function behind ck.run and its two flags, when calling it ourselves is what
    ck.run would do: no tensor-descriptor wrapper, no global or profile scratch to allocate per launch.
    We then pass pointers as integers (ck.run, given tensors, calls data_ptr() and cuPointerGetAttribute
    on each one: the replay knows they are CUDA tensors on the current device). None otherwise."""
    launcher = ck.run
    raw = getattr(launcher, "launch", None)
    if type(launcher).__name__ != "CudaLauncher" or type(raw).__name__ != "builtin_function_or_method":
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    return raw, launcher.launch_cooperative_grid, launcher.launch_pdl


def _make_replay(steps, plan, out_dtype):
    prepared = _prepared(steps)
    if prepared is not None:
        return _make_prepared(prepared, plan, out_dtype)
    if any(s[0] == "cuda" for s in steps):
        from .cuda.kernels import _launch, _Params  # cuda-python is there: it recorded these launches
    if len(steps) == 1 and steps[0][0] == "triton" and (direct := _direct(steps[0][1])) is not None:
        _, ck, g, vals, slots = steps[0]
        if all(r in (_X, _D, _Y) for _, r in slots):  # the common case: one launch, no workspace
            return _make_direct(ck, direct, g, vals, slots, plan, out_dtype)

    def run(x, d, device):
        y = torch.empty_like(x, dtype=out_dtype)
        if y.data_ptr() % 16:
            return None  # never from torch's allocator; the recorded plan assumed an aligned output
        have = {_X: x, _D: d, _Y: y}
        stream = _raw_stream(device)
        for step in steps:
            if step[0] == "triton":
                _, ck_, g, vals, slots = step
                vals = list(vals)
                for i, r in slots:
                    if isinstance(r, tuple) and r not in have:  # a workspace, allocated once per call
                        have[r] = torch.empty(r[2], dtype=r[3], device=x.device)
                    vals[i] = have[r]
                ck_.run(g[0], g[1], g[2], stream, ck_.function, ck_.packed_metadata, None, None, None, *vals)
            else:
                _, fn, (grid, block, cluster, smem), raw, fields = step
                params = _Params.from_buffer_copy(raw)
                for f, r in fields.items():
                    setattr(params, f, have[r].data_ptr())
                _launch(fn, grid, block, cluster, params, stream, smem, device)
        heuristics.record(plan)
        return y

    run.kind = "run"
    return run


# Triton signature types -> the ctypes type of the kernel parameter (as Triton 3.6's launcher passes them)
_TRITON_CTYPES = {
    "i1": "c_int8", "i8": "c_int8", "i16": "c_int16", "i32": "c_int32", "i64": "c_int64", "u1": "c_uint8",
    "u8": "c_uint8", "u16": "c_uint16", "u32": "c_uint32", "u64": "c_uint64", "fp32": "c_float", "f32": "c_float",
    "fp64": "c_double",
}  # fmt: skip


def _prepared(steps):
    """Each recorded launch as a cuda.launch.Launch (argument bytes built once) and the workspace it takes,
    if any: [(Launch, workspace role or None)], or None when one launch is not of a kind built here (then the
    replay calls Triton's launcher or cuda-python as the full path does)."""
    import ctypes

    from .cuda import launch

    out = []
    for step in steps:
        if step[0] == "cuda":
            from .cuda.kernels import _Params

            _, fn, (grid, block, cluster, smem), raw, fields = step
            slots = [(0, getattr(_Params, f).offset, r) for f, r in fields.items()]
            args = [(_Params, _Params.from_buffer_copy(raw))]
            out.append((launch.Launch(int(fn), (grid, 1, 1), block, smem, cluster, args, slots), None))
            continue
        _, ck, g, vals, slots = step
        md = getattr(ck, "metadata", None)
        sig = getattr(getattr(ck, "src", None), "signature", None)
        if _direct(ck) is None or md is None or not isinstance(sig, dict) or len(sig) != len(vals):
            return None
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False) or md.launch_cooperative_grid:
            return None
        roles = dict(slots)
        workspaces = {r for r in roles.values() if isinstance(r, tuple)}
        if len(workspaces) > 1:
            return None
        args, fills = [], []
        for i, (ty, v) in enumerate(zip(sig.values(), vals, strict=True)):
            if ty == "constexpr":
                continue
            if not isinstance(ty, str):
                return None  # a tuple argument
            if ty.startswith("*"):
                if i in roles:
                    fills.append((len(args), 0, "ws" if isinstance(roles[i], tuple) else roles[i]))
                elif v is not None:
                    return None  # a pointer that is not one of the call's tensors
                args.append((ctypes.c_uint64, 0))
            elif ty in _TRITON_CTYPES:
                args.append((getattr(ctypes, _TRITON_CTYPES[ty]), v))
            else:
                return None
        args += [(ctypes.c_uint64, 0), (ctypes.c_uint64, 0)]  # global and profile scratch: none (_direct)
        if not launch.preparable(args, fills):
            return None
        ln = launch.Launch(ck.function, g, 32 * md.num_warps, md.shared, 1, args, fills)
        out.append((ln, workspaces.pop() if workspaces else None))
    return out


def _make_prepared(prepared, plan, out_dtype):
    """The replay through prepared launches (cuda/launch.py): per call an allocation (and a workspace where
    the launches take one) and one call per launch with the addresses. A failed launch (this thread has no
    current context, or anything else) returns None: the full path runs and reports."""
    record = heuristics.record
    empty_like = torch.empty_like
    get_stream = torch._C._cuda_getCurrentRawStream
    if len(prepared) == 1 and prepared[0][1] is None:  # the common case: one launch, no workspace
        call = prepared[0][0].call

        def run(x, d, device):
            y = empty_like(x) if out_dtype is None else empty_like(x, dtype=out_dtype)  # no keyword: 0.2 us less
            py = y.data_ptr()
            if py % 16:
                return None  # never from torch's allocator; the recorded plan assumed an aligned output
            if call(get_stream(device), x.data_ptr(), py, d.data_ptr() if d is not None else 0, 0):
                return None
            record(plan)
            return y

        run.kind = "prepared"
        return run

    def run_general(x, d, device):
        y = empty_like(x) if out_dtype is None else empty_like(x, dtype=out_dtype)
        py = y.data_ptr()
        if py % 16:
            return None
        stream = get_stream(device)
        px, pd = x.data_ptr(), d.data_ptr() if d is not None else 0
        ws = {}  # the call's workspaces, by role (shared by the launches that share it), alive until the end
        for ln, r in prepared:
            if r is not None and r not in ws:
                ws[r] = torch.empty(r[2], dtype=r[3], device=x.device)
            if ln.call(stream, px, py, pd, ws[r].data_ptr() if r is not None else 0):
                return None
        record(plan)
        return y

    run_general.kind = "prepared"
    return run_general


def _make_direct(ck, direct, g, vals, slots, plan, out_dtype):
    """The replay of one Triton launch reading x (and dy) and writing y: its arguments are a fixed list with
    integer slots, handed to the C launch function as they are (the host time of a small call is mostly
    this path's)."""
    raw, coop, pdl = direct
    head = (g[0], g[1], g[2])
    flags = (ck.function, coop, pdl, None, None, ck.packed_metadata, None, None, None)
    vals = list(vals)
    ix = [i for i, r in slots if r == _X]
    iy = [i for i, r in slots if r == _Y]
    id_ = [i for i, r in slots if r == _D]
    record = heuristics.record
    empty_like = torch.empty_like
    get_stream = torch._C._cuda_getCurrentRawStream

    def run(x, d, device):
        y = empty_like(x) if out_dtype is None else empty_like(x, dtype=out_dtype)  # no keyword: 0.2 us less
        py = y.data_ptr()
        if py % 16:
            return None  # never from torch's allocator; the recorded plan assumed an aligned output
        px = x.data_ptr()
        v = vals.copy()  # per call: another thread may be replaying the same entry
        for i in ix:
            v[i] = px
        for i in iy:
            v[i] = py
        if id_:
            pd = d.data_ptr()
            for i in id_:
                v[i] = pd
        raw(*head, get_stream(device), *flags, *v)
        record(plan)
        return y

    run.kind = "direct"
    return run


def _raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


_runtime_knobs: list = []


def hooks_idle() -> bool:
    """No launch hooks registered with Triton (a profiler's hooks must see every launch)."""
    if not _runtime_knobs:
        try:
            from triton import knobs
        except ImportError:
            return True
        _runtime_knobs.append(knobs.runtime)
    r = _runtime_knobs[0]
    a, b = r.launch_enter_hook, r.launch_exit_hook  # HookChains (a plain callable counts as registered)
    return (a is None or not getattr(a, "calls", True)) and (b is None or not getattr(b, "calls", True))


def clear() -> None:
    _cache.clear()
