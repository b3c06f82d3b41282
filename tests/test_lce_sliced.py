"""fs.linear_cross_entropy's lce_sliced layout (ops/lm_head.py: row groups x vocabulary slices, for small
memory budgets) against the float64 torch reference (tests/lce_reference.py): every option, reduction and
dtype with ragged groups and slices and poisoned outputs, the plan recorded; the rule that picks it
(heuristics/lm_head.layout) and its budget (slice_plan); one group, one slice; autograd around it."""

import math

import pytest
import torch
from lce_reference import assert_near, b_double, check, class_weights, lowp, problem, run, torch_lce, upstream

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import lm_head as rules
from fastsoftmax.heuristics.lm_head import ROW_ALIGN

OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"label_smoothing": 0.2, "class_weight": "cw"},
    {"softcap": 3.0, "z_loss": 1e-2},
    {"class_weight": "cw", "ignore_index": 5},
    {"label_smoothing": 0.1, "class_weight": "cw", "softcap": 8.0, "z_loss": 1e-3},
]


def _opts(i, v, device):
    opts = dict(OPTIONS[i])
    if "class_weight" in opts:
        opts["class_weight"] = class_weights(v, device)
    return opts


def _plan(n, d, v, dtype, memory, path="lce_sliced", grads=True, plan=None):
    """The plan lce_sliced (or lce_fused: its forward fused) recorded (``plan``, else this thread's last): the
    budget's rules.slice_plan, the tiles of one sweep (none where lce_fused's forward computes no gradients);
    returns (rows, cols)."""
    rows, cols = rules.slice_plan(n, d, v, torch.empty((), dtype=dtype).element_size(), memory)
    plan = plan or heuristics.last_plan()
    assert (plan.backend, plan.path, plan.rows, plan.block_n) == ("triton", path, rows, cols), plan
    assert plan.fused == (path == "lce_fused"), plan
    tiles = math.ceil(n / rows) * math.ceil(v / cols) if grads or path == "lce_sliced" else 0
    assert plan.splits == tiles, plan  # the tiles one sweep took
    return rows, cols


LAYOUTS = ["lce_sliced", "lce_fused"]  # (lce_fused: lce_sliced with the forward in one fused GEMM launch)


MEMORY = 2304  # 18 x 16 x 513: groups of 4 rows (fp32; 7 in 16-bit), slices of 128 classes, both ragged


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opt", range(len(OPTIONS)))
def test_sliced_matches_reference(device, dtype, reduction, opt, layout):
    """18 rows in groups (the last shorter), 513 classes in slices of 128 (the last of 1): loss, dx, dW and
    db against float64, outputs poisoned (stats, the logits buffer, the dx sums, dW); the plan after the
    forward and (for 'none') after the backward. lce_fused: every option in the GEMMs' epilogues, the
    forward's splits merged, the backward's logits made as the forward's."""
    v = 513
    x, w, t, b = problem(device, dtype, (18,), 16, v, seed=21 + opt)
    opts = _opts(opt, v, device)
    if "ignore_index" in opts:
        t = torch.where(t == -100, opts["ignore_index"], t)
    # fp32: dW is the sum of 5 groups' GEMMs, each sum rounded once: partial sums reach ~100 (x's outliers,
    # 20x), so their rounding (fp32's ulp at 100: 7.6e-6) exceeds the 1e-6 atol
    scale = 10.0 if dtype == torch.float32 else 1.0
    fs_opts = {"backend": "triton", "memory": MEMORY}
    with heuristics.force(path=layout, poison=True):
        check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, grad_atol_scale=scale, **opts)
        xg = x.clone().requires_grad_()
        loss = fs.linear_cross_entropy(xg, w, t, b, reduction=reduction, **fs_opts, **opts)
        rows, cols = _plan(18, 16, v, dtype, MEMORY, layout, grads=reduction != "none")
        assert 18 % rows and v % cols == 1 and rows < 18
        with heuristics.recording() as plans:  # (on CUDA the backward records on autograd's thread)
            torch.autograd.grad(loss, xg, upstream(loss))
        assert (reduction == "none") == bool(plans), plans  # (a scalar loss's backward scales: no plan)
        _plan(18, 16, v, dtype, MEMORY, layout, plan=plans[-1] if plans else None)


