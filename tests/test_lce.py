"""fs.linear_cross_entropy and fs.LinearCrossEntropy (linear + cross-entropy without the full logits) against
a float64 torch reference (tests/lce_reference.py): F.linear, softcap, F.cross_entropy (weight=,
label_smoothing, ignore_index) and the z-loss, values and the gradients of x, weight and bias, for every
reduction, backend and dtype; the two designs (lce_chunked, lce_recompute) forced and checked through the
recorded plan, with several chunks, one row a chunk and poisoned outputs; every option; the module; errors
before launch. Autograd and torch's transforms around the loss: tests/test_lce_autograd.py."""

import os

import pytest
import torch
from lce_reference import (
    DESIGNS,
    DTYPES,
    LOSS_ATOL,
    assert_near,
    assert_plan,
    check,
    class_weights,
    problem,
    rows_for,
    run,
    torch_lce,
    upstream,
)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import lm_head as rules


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("v", [7, 513, 1031])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_reference(device, backend, v, dtype):
    """(B, T, d) x with bias and ignored rows, every reduction: loss (x's dtype), dx, dW, db; the default
    design for the reduction (recompute for 'none', chunked otherwise), recorded after the forward."""
    x, w, t, b = problem(device, dtype, (2, 7), 24, v)
    for reduction in ("mean", "sum", "none"):
        design = "lce_recompute" if reduction == "none" else "lce_chunked"
        loss = fs.linear_cross_entropy(x, w.clone().requires_grad_(), t, b, reduction=reduction, backend=backend)
        assert_plan(backend, design, 14)
        assert loss.dtype == dtype and loss.shape == (() if reduction != "none" else t.shape)
        check(x, w, t, b, reduction=reduction, fs_opts={"backend": backend})


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_designs_with_several_chunks(device, backend, dtype):
    """Each design forced, memory for 5 rows a chunk (18 rows: 4 chunks, the last ragged), outputs poisoned:
    the plan (path, rows = memory // (V·element size), splits) after the forward and, for recompute, after the
    backward; values and grads against the reference and equal between the designs. No bias, int32 targets."""
    v, n = 513, 18
    x, w, t, _ = problem(device, dtype, (n,), 16, v, bias=False, seed=1)
    t = t.to(torch.int32)
    memory = 5 * v * x.element_size() + v  # 5 rows and a part of a sixth
    assert rows_for(memory, v, dtype) == 5
    results = {}
    for reduction in ("mean", "sum", "none"):
        for design in DESIGNS if reduction != "none" else ["lce_recompute"]:
            with heuristics.force(path=design, poison=True):
                xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                loss = fs.linear_cross_entropy(xg, wg, t, reduction=reduction, memory=memory, backend=backend)
                assert_plan(backend, design, n, rows=5)
                assert heuristics.last_plan().splits == 4
                torch.autograd.grad(loss, (xg, wg), upstream(loss))
                if design == "lce_recompute":
                    assert_plan(backend, design, n, rows=5)
                fs_opts = {"memory": memory, "backend": backend}
                results[reduction, design] = check(x, w, t, None, reduction=reduction, fs_opts=fs_opts)
        if reduction != "none" and dtype == torch.float32:
            (l1, _, g1), (l2, _, g2) = results[reduction, DESIGNS[0]], results[reduction, DESIGNS[1]]
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-5)
            for k in g1:
                torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-5, msg=f"d{k}: the designs differ")


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("design", DESIGNS)
def test_one_row_a_chunk(device, backend, design):
    """memory=1 (less than a row): one row a chunk, N chunks; still right, with bias and 3-D x."""
    x, w, t, b = problem(device, torch.float32, (2, 3), 8, 513, seed=2)
    for reduction in ("mean", "none") if design == "lce_recompute" else ("mean", "sum"):
        with heuristics.force(path=design, poison=True):
            loss = fs.linear_cross_entropy(x, w, t, b, reduction=reduction, memory=1, backend=backend)
            assert_plan(backend, design, 6, rows=1)
            assert heuristics.last_plan().splits == 6 and loss.dtype == torch.float32
            check(x, w, t, b, reduction=reduction, fs_opts={"memory": 1, "backend": backend})
            if design == "lce_recompute":  # the plan of the backward
                assert_plan(backend, design, 6, rows=1)


