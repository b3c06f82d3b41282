"""fastsoftmax under PyTorch's own machinery: torch.func (grad, vmap, jvp, jacrev, hessian) and forward-mode
AD against torch's results, with the route each call took (the kernels under vmap/jvp rules, torch ops for
masked softmax and cross_entropy); fake and meta tensors, make_fx and torch.jit.trace reaching the fake
implementations (never a launch on a tensor without storage); torch's autocast policy; opcheck of every
custom op over a matrix of layouts; a tensor whose storage was resized away."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from helpers import assert_close

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import random_logits

FNS = {False: fs.softmax, True: fs.log_softmax}
TORCH = {False: torch.softmax, True: torch.log_softmax}


def kernel_backend(device):
    """The backend whose kernels run on this device's tensors (the interpreter on the CPU)."""
    return "triton"


def logits(shape, device, dtype=torch.float32, seed=0):
    return random_logits(shape, dtype, torch.Generator().manual_seed(seed)).to(device)


# ---- torch.func ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0])
def test_func_transforms_softmax(device, log, dim):
    """grad, vmap (batch dim first and inside), jvp, jacrev, hessian and fwAD.make_dual give torch's results,
    and vmap and jvp run the kernels (vmap: one launch over the batch; jvp: the tangent by the backward kernel
    or torch ops)."""
    from torch import func

    backend = kernel_backend(device)
    f = lambda t: FNS[log](t, dim, backend=backend)  # noqa: E731
    ref = lambda t: TORCH[log](t, dim)  # noqa: E731
    x = logits((5, 7), device)
    w = torch.randn(5, 7, device=device)
    tol = dict(rtol=1e-4, atol=1e-5)

    torch.testing.assert_close(
        func.grad(lambda t: (f(t) * w).sum())(x), func.grad(lambda t: (ref(t) * w).sum())(x), **tol
    )
    for in_dims in (0, 1):
        xb = torch.stack([x, x * 2, x - 1], in_dims)
        heuristics.record(None)
        got = func.vmap(f, in_dims=in_dims)(xb)
        assert heuristics.last_plan().backend == backend  # the kernels ran, over the whole batch
        torch.testing.assert_close(got, func.vmap(ref, in_dims=in_dims)(xb), **tol)
    t = torch.randn_like(x)
    y, jt = func.jvp(f, (x,), (t,))
    y_ref, jt_ref = func.jvp(ref, (x,), (t,))
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(jt, jt_ref, **tol)
    small = x[:2, :3].contiguous() if dim == -1 else x[:3, :2].contiguous()
    torch.testing.assert_close(func.jacrev(f)(small), func.jacrev(ref)(small), **tol)
    ws = w[: small.shape[0], : small.shape[1]]
    hess = [func.hessian(lambda t, g=g: (g(t) * ws).sum())(small) for g in (f, ref)]
    torch.testing.assert_close(hess[0], hess[1], **tol)
    with fwAD.dual_level():
        out = f(fwAD.make_dual(x, t))
        primal, tangent = fwAD.unpack_dual(out)
    assert tangent is not None  # the tangent is carried, not dropped
    torch.testing.assert_close(primal, y_ref, **tol)
    torch.testing.assert_close(tangent, jt_ref, **tol)


def test_func_vmap_of_grad_and_zero_dim(device):
    """Nested transforms (vmap over grad), a batch of 0-d tensors (softmax of a scalar is 1), and jvp of one."""
    from torch import func

    backend = kernel_backend(device)
    x = logits((3, 4, 6), device)
    g = func.vmap(func.grad(lambda t: (fs.log_softmax(t, backend=backend) ** 2).sum()))(x)
    g_ref = func.vmap(func.grad(lambda t: (torch.log_softmax(t, -1) ** 2).sum()))(x)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    s = torch.tensor([1.0, float("-inf"), 3.0], device=device)
    assert func.vmap(lambda t: fs.softmax(t, 0, backend=backend))(s).tolist() == [1.0, 0.0, 1.0]
    for log in (False, True):  # (the jvp of a 0-d input: softmax and log_softmax of a scalar are constant)
        y, jt = func.jvp(lambda t, log=log: FNS[log](t, 0, backend=backend), (s[0],), (torch.ones_like(s[0]),))
        assert y.item() == (0.0 if log else 1.0) and jt.item() == 0.0


