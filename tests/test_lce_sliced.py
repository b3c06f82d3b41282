"""fs.linear_cross_entropy's lce_sliced layout (ops/lm_head.py: row groups x vocabulary slices, for small
memory budgets) against the float64 torch reference (tests/lce_reference.py): every option, reduction and
dtype with ragged groups and slices and poisoned outputs, the plan recorded; the rule that picks it
(heuristics/lm_head.sliced) and its budget (slice_plan); one group, one slice; autograd around it."""

import math

import pytest
import torch
from lce_reference import check, class_weights, problem, run, upstream

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
    assert rules.fused(None) is False and rules.fused("lce_sliced") is False and rules.fused("lce_fused") is True


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


# ---- skip_eps: the opt-in skip of negligible gradient tiles ----------------------------------------------------

# (softcaps above the skippable classes' -200: capped logits far below the rest still; their targets' factor
# 1 - (z / c)^2 about 0.6 and 0.85)
SKIP_OPTIONS = [
    {},
    {"softcap": 300.0, "z_loss": 1e-2},
    {"class_weight": "cw"},
    {"class_weight": "cw", "softcap": 500.0},
]


@pytest.fixture
def free_tiles(monkeypatch):
    """The time model's host cost of a tile set to 0: these problems are tiny, and a skip whose tiles' host
    time alone passes row chunks' runs row chunks (test_skip_gives_way_to_row_chunks_where_host_bound)."""
    monkeypatch.setattr(rules, "HOST_TILE_S", 0.0)


def _skippable(device, dtype, seed):
    """18 rows, 513 classes whose classes 128-511 (slices 1-3 at MEMORY's plan) sit 200 below the rest (their
    probability mass about e^-200 of a row's, the outlier class 256 included), with targets among them (the
    skipped slices' target terms)."""
    x, w, t, b = problem(device, dtype, (18,), 16, 513, seed=seed)
    b = b.clone()
    b[128:512] -= 200
    t = t.clone()
    t[0], t[2], t[6], t[9] = 200, 300, 450, 130  # (rows 1, 5, 9, ... are ignored: -100; 9 is kept here)
    return x, w, t, b


