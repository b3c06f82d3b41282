"""The eager fast path: replaying a call's launches without re-planning them (softmax and its backward here;
cross-entropy on logits in the last section, with its own key and roles).

Everything a launch depends on (the layout, the backend's and path's choice, the kernel, its grid and its
integer arguments) is a pure function of the inputs' shapes, strides, dtypes, device and addresses modulo
16, of dim, of the output dtype and of the backend asked for. So the first call with a given key runs the
full path (checks, dispatch, planning, the launches) while recording what it launched; later calls with the
same key allocate the output and launch the recorded kernels with the new tensors' addresses. That leaves a
dict lookup, an allocation and the launch itself on the host.

Both backends launch through launch.py's prepared launches (fastlaunch.c), on the full path too; the
recording (launch.py) holds each launch.Launch the call launched and, per address slot, the tensor (or
address) that filled it. finish() gives each of those a role: x, y (the output), dy, or a workspace the
kernels write before they read (marked by launch.scratch); the replay is then one Launch per recorded one
with its slots merged by role, called with (x, y, dy, workspace) addresses: one replay path, the same on
every Triton whose compiled kernels triton/launch.py can launch (where it cannot, the full path raises at
the first launch).

A call is replayed only when it is plain (compose.py's 'plain' route, and no autocast region; a plain call under
autocast is recorded under its explicit output dtype, which fast() never looks up): CUDA tensors
that need no autograd, no heuristics.force or test poisoning active, no logsumexp output, inputs used in
place (not copied into another layout, not addressed from a 16-byte boundary before them), and only
launches made through launch.submit. Everything else always takes the full path. Launch hooks registered
with Triton turn the replay off (they must see every launch; the Triton kernels then launch through Triton
itself). FASTSOFTMAX_FAST_LAUNCH=0 turns the replay off, and the CPU's direct path in C (the Python one runs).
"""

from __future__ import annotations

import ctypes
import os
import threading
import types

import torch
import torch.autograd.forward_ad as _fwad

from . import compose, dtypes, heuristics, launch, torch_build
from .errors import BackendFailed

ENABLED = os.environ.get("FASTSOFTMAX_FAST_LAUNCH", "1") != "0"
MAX_ENTRIES = 4096

_cache: dict = {}
# roles of tensors in a recorded launch; ("scratch", index, numel, dtype) for the call's index-th workspace
_X, _D, _Y = "x", "d", "y"
_LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The hot path is C (fastlaunch.c: softmax_key, softmax_fast, loss_key), handed torch's probes and the cache
# once (_native()): every check, the key, the lookup, the allocation and the launch of a replayed call in one
# call from Python. Callers check torch.compiler.is_compiling() first (dynamo folds it; it cannot trace C).
_native_mod: list = []  # [fastlaunch configured] or [None] where it cannot be built (the full path raises)
_native_lock = threading.Lock()


def key(x, d, dim, dtype, log: bool, backend):
    """The cache key of a call (fastlaunch.c's softmax_key): None when it cannot take the fast path (or the
    arguments are not plain: the full path checks them and raises). Callers have ruled out autograd and
    torch.compile tracing."""
    if not ENABLED or type(x) is not torch.Tensor or not x.is_cuda or (mod := _native()) is None:
        return None
    return mod.softmax_key(x, d, dim, dtype, log, backend)


def fast(x, d, dim, dtype, log: bool, backend):
    """The public functions' first step for a call with no mask, scale or causal (after checking that
    torch.compile is not tracing): the replayed output, or for a CPU tensor the CPU's direct path
    (fastlaunch_cpu.c), or None (then the full path runs: autograd, a call not recorded yet, anything the
    replay must not take). fastlaunch.c's softmax_fast once the first call of a plain tensor has configured
    it (its checks: compose.route's for a plain call, autocast's and the replay's); where fastlaunch cannot
    be built, None always (the CPU's Python path then runs; a CUDA call's full path raises)."""
    if not ENABLED or type(x) is not torch.Tensor or (mod := _native()) is None:
        return None
    return mod.softmax_fast(x, d, dim, dtype, log, backend)


# ---- recording (launch.py holds the recording itself) ---------------------------------------------------


def start(k) -> launch.Recording | None:
    """Record the launches of the call with key ``k``, when it may be replayed (then finish() or abort())."""
    if k is None or heuristics.overridden() or len(_cache) >= MAX_ENTRIES:
        return None
    return launch.start()


abort = launch.abort


