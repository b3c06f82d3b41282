"""softmax and log_softmax of CPU tensors under backend='auto' (the torch backend's native path: torch's kernels
with the library's conventions, kernels/torch_native.py): the plan that ran, forward and backward; values and
gradients against the float64 oracle (outputs poisoned first where the library allocates them); torch's own
autograd nodes or the library's Function, double backward, gradcheck, compiled autograd. Loss: test_cpu_loss.py;
where torch's kernels miss the tolerance: test_cpu_precision.py."""

import pytest
import torch
from helpers import assert_close, cpu_logits, random_logits, run_poisoned

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare, compare_grad, oracle, oracle_backward, oracle_lse
from fastsoftmax.kernels import torch_native
from fastsoftmax.ops.softmax import forward as api_forward

FNS = {False: fs.softmax, True: fs.log_softmax}
TORCH = {False: torch.softmax, True: torch.log_softmax}
BWD = {False: fs.softmax_backward, True: fs.log_softmax_backward}
ALL = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
LOW = (torch.bfloat16, torch.float16)
NATIVE = heuristics.Plan("torch", "native")
GRAPH = heuristics.Plan("torch", "native_graph")  # the forward under torch's own autograd node
REFERENCE = heuristics.Plan("torch", "reference")
EMPTY = heuristics.Plan("torch", "empty")
INF, NAN = float("inf"), float("nan")
LOGS = pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])