@pytest.mark.parametrize("layout", [None, "lce_fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("opt", range(len(SKIP_OPTIONS)))
def test_skip_drops_negligible_tiles(free_tiles, device, dtype, reduction, opt, layout):
    """skip_eps=1e-6: each kept row skips the 3 negligible slices except the one holding its target, each
    ignored row every slice (the plan counts the (row, slice) pairs), the loss and every gradient still
    within the float64 reference's tolerance (the dropped terms are ~e^-200), the targets in negligible
    slices included; on the ordinary problem with skip_eps=1e-30 only the ignored rows' pairs are skipped.
    lce_fused: the slices' largest logits come from the fused forward (each split whole slices)."""
    opts = dict(SKIP_OPTIONS[opt])
    if "class_weight" in opts:
        opts["class_weight"] = class_weights(513, device)
    scale = 10.0 if dtype == torch.float32 else 1.0
    for skipped in (True, False):
        x, w, t, b = _skippable(device, dtype, 40 + opt) if skipped else problem(device, dtype, (18,), 16, 513)
        fs_opts = {"backend": "triton", "memory": MEMORY, "skip_eps": 1e-6 if skipped else 1e-30}
        with heuristics.force(**({"path": layout} if layout else {})):
            check(x, w, t, b, reduction=reduction, fs_opts=fs_opts, grad_atol_scale=scale, **opts)
        plan = heuristics.last_plan()
        rows, cols = rules.slice_plan(18, 16, 513, x.element_size(), MEMORY, skip=True)
        assert (plan.path, plan.rows, plan.block_n) == (layout or "lce_sliced", rows, cols), plan
        eps = fs_opts["skip_eps"]
        assert plan.skipped == _skipped_pairs(x, w, b, t, cols, eps, opts.get("softcap")), plan
        if skipped:  # (each kept row's 3 slices of classes 200 below the rest, less its target's)
            assert plan.skipped >= sum(3 - (128 <= tr < 512) for tr in t.tolist() if tr != -100), plan


@pytest.mark.parametrize("layout", [None, "lce_fused"])
def test_skip_gathers_the_live_rows_of_sparse_slices(free_tiles, device, layout, monkeypatch):
    """The three ways a skip runs a (group, slice) tile, each seen: none of it (no live row), its live rows
    alone, gathered (at most GATHER_SHARE of the group: the negligible slices, where only rows whose target
    is there live), the whole tile (more: the first slice). Counted through TritonSteps.pick, the gather's
    one call a tile; the gradients the float64 reference's either way, buffers poisoned with NaN first."""
    from fastsoftmax.kernels.lm_head_steps import TritonSteps

    picks = []
    real = TritonSteps.pick

    def pick(self, grp, rows):
        picks.append(rows.numel())
        return real(self, grp, rows)

    monkeypatch.setattr(TritonSteps, "pick", pick)
    for skippable in (True, False):
        picks.clear()
        f32 = torch.float32
        x, w, t, b = _skippable(device, f32, 41) if skippable else problem(device, f32, (18,), 16, 513)
        eps = 1e-6 if skippable else 1e-30
        with heuristics.force(poison=True, **({"path": layout} if layout else {})):  # (each buffer written first)
            check(x, w, t, b, fs_opts={"backend": "triton", "memory": MEMORY, "skip_eps": eps}, grad_atol_scale=10)
        plan = heuristics.last_plan()
        tiles = -(-18 // plan.rows) * -(-513 // plan.block_n)
        live = _live_pairs(x, w, b, t, plan.block_n, eps)
        want = []  # (the live rows of each group's slices, where at most GATHER_SHARE of the group's)
        for r0 in range(0, 18, plan.rows):
            group = live[r0 : r0 + plan.rows]
            want += [c for c in group.sum(0).tolist() if 0 < c <= group.shape[0] * rules.GATHER_SHARE]
        assert picks == want, (str(picks), str(want))
        if skippable:  # (slices 1-3 of classes 200 below the rest: a group's rows live there where their target is)
            assert want and plan.skipped > 0 and len(picks) < tiles, plan
        else:  # (an ordinary problem, a skip of nothing: each group's kept rows live on every slice)
            assert picks == [], picks


def _live_pairs(x, w, b, t, cols: int, eps: float, softcap=None) -> torch.Tensor:
    """(rows, slices) bools: the (row, slice) pairs whose gradients a skip computes, from float64
    probabilities: a kept row's pairs whose largest probability reaches eps, and the one holding its target;
    no pair of an ignored row. None within 4x of eps (where the kernels' rounding could decide)."""
    z = x.double() @ w.double().T + (b.double() if b is not None else 0.0)
    p = (softcap * torch.tanh(z / softcap) if softcap else z).softmax(-1).cpu()
    slices = -(-p.shape[1] // cols)
    live = torch.zeros(p.shape[0], slices, dtype=torch.bool)
    for r, target in enumerate(t.tolist()):
        for s in range(slices):
            top = p[r, s * cols : (s + 1) * cols].max().item()
            if target != -100 and s != target // cols:
                assert not eps / 4 < top < eps * 4, (r, s, top)
            live[r, s] = target != -100 and (top >= eps or s == target // cols)
    return live


def _skipped_pairs(x, w, b, t, cols: int, eps: float, softcap=None) -> int:
    return int((~_live_pairs(x, w, b, t, cols, eps, softcap)).sum())


@pytest.mark.parametrize(
    "shape,sliced",
    [
        ((8192, 4096, 128256, 2, 51876431), True),  # h200_lce.json's shapes at CCE's peak: 128 tiles, 25.6 ms
        ((16384, 2304, 256000, 2, 60722833), True),  # of host against row chunks' 60 ms; 315 against 169 ms
        ((4096, 8192, 128256, 2, 99174105), True),  # 64 tiles, 12.8 ms against 50 ms
        ((8192, 2048, 32000, 2, 7777379), False),  # 144 tiles, 28.8 ms of host against 68 chunks' 17 ms
        ((8192, 4096, 128256, 2, None), True),  # no budget: 2048 x 4096 tiles, 25.6 ms against 3 GEMMs' 39 ms
        ((8192, 2048, 32000, 2, None), False),  # 32 tiles' 6.4 ms of host against 3 GEMMs' 4.9 ms
    ],
)
def test_the_rule_with_a_skip(shape, sliced):
    """A skip runs slices unless their host time alone passes row chunks' whole time; a forced design wins."""
    n, d, v, elsize, memory = shape
    assert rules.sliced(n, d, v, elsize, memory, None, skip=True) is sliced
    assert rules.sliced(n, d, v, elsize, memory, "lce_chunked", skip=True) is False
    assert rules.sliced(n, d, v, elsize, memory, "lce_sliced", skip=True) is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_skip_gives_way_to_row_chunks_where_host_bound(device, dtype, monkeypatch):
    """The skippable problem at MEMORY with the model's real host costs: its tiles' host time passes row
    chunks', so row chunks run (lce_chunked, nothing skipped) and the loss and gradients are the float64
    reference's; with the tiles' host cost at 0 the same call skips."""
    x, w, t, b = _skippable(device, dtype, 60)
    fs_opts = {"backend": "triton", "memory": MEMORY, "skip_eps": 1e-6}
    scale = 10.0 if dtype == torch.float32 else 1.0
    check(x, w, t, b, fs_opts=fs_opts, grad_atol_scale=scale)
    plan = heuristics.last_plan()
    assert plan.path == "lce_chunked" and not getattr(plan, "skipped", 0), plan
    monkeypatch.setattr(rules, "HOST_TILE_S", 0.0)
    check(x, w, t, b, fs_opts=fs_opts, grad_atol_scale=scale)
    plan = heuristics.last_plan()
    assert plan.path == "lce_sliced" and plan.skipped > 0, plan


def test_skip_matches_the_exact_gradients_closely(device):
    """fp32: the skipped run's dx, dW and db against the same call without skip: equal to fp32 rounding (the
    dropped probabilities are ~e^-200 of the kept ones)."""
    x, w, t, b = _skippable(device, torch.float32, 50)
    runs = []
    for eps in (0.0, 1e-6):
        with heuristics.force(path="lce_sliced"):
            runs.append(
                check(x, w, t, b, fs_opts={"backend": "triton", "memory": MEMORY, "skip_eps": eps}, grad_atol_scale=10)
            )
        assert (heuristics.last_plan().skipped > 0) == (eps > 0)
    (l0, _, g0), (l1, _, g1) = runs
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)  # (the forward never skips)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-5, atol=1e-6, msg=f"d{k}")


def test_skip_reads_narrow_targets_widened(free_tiles, device):
    """uint8 targets (-100 would wrap to 156): row 0's target 156 holds nearly all of its probability in slice
    1, which every other row finds negligible; the skip must keep that slice for row 0's group (a row whose
    target equals ignore_index's wrapped value is not ignored). Its dx and dW equal the exact run's."""
    n, d, v = 18, 16, 513
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g)
    x[:, 0] = 0.0
    x[0] = 0.0
    x[0, 0] = 20.0
    w = torch.randn(v, d, generator=g) * 0.1
    w[128:256] = 0.0
    w[128:256, 0] = 20.0
    b = torch.zeros(v)
    b[128:256] = -200.0  # (other rows: -200 there; row 0: +200)
    t = torch.randint(0, 128, (n,), generator=g)
    t[0] = 156
    x, w, b, t8 = x.to(device), w.to(device), b.to(device), t.to(device, torch.uint8)
    grads = []
    for eps in (0.0, 1e-6):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fs.linear_cross_entropy(xg, wg, t8, b, backend="triton", memory=MEMORY, skip_eps=eps)
        grads.append(torch.autograd.grad(loss, (xg, wg)))
        assert (heuristics.last_plan().skipped > 0) == (eps > 0), heuristics.last_plan()
    for name, exact, skipped in zip(("dx", "dW"), *grads, strict=True):
        torch.testing.assert_close(skipped, exact, rtol=1e-5, atol=1e-6, msg=name)


def test_skip_refusals_and_exact_elsewhere(device):
    """skip_eps outside [0, 1), with label smoothing or reduction='none': a clear error before any launch;
    on the torch loss (no slices) the call is exact and records row chunks."""
    x, w, t, b = problem(device, torch.float32, (6,), 8, 300, seed=51)
    bads = ((-0.1, ValueError, r"\[0, 1\)"), (1.0, ValueError, r"\[0, 1\)"), ("x", TypeError, "skip_eps"))
    for bad, err, match in bads:
        with pytest.raises(err, match=match):
            fs.linear_cross_entropy(x, w, t, b, skip_eps=bad)
    with pytest.raises(ValueError, match="label_smoothing=0"):
        fs.linear_cross_entropy(x, w, t, b, skip_eps=1e-4, label_smoothing=0.1)
    with pytest.raises(ValueError, match="reduction 'mean' or 'sum'"):
        fs.linear_cross_entropy(x, w, t, b, skip_eps=1e-4, reduction="none")
    check(x, w, t, b, fs_opts={"backend": "torch", "skip_eps": 1e-3})
    assert heuristics.last_plan().path == "lce_chunked"
    check(x, w, t, b, fs_opts={"backend": "triton", "skip_eps": 1e-3})  # no budget: MIN_ROWS rows of one slice
    plan = heuristics.last_plan()
    assert (plan.path, plan.rows, plan.block_n) == ("lce_sliced", 6, 300), plan
    m = fs.LinearCrossEntropy(8, 300, bias=True, skip_eps=1e-3, backend="triton", memory=1000, device=x.device)
    m.weight.data.copy_(w)
    m.bias.data.copy_(b)
    torch.testing.assert_close(m(x, t), fs.linear_cross_entropy(x, w, t, b, backend="triton"), rtol=1e-5, atol=1e-6)


def test_skip_keeps_slices_narrow(free_tiles, device):
    """A skip without memory=, fewer rows than a group holds: the slices stay SLICE_COLS wide (one group
    widened to all 12288 classes could never be skipped), so the two negligible slices are (a regression:
    they were one slice, never skipped: each kept row's pairs there, less row 3's target pair, and the
    ignored rows' pairs); the gradients still the float64 reference's."""
    x, w, t, b = problem(device, torch.float32, (16,), 8, 3 * rules.SLICE_COLS, seed=52)
    b = b.clone()
    b[rules.SLICE_COLS :] -= 200
    t = torch.where(t >= rules.SLICE_COLS, t % rules.SLICE_COLS, t)
    t[3] = 2 * rules.SLICE_COLS + 5  # (a target in a skipped slice)
    check(x, w, t, b, fs_opts={"backend": "triton", "skip_eps": 1e-6}, grad_atol_scale=10)
    plan = heuristics.last_plan()
    skips = _skipped_pairs(x, w, b, t, rules.SLICE_COLS, 1e-6)
    assert skips == 12 * 2 - 1 + 4 * 3  # (12 kept rows, 4 ignored)
    assert (plan.path, plan.rows, plan.block_n, plan.skipped) == ("lce_sliced", 16, rules.SLICE_COLS, skips), plan


def test_skip_under_torch_compile(free_tiles, device):
    """torch.compile(fullgraph=True, aot_eager) around a skipping call (the custom op runs the skip eagerly
    inside the graph): the same loss and gradients as the eager call, tiles skipped."""
    x, w, t, b = _skippable(device, torch.float32, 53)
    opts = {"backend": "triton", "memory": MEMORY, "skip_eps": 1e-6}

    def f(a, c, e):
        return fs.linear_cross_entropy(a, c, t, e, **opts)

    eager = run(f, x, w, b, "xwb")
    assert heuristics.last_plan().skipped > 0
    compiled = run(torch.compile(f, fullgraph=True, backend="aot_eager"), x, w, b, "xwb")
    assert heuristics.last_plan().skipped > 0
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=1e-6)
    for k in "xwb":
        torch.testing.assert_close(compiled[2][k], eager[2][k], rtol=1e-5, atol=1e-6, msg=f"d{k}")