def finish(rec: launch.Recording | None, k, x, d, y, out_dtype) -> None:
    """Store the replay of the call just recorded, when every address it launched with has a role."""
    launch.abort()
    if rec is None or not rec.ok or not rec.launches:
        return
    plan = heuristics.last_plan()
    if plan is None or plan.copied:
        return
    if y.stride() != x.stride():
        return  # x not dense: its output is laid out otherwise; keep such calls on the full path
    ptrs = {x.data_ptr(): _X, y.data_ptr(): _Y}
    if d is not None:
        if d.data_ptr() in ptrs:
            return  # dy aliasing y: replay would still be right, but keep such calls on the full path
        ptrs[d.data_ptr()] = _D
    tensors = {_X: x, _D: d, _Y: y}
    workspaces = list(rec.scratch)

    def role(v):
        """The role of a slot's value: x, y, dy, a workspace; None for a null address; LookupError for an
        address the replay cannot fill (a tensor made during the call that is not a workspace)."""
        if type(v) is int or v is None:
            p, dtype = v or 0, None
        else:
            p, dtype = v.data_ptr(), v.dtype
        if not p:
            return None
        if p in ptrs:
            r = ptrs[p]
            if dtype is not None and dtype != tensors[r].dtype:
                raise LookupError  # a view of another dtype: keep such calls on the full path
            return r
        if p in rec.scratch:  # one workspace per recorded one: the launches that share it share its copy
            return ("scratch", workspaces.index(p), *rec.scratch[p])
        raise LookupError

    steps = []
    try:
        for ln, values in rec.launches:
            groups = {_X: [], _Y: [], _D: [], "ws": []}
            ws = None
            for slot, v in enumerate(values):
                r = role(v)
                if r is None:
                    continue
                if isinstance(r, tuple):
                    if ws not in (None, r):
                        return  # two workspaces in one launch: not a replay built here
                    ws, r = r, "ws"
                groups[r].append(slot)
            steps.append((ln.regroup([groups[_X], groups[_Y], groups[_D], groups["ws"]]), ws))
    except (LookupError, ValueError):
        return
    _cache[k] = _make_replay(steps, plan, None if out_dtype in (None, x.dtype) else out_dtype)


def _make_replay(steps, plan, out_dtype):
    """The replay: per call an allocation (and a workspace where the launches take one) and one call per
    recorded launch with the (x, y, dy, workspace) addresses. A failed launch (this thread has no current
    context, or anything else) returns None: the full path runs and reports. The common case (one launch, no
    workspace) runs in fastlaunch.c's softmax_fast from ``native``: (the Desc's address, the output dtype or
    None, the plan); the others through this function."""
    if len(steps) == 1 and steps[0][1] is None:  # the common case: one launch, no workspace
        ln = steps[0][0]  # (held by the entry: native's Desc address points into it)
        return types.SimpleNamespace(native=(ctypes.addressof(ln.desc), out_dtype, plan), launch=ln, kind="prepared")

    record = heuristics.record
    empty_like = torch.empty_like
    get_stream = torch._C._cuda_getCurrentRawStream
    calls = [(ln.call, r) for ln, r in steps]

    def run_general(x, d, device):
        y = empty_like(x) if out_dtype is None else empty_like(x, dtype=out_dtype)
        py = y.data_ptr()
        if py % 16:
            return None
        stream = get_stream(device)
        px, pd = x.data_ptr(), d.data_ptr() if d is not None else 0
        ws = {}  # the call's workspaces, by role (shared by the launches that share it), alive until the end
        for call, r in calls:
            if r is not None and r not in ws:
                ws[r] = torch.empty(r[2], dtype=r[3], device=x.device)
            if call(stream, px, py, pd, ws[r].data_ptr() if r is not None else 0):
                return None
        record(plan)
        return y

    run_general.native = None
    run_general.kind = "prepared"
    return run_general


# ---- cross-entropy on logits: the forward and its backward replayed ---------------------------------------
# fs.cross_entropy's eager call is two prepared launches (ce_fwd, ce_finish, whose device-side assertion
# checks the targets on CUDA; ce_bwd in the backward) around argument checks, dispatch and planning in
# Python. A call seen before, on contiguous CUDA logits and targets with no class weights, is replayed: its
# buffers allocated and its recorded launches made with their addresses (fastlaunch.launch_new), and where
# the logits need a gradient one autograd Function whose backward replays ce_bwd (recorded by the first
# backward). Every address of a recorded launch has a role found by address when it is recorded: the
# logits, the targets, the stats and their tail (the counts after the rows), the outputs, the upstream
# gradient, dlogits, or a workspace (launch.scratch). Anything else keeps the full path. A replay allocates
# two buffers (three with return_z_loss): the loss, and one fp32 buffer holding the stats, then the
# workspaces and the z-loss output nobody asked for.

_loss_cache: dict = {}


def loss_key(logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend):
    """The cache key of a cross-entropy call (fastlaunch.c's loss_key), or None where it cannot take the replay
    now (the full path then runs, and checks the arguments). Callers check torch.compile first."""
    if not ENABLED or type(logits) is not torch.Tensor or not logits.is_cuda or (mod := _native()) is None:
        return None
    opts = (ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend)
    return mod.loss_key(logits, target, class_weight, *opts)


