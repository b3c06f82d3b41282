"""fs.linear_cross_entropy under autograd and torch's transforms, against the float64 reference
(tests/lce_reference.py): requires_grad subsets and no-grad calls, gradcheck in float64, double backward,
torch.func.grad, torch.compile (the options as symbolic floats too), graphs captured by torch.export and
jit.trace, autocast (the loss in float32), fake tensors."""

import pytest
import torch
import torch.nn.functional as F
from lce_reference import (
    DESIGNS,
    LOSS_ATOL,
    TOL,
    assert_near,
    assert_plan,
    check,
    class_weights,
    lowp,
    problem,
    run,
    torch_lce,
    upstream,
)

import fastsoftmax as fs
from fastsoftmax import heuristics


@pytest.mark.parametrize("design", [None, *DESIGNS, "lce_sliced"])
def test_requires_grad_subsets(device, design):
    """Only x, only weight, only bias, none of them, and everything under torch.no_grad(): grads exactly for
    what asks for them (the others' .grad stays None), each right; the loss right in every case."""
    x, w, t, b = problem(device, torch.float32, (10,), 16, 513, seed=8)
    forced = {} if design is None else {"path": design}
    with heuristics.force(**forced):
        for wrt in (("x",), ("w",), ("b",), ("w", "b"), ()):
            check(x, w, t, b, wrt=wrt)
            leaves = [v.clone().requires_grad_(k in wrt) for k, v in (("x", x), ("w", w), ("b", b))]
            loss = fs.linear_cross_entropy(leaves[0], leaves[1], t, leaves[2])
            assert loss.requires_grad == bool(wrt)
            if wrt:
                loss.backward()
            for (k, _), leaf in zip((("x", x), ("w", w), ("b", b)), leaves, strict=True):
                assert (leaf.grad is not None) == (k in wrt), k
        xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()
        with torch.no_grad():
            loss = fs.linear_cross_entropy(xg, wg, t, bg)
        assert not loss.requires_grad and loss.grad_fn is None
    ref = torch_lce(x.double(), w.double(), t, b.double(), torch.float64)[0]
    base = torch_lce(x, w, t, b, torch.float32)[0]
    assert_near(loss, ref, base, "no_grad loss", LOSS_ATOL)


@pytest.mark.parametrize(
    "design,reduction",
    [("lce_chunked", "mean"), ("lce_chunked", "sum"), ("lce_recompute", "mean"), ("lce_recompute", "none")],
)
def test_gradcheck_float64(device, design, reduction):
    """gradcheck in float64 on the torch path, several chunks, every option, x, weight and bias."""
    g = torch.Generator().manual_seed(9)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64).to(device) for s in ((2, 3, 4), (5, 4), (5,)))
    t = torch.tensor([[0, -100, 4], [2, 2, 1]], device=device)
    opts = {"label_smoothing": 0.1, "class_weight": class_weights(5, device), "softcap": 3.0, "z_loss": 0.01}
    memory = 2 * 5 * 8  # 2 rows a chunk

    def f(a, c, e):
        return fs.linear_cross_entropy(a, c, t, e, reduction=reduction, memory=memory, backend="torch", **opts)

    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    with heuristics.force(path=design):
        assert torch.autograd.gradcheck(f, leaves)
        f(*leaves)
        assert_plan("torch", design, 6, rows=2)
    check(x, w, t, b, reduction=reduction, fs_opts={"memory": memory, "backend": "torch"}, **opts)


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float64), ("triton", torch.float32)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward(device, backend, dtype, reduction):
    """create_graph=True, then the gradient of <grads, r> for random r: against the float64 reference."""
    x, w, t, b = problem(device, dtype, (2, 4), 8, 7, seed=10)
    opts = {"label_smoothing": 0.1, "softcap": 6.0, "z_loss": 1e-2, "reduction": reduction}

    def second(fn, x, w, b):
        leaves = [v.detach().clone().requires_grad_() for v in (x, w, b)]
        loss = fn(*leaves)
        g1 = torch.autograd.grad(loss, leaves, upstream(loss), create_graph=True)
        r = [torch.linspace(-1, 1, v.numel(), dtype=v.dtype, device=v.device).reshape(v.shape) for v in g1]
        s = sum((gi * ri).sum() for gi, ri in zip(g1, r, strict=True))
        return [v.detach() for v in g1], torch.autograd.grad(s, leaves)

    got = second(lambda a, c, e: fs.linear_cross_entropy(a, c, t, e, backend=backend, **opts), x, w, b)
    ref = second(lambda a, c, e: torch_lce(a, c, t, e, torch.float64, **opts)[0], x.double(), w.double(), b.double())
    base = second(lambda a, c, e: torch_lce(a, c, t, e, lowp(dtype), **opts)[0], x, w, b)
    for order in range(2):
        for k, gv, rv, bv in zip("xwb", got[order], ref[order], base[order], strict=True):
            assert_near(gv, rv, bv, f"order {order + 1} d{k}")


