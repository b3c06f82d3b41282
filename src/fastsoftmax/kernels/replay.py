"""The eager replay: a plain call seen before runs its recorded launches again, without planning them. One
design for every kernel the library launches (softmax and its backward, the cross-entropy kernels).

Everything a launch depends on (the layout, the backend's and path's choice, the kernel, its grid and its
integer arguments) is a pure function of the call's key: each tensor's shape, strides, dtype and address
modulo 16 (and its storage's, for a tensor not on a 16-byte boundary), the device, and every other
argument. So the first call with a key takes the full path while launch.py records what it launched
(`recording`); `store` gives every address a role (an input, an output or a workspace, at a byte offset)
and keeps the replay. A later call with that key allocates the outputs and workspaces and calls the
recorded launches with the new addresses: on the host, a dict lookup, the allocations and the launches.

Only plain calls are keyed (dispatch.py asks, replayable()): tensors of type torch.Tensor, all CUDA or all
CPU, FASTSOFTMAX_REPLAY not 0. A replay runs only outside heuristics.force and, on a GPU, with no launch hooks
registered with Triton (a profiler must see every launch): it returns None otherwise, as it does where its
launch fails, and the full path then runs. A call is kept only when every launch was a prepared one
(launch.py), every address has a role (an input copied into another layout has none) and no force() block
opened while it ran (force is process-wide: another thread's may have set its launch). CPU tensors launch
nothing: there the torch backend's native path records the torch call it made (launch.recorded_call), and
the replay makes that call again, without the checks and the choice before it. At most MAX_ENTRIES keys
are kept.

Keys (softmax_key, loss_key) are made here only: the public functions look a call up before any check, and
dispatch.py records the full path under the same key.
"""

from __future__ import annotations

import os

import torch

from .. import heuristics
from . import launch

_overridden, _hooks_idle = heuristics.overridden, launch.hooks_idle

ENABLED = os.environ.get("FASTSOFTMAX_REPLAY", "1") != "0"
MAX_ENTRIES = 4096

_cache: dict = {}
lookup = _cache.get  # (a C call: no Python frame on the hot path)


def tensor_key(t: torch.Tensor):
    """What a replay keys a tensor by: shape, strides, dtype, whether it is a lazily negated view (its memory
    is not its value) and address modulo 16 (with its storage's where the address is not on a 16-byte
    boundary: the kernels then address it from the boundary below)."""
    p = t.data_ptr() & 15
    if p:
        p = (p, t.untyped_storage().data_ptr() & 15)
    return t.shape, t.stride(), t.dtype, t.is_neg(), p


def softmax_key(x, dy, dim: int, out_dtype, log: bool, backend):
    """The key of a softmax-family call on x (``dy`` None: the forward) or on y and dy (the backward): the
    tensors' keys and devices, dim (non-negative), the output dtype, log and the backend's name."""
    if dy is None:
        return tensor_key(x), x.get_device(), dim, out_dtype, log, backend
    return tensor_key(x), tensor_key(dy), x.get_device(), dy.get_device(), dim, out_dtype, log, backend


def loss_key(tensors: tuple, *options):
    """The key of a cross-entropy call on ``tensors`` (None entries kept as None): their keys and devices
    (each one's: the call is looked up before the checks that refuse tensors on two devices), and the loss's
    options (each as the kernels take it)."""
    keys = []  # (a loop: a generator expression costs a frame per tensor)
    for t in tensors:
        keys.append(None if t is None else (tensor_key(t), t.get_device()))
    return tuple(keys), options


def replayable(*tensors) -> bool:
    """Whether a call on ``tensors`` (None entries skipped) may be keyed and recorded: tensors of type
    torch.Tensor, all CUDA or all CPU, none a lazily negated view (the full path reads its values; what it
    records would read the replay's inputs' memory), replays on, outside heuristics.force."""
    if not ENABLED or _overridden():  # (under force nothing is recorded: a forced path is not the call's)
        return False
    cuda = None
    for t in tensors:
        if t is not None:
            if type(t) is not torch.Tensor or not (t.is_cuda or t.is_cpu) or cuda not in (None, t.is_cuda):
                return False
            if t.is_neg():
                return False
            cuda = t.is_cuda
    return True


