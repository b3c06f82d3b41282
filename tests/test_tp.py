"""fastsoftmax.distributed's tensor-parallel API (issue 21) on 2 and 3 CPU processes with gloo (a file://
store, no network ports): cross_entropy with every option (class_weight slices, softcap, z_loss and
return_z_loss, label smoothing with and without class weights, ignore_index, every reduction) and
linear_cross_entropy with the LM head's weight split along the classes (several chunks, non-uniform upstream
gradients), values and gradients against float64 torch on the gathered problem in one process; equal,
unequal and empty shards, shards -inf on a row, fully masked rows, outliers, narrow and strided targets;
options checked before any collective; a float64 output of a float32 shard. The problems and the checks
they share: tests/helpers.py. The Triton kernels: test_tp_triton.py; ranks that disagree:
test_tp_disagreeing_ranks.py; DTensor inputs: test_tp_dtensor.py."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    ALL_OPTIONS,
    CAP,
    EPS,
    LCE_MEMORY,
    TP_LCE_TOL,
    ZL,
    D,
    M,
    V,
    bounds,
    ce_logits,
    close,
    lce_one,
    lce_problem,
    leaf64,
    ref_cross_entropy,
    ref_grad,
    spawn_gloo,
    split_options,
    targets,
    upstream,
)

SHORT = ("plain", "all", "class_weight+smoothing")  # the cases run again on each later split of a spawn
# (name, options); class_weight True: the full weights, each rank passing its slice
CE_CASES = [
    ("plain", {}),
    ("smoothing", {"label_smoothing": EPS}),
    ("class_weight", {"class_weight": True}),
    ("class_weight+smoothing", {"class_weight": True, "label_smoothing": EPS}),
    ("softcap", {"softcap": CAP}),
    ("z_loss", {"z_loss": ZL, "return_z_loss": True}),
    ("ignore_index=7", {"ignore_index": 7}),
    ("all", ALL_OPTIONS),
]


def masked_ok(opts):
    """-inf logits give an infinite smoothing term unless a softcap makes them finite."""
    return not opts.get("label_smoothing") or opts.get("softcap") is not None


# ---- cross_entropy: every option, every reduction, against float64 torch -----------------------------------


def _ce_checks(rank, world, splits):
    import fastsoftmax.distributed as fsd

    for i, widths in enumerate(splits):
        lo, hi = bounds(widths, rank)
        cases = CE_CASES if i == 0 else [c for c in CE_CASES if c[0] in SHORT]  # (the later splits: fewer)
        for dtype in (torch.float32, torch.float64):
            for k, (name, opts) in enumerate(cases):
                backend = ("auto", "torch")[k % 2]  # (on CPU tensors both run torch ops)
                masked = masked_ok(opts)
                x = ce_logits(dtype, masked)
                ii = opts.get("ignore_index", -100)
                t = targets(ignore_index=ii)
                local, full = split_options(opts, dtype, lo, hi)
                for reduction in ("none", "mean", "sum"):
                    what = f"rank {rank} widths {widths} {dtype} {name} {reduction} {backend}"
                    xs = x[:, lo:hi].clone().requires_grad_()
                    out = fsd.cross_entropy(xs, t, reduction=reduction, backend=backend, **local)
                    loss, z = out if opts.get("return_z_loss") else (out, None)
                    x64 = leaf64(x)
                    ref, zref = ref_cross_entropy(x64, t, reduction=reduction, **full)
                    assert loss.dtype == dtype and loss.shape == ref.shape, (what, loss.dtype, loss.shape)
                    close(loss, ref, dtype, f"{what}: loss")
                    if z is not None:
                        close(z, zref, dtype, f"{what}: z-loss term")
                    g = upstream(reduction, ref.shape, dtype)
                    (dx,) = torch.autograd.grad(loss, xs, g)
                    close(dx, ref_grad(ref, x64, g, t, ii)[:, lo:hi], dtype, f"{what}: dlogits")
        if i == 0:
            _ce_inputs(fsd, rank, widths, lo, hi)


def _ce_inputs(fsd, rank, widths, lo, hi):
    """Targets of every integer dtype, strided targets and logits, (B, T, V) logits, every row ignored."""
    x = ce_logits(torch.float64)
    t = targets()
    x64 = x.clone().requires_grad_()
    ref, _ = ref_cross_entropy(x64, t, label_smoothing=0.0)
    dref = ref_grad(ref, x64, torch.tensor(1.0), t, -100)[:, lo:hi]
    for tdtype in (torch.int32, torch.int16, torch.int8):
        xs = x[:, lo:hi].clone().requires_grad_()
        loss = fsd.cross_entropy(xs, t.to(tdtype))
        close(loss, ref, torch.float64, f"rank {rank} widths {widths}: {tdtype} targets")
        close(torch.autograd.grad(loss, xs)[0], dref, torch.float64, f"rank {rank}: {tdtype} targets, dlogits")
    # uint8 targets (no ignored rows: -100 does not fit), on logits without a fully masked row
    xu = ce_logits(torch.float64, masked=False)
    u = torch.where(t < 0, 3, t).to(torch.uint8)
    close(fsd.cross_entropy(xu[:, lo:hi], u, label_smoothing=EPS),
          F.cross_entropy(xu, u.long(), label_smoothing=EPS), torch.float64, f"rank {rank}: uint8 targets")  # fmt: skip
    # a strided target (a view, stride 2) and a strided logits shard (a column slice of a wider buffer)
    wide_t = torch.stack([t, t.flip(0)], 1)[:, 0]
    assert not wide_t.is_contiguous()
    buf = torch.zeros(M, hi - lo + 3, dtype=torch.float64)
    buf[:, 1 : hi - lo + 1] = x[:, lo:hi]
    xs = buf[:, 1 : hi - lo + 1].requires_grad_()
    loss = fsd.cross_entropy(xs, wide_t, reduction="none")
    refn, _ = ref_cross_entropy(x64, t, reduction="none")
    close(loss, refn, torch.float64, f"rank {rank}: strided target and logits")
    g = upstream("none", (M,), torch.float64)
    close(torch.autograd.grad(loss, xs, g)[0], ref_grad(refn, x64, g, t, -100)[:, lo:hi], torch.float64,
          f"rank {rank}: strided target and logits, dlogits")  # fmt: skip
    # (B, T, V) logits, transposed (non-contiguous), with the targets transposed alike
    x3 = x.reshape(3, 3, V).transpose(0, 1)
    t3 = t.reshape(3, 3).t()
    xs3 = x3[..., lo:hi].clone().requires_grad_()
    x364 = x3.clone().requires_grad_()
    for reduction in ("none", "mean"):
        out = fsd.cross_entropy(xs3, t3, reduction=reduction, softcap=CAP, z_loss=ZL)
        ref3, _ = ref_cross_entropy(x364, t3, reduction=reduction, softcap=CAP, z_loss=ZL)
        assert out.shape == ref3.shape, (out.shape, ref3.shape)
        close(out, ref3, torch.float64, f"rank {rank}: (B, T, V) logits, {reduction}")
        g = upstream(reduction, ref3.shape, torch.float64)
        close(torch.autograd.grad(out, xs3, g)[0], ref_grad(ref3, x364, g, t3, -100)[..., lo:hi], torch.float64,
              f"rank {rank}: (B, T, V) logits, {reduction}, dlogits")  # fmt: skip
    # every row ignored: mean NaN (0 / 0, as torch), sum 0
    none = torch.full((M,), -100)
    xu32 = xu.float()
    for reduction in ("mean", "sum"):
        got = fsd.cross_entropy(xu32[:, lo:hi], none, reduction=reduction)
        close(got, F.cross_entropy(xu, none, reduction=reduction), torch.float32, f"rank {rank}: all ignored")
    # without gradients (no_grad): the same loss
    with torch.no_grad():
        close(fsd.cross_entropy(x[:, lo:hi].requires_grad_(), t), ref, torch.float64, f"rank {rank}: no_grad")


@pytest.mark.parametrize(
    "splits",
    [((11, 12), (0, 23), (17, 6)), ((5, 0, 18), (1, 21, 1), (8, 8, 7))],
    ids=["2-even-empty-uneven", "3-empty-uneven"],
)
def test_cross_entropy_every_option(tmp_path, monkeypatch, splits):
    """Every option and reduction in float32 and float64, values and dlogits against float64 torch on the
    gathered logits (upstream gradients not 1), for several splits of the 23 classes in one spawn (an empty
    shard, shards -inf on a row, a fully masked ignored row, outliers of +-80); then narrow, unsigned and
    strided targets, strided logits, (B, T, V) logits, all rows ignored, no_grad."""
    assert all(sum(w) == V for w in splits)
    spawn_gloo(tmp_path, monkeypatch, _ce_checks, len(splits[0]), splits)


# ---- linear_cross_entropy ----------------------------------------------------------------------------------


LCE_CASES = [
    ("plain", {}),
    ("no-bias", {}),
    ("smoothing", {"label_smoothing": EPS}),
    ("class_weight+smoothing", {"class_weight": True, "label_smoothing": EPS}),
    ("class_weight", {"class_weight": True}),
    ("softcap", {"softcap": CAP}),
    ("z_loss", {"z_loss": ZL, "return_z_loss": True}),
    ("ignore_index=4", {"ignore_index": 4}),
    ("all", ALL_OPTIONS),
]


def _lce_checks(rank, world, splits):
    import fastsoftmax.distributed as fsd

    for i, widths in enumerate(splits):
        lo, hi = bounds(widths, rank)
        for dtype in (torch.float32, torch.float64):
            for k, (name, opts) in enumerate(LCE_CASES if i == 0 else [c for c in LCE_CASES if c[0] in SHORT]):
                every = name in ("plain", "all")  # every reduction; the other cases one each, in turn
                for reduction in ("none", "mean", "sum") if every else (("none", "mean", "sum")[k % 3],):
                    what = f"rank {rank} widths {widths} {dtype} {name} {reduction}"
                    lce_one(fsd, rank, lo, hi, dtype, opts, reduction, bias=name != "no-bias", what=what)
            if i:
                continue
            # the default chunks (memory=None), (B, T, d) x, a frozen x, a frozen weight
            for reduction in ("none", "mean"):
                what = f"rank {rank} widths {widths} {dtype} {reduction}"
                lce_one(fsd, rank, lo, hi, dtype, {}, reduction, memory=None, what=f"{what} memory=None")
                lce_one(fsd, rank, lo, hi, dtype, {"softcap": CAP}, reduction, shape=(3, 4), what=f"{what} (B, T, d)")
            lce_one(fsd, rank, lo, hi, dtype, {}, "sum", wrt="wb", what=f"rank {rank} {widths} {dtype} x frozen")
            lce_one(fsd, rank, lo, hi, dtype, {}, "mean", wrt="x", what=f"rank {rank} {widths} {dtype} W frozen")
        # int32 targets, no gradients wanted
        x, w, b, t = lce_problem(torch.float64)
        ref = F.cross_entropy(F.linear(x, w, b), t)
        with torch.no_grad():
            got = fsd.linear_cross_entropy(x, w[lo:hi], t.to(torch.int32), b[lo:hi], memory=LCE_MEMORY)
        close(got, ref, torch.float64, f"rank {rank} widths {widths}: no_grad, int32 targets")


@pytest.mark.parametrize(
    "splits", [((9, 14), (23, 0)), ((5, 0, 18), (1, 21, 1), (8, 8, 7))], ids=["2-uneven-empty", "3-empty-uneven"]
)
def test_linear_cross_entropy_every_option(tmp_path, monkeypatch, splits):
    """The LM head's loss with W (and b) split by rows across the ranks, several chunks a call: every option
    (none and all of them in every reduction, each other in one) in float32 and float64; loss, x.grad (full,
    identical on every rank), W.grad and b.grad (the rank's slices) against float64
    F.cross_entropy(F.linear(x, W, b)) on the gathered W; no bias, the default chunks, (B, T, d) x, frozen x
    or W, no_grad with int32 targets."""
    assert all(sum(w) == V for w in splits)
    spawn_gloo(tmp_path, monkeypatch, _lce_checks, len(splits[0]), splits)


# ---- linear_cross_entropy's sliced backward ------------------------------------------------------------------
# 300 classes so that a rank's classes make several slices of 128 (rules.slice_plan's narrowest), 40 rows in
# groups of 16 (the last of 8): a budget of 16 rows of a 128-class slice and their dx sums.
SV, SN, SLICE, GROUP = 300, 40, 128, 16


def _sliced_memory(dtype) -> int:
    return GROUP * (SLICE * torch.empty((), dtype=dtype).element_size() + 4 * D)


def _sliced_checks(rank, world, splits):
    import fastsoftmax.distributed as fsd
    from fastsoftmax import heuristics
    from fastsoftmax.heuristics import lm_head as rules

    cases = LCE_CASES + [("3-D", {"softcap": CAP})]
    for widths in splits:
        lo, hi = bounds(widths, rank)
        for dtype in (torch.float32, torch.float64):
            mem = _sliced_memory(dtype)
            for k, (name, opts) in enumerate(cases):
                reduction = ("none", "mean", "sum")[k % 3]
                what = f"rank {rank} widths {widths} {dtype} {name} {reduction} sliced"
                shape = (4, SN // 4) if name == "3-D" else None
                with heuristics.force(path="lce_sliced", poison=True):
                    lce_one(fsd, rank, lo, hi, dtype, opts, reduction, bias=name != "no-bias", memory=mem, v=SV,
                            rows=SN, shape=shape, what=what, wrt="xwb" if k % 4 else "wb")  # fmt: skip
                plan = heuristics.last_plan()
                if hi > lo:  # (an empty shard has no backward work)
                    tiles = -(-SN // GROUP) * -(-(hi - lo) // SLICE)
                    got = (plan.path, plan.rows, plan.block_n, plan.splits)
                    assert got == ("lce_sliced", GROUP, SLICE, tiles), (what, plan)
            # the rule's own choice (rules.sliced for this rank's classes, recomputing), and row chunks forced
            # (and under a model whose GEMMs are slow enough to outweigh the host: there a 4th GEMM decides)
            e = torch.empty((), dtype=dtype).element_size()
            rates = dict(rules.GEMM_FLOPS)
            for budget, slow in ((mem // 8, False), (mem, False), (2 * mem, False), (mem, True)):
                rules.GEMM_FLOPS.update({2: 1e6, 4: 1e6} if slow else rates)
                lce_one(fsd, rank, lo, hi, dtype, {}, "mean", memory=budget, v=SV, rows=SN, what=f"{widths} rule")
                sliced = rules.sliced(SN, D, hi - lo, e, budget, None, recompute=True)
                got = getattr(heuristics.last_plan(), "path", None)  # (none on an empty shard)
                assert hi == lo or got == ("lce_sliced" if sliced else "lce_recompute"), (widths, dtype, budget, got)
                if slow and hi - lo == 170:  # (GEMMs that weigh: a backward that recomputes anyway takes slices
                    # for groups of more rows than its chunks: 16 against 12 on 170 classes, where 130 make 16 each)
                    assert sliced and not rules.sliced(SN, D, hi - lo, e, budget, None), (widths, dtype)
            rules.GEMM_FLOPS.update(rates)
            with heuristics.force(path="lce_recompute"):
                lce_one(fsd, rank, lo, hi, dtype, {}, "sum", memory=mem, v=SV, rows=SN, what=f"{widths} {dtype} chunks")
            assert hi == lo or heuristics.last_plan().path == "lce_recompute", heuristics.last_plan()


@pytest.mark.parametrize("splits", [((130, 170), (0, 300)), ((170, 0, 130),)], ids=["2-uneven-empty", "3-empty"])
def test_linear_cross_entropy_sliced_backward(tmp_path, monkeypatch, splits):
    """The head's backward in row groups x slices of the rank's classes (forced, the outputs poisoned): every
    option in turn, each in one reduction, float32 and float64, (B, T, d) x, x frozen; loss and gradients
    against float64 torch on the gathered W; the plan recorded (group rows, slice classes, tiles); the
    backward follows rules.sliced (recompute=True) at three budgets; forced row chunks record theirs."""
    assert all(sum(w) == SV for w in splits)
    spawn_gloo(tmp_path, monkeypatch, _sliced_checks, len(splits[0]), splits)


def test_sliced_rule_for_a_backward_that_recomputes():
    """rules.sliced(recompute=True): row chunks already do 4 GEMMs there, so slices win wherever they make
    fewer passes over dW; at 4096 x 8192 x 128256 bf16 with 256 MiB of logits, a forward that computes the gradients
    keeps row chunks (3 GEMMs) and one that recomputes takes slices; no budget: row chunks."""
    from fastsoftmax.heuristics import lm_head as rules

    n, d, v, mem = 4096, 8192, 128256, 256 << 20
    assert not rules.sliced(n, d, v, 2, mem, None)
    assert rules.sliced(n, d, v, 2, mem, None, recompute=True)
    assert not rules.sliced(n, d, v, 2, None, None, recompute=True)
    assert rules.sliced(16384, 2304, 128000, 2, 64 << 20, None, recompute=True)  # (a rank's half of 256000)


# ---- checks before any collective; one rank in-process -----------------------------------------------------


def test_options_are_checked_before_any_collective():
    """Bad options raise TypeError / ValueError naming the option before any collective: here, with no
    process group, before the RuntimeError a collective would give."""
    import fastsoftmax.distributed as fsd

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    x, t = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    w, b = torch.randn(5, 4), torch.randn(5)
    xl = torch.randn(3, 4)
    bad_ce = [
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap="15"), TypeError, "softcap"),
        (dict(z_loss=-1e-3), ValueError, "z_loss"),
        (dict(z_loss=float("nan")), ValueError, "z_loss"),
        (dict(return_z_loss=1), TypeError, "return_z_loss"),
        (dict(class_weight=torch.ones(6)), ValueError, "class_weight"),
        (dict(class_weight=torch.ones(5, dtype=torch.long)), TypeError, "class_weight"),
        (dict(class_weight=[1.0] * 5), TypeError, "class_weight"),
        (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        (dict(reduction="avg"), ValueError, "reduction"),
        (dict(backend="bogus"), ValueError, "backend"),
    ]
    for kwargs, err, name in bad_ce:
        with pytest.raises(err, match=name):
            fsd.cross_entropy(x, t, **kwargs)
        with pytest.raises(err, match=name):
            fsd.linear_cross_entropy(xl, w, t, b, **kwargs)
    with pytest.raises(TypeError, match="integer dtype"):
        fsd.cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="memory"):
        fsd.linear_cross_entropy(xl, w, t, b, memory=0)
    with pytest.raises(ValueError, match="weight"):
        fsd.linear_cross_entropy(xl, torch.randn(5, 3), t)
    with pytest.raises(TypeError, match="distributed.linear_cross_entropy: weight is torch.float64"):
        fsd.linear_cross_entropy(xl, w.double(), t)  # (named its caller: it said "linear_cross_entropy")
    with pytest.raises(ValueError, match="bias"):
        fsd.linear_cross_entropy(xl, w, t, torch.randn(4))
    with pytest.raises(ValueError, match="backend"):
        fsd.softmax(x, backend="bogus")
    # the shard's checks (core/checks.shard): the CUDA backend has no distributed kernels
    for fn in (fsd.softmax, fsd.log_softmax):
        with pytest.raises(ValueError, match="backend must be 'auto', 'triton' or 'torch'"):
            fn(x, backend="cuda")
        with pytest.raises(TypeError, match="floating-point torch.Tensor shard"):
            fn(t)
        with pytest.raises(ValueError, match="split class dim"):
            fn(torch.tensor(1.0))
        for bad in (torch.int64, torch.bool, torch.complex64):  # (a regression test: returned zeros, or integers)
            with pytest.raises(TypeError, match="dtype must be None"):
                fn(x, dtype=bad)
    with pytest.raises(TypeError, match="floating-point torch.Tensor shard"):
        fsd.cross_entropy(t, t)


def test_float64_output_of_a_float32_shard(one_rank):
    """softmax / log_softmax of a float32 shard with dtype=torch.float64 are float64-accurate, as
    fs.softmax(x, dtype=torch.float64) is (its reference computes in float64 when the output is float64)."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd

    x = ce_logits(torch.float32)
    for log in (False, True):
        want = torch.log_softmax(x.double(), -1) if log else torch.softmax(x.double(), -1)
        want[1] = float("-inf") if log else 0.0
        single = (fs.log_softmax if log else fs.softmax)(x, dtype=torch.float64)
        close(single, want, torch.float64, f"fs.{'log_softmax' if log else 'softmax'}, dtype=float64")
        y = (fsd.log_softmax if log else fsd.softmax)(x, dtype=torch.float64)
        assert y.dtype == torch.float64
        close(y, want, torch.float64, f"distributed.{'log_softmax' if log else 'softmax'}, dtype=float64")


def test_collectives_get_contiguous_tensors(one_rank, monkeypatch):
    """x transposed (dense, not contiguous: reshape keeps it a view) through the LM head's backward on both
    layouts: every tensor a collective gets is contiguous, as NCCL requires (gloo accepts any), and the
    gradients are right."""
    import torch.nn.functional as F

    import fastsoftmax.distributed as fsd
    from fastsoftmax import heuristics
    from fastsoftmax.distributed import merge

    seen = []
    for module, name in ((dist, "all_reduce"), (merge, "_all_gather")):  # (merge binds its all-gather once)
        real = getattr(module, name)

        def checked(t, *args, _real=real, _name=name, **kwargs):
            tensors = [t] + [a for a in args if isinstance(a, torch.Tensor)]
            seen.append((_name, all(a.is_contiguous() for a in tensors)))
            return _real(t, *args, **kwargs)

        monkeypatch.setattr(module, name, checked)
    x, w, b, t = lce_problem(torch.float64, rows=SN, v=SV)
    for path in ("lce_recompute", "lce_sliced"):
        xt = x.t().contiguous().t().requires_grad_()  # (same values, strides (1, SN))
        wr = w.clone().requires_grad_()
        with heuristics.force(path=path):
            loss = fsd.linear_cross_entropy(xt, wr, t, b, memory=_sliced_memory(torch.float64))
            dx, dw = torch.autograd.grad(loss, (xt, wr))
        x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = F.cross_entropy(F.linear(x64, w64, b), t)
        rx, rw = torch.autograd.grad(ref, (x64, w64))
        close(loss, ref, torch.float64, f"{path}: loss", TP_LCE_TOL)
        close(dx, rx, torch.float64, f"{path}: dx", TP_LCE_TOL)
        close(dw, rw, torch.float64, f"{path}: dW", TP_LCE_TOL)
    assert seen and all(ok for _, ok in seen), seen