def test_torch_func_grad(device):
    """torch.func.grad w.r.t. x, weight and bias equals autograd's and the reference."""
    x, w, t, b = problem(device, torch.float32, (8,), 12, 513, seed=11)
    opts = {"label_smoothing": 0.1, "z_loss": 1e-3}
    check(x, w, t, b, **opts)  # autograd against the reference
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    ag = torch.autograd.grad(fs.linear_cross_entropy(*leaves[:2], t, leaves[2], **opts), leaves)
    fg = torch.func.grad(lambda a, c, e: fs.linear_cross_entropy(a, c, t, e, **opts), argnums=(0, 1, 2))(x, w, b)
    for k, gv, av in zip("xwb", fg, ag, strict=True):
        torch.testing.assert_close(gv, av, rtol=1e-5, atol=1e-6, msg=f"d{k}")


def test_torch_func_names_a_bad_target_as_eager_does():
    """A target the host can read (CPU tensors: on a GPU a bad target is a device-side assertion, which would
    end the test process's CUDA context) gets the same message under torch.func.grad as outside it
    (semantics.md), for a 3-D x too. (Regression: the composite saw the target flattened inside the
    transform, wrapped, and gave the gather's message without the row.)"""
    x, w = torch.randn(2, 3, 4), torch.randn(7, 4)
    bad = torch.tensor([[0, 1, 7], [2, 3, -100]])
    msg = "target 7 at row 2 is outside"
    with pytest.raises(IndexError, match=msg):
        fs.linear_cross_entropy(x, w, bad)
    with pytest.raises(IndexError, match=msg):
        torch.func.grad(lambda a: fs.linear_cross_entropy(a, w, bad))(x)
    loss = torch.func.grad(lambda a: fs.linear_cross_entropy(a, w, bad.clamp_max(6)))(x)  # (a good one runs)
    assert loss.shape == x.shape


def test_torch_compile_fullgraph(device):
    """torch.compile(fullgraph=True) around the loss: values and grads against the reference."""
    x, w, t, b = problem(device, torch.float32, (2, 5), 16, 513, seed=12)
    opts = {"label_smoothing": 0.1, "softcap": 10.0}

    def f(a, c, e):
        return fs.linear_cross_entropy(a, c, t, e, **opts)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss, _, grads = run(compiled, x, w, b, "xwb")
    ref = run(
        lambda a, c, e: torch_lce(a, c, t, e, torch.float64, **opts)[0], x.double(), w.double(), b.double(), "xwb"
    )
    base = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float32, **opts)[0], x, w, b, "xwb")
    assert_near(loss, ref[0], base[0], "loss", LOSS_ATOL)
    for k in "xwb":
        assert_near(grads[k], ref[2][k], base[2][k], f"d{k}")


def test_captured_graphs_hold_no_grad_flags(device):
    """A graph captured by torch.export or torch.jit.trace serves calls whose requires_grad and grad mode differ
    from the example's (a regression test: the op took the example's flags as constants, so an export made with
    an x not requiring grad failed in backward once x did, "invalid gradient ... got [0]", a trace made with grad
    on computed dx and dW in every no_grad forward, and jit.trace's own check, which traces again under no_grad,
    found two graphs). Gradients against the reference; the captured op asks for no gradients."""
    x, w, t, _ = problem(device, torch.float32, (6,), 8, 11, bias=False, seed=14)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(w.clone())

        def forward(self, a, tgt):
            return fs.linear_cross_entropy(a, self.weight, tgt)

    head = Head()

    def unit(compute, a, c):  # (loss, dx, dW) for an upstream gradient of 1, as loss.backward() gives
        a, c = a.clone().requires_grad_(), c.clone().requires_grad_()
        loss = torch_lce(a, c, t, None, compute)[0]
        return loss.detach(), *torch.autograd.grad(loss, (a, c))

    ref, base = unit(torch.float64, x.double(), w.double()), unit(torch.float32, x, w)
    exported = torch.export.export(head, (x, t))  # (x without grad, the weight with it: the usual example)
    ops = [n for n in exported.graph.nodes if "linear_cross_entropy" in str(n.target)]
    assert len(ops) == 1 and not any(a is True for a in ops[0].args), ops[0].args
    with torch.no_grad():
        traced = torch.jit.trace(head, (x, t))  # (check_trace on: the check traces again)
    for captured in (exported.module(), traced):
        a = x.clone().requires_grad_()
        captured.weight.grad = None
        loss = captured(a, t)
        loss.backward()
        got = (loss.detach(), a.grad, captured.weight.grad)
        for what, g, r, bs in zip(("loss", "dx", "dW"), got, ref, base, strict=True):
            assert_near(g, r, bs, what, LOSS_ATOL if what == "loss" else 1.0)