def _held() -> bool:
    """Whether a replay must leave the call to the full path: inside heuristics.force, or while Triton has
    launch hooks (a profiler must see every launch)."""
    return _overridden() or not _hooks_idle()


def clear() -> None:
    _cache.clear()


def entries() -> list:
    """The replays kept, one per key (closures named ``one``, ``two`` or ``general``): for tests."""
    return list(_cache.values())


def start(key):
    """Record this thread's launches from now when ``key`` (a call's key, or None) may be stored: the
    recording, or None. The caller then calls store(), or stop() where the call failed."""
    if key is None or len(_cache) >= MAX_ENTRIES:
        return None
    rec = launch.start()
    rec.forces = heuristics.forces_opened()
    return rec


stop = launch.abort


def _span(t: torch.Tensor) -> int:
    """Bytes from t's first element to the end of its last one."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()


def _maker(out: torch.Tensor | None, inputs):
    """How a replay makes an output like ``out``: empty_like(an input) where that gives out's layout (the
    dtype None where it is the input's: torch then parses no keyword), else empty_strided; None for None."""
    if out is None:
        return ("none",)
    for i, t in enumerate(inputs):
        if t.shape == out.shape and torch.empty_like(t, dtype=out.dtype, device="meta").stride() == out.stride():
            return ("like", i, None if out.dtype == t.dtype else out.dtype)
    return ("strided", tuple(out.shape), out.stride(), out.dtype)


def store(key, rec, inputs: tuple, outputs: tuple) -> None:
    """Keep the replay of the call just recorded in ``rec`` under ``key`` (the recording stops): ``inputs``
    are the tensors a replay is called with, ``outputs`` the ones the full path returned (a replay returns
    new ones alike, and None where the full path returned None)."""
    launch.abort()
    plan = heuristics.last_plan()
    if rec is None or not rec.ok or plan is None or plan.copied:
        return
    if rec.forces != heuristics.forces_opened():
        return  # (a force() block opened meanwhile, on any thread: it may have set what was launched)
    if rec.call is not None:  # (CPU tensors: the torch backend's call, made again)
        if not rec.launches:
            _cache[key] = _torch_call(*rec.call, plan)
        return
    if not rec.launches:
        return
    scratch = list(rec.scratch.items())  # (address, (numel, dtype)) of each workspace
    bases = [(t.data_ptr(), _span(t)) if t is not None else (0, 0) for t in (*inputs, *outputs)]
    bases += [(p, numel * dtype.itemsize) for p, (numel, dtype) in scratch]
    if any(o.data_ptr() & 15 for o in outputs if o is not None):
        return
    spans = sorted(bases[: len(inputs)])
    if any(lo + n > spans[i + 1][0] for i, (lo, n) in enumerate(spans[:-1])):
        return  # inputs sharing memory (dy is y, two views of one buffer): the key cannot tell, so no replay

    def role(v):
        p = v if type(v) is int else 0 if v is None else v.data_ptr()
        if not p:
            return None
        for i, (lo, n) in enumerate(bases):
            if lo <= p < lo + max(n, 1):
                return i, p - lo
        for i, (lo, _) in enumerate(bases):
            if lo - 16 < p < lo:  # a view from the 16-byte boundary below (triton/launch.aligned_view)
                return i, p - lo
        raise LookupError

    steps = []
    try:
        for ln, values in rec.launches:
            pairs = []  # the distinct (base, offset) the launch's slots take, in order
            groups = []
            for slot, v in enumerate(values):
                r = role(v)
                if r is None:
                    continue
                if r not in pairs:
                    pairs.append(r)
                    groups.append([])
                groups[pairs.index(r)].append(slot)
            steps.append((ln.regroup(groups), tuple(pairs)))
    except (LookupError, ValueError):
        return
    makers = [_maker(o, inputs) for o in outputs] + [("strided", (n,), (1,), d) for _, (n, d) in scratch]
    device = inputs[0].get_device()
    _cache[key] = _replay(steps, makers, len(inputs), len(outputs), plan, device, inputs[0].device)


