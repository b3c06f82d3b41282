"""The same checks at sizes only a GPU runs: every path on large, odd and prime shapes; a tensor of more
than 2^31 elements (64-bit indexing) on the rowblock and the online path; non-default streams; CUDA graphs;
a target outside [0, V) stopping at the device's assertion; the LM-head loss at scale (its peak memory, a
CUDA graph). The replay and the launches on a GPU: test_gpu_replay.py. Skipped without CUDA; run with
`pytest --device cuda tests/test_gpu.py`."""

import contextlib

import pytest
import torch
from helpers import DTYPES, assert_close, forward, random_logits, special_rows

import fastsoftmax as fs
from fastsoftmax import heuristics
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


# bf16 outputs rounded to nearest, on every forced path of both backends. The tolerance admits one ulp in
# bf16, so a kernel that truncated its fp32 result (Triton's interpreter does: docs/architecture.md, Tests)
# would pass every other check; here about half its outputs would differ from the rounded oracle, against a
# few near rounding ties from the fp32 arithmetic. Below 2^-126 an error up to 2^-126 is allowed (the Triton
# kernels flush there: docs/semantics.md, Numerics; 6% of the (4096, 1024) outputs lie there).
ROUNDING = [("triton", "rowblock", (4096, 1024)), ("triton", "online", (64, 50257)), ("triton", "split", (8, 131072))]
ROUNDING += [("cuda", p, s) for p, s in (("three_pass", (2048, 513)), ("warp", (4096, 1000)), ("block", (1024, 12289)),
             ("cluster", (16, 131072)), ("online", (4, 1 << 20)), ("staged", (64, 65536)))]  # fmt: skip


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("backend,path,shape", ROUNDING, ids=lambda v: str(v).replace(" ", ""))
def test_bf16_rounds_to_nearest(backend, path, shape, log):
    x = random_logits(shape, torch.bfloat16, torch.Generator().manual_seed(shape[1])).cuda()
    with heuristics.force(poison=True, path=path):
        y = (fs.log_softmax if log else fs.softmax)(x, backend=backend)
    assert heuristics.last_plan().path == path
    want = oracle(x, -1, log).to(torch.float32).to(torch.bfloat16)
    normal = want.isfinite() & (want.abs() >= 2**-126)
    off = (y[normal] != want[normal]).double().mean().item()
    assert off < 0.01, f"{off:.1%} of the outputs are not the oracle rounded to nearest"
    tiny = want.isfinite() & ~normal  # (flushed to 0, or a subnormal from fewer bits of fp32 precision)
    assert ((y[tiny].double() - want[tiny].double()).abs() <= 2**-126).all()


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


_BAD_TARGET = r"""
import sys, torch, fastsoftmax as fs
from fastsoftmax.kernels import replay
how = sys.argv[1]
m, v = (64, 1000) if how == "two" else (8, 100)  # (64 rows of 1000: rows, then ce_finish; else one program)
x = torch.randn(m, v, device="cuda")
t = torch.randint(0, v, (m,), device="cuda")
if how == "replay":
    for _ in range(2):
        fs.cross_entropy(x, t)  # recorded, then replayed
    torch.cuda.synchronize()
    assert len(replay.entries()) == 1
t[3] = v
if how == "lce":
    loss = fs.linear_cross_entropy(torch.randn(8, 16, device="cuda"), torch.randn(100, 16, device="cuda"), t)
else:
    loss = fs.cross_entropy(x, t)
torch.cuda.synchronize()
print("NO ERROR", float(loss))
"""


