"""Public API: argument errors before any launch, dispatch choices, shapes at the edges (0-d, empty,
N = 1), the nn.Modules, info(), and no work at import."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_close

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import softmax_triton


@pytest.mark.parametrize("fn", [fs.softmax, fs.log_softmax])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.uint8])
def test_non_float_dtypes_raise_type_error(device, fn, dtype):
    x = torch.zeros(3, 4, device=device).to(dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        fn(x)


def test_bad_arguments(device):
    x = torch.randn(3, 4, device=device)
    with pytest.raises(IndexError, match="range of \\[-2, 1\\], but got 2"):
        fs.softmax(x, 2)
    with pytest.raises(IndexError):
        fs.log_softmax(x, -3)
    with pytest.raises(IndexError):
        fs.softmax(torch.tensor(1.0, device=device), 1)
    with pytest.raises(TypeError, match="dim must be an int"):
        fs.softmax(x, 1.0)
    with pytest.raises(TypeError, match="dim must be an int"):
        fs.softmax(x, True)
    with pytest.raises(TypeError, match="dtype"):
        fs.softmax(x, dtype=torch.int32)
    with pytest.raises(TypeError, match="got 'float32'"):  # (a string named as one: it read "got float32")
        fs.softmax(x, dtype="float32")
    for fn, args in ((fs.softmax, (x,)), (fs.log_softmax, (x,)), (fs.softmax_backward, (x, x))):
        fn(*args)  # (recorded: a bad dtype= must not be replayed as dtype=None)
        for bad in ([torch.float32], {}, 0, False, "", ()):  # (the unhashable ones raised "unhashable type",
            with pytest.raises(TypeError, match="dtype must be None"):  # and the falsy ones replayed the call)
                fn(*args, dtype=bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        fs.softmax([1.0, 2.0])
    with pytest.raises(ValueError, match="'auto', 'triton', 'cuda', 'torch'"):
        fs.softmax(x, backend="cuda-magic")
    with pytest.raises(TypeError, match="mask must be a torch.Tensor or None, got list"):
        fs.softmax(x, mask=[[True] * 4] * 3)


@pytest.mark.parametrize(
    "overrides, error, message",
    [({"paht": "rowblock"}, TypeError, r"unknown overrides \['paht'\]"), ({"block_n": 96}, ValueError, "power of two"),
     ({"rows": 0}, ValueError, "power of two"), ({"num_warps": 4.0}, ValueError, "power of two"),
     ({"splits": 0}, ValueError, "positive int"), ({"min_ctas": True + 0.5}, ValueError, "positive int"),
     ({"path": "fastest"}, ValueError, "unknown path 'fastest'")],
)  # fmt: skip
def test_force_refuses_what_no_launch_takes(overrides, error, message):
    """heuristics.force, the tests' hook, refuses a misspelt override or an impossible launch shape at once
    (a test forcing nothing would pass whatever ran) and leaves no block open."""
    with pytest.raises(error, match=message), heuristics.force(**overrides):
        pass
    assert not heuristics.overridden()


def test_unknown_device_names_the_device(monkeypatch):
    """A device with no path (say xpu; emulated: the CPU taken off the list) raises naming it. Meta tensors
    are not that: they reach the custom ops' fake implementations (tests/test_compose.py)."""
    from fastsoftmax.core import checks
    from fastsoftmax.kernels import replay

    monkeypatch.setattr(checks, "DEVICES", ("cuda",))
    replay.clear()  # (a call on a cpu tensor of this key recorded before would replay, past the checks)
    with pytest.raises(RuntimeError, match="device 'cpu'"):
        fs.softmax(torch.randn(3, 4))
    assert fs.softmax(torch.randn(3, 4, device="meta")).is_meta


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_meta_beside_a_real_tensor_raises(device, backend):
    """A meta tensor beside a cpu (cuda) one is on another device: the checks raise. (Regression: the checks'
    fast path compared is_cuda and get_device(), alike for cpu and meta, so the call ran the op's fake and
    returned an unwritten tensor.)"""
    x = torch.randn(4, 5, device=device)
    t = torch.randint(0, 5, (4,), device=device)
    y = torch.softmax(x, -1)
    meta = torch.empty(4, 5, device="meta")
    with pytest.raises(ValueError, match="target is on meta"):
        fs.cross_entropy(x, t.to("meta"), backend=backend)
    with pytest.raises(ValueError, match=f"target is on {device}"):
        fs.cross_entropy(meta, t, backend=backend)
    for fn in (fs.softmax_backward, fs.log_softmax_backward):
        with pytest.raises(ValueError, match="dy is on meta"):
            fn(meta, y, backend=backend)
        with pytest.raises(ValueError, match=f"dy is on {device}"):
            fn(torch.randn_like(y), meta, backend=backend)


