"""Backward: every path forced against the float64 oracle (odd N, looped long rows, fully masked rows,
NaN in dy, non-contiguous dy and y), autograd through the custom op (gradcheck, double backward), the
public backward functions, opcheck, and torch.compile(fullgraph=True) with no graph break."""

import pytest
import torch
from helpers import DTYPES, assert_close, overflowing_grad_inputs, random_logits, special_rows

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare_grad
from fastsoftmax.heuristics import softmax_triton

# online and split with chunks of 256: rows of 513 and 1000 loop over 3-4 chunks (and segments)
PATHS = [("rowblock", {}), ("online", {"block_n": 256}), ("split", {"block_n": 256})]
FNS = {False: fs.softmax, True: fs.log_softmax}
BWD = {False: fs.softmax_backward, True: fs.log_softmax_backward}


def assert_grad(dx, dy, y, dim, log, out_dtype=None):
    err, problem = compare_grad(dx, dy, y, dim, log, out_dtype)
    assert problem is None, problem
    return err


def forward_backward(x, dy, dim, log, backend="triton", **force):
    """y = f(x) and dx from autograd, outputs poisoned, path forced; returns (y, dx, backward plan). The
    plan comes from the backward function called here with the same arguments (on CUDA autograd runs the
    backward on its own thread, which records its own plan), and that call must give autograd's dx."""
    x = x.detach().requires_grad_()
    with heuristics.force(poison=True, **force):
        y = FNS[log](x, dim, backend=backend)
        (dx,) = torch.autograd.grad(y, x, dy)
        direct = BWD[log](dy, y.detach(), dim, dtype=x.dtype, backend=backend)
    torch.testing.assert_close(direct, dx, rtol=0, atol=0, equal_nan=True)
    return y.detach(), dx, heuristics.last_plan()


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [7, 513, 1000])
@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
def test_paths_against_oracle(device, path, force, n, dtype, log):
    gen = torch.Generator().manual_seed(n)
    x = torch.cat([random_logits((5, n), dtype, gen), special_rows(n, dtype, gen)]).to(device)
    dy = random_logits(x.shape, dtype, gen, scale=1.0).to(device)
    y, dx, plan = forward_backward(x, dy, -1, log, path=path, **force)
    assert (plan.backend, plan.path) == ("triton", path)
    if path == "rowblock":  # the tile holds the aligned body: 513 = 512 + edges; 7 is scalar code
        assert plan.block_n == {7: 8, 513: 512, 1000: 1024}[n] and plan.edges == (n != 7), plan
    assert dx.dtype == dtype
    assert_grad(dx, dy, y, -1, log)
    assert (dx[5] == 0).all() and dx[9].isnan().all()  # special rows: 0 fully masked, 4 NaN among -inf


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_long_rows_take_rowblock_with_more_warps(device, dtype, log):
    """Unforced, a backward row of BWD_LONG_N < N <= ROWBLOCK_MAX_N is held in registers by BWD_LONG_WARPS
    warps (one read of y and dy), and is right, special rows included."""
    n = softmax_triton.BWD_LONG_N + 3617
    gen = torch.Generator().manual_seed(n)
    x = torch.cat([random_logits((1, n), dtype, gen), special_rows(n, dtype, gen)[[0, 6, 7]]]).to(device)
    dy = random_logits(x.shape, dtype, gen, scale=1.0).to(device)
    with heuristics.force(poison=True):
        y = FNS[log](x, -1, backend="triton")
        dx = BWD[log](dy, y, -1, backend="triton")  # called here: autograd's CUDA thread keeps its own plan
    plan = heuristics.last_plan()
    assert (plan.path, plan.num_warps, plan.rows) == ("rowblock", softmax_triton.BWD_LONG_WARPS, 1)
    assert_grad(dx, dy, y, -1, log)
    assert (dx[1] == 0).all()  # the fully masked row