def test_func_transforms_masked(device):
    """Masked softmax under torch.func runs torch ops (the same conventions): grad for x and for a floating
    mask, vmap, jvp and hessian against torch's composite."""
    from torch import func

    x = logits((2, 3, 4, 6), device, torch.float64)
    mask = torch.randn(4, 6, device=device, dtype=torch.float64)
    keep = torch.rand(3, 1, 6, generator=torch.Generator().manual_seed(3)).to(device) > 0.3
    for log in (False, True):

        def f(t, m, log=log):
            return FNS[log](t, mask=m, scale=0.5, causal=True)

        def ref(t, m, log=log):
            z = t * 0.5 + m
            z = z.masked_fill(~torch.ones(4, 6, dtype=torch.bool, device=device).tril(2), float("-inf"))
            return TORCH[log](z, -1)

        w = torch.randn(2, 3, 4, 6, device=device, dtype=torch.float64)

        def loss(g, w=w):
            return lambda t, m: (torch.where(g(t, m).isinf(), 0, g(t, m)) * w).sum()

        heuristics.record(None)
        got = func.grad(loss(f), argnums=(0, 1))(x, mask)
        assert heuristics.last_plan() == heuristics.Plan("torch", "composite")
        want = func.grad(loss(ref), argnums=(0, 1))(x, mask)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(func.vmap(f, in_dims=(0, None))(x, mask), func.vmap(ref, in_dims=(0, None))(x, mask))
        tan = torch.randn_like(x)
        _, jt = func.jvp(lambda a: f(a, mask), (x,), (tan,))
        y_ref, jt_ref = func.jvp(lambda a: ref(a, mask), (x,), (tan,))
        kept = y_ref.isfinite() & (y_ref != 0 if not log else True)  # removed positions: tangent 0 here
        assert (jt[~kept] == 0).all()
        torch.testing.assert_close(jt[kept], jt_ref[kept])
        # a bool mask under vmap: positions removed give exactly 0 / -inf
        yb = func.vmap(lambda a, log=log: FNS[log](a, mask=keep))(x)
        assert (yb.masked_select(~keep.expand(x.shape)) == (float("-inf") if log else 0.0)).all()
    small = x[0, 0, :2, :3].contiguous()
    h = func.hessian(lambda t: (fs.softmax(t, mask=mask[:2, :3]) * w[0, 0, :2, :3]).sum())(small)
    h_ref = func.hessian(lambda t: (torch.softmax(t + mask[:2, :3], -1) * w[0, 0, :2, :3]).sum())(small)
    torch.testing.assert_close(h, h_ref)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_func_transforms_cross_entropy(device, reduction):
    """cross_entropy under torch.func (torch ops): grad, vmap over a batch of (logits, target), jvp, hessian,
    forward-mode AD; ignore_index rows and label smoothing."""
    from torch import func

    x = logits((6, 11), device, torch.float64)
    t = torch.tensor([1, -100, 10, 0, 5, 5], device=device)

    def f(a, tt=t):
        out = fs.cross_entropy(a, tt, reduction=reduction, label_smoothing=0.1)
        return out.sum() if reduction == "none" else out

    def ref(a, tt=t):
        out = F.cross_entropy(a, tt, reduction=reduction, label_smoothing=0.1)
        return out.sum() if reduction == "none" else out

    heuristics.record(None)
    torch.testing.assert_close(func.grad(f)(x), func.grad(ref)(x))
    assert heuristics.last_plan() == heuristics.Plan("torch", "composite")
    xb, tb = torch.stack([x, 2 * x]), torch.stack([t, t.flip(0)])
    torch.testing.assert_close(func.vmap(f)(xb, tb), func.vmap(ref)(xb, tb))
    v = torch.randn_like(x)
    torch.testing.assert_close(func.jvp(f, (x,), (v,))[1], func.jvp(ref, (x,), (v,))[1])
    torch.testing.assert_close(
        func.hessian(f)(x[:3, :4].contiguous(), t[:3] % 4), func.hessian(ref)(x[:3, :4].contiguous(), t[:3] % 4)
    )
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(f(fwAD.make_dual(x, v))).tangent
    torch.testing.assert_close(tangent, func.jvp(ref, (x,), (v,))[1])


