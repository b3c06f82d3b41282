"""The eager replay (kernels/replay.py) and the prepared launches (kernels/launch.py) on a GPU: a plain call
seen before replays its recorded launches, bit-identical to the full path, for each path of both backends and
for the cross-entropy kernels; the full path launches through launch.py only (Triton's own launcher never);
what a replay keys and what is never recorded (heuristics.force, Triton launch hooks); four threads at once,
and a new thread whose first call is a replay. Skipped without CUDA; run with
`pytest --device cuda tests/test_gpu_replay.py`."""

import pytest
import torch
from helpers import pass_through_mode, triton_hook

import fastsoftmax as fs
from fastsoftmax import dispatch, heuristics
from fastsoftmax.heuristics import tables
from fastsoftmax.kernels import launch, replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def no_replays_kept():
    """Each test starts and ends with no replay kept (the keys of one test's tensors are not another's)."""
    replay.clear()
    yield
    replay.clear()


def count_calls(monkeypatch, module, name):
    """A list that grows by one at each call of module.name (patched for the test)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def replay_names():
    """The kept replays' closures, sorted: ``one`` (one launch, x in and y out) or ``general``."""
    return sorted(r.__name__ for r in replay.entries())


REPLAY_CASES = [  # (shape, backend, the path the full path picks there)
    ((4096, 1000), "triton", "rowblock"),
    ((2048, 50257), "triton", "online"),
    ((8, 65536), "triton", "split"),
    ((4096, 1000), "cuda", "warp"),
    ((1024, 8192), "cuda", "block"),
    ((16, 131072), "cuda", "cluster"),
    ((2, 1 << 21), "cuda", "online"),
    ((16, 131072), "auto:cuda/staged", "staged"),  # the tuning table's pick made staged (cuda never picks it)
]


@pytest.mark.parametrize("shape,backend,path", REPLAY_CASES)
def test_replay_is_bit_identical_to_the_full_path(monkeypatch, shape, backend, path):
    """A plain call's second run replays the recorded launches without dispatching again: bit-identical
    output, the same plan recorded, forward and backward, softmax and log_softmax, each path of each
    backend, on every Triton release; one replay per key, `one` for the forward of a single launch with no
    workspace, `two` for the backward of one (y and dy in), `general` for the split path (two launches, a
    workspace)."""
    if not replay.ENABLED:
        pytest.skip("FASTSOFTMAX_REPLAY=0")
    if backend.startswith("auto:"):
        pick = tuple(backend[5:].split("/"))
        monkeypatch.setattr(tables, "choose", lambda *a, **k: pick)
        backend = "auto"
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    selected = count_calls(monkeypatch, dispatch, "select")
    for f, fb in ((fs.softmax, fs.softmax_backward), (fs.log_softmax, fs.log_softmax_backward)):
        ref_y = f(x, backend=backend)
        assert heuristics.last_plan().path == path
        ref_dx = fb(dy, ref_y, backend=backend)
        bwd_plan = heuristics.last_plan()
        n = len(selected)
        for _ in range(2):
            heuristics.record(None)
            y = f(x, backend=backend)
            assert heuristics.last_plan().path == path
            dx = fb(dy, y, backend=backend)
            assert heuristics.last_plan() == bwd_plan
            torch.cuda.synchronize()
            assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx), (shape, backend)
        assert len(selected) == n, (len(selected), n)  # replayed: no dispatch
    names = replay_names()
    assert len(names) == 4 and set(names) <= {"one", "two", "general"}, names
    if path in ("rowblock", "warp", "block"):
        assert names == ["one", "one", "two", "two"], names
    if path == "split":
        assert names == ["general"] * 4, names