def test_one_group_and_one_slice(device):
    """Budgets that hold every row (dW written once, no add), every class too (one slice: first and last at
    once); 3-D x, bias, int32 targets."""
    x, w, t, b = problem(device, torch.float32, (2, 9), 16, 513, seed=30)
    t = t.to(torch.int32)
    for memory, groups, slices in ((18 * (4096 * 4 + 64), 1, 1), (18 * (128 * 4 + 64), 1, 5)):
        for reduction in ("mean", "none"):
            with heuristics.force(path="lce_sliced", poison=True):
                fs_opts = {"backend": "triton", "memory": memory}
                check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, label_smoothing=0.1)
                fs.linear_cross_entropy(x, w, t, b, reduction=reduction, **fs_opts)
            rows, cols = _plan(18, 16, 513, torch.float32, memory)
            assert (math.ceil(18 / rows), math.ceil(513 / cols)) == (groups, slices)


def test_all_ignored_sliced(device):
    """Every row ignored: 'mean' NaN with zero grads, 'sum' 0 (as torch)."""
    x, w, t, b = problem(device, torch.float32, (6,), 8, 300, seed=31)
    t[:] = -100
    for reduction in ("mean", "sum", "none"):
        with heuristics.force(path="lce_sliced"):
            fs_opts = {"backend": "triton", "memory": 1000}
            loss, _, grads = check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, z_loss=1e-3)
        assert loss.isnan().all() if reduction == "mean" else (loss == 0).all()
        assert all((g == 0).all() for g in grads.values())


@pytest.mark.parametrize(
    "shape,sliced",
    [
        ((8192, 4096, 128256, 2, 51876431), True),  # h200_lce.json's shapes at CCE's peak
        ((16384, 2304, 256000, 2, 60722833), True),
        ((8192, 4096, 151936, 2, 65000000), True),
        ((4096, 8192, 128256, 2, 99174105), False),  # dW passes few: the fourth GEMM costs more
        ((8192, 2048, 32000, 2, 7777379), False),  # tiles too small for the host to keep up
        ((8192, 4096, 128256, 2, 2048 * 128256 * 2), False),  # 2048 rows a chunk: MIN_ROWS's
        ((8192, 4096, 128256, 2, None), False),  # no budget: the default chunks
        ((8192, 4096, 128256, 4, 51876431), False),  # fp32's GEMMs are slower: the fourth costs more
    ],
)
def test_the_rule(shape, sliced):
    """rules.sliced against its time model's answers on the bench shapes; a forced design wins."""
    n, d, v, elsize, memory = shape
    assert rules.sliced(n, d, v, elsize, memory, None) is sliced
    assert rules.sliced(n, d, v, elsize, memory, "lce_chunked") is False
    assert rules.sliced(n, d, v, elsize, memory, "lce_sliced") is True
    assert rules.sliced(n, d, v, elsize, memory, "lce_fused") is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_backward_logits_are_the_forwards(device, dtype):
    """lce_fused's backward makes each tile's logits again (dlogits_gemm) and takes the forward's logsumexp
    (lse_gemm): the two must be the same logits bit for bit, or at logits near 40 one 16-bit ulp (0.25) moves
    every probability by e^0.25. With g = 1 and no options each kept row's dlogits sum to sum(p) - 1 = 0 (to
    their own rounding); the same check fails with the logsumexp moved by a quarter (the check can fail)."""
    from fastsoftmax.core import options
    from fastsoftmax.kernels.lm_head_steps import TritonSteps

    n, d, v = 40, 64, 300
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(n, d, generator=g) * 10).to(device, dtype)  # (logits up to about 40)
    w = (torch.randn(v, d, generator=g) * d**-0.5).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    k = TritonSteps(x, t, None, options.Loss(-100, "sum", 0.0, None, 0.0), v)
    stats, rows = torch.empty(n + 3, device=device), torch.empty(n, device=device)
    k.start(stats, rows, rows, n, v)
    k.fused(x, w, None, stats, rows, rows, n)
    assert stats[:n].max() > 30  # (the logits the property is about)
    for shift, ok in ((0.0, True), (0.25, False)):
        st = stats.clone()
        st[:n] += shift
        dl = torch.full((n, v), float("nan"), dtype=dtype, device=device)
        k.fused_grads(x, w, None, dl, 0, v, k.group(0, n, st, None, None, None, torch.ones((), device=device), n))
        sums = dl.double().sum(1)  # sum(p) - 1 per row
        assert bool(sums.abs().max() < 0.02) == ok, (shift, sums.abs().max())