def test_errors_come_before_any_launch(device):
    with heuristics.force(path="rowblock"):
        heuristics.record(None)
        with pytest.raises(IndexError):
            fs.softmax(torch.randn(2, 3, device=device), 5, backend="triton")
        assert heuristics.last_plan() is None


LOSS_ERRORS = [  # (the loss functions' refusals of things that are not their arguments, no plan recorded)
    ("cross_entropy", ("list", "t"), TypeError, "logits and target must be torch.Tensors"),
    ("cross_entropy", ("x", "list"), TypeError, "logits and target must be torch.Tensors"),
    ("cross_entropy", ("scalar", "t0"), ValueError, "need a class dim"),
    ("cross_entropy", ("x_v0", "t"), ValueError, r"need a class dim .* got \(4, 0\)"),
    ("linear_cross_entropy", ("list", "w", "t"), TypeError, "x must be a torch.Tensor, got list"),
    ("linear_cross_entropy", ("h", "list", "t"), TypeError, "weight must be a torch.Tensor, got list"),
    ("linear_cross_entropy", ("h", "w", "list"), TypeError, "target must be a torch.Tensor, got list"),
    ("linear_cross_entropy", ("h", "w", "t", "list"), TypeError, "bias must be None or a torch.Tensor"),
    ("linear_cross_entropy", ("scalar", "w", "t"), ValueError, "x must have a feature dim"),
    ("linear_cross_entropy", ("h", "w_long", "t"), TypeError, "weight must be floating point, got torch.int64"),
    ("linear_cross_entropy", ("h", "w", "t", "b_long"), TypeError, "bias must be floating point"),
    ("linear_cross_entropy", ("h", "w_meta", "t"), ValueError, "weight is on meta but x on"),
    ("linear_cross_entropy", ("h", "w", "t", "b_meta"), ValueError, "bias is on meta but x on"),
]


@pytest.mark.parametrize(
    "fn, args, error, message", LOSS_ERRORS, ids=[f"{f}-{'-'.join(a)}" for f, a, *_ in LOSS_ERRORS]
)
def test_loss_argument_errors(device, fn, args, error, message):
    g = torch.Generator().manual_seed(0)
    values = {"list": [1.0], "scalar": torch.tensor(1.0), "t0": torch.tensor(0), "x": torch.randn(4, 8, generator=g),
              "x_v0": torch.randn(4, 0), "t": torch.randint(0, 8, (4,), generator=g), "h": torch.randn(4, 6),
              "w": torch.randn(8, 6), "w_long": torch.ones(8, 6, dtype=torch.long),
              "b_long": torch.ones(8, dtype=torch.long), "w_meta": torch.empty(8, 6, device="meta"),
              "b_meta": torch.empty(8, device="meta")}  # fmt: skip
    values = {k: v.to(device) if isinstance(v, torch.Tensor) and not v.is_meta else v for k, v in values.items()}
    heuristics.record(None)
    with pytest.raises(error, match=message):
        getattr(fs, fn)(*(values[a] for a in args))
    assert heuristics.last_plan() is None


def test_triton_refuses_float64_and_auto_takes_torch(device):
    x = torch.randn(3, 5, dtype=torch.float64, device=device)
    with pytest.raises(RuntimeError, match="float64 runs on backend='torch'"):
        fs.softmax(x, backend="triton")
    with pytest.raises(RuntimeError, match="float64"):
        fs.softmax(x.float(), dtype=torch.float64, backend="triton")
    y = fs.softmax(x)
    assert heuristics.last_plan().backend == "torch" and y.dtype == torch.float64
    assert_close(y.float(), x.float(), -1, False)


def test_auto_dispatch(device):
    x = torch.randn(4, 33, device=device)
    fs.softmax(x)
    expected = "triton" if device == "cuda" else "torch"
    assert heuristics.last_plan().backend == expected


