"""fs.cross_entropy on CPU tensors under backend='auto': the torch backend's native path (torch's own loss on
fp32 rows, fp64 for fp64, kernels/torch_native.py), or its reference formulas where softcap or z_loss ask
for them; under autograd torch's own nodes (NllLossBackward0) where they compute the library's gradient,
else the library's Function. The plan that ran, forward and backward; loss and dlogits against float64
F.cross_entropy: every reduction, ignore_index (all ignored: a NaN mean), label smoothing, class weights,
targets of every integer dtype and strides, rows past one chunk, fully masked, NaN and +inf rows, double
backward; the library's error for a target out of range. Softmax and log_softmax: test_cpu_path.py."""

import pytest
import torch
import torch.nn.functional as F
from helpers import random_logits, ref_loss, special_rows

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import TOLERANCE
from fastsoftmax.kernels import torch_native

ALL = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
NATIVE_CE = heuristics.Plan("torch", "native_cross_entropy")
GRAPH = heuristics.Plan("torch", "native_graph")  # the forward under torch's own nodes; their backward: no plan
REFERENCE_CE = heuristics.Plan("torch", "cross_entropy")
FUNCTION = "CrossEntropyFunctionBackward"
INF, NAN = float("inf"), float("nan")
CE_TOL = {  # (rtol, atol as a fraction of the largest reference value)
    torch.float32: (1e-5, 1e-6),
    torch.float64: (1e-10, 1e-12),
    torch.bfloat16: (TOLERANCE[torch.bfloat16][0], 1e-4),
    torch.float16: (TOLERANCE[torch.float16][0], 1e-4),
}


def run(fn, *args, **kwargs):
    """(fn's result, the plans recorded while it ran), outputs the library allocates poisoned with NaN."""
    with heuristics.force(poison=True), heuristics.recording() as plans:
        out = fn(*args, **kwargs)
    return out, plans


def ce_data(shape, v, dtype, seed):
    """Logits with outliers (shape + (v,)) and targets, every fourth one ignored (-100)."""
    gen = torch.Generator().manual_seed(seed)
    x = random_logits((*shape, v), dtype, gen)
    t = torch.randint(0, v, shape, generator=gen)
    t.view(-1)[1::4] = -100
    return x, t


def ce_ref(x, t, reduction, smoothing=0.0, weight=None, ignore_index=-100):
    """float64 F.cross_entropy and the float64 logits it ran on (requiring grad)."""
    x64 = x.detach().double().requires_grad_()
    w = weight.double() if weight is not None else None
    loss = F.cross_entropy(x64.reshape(-1, x.shape[-1]), t.reshape(-1).long(), weight=w, ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=smoothing)  # fmt: skip
    return x64, (loss.reshape(t.shape) if reduction == "none" else loss)


def close(got, ref, dtype, what):
    rtol, atol = CE_TOL[dtype]
    scale = max(ref[ref.isfinite()].abs().max().item() if ref.isfinite().any() else 0.0, 1.0)
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * scale, equal_nan=True, msg=what)


def core_node(loss) -> str:
    """The loss's grad_fn past the reshape to the target's shape and the rounding to a 16-bit dtype."""
    node = loss.grad_fn
    while node.name() in ("ViewBackward0", "ToCopyBackward0"):
        node = node.next_functions[0][0]
    return node.name()