@pytest.mark.parametrize("elsize", [2, 4])
@pytest.mark.parametrize(
    "n,v,cols,sms",
    [(8192, 128256, 0, 132), (8192, 128256, 4096, 132), (18, 513, 0, 4), (18, 513, 128, 4), (18, 513, 513, 4),
     (1, 300, 0, 132), (100000, 32000, 4096, 132), (16, 50257, 384, 132)],
)  # fmt: skip
def test_fused_shape(n, v, cols, sms, elsize):
    """lce_fused's launch shape: the tile of its element size; its splits cover the classes exactly (the last
    one non-empty); a split holds whole blocks and, with the skip's slices, whole slices (or every class,
    where a slice is all of them); splits as narrow as whole units allow, up to FUSED_WAVES programs an SM."""
    shape = rules.fused_shape(n, v, elsize, cols, sms)
    assert (shape.bm, shape.bn, shape.bk) == rules.FUSED_TILE[elsize]
    assert shape.per % shape.bn == 0 and (shape.splits - 1) * shape.per < v <= shape.splits * shape.per
    if cols:
        assert shape.per % cols == 0 or shape.splits == 1
    unit = -(-max(cols, shape.bn) // shape.bn) * shape.bn  # (whole blocks, whole slices)
    want = -(-rules.FUSED_WAVES * sms // -(-n // shape.bm))  # splits for FUSED_WAVES programs an SM
    assert shape.per == unit or (shape.per - unit) * want < v  # the narrowest whole-unit split within want


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_rule_picks_slices_unforced(device, backend, monkeypatch):
    """No force, the rule's constants set so that passes over dW dominate (no host cost): a budget of a few
    rows runs lce_sliced on the Triton loss, row chunks on the torch loss (it has no sliced layout) and for
    a budget of every row."""
    monkeypatch.setattr(rules, "HOST_CHUNK_S", 0.0)
    monkeypatch.setattr(rules, "HOST_TILE_S", 0.0)
    monkeypatch.setattr(rules, "DW_BYTES_S", 1.0)
    v, n = 513, 40
    x, w, t, b = problem(device, torch.float32, (n,), 16, v, seed=32)
    row = v * x.element_size()
    for memory, sliced in ((5 * row, backend == "triton"), (n * row, False)):
        for reduction in ("mean", "none"):
            fs_opts = {"backend": backend, "memory": memory}
            check(x, w, t, b, reduction=reduction, fs_opts=fs_opts)
            xg = x.clone().requires_grad_()
            with heuristics.recording() as plans:  # (the backward's plan on autograd's thread on CUDA)
                loss = fs.linear_cross_entropy(xg, w, t, b, reduction=reduction, **fs_opts)
                torch.autograd.grad(loss, xg, upstream(loss))
            want = "lce_sliced" if sliced else "lce_recompute" if reduction == "none" else "lce_chunked"
            assert plans and plans[-1].path == want, (memory, reduction, plans)


@pytest.mark.parametrize(
    "n,d,v,memory,want,no_fused,skip",
    [  # (bench --lce's shapes at its budgets from CCE's peak on the H200, h200_lce.json)
        (8192, 4096, 128256, 51876431, rules.SLICED, rules.SLICED, rules.SLICED),
        (16384, 2304, 256000, 60722833, rules.SLICED, rules.SLICED, rules.SLICED),
        (4096, 8192, 128256, 99174105, rules.ROWS, rules.ROWS, rules.SLICED),
        (8192, 4096, 151936, 61998535, rules.SLICED, rules.SLICED, rules.SLICED),
        # (152 host-bound tiles: lce_fused, 13.2 ms on the H100 against 20.5 for row chunks and lce_sliced;
        # a skip's 200 smaller tiles cost the host more than row chunks' whole time)
        (8192, 2048, 32000, 7777379, rules.FUSED, rules.ROWS, rules.ROWS),
        (8192, 2048, 32000, None, rules.ROWS, rules.ROWS, rules.ROWS),  # (no budget: every row's logits fit)
    ],
)
def test_layout_by_the_time_model(n, d, v, memory, want, no_fused, skip):
    """rules.layout's unforced choice at bench --lce's shapes and budgets (bf16): lce_fused only where the
    sliced tiles are host-bound, and only where asked (``fusable``: the one-GPU loss; the tensor-parallel
    head's rules.sliced never); fp32 not at these shapes (its fused GEMM runs on FMA units); a forced path
    decides."""
    assert rules.layout(n, d, v, 2, memory, None, fusable=True) == want
    assert rules.layout(n, d, v, 2, memory, None) == no_fused
    assert rules.sliced(n, d, v, 2, memory, None) == (no_fused != rules.ROWS)
    assert rules.layout(n, d, v, 2, memory, None, skip=True, fusable=True) == skip
    assert rules.layout(n, d, v, 4, memory, None, fusable=True) != rules.FUSED
    for forced, path in (("lce_chunked", rules.ROWS), ("lce_recompute", rules.ROWS), ("lce_sliced", rules.SLICED),
                         ("lce_fused", rules.FUSED)):  # fmt: skip
        assert rules.layout(n, d, v, 2, memory, forced, fusable=True) == path


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_rule_picks_fused_unforced(device, reduction, monkeypatch):
    """No force, the rule's constants set so that the sliced tiles are host-bound and lce_fused's are not: a
    budget of a few rows runs lce_fused (the forward's sweep and, for per-row losses, the backward's), exact
    against float64; the tensor-parallel rule (rules.sliced, no lce_fused) keeps row chunks."""
    monkeypatch.setattr(rules, "HOST_CHUNK_S", 1.0)
    monkeypatch.setattr(rules, "HOST_TILE_S", 1.0)
    monkeypatch.setattr(rules, "HOST_FUSED_TILE_S", 0.0)
    v, n = 513, 40
    x, w, t, b = problem(device, torch.bfloat16, (n,), 16, v, seed=33)
    memory = 5 * v * x.element_size()
    assert rules.layout(n, 16, v, 2, memory, None, fusable=True) == rules.FUSED
    assert not rules.sliced(n, 16, v, 2, memory, None)
    fs_opts = {"backend": "triton", "memory": memory}
    check(x, w, t, b, reduction=reduction, fs_opts=fs_opts)
    xg = x.clone().requires_grad_()
    with heuristics.recording() as plans:
        loss = fs.linear_cross_entropy(xg, w, t, b, reduction=reduction, **fs_opts)
        torch.autograd.grad(loss, xg, upstream(loss))
    lce = [p.path for p in plans if p.path.startswith("lce")]  # (and the loss kernels' own plans)
    assert lce == ["lce_fused"] * (2 if reduction == "none" else 1), plans


def _grads_vs_reference(x, w, t, b, reduction, grads):
    """dx and dW (``grads``) against the float64 reference, with torch's own low-precision error as slack."""
    ref = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float64, reduction=reduction), x.double(), w.double(),
              b_double(b), ("x", "w"))[2]  # fmt: skip
    base = run(lambda a, c, e: torch_lce(a, c, t, e, lowp(x.dtype), reduction=reduction), x, w, b, ("x", "w"))[2]
    for name, got in zip(("x", "w"), grads, strict=True):
        assert_near(got, ref[name], base[name], f"d{name}")