def test_requires_grad_goes_through_the_eager_function(device):
    """Eager autograd takes the softmax op's eager Function (the custom op's code without its dispatch
    layers; torch.compile traces the custom op, tests/test_backward.py); on the CPU under auto, torch's own
    graph (tests/test_cpu_path.py)."""
    x = torch.randn(4, 10, device=device, requires_grad=True)
    w = torch.arange(10.0, device=device)
    for backend in ("auto", "triton", "torch") + (("cuda",) if device == "cuda" else ()):
        y = fs.softmax(x, backend=backend)
        graph = backend == "auto" and device == "cpu"
        assert y.grad_fn is not None and y.grad_fn.name() == (
            "SoftmaxBackward0" if graph else "SoftmaxFunctionBackward"
        )
        (g,) = torch.autograd.grad((y * w).sum(), x)
        ref = torch.autograd.grad((torch.softmax(x, -1) * w).sum(), x)[0]
        torch.testing.assert_close(g, ref)
    with torch.no_grad():  # no autograd needed: the direct path, no op
        assert fs.softmax(x).grad_fn is None


def test_backward_rejects_a_non_tensor_dy(device):
    """A list as dy is a TypeError naming dy (the replay's first look must not read .requires_grad on it);
    so is None, after forwards of y's shape were seen (replayed on CUDA, the CPU's direct path on the CPU):
    the forward's key and path must not take a backward whose dy is missing."""
    y = torch.softmax(torch.randn(2, 3, device=device), -1)
    for _ in range(2):
        fs.softmax(y), fs.log_softmax(y)
    with pytest.raises(TypeError, match="dy to be a torch.Tensor"):
        fs.softmax_backward([[1.0, 2.0, 3.0]] * 2, y)
    for backward in (fs.softmax_backward, fs.log_softmax_backward):
        with pytest.raises(TypeError, match="dy to be a torch.Tensor"):
            backward(None, y)


def test_forward_returns_the_logsumexp(device):
    """fastsoftmax.softmax.forward: the output and its fp32 logsumexp per row (x's shape without dim), checked
    like the public functions (the README's documented way to get the logsumexp)."""
    from fastsoftmax.core.reference import oracle, oracle_lse
    from fastsoftmax.ops.softmax import forward

    x = torch.randn(3, 7, 5, device=device) * 4
    for dim in (1, -1):
        y, lse = forward(x, dim, want_lse=True)
        assert lse.dtype == torch.float32 and lse.shape == x.shape[: dim % 3] + x.shape[dim % 3 + 1 :]
        torch.testing.assert_close(lse.double(), oracle_lse(x, dim), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y.double(), oracle(x, dim), rtol=1e-5, atol=1e-6)
    y, lse = forward(x, log=True, mask=torch.ones(5, dtype=torch.bool, device=device), want_lse=False)
    assert lse is None and y.shape == x.shape
    with pytest.raises(TypeError, match="bool .* or floating"):
        forward(x, mask=torch.ones(5, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="unknown backend"):
        forward(x, backend="nope")
    xg = x.clone().requires_grad_()
    for backend in ("auto", "torch"):  # no autograd on any backend (torch ops would otherwise record a graph)
        y, lse = forward(xg, want_lse=True, backend=backend)
        assert not y.requires_grad and not lse.requires_grad
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), pytest.raises(RuntimeError, match="use fs.softmax"):
        forward(torch.empty(3, 5), want_lse=True)
    with pytest.raises(RuntimeError, match="use fs.log_softmax"):
        torch.func.vmap(lambda r: forward(r, log=True)[0])(x)


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_forward_logsumexp_is_fp32_under_any_default_dtype(device, backend):
    """The logsumexp is fp32 whatever torch's default dtype, for empty inputs too (their rows' logsumexp is
    -inf, made without a launch): it was made in the default dtype there, float64 after
    torch.set_default_dtype(torch.float64)."""
    from fastsoftmax.ops.softmax import forward

    g, default = torch.Generator().manual_seed(5), torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for shape, dim in (((3, 0), 1), ((0, 4), 1), ((2, 0, 3), 1), ((4, 9), 1), ((4, 9), 0)):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(shape, generator=g, dtype=torch.float32) * 8).to(dtype).to(device)
                if x.numel():
                    x[1, 2] = 90.0  # (an outlier)
                y, lse = forward(x, dim, want_lse=True, backend=backend)
                assert lse.dtype == torch.float32 and y.dtype == dtype, (shape, dim, lse.dtype)
                assert lse.shape == x.shape[:dim] + x.shape[dim + 1 :]
                ref = torch.logsumexp(x.double(), dim)  # (-inf for an empty row)
                torch.testing.assert_close(lse.double(), ref, rtol=2e-5, atol=1e-5)
    finally:
        torch.set_default_dtype(default)


