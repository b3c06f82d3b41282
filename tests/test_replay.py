"""kernels/replay.py without a GPU: recordings made by hand (the launches a full path would record: Launches
and what filled each address slot, its workspaces), kept by replay.store and replayed through a stand-in of
fastlaunch that writes each call's addresses into the launch's argument bytes as fastlaunch.c does. The
roles an address takes (an input, an output, a workspace, at an offset inside one, a view up to 15 bytes
before an input), the recordings no replay is kept for, the closure chosen (``one`` or ``general``), a
failed launch's None; which calls are keyed (replayable) and the tensors' keys (tensor_key)."""

import ctypes
import gc
import shutil
import struct
import threading

import pytest
import torch
from helpers import triton_hook

from fastsoftmax import heuristics
from fastsoftmax.kernels import launch, replay

STREAM = 0x5EED
PLAN = heuristics.Plan("triton", "rowblock", block_n=64)  # what the recorded call ran
OTHER = heuristics.Plan("torch", "native")  # the last plan before a replay


class Launcher:
    """fastlaunch.c as a stand-in: the Desc at the address read back and the call's addresses written into its
    argument bytes where its slots go; each launch kept as (function, stream, the bytes the kernel gets); the
    codes queued returned, then 0. ``stream``: torch's current-stream call, as launch.raw_stream gives it."""

    def __init__(self):
        self.seen, self.codes, self.devices = [], [], []

    def launch(self, desc, stream, *addresses):
        d = launch.Desc.from_address(desc)
        if len(addresses) != d.n_slots:
            raise TypeError(f"this launch takes {d.n_slots} addresses, got {len(addresses)}")
        raw = bytearray(ctypes.string_at(desc + launch.Desc.bytes.offset, d.n_bytes))
        for i in range(d.n_fills):
            raw[d.fill_offset[i] : d.fill_offset[i] + 8] = addresses[d.fill_slot[i]].to_bytes(8, "little")
        self.seen.append((d.function, stream, bytes(raw)))
        return self.codes.pop(0) if self.codes else 0

    def stream(self, index):
        self.devices.append(index)
        return STREAM

    def pointers(self, k=-1):
        """The pointer arguments of launch k (kernel() launches: pointers, then an int32 7)."""
        raw = self.seen[k][2]
        *ptrs, seven = struct.unpack(f"<{(len(raw) - 4) // 8}Qi", raw)
        assert seven == 7
        return tuple(ptrs)


@pytest.fixture
def launcher(monkeypatch):
    fake = Launcher()
    monkeypatch.setattr(launch, "_native_mod", [fake])
    monkeypatch.setattr(launch, "raw_stream", lambda: fake.stream)
    replay.clear()
    yield fake
    replay.clear()
    launch.abort()


def kernel(n: int, function: int = 0xA, grid=(1, 1, 1)) -> launch.Launch:
    """A Launch of a kernel taking n pointers, each an address slot, then an int32 7."""
    params = [(ctypes.c_uint64, 0)] * n + [(ctypes.c_int32, 7)]
    return launch.Launch(function, grid, 128, 0, 1, params, [[(i, 0)] for i in range(n)])


def record(key, launches, inputs, outputs, scratch=(), ok=True, plan=PLAN):
    """A call's recording made by hand, as the full path makes it, and stored: the replay kept, or None."""
    rec = replay.start(key)
    assert rec is launch.recording() is not None
    for t in scratch:
        assert launch.scratch(t) is t
    for ln, values in launches:
        launch.recorded(ln, values)
    if not ok:
        launch.unrecorded()
    heuristics.record(plan)
    replay.store(key, rec, inputs, outputs)
    assert launch.recording() is None  # (store ends the recording)
    return replay.lookup(key)


def ptr(t, offset=0):
    return t.data_ptr() + offset