@pytest.mark.parametrize("vec", [1, 8])
@pytest.mark.parametrize("extra", [1, 7, 8])
def test_long_row_rule_and_register_cap_agree(vec, extra):
    """The long-row warps (launch_shape) and the register cap (max_registers) follow one rule, on the body a
    tile holds: N = BWD_LONG_N + 1..7 in bf16 vectors has a BWD_LONG_N body (edges hold the rest), so no
    cap and a BWD_LONG_N tile; a scalar row of that N, or a body past BWD_LONG_N, gets the long rows' warps,
    the cap and a tile twice as wide."""
    n = softmax_triton.BWD_LONG_N + extra
    shape = softmax_triton.launch_shape(n, 4096, 2, False, 132, "rowblock", inputs=2, vec=vec)
    long = vec == 1 or extra >= vec
    assert shape.num_warps == softmax_triton.BWD_LONG_WARPS or not long, shape
    assert (softmax_triton.max_registers(shape, 2) is not None) == long
    assert shape.block_n == (2 * softmax_triton.BWD_LONG_N if long else softmax_triton.BWD_LONG_N)


@pytest.mark.parametrize("dtype,extra", [(torch.bfloat16, 7), (torch.bfloat16, 8), (torch.float32, 3)], ids=str)
def test_the_launch_asks_for_the_cap_of_its_tile(device, monkeypatch, dtype, extra):
    """The backward launch asks for the register cap (maxnreg) only where its tile's body is a long row:
    N = BWD_LONG_N + 7 in bf16 (+ 3 in fp32) holds a BWD_LONG_N body, + 8 in bf16 one past it."""
    from fastsoftmax.kernels.triton import softmax_bwd

    asked = []

    def launch(kernel, grid, args, options):
        asked.append(dict(options))
        return real(kernel, grid, args, options)

    real = softmax_bwd.launch
    monkeypatch.setattr(softmax_bwd, "launch", launch)
    n = softmax_triton.BWD_LONG_N + extra
    gen = torch.Generator().manual_seed(n)
    y = torch.softmax(random_logits((2, n), dtype, gen).double(), -1).to(dtype).to(device)
    dy = random_logits((2, n), dtype, gen, scale=1.0).to(device)
    with heuristics.force(poison=True):
        dx = fs.softmax_backward(dy, y, backend="triton")
    assert heuristics.last_plan().path == "rowblock" and len(asked) == 1
    long = extra >= 16 // y.element_size()
    assert ("maxnreg" in asked[0]) == long, asked
    assert heuristics.last_plan().block_n == softmax_triton.BWD_LONG_N * (2 if long else 1)
    assert_grad(dx, dy, y, -1, False)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
def test_nan_in_dy(device, path, force, log):
    gen = torch.Generator().manual_seed(1)
    x = random_logits((4, 100), torch.float32, gen).to(device)
    x[1] = float("-inf")  # fully masked
    dy = torch.randn(4, 100, generator=gen).to(device)
    dy[0, 5] = float("nan")  # propagates through the row sum
    dy[1, 7] = float("nan")  # a fully masked row still gets 0
    y, dx, plan = forward_backward(x, dy, -1, log, path=path, **force)
    assert plan.path == path
    assert dx[0].isnan().any() and (dx[1] == 0).all() and not dx[2:].isnan().any()
    assert_grad(dx, dy, y, -1, log)


@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
@pytest.mark.parametrize(
    "make_dy",
    [lambda d: d.t().contiguous().t(), lambda d: torch.cat([d, d], -1)[:, : d.shape[1]], lambda d: d.to(torch.float32)],
    ids=["transposed_dy", "sliced_dy", "fp32_dy"],
)
def test_non_contiguous_and_other_dtype_dy(device, path, force, make_dy):
    gen = torch.Generator().manual_seed(2)
    x = random_logits((8, 300), torch.bfloat16, gen).to(device)
    dy = make_dy(torch.randn(8, 300, generator=gen).to(torch.bfloat16).to(device))
    y = fs.softmax(x)
    with heuristics.force(poison=True, path=path, **force):
        dx = fs.softmax_backward(dy, y, backend="triton")  # dy reaches the kernel as given (autograd would cast)
    plan = heuristics.last_plan()
    # dy in another layout is copied into y's; dy in another dtype is read as it is
    assert plan.path == path and plan.copied == (dy.dtype == torch.bfloat16)
    assert_grad(dx, dy, y, -1, False)


