"""fastsoftmax.distributed's error does not grow with the logits: 2 gloo processes, fp32 logits of 513 classes
split unevenly (200 + 313), rows offset by -1e4 to 3e4 (and around 30), with random outliers, a row's
maximum on either rank and a rank's slice -inf on a row. softmax and log_softmax against the float64 oracle
under the library's tolerance rule (core/reference.compare, as fs.softmax's tests); cross_entropy's loss and
dlogits, and linear_cross_entropy's loss and gradients (integer-valued inputs, so that fp32 logits near 1e4
are exact), against float64 torch (TP_TOL); on torch ops and on the Triton kernels (Triton's interpreter)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import (
    CAP,
    EPS,
    TP_LCE_TOL,
    ZL,
    bounds,
    close,
    compare,
    leaf64,
    random_logits,
    ref_cross_entropy,
    ref_grad,
    spawn_gloo,
    upstream,
)

PV, WIDTHS = 513, (200, 313)
OFFSETS = (0.0, 30.0, -30.0, 1e3, 1e4, -1e4, 3e4, 1e4)  # one a row
CE_CASES = [("plain", {}), ("z_loss", {"z_loss": ZL}), ("smoothing", {"label_smoothing": EPS})]
CE_CASES += [("softcap", {"softcap": CAP})]


def big_logits() -> torch.Tensor:
    """(8, 513) fp32: scale-3 logits with outliers x20, each row offset by OFFSETS; row 4's maximum on rank
    1's classes, row 5's on rank 0's; row 7 -inf on rank 0's classes."""
    g = torch.Generator().manual_seed(7)
    x = (
        random_logits((len(OFFSETS), PV), torch.float32, g).double()
        + torch.tensor(OFFSETS, dtype=torch.float64)[:, None]
    )
    x[4, 450] += 60.0
    x[5, 10] += 60.0
    x[7, : WIDTHS[0]] = float("-inf")
    return x.float()


def big_targets(rows: int) -> torch.Tensor:
    t = torch.randint(0, PV, (rows,), generator=torch.Generator().manual_seed(3))
    t[1] = -100
    t[7] = PV - 1  # (row 7 is -inf on rank 0's classes)
    return t


def lce_integer_problem():
    """(x (8, 6), W (513, 6), b (513,), targets) of small integers, x's first feature the row's offset and W's
    first column 1: every logit an integer below 2^24 plus the offset, exact in fp32 and float64 alike."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (len(OFFSETS), 6), generator=g).double()
    w = torch.randint(-2, 3, (PV, 6), generator=g).double()
    b = torch.randint(-4, 5, (PV,), generator=g).double()
    x[:, 0] = torch.tensor(OFFSETS)
    w[:, 0] = 1.0
    w[450] *= 4  # (a class whose logits stand out, on rank 1)
    return x, w, b, big_targets(len(OFFSETS))


def within_tolerance(y, x, log, what):
    err, problem = compare(y, x, -1, log)
    assert problem is None, f"{what}: {problem} (worst error / tolerance {err:.3g})"


def _precision_checks(rank, world, backend, dev):
    from fastsoftmax import heuristics

    with heuristics.recording() as plans:
        _precision_cases(rank, world, backend, dev)
    ran = {p.backend for p in plans if p.path == "shard"}
    assert ran == {backend}, f"rank {rank}: backend={backend!r} ran the slice's work on {ran}"


def _precision_cases(rank, world, backend, dev):
    import fastsoftmax.distributed as fsd

    lo, hi = bounds(WIDTHS, rank)
    f32 = torch.float32
    x = big_logits()
    failures = []

    def check(fn, *args):
        try:
            fn(*args)
        except AssertionError as e:
            failures.append(str(e))

    for log, fn in ((False, fsd.softmax), (True, fsd.log_softmax)):
        y = fn(x[:, lo:hi].to(dev), backend=backend).cpu()
        parts = [None] * world
        dist.all_gather_object(parts, y)
        check(within_tolerance, torch.cat(parts, -1), x, log, f"rank {rank} {backend} {fn.__name__}")
    t = big_targets(x.shape[0])
    for name, opts in CE_CASES:
        what = f"rank {rank} {backend} cross_entropy {name}"
        xs = x[:, lo:hi].to(dev).requires_grad_()
        loss = fsd.cross_entropy(xs, t.to(dev), reduction="none", backend=backend, **opts)
        x64 = leaf64(x)
        ref, _ = ref_cross_entropy(x64, t, reduction="none", **opts)
        row_ok = ~ref.isinf()  # (row 7's target is finite; a smoothing term over -inf logits is inf, on both)
        check(close, loss.cpu(), ref, f32, f"{what}: loss")
        g = upstream("none", ref.shape, f32)
        (dx,) = torch.autograd.grad(loss, xs, g.to(dev))
        dx = dx.cpu()
        want = ref_grad(torch.where(row_ok, ref, 0.0), x64, g, t, -100)[:, lo:hi]
        check(close, dx[row_ok], want[row_ok], f32, f"{what}: dlogits")
    xl, wl, bl, tl = lce_integer_problem()
    xr, wr, br = (a.float().to(dev).requires_grad_() for a in (xl, wl[lo:hi], bl[lo:hi]))
    what = f"rank {rank} {backend} linear_cross_entropy"
    loss = fsd.linear_cross_entropy(xr, wr, tl.to(dev), br, reduction="none", z_loss=ZL, backend=backend,
                                    memory=3 * 313 * 4)  # fmt: skip
    x64, w64, b64 = leaf64(xl), leaf64(wl), leaf64(bl)
    ref, _ = ref_cross_entropy(F.linear(x64, w64, b64), tl, reduction="none", z_loss=ZL)
    check(close, loss.cpu(), ref, f32, f"{what}: loss", TP_LCE_TOL)
    g = upstream("none", ref.shape, f32)
    got = [a.cpu() for a in torch.autograd.grad(loss, (xr, wr, br), g.to(dev))]
    want = torch.autograd.grad(ref, (x64, w64, b64), g.double())
    for name, dp, dref in zip(("dx", "dW", "db"), got, (want[0], want[1][lo:hi], want[2][lo:hi]), strict=True):
        check(close, dp, dref, f32, f"{what}: {name}", TP_LCE_TOL)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_error_does_not_grow_with_the_logits(tmp_path, monkeypatch, backend, device):
    """2 ranks, 513 classes split 200 + 313, fp32 logits offset up to 3e4: softmax and log_softmax within
    the library's tolerance of the float64 oracle, cross_entropy (plain, z_loss, smoothing, softcap) and
    linear_cross_entropy within TP_TOL of float64 torch, on torch ops and on the kernels (the interpreter on
    the CPU; with --device cuda, compiled, every rank's tensors on GPU 0, gloo carrying the collectives).
    The output was x - lse with lse rounded to fp32: at logits 1e4 an error of ~5e-4 (25x the tolerance)."""
    assert sum(WIDTHS) == PV
    dev = device if backend == "triton" else "cpu"
    interpret = dev == "cpu" and backend == "triton"
    spawn_gloo(tmp_path, monkeypatch, _precision_checks, 2, backend, dev, interpret=interpret)