# ---- the roles an address takes ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_one_input_one_output_replays_with_new_addresses(launcher, layout):
    """The common case (x in, y out, one launch; y also in another slot, a null slot left null): ``one``,
    which makes y like the new x (its dtype, x's layout), launches on device x's current stream, records the
    call's plan and returns y."""
    make = (lambda: torch.randn(4, 8)) if layout == "contiguous" else (lambda: torch.randn(8, 4).t())
    x = make()
    y = torch.empty_like(x, dtype=torch.bfloat16)
    r = record("k", [(kernel(4), (x, y, y, None))], (x,), (y,))
    assert r.__name__ == "one" and replay.entries() == [r]
    x2 = make()
    heuristics.record(OTHER)
    y2 = r(x2)
    assert (y2.shape, y2.stride(), y2.dtype) == (x.shape, x.stride(), torch.bfloat16) and ptr(y2) != ptr(y)
    assert launcher.seen[0][:2] == (0xA, STREAM) and len(launcher.seen) == 1
    assert launcher.pointers() == (ptr(x2), ptr(y2), ptr(y2), 0) and launcher.devices == [x.get_device()]
    assert heuristics.last_plan() is PLAN


@pytest.mark.parametrize("back", [1, 4, 15, 16])
def test_a_view_before_an_input(launcher, back):
    """An address 1 to 15 bytes before an input (triton/launch.aligned_view: the 16-byte boundary below a
    misaligned x) is the new input's address less as many bytes; 16 bytes before, it is nobody's: no replay."""
    buf = torch.empty(128, dtype=torch.uint8)
    x, y = buf[16 + back : 48 + back], torch.empty(32, dtype=torch.uint8)
    r = record("k", [(kernel(2), (buf[16:], y))], (x,), (y,))
    if back == 16:
        assert r is None and replay.entries() == []
        return
    x2 = torch.empty(128, dtype=torch.uint8)[16 + back : 48 + back]
    y2 = r(x2)
    assert r.__name__ == "one" and launcher.pointers() == (ptr(x2) - back, ptr(y2))


def test_offsets_inside_an_input(launcher):
    """The loss backward's launch: the logits also where the class weights would go, the stats tensor as the
    weight sum and the logsumexp, its tail (the counts, from a view and from an integer address); each the
    new tensor's address at the same offset."""
    m, v = 4, 10
    x, t = torch.randn(m, v, dtype=torch.bfloat16), torch.randint(0, v, (m,))
    stats, g, dx = torch.randn(m + 3), torch.ones(()), torch.empty(m, v, dtype=torch.bfloat16)
    values = (x, t, x, stats, stats[m:], g, dx, ptr(stats, 4 * (m + 1)))
    r = record("k", [(kernel(8), values)], (x, t, stats, g), (dx,))
    x2, t2, stats2, g2 = torch.randn_like(x), torch.randint_like(t, v), torch.randn_like(stats), torch.ones(())
    dx2 = r(x2, t2, stats2, g2)
    assert r.__name__ == "general" and (dx2.shape, dx2.stride(), dx2.dtype) == (x.shape, x.stride(), x.dtype)
    want = (ptr(x2), ptr(t2), ptr(x2), ptr(stats2), ptr(stats2, 4 * m), ptr(g2), ptr(dx2), ptr(stats2, 4 * (m + 1)))
    assert launcher.pointers() == want and launcher.devices == [-1]