@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
@pytest.mark.parametrize(
    "shape,dim,make", [((24, 64), 0, None), ((6, 40, 5), 1, None), ((30, 64), -1, lambda t: t[:, 3:50])]
)
def test_layouts(device, path, force, shape, dim, make):
    gen = torch.Generator().manual_seed(3)
    x = random_logits(shape, torch.float32, gen).to(device)
    x = make(x) if make else x
    dy = torch.randn(x.shape, generator=gen).to(device)
    for log in (False, True):
        y, dx, plan = forward_backward(x, dy, dim, log, path=path, **force)
        assert plan.path == path
        assert_grad(dx, dy, y, dim, log)


@pytest.mark.parametrize("path", ["online", "split"])
@pytest.mark.parametrize(
    "shape,dim,permute,block_n",
    [
        ((2, 129, 2), 0, False, 16),
        ((2, 129), 0, False, 16),
        ((2, 5, 129), -1, True, 2),
        ((3, 5, 3, 8), 0, False, 16),
        ((2, 3, 1, 17, 3), -5, False, 16),  # a size-1 dim among the row dims
    ],
)
def test_strided_rows_on_multi_row_tiles(device, path, shape, dim, permute, block_n):
    """Short strided rows forced through the looping paths: tiles of 64 rows at 1 warp. On the H200 (Triton
    3.6) the backward's row sums were rewritten by the compiler and mixed rows 32-63 with rows 0-31 (dx = 0
    there) or every row (docs/investigations.md): the cases seen."""
    gen = torch.Generator().manual_seed(7)
    x = random_logits(shape, torch.float32, gen).to(device)
    x = x.permute(*range(x.dim() - 1, -1, -1)) if permute else x
    dy = torch.randn(x.shape, generator=gen).to(device)  # contiguous: copied to y's strides when permuted
    for log in (False, True):
        y, dx, plan = forward_backward(x, dy, dim, log, path=path, block_n=block_n)
        assert (plan.path, plan.rows, plan.block_n) == (path, 64, block_n)
        assert_grad(dx, dy, y, dim, log)


@pytest.mark.parametrize(
    "shape,dtype,out_dtype,dim,log",
    [
        ((3, 5, 3, 8), torch.bfloat16, torch.float32, 0, False),  # bf16 in, fp32 out
        ((2, 3, 1, 17, 3), torch.float32, None, -5, True),  # a size-1 dim among the row dims
    ],
    ids=["bf16_in_fp32_out", "5d_size1_dim"],
)
def test_strided_rows_on_multi_row_tiles_seen_cases(device, shape, dtype, out_dtype, dim, log):
    """The two failing cases the property hunt printed for the mixed-rows bug above, exactly: contiguous x,
    online path, chunks of 16, tiles of 64 rows, forward and backward against the float64 oracle."""
    gen = torch.Generator().manual_seed(11)
    x = random_logits(shape, dtype, gen).to(device)
    y_dtype = out_dtype or dtype
    dy = torch.randn(shape, generator=gen).to(y_dtype).to(device)
    xg = x.detach().requires_grad_()
    with heuristics.force(poison=True, path="online", block_n=16):
        y = FNS[log](xg, dim, dtype=out_dtype, backend="triton")
        (dx,) = torch.autograd.grad(y, xg, dy)
        direct = BWD[log](dy, y.detach(), dim, dtype=dtype, backend="triton")
        plan = heuristics.last_plan()
    assert (plan.backend, plan.path, plan.rows, plan.block_n) == ("triton", "online", 64, 16)
    torch.testing.assert_close(direct, dx, rtol=0, atol=0, equal_nan=True)
    assert y.dtype == y_dtype and dx.dtype == dtype
    assert_close(y.detach(), x, dim, log, out_dtype)
    assert_grad(dx, dy, y.detach(), dim, log, dtype)


