"""backend="cuda" on a GPU: every variant forced, forward and backward, against the float64 oracle, on odd
shapes, special-value rows, unaligned and strided layouts, a different output dtype; autograd, logsumexp,
CUDA graphs, side streams, 64-bit offsets. Run with `pytest --device cuda tests/test_cuda.py`."""

import pytest
import torch
from helpers import DTYPES, assert_close, forward, overflowing_grad_inputs, random_logits, special_rows

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare_grad, oracle, oracle_lse
from fastsoftmax.heuristics import device as gpu
from fastsoftmax.heuristics import softmax_cuda, tables
from fastsoftmax.kernels.cuda import backend as cuda_backend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (variant, N): each variant on lengths it holds, odd ones first; the cluster and online lengths cross
# 16-byte vectors, CTAs of a cluster and (online) several sweeps per thread.
CASES = [
    ("three_pass", 1),
    ("three_pass", 513),
    ("three_pass", 4099),
    ("warp", 1),
    ("warp", 7),
    ("warp", 33),
    ("warp", 513),
    ("warp", 1000),
    ("block", 513),
    ("block", 4099),
    ("block", 12289),
    ("cluster", 513),
    ("cluster", 12289),
    ("cluster", 50257),
    ("cluster", 131072),
    ("online", 7),
    ("online", 4099),
    ("online", 50257),
]
# The staged variant: lengths that cross CTAs of a cluster (1 to 8) and 16 KiB pieces of the bulk copy.
STAGED_CASES = [("staged", 1), ("staged", 7), ("staged", 513), ("staged", 12289), ("staged", 50257), ("staged", 131072)]
FNS = {False: fs.softmax, True: fs.log_softmax}