@pytest.mark.parametrize("design", DESIGNS)
def test_one_row_a_chunk_bf16(device, design):
    """memory=1 in bf16 with 32 rows: 32 chunks, each adding into dW and db; still within bf16's tolerance."""
    x, w, t, b = problem(device, torch.bfloat16, (32,), 32, 513, seed=15)
    reduction = "none" if design == "lce_recompute" else "sum"
    with heuristics.force(path=design):
        check(x, w, t, b, reduction=reduction, fs_opts={"memory": 1, "backend": "triton"})
        fs.linear_cross_entropy(x.requires_grad_(), w, t, b, reduction=reduction, memory=1, backend="triton")
    assert_plan("triton", design, 32, rows=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_odd_vocab(device, dtype):
    """V = 4099 (odd, longer than one block of the loss kernels), 3 chunks, each design, poisoned outputs."""
    v = 4099
    x, w, t, b = problem(device, dtype, (9,), 16, v, seed=18)
    memory = 3 * v * x.element_size()
    for design, reduction in (("lce_chunked", "mean"), ("lce_recompute", "none")):
        with heuristics.force(path=design, poison=True):
            check(x, w, t, b, reduction=reduction, fs_opts={"memory": memory, "backend": "triton"}, label_smoothing=0.1)
            fs.linear_cross_entropy(x, w, t, b, reduction=reduction, memory=memory, backend="triton")
        assert_plan("triton", design, 9, rows=3)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("design", DESIGNS)
def test_non_contiguous_inputs(device, backend, design):
    """x a slice along d of a wider tensor, weight the transpose of a (d, V) tensor (as a tied, transposed
    embedding), bias and targets strided: read at their strides, grads in the inputs' shapes."""
    x0, w0, t0, b0 = problem(device, torch.float32, (3, 4), 12, 513, seed=16)
    x = torch.cat([x0, torch.randn_like(x0)], -1)[..., :12]
    w = w0.t().contiguous().t()
    b = torch.stack([b0, torch.randn_like(b0)], -1)[:, 0]
    t = torch.stack([t0, torch.zeros_like(t0)], -1)[..., 0]
    assert not (x.is_contiguous() or w.is_contiguous() or b.is_contiguous() or t.is_contiguous())
    for reduction in ("mean", "none") if design == "lce_recompute" else ("mean", "sum"):
        with heuristics.force(path=design):
            memory = 5 * 513 * 4
            _, _, grads = check(x, w, t, b, reduction=reduction, fs_opts={"backend": backend, "memory": memory})
        assert grads["x"].shape == x.shape and grads["w"].shape == w.shape and grads["b"].shape == b.shape


@pytest.mark.parametrize("design", DESIGNS)
def test_gradient_accumulation(device, design):
    """A retained graph's second backward adds the same grads again; two micro-batches' backwards add theirs
    (the designs' in-place scaling must not alias a gradient the first backward left in .grad)."""
    x, w, t, b = problem(device, torch.float32, (12,), 16, 513, seed=17)
    halves = [(x[:6], t[:6]), (x[6:], t[6:])]
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    xg = x.clone().requires_grad_()
    with heuristics.force(path=design):
        loss = fs.linear_cross_entropy(xg, wg, t, bg, memory=4 * 513 * 4)
        g = torch.tensor(0.7, device=device)
        loss.backward(g, retain_graph=True)
        loss.backward(g)
        wm, bm = w.clone().requires_grad_(), b.clone().requires_grad_()
        for xh, th in halves:
            fs.linear_cross_entropy(xh, wm, th, bm, reduction="sum").backward()
    x64, w64, b64 = (v.double().requires_grad_() for v in (x, w, b))
    ref = torch_lce(x64, w64, t, b64, torch.float64)[0]
    for leaf, r in zip(
        (xg, wg, bg),
        torch.autograd.grad(ref, (x64, w64, b64), torch.tensor(1.4, dtype=torch.float64, device=device)),
        strict=True,
    ):
        torch.testing.assert_close(leaf.grad.double(), r, rtol=1e-5, atol=1e-6)
    w64.grad = b64.grad = None
    for xh, th in halves:
        torch_lce(xh.double(), w64, th, b64, torch.float64, reduction="sum")[0].backward()
    torch.testing.assert_close(wm.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bm.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_rows(device, backend):
    """x with no rows: 'sum' 0, 'none' empty, 'mean' NaN (as torch); grads zeros of the inputs' shapes."""
    _, w, _, b = problem(device, torch.float32, (2,), 8, 7)
    x, t = torch.empty(0, 8, device=device), torch.empty(0, dtype=torch.long, device=device)
    for reduction in ("mean", "sum", "none"):
        loss, _, grads = check(x, w, t, b, reduction=reduction, fs_opts={"backend": backend})
        assert loss.shape == ((0,) if reduction == "none" else ())
        assert grads["w"].shape == w.shape and (grads["w"] == 0).all() and (grads["b"] == 0).all()


def test_out_of_range_target():
    """A target outside [0, V) that is not ignore_index raises on CPU tensors before any chunk or tile runs
    (no plan recorded), naming linear_cross_entropy, on every design and budget."""
    x, w, t, b = problem("cpu", torch.float32, (4,), 8, 9)
    for backend in ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",):
        for bad in (9, -5):
            t[2] = bad
            for design, memory in [(d, None) for d in DESIGNS] + [(None, 64), ("lce_sliced", 64)]:
                force = {"path": design} if design else {}
                with heuristics.force(**force), heuristics.recording() as plans:
                    with pytest.raises(IndexError, match=rf"^linear_cross_entropy: target {bad} at row 2 "):
                        fs.linear_cross_entropy(x.requires_grad_(), w, t, b, backend=backend, memory=memory)
                assert plans == [], (design, memory, plans)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_default_design_and_chunks(device, backend, reduction, monkeypatch):
    """No force, memory=None: recompute for 'none', chunked for 'mean' / 'sum' (grads asked for and not);
    the chunk rows the default chose cover the rows in splits chunks; at a budget of 4 rows, row chunks too
    where a tile costs the host as much as lce_sliced's (else rules.layout takes lce_fused's few launches:
    test_lce_sliced.py)."""
    monkeypatch.setattr(rules, "HOST_FUSED_TILE_S", rules.HOST_TILE_S)
    x, w, t, b = problem(device, torch.float32, (3, 5), 12, 1031, seed=4)
    design = "lce_recompute" if reduction == "none" else "lce_chunked"
    check(x, w, t, b, reduction=reduction, fs_opts={"backend": backend})
    loss = fs.linear_cross_entropy(x.requires_grad_(), w, t, b, reduction=reduction, backend=backend)
    assert_plan(backend, design, 15)
    torch.autograd.grad(loss, x, upstream(loss))
    if reduction == "none":
        assert_plan(backend, design, 15)
    memory = 4 * 1031 * 4
    with heuristics.force(poison=True):
        check(x.detach(), w, t, b, reduction=reduction, fs_opts={"backend": backend, "memory": memory})
        fs.linear_cross_entropy(x, w, t, b, reduction=reduction, backend=backend, memory=memory)
    assert_plan(backend, design, 15, rows=4)  # (tiny: slices would not pay, rules.layout)


OPTIONS = {
    "smoothing": {"label_smoothing": 0.2},
    "class_weight": {"class_weight": "cw"},
    "smoothing+weight": {"label_smoothing": 0.1, "class_weight": "cw"},
    "softcap": {"softcap": 5.0},
    "z_loss": {"z_loss": 1e-2},
    "all": {"label_smoothing": 0.1, "class_weight": "cw", "softcap": 8.0, "z_loss": 1e-3, "ignore_index": 5},
}


def options(name, v, device):
    opts = dict(OPTIONS[name])
    if "class_weight" in opts:
        opts["class_weight"] = class_weights(v, device)
    return opts


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(device, backend, name):
    """Each option (and all at once, with ignore_index=5 as well as -100 rows: -100 is then a bad target, so
    those rows get class 5) with ignored rows, every reduction; return_z_loss=True: (loss, z term), the z
    term equal to its reference and without grad; return_z_loss=False the same loss; a no-grad call too."""
    v = 513
    x, w, t, b = problem(device, torch.float32, (2, 9), 16, v, seed=5)
    opts = options(name, v, device)
    if "ignore_index" in opts:
        t = torch.where(t == -100, opts["ignore_index"], t)
    for reduction in ("mean", "sum", "none"):
        fs_opts = {"backend": backend, "return_z_loss": True}
        loss, zt, _ = check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, **opts)
        if not opts.get("z_loss"):
            assert (zt == 0).all()
        plain = fs.linear_cross_entropy(x, w, t, b, reduction=reduction, backend=backend, **opts)
        assert isinstance(plain, torch.Tensor) and not plain.requires_grad
        torch.testing.assert_close(plain, loss, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("design", DESIGNS)
def test_options_low_precision_designs(device, dtype, design):
    """All options at once in 16-bit, each design forced with several chunks and poisoned outputs (Triton)."""
    v = 1031
    x, w, t, b = problem(device, dtype, (20,), 32, v, seed=6)
    opts = options("all", v, device)
    t = torch.where(t == -100, 5, t)
    memory = 6 * v * x.element_size()
    for reduction in ("mean", "none") if design == "lce_recompute" else ("mean", "sum"):
        with heuristics.force(path=design, poison=True):
            fs_opts = {"backend": "triton", "memory": memory, "return_z_loss": True}
            check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, **opts)
            fs.linear_cross_entropy(x.requires_grad_(), w, t, b, reduction=reduction, **fs_opts, **opts)
            assert_plan("triton", design, 20, rows=6)
            x.requires_grad_(False)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("design", DESIGNS)
def test_all_ignored(device, backend, design):
    """Every row ignored: 'mean' is NaN (as torch) with zero grads (as torch's float64), 'sum' 0, 'none' 0s."""
    x, w, t, b = problem(device, torch.float32, (6,), 8, 7, seed=7)
    t[:] = -100
    for reduction in ("mean", "sum") if design == "lce_chunked" else ("mean", "sum", "none"):
        for opts in ({}, {"label_smoothing": 0.1, "class_weight": class_weights(7, device), "z_loss": 1e-3}):
            with heuristics.force(path=design):
                loss, _, grads = check(x, w, t, b, reduction=reduction, fs_opts={"backend": backend}, **opts)
            assert loss.isnan().all() if reduction == "mean" else (loss == 0).all()
            assert all((g == 0).all() for g in grads.values())


def test_module(device):
    """fs.LinearCrossEntropy: nn.Linear-like parameters (shapes, init bound, bias flag, dtype), forward equals
    fs.linear_cross_entropy with its parameters and options, which reach the loss (ignore_index, smoothing,
    z-loss, reduction); backward fills .weight.grad and .bias.grad, right."""
    d, v = 24, 513
    opts = {"ignore_index": 3, "label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"}
    m = fs.LinearCrossEntropy(d, v, bias=True, device=device, dtype=torch.float32, **opts)
    assert isinstance(m, torch.nn.Module) and [n for n, _ in m.named_parameters()] == ["weight", "bias"]
    assert isinstance(m.weight, torch.nn.Parameter) and m.weight.shape == (v, d) and m.bias.shape == (v,)
    assert m.weight.device.type == torch.device(device).type and m.weight.dtype == torch.float32
    bound = 1 / d**0.5  # nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in)) for weight and bias
    for p in (m.weight, m.bias):
        assert p.abs().max() <= bound and p.std() > bound / 3
    no_bias = fs.LinearCrossEntropy(d, 7, device=device, dtype=torch.bfloat16)
    assert no_bias.bias is None and no_bias.weight.shape == (7, d) and no_bias.weight.dtype == torch.bfloat16
    assert fs.LinearCrossEntropy(d, 7).weight.dtype == torch.get_default_dtype()
    assert repr(no_bias) == "LinearCrossEntropy(in_features=24, out_features=7, bias=False)"

    x, _, t, _ = problem(device, torch.float32, (2, 6), d, v, seed=14)
    t = torch.where(t == -100, 3, t)
    loss = m(x, t)
    direct = fs.linear_cross_entropy(x, m.weight, t, m.bias, **opts)
    torch.testing.assert_close(loss, direct)
    loss.backward(upstream(loss))
    w, b = m.weight.detach(), m.bias.detach()
    ref = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float64, **opts)[0], x.double(), w.double(), b.double(), "wb")
    base = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float32, **opts)[0], x, w, b, "wb")
    assert_near(loss.detach(), ref[0], base[0], "loss", LOSS_ATOL)
    assert_near(m.weight.grad, ref[2]["w"], base[2]["w"], "weight.grad")
    assert_near(m.bias.grad, ref[2]["b"], base[2]["b"], "bias.grad")
    t7 = t.remainder(7)
    nb = no_bias.to(torch.float32)(x, t7)
    torch.testing.assert_close(nb, fs.linear_cross_entropy(x, no_bias.weight, t7))
    ref7 = torch_lce(x.double(), no_bias.weight.double(), t7, None, torch.float64)[0]
    torch.testing.assert_close(nb.double(), ref7, rtol=1e-5, atol=1e-5)
    per_row = fs.LinearCrossEntropy(d, v, bias=True, device=device, reduction="none")
    assert per_row(x, t).shape == t.shape