@pytest.mark.parametrize(
    "forward_force,backward_force,paths",
    [  # (where the forward made its logits with lce_fused's kernels, the backward does too, and never otherwise)
        (None, None, ["lce_fused", "lce_fused"]),
        ("lce_sliced", None, ["lce_sliced", "lce_recompute"]),
        (None, "lce_recompute", ["lce_fused", "lce_fused"]),
        ("lce_recompute", "lce_fused", ["lce_recompute", "lce_sliced"]),
    ],
)
def test_the_backward_makes_its_logits_as_the_forward_did(device, forward_force, backward_force, paths, monkeypatch):
    """reduction='none' (lce_recompute: the backward makes the logits again) with a force around the forward
    or the backward alone, the rule's constants set so that lce_fused wins unforced: the backward runs
    lce_fused exactly where the forward did (its probabilities must match the forward's logsumexp: mixing
    lce_fused's logits with cuBLAS's erred 4x past the bound), against float64. Before the fix a forward
    forced to lce_sliced had its backward take lce_fused by the rule (dx 0.405 against a bound of 0.0989)."""
    monkeypatch.setattr(rules, "HOST_CHUNK_S", 1.0)
    monkeypatch.setattr(rules, "HOST_TILE_S", 1.0)
    monkeypatch.setattr(rules, "HOST_FUSED_TILE_S", 0.0)
    n, d, v = 40, 64, 513
    x, w, t, b = problem(device, torch.bfloat16, (n,), d, v, seed=33)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    memory = 5 * v * x.element_size()
    with heuristics.recording() as plans:
        with heuristics.force(**({"path": forward_force} if forward_force else {})):
            loss = fs.linear_cross_entropy(xg, wg, t, b, reduction="none", backend="triton", memory=memory)
        with heuristics.force(**({"path": backward_force} if backward_force else {})):
            grads = torch.autograd.grad(loss, (xg, wg), upstream(loss))
    assert [p.path for p in plans if p.path.startswith("lce")] == paths, plans
    _grads_vs_reference(x, w, t, b, "none", grads)


