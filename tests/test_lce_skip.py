"""fs.linear_cross_entropy's skip_eps (ops/lm_head.py's lce_sliced: a (row, slice) pair's gradient left out
where all of the row's probabilities on the slice are negligible) against the float64 torch reference
(tests/lce_reference.py): every option the skip allows, both layouts, the pairs it leaves out and the tiles
it gathers (from float64 probabilities), the rule that gives way to row chunks, refusals, torch.compile."""

import pytest
import torch
from lce_reference import check, class_weights, problem, run

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import lm_head as rules

MEMORY = 2304  # 18 x 16 x 513: test_lce_sliced.py's budget (a skip's plan fits fewer rows a group in it)

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


@pytest.fixture
def picks(monkeypatch):
    """The live rows of each tile a skip gathers, in order: TritonSteps.pick, the gather's one call a tile,
    counted."""
    from fastsoftmax.kernels.lm_head_steps import TritonSteps

    seen = []
    real = TritonSteps.pick

    def pick(self, grp, rows):
        seen.append(rows.numel())
        return real(self, grp, rows)

    monkeypatch.setattr(TritonSteps, "pick", pick)
    return seen


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
        live = _live_pairs(x, w, b, t, cols, fs_opts["skip_eps"], opts.get("softcap"))
        assert plan.skipped == _expected_tiles(live, rows)[1], plan
        if skipped:  # (each kept row's 3 slices of classes 200 below the rest, less its target's)
            assert plan.skipped >= sum(3 - (128 <= tr < 512) for tr in t.tolist() if tr != -100), plan