@pytest.mark.parametrize("log", [False, True])
def test_public_backward_functions(device, log):
    gen = torch.Generator().manual_seed(4)
    x = random_logits((6, 77), torch.bfloat16, gen).to(device)
    y = FNS[log](x, dtype=torch.float32)  # fp32 output of a bf16 input
    dy = torch.randn(6, 77, generator=gen).to(device)
    for backend in ("triton", "torch"):
        with heuristics.force(poison=True):
            dx = BWD[log](dy, y, -1, dtype=torch.bfloat16, backend=backend)
        assert heuristics.last_plan().backend == backend
        assert_grad(dx, dy, y, -1, log, torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        BWD[log](dy[:, :5], y)
    with pytest.raises(TypeError, match="dy must be floating"):
        BWD[log](dy.to(torch.int32), y)
    with pytest.raises(IndexError):
        BWD[log](dy, y, 2)


def test_backward_edge_shapes(device):
    for shape in [(0, 5), (3, 0), ()]:
        x = torch.randn(shape, device=device, requires_grad=True)
        y = fs.softmax(x, -1 if shape else 0)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert g.shape == x.shape and (g == 0).all()


def test_gradcheck_and_double_backward():
    # float64 takes the torch path inside the same custom op; autograd formula and double backward checked.
    gen = torch.Generator().manual_seed(5)
    for shape, dim in [((3, 7), -1), ((4, 5, 3), 1), ((5,), 0)]:
        for log in (False, True):
            x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
            f = lambda t, d=dim, lg=log: FNS[lg](t, d)  # noqa: E731
            assert torch.autograd.gradcheck(f, (x,))
            assert torch.autograd.gradgradcheck(f, (x,))


def test_only_the_output_is_saved(device):
    x = torch.randn(4, 9, device=device, requires_grad=True)
    y = fs.softmax(x)
    saved = y.grad_fn._saved_tensors if hasattr(y.grad_fn, "_saved_tensors") else None
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = fs.softmax(x)
    assert len(packed) == 1 and packed[0].data_ptr() == y.data_ptr(), saved


@pytest.mark.parametrize("log", [False, True])
def test_opcheck(device, log):
    x = torch.randn(3, 33, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.fastsoftmax.softmax.default, (x, -1, log, None, "auto"))
    y = fs.softmax(x.detach(), dtype=torch.float32)
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.fastsoftmax.softmax_backward.default, (dy, y, -1, log, torch.float32, "auto"))


def test_torch_compile_fullgraph(device):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 32)
            self.sm = fs.LogSoftmax(dim=-1)

        def forward(self, t):
            return fs.softmax(self.lin(t), -1).sum(-1) + self.sm(self.lin(t)).mean(-1)

    torch.manual_seed(6)
    model = Model().to(device)
    x = torch.randn(8, 16, device=device)
    ref = model(x)
    (g_ref,) = torch.autograd.grad(ref.sum(), model.lin.weight)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    out = compiled(x)  # fullgraph=True raises on any graph break
    (g,) = torch.autograd.grad(out.sum(), model.lin.weight)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradient_tolerance_catches_bugs(log, dtype):
    """The gradient tolerance (which allows for the fp32 accumulation of the row sum) still rejects the
    bugs a backward kernel could have: the row sum accumulated in a 16-bit input dtype, the sum off by
    1e-4 (fp32) or 2^-5 (bf16) relative, one element off by 4 times that. The gradient from an fp32 sum passes."""
    gen = torch.Generator().manual_seed(5)
    n = 50257
    y = torch.softmax(random_logits((4, n), torch.float32, gen), -1)
    y = (y.log() if log else y).to(dtype)
    dy = torch.randn(4, n, generator=gen).to(dtype)
    a = dy.float() if log else y.float() * dy.float()
    f = y.float().exp() if log else y.float()

    def grad(s):
        return (a - f * s).to(dtype)

    s = a.sum(-1, keepdim=True)
    assert compare_grad(grad(s), dy, y, -1, log)[1] is None
    off = 1e-4 if dtype == torch.float32 else 2**-5  # relative: well under fp32 output's tolerance, 4 bf16 ulp
    wrong = {"sum off": grad(s * (1 + off) + off)}
    if dtype != torch.float32:  # a tree sum rounded to the input dtype at every level
        t = torch.nn.functional.pad(a, (0, (1 << (n - 1).bit_length()) - n)).to(dtype)
        while t.shape[-1] > 1:
            t = t[:, 0::2] + t[:, 1::2]
        wrong["sum in input dtype"] = grad(t.float())
    one = grad(s)
    i = (f * s).abs().argmax()  # an element where the sum term matters
    one.view(-1)[i] = (one.view(-1)[i].float() * (1 + 4 * off) + off).to(dtype)
    wrong["one element off"] = one
    for name, dx in wrong.items():
        assert compare_grad(dx, dy, y, -1, log)[1] is not None, name


