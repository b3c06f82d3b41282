"""The same checks at sizes only a GPU runs: every path on large, odd and prime shapes; a tensor of more
than 2^31 elements (64-bit indexing) on the rowblock and the online path; non-default streams. Skipped
without CUDA; run with `pytest --device cuda tests/test_gpu.py`."""

import pytest
import torch
from helpers import DTYPES, assert_close, forward, pass_through_mode, random_logits, special_rows, triton_hook

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import tables
from fastsoftmax.core.reference import oracle, oracle_lse

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [
    ((8192, 1024), None),
    ((4096, 513), None),
    ((1024, 16384), None),
    ((256, 32000), None),
    ((128, 50257), None),
    ((32, 151936), None),
    ((4, 1 << 20), None),
    ((8192, 1024), "online"),
    ((1024, 12289), "rowblock"),
]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,path", SHAPES)
def test_large(shape, path, dtype, log):
    gen = torch.Generator().manual_seed(shape[1])
    x = random_logits(shape, dtype, gen)
    x[: min(9, shape[0])] = special_rows(shape[1], dtype, gen)[: shape[0]]
    x = x.cuda()
    with heuristics.force(poison=True, **({"path": path} if path else {})):
        y = (fs.log_softmax if log else fs.softmax)(x, backend="triton")
    plan = heuristics.last_plan()
    assert plan.backend == "triton" and (path is None or plan.path == path)
    assert_close(y, x, -1, log)


@pytest.mark.parametrize("path", ["rowblock", "online"])
@pytest.mark.parametrize(
    "make,dim",
    [
        (lambda b: b.t(), -1),
        (lambda b: b, 0),
        (lambda b: b[:, 7:1000], -1),
        (lambda b: b.view(64, 64, 1024).permute(1, 2, 0), 1),
        (lambda b: b.view(16, 256, 16, 64).to(memory_format=torch.channels_last), 1),
    ],
)
def test_large_non_contiguous(make, dim, path):
    gen = torch.Generator().manual_seed(11)
    x = make(random_logits((4096, 1024), torch.bfloat16, gen).cuda())
    with heuristics.force(poison=True, path=path):
        y = fs.softmax(x, dim, backend="triton")
    assert heuristics.last_plan().path == path
    assert_close(y, x, dim, False)