def test_errors_before_launch(device):
    """Bad shapes, dtypes and options raise before anything runs (the recorded plan is untouched)."""
    x, w, t, b = problem(device, torch.float32, (4,), 8, 9)
    x.requires_grad_()
    lce = fs.linear_cross_entropy
    bad = [
        (ValueError, lambda: lce(x, w[:, :7], t, b)),  # d mismatch
        (ValueError, lambda: lce(x, w[0], t, b)),  # weight 1-D
        (ValueError, lambda: lce(x, w[None], t, b)),  # weight 3-D
        (ValueError, lambda: lce(x, w, t, b[:8])),  # bias (V-1,)
        (ValueError, lambda: lce(x, w, t, b[None])),  # bias 2-D
        (ValueError, lambda: lce(x, w, t[:3], b)),  # target shape
        (ValueError, lambda: lce(x, w, t[None], b)),
        (TypeError, lambda: lce(x, w, t.float(), b)),  # target not integer
        ((TypeError, ValueError), lambda: lce(x, w.bfloat16(), t, b)),  # dtype mismatch x / weight
        ((TypeError, ValueError), lambda: lce(x, w, t, b.double())),  # dtype mismatch bias
        ((TypeError, ValueError), lambda: lce(x.bfloat16(), w.bfloat16(), t, b)),
        (TypeError, lambda: lce(x.long(), w.long(), t, b.long())),  # not floating
        ((TypeError, ValueError), lambda: lce(x, w, t, b, memory=0)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, memory=-1)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, memory=1.5)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, memory=True)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, memory="1024")),
        (ValueError, lambda: lce(x, w, t, b, reduction="avg")),
        (ValueError, lambda: lce(x, w, t, b, label_smoothing=1.5)),
        (ValueError, lambda: lce(x, w, t, b, ignore_index=2**63)),
        (ValueError, lambda: lce(x, w, t, b, backend="cuda")),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, class_weight=torch.ones(8, device=device))),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, class_weight=[1.0] * 9)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, class_weight=torch.ones(9, dtype=torch.long, device=device))),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, softcap=0.0)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, softcap=-1.0)),
        ((TypeError, ValueError), lambda: lce(x, w, t, b, softcap="1")),
        (ValueError, lambda: lce(x, w, t, b, z_loss=-1e-3)),
        (TypeError, lambda: lce(x, w, t, b, return_z_loss=1)),
    ]
    for i, (exc, call) in enumerate(bad):
        sentinel = heuristics.record(heuristics.Plan("none", f"sentinel {i}"))
        with pytest.raises(exc):
            call()
        assert heuristics.last_plan() is sentinel, f"case {i} ran something before raising"
    for bad_option in ({"reduction": "avg"}, {"z_loss": -1.0}, {"softcap": 0.0}, {"memory": 0}, {"skip_eps": 2.0},
                       {"backend": "cuda"}, {"return_z_loss": 1}, {"class_weight": torch.ones(8)},
                       {"label_smothing": 0.1}):  # fmt: skip
        with pytest.raises((TypeError, ValueError), match="LinearCrossEntropy"):  # (at construction)
            fs.LinearCrossEntropy(8, 9, device=device, **bad_option)
    dead = w.clone()
    dead.untyped_storage().resize_(0)  # (elements, no storage: torch's ops refuse it too)
    with pytest.raises(RuntimeError, match="no storage"):
        lce(x, dead, t, b)