def test_outputs_and_workspaces_are_made_anew(launcher, monkeypatch):
    """The loss forward's two launches: three outputs (one like an input, two of their own shapes) returned as
    a tuple, made alike; a workspace both launches use (scratch) allocated anew, the same one for both."""
    made = []
    empty_strided = torch.empty_strided

    def spy(*a, **k):
        made.append((*a, k["dtype"]))
        return empty_strided(*a, **k)

    monkeypatch.setattr(torch, "empty_strided", spy)
    m, v = 4, 10
    x, t, rows = torch.randn(m, v), torch.randint(0, v, (m,)), torch.empty(m)
    loss, z, st = torch.empty(m, dtype=torch.bfloat16), torch.empty((), dtype=torch.bfloat16), torch.empty(m + 3)
    launches = [(kernel(5, 0xB), (x, t, rows, rows, st)), (kernel(6, 0xC), (rows, t, loss, z, st[m:], None))]
    r = record("k", launches, (x, t), (loss, z, st), scratch=(rows,))
    made.clear()
    x2, t2 = torch.randn(m, v), torch.randint(0, v, (m,))
    out = r(x2, t2)
    assert r.__name__ == "general" and isinstance(out, tuple) and len(out) == 3
    assert [(o.shape, o.stride(), o.dtype) for o in out] == [(o.shape, o.stride(), o.dtype) for o in (loss, z, st)]
    assert made == [((), (), torch.bfloat16), ((m + 3,), (1,), torch.float32), ((m,), (1,), torch.float32)]
    loss2, z2, st2 = out
    assert [f for f, _, _ in launcher.seen] == [0xB, 0xC]
    a, b = launcher.pointers(0), launcher.pointers(1)
    ws = a[2]
    assert a == (ptr(x2), ptr(t2), ws, ws, ptr(st2)) and b == (ws, ptr(t2), ptr(loss2), ptr(z2), ptr(st2, 4 * m), 0)
    assert ws not in (ptr(rows), ptr(x2), ptr(t2), ptr(loss2), ptr(z2), ptr(st2))


def test_outputs_returned_as_none(launcher):
    """The one-program loss forward of a plain call: its stats and z-loss None (not made), its slots the
    loss's; each replay returns None for them and launches with the new loss's address there."""
    m, v = 4, 10
    x, t, loss = torch.randn(m, v), torch.randint(0, v, (m,)), torch.empty(())
    r = record("k", [(kernel(5, 0xB), (x, t, x, loss, loss))], (x, t), (loss, None, None))
    x2, t2 = torch.randn(m, v), torch.randint(0, v, (m,))
    out = r(x2, t2)
    assert r.__name__ == "general" and len(out) == 3 and out[1] is None and out[2] is None
    assert out[0].shape == () and launcher.pointers() == (ptr(x2), ptr(t2), ptr(x2), ptr(out[0]), ptr(out[0]))


# ---- which closure, and a failed launch ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "slots, closure",
    [
        ([[("x", 0), ("y", 0)]], "one"),
        ([[("x", 4), ("y", 0), ("y", 0)]], "one"),  # x at an offset; y twice
        ([[("y", 0), ("x", 0)]], "general"),  # y's slot first
        ([[("x", 0), ("y", 0)], [("x", 0), ("y", 0)]], "general"),  # two launches
        ([[("x", 0), ("y", 0), ("ws", 0)]], "general"),  # a workspace
        ([[("x", 0), ("y", 0), ("y", 8)]], "general"),  # y at two offsets
        ([[("x", 0), ("y_t", 0)]], "general"),  # y not laid out like x
    ],
    ids=["one", "offset", "y-first", "two-launches", "workspace", "y-offsets", "y-unlike-x"],
)
def test_one_or_general(launcher, slots, closure):
    """``one`` for one input and one output made like it, at one address each, in that order, one launch;
    ``general`` otherwise; both launch with each role's new address at the recorded offset."""
    x, ws = torch.randn(4, 8), torch.empty(16)
    y = torch.empty(8, 4).t() if any(n == "y_t" for s in slots for n, _ in s) else torch.empty(4, 8)
    old = {"x": x, "y": y, "y_t": y, "ws": ws}
    launches = [(kernel(len(s)), [ptr(old[n], off) if off else old[n] for n, off in s]) for s in slots]
    r = record("k", launches, (x,), (y,), scratch=(ws,) if any(n == "ws" for s in slots for n, _ in s) else ())
    assert r.__name__ == closure
    x2 = torch.randn(4, 8)
    y2 = r(x2)
    assert (y2.shape, y2.stride(), y2.dtype) == (y.shape, y.stride(), y.dtype)
    new = {"x": x2, "y": y2, "y_t": y2}
    assert len(launcher.seen) == len(slots)
    for k, s in enumerate(slots):
        got = launcher.pointers(k)
        assert [got[i] for i, (n, _) in enumerate(s) if n != "ws"] == [ptr(new[n], off) for n, off in s if n != "ws"]
        assert all(got[i] != ptr(ws) for i, (n, _) in enumerate(s) if n == "ws")