def logits(rows, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([random_logits((rows, n), dtype, gen), special_rows(n, dtype, gen)])
    return x.cuda()


def run_forward(x, dim, log, variant, out_dtype=None):
    with heuristics.force(poison=True, path=variant):
        y, lse = forward(x, dim, log=log, dtype=out_dtype, backend="cuda", want_lse=True)
    plan = heuristics.last_plan()
    assert plan.backend == "cuda" and plan.path == variant, plan
    return y, lse


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant,n", CASES + STAGED_CASES)
def test_forward(variant, n, dtype, log):
    x = logits(7, n, dtype, n)
    y, lse = run_forward(x, -1, log, variant)
    assert_close(y, x, -1, log)
    torch.testing.assert_close(lse.double(), oracle_lse(x), rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("variant", ["three_pass", "warp", "block", "cluster", "online"])
@pytest.mark.parametrize(
    "make,dim",
    [
        (lambda b: b[:, 3:], -1),  # rows start off 16-byte boundaries, each differently
        (lambda b: b.t(), 0),  # the softmax dim is contiguous, rows are not
        (lambda b: b.t(), -1),  # the softmax dim is strided: scalar accesses
        (lambda b: b.view(4, 8, -1).permute(1, 0, 2), -1),  # two row groups
    ],
    ids=["sliced", "transposed_dim0", "strided_dim", "two_groups"],
)
def test_forward_layouts(variant, make, dim):
    x = make(logits(23, 1024, torch.bfloat16, 3))
    for log in (False, True):
        y, _ = run_forward(x, dim, log, variant)
        assert_close(y, x, dim, log)


def test_staged_layouts():
    """The staged variant on rows off 16-byte boundaries, a contiguous softmax dim with strided rows and two
    row groups; a strided softmax dim is refused when forced (bulk copies need unit stride) and never hinted."""
    from fastsoftmax.kernels.cuda import kernels

    base = logits(23, 1024, torch.bfloat16, 3)
    for make, dim in (
        (lambda b: b[:, 3:], -1),
        (lambda b: b.t(), 0),
        (lambda b: b.view(4, 8, -1).permute(1, 0, 2), -1),
    ):
        x = make(base)
        for log in (False, True):
            y, _ = run_forward(x, dim, log, "staged")
            assert_close(y, x, dim, log)
    with pytest.raises(ValueError, match="unit stride"):
        run_forward(base.t(), -1, False, "staged")
    x = base.t()
    shape, _ = kernels._plan(x, kernels.plan_layout(x, torch.empty_like(x), 1)[1], 1, "staged")
    assert shape.variant != "staged"


@pytest.mark.parametrize("variant", ["warp", "block", "cluster", "online", "three_pass", "staged"])
def test_forward_out_dtype(variant):
    x = logits(9, 1000, torch.bfloat16, 4)
    y, _ = run_forward(x, -1, True, variant, torch.float32)
    assert y.dtype == torch.float32
    assert_close(y, x, -1, True, torch.float32)


def run_backward(x, dy, dim, log, variant):
    x = x.detach().requires_grad_()
    with heuristics.force(poison=True, path=variant):
        y = FNS[log](x, dim, backend="cuda")
        (dx,) = torch.autograd.grad(y, x, dy)
    plan = heuristics.last_plan()
    assert plan.backend == "cuda" and plan.path == variant, plan
    return y.detach(), dx


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant,n", CASES + STAGED_CASES)
def test_backward(variant, n, dtype, log):
    x = logits(7, n, dtype, n + 1)
    gen = torch.Generator().manual_seed(n)
    dy = torch.randn(x.shape, generator=gen).to(dtype).cuda()
    dy[-3, : min(n, 5)] = float("nan")  # a NaN in dy poisons its row (that row of x is finite-valued)
    y, dx = run_backward(x, dy, -1, log, variant)
    err, problem = compare_grad(dx, dy, y, -1, log)
    assert problem is None, problem


@pytest.mark.parametrize("variant", ["three_pass", "warp", "block", "cluster", "online", "staged"])
def test_backward_layouts(variant):
    x = logits(23, 1000, torch.float32, 5)
    dy = torch.randn(1000, x.shape[0], device="cuda").t()  # dy strided unlike y: copied into y's layout
    for log in (False, True):
        y, dx = run_backward(x[:, 3:], dy[:, 3:], -1, log, variant)
        err, problem = compare_grad(dx, dy[:, 3:], y, -1, log)
        assert problem is None, problem
    y, dx = run_backward(x.t(), dy.t(), 0, False, variant)  # softmax along dim 0
    assert compare_grad(dx, dy.t(), y, 0, False)[1] is None


@pytest.mark.parametrize("variant", ["three_pass", "warp", "block", "cluster", "online", "staged"])
def test_gradient_overflow(variant):
    """y of large magnitude (a caller may pass any y): the fp16 gradient overflows; fp32 arithmetic rounded
    once at the store gives the oracle's infinities, the right finite values elsewhere."""
    dy, y = overflowing_grad_inputs(1000, 12, "cuda")
    with heuristics.force(poison=True, path=variant):
        dx = fs.softmax_backward(dy, y, backend="cuda")
    assert heuristics.last_plan().path == variant
    assert dx.isinf().any()
    assert compare_grad(dx, dy, y, -1, False)[1] is None


@pytest.mark.parametrize(
    "variant,bwd_variant,shape,dtype",
    [
        ("cluster", "cluster", (8, 262144), torch.float32),
        ("cluster", "online", (64, 524288), torch.bfloat16),
        ("cluster", "cluster", (64, 262144), torch.bfloat16),
        ("cluster", "cluster", (8, 131072), torch.bfloat16),
        ("online", "online", (4, 1 << 20), torch.float32),
        ("online", "online", (300, 1 << 19), torch.bfloat16),
        ("block", "block", (4096, 16384), torch.float32),
        ("warp", "block", (65536, 2048), torch.bfloat16),
    ],
)
def test_large(variant, bwd_variant, shape, dtype):
    """The longest rows each variant holds (the backward holds half as many bf16 elements per thread)."""
    gen = torch.Generator().manual_seed(shape[1])
    x = random_logits(shape, dtype, gen)
    x[:3] = special_rows(shape[1], dtype, gen)[:3]
    x = x.cuda()
    y, _ = run_forward(x, -1, False, variant)
    if variant == "cluster":
        assert heuristics.last_plan().splits >= 2  # CTAs per row
    assert_close(y, x, -1, False)
    dy = torch.randn(shape, generator=gen).to(dtype).cuda()
    with heuristics.force(poison=True, path=bwd_variant):
        dx = fs.softmax_backward(dy, y, backend="cuda")
    assert heuristics.last_plan().path == bwd_variant
    assert compare_grad(dx, dy, y, -1, False)[1] is None


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((8, 131072), torch.bfloat16),
        ((3, 786432), torch.float32),
        ((64, 524288), torch.bfloat16),
        ((300, 65536), torch.float16),
    ],
)
def test_staged_large(shape, dtype):
    """The staged forward on the longest rows it holds (16 CTAs x STAGE_MAX bytes: 786432 fp32), few rows
    spread over 16 CTAs, special rows; one element more is refused when forced. The staged backward (y and
    dy staged: half the length) on the same rows where they fit, refused where they do not."""

    gen = torch.Generator().manual_seed(shape[1])
    x = random_logits(shape, dtype, gen)
    x[:3] = special_rows(shape[1], dtype, gen)[:3]
    x = x.cuda()
    for log in (True, False):  # the backward below takes softmax's y
        y, lse = run_forward(x, -1, log, "staged")
        assert_close(y, x, -1, log)
        torch.testing.assert_close(lse.double(), oracle_lse(x), rtol=2e-6, atol=2e-6, equal_nan=True)
    assert (
        heuristics.last_plan().splits
        == softmax_cuda.launch_shape(shape[1], shape[0], x.element_size(), gpu.INTERPRETER, "staged").cluster
    )
    if shape[1] == 786432:
        assert heuristics.last_plan().splits == softmax_cuda.STAGE_CLUSTER_MAX == 16
        with pytest.raises(ValueError, match="staged variant holds at most"):
            run_forward(torch.zeros(1, shape[1] + 4, device="cuda"), -1, False, "staged")
    dy = torch.randn(shape, generator=gen).to(dtype).cuda()
    with heuristics.force(poison=True, path="staged"):
        if 2 * shape[1] * x.element_size() > softmax_cuda.STAGE_CLUSTER_MAX * softmax_cuda.STAGE_MAX:  # y and dy staged
            with pytest.raises(ValueError, match="staged variant holds at most"):
                fs.softmax_backward(dy, y, backend="cuda")
            return
        dx = fs.softmax_backward(dy, y, backend="cuda")
    assert heuristics.last_plan().path == "staged"
    assert compare_grad(dx, dy, y, -1, False)[1] is None


