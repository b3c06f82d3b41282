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
itself). FASTSOFTMAX_FAST_LAUNCH=0 turns the replay off.
"""

from __future__ import annotations

import os

import torch
import torch.autograd.forward_ad as _fwad

from . import compose, heuristics, launch

ENABLED = os.environ.get("FASTSOFTMAX_FAST_LAUNCH", "1") != "0"
MAX_ENTRIES = 4096

_cache: dict = {}
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
    if d is not None and (type(d) is not torch.Tensor or (d.requires_grad and torch.is_grad_enabled())):
        return None
    k = key(x, d, dim, dtype, log, backend)
    entry = _cache.get(k) if k is not None else None
    if entry is None or heuristics.overridden() or not hooks_idle() or torch._C._cuda_getDevice() != k[3]:
        return None
    return entry(x, d, k[3])


_compiling = compose.compiling
_transforms = compose.transforms_active
_modes = compose.dispatch_modes
_tracing = compose.tracing
_autocast = compose.any_autocast
hooks_idle = launch.hooks_idle  # no launch hooks registered with Triton


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
    context, or anything else) returns None: the full path runs and reports."""
    record = heuristics.record
    empty_like = torch.empty_like
    get_stream = torch._C._cuda_getCurrentRawStream
    if len(steps) == 1 and steps[0][1] is None:  # the common case: one launch, no workspace
        call = steps[0][0].call

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

    run_general.kind = "prepared"
    return run_general


# ---- cross-entropy on logits: the forward and its backward replayed ---------------------------------------
# fs.cross_entropy's eager call is three prepared launches (ce_fwd, ce_finish; ce_bwd in the backward)
# around argument checks, dispatch and planning in Python. A call seen before, on contiguous CUDA logits and
# targets with no class weights, is replayed: its buffers allocated and its recorded launches made with
# their addresses, and where the logits need a gradient one autograd Function whose backward replays ce_bwd
# (recorded by the first backward). Every address of a recorded launch has a role found by address when it
# is recorded: the logits, the targets, the stats and their tail (the counts after the rows), the outputs,
# the upstream gradient, dlogits, or a workspace (launch.scratch). Anything else keeps the full path.

_loss_cache: dict = {}
_LOSS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NUM = (int, float)


def loss_key(logits, target, class_weight, ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend):
    """The cache key of a cross-entropy call, or None where it cannot take the replay now (the full path
    then runs, and checks the arguments)."""
    if not ENABLED or type(logits) is not torch.Tensor or type(target) is not torch.Tensor or class_weight is not None:
        return None
    if not logits.is_cuda or logits.dtype not in _LOSS_DTYPES or not logits.numel() or not target.is_cuda:
        return None
    if type(ignore_index) is not int or type(reduction) is not str or type(backend) is not str:
        return None
    if type(smoothing) not in _NUM or type(z_loss) not in _NUM or type(want_z) is not bool:
        return None
    if softcap is not None and type(softcap) not in _NUM:
        return None
    if not logits.is_contiguous() or not target.is_contiguous():
        return None
    if _compiling() or _transforms() or _fwad._current_level >= 0 or _modes() or _tracing() is not None:
        return None
    if _autocast() or heuristics.overridden() or not hooks_idle():
        return None
    px, pt = logits.data_ptr(), target.data_ptr()
    if not px or not pt:
        return None
    grad = logits.requires_grad and torch.is_grad_enabled()
    shape = (logits.shape, logits.dtype, logits.get_device(), px % 16, target.shape, target.dtype, pt % 16, grad)
    return shape + (ignore_index, reduction, smoothing, softcap, z_loss, want_z, backend, target.get_device())


def loss_fast(k, logits, target):
    """The replayed loss (or (loss, z-loss)) of a call with key k, or None (then the full path runs)."""
    replay = _loss_cache.get(k)
    if replay is None or torch._C._cuda_getDevice() != k[2]:
        return None
    return replay.run(logits, target)


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
    names = {logits.data_ptr(): "x", target.data_ptr(): "t", stats.data_ptr(): "stats"}
    names |= {stats.data_ptr() + 4 * m: "tail", loss.data_ptr(): "out", z.data_ptr(): "zout"}
    steps = _roles(rec, names)
    if steps is not None and len(names) == 6:  # (six distinct addresses)
        _loss_cache[k] = _LossReplay(steps, m, loss, plan, k, backward, differentiable)
    return out


def _roles(rec, names):
    """The recorded launches as (call, roles of its address slots); None when an address has no role."""
    ws = list(rec.scratch)
    steps = []
    for ln, values in rec.launches:
        slots = []
        for v in values:
            p = v if type(v) is int else 0 if v is None else v.data_ptr()
            if p in names:
                slots.append(names[p])
            elif p in rec.scratch:
                slots.append(("ws", ws.index(p), *rec.scratch[p]))
            else:
                return None
        steps.append((ln.call, tuple(slots)))
    return steps