def loss_cpu(logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend):
    """The CPU's direct path of a cross-entropy call in C (fastlaunch_cpu.c's loss_cpu: its common calls,
    through fastlaunch_torch), or None (then loss.py's own runs). Callers check torch.compile first."""
    if not ENABLED or type(logits) is not torch.Tensor or (mod := _native()) is None:
        return None
    opts = (ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend)
    return mod.loss_cpu(logits, target, class_weight, *opts)


def loss_fast(k, logits, target):
    """The replayed loss (or (loss, z-loss)) of a call with key k, or None (then the full path runs)."""
    replay = _loss_cache.get(k)
    return None if replay is None else replay.run(logits, target)  # (loss_key: the logits' device is current)


def loss_record(k, logits, target, run, backward, differentiable):
    """run() (the full path: (loss, z, stats)), its launches recorded and kept as the replay of key k when
    every address has a role; returns run()'s result. ``backward``, ``differentiable``: the full path's
    dlogits (ops.cross_entropy_backward) and its differentiable form (ops.dlogits_differentiable)."""
    if k is None or len(_loss_cache) >= MAX_ENTRIES or k in _loss_cache:
        return run()
    rec = launch.start()
    try:
        loss, z, stats = out = run()
    finally:
        launch.abort()
    plan = heuristics.last_plan()
    if not rec.ok or len(rec.launches) != 2 or plan is None or plan.backend != "triton":
        return out
    m = stats.shape[0] - 3
    ws = list(rec.scratch)
    # the replay's one fp32 buffer: the stats (m + 3), then each workspace, then the unwanted z-loss output,
    # each from a 16-byte boundary; offsets in bytes
    offsets, end = {}, _up16(4 * (m + 3))
    for p in ws:
        numel, dtype = rec.scratch[p]
        offsets[p], end = end, end + _up16(numel * dtype.itemsize)
    z_off, end = end, end + _up16(z.numel() * z.element_size())
    roles = {logits.data_ptr(): (0, 0), target.data_ptr(): (1, 0), stats.data_ptr(): (2, 0)}
    roles |= {stats.data_ptr() + 4 * m: (2, 4 * m), loss.data_ptr(): (3, 0), z.data_ptr(): (4, 0)}
    roles |= {p: (2, offsets[p]) for p in ws}
    steps = _steps(rec, roles)
    if steps is not None and len(roles) == 6 + len(ws):  # (distinct addresses)
        _loss_cache[k] = _LossReplay(steps, m, end // 4, z_off, loss, plan, k, backward, differentiable)
    return out


def _up16(n: int) -> int:
    return -(-n // 16) * 16


def _steps(rec, roles):
    """The recorded launches as launch_steps' steps ((Desc address, (base, offset) per address slot), ...)
    and the Launches they point into; None when an address has no role."""
    steps, launches = [], []
    for ln, values in rec.launches:
        pairs = []
        for v in values:
            p = v if type(v) is int else 0 if v is None else v.data_ptr()
            if not p:
                pairs += (-1, 0)
            elif p in roles:
                pairs += roles[p]
            else:
                return None
        steps.append((ctypes.addressof(ln.desc), tuple(pairs)))
        launches.append(ln)
    return tuple(steps), launches


class _LossReplay:
    """One cross-entropy call's forward, and once its first backward is recorded, that backward."""

    def __init__(self, steps, m, buf_numel, z_off, loss, plan, k, backward, differentiable):
        (self.fwd, self.launches), self.m, self.plan = steps, m, plan  # (launches: what the steps point into)
        self.full_backward, self.differentiable = backward, differentiable
        self.opts = (k[8], k[9], float(k[10]), None if k[11] is None else float(k[11]), float(k[12]))
        self.want_z, self.backend, self.grad, self.device = k[13], k[14], k[7], k[2]
        self.bwd = None  # (steps, the upstream gradient's key, the plan, the Launches) once recorded
        # allocations as empty_like of small prototypes (torch.empty would parse a shape)
        self.buf_like = torch.empty(buf_numel, dtype=torch.float32, device=loss.device)
        self.out_like = torch.empty_like(loss)
        self.protos = (self.buf_like, self.out_like, self.out_like) if self.want_z else (self.buf_like, self.out_like)
        self.derived = () if self.want_z else ((2, z_off),)  # (the unwanted z-loss output: in the buffer)
        self.launch_new, self.tensor_key = launch.native().launch_new, launch.native().tensor_key

    def run(self, logits, target):
        """The bases (logits, target, the buffer, the loss, the z-loss output), the buffer and outputs new."""
        made = self.launch_new(self.fwd, self.device, (logits, target), self.protos, self.derived)
        if made is None:
            return None
        buf, out, zout = made if self.want_z else (*made, None)
        heuristics.record(self.plan)
        if self.grad:
            out = _CrossEntropyReplay.apply(logits, target, (out, buf), self)
        return (out, zout) if self.want_z else out

    def backward(self, logits, target, stats, g):
        """dlogits: the recorded backward when g looks as it did then, else the full path (recorded the
        first time)."""
        gk = self.tensor_key(g)
        b = self.bwd
        if b is not None and b[1] == gk:  # dx: empty_like(logits), contiguous as the full path's
            made = self.launch_new(b[0], self.device, (logits, target, stats, g), (logits,), ())
            if made is not None:
                heuristics.record(b[2])
                return made[0]
        rec = launch.start() if b is None else None
        try:
            dx = self.full_backward(logits, target, None, stats, g, *self.opts, self.backend)
        finally:
            launch.abort()
        plan = heuristics.last_plan()
        if rec is not None and rec.ok and len(rec.launches) == 1 and plan is not None and plan.backend == "triton":
            ps, m = stats.data_ptr(), self.m
            roles = {logits.data_ptr(): (0, 0), target.data_ptr(): (1, 0), ps: (2, 0), ps + 4 * m: (2, 4 * m)}
            roles |= {g.data_ptr(): (3, 0), dx.data_ptr(): (4, 0)}
            steps = _steps(rec, roles)
            if steps is not None and len(roles) == 6:
                self.bwd = (steps[0], gk, plan, steps[1])
        return dx


class _CrossEntropyReplay(torch.autograd.Function):
    """The replayed loss's autograd node: dlogits from the saved stats (ce_bwd replayed), or in torch ops
    where the backward must itself be differentiable (create_graph=True)."""

    @staticmethod
    def forward(ctx, logits, target, outputs, replay):
        out, stats = outputs  # (made by the replay: not inputs of this node)
        ctx.save_for_backward(logits, target, stats)
        ctx.replay = replay
        return out

    @staticmethod
    def backward(ctx, g):
        logits, target, stats = ctx.saved_tensors
        r = ctx.replay
        if torch.is_grad_enabled():
            dx = r.differentiable(logits, target, None, stats, g, *r.opts)
        else:
            dx = r.backward(logits, target, stats, g)
        return dx, None, None, None


def _native():
    """fastlaunch, configured for the replay and the CPU's direct path (built on first use, by the first call
    of a plain tensor); None where it cannot be built. Once configured, ``fast`` and ``loss_key`` are its
    functions."""
    if not _native_mod:
        with _native_lock:
            if not _native_mod:
                try:
                    mod = launch.native()
                except BackendFailed:
                    _native_mod.append(None)
                    return None
                try:
                    from triton import knobs
                except ImportError:  # (no Triton: the CPU's Python path runs; CUDA calls raise on the full path)
                    _native_mod.append(None)
                    return None

                from . import dispatch  # noqa: PLC0415 (its DEVICES, read per call: tests take the CPU off)
                from .backends import torch as native  # noqa: PLC0415 (the plans the CPU's path records)

                # (its table where built; until then Python's calls, fastlaunch's own state to begin with)
                if (calls := torch_build.torch_calls(wait=False, ready=lambda t: _reach_torch(mod, t))) is not None:
                    _reach_torch(mod, calls)
                floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
                kernels = (torch._softmax, torch._log_softmax, torch._softmax_backward_data)
                plans = (native.NATIVE, native.NATIVE_GRAPH, floats, dispatch, native.NATIVE_CE, native.NATIVE_CE_GRAPH)
                mod.configure_cpu(*kernels, *plans, dtypes.TARGETS, native)
                mod.configure(
                    torch.Tensor,
                    torch.dtype,
                    _cache,
                    torch.is_grad_enabled,
                    compose.transforms_active,
                    compose.dispatch_modes,
                    compose.tracing,
                    compose.any_autocast,
                    _fwad,
                    heuristics,
                    knobs.runtime,
                    torch._C._cuda_getCurrentRawStream,
                    torch.empty_like,
                    heuristics.record,
                    _LOSS_DTYPES,
                )
                global fast, loss_key, loss_cpu
                fast, loss_key, loss_cpu = mod.softmax_fast, mod.loss_key, mod.loss_cpu
                _native_mod.append(mod)
    return _native_mod[0]


def _reach_torch(mod, calls) -> None:
    """fastlaunch reaching torch through fastlaunch_torch's table ``calls`` (None: through Python). Calls are
    keyed otherwise then: the replays recorded under the other keys are dropped."""
    try:
        mod.configure_torch(calls)
    except RuntimeError:  # a table of another ABI: Python's probes
        mod.configure_torch(None)
    clear()


def clear() -> None:
    _cache.clear()
    _loss_cache.clear()