@pytest.mark.parametrize("order", [(0, 2, 1), (1, 0, 2), (2, 1, 0)])
def test_two_inputs_one_output(launcher, order):
    """The backward's case (y and dy in, dx out made like y, one launch of the three, in any recorded order,
    y at an offset): ``two``, each new address at its slot and offset; a failed launch gives None."""
    y, dy, dx = torch.randn(4, 8), torch.randn(4, 8), torch.empty(4, 8)
    old = [ptr(y, 4), dy, dx]  # (y's slot from 4 bytes in)
    r = record("k", [(kernel(3), [old[i] for i in order])], (y, dy), (dx,))
    assert r.__name__ == "two"
    y2, dy2 = torch.randn(4, 8), torch.randn(4, 8)
    dx2 = r(y2, dy2)
    assert (dx2.shape, dx2.stride(), dx2.dtype) == (dx.shape, dx.stride(), dx.dtype)
    new = [ptr(y2, 4), ptr(dy2), ptr(dx2)]
    assert launcher.pointers() == tuple(new[i] for i in order)
    launcher.codes = [700]
    assert r(y2, dy2) is None


def test_a_failed_launch_returns_none(launcher):
    """A replay whose launch returns a code (not 0) returns None (the full path then runs and reports), having
    recorded no plan; ``general`` launches nothing after the failed launch."""
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    one = record("one", [(kernel(2), (x, y))], (x,), (y,))
    general = record("general", [(kernel(2, 0xB), (x, y)), (kernel(2, 0xC), (x, y))], (x,), (y,))
    heuristics.record(OTHER)
    launcher.codes = [700]
    assert one(x) is None and len(launcher.seen) == 1
    launcher.codes = [700]
    assert general(x) is None and [f for f, _, _ in launcher.seen[1:]] == [0xB]
    launcher.codes = [0, 700]
    assert general(x) is None and [f for f, _, _ in launcher.seen[2:]] == [0xB, 0xC]
    assert heuristics.last_plan() is OTHER
    assert one(x) is not None and heuristics.last_plan() is PLAN


# ---- what is not kept --------------------------------------------------------------------------------------


@pytest.mark.parametrize("why", ["no-role", "copied", "not-recorded", "no-launches", "misaligned-output"])
def test_no_replay_is_kept(launcher, why):
    """An address with no role (a tensor made during the call), a plan that copied an input into another
    layout, a launch that was not recorded (Triton's own), no launches at all, an output not on a 16-byte
    boundary: nothing is kept (the full path runs each time)."""
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    launches, plan, ok = [(kernel(2), (x, y))], PLAN, True
    if why == "no-role":
        launches = [(kernel(3), (x, y, torch.empty(3)))]
    elif why == "copied":
        plan = heuristics.Plan("triton", "rowblock", copied=True)
    elif why == "not-recorded":
        ok = False
    elif why == "no-launches":
        launches = []
    else:
        y = torch.empty(33)[1:].view(4, 8)
        launches = [(kernel(2), (x, y))]
    assert record("k", launches, (x,), (y,), ok=ok, plan=plan) is None and replay.entries() == []