def _replay(steps, makers, n_in: int, n_out: int, plan, index: int, dev):
    """The replay's closure: (*inputs) -> the outputs (one tensor, or a tuple of several), or None."""
    if len(steps) == 1 and n_out == 1 and len(makers) == 1 and makers[0][0] == "like":
        ln, pairs = steps[0]
        call, dtype = ln.call, makers[0][2]
        offset = pairs[0][1] if pairs[0][0] == 0 else 0
        if n_in == 1 and pairs == ((0, offset), (1, 0)):  # (one input and one output, in that order)
            return _one(call, dtype, offset, plan, index)
        if n_in == 2 and len(pairs) == 3 and sorted(i for i, _ in pairs) == [0, 1, 2]:
            return _two(call, dtype, makers[0][1], pairs, plan, index)
    return _general(steps, makers, n_out, plan, index, dev)


def _torch_call(fn, args: tuple, swap: bool, plan):
    """The replay of a torch call the torch backend made on CPU tensors: fn(*inputs, *args), the two inputs
    swapped where ``swap`` (a backward: the replay takes y, dy and fn dy, y)."""
    record = heuristics.record

    def torch_call(x, *rest):  # (x alone: the forward, one frame)
        if _overridden():
            return None
        try:
            if not rest:
                out = fn(x, *args)
            elif swap:
                out = fn(rest[0], x, *args)
            else:
                out = fn(x, *rest, *args)
        except (IndexError, RuntimeError):  # (a bad target, say: the full path runs and reports it)
            return None
        record(plan)
        return out

    return torch_call


def _one(call, dtype, offset: int, plan, index: int):
    record, stream, empty_like, held = heuristics.record, launch.raw_stream(), torch.empty_like, _held

    def one(x):  # the common case: x in, y out, one launch
        if held():
            return None
        y = empty_like(x) if dtype is None else empty_like(x, dtype=dtype)
        if call(stream(index), x.data_ptr() + offset, y.data_ptr()):
            return None
        record(plan)
        return y

    return one


def _two(call, dtype, like: int, pairs, plan, index: int):
    """The backward's common case: y and dy in, dx out (made like input ``like``), one launch of their three
    addresses in the recorded order."""
    record, stream, empty_like, held = heuristics.record, launch.raw_stream(), torch.empty_like, _held
    (i0, o0), (i1, o1), (i2, o2) = pairs

    def two(y, dy):
        if held():
            return None
        t = y if like == 0 else dy
        dx = empty_like(t) if dtype is None else empty_like(t, dtype=dtype)
        p = (y.data_ptr(), dy.data_ptr(), dx.data_ptr())
        if call(stream(index), p[i0] + o0, p[i1] + o1, p[i2] + o2):
            return None
        record(plan)
        return dx

    return two


def _general(steps, makers, n_out: int, plan, index: int, dev):
    record, stream = heuristics.record, launch.raw_stream()
    empty_like, empty_strided = torch.empty_like, torch.empty_strided
    calls = [(ln.call, pairs) for ln, pairs in steps]

    def make(m, inputs):
        if m[0] == "like":
            return empty_like(inputs[m[1]]) if m[2] is None else empty_like(inputs[m[1]], dtype=m[2])
        if m[0] == "none":
            return None
        return empty_strided(m[1], m[2], dtype=m[3], device=dev)

    def general(*inputs):
        if _held():
            return None
        made = [make(m, inputs) for m in makers]
        ptrs = [t.data_ptr() for t in inputs] + [0 if t is None else t.data_ptr() for t in made]
        s = stream(index)
        for call, pairs in calls:
            if call(s, *[ptrs[i] + off for i, off in pairs]):
                return None
        record(plan)
        return made[0] if n_out == 1 else tuple(made[:n_out])

    return general
