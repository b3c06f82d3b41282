"""The cross-entropy forward as one program (heuristics/cross_entropy.py's ONE_PROGRAM rule): the rows, the
reduction, the counts and the targets' flag in one launch, against the two-launch forward and a float64
reference, every option and reduction, poisoned outputs, the backward fed by its stats; the rule's edges;
a plain call's forward that writes no stats and no z-loss (None)."""

import pytest
import torch
from helpers import ref_loss

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.options import Loss
from fastsoftmax.heuristics import cross_entropy as rules

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-3), torch.float16: (4e-3, 1e-4)}


def data(device, dtype, m, v, seed=0):
    """(m, v) logits of scale 3 with an outlier, targets with every 4th row ignored (the first kept)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=g) * 3
    x[0, min(1, v - 1)] = 40.0
    t = torch.randint(0, v, (m,), generator=g)
    t[3::4] = -100
    return x.to(device, dtype), t.to(device)


def test_the_rule():
    """One program exactly where m <= ONE_ROWS and m x v <= ONE_PROGRAM (its ROWS then hold every row, its
    tile at most ONE_TILE logits) or the usual shape's ROWS hold every row (one long row); the backward's
    shape and one without a row count (the LM-head loss's) as before."""
    cases = [(1, 4096), (8, 4096), (9, 4096), (1, rules.ONE_PROGRAM), (1, rules.ONE_PROGRAM + 1), (64, 512),
             (65, 7), (15, 7), (3, 513), (2, 50257)]  # fmt: skip
    for m, v in cases:
        rows, block, _, splits = rules.launch_shape(v, 2, False, m)
        one = m <= rules.ONE_ROWS and m * v <= rules.ONE_PROGRAM or m <= rules.launch_shape(v, 2, False)[0]
        assert (rows >= m) == one and splits == 1, (m, v)
        if one:
            assert rows * block <= max(rules.ONE_TILE, rows * 16) and block <= 1 << (v - 1).bit_length()
        assert rules.launch_shape(v, 2, True, m) == rules.launch_shape(v, 2, True)  # (the backward: no m)
    assert rules.launch_shape(4096, 2, False) == rules.launch_shape(4096, 2, False, 0) == (1, 4096, 4, 1)


CASES = {
    "plain": {},
    "smooth+weight": {"label_smoothing": 0.1, "class_weight": True},
    "softcap+z_loss": {"softcap": 15.0, "z_loss": 0.01},
    "all": {"label_smoothing": 0.1, "class_weight": True, "softcap": 15.0, "z_loss": 0.01},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 4096), (8, 4096), (15, 7), (5, 513)], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_one_program_against_two_launches_and_float64(device, dtype, shape, case):
    """Both forwards (the rule's one program; forced rows=1: rows, then ce_finish) give the float64 loss and
    z-loss for every reduction with every output poisoned first, and the backward fed by each one's stats
    gives the float64 gradient; the plan says which ran."""
    m, v = shape
    x, t = data(device, dtype, m, v)
    opts = dict(CASES[case])
    if opts.pop("class_weight", False):
        w = torch.rand(v, generator=torch.Generator().manual_seed(1)) + 0.2
        opts["class_weight"] = w.to(device)
    rtol, atol = TOL[dtype]
    for reduction in ("none", "mean", "sum"):
        x64 = x.double().requires_grad_()
        ref, zref = ref_loss(x64, t, -100, reduction, opts.get("label_smoothing", 0.0), opts.get("class_weight"),
                             opts.get("softcap"), opts.get("z_loss", 0.0))  # fmt: skip
        g = torch.rand_like(ref) + 0.5
        (dref,) = torch.autograd.grad(ref, x64, g)
        for fused in (True, False):
            if not fused and m == 1:
                continue  # (one row: every launch shape is one program)
            xg = x.clone().requires_grad_()
            with heuristics.force(poison=True, **({} if fused else {"rows": 1})):
                loss, z = fs.cross_entropy(xg, t, reduction=reduction, backend="triton", return_z_loss=True, **opts)
                assert heuristics.last_plan().fused == fused, (fused, heuristics.last_plan())
                (dx,) = torch.autograd.grad(loss, xg, g.to(dtype))
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
            torch.testing.assert_close(z.double(), zref.detach(), rtol=rtol, atol=atol * 10)
            torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("z_loss", [0.0, 0.01])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_a_plain_forward_makes_no_stats(device, z_loss, reduction):
    """The one-program forward without stats (a plain call: no backward to feed) returns None for the stats
    and, without a z-loss, for the z-loss, and the same loss as with them."""
    from fastsoftmax.kernels.triton import cross_entropy as k

    x, t = data(device, torch.float32, 8, 1000)
    o = Loss(reduction=reduction, z_loss=z_loss)
    with heuristics.force(poison=True):
        loss, z, st = k.forward(x, t, None, o, torch.float32, stats=False)
        assert heuristics.last_plan().fused and st is None and (z is None) == (not z_loss)
        full, zfull, st_full = k.forward(x, t, None, o, torch.float32)
    assert st_full.shape == (8 + 3,) and not st_full.isnan().any()
    torch.testing.assert_close(loss, full, rtol=0, atol=0)
    if z_loss:
        torch.testing.assert_close(z, zfull, rtol=0, atol=0)
    ref, _ = ref_loss(x, t, reduction=reduction, z_loss=z_loss)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_a_plain_calls_z_loss_term(device, backend):
    """fs.cross_entropy(return_z_loss=True) without a z-loss, no autograd (a plain call), every reduction,
    also replayed: the z term as the reference reduces it (zeros; 0 / 0 = NaN for the mean of all rows
    ignored, as the loss), on every path (a regression test: the plain one-program forward made no z term
    and the public function returned zeros for it)."""
    x, t = data(device, torch.float32, 4, 100)
    for ignored in (False, True):
        tt = torch.full_like(t, -100) if ignored else t
        for reduction in ("none", "sum", "mean"):
            ref, zref = ref_loss(x, tt, reduction=reduction)
            for _ in range(2):  # (the second call replayed where the path records)
                loss, z = fs.cross_entropy(x, tt, reduction=reduction, return_z_loss=True, backend=backend)
                assert z.shape == zref.shape and z.dtype == loss.dtype, (ignored, reduction)
                assert (z.isnan() == zref.isnan()).all() and (z[~z.isnan()] == 0).all(), (ignored, reduction, z)
                torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