def test_a_retained_graph_recomputes_as_the_forward_made_its_logits(device, monkeypatch):
    """A scalar loss's second backward through a retained graph makes the logits again (lce_recompute's
    backward): where the forward (lce_chunked, 3 GEMMs) ran row chunks but the rule would take lce_fused for
    a recompute (4 GEMMs), it runs cuBLAS's logits as the forward did, not lce_fused's (before the fix:
    dx 0.0119 against a bound of 0.0041); both backwards against float64."""
    monkeypatch.setattr(rules, "GEMM_FLOPS", {2: 1e3, 4: 1e3})  # (GPU-bound: 3 GEMMs < lce_fused's 3.2 < 4)
    monkeypatch.setattr(rules, "DW_BYTES_S", 1e30)
    monkeypatch.setattr(rules, "FUSED_GEMM_COST", 0.6)
    for name in ("HOST_CHUNK_S", "HOST_TILE_S", "HOST_FUSED_TILE_S"):
        monkeypatch.setattr(rules, name, 0.0)
    n, d, v = 40, 64, 513
    memory = 5 * v * 2
    assert rules.layout(n, d, v, 2, memory, None, fusable=True) == rules.ROWS
    assert rules.layout(n, d, v, 2, memory, None, recompute=True, fusable=True) == rules.FUSED
    x, w, t, b = problem(device, torch.bfloat16, (n,), d, v, seed=33)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with heuristics.recording() as plans:
        loss = fs.linear_cross_entropy(xg, wg, t, b, backend="triton", memory=memory)
        first = torch.autograd.grad(loss, (xg, wg), upstream(loss), retain_graph=True)
        second = torch.autograd.grad(loss, (xg, wg), upstream(loss))
    assert [p.path for p in plans if p.path.startswith("lce")] == ["lce_chunked", "lce_recompute"], plans
    for grads in (first, second):
        _grads_vs_reference(x, w, t, b, "mean", grads)


