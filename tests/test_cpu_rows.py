"""The CPU's row kernels (cpu_rows.h, built into fastlaunch_torch): softmax, log_softmax, their backward and
cross-entropy's loss of fp32 and bf16 rows in memory. Each kernel against the float64 oracle under the
library's tolerance rule, odd lengths (a partial vector, 513, 50257), outliers and special rows; the branch
that ran read from the profiler's events; the graph they carry under autograd (SoftmaxRowsBackward,
CrossEntropyRowsBackward) against float64 gradients, double backward included; the compiler's ISA flags."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close, random_logits, special_rows

import fastsoftmax as fs
from fastsoftmax import torch_build
from fastsoftmax.reference import compare_grad

ROWS = (torch.float32, torch.bfloat16)
LENGTHS = (1, 7, 8, 9, 24, 57, 513, 4097, 50257)  # (24, 57: every loop of W = 4, 8 and 16 and a tail)
ROW_EVENTS = {"fastsoftmax::softmax_rows", "fastsoftmax::log_softmax_rows", "fastsoftmax::cross_entropy_rows"}
ROW_EVENTS |= {"fastsoftmax::cross_entropy_backward_rows"}
BWD_EVENTS = {False: "fastsoftmax::softmax_backward_rows", True: "fastsoftmax::log_softmax_backward_rows"}
ROW_EVENTS |= set(BWD_EVENTS.values())


@pytest.fixture(scope="module")
def rows():
    torch_build.torch_calls()
    mod = torch_build.row_kernels()
    if mod is None:
        pytest.fail(f"fastlaunch_torch.cpp did not build here (the CI has a C++ compiler): {torch_build.describe()}")
    return mod


def sample(m: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with ~1% outliers x20, a row holding one large outlier (log_softmax outputs near 0 and below
    -100), and -inf sprinkled in another."""
    gen = torch.Generator().manual_seed(seed)
    x = random_logits((m, n), torch.float32, gen)
    x[0, n // 2] = 60.0
    if n > 2 and m > 1:
        x[1, ::3] = float("-inf")
    return x.to(dtype)


def ran(fn):
    """(fn(), the fastsoftmax:: row-kernel events the profiler saw while it ran)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events()} & ROW_EVENTS


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", ROWS, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_rows_match_the_oracle(rows, n, dtype, log):
    """The kernels alone: every element within the tolerance of the float64 oracle (fp32: also within twice
    torch's own error), -inf entries exactly 0 (log: -inf), the partial vector at the row's end included."""
    x = sample(4, n, dtype, n)
    y = rows.softmax_rows(x, 1, log)
    assert y.dtype == dtype and y.shape == x.shape and not y.isnan().any()
    assert_close(y, x, 1, log)
    # rows along dim 0 of an (n, 1) tensor lie in memory too
    assert_close(rows.softmax_rows(x[:1].t().contiguous(), 0, log), x[:1].t().contiguous(), 0, log)


def test_bf16_log_softmax_keeps_the_digits_torch_loses(rows):
    """torch's own bf16 log_softmax misses the tolerance on outputs near 0 (the reason these rows run in
    fp32): the kernels' bf16 meets it on the same row."""
    x = sample(4, 4096, torch.bfloat16, 3)
    assert_close(rows.softmax_rows(x, 1, True), x, 1, True)
    with pytest.raises(AssertionError, match="error"):
        assert_close(torch.log_softmax(x, 1), x, 1, True)


@pytest.mark.parametrize("dtype", ROWS, ids=str)
def test_non_finite_rows_are_nan_as_torchs(rows, dtype):
    """A row whose max is not finite (all -inf, +inf) or that holds NaN comes out NaN throughout, as
    torch's kernels make it (callers find such rows by their first element and apply the conventions)."""
    gen = torch.Generator().manual_seed(5)
    x = special_rows(37, dtype, gen)
    for log in (False, True):
        y = rows.softmax_rows(x, 1, log).float()
        want = torch.softmax(x.float(), 1) if not log else torch.log_softmax(x.float(), 1)
        assert torch.equal(y.isnan().all(1), want.isnan().all(1)) and want.isnan().all(1)[:4].any()
        assert torch.equal(y.isnan().any(1), y.isnan().all(1))  # (whole rows)


def test_where_the_row_kernels_apply(rows):
    """The kernels take plain contiguous fp32 and bf16 tensors whose rows lie in memory; anything else
    (fp16, fp64, rows across memory, a non-contiguous tensor) is None, and the library's path then runs
    torch's kernels, as the profiler's events show."""
    x = sample(6, 40, torch.float32, 1)
    assert rows.softmax_rows(x.half(), 1, False) is None and rows.softmax_rows(x.double(), 1, False) is None
    assert rows.softmax_rows(x, 0, False) is None and rows.softmax_rows(x.t(), 0, False) is None
    for arg, dim, taken in ((x, 1, True), (x.bfloat16(), 1, True), (x.half(), 1, False), (x, 0, False)):
        y, seen = ran(lambda arg=arg, dim=dim: fs.softmax(arg, dim))
        assert (seen == {"fastsoftmax::softmax_rows"}) == taken, (arg.dtype, dim, seen)
        assert_close(y, arg, dim, False)
        y, seen = ran(lambda arg=arg, dim=dim: fs.log_softmax(arg, dim))
        assert (seen == {"fastsoftmax::log_softmax_rows"}) == taken, (arg.dtype, dim, seen)
        assert_close(y, arg, dim, True)


@pytest.mark.parametrize("dtype", ROWS, ids=str)
def test_public_calls_keep_the_conventions(dtype):
    """fs.softmax / fs.log_softmax on rows with the special rows (fully masked: 0 and -inf, NaN, +inf, near
    the dtype's top): the row kernels ran, and the library's conventions hold."""
    gen = torch.Generator().manual_seed(9)
    x = torch.cat([random_logits((3, 513), dtype, gen), special_rows(513, dtype, gen)])
    for fn, log in ((fs.softmax, False), (fs.log_softmax, True)):
        y, seen = ran(lambda fn=fn: fn(x, -1))
        assert seen, "the row kernels did not run"
        assert_close(y, x, 1, log)


def backward_inputs(m: int, n: int, dtype: torch.dtype, log: bool, seed: int):
    """(dy, y): y softmax's (log_softmax's) output of sample(m, n) rounded to dtype, dy with outliers."""
    x = sample(m, n, torch.float32, seed).double()
    y = (torch.log_softmax(x, 1) if log else torch.softmax(x, 1)).to(dtype)
    return random_logits((m, n), torch.float32, torch.Generator().manual_seed(seed + 1), 1.0).to(dtype), y


def backward_rows(rows, dy, y, dim, log):
    """rows.softmax_backward_rows, right after a NaN-filled tensor of the output's size is freed (the
    allocator tends to hand its memory back out: an element the kernel fails to write shows as NaN)."""
    poison = torch.full_like(y, float("nan"))
    del poison
    return rows.softmax_backward_rows(dy, y, dim, log)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("dtype", ROWS, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_backward_rows_match_the_oracle(rows, n, dtype, log):
    """The backward kernels alone (dx = y (dy - sum(y dy)); log: dy - exp(y) sum(dy)) against the float64
    oracle of the same rounded dy and y under the library's gradient tolerance (the row sum's cancellation
    bounded), the partial vector at the row's end included; the public call gives the same bits."""
    dy, y = backward_inputs(max(1, min(4, rows.BACKWARD_ROWS_MAX // n)), n, dtype, log, n)
    dx = backward_rows(rows, dy, y, 1, log)
    assert dx.dtype == dtype and dx.shape == y.shape
    err, problem = compare_grad(dx, dy, y, 1, log)
    assert problem is None, problem
    public, seen = ran(lambda: (fs.log_softmax_backward if log else fs.softmax_backward)(dy, y, -1))
    assert seen == {BWD_EVENTS[log]} and torch.equal(public, dx)
    # rows along dim 0 of an (n, 1) tensor lie in memory too
    col = backward_rows(rows, dy[:1].t().contiguous(), y[:1].t().contiguous(), 0, log)
    assert torch.equal(col, dx[:1].t())


@pytest.mark.parametrize("dtype", ROWS, ids=str)
def test_backward_rows_masked_and_non_finite(rows, dtype):
    """Fully masked rows give 0 whatever dy holds (softmax: y all 0; log_softmax: every exp(y) 0 in fp32,
    so y all -inf or below -104), a row of y whose exps are subnormal (-101) keeps the formula; NaN in y
    or dy, inf in dy, y above 0 (log: exp overflowing at 100) as the float64 oracle has them (NaN and
    infinities exactly)."""
    inf, nan = float("inf"), float("nan")
    gen = torch.Generator().manual_seed(11)
    n = 37
    dy = torch.randn(8, n, generator=gen)
    dy[0, 3], dy[1, 5], dy[4, 2] = inf, nan, -inf
    y = torch.softmax(torch.randn(8, n, generator=gen) * 3, 1)
    y[0], y[1] = 0.0, 0.0  # fully masked, dy holding inf and NaN
    y[2, 4] = nan
    dy = dy.to(dtype)
    dx = backward_rows(rows, dy, y.to(dtype), 1, False)
    assert (dx[:2] == 0).all() and dx[2].isnan().all() and dx[4].isnan().any()
    assert compare_grad(dx, dy, y.to(dtype), 1, False)[1] is None
    ly = torch.log_softmax(torch.randn(8, n, generator=gen) * 3, 1)
    ly[0], ly[1], ly[3], ly[5] = -inf, -inf, -120.0, -101.0  # (-120 with a finite dy: float64's exp is not 0)
    ly[2, 4] = nan
    ly[6] = torch.rand(n, generator=gen) * 80  # exps up to e^80, finite in fp32
    ly[7, :5] = 100.0  # exp overflows
    ly = ly.to(dtype)
    dx = backward_rows(rows, dy, ly, 1, True)
    assert (dx[:2] == 0).all() and (dx[3] == 0).all() and (dx[5] != 0).any()
    assert dx[2].isnan().sum() == 1  # (log_softmax: NaN where y is)
    assert compare_grad(dx, dy, ly, 1, True)[1] is None


def test_where_the_backward_row_kernels_apply(rows):
    """The backward kernels take plain contiguous dy and y of one dtype, fp32 or bf16, whose rows lie in
    memory, of at most BACKWARD_ROWS_MAX elements, with no graph to record; anything else is None, and the
    library's path then runs torch's kernels (no fastsoftmax:: event), its answer within the oracle's
    tolerance either way."""
    dy, y = backward_inputs(6, 40, torch.float32, False, 3)
    big_dy, big = backward_inputs(2, rows.BACKWARD_ROWS_MAX // 2 + 1, torch.float32, False, 4)
    assert rows.softmax_backward_rows(big_dy[:, :-1].contiguous(), big[:, :-1].contiguous(), 1, False) is not None
    none = [
        (big_dy, big, 1),
        (dy.half(), y.half(), 1),
        (dy.double(), y.double(), 1),
        (dy, y, 0),
        (dy.t().contiguous().t(), y, 1),
        (dy.bfloat16(), y, 1),
    ]
    for a, b, dim in none:
        assert rows.softmax_backward_rows(a, b, dim, False) is None, (a.dtype, b.dtype, dim)
    with torch.enable_grad():
        assert rows.softmax_backward_rows(dy.clone().requires_grad_(), y, 1, False) is None
    cases = [(dy, y, 1, True), (dy.bfloat16(), y.bfloat16(), 1, True)]
    cases += [(a, b, dim, False) for a, b, dim in none]
    for log in (False, True):
        for a, b, dim, taken in cases:
            b = b.log() if log else b
            fn = fs.log_softmax_backward if log else fs.softmax_backward
            dx, seen = ran(lambda a=a, b=b, dim=dim, fn=fn: fn(a, b, dim))
            assert (seen == {BWD_EVENTS[log]}) == taken and seen <= {BWD_EVENTS[log]}, (log, a.dtype, dim, seen)
            assert compare_grad(dx, a, b, dim, log, dx.dtype)[1] is None


@pytest.mark.parametrize("dtype", ROWS, ids=str)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_graph_under_autograd(log, dtype):
    """Under autograd: the kernels' output (bit-equal to the no-grad call) with a C++ node. fp32: torch's own
    (SoftmaxBackward0: compiled autograd captures it), its first order torch's kernel, within the tolerance of
    fs.softmax_backward's row kernels; bf16: SoftmaxRowsBackward, whose first-order gradient is
    fs.softmax_backward's (the backward row kernels) and whose double backward runs the library's formula in
    fp32. Gradients and double backward against float64 autograd."""
    x = sample(3, 513, dtype, 4).requires_grad_()
    fn = fs.log_softmax if log else fs.softmax
    y, seen = ran(lambda: fn(x, -1))
    name = ("Log" if log else "") + ("SoftmaxBackward0" if dtype == torch.float32 else "SoftmaxRowsBackward")
    assert seen and y.grad_fn.name() == name
    assert torch.equal(y.detach(), fn(x.detach(), -1))
    x64 = x.detach().double().requires_grad_()
    y64 = (torch.log_softmax if log else torch.softmax)(x64, -1)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (g1,) = torch.autograd.grad(y, x, dy, retain_graph=True)
    want = fs.softmax_backward(dy, y.detach(), -1) if not log else fs.log_softmax_backward(dy, y.detach(), -1)
    if dtype == torch.float32:  # (torch's kernel and the row kernels: fp32 sums in other orders)
        torch.testing.assert_close(g1, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    else:
        assert torch.equal(g1, want)
    (g,) = torch.autograd.grad(y, x, dy, create_graph=True)
    (g64,) = torch.autograd.grad(y64, x64, dy.double(), create_graph=True)
    rtol, atol = (1e-4, 1e-6) if dtype == torch.float32 else (2**-6, 1e-3 * float(g64.abs().max()))
    torch.testing.assert_close(g1.double(), g64, rtol=rtol, atol=atol)
    torch.testing.assert_close(g.double(), g64, rtol=rtol, atol=atol)
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    (gg,) = torch.autograd.grad((g.float() * w).sum(), x)
    (gg64,) = torch.autograd.grad((g64 * w.double()).sum(), x64)
    torch.testing.assert_close(gg.double(), gg64, rtol=rtol * 10, atol=1e-2 * float(gg64.abs().max()))


def ce_reference(x, t, reduction, smoothing):
    x64 = x.detach().double().requires_grad_()
    loss = F.cross_entropy(x64, t.long(), reduction=reduction, label_smoothing=smoothing)
    return x64, loss


@pytest.mark.parametrize("v", (7, 513, 50257))
@pytest.mark.parametrize("dtype", ROWS, ids=str)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_cross_entropy_rows_match_float64(rows, v, dtype, reduction):
    """The loss alone, with ignored rows, label smoothing and targets of every integer dtype, against
    float64 F.cross_entropy; fully ignored rows give torch's NaN mean."""
    gen = torch.Generator().manual_seed(v)
    x = random_logits((6, v), dtype, gen)
    t = torch.randint(0, min(v, 120), (6,), generator=gen)
    t[1::3] = -100
    code = {"none": 0, "mean": 1, "sum": 2}[reduction]
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    for smoothing in (0.0, 0.1):
        _, want = ce_reference(x, t, reduction, smoothing)
        for tdt in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            tt = t.to(tdt) if tdt != torch.uint8 else torch.where(t < 0, 200, t).to(tdt)
            got = rows.cross_entropy_rows(x, tt, -100 if tdt != torch.uint8 else 200, code, smoothing)
            assert got.dtype == dtype and got.shape == want.shape
            torch.testing.assert_close(got.double(), want.detach(), rtol=rtol, atol=1e-5)
    assert rows.cross_entropy_rows(x, torch.full((6,), -100), -100, 1, 0.0).isnan()
    bad = t.clone()
    bad[4] = v  # (one past the last class)
    with pytest.raises(IndexError, match=f"Target {v} is out of bounds"):
        rows.cross_entropy_rows(x, bad, -100, code, 0.0)


def test_cross_entropy_rows_under_autograd():
    """fs.cross_entropy of fp32 and bf16 logits that need a gradient: the kernels' loss (equal to the no-grad
    call's) with CrossEntropyRowsBackward, whose gradient and double backward (through torch's ops) match
    float64 autograd; a fully masked kept row hands the call to the library's Function."""
    gen = torch.Generator().manual_seed(2)
    for dtype in ROWS:
        for reduction in ("mean", "sum", "none"):
            x = random_logits((5, 513), dtype, gen).requires_grad_()
            t = torch.randint(0, 513, (5,), generator=gen)
            t[3] = -100
            loss, seen = ran(lambda x=x, t=t, reduction=reduction: fs.cross_entropy(x, t, reduction=reduction))
            assert seen == {"fastsoftmax::cross_entropy_rows"}
            node = loss.grad_fn if reduction != "none" else loss.grad_fn.next_functions[0][0]  # (through a view)
            assert node.name() == "CrossEntropyRowsBackward", loss.grad_fn
            assert torch.equal(loss.detach(), fs.cross_entropy(x.detach(), t, reduction=reduction))
            x64, want = ce_reference(x, t, reduction, 0.0)
            g = torch.linspace(0.5, 1.5, loss.numel()).reshape(loss.shape)
            (dx64,) = torch.autograd.grad(want, x64, g.double(), create_graph=True)
            rtol = 1e-5 if dtype == torch.float32 else 2**-7
            # first order: one pass of the row kernels; under create_graph: torch's ops, recorded
            (dx1,), seen = ran(
                lambda loss=loss, x=x, g=g: torch.autograd.grad(loss, x, g.to(loss.dtype), retain_graph=True)
            )
            assert seen == {"fastsoftmax::cross_entropy_backward_rows"}
            (dx,) = torch.autograd.grad(loss, x, g.to(loss.dtype), create_graph=True)
            for d in (dx1, dx):
                torch.testing.assert_close(d.double(), dx64, rtol=rtol, atol=1e-6)
            assert (dx[3] == 0).all()
            w = torch.randn(x.shape, generator=gen)
            (ddx,) = torch.autograd.grad((dx.float() * w).sum(), x)
            (ddx64,) = torch.autograd.grad((dx64 * w.double()).sum(), x64)
            torch.testing.assert_close(ddx.double(), ddx64, rtol=max(rtol, 1e-4), atol=1e-5)
    x = random_logits((3, 40), torch.float32, gen)
    x[1] = float("-inf")
    x.requires_grad_()
    loss = fs.cross_entropy(x, torch.tensor([1, 2, 3]))
    assert "CrossEntropyRowsBackward" not in loss.grad_fn.name()  # (the library's Function: its convention)
    (dx,) = torch.autograd.grad(loss, x)
    assert not dx.isnan().any()


AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"]


def test_isa_flags(monkeypatch):
    """The row kernels are built for the vector ISA torch's own CPU kernels use on this machine: AVX-512
    (with AVX2 and FMA) where torch reports AVX-512 on x86-64, AVX2 and FMA where it reports AVX2, the
    architecture's baseline otherwise (a separate cache entry each)."""
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for capability, flags in (("AVX512", AVX512_FLAGS), ("AVX2", ["-mavx2", "-mfma"]), ("DEFAULT", [])):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert torch_build._isa() == flags
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    for capability in ("AVX512", "AVX2"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert torch_build._isa() == []


def _floats(capability: str) -> int:
    return 16 if capability.startswith("AVX512") else 8 if capability.startswith("AVX2") else 4


def test_build_vector_width():
    """The process's build holds the vectors its ISA flags ask for (16 floats: AVX-512, 8: AVX2, 4)."""
    rows = torch_build.row_kernels() or (torch_build.torch_calls(), torch_build.row_kernels())[1]
    assert rows is not None, torch_build.describe()
    assert rows.VECTOR_FLOATS == _floats(torch.backends.cpu.get_cpu_capability())


ISA_RUN = """
import torch, platform, sys
from fastsoftmax import torch_build
torch_build.torch_calls()
rows = torch_build.row_kernels()
assert rows is not None, torch_build.describe()
assert rows.VECTOR_FLOATS == int(sys.argv[1]), (rows.VECTOR_FLOATS, torch_build._isa())
from helpers import assert_close
from fastsoftmax.reference import compare_grad
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for n in (517, 16, 33, 24, 57):
        x = (torch.randn(5, n, generator=g) * 3).to(dtype)
        x[1, ::4] = float("-inf")
        x[2, 3] = 60.0
        for log in (False, True):
            assert_close(rows.softmax_rows(x, 1, log), x, 1, log)
        t = torch.randint(0, n, (5,), generator=g)
        want = torch.nn.functional.cross_entropy(x.double(), t)
        got = rows.cross_entropy_rows(x, t, -100, 1, 0.0).double()
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-5)
        xg = x.clone().requires_grad_()
        (dx,) = torch.autograd.grad(rows.cross_entropy_rows(xg, t, -100, 1, 0.0), xg)
        xd = x.double().requires_grad_()
        (want_dx,) = torch.autograd.grad(torch.nn.functional.cross_entropy(xd, t), xd)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(dx.double(), want_dx, rtol=tol, atol=tol * 1e-2)
        dy = torch.randn(5, n, generator=g).to(dtype)
        for log in (False, True):
            y = (torch.log_softmax if log else torch.softmax)(x.double(), 1).to(dtype)
            problem = compare_grad(rows.softmax_backward_rows(dy, y, 1, log), dy, y, 1, log)[1]
            assert problem is None, (dtype, n, log, problem)
print("isa ok")
"""
LEVELS = ("default", "avx2", "avx512")  # (ATEN_CPU_CAPABILITY's values, lowest first)


@pytest.mark.parametrize("level", LEVELS[:2])
def test_lower_isa_build(tmp_path, level):
    """With torch's capability lowered (ATEN_CPU_CAPABILITY) below the machine's, the kernels build for
    that level's vectors (4 floats for the baseline; 8 for AVX2, on an AVX-512 machine) into their own cache
    entry and still meet the tolerance. A level the machine lacks cannot be lowered to: skipped."""
    capability = torch.backends.cpu.get_cpu_capability().lower()
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if not x86 or capability not in LEVELS or LEVELS.index(level) >= LEVELS.index(capability):
        pytest.skip(f"{level} is not below this machine's {capability}")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level, FASTSOFTMAX_CACHE_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    floats = str(_floats(level.upper()))
    out = subprocess.run([sys.executable, "-c", ISA_RUN, floats], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and "isa ok" in out.stdout, out.stderr[-3000:]