@pytest.mark.parametrize("how", ["full", "replay", "two", "lce"])
def test_bad_target_stops_at_a_device_assertion(how):
    """A target outside [0, V) on CUDA stops at the forward's last program's device-side assertion (in a
    process of its own: the CUDA context does not survive it): the one-program forward on the full path and
    in a replayed call, ce_finish after the rows (``two``), in the LM-head loss (before its first GEMM); the
    device prints the library's message, and the next CUDA call that reports fails (a synchronisation:
    'device-side assert triggered'; cuBLAS's handle: its own error)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _BAD_TARGET, how], capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "NO ERROR" not in text, text[-2000:]
    assert "Assertion `cross_entropy: a target is outside [0, V) and not ignore_index` failed" in text, text[-2000:]
    assert "Error" in text, text[-2000:]


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
    # row chunks: 5 of 700 rows; lce_sliced: one group of 3000 rows, 7 slices of 8192 classes (rules.slice_plan)
    assert (
        plan.path == design
        and plan.backend == "triton"
        and plan.splits == (7 if design in ("lce_sliced", "lce_fused") else 5)
    )
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
    memory = rows * v * 2

    def step():
        loss = fs.linear_cross_entropy(x, w, t, memory=memory)
        return torch.autograd.grad(loss, (x, w))

    for design in ("lce_chunked", "lce_sliced"):  # (the rule picks lce_sliced for this budget)
        with heuristics.force(path=design):
            step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = step()
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        budget = (v * d + n * d) * 2 + memory + (1 << 20)  # dW + dx + the budget (a chunk; slice + dx sums)
        plan = heuristics.last_plan()
        assert plan.path == design and (design == "lce_sliced" or plan.splits == n // rows), plan
        assert peak <= budget, (design, peak, budget)
        del out


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("sliced", [False, True], ids=["rows", "sliced"])
def test_lce_cuda_graph(reduction, sliced):
    """The LM-head loss (both designs: mean is lce_chunked, none lce_recompute; and lce_sliced at a budget of
    300 rows, in groups over slices) captured with its backward in a CUDA graph, replayed on new data,
    equals eager (no host synchronisation inside)."""
    x, w, t = _lce_inputs(1024, 256, 5003, torch.float32)
    cw = torch.rand(5003, device="cuda") + 0.5
    g_out = torch.rand(1024, device="cuda") if reduction == "none" else torch.tensor(0.75, device="cuda")
    opts = dict(class_weight=cw, softcap=15.0, z_loss=1e-3, memory=300 * 5003 * 4 if sliced else None)

    want = "lce_sliced" if sliced else "lce_recompute" if reduction == "none" else "lce_chunked"

    def step():
        with heuristics.force(path="lce_sliced") if sliced else contextlib.nullcontext():
            loss = fs.linear_cross_entropy(x, w, t, reduction=reduction, **opts)
            assert heuristics.last_plan().path == want
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


def test_lce_skip_refused_in_a_cuda_graph():
    """skip_eps synchronises once a row group: under CUDA graph capture a clear error, not the driver's, where
    the skip runs (the sliced path, forced: at this small shape the rule gives the skip's tiles to row
    chunks, exact and without a synchronisation, since 8d55893)."""
    x, w, t = _lce_inputs(256, 64, 5003, torch.float32)
    fs.linear_cross_entropy(x, w, t, skip_eps=1e-6)  # (eager: runs)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with heuristics.force(path="lce_sliced"), torch.cuda.stream(s):
        with pytest.raises(RuntimeError, match="skip_eps .*: not in a CUDA graph"), torch.cuda.graph(graph):
            fs.linear_cross_entropy(x, w, t, skip_eps=1e-6)


def test_lce_scale_kernel_both_branches():
    """scale_by, the backward's in-place scaling: untouched (not read or written) when g == 1, scaled else."""
    from fastsoftmax.kernels.triton import lm_head as k

    a = torch.randn(10007, device="cuda", dtype=torch.bfloat16)
    b = a.clone()
    k.scale_(b, torch.tensor(1.0, device="cuda"))
    assert torch.equal(a, b)
    k.scale_(b, torch.tensor(-0.5, device="cuda"))
    torch.testing.assert_close(b.float(), (a.float() * -0.5).bfloat16().float(), rtol=0, atol=0)