def same(a, b):
    """Bit-equal, NaN where the other has NaN."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


# ---- forward ------------------------------------------------------------------------------------------------


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("n", [1, 7, 513, 50257])
def test_forward_rows(dtype, log, n):
    x = cpu_logits((5, n), dtype, n)
    before = x.clone()
    y, plans = run_poisoned(FNS[log], x)
    assert plans == [NATIVE]
    assert_close(y, x, -1, log)
    assert same(x, before)  # (read only)
    assert (y[5] == (-INF if log else 0.0)).all()  # the fully masked row, exactly
    assert y[7].isnan().all() and y[8].isnan().all()  # NaN, +inf: NaN across
    if n > 1:  # a lone finite logit among -inf: 1 (log: 0) there, exactly
        assert y[6, n // 2] == (0.0 if log else 1.0)


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_forward_every_dim_and_layout(dtype, log):
    """(6, 9, 33) along each dim, as given, permuted, transposed and channels-last (dense: the output keeps x's
    strides, as torch.empty_like), sliced and expanded (not dense: contiguous), a 1-d row; fully masked rows
    along each dim."""
    x = cpu_logits((6, 9, 33), dtype, 3, special=False)
    x[:, 2, 5] = -INF  # a fully masked row along dim 0
    x[1, :, 7] = -INF  # ... along dim 1
    x[4, 3, :] = -INF  # ... along dim 2
    views = (x, x.permute(2, 0, 1), x.transpose(0, 1), x[:, ::2], x[..., 1:], x[:1].expand(4, 9, 33), x[4, 5])
    for t in views + (x.reshape(6, 9, 3, 11).to(memory_format=torch.channels_last),):
        for dim in range(-1, t.dim()):
            y, plans = run_poisoned(FNS[log], t, dim)
            assert plans == [NATIVE], (tuple(t.stride()), dim)
            assert_close(y, t, dim, log)
            assert y.stride() == torch.empty_like(t).stride(), (tuple(t.stride()), dim)
    assert (fs.softmax(x, 0)[:, 2, 5] == 0).all() and (fs.log_softmax(x, 1)[1, :, 7] == -INF).all()


@LOGS
@pytest.mark.parametrize("m", [1, 2, 64, 65, 600])
def test_masked_row_found_whatever_the_row_count(log, m):
    """One fully masked row, the last among m (one row: its first element's bits; up to READ_ROWS: the rows'
    first elements read from memory; more: torch ops), in each dtype, rows in memory and along dim 0; then a
    NaN in it: NaN across. 16-bit log_softmax of 600 x 513: two fp32 chunks, the last partial."""
    assert torch_native.READ_ROWS == 64 and torch_native.CHUNK < 600 * 513 < 2 * torch_native.CHUNK
    for dtype in ALL:
        x = cpu_logits((m, 513), dtype, m, special=False)
        x[m - 1] = -INF
        for t, dim in ((x, 1), (x[:, :40].t().contiguous(), 0)):  # (long rows along dim 0: test_rows_not_in_memory)
            y, plans = run_poisoned(FNS[log], t, dim)
            assert plans == [NATIVE]
            assert_close(y, t, dim, log)
            assert (y.select(1 - dim, m - 1) == (-INF if log else 0.0)).all(), (dtype, dim)
        x[m - 1, 3] = NAN  # now a NaN row: NaN across, the others untouched
        y = FNS[log](x)
        assert y[m - 1].isnan().all() and not y[: m - 1].isnan().any()


@LOGS
@pytest.mark.parametrize("m", [3, 65, 600])
def test_rows_not_in_memory(log, m):
    """Rows of 513 along dim 0 of a contiguous (513, m), m rows side by side in memory, in fp32 and 16-bit,
    dtype= wider and narrower: within the tolerance (fp32: within twice the error of fp32 torch ops, plus
    atol). (torch's CPU kernel along an inner dim sums each row's exps one by one: past the rule.)"""
    for dtype, od in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)):
        for seed in range(2):
            t = random_logits((513, m), dtype, torch.Generator().manual_seed(seed))
            y, plans = run_poisoned(FNS[log], t, 0, dtype=od)
            assert plans == [NATIVE]
            err, problem = compare(y, t, 0, log, od)
            assert problem is None, (dtype, od, seed, problem)


@LOGS
def test_dtype_out_written_once(log):
    """dtype= computed from x as given in fp32 (fp64 where either is) and rounded once: narrower (fp32 ->
    bf16, fp64 -> fp32, fp16 -> bf16, fp64 -> fp16), wider (bf16 -> fp32, fp32 -> fp64, fp16 -> fp64), rows
    in memory and not, special rows."""
    pairs = [(torch.float32, torch.bfloat16), (torch.float64, torch.float32), (torch.float16, torch.bfloat16)]
    pairs += [(torch.float64, torch.float16), (torch.bfloat16, torch.float32), (torch.float32, torch.float64)]
    pairs += [(torch.float16, torch.float64)]
    for xd, od in pairs:
        x = cpu_logits((5, 513), xd, 11)
        for t, dim in ((x, -1), (x, 0), (x.t(), 0), (x.t().contiguous(), 0)):
            y, plans = run_poisoned(FNS[log], t, dim, dtype=od)
            assert plans == [NATIVE] and y.dtype == od
            assert_close(y, t, dim, log, od)
            assert y.stride() == torch.empty_like(t).stride()


@LOGS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunk_boundaries(monkeypatch, dtype, log):
    """Chunks of 1000 elements: rows computed in fp32 a chunk at a time (16-bit log_softmax, dtype= narrower)
    with 3 rows a chunk and a partial last (7 x 300) and one row a chunk (5 x 1500), a fully masked row."""
    monkeypatch.setattr(torch_native, "CHUNK", 1000)
    for m, n in ((7, 300), (5, 1500)):
        x = cpu_logits((m, n), dtype, m, special=False)
        x[m - 2] = -INF
        cases = [(x.float(), torch.bfloat16), (x.double(), dtype)] + ([(x, None)] if dtype in LOW else [])
        for t, od in cases:
            y, plans = run_poisoned(FNS[log], t, dtype=od)
            assert plans == [NATIVE]
            assert_close(y, t, -1, log, od)
            assert (y[m - 2] == (-INF if log else 0.0)).all()


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_zero_dim_and_empty(dtype, log):
    """A 0-d x is a row of one: 1 (log: 0), -inf gives 0 (log: -inf), NaN and +inf NaN, under autograd
    too (gradient 0); empty tensors along every dim give empty outputs of x's layout (plan "empty"), forward,
    backward and dtype=. (Which path a 0-d call takes: test_zero_dim_takes_the_native_path.)"""
    for v, want in ((2.5, 0.0 if log else 1.0), (-INF, -INF if log else 0.0), (NAN, NAN), (INF, NAN)):
        x = torch.tensor(v, dtype=dtype)
        y, plans = run_poisoned(FNS[log], x)
        assert [p.backend for p in plans] == ["torch"] and y.shape == () and y.dtype == dtype
        assert same(y, torch.tensor(want, dtype=dtype)), (v, y)
        dx, plans = run_poisoned(BWD[log], torch.tensor(1.5, dtype=dtype), y)
        assert [p.backend for p in plans] == ["torch"] and dx.shape == ()
        want = oracle_backward(torch.tensor([1.5]), y.reshape(1), 0, log).to(dtype).reshape(())
        assert same(dx, want), (v, dx)
    xg = torch.tensor(0.5, dtype=dtype, requires_grad=True)
    (dx,) = torch.autograd.grad(FNS[log](xg), xg)
    assert dx == 0.0
    for shape in ((0, 5), (5, 0), (3, 0, 4)):
        x = torch.empty(shape, dtype=dtype)
        for dim in range(len(shape)):
            for od in (None, torch.float64 if dtype != torch.float64 else torch.float32):
                y, plans = run_poisoned(FNS[log], x, dim, dtype=od)
                assert plans == [EMPTY] and y.shape == shape and y.dtype == (od or dtype)
            dx, plans = run_poisoned(BWD[log], x, x, dim)
            assert plans == [EMPTY] and dx.shape == shape
            xg = x.clone().requires_grad_()
            (dx,) = torch.autograd.grad(FNS[log](xg, dim), xg, x)
            assert dx.shape == shape


# ---- which path ran ---------------------------------------------------------------------------------------


def test_zero_dim_takes_the_native_path():
    """A plain 0-d call under backend='auto' on CPU is a row of one on the native path (dispatch.select: only
    masks and logsumexp outputs take the reference), forward and backward."""
    for log in (False, True):
        y, plans = run_poisoned(FNS[log], torch.tensor(0.5))
        assert plans == [NATIVE], log
        _, plans = run_poisoned(BWD[log], torch.tensor(1.5), y)
        assert plans == [NATIVE], log


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_masks_and_logsumexp_take_the_reference(dtype, log):
    """backend='auto' on CPU: a mask, a scale or causal, and fastsoftmax.ops.softmax.forward(want_lse=True)
    run the torch backend's reference path (outputs poisoned first: every element written); a plain forward
    (want_lse=False) the native one. Values against the oracle of the masked logits."""
    x = cpu_logits((3, 4, 33), dtype, 12, special=False)
    keep = torch.rand(4, 33, generator=torch.Generator().manual_seed(12)) > 0.3
    keep[1] = False  # fully masked rows
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    for kw, z in (
        (dict(mask=keep), x.to(wide).masked_fill(~keep, -INF)),
        (dict(mask=torch.where(keep, 0.0, -INF).to(dtype)), x.to(wide).masked_fill(~keep, -INF)),
        (dict(scale=0.5), x.to(wide) * 0.5),
        (dict(causal=True), x.to(wide).masked_fill(torch.ones(4, 33, dtype=torch.bool).tril(29).logical_not(), -INF)),
    ):
        y, plans = run_poisoned(FNS[log], x, **kw)
        assert plans == [REFERENCE], kw
        assert_close(y, z, -1, log, dtype)
    (y, lse), plans = run_poisoned(api_forward, x, 1, log=log, want_lse=True)
    assert plans == [REFERENCE] and lse.dtype == torch.float32 and lse.shape == (3, 33)
    assert_close(y, x, 1, log)
    torch.testing.assert_close(lse.double(), oracle_lse(x, 1), rtol=2e-6, atol=1e-6)
    (y2, none), plans = run_poisoned(api_forward, x, 1, log=log)
    assert plans == [NATIVE] and none is None and same(y2, FNS[log](x, 1))
    dx, plans = run_poisoned(BWD[log], torch.ones_like(y), y, 1, mask=torch.ones(1, 4, 1, dtype=torch.bool))
    assert plans == [REFERENCE] and compare_grad(dx, torch.ones_like(y), y, 1, log)[1] is None
    y, plans = run_poisoned(FNS[log], x, backend="torch")
    assert plans == [REFERENCE]
    assert_close(y, x, -1, log)


# ---- autograd -----------------------------------------------------------------------------------------------

# grad_fn of an eager x (contiguous, no row fully masked, no NaN) that requires grad, per (dtype, log): torch's
# own node where it computes the library's gradient, else the library's Function
NODE = {(d, False): "SoftmaxBackward0" for d in ALL} | {(d, True): "ToCopyBackward0" for d in LOW}
NODE |= {(torch.float32, True): "LogSoftmaxBackward0", (torch.float64, True): "SoftmaxFunctionBackward"}


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
def test_autograd_nodes_and_gradients(dtype, log):
    """The grad_fn per dtype (NODE), its forward the plain call's bit for bit, its gradient the oracle's
    (compare_grad, an upstream gradient with outliers) and fs.softmax_backward's bit for bit (16-bit
    log_softmax: the oracle's of the fp32 output torch's node differentiates) along the last dim and dim 0;
    torch's nodes record no backward plan, the Function a native one (along dim 0, rows not in memory, the
    Function). Under no_grad (an nn.Parameter, the nn.Module): the plain call, no graph."""
    x = cpu_logits((6, 513), dtype, 14, special=False)
    dy = cpu_logits((6, 513), dtype, 15, special=False)
    with torch.no_grad():
        y, plans = run_poisoned((fs.LogSoftmax if log else fs.Softmax)(0), torch.nn.Parameter(x))
    assert y.grad_fn is None and plans == [NATIVE] and same(y, FNS[log](x, 0))
    for dim in (-1, 0):
        # (along dim 0 the rows are not in memory: the plain call moves them last, torch's node would not)
        node = NODE[dtype, log] if dim == -1 else "SoftmaxFunctionBackward"
        xg = x.clone().requires_grad_()
        y, plans = run_poisoned(FNS[log], xg, dim)
        assert y.grad_fn.name() == node, (dim, y.grad_fn.name())
        assert plans == [NATIVE if node == "SoftmaxFunctionBackward" else GRAPH]
        assert same(y.detach(), FNS[log](x, dim))
        (dx,), plans = run_poisoned(torch.autograd.grad, y, xg, dy)
        assert plans == ([NATIVE] if node == "SoftmaxFunctionBackward" else [])
        assert dx.dtype == dtype
        # (ToCopyBackward0: torch's node differentiates the fp32 output, not the 16-bit y it was rounded to)
        y_ref = oracle(x, dim, log) if node == "ToCopyBackward0" else y.detach()
        err, problem = compare_grad(dx, dy, y_ref, dim, log, dtype)
        assert problem is None, (dim, problem)
        if node != "ToCopyBackward0":  # (the same kernel as the public backward's, from the same y)
            assert same(dx, BWD[log](dy, y.detach(), dim)), dim


@pytest.mark.parametrize(
    "case", ["masked_row", "masked_row_many", "nan_row", "inf_row", "strided", "dtype_out", "bf16_masked"]
)
def test_autograd_function_where_torchs_node_cannot(case):
    """The library's Function (SoftmaxFunctionBackward, both passes native) where torch's node would not
    give the library's output or gradient: a fully masked row (torch's gradient NaN, the library's 0) among
    4 rows and among 100 (found by torch ops), a NaN or +inf row (found by the same check), a non-contiguous
    x, another output dtype; softmax and log_softmax."""
    dtype, m = torch.bfloat16 if case.startswith("bf16") else torch.float32, 100 if case.endswith("many") else 4
    x = cpu_logits((m, 33), dtype, 16, special=False)
    bad = {"nan_row": 1, "inf_row": 3}.get(case, 2 if "masked" in case else None)
    if bad is not None:
        x[bad if case != "nan_row" else (1, 5)] = {"nan_row": NAN, "inf_row": INF}.get(case, -INF)
    x = x.t().contiguous().t() if case == "strided" else x
    kw = {"dtype": torch.float64} if case == "dtype_out" else {}
    for log in (False, True):
        xg = x.clone().requires_grad_()
        y, plans = run_poisoned(FNS[log], xg, **kw)
        assert y.grad_fn.name() == "SoftmaxFunctionBackward" and plans == [NATIVE], log
        assert same(y.detach(), FNS[log](x, **kw))
        dy = cpu_logits((m, 33), torch.float32, 17, special=False).to(y.dtype)
        (dx,), plans = run_poisoned(torch.autograd.grad, y, xg, dy)
        assert plans == [NATIVE] and dx.dtype == dtype and dx.stride() == torch.empty_like(x).stride()
        ok = [r for r in range(m) if r != bad]
        if case in ("nan_row", "inf_row"):
            assert dx[bad].isnan().all()
        elif bad is not None:
            assert (y[bad] == (-INF if log else 0.0)).all() and (dx[bad] == 0).all()
        assert compare_grad(dx[ok], dy[ok], y.detach()[ok], -1, log, dtype)[1] is None


@LOGS
def test_double_backward_matches_torchs(log):
    """create_graph=True through torch's node (fp32) and through the Function (a strided x; fp64
    log_softmax): the first gradient within the oracle's tolerance, the second torch's own."""
    for x in (cpu_logits((5, 40), torch.float32, 18, special=False), cpu_logits((40, 5), torch.float32, 19, False).t()):
        for dtype in (torch.float32, torch.float64):
            xg = x.to(dtype).requires_grad_()
            dy = cpu_logits((5, 40), dtype, 20, special=False)
            y = FNS[log](xg)
            (dx,) = torch.autograd.grad(y, xg, dy, create_graph=True)
            assert dx.requires_grad and compare_grad(dx.detach(), dy, y.detach(), -1, log)[1] is None
            (ddx,) = torch.autograd.grad(dx, xg, dy)
            xt = x.to(dtype).requires_grad_()
            (dxt,) = torch.autograd.grad(TORCH[log](xt, -1), xt, dy, create_graph=True)
            (want,) = torch.autograd.grad(dxt, xt, dy)
            tol = 1e-4 if dtype == torch.float32 else 1e-10
            torch.testing.assert_close(ddx, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_gradcheck_float64():
    """gradcheck and gradgradcheck in fp64 on small inputs: torch's node (softmax), the Function (fp64
    log_softmax, a strided x), along dim 0 too."""
    x = torch.randn(3, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(21)) * 2
    cases = [(x, -1), (x, 0), (x.t().contiguous().t(), -1)]
    for log in (False, True):
        for t, dim in cases:
            t = t.detach().requires_grad_()
            f = lambda z, log=log, dim=dim: FNS[log](z, dim)  # noqa: E731
            assert torch.autograd.gradcheck(f, (t,))
            assert torch.autograd.gradgradcheck(f, (t,))


@LOGS
@pytest.mark.parametrize("case", ["float32", "bfloat16", "masked_row"])
def test_compiled_autograd_over_eager_calls(case, log):
    """Compiled autograd over an eager fs.softmax / fs.log_softmax (torch's node for fp32 and bf16, the
    library's Function on a fully masked row): the gradient the eager backward gives (a regression: a
    library C++ node without compiled_args broke it); and torch.compile(backend="eager") of a function
    that calls torch.autograd.grad on an eager output."""
    from torch._dynamo import compiled_autograd

    enable = getattr(compiled_autograd, "_enable", None) or compiled_autograd.enable
    x = cpu_logits((4, 33), torch.bfloat16 if case == "bfloat16" else torch.float32, 22, special=False)
    if case == "masked_row":
        x[1] = -INF
    dy = cpu_logits((4, 33), x.dtype, 23, special=False)
    xg = x.clone().requires_grad_()
    y = FNS[log](xg)
    assert y.grad_fn.name() == ("SoftmaxFunctionBackward" if case == "masked_row" else NODE[x.dtype, log])
    (want,) = torch.autograd.grad(y, xg, dy, retain_graph=True)
    torch._dynamo.reset()
    try:
        with enable(torch.compile(backend="eager")):
            (y * dy).sum().backward()
        assert same(xg.grad, want)
        grad = torch.compile(lambda out, inp, g: torch.autograd.grad(out, inp, g)[0], backend="eager")
        assert same(grad(FNS[log](xg), xg, dy), want)
    finally:
        torch._dynamo.reset()


# ---- backward ---------------------------------------------------------------------------------------------


@LOGS
@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("m", [1, 5, 70])
def test_backward_autograd_and_public(dtype, log, m):
    """dx through autograd (the Function: a fully masked row) and through fs.softmax_backward: bit-equal,
    both native, the oracle's; the fully masked row's gradient exactly 0 even where dy there is NaN or inf;
    NaN in dy spreads across its row."""
    x = cpu_logits((m, 513), dtype, 26 + m, special=False)
    x[m - 1] = -INF
    dy = cpu_logits((m, 513), dtype, m, special=False)
    dy[m - 1, 2], dy[m - 1, 9] = NAN, INF
    if m > 1:
        dy[0, 4] = NAN
    xg = x.clone().requires_grad_()
    y = FNS[log](xg)
    (dx,), plans = run_poisoned(torch.autograd.grad, y, xg, dy)
    assert plans == [NATIVE]
    y = y.detach()
    dx2, plans = run_poisoned(BWD[log], dy, y)
    assert plans == [NATIVE] and same(dx, dx2)
    for d in (dx, dx2):
        assert (d[m - 1] == 0).all()
        if m > 1:
            assert d[0].isnan().all()
        keep = slice(1, m - 1)
        assert compare_grad(d[keep], dy[keep], y[keep], -1, log)[1] is None


@LOGS
def test_backward_layouts_dtypes_and_dead_rows(log):
    """Permuted or expanded y (dx in y's layout, torch.empty_like's), dy in another layout, dy of another
    dtype, dtype= outputs (narrower and wider), 3-d along each dim; log_softmax rows whose exps all underflow
    in fp32 (every y < -104) give 0, rows just above keep the formula; softmax rows of y all 0 give 0."""
    y0 = FNS[log](cpu_logits((6, 9, 33), torch.float32, 9, special=False), 0)
    dy0 = cpu_logits((6, 9, 33), torch.float32, 10, special=False)
    for y, dy, dim in (
        (y0, dy0, 0),
        (y0.permute(2, 1, 0), dy0.permute(2, 1, 0), 2),
        (y0, dy0.transpose(0, 2).contiguous().transpose(0, 2), 1),
        (y0.bfloat16(), dy0, 2),
        (y0.double().transpose(0, 1), dy0.transpose(0, 1), 1),
        (y0[:1].expand(6, 9, 33), dy0, 2),  # (overlapping: read as a contiguous copy)
    ):
        for dyd, od in ((None, None), (torch.bfloat16, None), (None, torch.bfloat16), (torch.float64, None)):
            dyt = dy.to(dyd or y.dtype)
            dx, plans = run_poisoned(BWD[log], dyt, y, dim, dtype=od)
            assert plans == [NATIVE] and dx.stride() == torch.empty_like(y).stride()
            out = od or y.dtype
            assert dx.dtype == out and compare_grad(dx, dyt, y, dim, log, out)[1] is None, (y.dtype, dyd, od, dim)
    gen = torch.Generator().manual_seed(11)
    if log:
        y = torch.full((3, 40), -120.0)
        y[1] = -101.0  # exp(-101) > 0 in fp32: not a dead row
        y[2, 7] = -10.0
    else:
        y = torch.softmax(torch.randn(3, 40, generator=gen), -1)
        y[0] = 0.0
    dy = torch.randn(3, 40, generator=gen)
    for m in (1, 3, 70):
        yy, dd = y.repeat(24, 1)[:m], dy.repeat(24, 1)[:m]
        dx, plans = run_poisoned(BWD[log], dd, yy)
        assert plans == [NATIVE] and (dx[0] == 0).all() and compare_grad(dx, dd, yy, -1, log)[1] is None
        if m > 1:
            assert (dx[1] != 0).any()


def test_lazily_negated_inputs():
    """torch._neg_view (its memory holds -value): x, dy and y read as their values, so the output equals
    the one for the materialised tensor, fully masked rows included (a log_softmax y of -inf is +inf in
    memory)."""
    x = cpu_logits((4, 37), torch.float32, 27, special=False)
    x[2] = -INF
    dy = cpu_logits((4, 37), torch.float32, 28, special=False)
    for log in (False, True):
        y = FNS[log](x)
        for fn, args, want in (
            (FNS[log], (torch._neg_view(-x),), FNS[log](x)),
            (BWD[log], (torch._neg_view(-dy), y), BWD[log](dy, y)),
            (BWD[log], (dy, torch._neg_view(-y)), BWD[log](dy, y)),
        ):
            got, plans = run_poisoned(fn, *args)
            assert plans == [NATIVE] and same(got, want), (log, fn.__name__, got[2])


def test_errors_before_any_work():
    x = torch.randn(3, 4)
    heuristics.record(None)
    for call, err in [
        (lambda: fs.softmax(x, 2), IndexError),
        (lambda: fs.softmax(x, 1.0), TypeError),
        (lambda: fs.softmax(x, dtype=torch.int32), TypeError),
        (lambda: fs.softmax(x.long()), TypeError),
        (lambda: fs.log_softmax(x, backend="nope"), ValueError),
        (lambda: fs.softmax_backward(x, x[:2]), ValueError),
        (lambda: fs.softmax_backward(x.long(), x), TypeError),
    ]:
        with pytest.raises(err):
            call()
    dead = torch.randn(3, 4)
    dead.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="no storage"):
        fs.softmax(dead)
    assert heuristics.last_plan() is None