def test_eager_functions_skip_argument_binding():
    """The eager-autograd Functions are ctx-first: a Function with setup_context binds its arguments through
    inspect.signature on every apply (host time on every training step); the transform Function, which
    torch.func needs in the setup_context style, is used only under torch.func."""
    from fastsoftmax.ops import cross_entropy, softmax

    base = torch.autograd.Function.setup_context
    for op in (softmax.SOFTMAX, softmax.SOFTMAX_MASKED, cross_entropy.CROSS_ENTROPY):
        assert op.eager is not None and op.eager.setup_context is base
    assert softmax.SOFTMAX.transform.setup_context is not base and softmax.SOFTMAX.transform.vmap is not None


@pytest.mark.parametrize("backend", ["triton", "cuda", "torch"])
def test_zero_dim(device, backend):
    if backend == "cuda" and device == "cpu":
        pytest.skip("the CUDA backend runs CUDA tensors only (tests/test_cuda_build.py checks its CPU error)")
    for v, sm, lsm in [(3.0, 1.0, 0.0), (float("-inf"), 0.0, float("-inf"))]:
        x = torch.tensor(v, device=device)
        y = fs.softmax(x, 0, backend=backend)
        assert y.shape == () and y.item() == sm
        assert fs.log_softmax(x, -1, backend=backend).item() == lsm
    for v in (float("nan"), float("inf")):
        assert fs.softmax(torch.tensor(v, device=device), backend=backend).isnan()


@pytest.mark.parametrize("backend", ["triton", "cuda", "torch"])
@pytest.mark.parametrize("shape,dim", [((0,), 0), ((3, 0), -1), ((0, 5), -1), ((2, 0, 4), 1), ((2, 0, 4), 2)])
def test_empty(device, backend, shape, dim):
    if backend == "cuda" and device == "cpu":
        pytest.skip("the CUDA backend runs CUDA tensors only (tests/test_cuda_build.py checks its CPU error)")
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    y = fs.softmax(x, dim, backend=backend, dtype=torch.float32)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert heuristics.last_plan().path == "empty"


@pytest.mark.parametrize("backend", ["triton", "cuda", "torch"])
def test_n_equals_one(device, backend):
    if backend == "cuda" and device == "cpu":
        pytest.skip("the CUDA backend runs CUDA tensors only (tests/test_cuda_build.py checks its CPU error)")
    x = torch.tensor([[2.0], [float("-inf")], [float("nan")], [float("inf")], [-1e30]], device=device)
    y = fs.softmax(x, backend=backend)
    assert y[:, 0].tolist()[:2] == [1.0, 0.0] and y[2:4].isnan().all() and y[4].item() == 1.0
    assert_close(fs.log_softmax(x, backend=backend), x, -1, True)


def test_modules(device):
    x = torch.randn(2, 3, 7, device=device)
    m, lm = fs.Softmax(dim=1), fs.LogSoftmax(-1, backend="torch")
    assert "dim=1" in repr(m)
    assert repr(fs.LogSoftmax(0, dtype=torch.float32, scale=0.5)) == (
        "LogSoftmax(dim=0, scale=0.5, dtype=torch.float32, backend='auto')"
    )  # (every option the module holds)
    for kw, shown in ((dict(scale="2"), "scale='2'"), (dict(causal=1), "causal=1"), (dict(causal=None), "causal=None"),
                      (dict(dtype="float32"), "dtype='float32'")):  # fmt: skip
        assert shown in repr(fs.Softmax(**kw)), kw  # (as given: the first call refuses each)
    torch.testing.assert_close(m(x), torch.softmax(x, 1))
    torch.testing.assert_close(lm(x), torch.log_softmax(x, -1))
    assert isinstance(m, torch.nn.Module)
    assert fs.Softmax()(x).shape == x.shape