def test_gradient_overflow_is_checked():
    """A softmax gradient is not bounded: y·dy of large y (as a caller passing any y may) overflows fp16. The
    oracle's own rounding to fp16 (infinities of the right sign) passes; a saturated value, a flipped sign
    or an infinity where the oracle is finite in fp16 fails."""
    from fastsoftmax.core.reference import oracle_backward

    dy, y = overflowing_grad_inputs(4097, 11)
    exact = oracle_backward(dy, y, -1, False).to(torch.float16)
    big = exact.isinf()
    assert big.any() and (~big).any()
    assert compare_grad(exact, dy, y, -1, False)[1] is None
    wrong = {
        "saturated": torch.where(big, torch.finfo(torch.float16).max * exact.sign(), exact),
        "flipped": torch.where(big, -exact, exact),
        "spurious inf": torch.where(big, exact, exact.sign() * torch.inf),
    }
    for name, dx in wrong.items():
        assert compare_grad(dx, dy, y, -1, False)[1] is not None, name


@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
def test_gradient_overflow(device, path, force):
    """Every path gives fp16 infinities where the gradient exceeds fp16's range (fp32 arithmetic, rounded
    once at the store), and the right finite values elsewhere."""
    dy, y = overflowing_grad_inputs(4097, 12, device)
    with heuristics.force(poison=True, path=path, **force):
        dx = fs.softmax_backward(dy, y, backend="triton")
    assert heuristics.last_plan().path == path
    assert dx.isinf().any()
    assert_grad(dx, dy, y, -1, False)


def _softmax_backward_data_samples(device, dtype):
    """The samples of PyTorch's OpInfo for _softmax_backward_data (common_methods_invocations.py's
    sample_inputs_softmax_backward_data): shapes (5,), (5, 5), (5, 10, 5) along dims 0, 0, -1; dy of
    ``dtype``, y = softmax of a random x in input_dtype, and for fp32 also input_dtype fp16 (OpInfo adds it on
    CUDA; the mix runs on every device here). x and dy require grad."""
    for shape, dim in (((5,), 0), ((5, 5), 0), ((5, 10, 5), -1)):
        for input_dtype in (dtype, torch.float16) if dtype == torch.float32 else (dtype,):
            x = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
            dy = torch.randn(shape, device=device).to(dtype).requires_grad_()
            yield dy, x, torch.softmax(x, dim, dtype=input_dtype), dim, input_dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_opinfo_samples_and_their_gradients(device, dtype):
    """Regression: on the H200, the OpInfo samples of _softmax_backward_data with dy float32 and y float16
    (input_dtype float16) made the gradient of fs.softmax_backward raise "expected scalar type Float but
    found Half". Each sample's output and its gradients (to dy and, through y, to x) match torch's own op's,
    computed in float64 from the same inputs."""
    torch.manual_seed(0)
    for dy, x, y, dim, input_dtype in _softmax_backward_data_samples(device, dtype):
        out = fs.softmax_backward(dy, y, dim, dtype=input_dtype)
        assert out.dtype == input_dtype and out.shape == y.shape
        g = torch.randn(out.shape, device=device, dtype=out.dtype)
        got = torch.autograd.grad(out, (dy, x), g, retain_graph=True)
        ref = torch._softmax_backward_data(dy.double(), y.double(), dim, torch.float64)
        want = torch.autograd.grad(ref, (dy, x), g.double())
        tol = {torch.float64: 1e-10, torch.float32: 1e-5}.get(input_dtype, 2e-2)
        for a, b, what in ((out, ref, "dx"), *zip(got, want, ("d dy", "d x"), strict=True)):
            assert a.dtype == b.dtype or what == "dx" or a.dtype == dtype, (what, a.dtype)
            err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
            assert err < tol, (what, tuple(y.shape), dim, dtype, input_dtype, err)