def test_staged_backward_needs_dy_like_y():
    """The staged backward stages dy as it stages y: dy of another dtype, or 16-byte-misaligned relative to y,
    is refused when forced and takes another variant otherwise."""
    from fastsoftmax.kernels.cuda import kernels

    y = torch.softmax(logits(30, 4099, torch.bfloat16, 8).float(), -1).to(torch.bfloat16)
    buf = torch.randn(y.numel() + 1, device="cuda").to(torch.bfloat16)
    off = buf[1:].view(y.shape)  # y's strides, 2 bytes off y's alignment
    for dy in (torch.randn_like(y, dtype=torch.float32), off):
        with heuristics.force(path="staged"), pytest.raises(ValueError, match="staged backward needs dy"):
            fs.softmax_backward(dy, y, backend="cuda")
        lay = kernels.plan_layout(y, torch.empty_like(y), 1)[1]
        assert kernels._plan(y, lay, 2, "staged")[0].variant == "staged"  # the hint alone would take it...
    with heuristics.force(poison=True):
        dx = kernels.backward(off, y, 1, y.dtype, False, "staged")  # the table's hint: backward() falls back
    assert heuristics.last_plan().path != "staged"
    assert compare_grad(dx, off, y, -1, False)[1] is None


def test_auto_picks_by_length():
    """With no forcing, backend="cuda" picks warp / block / cluster / online by N and row count."""
    seen = {}
    for shape in [(4096, 513), (4096, 8192), (16, 65536), (8, 1 << 21)]:
        x = torch.randn(shape, device="cuda")
        y = fs.softmax(x, backend="cuda")
        seen[shape] = heuristics.last_plan().path
        torch.testing.assert_close(y, torch.softmax(x, -1), rtol=2e-5, atol=1e-6)
    assert list(seen.values()) == ["warp", "block", "cluster", "online"], seen