def test_replay_under_torchs_dispatcher_states(monkeypatch):
    """The replay sits inside the custom ops' implementation, below torch's dispatcher, so every state the
    dispatcher decides (autograd, autocast, a dispatch mode, a forward-mode AD level, a torch.func transform,
    torch.compile) gives the right result whether or not a replay ran; under heuristics.force nothing is
    replayed or recorded (the full path dispatches); a plain call then still replays."""
    import torch.autograd.forward_ad as fwad

    x = torch.randn(64, 1000, device="cuda") * 3
    ref = torch.softmax(x.double(), -1)
    tol = dict(rtol=2e-6, atol=1e-6)  # (fp32 outputs against float64: the fp32 tolerance, not float64's)
    fs.softmax(x)  # recorded
    assert replay_names() == ["one"]
    calls = count_calls(monkeypatch, dispatch, "select")
    torch.testing.assert_close(fs.softmax(x).double(), ref, **tol)
    assert not calls  # replayed
    states = {
        "autograd": lambda: fs.softmax(x.clone().requires_grad_()),
        "autocast": lambda: _within(torch.autocast("cuda"), lambda: fs.softmax(x)),
        "dispatch mode": lambda: _within(pass_through_mode(), lambda: fs.softmax(x)),
        "forward AD": lambda: _within(fwad.dual_level(), lambda: fs.softmax(x)),
        "vmap": lambda: torch.func.vmap(fs.softmax)(x.view(8, 8, 1000)).view(64, 1000),
        "compile": lambda: torch.compile(fs.softmax, fullgraph=True)(x),
    }
    for name, run in states.items():
        torch.testing.assert_close(run().double(), ref, **tol, msg=name)
    n, kept = len(calls), replay.entries()
    y = _within(heuristics.force(path="rowblock"), lambda: fs.softmax(x))
    torch.testing.assert_close(y.double(), ref, **tol)
    assert len(calls) > n and replay.entries() == kept  # the full path, and nothing recorded
    n = len(calls)
    torch.testing.assert_close(fs.softmax(x).double(), ref, **tol)
    assert len(calls) == n  # replayed again


def _within(ctx, fn):
    with ctx:
        return fn()


LAUNCH_CASES = [
    ((4096, 1000), "triton", "rowblock", 1),
    ((8, 65536), "triton", "split", 2),
    ((16, 131072), "cuda", "cluster", 1),
]  # (..., launches of the forward)


def test_full_path_launches_through_launch_py(monkeypatch):
    """The full path of both backends launches through launch.py's prepared launches (each one reported to
    launch.recorded, a launch.Launch: a forward's launches counted once each, the split path's two), Triton's
    kernels on every Triton release, and Triton's own launcher is never called; the replay of the same call
    then launches without the full path (nothing reported), bit-identical."""
    from triton.runtime.jit import JITFunction

    launched = count_calls(monkeypatch, launch, "recorded")
    triton_launches = []  # kernel[grid](...): Triton's own launch (it would launch nothing here)

    def tritons_launch(self, grid):
        triton_launches.append(grid)
        return lambda *a, **k: None

    monkeypatch.setattr(JITFunction, "__getitem__", tritons_launch)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for shape, backend, path, n_launches in LAUNCH_CASES:
        replay.clear()
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
        dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        del launched[:]
        ref_y = fs.softmax(x, backend=backend)
        assert heuristics.last_plan().path == path and len(launched) == n_launches, (shape, len(launched))
        assert all(isinstance(ln, launch.Launch) for ln, _ in launched)
        ref_dx = fs.softmax_backward(dy, ref_y, backend=backend)
        del launched[:]
        for _ in range(2):
            y, dx = fs.softmax(x, backend=backend), fs.softmax_backward(dy, ref_y, backend=backend)
            torch.cuda.synchronize()
            assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx), shape
        assert not launched  # replayed: no full path
        assert len(replay.entries()) == 2, replay_names()
    assert not triton_launches


def test_compiled_kernel_memo_matches_tritons_choice():
    """triton/launch.compiled() skips Triton's argument binding after the first call of a specialisation: for
    arguments Triton specialises differently (a pointer 16-byte aligned or not, an int equal to 1, divisible
    by 16 or neither) it must hand back the very CompiledKernel Triton's own lookup picks, and the launch
    through it must compute the right thing."""
    from fastsoftmax.kernels.triton import launch as tl_launch
    from fastsoftmax.kernels.triton import lm_head as ce

    base = torch.randn(4099, device="cuda")
    g = torch.full((1,), 3.0, device="cuda")
    kw = dict(BLOCK=ce.SCALE_BLOCK, num_warps=4)
    seen = set()
    for x in (base[:4096], base[1:4097], base[3:4099]):  # aligned, then 4 and 12 bytes off
        for n in (1, 16, 17, 4096):
            args = (x, n, g)
            mine = tl_launch.compiled(ce.scale_by, (1,), args, kw, 0)
            again = tl_launch.compiled(ce.scale_by, (1,), args, kw, 0)  # the memo's hit
            theirs = ce.scale_by.run(*args, grid=(1,), warmup=True, **kw)
            assert mine is theirs and again is theirs, (x.data_ptr() % 16, n)
            seen.add(id(theirs))
            ref = x.clone()
            ref[:n] *= 3.0
            tl_launch.launch(ce.scale_by, (1,), args, kw)
            torch.cuda.synchronize()
            assert torch.equal(x, ref), (x.data_ptr() % 16, n)
    assert len(seen) >= 4  # Triton itself told these apart: the memo did too