def test_info_reports_versions_backends_and_math():
    info = fs.info()
    assert info["torch"] == torch.__version__ and info["fastsoftmax"] == fs.__version__
    assert set(info["backends"]) == {"triton", "cuda", "torch"}
    fam = info["kernels"]["triton.softmax_fwd"]
    assert "ex2.approx" in fam["exp"] and "div.rn" in fam["division"] and "build_flags" in fam
    assert info["backends"]["torch"]["cpu"] is True
    from fastsoftmax.kernels.triton import lm_head as lm_kernels

    head = info["kernels"]["lm_head"]  # (it left out lce_fused and its three kernels)
    assert {"lce_chunked", "lce_recompute", "lce_sliced", "lce_fused"} <= set(head["designs"])
    assert all(getattr(lm_kernels, k).fn.__name__ == k for k in head["kernels"])  # (Triton kernels by those names)
    assert {"lse_gemm", "lse_merge", "dlogits_gemm"} <= set(head["kernels"])


def test_import_does_no_work():
    # In a fresh interpreter: importing fastsoftmax neither imports the kernels nor touches CUDA, and its
    # transformers integration imports transformers only when used.
    code = (
        "import sys, torch, fastsoftmax, fastsoftmax.integrations.transformers; "
        "assert 'fastsoftmax.kernels.triton.softmax_fwd' not in sys.modules; "
        "assert 'transformers' not in sys.modules; "
        "assert not torch.cuda.is_initialized()"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize(
    "shape,dim,path,flags",
    [
        ((3, softmax_triton.ROWBLOCK_MAX_N), -1, "rowblock", {"rows": 1}),
        ((264, softmax_triton.ROWBLOCK_MAX_N + 1), -1, "online", {"rows": 1}),  # 2 rows per SM of an H200
        ((2, 32 * softmax_triton.ONLINE_BLOCK + 1), -1, "split", {"rows": 1, "splits": 65}),  # few, long: split
        ((8, softmax_triton.ROWBLOCK_MAX_N + 1), -1, "split", {"rows": 1, "splits": 9}),
        ((64, 256), -1, "rowblock", {"rows": 8}),  # short rows packed several per program
        # N = 513: rows off 16-byte boundaries; the tile holds the 512-element aligned body, edges the rest
        ((64, 513), -1, "rowblock", {"rows": 4, "block_n": 512, "vec": 8, "edges": True}),
        ((64, 1024), -1, "rowblock", {"rows": 2, "block_n": 1024, "vec": 8, "edges": False}),
        ((64, 40), 0, "rowblock", {"rows": 64}),  # strided dim, adjacent rows
        ((5000, 3), 0, "online", {"rows": 4}),  # rows capped at the rows there are
    ],
)
def test_heuristics_table_branches(device, shape, dim, path, flags):
    """Unforced, the table picks each path where it should, and the kernel then runs correctly (the
    17M-element online case only on a GPU: the interpreter would take a minute)."""
    gen = torch.Generator().manual_seed(14)
    if device == "cpu" and shape[0] * shape[1] > 1 << 22:
        n = shape[dim]
        got = softmax_triton.launch_shape(n, shape[0], 2, False, 132)
        assert (got.path, got.rows) == (path, flags["rows"])
        return
    x = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
    x[:, 1] = 30.0  # an outlier in every row's head (an edge element where the row is not aligned)
    x = x.to(device)
    with heuristics.force(poison=True):
        y = fs.softmax(x, dim, backend="triton")
    plan = heuristics.last_plan()
    assert plan.path == path, plan
    for k, v in flags.items():
        assert getattr(plan, k) == v, (k, plan)
    assert_close(y, x, dim, False)


@pytest.mark.parametrize("backend", ["triton", "cuda", "torch", "auto"])
def test_negated_views_are_their_values(device, backend):
    """A lazily negated view (torch._neg_view, as autograd's formulas make them) holds -memory: every backend,
    the replay of a call seen before without the negation included, reads its value, not its memory.
    Softmax, its backward (y and dy negated in turn) and cross-entropy, forward and backward."""
    if backend == "cuda" and device != "cuda":
        pytest.skip("the CUDA backend runs CUDA tensors only")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 33, generator=g) * 3).to(device)
    dy = torch.randn(6, 33, generator=g).to(device)
    y = torch.softmax(x, -1)
    neg = torch._neg_view
    for _ in range(2):  # (the second round: every call seen before, as itself and un-negated)
        for fn in (fs.softmax, fs.log_softmax):
            fn(-x, backend=backend)
            torch.testing.assert_close(fn(neg(x), backend=backend), fn(-x, backend="torch"))
        fs.softmax_backward(dy, y, backend=backend)
        got = fs.softmax_backward(neg(dy), y, backend=backend)
        torch.testing.assert_close(got, fs.softmax_backward(-dy, y, backend="torch"))
        ny = torch._neg_view(-y)  # (its value is y)
        torch.testing.assert_close(fs.softmax_backward(dy, ny, backend=backend), fs.softmax_backward(dy, y))
        if backend != "cuda":
            t = torch.randint(0, 33, (6,), generator=g).to(device)
            want = torch.nn.functional.cross_entropy(-x.double(), t).float()
            fs.cross_entropy(-x, t, backend=backend)
            torch.testing.assert_close(fs.cross_entropy(neg(x), t, backend=backend), want)
            xg = neg(x).requires_grad_()
            (dx,) = torch.autograd.grad(fs.cross_entropy(xg, t, backend=backend), xg)
            torch.testing.assert_close(dx, torch.softmax(-x, -1).sub(torch.nn.functional.one_hot(t, 33)).div(6))