def test_more_than_2_pow_31_elements():
    n = 1024
    rows = (1 << 31) // n + 3
    x = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16).normal_(0, 3)
    x[-1] = float("-inf")
    with heuristics.force(poison=True):
        y = fs.softmax(x, backend="cuda")
    assert not y.isnan().any() and (y[-1] == 0).all()
    for r in (0, (1 << 31) // n, rows - 2):
        ref = oracle(x[r])
        assert (y[r].double() - ref).abs().max().item() <= 2**-7 * ref.abs().max().item() + 1e-6


def test_cuda_graph():
    """Forward and backward captured in a CUDA graph (launched through the driver API on the capture
    stream) and replayed on new data."""
    s = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    static = torch.randn(64, 131072, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fs.softmax_backward(static, fs.softmax(static, backend="cuda"), backend="cuda")  # compile outside
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fs.softmax(static, backend="cuda")
        grad = fs.softmax_backward(static, out, backend="cuda")
    for _ in range(2):
        static.copy_(torch.randn_like(static))
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, static, -1, False)
        assert compare_grad(grad, static, out, -1, False)[1] is None


def test_row_of_2_pow_31_elements_or_more():
    """softmax.cu's row length is a 32-bit int: backend='cuda' refuses such a row before any launch, naming
    the limit; 'auto' (whatever the table says) takes the Triton kernels, and the output is written."""

    n = (1 << 31) + 5
    x = torch.empty(1, n, device="cuda", dtype=torch.float16).normal_(0, 2)
    x[0, 7] = 12.0
    with pytest.raises(RuntimeError, match=r"at most 2\^31 - 1"):
        fs.softmax(x, backend="cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tables, "choose", lambda *a, **k: ("cuda", "online"))
        with heuristics.force(poison=True):
            y = fs.softmax(x, dtype=torch.float32)  # fp32: most of 2^31 probabilities underflow fp16
    assert heuristics.last_plan().backend == "triton"
    lse = torch.logsumexp(x.float(), -1, keepdim=True)
    for lo in (0, (1 << 31) - 3, n - 1000):
        want = (x[:, lo : lo + 1000].double() - lse.double()).exp()
        assert (y[:, lo : lo + 1000].double() - want).abs().max().item() <= 2e-5 * want.abs().max().item()
    assert not y.isnan().any() and abs(y.double().sum().item() - 1.0) < 1e-4


def test_graph_capture_as_the_very_first_call(tmp_path):
    """In a fresh process with an empty cache, the first backend='cuda' call is made inside
    torch.cuda.graph: compiled and loaded during the capture, replayed right on new data."""
    import subprocess
    import sys

    code = (
        "import torch, fastsoftmax as fs\n"
        "from fastsoftmax.core.reference import compare, compare_grad\n"
        "x = torch.randn(64, 4096, device='cuda')\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    y = fs.softmax(x, backend='cuda')\n"
        "    dx = fs.softmax_backward(x, y, backend='cuda')\n"
        "for _ in range(2):\n"
        "    x.copy_(torch.randn_like(x) * 3)\n"
        "    g.replay(); torch.cuda.synchronize()\n"
        "    assert compare(y, x, -1, False)[1] is None, compare(y, x, -1, False)\n"
        "    assert compare_grad(dx, x, y, -1, False)[1] is None, compare_grad(dx, x, y, -1, False)\n"
        "    assert torch.equal(dx, fs.softmax_backward(x, y, backend='cuda'))\n"
        "print('ok')\n"
    )
    env = {**__import__("os").environ, "FASTSOFTMAX_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_module_that_cannot_load_turns_the_backend_off(monkeypatch, tmp_path):
    """A cubin the driver rejects (what a driver older than the NVRTC that compiled it does): backend='cuda'
    raises naming the cause; 'auto' takes the Triton kernels for that call and the rest of the process, and
    fs.info() says why."""
    from fastsoftmax.kernels import replay
    from fastsoftmax.kernels.cuda import build, kernels

    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_functions", {})
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(build, "compile_kernel", lambda cfg, arch, *a, **k: build.Compiled(b"\x7fELF junk", "", "k"))
    monkeypatch.setattr(tables, "choose", lambda *a, **k: ("cuda", "warp"))
    replay.clear()
    cuda_backend.reset_failure()
    x = torch.randn(64, 1000, device="cuda")
    try:
        with pytest.raises(RuntimeError, match="cannot load the cubin"):
            fs.softmax(x, backend="cuda")
        assert "cannot load the cubin" in fs.info()["backends"]["cuda"]["off"]
        assert not fs.info()["backends"]["cuda"]["cuda"]
        for _ in range(2):
            y = fs.softmax(x)
            assert heuristics.last_plan().backend == "triton"
            assert_close(y, x, -1, False)
        with pytest.raises(RuntimeError, match="failed earlier in this process"):
            fs.softmax(x, backend="cuda")
        cuda_backend.reset_failure()  # the first failure under 'auto' itself falls back within the call
        y = fs.log_softmax(x)
        assert heuristics.last_plan().backend == "triton" and cuda_backend.failure()
        assert_close(y, x, -1, True)
    finally:
        cuda_backend.reset_failure()
        replay.clear()


def test_a_cached_cubin_the_driver_rejects_is_rebuilt(monkeypatch, tmp_path):
    """A verified cache entry whose cubin does not load (not one this driver takes): reported by a warning
    naming it, compiled again, and the call runs on the CUDA backend."""
    from fastsoftmax import cache
    from fastsoftmax.kernels import replay
    from fastsoftmax.kernels.cuda import build, kernels

    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_functions", {})
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(build, "_memory", {})
    x = torch.randn(32, 777, device="cuda")
    fs.softmax(x, backend="cuda")
    (entry,) = tmp_path.glob("*.cubin")
    cache.store(entry.name, b"\x7fELF not a cubin")  # well formed entry, unloadable content
    replay.clear()  # (a replay would reuse the module already loaded)
    kernels._functions.clear()
    kernels._modules.clear()
    build._memory.clear()
    with pytest.warns(RuntimeWarning, match="did not load"):
        y = fs.softmax(x, backend="cuda")
    assert heuristics.last_plan().backend == "cuda"
    assert_close(y, x, -1, False)
    assert len(cache.load(entry.name)) > 1000  # the rebuilt cubin replaced it