def test_compile_fullgraph_with_symbolic_float_options():
    """torch.compile(fullgraph=True) with the loss options as symbolic floats: dynamic=True, and a z_loss or
    softcap that changes between calls (automatic dynamic makes it a SymFloat on the recompile). A regression
    test: the options' finiteness check called math.isfinite, which Dynamo cannot trace, and every such call
    failed. Values and gradients as eager's."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 16, generator=g), torch.randn(37, 16, generator=g)
    t = torch.randint(0, 37, (6,), generator=g)
    calls = {
        "linear_cross_entropy": lambda a, c, v: fs.linear_cross_entropy(a, c, t, z_loss=v),
        "cross_entropy": lambda a, c, v: fs.cross_entropy(a @ c.t(), t, softcap=30.0 + v, z_loss=v),
    }
    for name, fn in calls.items():
        for dynamic in (True, None):
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")
            for v in (1e-3, 2e-3, 0.0):
                a, c = x.clone().requires_grad_(), w.clone().requires_grad_()
                got = compiled(a, c, v)
                got_grads = torch.autograd.grad(got, (a, c))
                a, c = x.clone().requires_grad_(), w.clone().requires_grad_()
                want = fn(a, c, v)
                want_grads = torch.autograd.grad(want, (a, c))
                torch.testing.assert_close(got, want, msg=f"{name} dynamic={dynamic} v={v}")
                for gg, ww in zip(got_grads, want_grads, strict=True):
                    torch.testing.assert_close(gg, ww, msg=f"{name} dynamic={dynamic} v={v}: grads")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("inputs", ["16-bit", "float32", "mixed"])
@pytest.mark.parametrize("sliced", [False, True], ids=["default", "lce_sliced"])
def test_autocast_loss_is_float32(device, dtype, inputs, sliced):
    """Under autocast the loss is float32 (as F.cross_entropy's), the logits in the autocast dtype (as
    F.linear's: float32 inputs are cast); loss and grads (in the inputs' dtypes) against the float64
    reference of the cast inputs, within twice torch's own error under the same autocast. "mixed": 16-bit
    activations with float32 parameters, as under autocast training (a regression test: the dtype check
    ran before the cast and refused them). Also with lce_sliced forced (the cast inputs in groups over slices)."""
    x, w, t, b = problem(device, dtype if inputs == "16-bit" else torch.float32, (6,), 8, 513, seed=13)
    if inputs == "mixed":
        x = x.to(dtype)
    dev = torch.device(device).type

    def under_autocast(fn):
        def f(a, c, e):
            with torch.autocast(device_type=dev, dtype=dtype):
                return fn(a, c, e)

        return f

    def lce(a, c, e):  # (lce_sliced: the Triton loss, in groups over slices)
        if not sliced:
            return fs.linear_cross_entropy(a, c, t, e)
        with heuristics.force(path="lce_sliced"):
            loss = fs.linear_cross_entropy(a, c, t, e, backend="triton", memory=1000)
        assert heuristics.last_plan().path == "lce_sliced" and heuristics.last_plan().splits > 1
        return loss

    got = run(under_autocast(lce), x, w, b, "xwb")
    base = run(under_autocast(lambda a, c, e: F.cross_entropy(F.linear(a, c, e), t)), x, w, b, "xwb")
    assert got[0].dtype == base[0].dtype == torch.float32
    cast = [v.to(dtype).double() for v in (x, w, b)]
    ref = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float64), *cast, "xwb")
    rtol, atol = TOL[dtype]
    for what, g, r, bs, scale in [("loss", got[0], ref[0], base[0], LOSS_ATOL)] + [
        (f"d{k}", got[2][k], ref[2][k], base[2][k], 1) for k in "xwb"
    ]:
        assert g.dtype == bs.dtype, what
        err, base_err = (g.double() - r).abs(), (bs.double() - r).abs().max()
        assert (err <= atol * scale + rtol * r.abs() + 2 * base_err).all(), f"{what}: error {err.max():.3g}"


def test_fake_tensors():
    """Under FakeTensorMode (no data: the custom op's fake implementation) both designs give the loss's
    shape and dtype and gradients shaped like x and W, the options included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(6, 8, requires_grad=True)
        w = torch.randn(11, 8, requires_grad=True)
        t = torch.randint(0, 11, (6,))
        for reduction, shape in (("mean", ()), ("none", (6,))):
            loss, z = fs.linear_cross_entropy(
                x, w, t, reduction=reduction, class_weight=torch.rand(11), softcap=5.0, z_loss=1e-3, return_z_loss=True
            )
            assert loss.shape == z.shape == shape and loss.dtype == torch.float32
            dx, dw = torch.autograd.grad(loss.sum(), (x, w))
            assert dx.shape == x.shape and dw.shape == w.shape
