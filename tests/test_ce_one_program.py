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
from fastsoftmax.kernels import replay

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
    """One program (ROWS >= m) where m <= ONE_ROWS (16) and m x v <= ONE_PROGRAM (32768), or where the usual
    shape's ROWS hold every row (one long row), its tile at most ONE_TILE logits; the
    backward's shape and one without a row count (the LM-head loss's) as before."""
    assert (rules.ONE_PROGRAM, rules.ONE_ROWS, rules.ONE_TILE) == (32768, 16, 4096)
    one = [(1, 4096), (8, 4096), (16, 2048), (15, 7), (3, 513), (1, 32768), (1, 32769), (1, 256000), (16, 16)]
    two = [(9, 4096), (17, 7), (64, 7), (2, 50257), (16, 2049), (4096, 4096)]
    for m, v in one + two:
        rows, block, _, splits = rules.launch_shape(v, 2, False, m)
        assert (rows >= m) == ((m, v) in one) and splits == 1, (m, v, rows)
        if m > 1 and rows >= m:
            assert rows * block <= rules.ONE_TILE and block <= 1 << (v - 1).bit_length(), (m, v, rows, block)
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


def test_the_targets_flag_of_both_forwards(device):
    """The counts both forwards leave behind the rows' logsumexp (stats[m:]): the rows kept, 1.0 where every
    kept target is in [0, V) (else 0.0, the kernels reading nothing at a bad index), their weight; the loss
    right where the flag is 1 (the checks before a launch raise on a bad target: here the kernels alone)."""
    from fastsoftmax.kernels.triton import cross_entropy as k

    x, t = data(device, torch.float32, 4, 9)
    w = torch.rand(9, generator=torch.Generator().manual_seed(2)).to(device)
    for bad, flag in ((9, 0.0), (-5, 0.0), (-100, 1.0), (8, 1.0)):
        t[2] = bad
        keep = t != -100
        for fused in (True, False):
            with heuristics.force(**({} if fused else {"rows": 1})):
                loss, _, st = k.forward(x, t, w, Loss(), torch.float32, check=False)
                assert heuristics.last_plan().fused == fused
            inside = keep & (t >= 0) & (t < 9)
            assert st[4:].tolist() == [keep.sum().item(), flag, pytest.approx(w[t[inside]].sum().item(), rel=1e-6)]
            if flag:
                torch.testing.assert_close(loss.double(), ref_loss(x, t, class_weight=w)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["plain", "smooth+weight"])
@pytest.mark.parametrize("z_loss", [0.0, 0.01])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_a_plain_forward_makes_no_stats(device, case, z_loss, reduction):
    """The one-program forward without stats (a plain call: no backward to feed) returns None for the stats
    and, without a z-loss, for the z-loss, and the same loss as with them."""
    from fastsoftmax.kernels.triton import cross_entropy as k

    x, t = data(device, torch.float32, 8, 1000)
    w = (torch.rand(1000, generator=torch.Generator().manual_seed(1)) + 0.2).to(device) if case != "plain" else None
    eps = 0.1 if case != "plain" else 0.0
    o = Loss(reduction=reduction, smoothing=eps, z_loss=z_loss)
    with heuristics.force(poison=True):
        loss, z, st = k.forward(x, t, w, o, torch.float32, stats=False)
        assert heuristics.last_plan().fused and st is None and (z is None) == (not z_loss)
        full, zfull, st_full = k.forward(x, t, w, o, torch.float32)
    assert st_full.shape == (8 + 3,) and not st_full.isnan().any()
    torch.testing.assert_close(loss, full, rtol=0, atol=0)
    if z_loss:
        torch.testing.assert_close(z, zfull, rtol=0, atol=0)
    ref, _ = ref_loss(x, t, reduction=reduction, eps=eps, class_weight=w, z_loss=z_loss)
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
            replay.clear()  # (the first call the full path's, the second replayed where the path records)
            for _ in range(2):
                loss, z = fs.cross_entropy(x, tt, reduction=reduction, return_z_loss=True, backend=backend)
                assert z.shape == zref.shape and z.dtype == loss.dtype, (ignored, reduction)
                assert (z.isnan() == zref.isnan()).all() and (z[~z.isnan()] == 0).all(), (ignored, reduction, z)
                torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6, equal_nan=True)