def test_negated_views_are_never_replayed_from_memory():
    """A replay runs what the first call recorded on the tensors it is given, so a negated view's call is
    never recorded: its full path reads the values. Found by a review: on CPU tensors the torch path's
    second call read the memory, fp16 log_softmax past a chunk (its fp32 copy drops the negation: off by up
    to 9.3), and a backward's fully masked row of y (read through its memory) gave dy instead of 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(130, 2049, generator=g).half()  # (more than native.CHUNK elements: the chunked fp32 copy)
    x[3] = float("-inf")  # (its value, +inf, makes the row NaN)
    want = torch.log_softmax(-x.double(), -1)
    for _ in range(3):
        got = fs.log_softmax(torch._neg_view(x))
        torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=4e-3, equal_nan=True)
    x = torch.randn(4, 37, generator=g)
    x[2] = float("-inf")
    dy = torch.randn(4, 37, generator=g)
    y = fs.log_softmax(x)  # (its row 2 -inf: fully masked)
    want = fs.log_softmax_backward(dy, y)
    assert (want[2] == 0).all() and not want[[0, 1, 3]].eq(0).all()
    for _ in range(3):
        assert torch.equal(fs.log_softmax_backward(dy, torch._neg_view(-y)), want)


def test_negated_views_in_the_lm_head_loss(device):
    """linear_cross_entropy with a lazily negated upstream gradient and class weights (their memory is -their
    value): the gradients of the values, on the Triton kernels (the interpreter on the CPU)."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(10, 16, generator=g).to(device).requires_grad_()
    w = torch.randn(40, 16, generator=g).to(device).requires_grad_()
    t = torch.randint(0, 40, (10,), generator=g).to(device)
    cw = torch.rand(40, generator=g).to(device) + 0.5
    up = torch.randn(10, generator=g).to(device)
    loss = fs.linear_cross_entropy(x, w, t, class_weight=torch._neg_view(-cw), reduction="none", backend="triton")
    dx, dw = torch.autograd.grad(loss, (x, w), torch._neg_view(-up))
    ref = torch.nn.functional.cross_entropy((x @ w.t()).double(), t, weight=cw.double(), reduction="none")
    rx, rw = torch.autograd.grad(ref, (x, w), up.double())
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, rx.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw, rw.float(), rtol=1e-4, atol=1e-5)


def test_force_blocks_of_two_threads_end_out_of_order():
    """force() is process-wide; a block that ends while another thread's later block is still open removes
    its own overrides only (a regression test: the blocks were a stack closed with pop(), so the open block
    then ran under the closed one's overrides and poison flag)."""
    import threading

    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with heuristics.force(path="online", block_n=256):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def second():
        a_in.wait(10)
        with heuristics.force(path="rowblock", poison=True):
            b_in.set()
            a_out.wait(10)
            seen["inside"] = (heuristics.forced(), heuristics.poisoning())
        seen["after"] = (heuristics.forced(), heuristics.overridden())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert seen == {"inside": ({"path": "rowblock"}, True), "after": (None, 0)}, seen