@pytest.mark.parametrize("layout", [None, "lce_fused"])
def test_skip_gathers_the_live_rows_of_sparse_slices(free_tiles, device, layout, picks):
    """The three ways a skip runs a (group, slice) tile, each seen: none of it (no live row), its live rows
    alone, gathered (at most GATHER_SHARE of the group: the negligible slices, where only rows whose target
    is there live), the whole tile (more: the first slice). Counted through TritonSteps.pick, the gather's
    one call a tile; the gradients the float64 reference's either way, buffers poisoned with NaN first."""
    for skippable in (True, False):
        picks.clear()
        f32 = torch.float32
        x, w, t, b = _skippable(device, f32, 41) if skippable else problem(device, f32, (18,), 16, 513)
        eps = 1e-6 if skippable else 1e-30
        with heuristics.force(poison=True, **({"path": layout} if layout else {})):  # (each buffer written first)
            check(x, w, t, b, fs_opts={"backend": "triton", "memory": MEMORY, "skip_eps": eps}, grad_atol_scale=10)
        plan = heuristics.last_plan()
        tiles = -(-18 // plan.rows) * -(-513 // plan.block_n)
        want, skipped, _ = _expected_tiles(_live_pairs(x, w, b, t, plan.block_n, eps), plan.rows)
        assert (picks, plan.skipped) == (want, skipped), (str(picks), str(want), plan)
        if skippable:  # (slices 1-3 of classes 200 below the rest: a group's rows live there where their target is)
            assert want and plan.skipped > 0 and len(picks) < tiles, plan
        else:  # (an ordinary problem, a skip of nothing: each group's kept rows live on every slice)
            assert picks == [], picks


def _sparse_live(device, dtype, seed, nan_row=None):
    """18 rows, 513 classes: slices 1-3 (128 classes each) sit 100 below the rest except for the rows whose
    indicator feature s is on (x[r, s] = 1, W's slice-s rows 100 there), which rows 1 to 3 turn on for 20%,
    60% and 5% of the rows: pairs live by their probabilities, not only by their targets. ``nan_row``: a
    NaN in that row's x."""
    g = torch.Generator().manual_seed(seed)
    on = torch.rand(18, 4, generator=g) < torch.tensor([1.0, 0.2, 0.6, 0.05])
    x = torch.randn(18, 16, generator=g) * 0.5
    x[:, :4] = on.float()
    w = torch.randn(513, 16, generator=g) * 0.5
    w[:, :4] = 0
    b = torch.randn(513, generator=g)
    for s in (1, 2, 3):
        w[s * 128 : (s + 1) * 128, s] = 100.0
        b[s * 128 : (s + 1) * 128] -= 100.0
    t = torch.randint(0, 513, (18,), generator=g)
    t[1::4] = -100
    if nan_row is not None:
        x[nan_row, 5] = float("nan")
    return x.to(device, dtype), w.to(device, dtype), t.to(device), b.to(device, dtype)


@pytest.mark.parametrize("layout", [None, "lce_fused"])
@pytest.mark.parametrize("nan_row", [None, 4])
def test_skip_keeps_the_pairs_live_by_probability(free_tiles, device, layout, nan_row, picks):
    """Rows live on a slice by their probabilities there (not by their targets) get their gradient there:
    the loss and gradients are the float64 reference's (the dropped terms ~e^-100) and the pairs the plan
    leaves uncomputed are the float64 probabilities' negligible ones in gathered or empty tiles. A NaN in a
    kept row's x (NaN probabilities) keeps all its pairs live: its NaN reaches every row of dW, as torch's."""
    x, w, t, b = _sparse_live(device, torch.float32, 7, nan_row)
    with heuristics.force(poison=True, **({"path": layout} if layout else {})):
        _, _, grads = check(
            x, w, t, b, fs_opts={"backend": "triton", "memory": 5120, "skip_eps": 1e-6}, grad_atol_scale=10
        )
    plan = heuristics.last_plan()
    if nan_row is not None:
        assert grads["w"].isnan().any(1).all() and grads["x"][nan_row].isnan().all(), plan
        return
    live = _live_pairs(x, w, b, t, plan.block_n, 1e-6)
    by_target = torch.zeros_like(live)
    for r, tr in enumerate(t.tolist()):
        if tr != -100:
            by_target[r, tr // plan.block_n] = True
    assert (live & ~by_target)[:, 1:4].any(), "some pairs live by probability alone"
    want_picks, want_skipped, _ = _expected_tiles(live, plan.rows)
    assert (picks, plan.skipped) == (want_picks, want_skipped), (str(picks), str(want_picks), plan)


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


def _expected_tiles(live: torch.Tensor, rows: int, span: int = 1, room: int = 0, widths=()) -> tuple[list, int, int]:
    """From the live pairs, what a skip's plan and gathers must be: the live rows of each gathered tile (at
    most GATHER_SHARE of its group's rows, group by group, slice by slice) and the pairs left uncomputed
    (every pair of a tile with no live row, the dead pairs of a gathered tile; a tile that runs whole
    computes every pair). With ``span`` > 1 (the tiles' host cost set far above their GEMMs'): each span of
    slices with live rows on two or more of them runs as one tile on the union of its live rows where that
    fits GATHER_SHARE of the group and ``room`` elements of logits (``widths``: each slice's classes)."""
    picks, skipped, spans = [], 0, 0
    for r0 in range(0, live.shape[0], rows):
        group = live[r0 : r0 + rows]
        m = group.shape[0]
        counts = group.sum(0).tolist()
        for i0 in range(0, len(counts), span):
            sub = counts[i0 : i0 + span]
            union = int(group[:, i0 : i0 + span].any(1).sum())
            if sum(c > 0 for c in sub) > 1 and union <= m * rules.GATHER_SHARE:
                if union * sum(widths[i0 : i0 + span]) <= room:
                    picks.append(union)
                    skipped, spans = skipped + (m - union) * len(sub), spans + 1
                    continue
            for c in sub:
                if c == 0:
                    skipped += m
                elif c <= m * rules.GATHER_SHARE:
                    picks.append(c)
                    skipped += m - c
    return picks, skipped, spans


def _spanning(device):
    """18 rows, 513 classes in one group of 128-class slices (SPAN_MEMORY): classes 0-511 sit 200 below class
    512 (slice 4, where every kept row lives), except for row 4, whose probability is spread over slices 1,
    2 and 4; rows 0, 2 and 6 have their targets in slices 0, 1 and 2, the other kept rows at 512."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(18, 16, generator=g) * 0.5
    w = torch.randn(513, 16, generator=g) * 0.5
    x[:, 0], w[:, 0] = 0.0, 0.0
    x[4, 0], w[128:384, 0] = 1.0, 200.0
    b = torch.zeros(513)
    b[:512] = -200.0
    t = torch.full((18,), 512)
    t[0], t[2], t[6] = 20, 200, 300
    t[1::4] = -100
    return x.to(device), w.to(device), t.to(device), b.to(device)


SPAN_MEMORY = 18 * (128 * 4 + 4 * 16 + 8 * 16 // 2 + 5 * rules.SKIP_PAIR_BYTES)  # (fp32: one group of 128-class slices)


@pytest.mark.parametrize("layout", ["lce_sliced", "lce_fused"])
@pytest.mark.parametrize("span", [2, 4])
def test_skip_spans_sparse_slices_with_one_tile(device, monkeypatch, picks, layout, span):
    """A skip's span of slices with live rows on two or more runs as one gathered tile on the union of their
    live rows (every pair of it computed: more exact, not less) where the tiles' host time it saves passes
    the GEMM work it adds: here always (HOST_TILE_S 1 s), then never (0 s). The tiles, pairs left out and
    spans the plan counts are the float64 probabilities' (span 2: slices 0-1 as one tile of rows 0, 2, 4;
    span 4: slices 0-3, rows 0, 2, 4, 6, filling the logits buffer), the loss and gradients the float64
    reference's, buffers poisoned with NaN first."""
    monkeypatch.setattr(rules, "SKIP_SPAN", span)
    x, w, t, b = _spanning(device)
    for host_s in (1.0, 0.0):
        monkeypatch.setattr(rules, "HOST_TILE_S", host_s)
        picks.clear()
        with heuristics.force(poison=True, path=layout):
            check(
                x, w, t, b, fs_opts={"backend": "triton", "memory": SPAN_MEMORY, "skip_eps": 1e-6}, grad_atol_scale=10
            )
        plan = heuristics.last_plan()
        assert (plan.rows, plan.block_n) == (18, 128), plan
        live = _live_pairs(x, w, b, t, 128, 1e-6)
        widths = [128] * 4 + [1]
        want = _expected_tiles(live, 18, span if host_s else 1, 18 * 128, widths)
        assert (picks, plan.skipped, plan.spans) == want, (str(picks), str(want), plan)
        spans = {2: ([3, 2], 1), 4: ([4], 1)}[span] if host_s else ([1, 2, 2], 0)
        assert (picks, plan.spans) == spans, (picks, plan)


def test_the_span_rule():
    """widen(): one tile for a span only where two or more of its slices have live rows, their union fits
    GATHER_SHARE of the group and the logits buffer, and the GEMM work it adds costs less than the host time
    of the tiles it saves (bf16, d 4096: a row of a 4096-class slice is 0.15 us of GEMMs, a tile 200 us of host)."""
    d, e, room, ws = 4096, 2, 2048 * 4096, [4096] * 4
    assert rules.HOST_TILE_S == 2.0e-4 and rules.GEMM_FLOPS[2] == 6.6e14  # (the figures below assume these)
    assert rules.widen(2048, [100, 100, 100, 0], 300, ws, d, e, room)  # (900 rows more: 137 us < 400 us saved)
    assert rules.widen(2048, [10, 10, 10, 0], 300, ws, d, e, room)  # (1170 rows: 178 us < 400 us)
    assert not rules.widen(2048, [10, 10, 0, 0], 500, ws, d, e, room)  # (1980 rows: 302 us > 200 us)
    assert not rules.widen(2048, [40, 0, 0, 0], 40, ws, d, e, room)  # (one tile: nothing saved)
    assert not rules.widen(2048, [600, 600, 0, 0], 1100, ws, d, e, room)  # (past GATHER_SHARE of the rows)
    assert not rules.widen(2048, [60, 30, 0, 10], 90, ws, d, e, 90 * 4 * 4096 - 1)  # (past the logits buffer)
    assert rules.widen(2048, [60, 30, 0, 10], 90, ws, d, e, 90 * 4 * 4096)


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
    reference's; with the tiles' host cost at 0 the same call skips. (lce_fused's tiles priced as lce_sliced's:
    its cheaper ones would not be host-bound here.)"""
    monkeypatch.setattr(rules, "HOST_FUSED_TILE_S", rules.HOST_TILE_S)
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


def test_a_skip_that_gives_way_runs_the_exact_layout_the_model_picks(device, monkeypatch):
    """A skip whose tiles cost the host more than row chunks (its plan: 20 tiles of 11 rows) runs exactly as
    the call without it would: here lce_fused's 15 tiles of 16 rows, cheaper than the 8 row chunks, nothing
    skipped, the same numbers as skip_eps=0 and the float64 reference's (before, row chunks ran: 1.4x
    lce_fused's time at 8192 x 2048 x 32000 on an H100, sweeps/h100_lce_fused_rows.json)."""
    monkeypatch.setattr(rules, "HOST_CHUNK_S", 1.0)
    monkeypatch.setattr(rules, "HOST_TILE_S", 100.0)
    monkeypatch.setattr(rules, "HOST_FUSED_TILE_S", 0.45)
    n, d, v, memory = 40, 16, 513, 5130
    assert rules.layout(n, d, v, 2, memory, None, skip=True, fusable=True) == rules.ROWS
    assert rules.layout(n, d, v, 2, memory, None, fusable=True) == rules.FUSED
    x, w, t, b = problem(device, torch.bfloat16, (n,), d, v, seed=53)
    fs_opts = {"backend": "triton", "memory": memory, "skip_eps": 1e-3}
    check(x, w, t, b, fs_opts=fs_opts)
    got = []
    for eps in (1e-3, 0.0):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fs.linear_cross_entropy(xg, wg, t, b, backend="triton", memory=memory, skip_eps=eps)
        got.append((loss, *torch.autograd.grad(loss, (xg, wg))))
        plan = heuristics.last_plan()
        assert (plan.path, plan.rows, plan.skipped) == ("lce_fused", 16, 0), plan
    for a, e in zip(*got, strict=True):
        assert torch.equal(a, e)


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
    plan = heuristics.last_plan()  # (one tile: lce_fused's costs the host less than lce_sliced's, rules.layout)
    assert (plan.path, plan.rows, plan.block_n) == ("lce_fused", 6, 300), plan
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
    live = _live_pairs(x, w, b, t, rules.SLICE_COLS, 1e-6)
    assert int((~live).sum()) == 12 * 2 - 1 + 4 * 3  # (12 kept rows, 4 ignored)
    skips = _expected_tiles(live, 16)[1]  # (slice 1: empty; slice 2: row 3 alone, gathered)
    assert skips == 16 + 15
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