def ce_check(x, t, dtype, reduction, smoothing=0.0, weight=None, ignore_index=-100, seed=0):
    """Loss and dlogits for a random upstream gradient against float64 torch; the plans of both passes and
    the autograd node: torch's (NllLossBackward0) without smoothing within one chunk, else the Function; the
    plain call's loss the same."""
    xg = x.clone().requires_grad_()
    kw = dict(reduction=reduction, label_smoothing=smoothing, class_weight=weight, ignore_index=ignore_index)
    loss, plans = run(fs.cross_entropy, xg, t, **kw)
    graph = not smoothing and x.numel() <= torch_native.CHUNK
    assert plans == [GRAPH if graph else NATIVE_CE] and loss.dtype == x.dtype
    assert core_node(loss) == ("NllLossBackward0" if graph else FUNCTION)
    x64, ref = ce_ref(x, t, reduction, smoothing, weight, ignore_index)
    assert loss.shape == ref.shape
    close(loss, ref.detach(), dtype, f"loss {reduction}")
    g = (torch.rand(ref.shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(dtype)
    (dx,), plans = run(torch.autograd.grad, loss, xg, g)
    assert plans == ([] if graph else [NATIVE_CE]) and dx.dtype == x.dtype and dx.shape == x.shape
    (dref,) = torch.autograd.grad(ref, x64, g.double())
    close(dx, dref, dtype, f"dlogits {reduction}")
    ignored = (t.long() == ignore_index).reshape(-1)
    assert (dx.reshape(-1, x.shape[-1])[ignored] == 0).all()
    plain, plans = run(fs.cross_entropy, x, t, **kw)
    assert plans == [NATIVE_CE] and torch.equal(plain, loss.detach())


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("shape,v", [((3, 5), 7), ((3, 5), 513), ((6,), 50257), ((600,), 513)])
def test_matches_torch(dtype, shape, v):
    """Every reduction with and without label smoothing; (6, 50257) and (600, 513) are two chunks, the last
    partial (the Function: torch's backward would write an M x V temporary)."""
    x, t = ce_data(shape, v, dtype, v)
    for reduction in ("none", "mean", "sum"):
        for smoothing in (0.0, 0.2):
            ce_check(x, t, dtype, reduction, smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("v", [513, 50257])
def test_class_weights(dtype, v):
    """torch's weight=, in fp32 and fp64 (a class of weight 0 among them), with smoothing, every reduction;
    one chunk (60 x 513: torch's node without smoothing) and two (6 x 50257: the Function)."""
    x, t = ce_data((60,) if v == 513 else (3,), v, dtype, 1)
    if v == 50257:
        x, t = torch.cat([x, x]), torch.cat([t, t])
    gen = torch.Generator().manual_seed(2)
    for wd in (
        (torch.float32, torch.float64) if v == 513 else (torch.float64 if dtype == torch.float64 else torch.float32,)
    ):
        w = (torch.rand(v, generator=gen) + 0.1).to(wd)
        w[int(t[0])] = 0.0
        for reduction in ("none", "mean", "sum"):
            for smoothing in (0.0, 0.1):
                ce_check(x, t, dtype, reduction, smoothing, w)


def test_targets_of_every_kind():
    """int32, int16, int8, uint8 targets (uint8: -100 cannot be stored, so no row is ignored unless
    ignore_index names a class), a column of a label table, an expanded target, every other one of a
    longer target; ignore_index a class."""
    x, t = ce_data((6,), 11, torch.float32, 4)
    t = t.clamp_min(0)
    table = torch.stack([t, t.flip(0)], 1)  # (6, 2): column 0 is strided
    for tt, ii in [
        (t.int(), -100),
        (t.short(), -100),
        (t.to(torch.int8), -100),
        (t.to(torch.uint8), -100),
        (t.to(torch.uint8), int(t[2])),
        (table[:, 0], -100),
        (table[:, 1].int(), int(t[3])),
        (torch.tensor(3).expand(6), -100),
        (torch.stack([t, t], 1).reshape(-1)[::2], -100),
        (t, int(t[0])),
    ]:
        for reduction in ("none", "mean"):
            for smoothing in (0.0, 0.1):
                ce_check(x, tt, torch.float32, reduction, smoothing, ignore_index=ii)


def test_shapes_and_layouts():
    """(B, T, V) logits with (B, T) targets, 1-d logits with a 0-d target, logits whose V is not contiguous
    (a transposed table) and every other row of a table; logits requiring grad under no_grad: the plain
    call, no graph."""
    x, t = ce_data((2, 3), 17, torch.float32, 7)
    for reduction in ("none", "mean", "sum"):
        ce_check(x, t, torch.float32, reduction)
        ce_check(x[0, 0], t[0, 0].clamp_min(0), torch.float32, reduction)
        ce_check(x.transpose(0, 2).contiguous().transpose(0, 2), t, torch.float32, reduction, 0.1)
        ce_check(x.reshape(6, 17)[::2], t.reshape(6)[::2], torch.float32, reduction)
    with torch.no_grad():
        loss, plans = run(fs.cross_entropy, x.clone().requires_grad_(), t)
    assert plans == [NATIVE_CE] and loss.grad_fn is None


def test_torchs_node_up_to_one_chunk(monkeypatch):
    """torch's node (NllLossBackward0; 16-bit: rounded after it) for logits of at most CHUNK elements, the
    Function past it (torch's backward would write an M x V temporary): at the real CHUNK, the forward
    alone; at a CHUNK of 1000, loss and dlogits."""
    for dtype in (torch.float32, torch.bfloat16):
        for m, node in ((512, "NllLossBackward0"), (513, FUNCTION)):  # (512 x 512 = CHUNK)
            x = torch.zeros(m, 512, dtype=dtype, requires_grad=True)
            loss, plans = run(fs.cross_entropy, x, torch.zeros(m, dtype=torch.long))
            assert core_node(loss) == node and plans == [GRAPH if node != FUNCTION else NATIVE_CE], (dtype, m)
            assert loss.grad_fn.name() == ("ToCopyBackward0" if dtype != torch.float32 and node != FUNCTION else node)
    monkeypatch.setattr(torch_native, "CHUNK", 1000)
    x, t = ce_data((10,), 100, torch.float32, 14)
    ce_check(x, t, torch.float32, "mean")  # (the graph: 1000 elements)
    x, t = ce_data((11,), 100, torch.float32, 14)
    ce_check(x, t, torch.float32, "mean")  # (the Function)


def test_empty_logits():
    """No rows: torch's results (mean NaN, sum 0, none empty), a zero gradient of the logits' shape."""
    x = torch.empty(0, 7, requires_grad=True)
    t = torch.empty(0, dtype=torch.long)
    for reduction in ("none", "mean", "sum"):
        loss = fs.cross_entropy(x, t, reduction=reduction)
        want = F.cross_entropy(x.detach(), t, reduction=reduction)
        assert loss.shape == want.shape and torch.equal(loss.isnan(), want.isnan())
        if reduction == "sum":
            assert loss == 0
        (dx,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
        assert dx.shape == (0, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_special_rows_as_the_reference(dtype):
    """Rows whose softmax is NaN in torch's (fully masked, NaN, +inf; kept and ignored) and a target class
    at -inf: the Function (not torch's node), loss and dlogits as the reference formulas have them
    (backend='torch' in float64), NaN where they have NaN. (The rows near +-1e4 carry fp32's error on such
    logits, a few 1e-3.)"""
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([random_logits((3, 40), dtype, gen), special_rows(40, dtype, gen)])
    t = torch.randint(0, 40, (12,), generator=gen)
    t[[4, 6]] = -100  # one finite among -inf, ignored; a +inf row, ignored
    x[0, int(t[0])] = -INF
    rtol = CE_TOL[dtype][0]
    for reduction, smoothing in (("none", 0.0), ("sum", 0.0), ("mean", 0.0), ("none", 0.1), ("mean", 0.1)):
        got, want = [], []
        for xx, backend, out in ((x, "auto", got), (x.double(), "torch", want)):
            xg = xx.clone().requires_grad_()
            loss, plans = run(fs.cross_entropy, xg, t, reduction=reduction, label_smoothing=smoothing, backend=backend)
            (dx,), bwd = run(torch.autograd.grad, loss, xg, torch.ones_like(loss))
            out += [loss, dx]
            if backend == "auto":
                assert plans == bwd == [NATIVE_CE] and core_node(loss) == FUNCTION
        assert got[0].isnan().any() and got[1].isnan().any()  # (the NaN and +inf rows kept)
        for a, b, atol in zip(got, want, (16 * 1e4 * 2**-23, 1e-3), strict=True):
            torch.testing.assert_close(a.double(), b, equal_nan=True, rtol=rtol, atol=atol, msg=reduction)


def test_mean_over_no_kept_row_is_nan():
    """Every row ignored: a NaN mean, as torch's, and a zero gradient; through torch's node, the Function
    (smoothing) and class weights."""
    x, t = ce_data((5,), 9, torch.float32, 6)
    t[:] = -100
    for kw, plan in (({}, GRAPH), ({"label_smoothing": 0.2}, NATIVE_CE), ({"class_weight": torch.rand(9)}, GRAPH)):
        xg = x.clone().requires_grad_()
        loss, plans = run(fs.cross_entropy, xg, t, **kw)
        assert plans == [plan] and loss.isnan(), kw
        assert (torch.autograd.grad(loss, xg)[0] == 0).all(), kw
        plain, plans = run(fs.cross_entropy, x, t, **kw)
        assert plans == [NATIVE_CE] and plain.isnan(), kw
        assert run(fs.cross_entropy, x, t, reduction="sum", **kw)[0] == 0


def test_bad_targets_raise_the_library_error():
    """A target outside [0, V) and not ignore_index: IndexError with the library's message, the row it is at,
    on every route: plain, torch's node, the Function (smoothing), past one chunk (the bad target in the
    second), int32 and uint8 targets; a target equal to ignore_index is not one."""
    x = torch.randn(4, 7)
    for t in (torch.tensor([0, 7, 1, 2]), torch.tensor([0, -3, 1, 2], dtype=torch.int32)):
        for reduction in ("mean", "none"):
            for grad in (False, True):
                for kw in ({}, {"label_smoothing": 0.1}):
                    with pytest.raises(IndexError, match="at row 1 is outside \\[0, 7\\) and not ignore_index"):
                        fs.cross_entropy(x.clone().requires_grad_(grad), t, reduction=reduction, **kw)
    with pytest.raises(IndexError, match="target 200 at row 2 is outside \\[0, 7\\) and not ignore_index"):
        fs.cross_entropy(x, torch.tensor([0, 1, 200, 2], dtype=torch.uint8))
    assert fs.cross_entropy(x, torch.tensor([0, 9, 1, 2]), ignore_index=9).isfinite()
    big = torch.randn(600, 513)
    t = torch.zeros(600, dtype=torch.long)
    t[550] = 513
    for grad in (False, True):
        with pytest.raises(IndexError, match="at row 550"):
            fs.cross_entropy(big.clone().requires_grad_(grad), t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_softcap_and_z_loss_take_the_reference_formulas(dtype):
    """softcap or z_loss: the torch backend's reference (plan "cross_entropy") forward and backward, the
    Function under autograd; loss, z-loss and dlogits against float64 torch with the options applied."""
    x, t = ce_data((8,), 33, dtype, 9)
    w = torch.rand(33, generator=torch.Generator().manual_seed(9)) + 0.5
    for kw in (
        dict(softcap=5.0),
        dict(z_loss=1e-3),
        dict(softcap=5.0, z_loss=1e-3, reduction="none"),
        dict(z_loss=1e-3, reduction="sum", label_smoothing=0.1, class_weight=w),
    ):
        xg = x.clone().requires_grad_()
        (loss, z), plans = run(fs.cross_entropy, xg, t, return_z_loss=True, **kw)
        assert plans == [REFERENCE_CE] and core_node(loss) == FUNCTION, kw
        opts = dict(reduction=kw.get("reduction", "mean"), eps=kw.get("label_smoothing", 0.0))
        x64 = x.double().requires_grad_()
        opts |= dict(class_weight=kw.get("class_weight"), softcap=kw.get("softcap"), z_loss=kw.get("z_loss", 0.0))
        ref, zref = ref_loss(x64, t, **opts)
        close(loss, ref.detach(), dtype, f"loss {kw}")
        close(z, zref.detach(), dtype, f"z-loss {kw}")
        assert (z != 0).any() == ("z_loss" in kw) and not z.requires_grad
        g = torch.rand(ref.shape, generator=torch.Generator().manual_seed(1)).to(dtype) + 0.5
        (dx,), plans = run(torch.autograd.grad, loss, xg, g)
        assert plans == [REFERENCE_CE]
        close(dx, torch.autograd.grad(ref, x64, g.double())[0], dtype, f"dlogits {kw}")


def test_return_z_loss_without_z_loss():
    """return_z_loss=True without z_loss: the loss as without it and a zero z-loss of its shape and dtype,
    on the plain path, through torch's node and through the Function; no gradient through it."""
    x, t = ce_data((2, 3), 17, torch.bfloat16, 10)
    for reduction in ("mean", "none"):
        for grad, kw, plan in ((False, {}, NATIVE_CE), (True, {}, GRAPH), (True, {"label_smoothing": 0.1}, NATIVE_CE)):
            xg = x.clone().requires_grad_(grad)
            (loss, z), plans = run(fs.cross_entropy, xg, t, reduction=reduction, return_z_loss=True, **kw)
            assert plans == [plan] and torch.equal(loss, fs.cross_entropy(x, t, reduction=reduction, **kw))
            assert z.shape == loss.shape and z.dtype == loss.dtype and (z == 0).all() and not z.requires_grad


def test_double_backward():
    """create_graph: the gradient is differentiable (gradgradcheck, float64) through torch's node (no
    smoothing, class weights) and through the Function (smoothing, with weights)."""
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    t = torch.tensor([1, -100, 5, 0])
    w = torch.rand(6, dtype=torch.float64, generator=torch.Generator().manual_seed(12)) + 0.5
    for kw, node in (
        ({"class_weight": w}, "NllLossBackward0"),
        ({"label_smoothing": 0.2, "class_weight": w, "reduction": "none"}, FUNCTION),
    ):
        assert core_node(fs.cross_entropy(x, t, **kw)) == node, kw
        assert torch.autograd.gradgradcheck(lambda z, kw=kw: fs.cross_entropy(z, t, **kw), (x,))


def test_autocast_gives_an_fp32_loss():
    """Under CPU autocast a bf16 logits' loss is fp32 (torch's cross_entropy policy), the gradient bf16."""
    x, t = ce_data((6,), 33, torch.bfloat16, 13)
    xg = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fs.cross_entropy(xg, t)
    assert loss.dtype == torch.float32
    x64, ref = ce_ref(x, t, "mean")
    close(loss, ref.detach(), torch.bfloat16, "loss")
    (dx,) = torch.autograd.grad(loss, xg)
    assert dx.dtype == torch.bfloat16
    close(dx, torch.autograd.grad(ref, x64)[0], torch.bfloat16, "dlogits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_chunk_boundaries(monkeypatch, dtype):
    """Chunks of 1000 elements: 3 rows a chunk with a partial last (7 x 300) and one row a chunk (5 x 1500):
    loss, stats and dlogits a chunk at a time, with and without weights and smoothing, every reduction; a
    fully masked row kept (NaN) and ignored (0)."""
    monkeypatch.setattr(torch_native, "CHUNK", 1000)
    w = torch.rand(1500, generator=torch.Generator().manual_seed(1)) + 0.5
    for m, n in ((7, 300), (5, 1500)):
        x, t = ce_data((m,), n, dtype, n)
        for reduction in ("none", "mean", "sum"):
            for smoothing, weight in ((0.0, None), (0.1, None), (0.0, w[:n]), (0.1, w[:n])):
                ce_check(x, t, dtype, reduction, smoothing, weight)
        x[1] = x[2] = -INF  # (t[1] is ignored: every fourth from the second)
        for reduction, smoothing in (("none", 0.0), ("sum", 0.1)):
            got = []
            for xx, backend in ((x, "auto"), (x.double(), "torch")):
                xg = xx.clone().requires_grad_()
                kw = dict(reduction=reduction, label_smoothing=smoothing, backend=backend)
                loss, plans = run(fs.cross_entropy, xg, t, **kw)
                (dx,), bwd = run(torch.autograd.grad, loss, xg, torch.ones_like(loss))
                got.append((loss, dx, plans + bwd))
            (loss, dx, plans), (ref, dref, _) = got
            assert (
                plans == [NATIVE_CE, NATIVE_CE] and (dx[1] == 0).all() and dx[2].isnan().any() == dref[2].isnan().any()
            )
            close(loss, ref, dtype, f"loss {reduction} masked rows")  # (NaN where the reference has NaN)
            close(dx, dref, dtype, f"dlogits {reduction} masked rows")


def test_errors_before_any_work():
    x = torch.randn(3, 4)
    heuristics.record(None)
    for call, err in [
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1])), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0.0, 1.0, 2.0])), TypeError),
        (lambda: fs.cross_entropy(x.long(), torch.tensor([0, 1, 2])), TypeError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), reduction="avg"), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), label_smoothing=1.5), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), label_smoothing=False), TypeError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), ignore_index=-100.0), TypeError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), class_weight=torch.ones(3)), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), softcap=-1.0), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), softcap=10**400), ValueError),  # (past a float)
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), z_loss=10**400), ValueError),
        (lambda: fs.cross_entropy(x, torch.tensor([0, 1, 2]), backend="cuda"), ValueError),
    ]:
        with pytest.raises(err):
            call()
    assert heuristics.last_plan() is None