# ---- double backward, learnable masks ----------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_double_backward(device, reduction):
    """gradgradcheck (float64, the torch path) and, on the kernel path, the Hessian-vector product against
    torch's: the full Hessian (diag(p) - p p^T per row), not its diagonal."""
    x = torch.randn(4, 7, dtype=torch.float64, device=device, requires_grad=True)
    t = torch.tensor([1, -100, 6, 0], device=device)
    for eps in (0.0, 0.2):
        f = lambda a, e=eps: fs.cross_entropy(a, t, reduction=reduction, label_smoothing=e)  # noqa: E731
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradgradcheck(f, (x,))
    x32 = logits((5, 513), device).requires_grad_()
    t32 = torch.tensor([3, 512, -100, 0, 77], device=device)
    v = torch.randn_like(x32)
    for backend in ("triton", "torch"):
        for eps in (0.0, 0.1):
            out = fs.cross_entropy(x32, t32, reduction=reduction, label_smoothing=eps, backend=backend)
            ref = F.cross_entropy(x32, t32, reduction=reduction, label_smoothing=eps)
            go = torch.linspace(0.5, 2.0, out.numel(), device=device).reshape(out.shape)
            (g,) = torch.autograd.grad(out, x32, go, create_graph=True)
            (g_ref,) = torch.autograd.grad(ref, x32, go, create_graph=True)
            (hv,) = torch.autograd.grad((g * v).sum(), x32)
            (hv_ref,) = torch.autograd.grad((g_ref * v).sum(), x32)
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(hv, hv_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_learnable_mask_gets_its_gradient(device, backend, log):
    """A floating mask that requires grad (a learnable bias: ALiBi, relative positions) gets dL/dmask, summed
    over the dims it is broadcast along, whether or not x requires grad; x's gradient as before (scale
    applied, 0 where the mask is -inf and above the causal diagonal)."""
    x0 = logits((2, 3, 5, 9), device)
    bias0 = torch.randn(3, 1, 9, device=device)
    bias0[1, 0, 2] = float("-inf")
    w = torch.randn(2, 3, 5, 9, device=device)
    for x_grad in (True, False):
        x = x0.clone().requires_grad_(x_grad)
        bias = torch.nn.Parameter(bias0.clone())
        y = FNS[log](x, mask=bias, scale=0.5, causal=True, backend=backend)
        loss = torch.where(y.isinf(), 0, y * w).sum()
        grads = torch.autograd.grad(loss, [x, bias] if x_grad else [bias])
        x64, b64 = x0.double().requires_grad_(), bias0.double().requires_grad_()
        z = (x64 * 0.5 + b64).masked_fill(~torch.ones(5, 9, dtype=torch.bool, device=device).tril(4), float("-inf"))
        y64 = TORCH[log](z, -1)
        refs = torch.autograd.grad(torch.where(y64.isinf(), 0, y64 * w.double()).sum(), [x64, b64])
        refs = [r.masked_fill(r.isnan(), 0) for r in refs]  # torch: NaN from -inf - -inf at removed positions
        if not x_grad:
            refs = refs[1:]
        for got, want in zip(grads, refs, strict=True):
            assert got.dtype == torch.float32 and got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_learnable_float64_mask_on_every_backend(device, backend, log):
    """A float64 learnable mask beside an fp32 x gets its float64 gradient on every backend. (Regression:
    the backward asked backend='triton' for a float64 dz, which it refuses, after the forward had run.) The
    Triton kernels computed the forward in fp32: fp32 tolerances there, float64's on the others."""
    x0 = logits((3, 37), device)
    bias0 = torch.randn(37, dtype=torch.float64, device=device)
    w = torch.randn(3, 37, device=device)
    x, bias = x0.clone().requires_grad_(), bias0.clone().requires_grad_()
    y = FNS[log](x, mask=bias, backend=backend)
    gx, gb = torch.autograd.grad((y * w).sum(), [x, bias])
    x64, b64 = x0.double().requires_grad_(), bias0.clone().requires_grad_()
    refs = torch.autograd.grad((TORCH[log](x64 + b64, -1) * w.double()).sum(), [x64, b64])
    assert gx.dtype == torch.float32 and gb.dtype == torch.float64
    tol = dict(rtol=1e-4, atol=1e-5) if backend == "triton" else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx.double(), refs[0], **tol)
    torch.testing.assert_close(gb, refs[1], **tol)