def test_no_replay_without_a_recording_or_a_plan(launcher):
    """store() with no recording, or on a thread that recorded no plan: nothing kept."""
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    heuristics.record(PLAN)
    replay.store("k", None, (x,), (y,))
    errors = []

    def fresh_thread():  # (heuristics.last_plan() is per thread: None on a new one)
        try:
            rec = replay.start("k")
            launch.recorded(kernel(2), (x, y))
            assert heuristics.last_plan() is None
            replay.store("k", rec, (x,), (y,))
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=fresh_thread)
    th.start()
    th.join()
    assert errors == [] and replay.entries() == []
    assert record("k", [(kernel(2), (x, y))], (x,), (y,)) is not None  # (the same call, with a plan, is kept)


def test_aliased_inputs_keep_their_own_roles(launcher):
    """Two inputs that share memory when recorded (dy is y; dy a view inside y's span, as two halves of one
    buffer's rows) have the same keys as two separate tensors of those layouts: a replay must then launch
    with each input's own address, or not be kept."""
    buf = torch.randn(4, 16)
    for y, dy in ((buf, buf), (buf[:, :8], buf[:, 8:])):
        replay.clear()
        dx = torch.empty_like(y)
        r = record("k", [(kernel(3), (y, dx, dy))], (y, dy), (dx,))
        y2, dy2 = torch.randn(4, 16)[:, : y.shape[1]], torch.randn(4, 16)[:, -dy.shape[1] :]
        assert replay.tensor_key(y2) == replay.tensor_key(y) and replay.tensor_key(dy2) == replay.tensor_key(dy)
        if r is not None:
            dx2 = r(y2, dy2)
            assert launcher.pointers() == (ptr(y2), ptr(dx2), ptr(dy2)), "dy's slot took y's address"


def test_start_and_stop(launcher, monkeypatch):
    """start(): no recording without a key or with MAX_ENTRIES kept; else the thread's recording until stop()."""
    x, y = torch.randn(4, 8), torch.empty(4, 8)
    assert replay.start(None) is None and launch.recording() is None
    rec = replay.start("k")
    assert rec is launch.recording() is not None
    replay.stop()
    assert launch.recording() is None
    assert record("k", [(kernel(2), (x, y))], (x,), (y,)) is not None
    monkeypatch.setattr(replay, "MAX_ENTRIES", 1)
    assert replay.start("k2") is None and launch.recording() is None


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")
def test_a_replay_through_fastlaunch(tmp_path, monkeypatch):
    """With fastlaunch.c itself (built into a private cache): a launch with nothing to run (an empty grid)
    returns 0 without the driver, so the replay returns its output; the replay holds its launches' calls only
    (each keeps its Desc alive)."""
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(launch, "_native_mod", [])
    monkeypatch.setattr(launch, "raw_stream", lambda: lambda index: 0)
    replay.clear()
    try:
        x, y = torch.randn(4, 8), torch.empty(4, 8)
        r = record("k", [(kernel(2, grid=(0, 1, 1)), (x, y))], (x,), (y,))
        assert r.__name__ == "one"
        gc.collect()
        y2 = r(torch.randn(4, 8))
        assert y2.shape == (4, 8) and heuristics.last_plan() is PLAN
    finally:
        replay.clear()


# ---- which calls are keyed, and by what --------------------------------------------------------------------