def _replay(steps, addr: dict, device) -> bool:
    """The recorded launches with these addresses (workspaces allocated); False when a launch failed."""
    stream = torch._C._cuda_getCurrentRawStream(device.index)
    ws = {}
    for call, slots in steps:
        a = []
        for s in slots:
            if type(s) is str:
                a.append(addr[s])
            else:
                if s[1] not in ws:
                    ws[s[1]] = torch.empty(s[2], dtype=s[3], device=device)
                a.append(ws[s[1]].data_ptr())
        if call(stream, *a):
            return False
    return True


class _LossReplay:
    """One cross-entropy call's forward, and once its first backward is recorded, that backward."""

    def __init__(self, steps, m, loss, plan, k, backward, differentiable):
        self.fwd, self.m, self.plan = steps, m, plan
        self.full_backward, self.differentiable = backward, differentiable
        self.out_shape, self.out_dtype = tuple(loss.shape), loss.dtype
        self.bad_target = f"cross_entropy: a target is outside [0, {k[0][-1]}) and not ignore_index"
        self.opts = (k[8], k[9], float(k[10]), None if k[11] is None else float(k[11]), float(k[12]))
        self.want_z, self.backend, self.grad = k[13], k[14], k[7]
        self.bwd = None  # (steps, the upstream gradient's key, the plan) once recorded

    def run(self, logits, target):
        dev = logits.device
        stats = torch.empty(self.m + 3, dtype=torch.float32, device=dev)
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=dev)
        zout = torch.empty(self.out_shape, dtype=self.out_dtype, device=dev)
        ps = stats.data_ptr()
        addr = {"x": logits.data_ptr(), "t": target.data_ptr(), "stats": ps, "tail": ps + 4 * self.m}
        addr |= {"out": out.data_ptr(), "zout": zout.data_ptr()}
        if not _replay(self.fwd, addr, dev):
            return None
        torch._assert_async(stats[self.m + 1], self.bad_target)
        heuristics.record(self.plan)
        if self.grad:
            out, zout = _CrossEntropyReplay.apply(logits, target, (out, zout, stats), self)
        return (out, zout) if self.want_z else out

    def backward(self, logits, target, stats, g):
        """dlogits: the recorded backward when g looks as it did then, else the full path (recorded the
        first time)."""
        gk = (g.shape, g.stride(), g.dtype, g.data_ptr() % 16)
        b = self.bwd
        if b is not None and b[1] == gk:
            dx = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            ps = stats.data_ptr()
            addr = {"x": logits.data_ptr(), "t": target.data_ptr(), "stats": ps, "tail": ps + 4 * self.m}
            addr |= {"g": g.data_ptr(), "dx": dx.data_ptr()}
            if _replay(b[0], addr, logits.device):
                heuristics.record(b[2])
                return dx
        rec = launch.start() if b is None else None
        try:
            dx = self.full_backward(logits, target, None, stats, g, *self.opts, self.backend)
        finally:
            launch.abort()
        plan = heuristics.last_plan()
        if rec is not None and rec.ok and len(rec.launches) == 1 and plan is not None and plan.backend == "triton":
            ps = stats.data_ptr()
            names = {logits.data_ptr(): "x", target.data_ptr(): "t", ps: "stats", ps + 4 * self.m: "tail"}
            names |= {g.data_ptr(): "g", dx.data_ptr(): "dx"}
            steps = _roles(rec, names)
            if steps is not None and len(names) == 6:
                self.bwd = (steps, gk, plan)
        return dx


class _CrossEntropyReplay(torch.autograd.Function):
    """The replayed loss's autograd node: dlogits from the saved stats (ce_bwd replayed), or in torch ops
    where the backward must itself be differentiable (create_graph=True)."""

    @staticmethod
    def forward(ctx, logits, target, outputs, replay):
        out, zout, stats = outputs  # (made by the replay: not inputs of this node)
        ctx.save_for_backward(logits, target, stats)
        ctx.replay = replay
        ctx.mark_non_differentiable(zout)
        ctx.set_materialize_grads(False)
        return out, zout

    @staticmethod
    def backward(ctx, g, _gz):
        if g is None:
            return (None,) * 4
        logits, target, stats = ctx.saved_tensors
        r = ctx.replay
        if torch.is_grad_enabled():
            dx = r.differentiable(logits, target, None, stats, g, *r.opts)
        else:
            dx = r.backward(logits, target, stats, g)
        return dx, None, None, None


def clear() -> None:
    _cache.clear()
    _loss_cache.clear()