@pytest.mark.parametrize(
    "n,d,v,elsize,memory",
    [
        (8192, 4096, 128256, 2, 51876431),
        (16384, 2304, 256000, 2, 60722833),
        (4096, 8192, 128256, 2, 99174105),
        (8192, 2048, 32000, 2, 7777379),
        (3000, 512, 50257, 2, 700 * 50257 * 2),
        (18, 16, 513, 4, 2304),
        (18, 16, 513, 2, 2304),
        (7, 3, 100, 4, 1),
    ],
)
def test_slice_plan_fits_the_budget(n, d, v, elsize, memory):
    """rows x (classes of logits + d fp32 sums) within memory wherever one row and 128 classes fit; rows a
    multiple of ROW_ALIGN when a group is at least that, the groups evened out."""
    rows, cols = rules.slice_plan(n, d, v, elsize, memory)
    assert 1 <= rows <= n and 1 <= cols <= v
    if memory >= 128 * elsize + 4 * d:
        assert rows * (cols * elsize + 4 * d) <= memory, (rows, cols)
    if ROW_ALIGN <= rows < n:
        assert rows % ROW_ALIGN == 0
    groups = math.ceil(n / rows)
    assert rows * groups - n < rows  # (no empty group)


def test_gradient_accumulation_sliced(device):
    """A retained graph's second backward adds the same grads again (the forward's grads are scaled in place
    once, then recomputed)."""
    x, w, t, b = problem(device, torch.float32, (12,), 16, 513, seed=33)
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    with heuristics.force(path="lce_sliced"):
        loss = fs.linear_cross_entropy(x, wg, t, bg, backend="triton", memory=MEMORY)
        loss.backward(torch.tensor(0.5), retain_graph=True)
        first = wg.grad.clone(), bg.grad.clone()
        loss.backward(torch.tensor(0.5))
    torch.testing.assert_close(wg.grad, 2 * first[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bg.grad, 2 * first[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("path", ["lce_chunked", "lce_sliced", "lce_fused"])
def test_bias_of_any_strides_and_negated_views(device, path, reduction):
    """A bias sliced with a stride of 2 or expanded from a scalar, and x, W and the bias as lazily negated
    views (torch._neg_view: their memory holds -value), on every layout: loss, dx, dW and db against float64.
    (Regression: lce_fused's kernels read the bias as contiguous and the memory of negated views, so a
    strided bias gave a loss of 3.168 against 3.574, and negated views 4.37 against 3.17.)"""
    n, d, v = 9, 16, 13
    x, w, t, b = problem(device, torch.float32, (n,), d, v, seed=41)
    big = torch.randn(2 * v, generator=torch.Generator().manual_seed(42)).to(device)
    memory = 4 * v * 4  # (several row groups and, on the sliced layouts, a tile's 4 rows)
    cases = {
        "strided": lambda a, c, e: (a, c, e[::2]),
        "expanded": lambda a, c, e: (a, c, e[:1].expand(v)),
        "negated": lambda a, c, e: (torch._neg_view(a), torch._neg_view(c), torch._neg_view(e[:v])),
    }
    for name, view in cases.items():
        leaves = [t_.clone().requires_grad_() for t_ in (x, w, big)]
        a, c, e = view(*leaves)
        with heuristics.force(path=path):
            loss = fs.linear_cross_entropy(a, c, t, e, reduction=reduction, backend="triton", memory=memory)
        got = torch.autograd.grad(loss, leaves, upstream(loss))
        leaves64 = [t_.double().requires_grad_() for t_ in (x, w, big)]
        a64, c64, e64 = view(*leaves64)
        ref = torch_lce(a64, c64, t, e64, torch.float64, reduction=reduction)[0]
        want = torch.autograd.grad(ref, leaves64, upstream(ref).double())
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5, msg=f"{name}: loss")
        for what, g, r in zip(("dx", "dW", "dbias"), got, want, strict=True):
            torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-5, msg=f"{name}: {what}")