def test_tensor_key():
    """Shape, strides, dtype, the negation bit and the address modulo 16; for an address off the 16-byte
    boundary, the storage's too (the kernels then address the tensor from the boundary below it)."""
    a, b = torch.randn(64), torch.randn(64)
    assert replay.tensor_key(a[:48].view(6, 8)) == (torch.Size([6, 8]), (8, 1), torch.float32, False, 0)
    negated = torch._neg_view(a[:48].view(6, 8))  # (its memory is -its value)
    assert replay.tensor_key(negated) == (torch.Size([6, 8]), (8, 1), torch.float32, True, 0)
    assert replay.tensor_key(b[4:52].view(6, 8)) == replay.tensor_key(a[:48].view(6, 8))  # 16 bytes on
    keys = [replay.tensor_key(t) for t in (a[:48].view(6, 8), a[:48].view(8, 6), a[:48].view(6, 8).t())]
    keys += [replay.tensor_key(t) for t in (a[:48].double().view(6, 8), a[1:49].view(6, 8), a[2:50].view(6, 8))]
    assert len(set(keys)) == len(keys)
    assert replay.tensor_key(a[1:49]) == (torch.Size([48]), (1,), torch.float32, False, (4, 0))
    raw = bytearray(256)
    off = (3 - ctypes.addressof(ctypes.c_char.from_buffer(raw))) % 16  # a storage 3 bytes off the boundary
    unaligned = torch.frombuffer(raw, dtype=torch.uint8, offset=off)[5:37]
    aligned = torch.empty(64, dtype=torch.uint8)[8:40]  # the same address modulo 16, its storage aligned
    assert replay.tensor_key(unaligned) == (torch.Size([32]), (1,), torch.uint8, False, (8, 3))
    assert replay.tensor_key(aligned) == (torch.Size([32]), (1,), torch.uint8, False, (8, 0))


class _LooksCuda(torch.Tensor):
    """A tensor subclass that says it is on a GPU."""

    @property
    def is_cuda(self):
        return True


def test_keys_hold_every_tensors_device():
    """softmax_key and loss_key hold each tensor's device (the public functions look a call up before the
    checks that refuse tensors on two devices)."""
    x, t, w = torch.randn(4, 9), torch.zeros(4, dtype=torch.long), torch.ones(9)
    (kx, dx), (kt, dt), (kw, dw) = replay.loss_key((x, t, w), -100, "mean")[0]
    assert (dx, dt, dw) == (-1, -1, -1) and kw == replay.tensor_key(w)
    assert replay.loss_key((x, t, None), -100)[0][2] is None
    key = replay.softmax_key(x, x, 1, torch.float32, False, "auto")
    assert key[2:4] == (-1, -1)


def test_replayable_takes_plain_calls_only(monkeypatch):
    """Tensors of type torch.Tensor, all on the CPU or all on a GPU (not a subclass, even one that says it is
    on a GPU, nor a meta tensor), with FASTSOFTMAX_REPLAY not 0, outside heuristics.force; None entries are
    skipped. A kept replay leaves the call to the full path (_held) under heuristics.force (overrides or
    poison) and while a launch hook is registered with Triton."""
    from triton import knobs

    monkeypatch.setattr(replay, "ENABLED", True)
    assert replay.replayable() and replay.replayable(None, None)
    assert replay.replayable(torch.empty(2)) and replay.replayable(None, torch.empty(2), torch.empty(3))
    sub = torch.empty(2).as_subclass(_LooksCuda)
    assert sub.is_cuda and type(sub) is not torch.Tensor
    meta = torch.empty(2, device="meta")
    for args in ((sub,), (torch.nn.Parameter(torch.empty(2)),), (meta,), (torch.empty(2), meta)):
        assert not replay.replayable(*args), args
    assert not replay._held()
    with heuristics.force(path="online"):
        assert replay._held() and not replay.replayable(torch.empty(2))  # (nothing recorded under force)
    with heuristics.force(poison=True):
        assert replay._held() and not replay.replayable()
    for name in ("launch_enter_hook", "launch_exit_hook"):
        with triton_hook(knobs.runtime, name, lambda *a: None):
            assert replay._held()
    assert not replay._held()
    monkeypatch.setattr(replay, "ENABLED", False)
    assert not replay.replayable(torch.empty(2)) and not replay.replayable()


def test_replayable_takes_a_plain_cuda_tensor(device, monkeypatch):
    if device != "cuda":
        pytest.skip("needs a GPU (--device cuda)")
    monkeypatch.setattr(replay, "ENABLED", True)
    x = torch.empty(2, device="cuda")
    assert replay.replayable(x, None, x) and not replay.replayable(x, torch.empty(2))