def test_logsumexp_large():
    gen = torch.Generator().manual_seed(12)
    x = random_logits((512, 50257), torch.bfloat16, gen).cuda()
    y, lse = forward(x, -1, want_lse=True, backend="triton")
    torch.testing.assert_close(lse.double(), oracle_lse(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_side_stream(backend):
    x = torch.randn(4096, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = fs.softmax(x, backend=backend)
    s.synchronize()
    assert_close(y, x, -1, False)


@pytest.mark.parametrize("n,path", [(1024, "rowblock"), (1 << 25, "online")])
def test_more_than_2_pow_31_elements(n, path):
    """bf16 rows whose element offsets pass 2^31: rows at both ends and across the boundary are checked
    against the oracle, and every element must have been written (no NaN left from the poison)."""
    rows = (1 << 31) // n + 3
    assert rows * n > 2**31
    torch.manual_seed(13)
    x = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    x[-1] = float("-inf")  # the last row fully masked: all zeros
    with heuristics.force(poison=True, path=path):
        y = fs.softmax(x, backend="triton")
    assert heuristics.last_plan().path == path
    assert not y.isnan().any()
    boundary = (1 << 31) // n
    for r in sorted({0, 1, boundary - 1, boundary, boundary + 1, rows - 2}):
        ref = oracle(x[r])
        err = (y[r].double() - ref).abs().max().item()
        assert err <= 2**-7 * ref.abs().max().item() + 1e-6, (r, err)
    assert (y[-1] == 0).all()
    sums = y[:-1].sum(-1, dtype=torch.float32)
    assert ((sums - 1).abs() < 1e-2).all()


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "shape,path",
    [
        ((8192, 1024), None),
        ((4096, 513), None),
        ((256, 16384), None),
        ((256, 50257), None),
        ((8, 131072), None),
        ((4096, 1024), "online"),
        ((512, 4096), "split"),
    ],
)
def test_backward_large(shape, path, dtype, log):
    from fastsoftmax.core.reference import compare_grad

    gen = torch.Generator().manual_seed(shape[1] + 1)
    x = random_logits(shape, dtype, gen)
    x[: min(9, shape[0])] = special_rows(shape[1], dtype, gen)[: shape[0]]
    x = x.cuda().requires_grad_()
    dy = torch.randn(shape, generator=gen).to(dtype).cuda()
    with heuristics.force(poison=True, **({"path": path} if path else {})):
        y = (fs.log_softmax if log else fs.softmax)(x, backend="triton")
        (dx,) = torch.autograd.grad(y, x, dy)
    plan = heuristics.last_plan()
    assert plan.backend == "triton" and (path is None or plan.path == path)
    err, problem = compare_grad(dx, dy, y.detach(), -1, log)
    assert problem is None, problem


def test_backward_more_than_2_pow_31_elements():
    n = 1024
    rows = (1 << 31) // n + 3
    y = fs.softmax(torch.empty(rows, n, device="cuda", dtype=torch.bfloat16).normal_(0, 3))
    dy = torch.empty_like(y).normal_()
    with heuristics.force(poison=True):
        dx = fs.softmax_backward(dy, y, backend="triton")
    assert not dx.isnan().any()
    from fastsoftmax.core.reference import oracle_backward

    for r in (0, (1 << 31) // n, rows - 1):
        ref = oracle_backward(dy[r], y[r])
        assert (dx[r].double() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item() + 1e-5


def test_cuda_graph_forward_backward():
    """Capture one forward + backward step in a CUDA graph, replay it on new data, compare with eager."""
    torch.manual_seed(15)
    lin = torch.nn.Linear(256, 4096).cuda()
    static_x = torch.randn(64, 256, device="cuda")
    static_w = torch.randn(64, 4096, device="cuda")

    def step():
        lin.zero_grad(set_to_none=False)
        loss = (fs.log_softmax(lin(static_x), -1) * static_w).sum() + (fs.softmax(lin(static_x), -1) ** 2).sum()
        loss.backward()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()  # warm up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_loss = step()
    for _ in range(3):
        static_x.copy_(torch.randn(64, 256, device="cuda"))
        g.replay()
        ref_loss = step()
        ref_grad = lin.weight.grad.clone()
        g.replay()
        torch.testing.assert_close(static_loss, ref_loss)
        torch.testing.assert_close(lin.weight.grad, ref_grad)


FAST_CASES = [  # (shape, backend, the path the full path picks there)
    ((4096, 1000), "triton", "rowblock"),
    ((2048, 50257), "triton", "online"),
    ((8, 65536), "triton", "split"),
    ((4096, 1000), "cuda", "warp"),
    ((1024, 8192), "cuda", "block"),
    ((16, 131072), "cuda", "cluster"),
    ((2, 1 << 21), "cuda", "online"),
    ((16, 131072), "auto:cuda/staged", "staged"),  # the tuning table's pick made staged (cuda never picks it)
]


@pytest.mark.parametrize("shape,backend,path", FAST_CASES)
def test_fast_path_replays_bit_identical(monkeypatch, shape, backend, path):
    """A plain call's second run replays the recorded launches without dispatching again: bit-identical
    output, the same plan recorded, forward and backward, softmax and log_softmax, each path of each
    backend, on every Triton release, each entry of the one replay kind (launch.py's prepared launches)."""
    from fastsoftmax import dispatch
    from fastsoftmax.kernels import replay as fastpath

    if not fastpath.ENABLED:
        pytest.skip("FASTSOFTMAX_FAST_LAUNCH=0")
    if backend.startswith("auto:"):
        pick = tuple(backend[5:].split("/"))
        monkeypatch.setattr(tables, "choose", lambda *a, **k: pick)
        backend = "auto"
    fastpath.clear()
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    calls = []
    real = dispatch.select
    monkeypatch.setattr(dispatch, "select", lambda *a, **k: calls.append(1) or real(*a, **k))
    for f, fb in ((fs.softmax, fs.softmax_backward), (fs.log_softmax, fs.log_softmax_backward)):
        ref_y = f(x, backend=backend)
        assert heuristics.last_plan().path == path
        ref_dx = fb(dy, ref_y, backend=backend)
        bwd_plan = heuristics.last_plan()
        n = len(calls)
        for _ in range(2):
            heuristics.record(None)
            y = f(x, backend=backend)
            assert heuristics.last_plan().path == path
            dx = fb(dy, y, backend=backend)
            assert heuristics.last_plan() == bwd_plan
            torch.cuda.synchronize()
            assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx), (shape, backend)
        assert len(calls) == n, (len(calls), n)  # replayed: no dispatch
    kinds = {entry.kind for entry in fastpath._cache.values()}
    assert len(fastpath._cache) == 4 and kinds == {"prepared"}, kinds
    # one launch and no workspace: replayed inside fastlaunch.softmax_fast; the split path's two launches
    # and workspace: through the entry's own Python replay
    natives = [entry.native for entry in fastpath._cache.values()]
    if path in ("rowblock", "warp", "block"):
        assert all(n is not None for n in natives), natives
    if path == "split":
        assert all(n is None for n in natives), natives


def test_replay_in_c_steps_aside_where_it_must():
    """fastlaunch.softmax_fast replays a plain call with no dispatch, and steps aside for the full path under
    each state a replay must not run in: autograd, autocast, heuristics.force, a dispatch mode, a
    forward-mode AD level, a torch.func transform, torch.compile; every result right."""
    import torch.autograd.forward_ad as fwad

    from fastsoftmax import dispatch
    from fastsoftmax.kernels import replay as fastpath
    from fastsoftmax.kernels import launch

    fastpath.clear()
    x = torch.randn(64, 1000, device="cuda") * 3
    ref = torch.softmax(x.double(), -1)
    fs.softmax(x)  # recorded
    assert fastpath.fast is launch.native().softmax_fast
    calls = []
    real = dispatch.select
    dispatch.select = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        torch.testing.assert_close(fs.softmax(x).double(), ref)
        assert not calls  # replayed
        states = {
            "autograd": lambda: fs.softmax(x.clone().requires_grad_()),
            "autocast": lambda: _within(torch.autocast("cuda"), lambda: fs.softmax(x)),
            "force": lambda: _within(heuristics.force(path="rowblock"), lambda: fs.softmax(x)),
            "dispatch mode": lambda: _within(pass_through_mode(), lambda: fs.softmax(x)),
            "forward AD": lambda: _within(fwad.dual_level(), lambda: fs.softmax(x)),
            "vmap": lambda: torch.func.vmap(fs.softmax)(x.view(8, 8, 1000)).view(64, 1000),
            "compile": lambda: torch.compile(fs.softmax, fullgraph=True)(x),
        }
        for name, run in states.items():
            n = len(calls)
            y = run()
            torch.testing.assert_close(y.double(), ref, msg=name)
            assert len(calls) > n or name == "compile", name  # (compiled: the custom op, no eager dispatch)
        n = len(calls)
        torch.testing.assert_close(fs.softmax(x).double(), ref)
        assert len(calls) == n  # replayed again
    finally:
        dispatch.select = real


def _within(ctx, fn):
    with ctx:
        return fn()


_BAD_TARGET = r"""
import sys, torch, fastsoftmax as fs
from fastsoftmax.kernels import replay as fastpath
how = sys.argv[1]
x = torch.randn(8, 100, device="cuda")
t = torch.randint(0, 100, (8,), device="cuda")
if how == "replay":
    for _ in range(2):
        fs.cross_entropy(x, t)  # recorded, then replayed
    torch.cuda.synchronize()
    assert len(fastpath._loss_cache) == 1
t[3] = 100
if how == "lce":
    loss = fs.linear_cross_entropy(torch.randn(8, 16, device="cuda"), torch.randn(100, 16, device="cuda"), t)
else:
    loss = fs.cross_entropy(x, t)
torch.cuda.synchronize()
print("NO ERROR", float(loss))
"""


@pytest.mark.parametrize("how", ["full", "replay", "lce"])
def test_bad_target_stops_at_a_device_assertion(how):
    """A target outside [0, V) on CUDA stops at ce_finish's device-side assertion (in a process of its own:
    the CUDA context does not survive it): on the full path, in a replayed call, in the LM-head loss (before
    its first GEMM); the device prints the library's message, and the next CUDA call that reports fails
    (a synchronisation: 'device-side assert triggered'; cuBLAS's handle: its own error)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BAD_TARGET, how], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "NO ERROR" not in text, text[-2000:]
    assert "Assertion `cross_entropy: a target is outside [0, V) and not ignore_index` failed" in text, text[-2000:]
    assert "Error" in text, text[-2000:]


REPLAY_CASES = [
    ((4096, 1000), "triton", "rowblock", 1),
    ((8, 65536), "triton", "split", 2),
    ((16, 131072), "cuda", "cluster", 1),
]  # (..., launches of the forward)


def test_full_path_launches_through_launch_py(monkeypatch):
    """The full path of both backends launches through launch.submit (a prepared launch.Launch), Triton's
    kernels on every Triton release: a forward's launches each counted once (the split path's two), and
    Triton's own launcher never called; then the replay of the same call launches through the recorded
    Launches only, bit-identical."""
    from triton.runtime.jit import JITFunction

    from fastsoftmax.kernels import replay as fastpath
    from fastsoftmax.kernels import launch

    submitted = []
    real_submit = launch.submit
    monkeypatch.setattr(launch, "submit", lambda ln, *a: submitted.append(ln) or real_submit(ln, *a))
    triton_launches = []  # kernel[grid](...): Triton's own launch (it would launch nothing here)

    def tritons_launch(self, grid):
        triton_launches.append(grid)
        return lambda *a, **k: None

    monkeypatch.setattr(JITFunction, "__getitem__", tritons_launch)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for shape, backend, path, n_launches in REPLAY_CASES:
        fastpath.clear()
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
        dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        del submitted[:]
        ref_y = fs.softmax(x, backend=backend)
        assert heuristics.last_plan().path == path and len(submitted) == n_launches, (shape, len(submitted))
        assert all(isinstance(ln, launch.Launch) for ln in submitted)
        ref_dx = fs.softmax_backward(dy, ref_y, backend=backend)
        del submitted[:]
        for _ in range(2):
            y, dx = fs.softmax(x, backend=backend), fs.softmax_backward(dy, ref_y, backend=backend)
            torch.cuda.synchronize()
            assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx), shape
        assert not submitted  # replayed: no full path
        assert len(fastpath._cache) == 2 and {e.kind for e in fastpath._cache.values()} == {"prepared"}
    assert not triton_launches


def test_compiled_kernel_memo_matches_tritons_choice():
    """triton/launch.compiled() skips Triton's argument binding after the first call of a specialisation: for
    arguments Triton specialises differently (a pointer 16-byte aligned or not, an int equal to 1, divisible
    by 16 or neither) it must hand back the very CompiledKernel Triton's own lookup picks, and the launch
    through it must compute the right thing."""
    from fastsoftmax.kernels.triton import cross_entropy as ce
    from fastsoftmax.kernels.triton import launch as tl_launch

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
    kernel[grid](...) so the hook sees each launch, nothing is replayed, and results are right; once it is
    removed, launches go through launch.py and replay again."""
    from triton import knobs

    from fastsoftmax.kernels import replay as fastpath
    from fastsoftmax.kernels import launch

    seen = []

    def hook(metadata):
        seen.append(metadata)

    fastpath.clear()
    x = torch.randn(64, 1000, device="cuda") * 3
    with triton_hook(knobs.runtime, "launch_enter_hook", hook):
        assert not launch.hooks_idle()
        for _ in range(3):
            y = fs.softmax(x, backend="triton")
            torch.testing.assert_close(y, torch.softmax(x, -1))
        torch.testing.assert_close(fs.log_softmax(x, backend="triton"), torch.log_softmax(x, -1))
        assert len(seen) == 4 and not fastpath._cache
    assert launch.hooks_idle()
    for _ in range(2):
        torch.testing.assert_close(fs.softmax(x, backend="triton"), torch.softmax(x, -1))
    assert len(seen) == 4 and len(fastpath._cache) == 1


def test_fast_path_threads():
    """Threads replaying the same entries at once (a replay's Desc is only read: each call fills its own
    copy of the argument bytes), and a new thread whose first CUDA call is a replay (no current context yet:
    the replay steps aside, the full path makes the context current and launches): every output right."""
    import threading

    from fastsoftmax.kernels import replay as fastpath

    fastpath.clear()
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = [torch.randn(64, n, device="cuda", generator=gen) * 3 for n in (1000, 4096)]
    refs = [[fs.softmax(x, backend=b) for x in xs] for b in ("triton", "cuda")]
    torch.cuda.synchronize()
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
    assert len(fastpath._cache) == 4


def test_fast_path_keeps_off_what_it_cannot_replay():
    """Calls the replay must not take go through the full path every time: a forced path, a non-dense or
    16-byte-misaligned input, autograd, a different output dtype is its own key; a side stream is honoured."""
    from fastsoftmax.kernels import replay as fastpath

    fastpath.clear()
    x = torch.randn(64, 1001, device="cuda")
    with heuristics.force(path="online"):
        fs.softmax(x[:, :1000], backend="triton")
    assert not fastpath._cache
    fs.softmax(x[:, :1000], backend="triton")  # not dense: output strides differ from x's
    fs.softmax(x.view(-1)[1:65].view(1, 64), backend="triton")  # misaligned: read from a 16-byte boundary
    assert not fastpath._cache
    xg = x.clone().requires_grad_()
    fs.softmax(xg).sum().backward()
    assert not fastpath._cache
    y32 = fs.softmax(x)
    y16 = fs.softmax(x, dtype=torch.bfloat16)
    assert len(fastpath._cache) == 2
    assert y16.dtype == torch.bfloat16 and fs.softmax(x, dtype=torch.bfloat16).dtype == torch.bfloat16
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


def _lce_inputs(n, d, v, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, d, device="cuda", generator=g)
    x[::97] *= 20  # outliers
    w = torch.randn(v, d, device="cuda", generator=g) * d**-0.5
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    t[::7] = -100
    return x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_(), t


@pytest.mark.parametrize("design", heuristics.LCE_DESIGNS)
def test_lce_large_against_fp32(design):
    """The LM-head loss on cuBLAS and the compiled kernels, several chunks, an odd vocabulary: loss, dx and dW
    within 2x torch's own bf16 error (F.linear + F.cross_entropy) against an fp32 reference, plus an atol."""
    import torch.nn.functional as F

    x, w, t = _lce_inputs(3000, 512, 50257)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(F.linear(x32, w32), t, label_smoothing=0.1)
    f_dx, f_dw = torch.autograd.grad(ref, (x32, w32))
    tl_ = F.cross_entropy(F.linear(x, w), t, label_smoothing=0.1)
    t_dx, t_dw = torch.autograd.grad(tl_, (x, w))
    with heuristics.force(path=design, poison=True):
        loss = fs.linear_cross_entropy(x, w, t, label_smoothing=0.1, memory=700 * 50257 * 2)
        plan = heuristics.last_plan()
        dx, dw = torch.autograd.grad(loss * 0.5, (x, w))  # an upstream gradient other than 1
    assert plan.path == design and plan.backend == "triton" and plan.splits == 5
    for mine, torchs, fp32 in ((loss.float(), tl_.float(), ref), (dx * 2, t_dx, f_dx), (dw * 2, t_dw, f_dw)):
        err = (mine.float() - fp32).abs().max().item()
        assert err <= 2 * (torchs.float() - fp32).abs().max().item() + 1e-3 * fp32.abs().max().item(), err


def test_lce_peak_memory():
    """Peak memory above the inputs of a forward + backward is dW + dx + one chunk of logits (+1 MiB): a
    regression test (autograd used to make zero gradients shaped like dx and dW for the outputs carrying
    them, doubling the peak)."""
    n, d, v = 4096, 1024, 32000
    x, w, t = _lce_inputs(n, d, v)
    rows = 512

    def step():
        loss = fs.linear_cross_entropy(x, w, t, memory=rows * v * 2)
        return torch.autograd.grad(loss, (x, w))

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    budget = (v * d + n * d + rows * v) * 2 + (1 << 20)
    assert heuristics.last_plan().splits == n // rows
    assert peak <= budget, (peak, budget)
    del out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_lce_cuda_graph(reduction):
    """The LM-head loss (both designs: mean is lce_chunked, none lce_recompute) captured with its backward in
    a CUDA graph, replayed on new data, equals eager (no host synchronisation inside)."""
    x, w, t = _lce_inputs(1024, 256, 5003, torch.float32)
    cw = torch.rand(5003, device="cuda") + 0.5
    g_out = torch.rand(1024, device="cuda") if reduction == "none" else torch.tensor(0.75, device="cuda")

    def step():
        loss = fs.linear_cross_entropy(x, w, t, reduction=reduction, class_weight=cw, softcap=15.0, z_loss=1e-3)
        return (loss, *torch.autograd.grad(loss, (x, w), g_out))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in range(2):
        with torch.no_grad():
            x.copy_(_lce_inputs(1024, 256, 5003, torch.float32, seed + 1)[0])
        graph.replay()
        eager = step()
        for a, b in zip(static, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lce_scale_kernel_both_branches():
    """scale_by, the backward's in-place scaling: untouched (not read or written) when g == 1, scaled else."""
    from fastsoftmax.kernels.triton import cross_entropy as k

    a = torch.randn(10007, device="cuda", dtype=torch.bfloat16)
    b = a.clone()
    k.scale_(b, torch.tensor(1.0, device="cuda"))
    assert torch.equal(a, b)
    k.scale_(b, torch.tensor(-0.5, device="cuda"))
    torch.testing.assert_close(b.float(), (a.float() * -0.5).bfloat16().float(), rtol=0, atol=0)


CE_REPLAY_CASES = [  # (logits shape, dtype, options)
    ((8, 4096), torch.bfloat16, dict()),
    ((3, 5, 1000), torch.float32, dict(reduction="none", label_smoothing=0.1)),
    ((64, 50257), torch.float16, dict(z_loss=1e-3, return_z_loss=True, softcap=30.0, ignore_index=7)),
    ((1024, 32000), torch.bfloat16, dict(reduction="sum")),
]


@pytest.mark.parametrize("shape,dtype,opts", CE_REPLAY_CASES)
def test_cross_entropy_replay(monkeypatch, shape, dtype, opts):
    """fs.cross_entropy seen before is replayed (fastpath.loss_*): no launch through the full path's submit,
    forward and backward bit-identical to the full path's, and right against float64 torch; the backward
    with create_graph=True leaves the replay for torch ops and gives torch's second derivatives."""
    from fastsoftmax.kernels import replay as fastpath
    from fastsoftmax.kernels import launch

    submitted = []
    real_submit = launch.submit
    monkeypatch.setattr(launch, "submit", lambda ln, *a: submitted.append(ln) or real_submit(ln, *a))
    fastpath.clear()
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

    ref_out, ref_dx, _ = step()  # the full path, recorded
    assert len(fastpath._loss_cache) == 1 and len(submitted) == 3
    step()  # the first replayed forward; its backward is the full path's, recorded
    del submitted[:]
    for _ in range(2):
        out, dx, g = step()
        torch.cuda.synchronize()
        assert not submitted, "the replay launched through the full path"
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
        assert not submitted
        loss = (out[0] if want_z else out).sum()
        (dx,) = torch.autograd.grad(loss, xg, create_graph=True)
        (ddx,) = torch.autograd.grad((dx * dx).sum(), xg)
        x64 = x.double().requires_grad_()
        (d64,) = torch.autograd.grad(fs.cross_entropy(x64, t, **opts).sum(), x64, create_graph=True)
        (dd64,) = torch.autograd.grad((d64 * d64).sum(), x64)
        torch.testing.assert_close(ddx.double(), dd64, rtol=1e-4, atol=1e-6)