# ---- fake tensors, meta, make_fx, jit.trace ---------------------------------------------------------


def test_fake_tensors_reach_the_fake_implementations(device):
    """Under FakeTensorMode every public function returns fake tensors of the real op's metadata (nothing is
    launched on tensors without storage): softmax, log_softmax, masked, cross_entropy, the backward
    functions, and autograd through them."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    real = logits((4, 33), device)
    want = fs.softmax(real.t(), 0)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(real).requires_grad_()
        d = x.detach()
        outs = [
            fs.softmax(x),
            fs.log_softmax(x, 0, dtype=torch.float32),
            fs.softmax(x.t(), 0),
            fs.softmax(x, mask=torch.ones(33, device=device, dtype=torch.bool), causal=True),
            fs.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=device)),
            fs.softmax_backward(d, d),
            fs.log_softmax_backward(d, d),
        ]
        for y in outs:
            assert isinstance(y, FakeTensor)
        assert outs[2].stride() == want.stride()
        (g,) = torch.autograd.grad(outs[0].sum() + outs[4], x)
        assert isinstance(g, FakeTensor) and g.shape == x.shape


def test_meta_tensors():
    x = torch.empty(3, 17, device="meta", dtype=torch.bfloat16)
    for y in (
        fs.softmax(x),
        fs.log_softmax(x, 0, dtype=torch.float32),
        fs.softmax(x, scale=2.0),
        fs.cross_entropy(x, torch.zeros(3, dtype=torch.long, device="meta"), reduction="none"),
    ):
        assert y.is_meta
    assert fs.log_softmax(x, 0, dtype=torch.float32).dtype == torch.float32


def test_make_fx_and_jit_trace(device):
    """make_fx (fake and real tracing) records the custom ops; torch.jit.trace records them too and the
    traced function is right on new data."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(t, target):
        return fs.softmax(t, -1).sum() + fs.cross_entropy(t, target) + fs.softmax(t, mask=t > 0).sum()

    x = logits((4, 9), device)
    t = torch.tensor([1, 2, 3, 8], device=device)
    for mode in ("fake", "real"):
        g = make_fx(f, tracing_mode=mode)(x, t)
        targets = {str(n.target) for n in g.graph.nodes if n.op == "call_function"}
        assert {
            "fastsoftmax.softmax.default",
            "fastsoftmax.cross_entropy.default",
            "fastsoftmax.softmax_masked.default",
        } <= targets, targets
        torch.testing.assert_close(g(x, t), f(x, t))
    traced = torch.jit.trace(lambda a: fs.log_softmax(a, -1), (x,))
    assert "fastsoftmax::softmax" in str(traced.graph)
    x2 = logits((4, 9), device, seed=5)
    torch.testing.assert_close(traced(x2), torch.log_softmax(x2, -1))


# ---- autocast -------------------------------------------------------------------------------------------


def test_autocast_follows_torch(device):
    """Under torch.autocast the outputs have torch's dtypes (CUDA: softmax, log_softmax and cross_entropy in
    fp32; CPU: cross_entropy in fp32, softmax as given), written once by the kernel from the 16-bit input;
    an fp16 sum of 16384 losses is finite and matches torch's; gradients come back in x's dtype."""
    low = torch.float16 if device == "cuda" else torch.bfloat16
    x = logits((16384, 64), device, low)
    x[0, 3] = 60.0
    t = torch.randint(0, 64, (16384,), generator=torch.Generator().manual_seed(1)).to(device)
    backend = kernel_backend(device) if device == "cuda" else "auto"
    with torch.autocast(device, dtype=low):
        for log in (False, True):
            y, ref = FNS[log](x, backend=backend), TORCH[log](x, -1)
            assert y.dtype == ref.dtype, (log, y.dtype, ref.dtype)
            assert_close(y, x, -1, log, ref.dtype)
            assert FNS[log](x, dtype=low).dtype == TORCH[log](x, -1, dtype=low).dtype == low  # dtype= as given
        loss, ref = fs.cross_entropy(x, t, reduction="sum"), F.cross_entropy(x, t, reduction="sum")
        assert loss.dtype == ref.dtype == torch.float32 and loss.isfinite()
        torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-2)
        xg = x[:64].clone().requires_grad_()
        y = fs.softmax(xg, mask=torch.zeros(64, device=device, dtype=low), backend=backend)
        assert y.dtype == torch.softmax(xg, -1).dtype
        (g,) = torch.autograd.grad(y.float().pow(2).sum() + fs.cross_entropy(xg, t[:64]), xg)
        assert g.dtype == low
    y = fs.softmax(x, backend=backend)  # outside autocast: x's dtype again (and no stale replay)
    assert y.dtype == low