def test_launch_hooks_take_tritons_own_launch():
    """With a launch hook registered with Triton (what a profiler does), the Triton kernels launch through
    kernel[grid](...) so the hook sees each launch, also of a call replayed before the hook came; nothing is
    replayed or recorded, and results are right; once it is removed, launches go through launch.py and
    replay again."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    x = torch.randn(64, 1000, device="cuda") * 3
    x2 = torch.randn(32, 1000, device="cuda")
    fs.softmax(x2, backend="triton")  # (recorded before the hook)
    kept = replay.entries()
    with triton_hook(knobs.runtime, "launch_enter_hook", hook):
        assert not launch.hooks_idle() and replay._held()
        for _ in range(3):
            y = fs.softmax(x, backend="triton")
            torch.testing.assert_close(y, torch.softmax(x, -1))
        torch.testing.assert_close(fs.log_softmax(x, backend="triton"), torch.log_softmax(x, -1))
        torch.testing.assert_close(fs.softmax(x2, backend="triton"), torch.softmax(x2, -1))
        assert len(seen) == 5 and replay.entries() == kept
    replay.clear()
    assert launch.hooks_idle()
    for _ in range(2):
        torch.testing.assert_close(fs.softmax(x, backend="triton"), torch.softmax(x, -1))
    assert len(seen) == 5 and replay_names() == ["one"]


def test_replays_from_four_threads():
    """Threads replaying the same replays at once (a replay's Launch is only read: each call fills its own
    copy of the argument bytes), and a new thread whose first CUDA call is a replay (no current context yet:
    the replay's launch fails and it returns None, the full path makes the context current and launches):
    every output right."""
    import threading

    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(64, n, device="cuda", generator=gen) * 3 for n in (1000, 4096)]
    refs = [[fs.softmax(x, backend=b) for x in xs] for b in ("triton", "cuda")]
    torch.cuda.synchronize()
    assert len(replay.entries()) == 4
    bad = []

    def work(seed):
        for i in range(200):
            b, j = (seed + i) % 2, (seed * 7 + i // 2) % 2
            y = fs.softmax(xs[j], backend=("triton", "cuda")[b])
            torch.cuda.current_stream().synchronize()
            if not torch.equal(y, refs[b][j]):
                bad.append((seed, i))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad, bad[:5]
    assert len(replay.entries()) == 4


def test_what_a_replay_keys():
    """A forced path is never recorded; a different output dtype is its own key; non-dense and
    16-byte-misaligned inputs (their strides and address modulo 16 are in the key) replay bit-identically to
    their full path, as calls under autograd do; a replay launches on the current stream (a side stream)."""
    x = torch.randn(64, 1001, device="cuda")
    with heuristics.force(path="online"):
        fs.softmax(x[:, :1000], backend="triton")
    assert not replay.entries()
    for view in (x[:, :1000], x.view(-1)[1:65].view(1, 64), x.view(-1)[3:1003].view(1, 1000)):
        first = fs.softmax(view, backend="triton")
        torch.testing.assert_close(first, torch.softmax(view, -1))
        for _ in range(2):
            assert torch.equal(fs.softmax(view, backend="triton"), first)
    xg = x.clone().requires_grad_()
    grads = []
    for _ in range(2):
        fs.softmax(xg).sum().backward()
        grads.append(xg.grad)
        xg.grad = None
    assert torch.equal(grads[0], grads[1])
    replay.clear()
    y32 = fs.softmax(x)
    y16 = fs.softmax(x, dtype=torch.bfloat16)
    assert len(replay.entries()) == 2
    assert y16.dtype == torch.bfloat16 and fs.softmax(x, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(fs.softmax(x), y32)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(20):
            y_side = fs.softmax(x)
    torch.cuda.current_stream().wait_stream(s)
    assert torch.equal(y_side, y32)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_replay_refuses_dy_on_another_gpu():
    """A backward whose dy is on another GPU raises as the full path does, also once the same call (dy on
    y's GPU) has been recorded for replay."""
    y = fs.softmax(torch.randn(8, 1000, device="cuda:0"))
    dy = torch.randn(8, 1000, device="cuda:0")
    fs.softmax_backward(dy, y)
    fs.softmax_backward(dy, y)  # recorded, then replayed
    with pytest.raises(ValueError, match="dy is on cuda:1"):
        fs.softmax_backward(dy.to("cuda:1"), y)


CE_REPLAY_CASES = [  # (logits shape, dtype, options)
    ((8, 4096), torch.bfloat16, dict()),
    ((3, 5, 1000), torch.float32, dict(reduction="none", label_smoothing=0.1)),
    ((64, 50257), torch.float16, dict(z_loss=1e-3, return_z_loss=True, softcap=30.0, ignore_index=7)),
    ((1024, 32000), torch.bfloat16, dict(reduction="sum")),
]


@pytest.mark.parametrize("shape,dtype,opts", CE_REPLAY_CASES)
def test_cross_entropy_replay(monkeypatch, shape, dtype, opts):
    """fs.cross_entropy seen before is replayed (its forward and its backward, one replay each): no launch
    through the full path, forward and backward bit-identical to the full path's, and right against float64
    torch; the backward with create_graph=True leaves the replay for torch ops and gives torch's second
    derivatives."""
    launched = count_calls(monkeypatch, launch, "recorded")
    gen = torch.Generator(device="cuda").manual_seed(11)
    v = shape[-1]
    x = (torch.randn(shape, device="cuda", generator=gen) * 4).to(dtype)
    t = torch.randint(0, v, shape[:-1], device="cuda", generator=gen)
    t.view(-1)[::5] = opts.get("ignore_index", -100)
    want_z = opts.get("return_z_loss", False)

    def step():
        xg = x.clone().requires_grad_()
        out = fs.cross_entropy(xg, t, **opts)
        loss = out[0] if want_z else out
        g = torch.full_like(loss, 1.5)
        (dx,) = torch.autograd.grad(loss, xg, g)
        return out, dx, g

    ref_out, ref_dx, _ = step()  # the full path, recorded: the forward's launches and the backward's
    assert launched and len(replay.entries()) == 2, (len(launched), replay_names())
    del launched[:]
    for _ in range(2):
        out, dx, g = step()
        torch.cuda.synchronize()
        assert not launched, "the replay launched through the full path"
        for a, b in zip(out if want_z else (out,), ref_out if want_z else (ref_out,), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(dx, ref_dx)
        assert heuristics.last_plan().backend == "triton"
    # against float64 torch (the z-loss and softcap in torch ops: fastsoftmax.core.reference's definitions)
    x64 = x.double().requires_grad_()
    ref = fs.cross_entropy(x64, t, **opts)  # float64: the torch path, never replayed
    ref = ref[0] if want_z else ref
    (d64,) = torch.autograd.grad(ref, x64, g.double())
    loss = out[0] if want_z else out
    tol = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-3), torch.float16: (4e-3, 1e-4)}[dtype]
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=tol[0], atol=tol[1] * 10)
    torch.testing.assert_close(dx.double(), d64, rtol=tol[0], atol=tol[1])
    # create_graph=True: a replayed forward, its backward in torch ops, differentiable once more
    if dtype == torch.float32:
        xg = x.clone().requires_grad_()
        out = fs.cross_entropy(xg, t, **opts)
        assert not launched
        loss = (out[0] if want_z else out).sum()
        (dx,) = torch.autograd.grad(loss, xg, create_graph=True)
        (ddx,) = torch.autograd.grad((dx * dx).sum(), xg)
        x64 = x.double().requires_grad_()
        (d64,) = torch.autograd.grad(fs.cross_entropy(x64, t, **opts).sum(), x64, create_graph=True)
        (dd64,) = torch.autograd.grad((d64 * d64).sum(), x64)
        torch.testing.assert_close(ddx.double(), dd64, rtol=1e-4, atol=1e-6)


def test_a_replayed_loss_keys_every_tensors_device():
    """A cross-entropy call recorded with its class weights on the GPU, then made with them on the CPU: the
    checks' error, not a replay that hands the kernels a host address (the key once held the logits' device
    only, and an illegal memory access followed)."""
    x = torch.randn(4, 9, device="cuda")
    t = torch.zeros(4, dtype=torch.long, device="cuda")
    for _ in range(2):
        fs.cross_entropy(x, t, class_weight=torch.ones(9, device="cuda"))
    with pytest.raises(ValueError, match="class_weight is on cpu"):
        fs.cross_entropy(x, t, class_weight=torch.ones(9))
    torch.cuda.synchronize()