def test_custom_ops_called_directly_check_their_arguments(device):
    """torch.ops.fastsoftmax.linear_cross_entropy and its backward called directly check their arguments as
    the public function does, and the design; the backward's real and fake outputs agree (regression tests:
    neither op checked anything, the backward's real db for want_b without a bias was (V,) where its fake
    said (0,), and a per-row loss under lce_chunked failed inside torch ops)."""
    ops = torch.ops.fastsoftmax
    x, w, t, _ = problem(device, torch.float32, (5,), 4, 7, bias=False)
    opts = (-100, "mean", 0.0, None, 0.0, 0, "auto")
    loss, _, stats, *_ = ops.linear_cross_entropy(x, w, t, None, None, *opts, "lce_recompute", 0.0, 1, 1, 1,
                                                  torch.float32)  # fmt: skip
    g = torch.ones((), device=device)
    args = (x, w, t, None, None, stats, g, *opts, False, True, True, True)
    torch.library.opcheck(ops.linear_cross_entropy_backward.default, args, test_utils=("test_faketensor",))
    dx, dw, db = ops.linear_cross_entropy_backward(*args)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == (0,)
    fwd = (x, w, t, None, None, -100)
    bad = [
        (ValueError, "unknown design", lambda: ops.linear_cross_entropy(*fwd, "mean", 0.0, None, 0.0, 0, "auto",
                                                                       "no_such", 0.0, 1, 1, 0, torch.float32)),
        (ValueError, "lce_chunked", lambda: ops.linear_cross_entropy(*fwd, "none", 0.0, None, 0.0, 0, "auto",
                                                                    "lce_chunked", 0.0, 1, 1, 0, torch.float32)),
        (ValueError, "reduction", lambda: ops.linear_cross_entropy(*fwd, "avg", 0.0, None, 0.0, 0, "auto",
                                                                  "lce_recompute", 0.0, 1, 1, 0, torch.float32)),
        (ValueError, "softcap", lambda: ops.linear_cross_entropy(*fwd, "mean", 0.0, -1.0, 0.0, 0, "auto",
                                                                "lce_recompute", 0.0, 1, 1, 0, torch.float32)),
        (ValueError, "memory", lambda: ops.linear_cross_entropy(*fwd, "mean", 0.0, None, 0.0, -5, "auto",
                                                               "lce_recompute", 0.0, 1, 1, 0, torch.float32)),
        (ValueError, "2-d", lambda: ops.linear_cross_entropy(x[None], w, t[None], None, None, -100, "mean", 0.0,
                                                            None, 0.0, 0, "auto", "lce_recompute", 0.0, 1, 1, 0,
                                                            torch.float32)),
        (ValueError, "stats", lambda: ops.linear_cross_entropy_backward(x, w, t, None, None, stats[:-1], g, *opts,
                                                                       False, True, True, True)),
        (ValueError, "backend", lambda: ops.linear_cross_entropy_backward(x, w, t, None, None, stats, g, -100,
                                                                         "mean", 0.0, None, 0.0, 0, "cuda",
                                                                         False, True, True, True)),
    ]  # fmt: skip
    for exc, match, call in bad:
        sentinel = heuristics.record(heuristics.Plan("none", match))
        with pytest.raises(exc, match=match):
            call()
        assert heuristics.last_plan() is sentinel, f"{match}: ran something before raising"