def test_autocast_on_cuda_writes_fp32_once():
    """The CUDA policy on any device: an fp16 input under a CUDA autocast region on a CUDA tensor gives an
    fp32 output from the kernel itself (checked without a GPU through the dtype rule)."""
    from fastsoftmax.core import compose

    x = torch.empty(2, 3, dtype=torch.float16, device="meta")
    assert compose.softmax_dtype(x, None) is torch.float16  # no autocast: x's dtype
    assert compose.softmax_dtype(x, torch.float64) is torch.float64


# ---- opcheck over layouts ---------------------------------------------------------------------------------


def layouts(device):
    """(name, tensor) over the layouts a caller hands over."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(2, 3, 4, 5, generator=g).to(device)
    return [
        ("contiguous", base),
        ("transposed", base.transpose(-1, -2)),
        ("permuted", base.permute(2, 0, 3, 1)),
        ("expanded", torch.randn(1, 3, 1, 5, generator=g).to(device).expand(2, 3, 4, 5)),
        ("channels-last", base.contiguous(memory_format=torch.channels_last)),
        ("sliced", torch.randn(2, 3, 4, 9, generator=g).to(device)[..., ::2]),
    ]


@pytest.mark.parametrize("name", ["contiguous", "transposed", "permuted", "expanded", "channels-last", "sliced"])
def test_opcheck_layouts(device, name):
    """torch.library.opcheck on every custom op: the fake implementation promises the real op's strides
    (forward, backward, masked with a bool mask broadcast over the batch and an expanded additive one)."""
    x = dict(layouts(device))[name]
    g = torch.Generator().manual_seed(8)
    masks = [
        (torch.rand(x.shape[1:], generator=g) > 0.3).to(device),
        torch.randn(x.shape[-1], generator=g).to(device).expand(x.shape),
    ]
    for dim in (-1, 1):
        for log in (False, True):
            xg = x.detach().clone().requires_grad_() if name == "contiguous" else x
            torch.library.opcheck(torch.ops.fastsoftmax.softmax.default, (xg, dim, log, None, "auto"))
            y = fs.softmax(x, dim, dtype=torch.float32)
            torch.library.opcheck(
                torch.ops.fastsoftmax.softmax_backward.default,
                (torch.randn_like(y), y, dim, log, torch.float32, "auto"),
            )
            for m in masks:
                causal = dim == -1
                args = (xg, dim, log, None, "auto", m, 0.5, causal)
                torch.library.opcheck(torch.ops.fastsoftmax.softmax_masked.default, args)
                ym = fs.softmax(x, dim, mask=m, scale=0.5, causal=causal).detach()
                args = (torch.randn_like(ym), ym, dim, log, x.dtype, "auto", m, 0.5, causal)
                torch.library.opcheck(torch.ops.fastsoftmax.softmax_backward_masked.default, args)


def test_opcheck_rows_out_of_logical_order_and_transposed_logits(device):
    """The two layouts that broke torch.compile: dense scores whose rows are not in logical order ((S, B, H,
    D) storage viewed as (B, H, S, D)) under a mask, and cross-entropy on transposed logits; opcheck and a
    compiled step (inductor on a GPU) agree with eager."""
    s, b, h, d = 6, 2, 3, 8
    scores = torch.randn(s, b, h, d, device=device).permute(1, 2, 0, 3)
    mask = torch.rand(b, 1, 1, d, generator=torch.Generator().manual_seed(2)).to(device) > 0.2
    for log in (False, True):
        torch.library.opcheck(
            torch.ops.fastsoftmax.softmax_masked.default, (scores, -1, log, None, "auto", mask, 0.3, False)
        )
    y = fs.softmax(scores, mask=mask)
    assert y.stride() == torch.empty_like(scores).stride()
    logits_t = torch.randn(11, 6, device=device).t()  # (6, 11), classes not contiguous
    target = torch.tensor([1, 2, 10, -100, 0, 4], device=device)
    for reduction in ("mean", "none"):
        lg = logits_t.detach().requires_grad_()
        torch.library.opcheck(
            torch.ops.fastsoftmax.cross_entropy.default,
            (lg, target, None, -100, reduction, 0.1, None, 0.0, "auto", torch.float32),
        )
        _, _, stats = torch.ops.fastsoftmax.cross_entropy(
            logits_t, target, None, -100, reduction, 0.1, None, 0.0, "auto", torch.float32
        )
        grad = torch.ones(6 if reduction == "none" else (), device=device)
        torch.library.opcheck(
            torch.ops.fastsoftmax.cross_entropy_backward.default,
            (logits_t, target, None, stats, grad, -100, reduction, 0.1, None, 0.0, "auto"),
        )

    def step(a, lt):
        return fs.softmax(a, mask=mask, scale=0.3).sum() + fs.cross_entropy(lt * 2, target)

    backend = "inductor" if device == "cuda" else "aot_eager"
    a, lt = scores.clone().requires_grad_(), logits_t.detach().requires_grad_()
    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True, backend=backend)(a, lt)
    ga, gl = torch.autograd.grad(out, (a, lt))
    ref = step(a, lt)
    ra, rl = torch.autograd.grad(ref, (a, lt))
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(ga, ra)
    torch.testing.assert_close(gl, rl)


# ---- storage ---------------------------------------------------------------------------------------------


def test_storage_resized_to_zero_raises(device):
    """As torch does, a clear error and no launch on a null pointer, on every backend and public function."""
    x = logits((4, 8), device)
    x.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError):
        torch.softmax(x, -1)
    for backend in ("auto", "triton", "torch"):
        calls = (
            lambda b: fs.softmax(x, backend=b),
            lambda b: fs.log_softmax(x, backend=b),
            lambda b: fs.softmax(x, scale=2.0, backend=b),
            lambda b: fs.softmax_backward(x, x, backend=b),
        )
        for call in calls:
            with pytest.raises(RuntimeError, match="storage"):
                call(backend)
        with pytest.raises(RuntimeError, match="storage"):
            fs.cross_entropy(x, torch.zeros(4, dtype=torch.long, device=device), backend=backend)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_public_backward_is_differentiable(device, log):
    """fs.softmax_backward / fs.log_softmax_backward on inputs that require grad run torch ops (plan
    'composite') whose gradients in y and dy are torch's, masked or not; plain calls run the kernels."""
    fb = {False: fs.softmax_backward, True: fs.log_softmax_backward}[log]
    x = logits((3, 7), device, torch.float64)
    y = FNS[log](x).requires_grad_()
    dy = torch.randn_like(y).requires_grad_()
    keep = torch.tensor([True] * 5 + [False] * 2, device=device)
    for mask in (None, keep):
        heuristics.record(None)
        dx = fb(dy, y, mask=mask, scale=None if mask is None else 0.5)
        assert heuristics.last_plan() == heuristics.Plan("torch", "composite") and dx.grad_fn is not None
        assert torch.autograd.gradcheck(lambda a, b, m=mask: fb(a, b, mask=m), (dy, y))
    fb(dy.detach().float(), y.detach().float(), backend=kernel_backend(device))
    assert heuristics.last_plan().backend == kernel_backend(device)


def test_learnable_mask_under_torch_compile():
    """The learnable mask's gradient through the compiled custom op (fullgraph), as in eager."""
    x = torch.randn(2, 3, 4, 6, requires_grad=True)
    bias = torch.nn.Parameter(torch.randn(3, 1, 6))
    w = torch.arange(6.0)

    def f(a, b):
        return (fs.softmax(a, mask=b, scale=0.5, causal=True) * w).sum()

    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(x, bias), (x, bias))
    want = torch.autograd.grad(f(x, bias), (x, bias))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[1].abs().sum() > 0