def test_cpu_path_runs_without_triton():
    """CPU tensors need no Triton and no C compiler: with Triton unimportable (sys.modules entry None) and no
    compiler to be found (PATH empty of one, CC unset), cross_entropy, softmax, log_softmax, their backward
    and autograd still answer on the native path and match torch's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """import sys; sys.modules['triton'] = None
import torch, fastsoftmax as fs
from fastsoftmax import heuristics
x, t = torch.randn(3, 513, dtype=torch.float64), torch.tensor([0, 5, 7])
assert torch.allclose(fs.softmax(x), torch.softmax(x, -1), rtol=0, atol=1e-15)
assert heuristics.last_plan().path == 'native'
assert torch.allclose(fs.log_softmax(x.float()), torch.log_softmax(x, -1).float(), atol=1e-6)
y = torch.softmax(x, -1)
assert torch.allclose(fs.softmax_backward(x, y), torch._softmax_backward_data(x, y, 1, x.dtype))
assert torch.allclose(fs.cross_entropy(x, t), torch.nn.functional.cross_entropy(x, t))
import shutil; assert shutil.which('cc') is None and shutil.which('gcc') is None
xg = x.clone().requires_grad_()
(g,) = torch.autograd.grad(fs.cross_entropy(xg, t), xg)
assert torch.allclose(g, (torch.softmax(x, -1) - torch.nn.functional.one_hot(t, 513)) / 3)
print('OK')"""
    src = str(Path(__file__).parents[1] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    env.pop("CC", None)
    env["PATH"] = str(Path(sys.executable).parent)  # (the interpreter's own bin: no C compiler there)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 40])  # (one chunk; several, at CHUNK = 2 rows' worth below)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_and_stats_in_one_pass(monkeypatch, dtype, rows, smoothing):
    """native_loss_stats (what autograd's forward runs past torch's own nodes): the loss as torch's, each
    row's logsumexp (-inf for a fully masked row) within fp32 rounding of float64's, the counts, and the
    logits left as they were, on one chunk and on several, with and without smoothing (its own branch)."""
    v = 513
    monkeypatch.setattr(torch_native, "CHUNK", 2 * v)
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, v, generator=g) * 5).to(dtype)
    x[1] = float("-inf")
    x[2, 9] = 90.0
    t = torch.randint(0, v, (rows,), generator=g)
    t[1] = -100  # (the fully masked row is ignored: its logsumexp is the point)
    w = torch.rand(v, generator=g) + 0.5
    before = x.clone()
    for weights in (None, w):
        loss, st = torch_native.native_loss_stats(x, t, weights, -100, "sum", smoothing, torch.float32)
        assert torch.equal(x, before)  # (the logits are no buffer of ours)
        keep = t != -100
        w64 = None if weights is None else weights.double()
        want = F.cross_entropy(x.double()[keep], t[keep], weight=w64, label_smoothing=smoothing, reduction="sum")
        torch.testing.assert_close(loss.double(), want, rtol=2e-6, atol=1e-5)
        lse = torch.logsumexp(x.double(), 1)
        assert st[1] == float("-inf")
        torch.testing.assert_close(st[:rows].double(), lse, rtol=1e-6, atol=1e-6)
        assert st[rows] == keep.sum() and st[rows + 1] == 1.0
