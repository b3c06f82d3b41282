"""The LM-head loss's precision for fp32 logits far from 0, on every layout: each row's logsumexp is kept in
float64 (its max plus the log of its sum, exact; across the slices too) and the kernels split it into fp32
hi + lo, so the probabilities keep fp32's precision at any offset, as torch's x - max does, and as
fs.cross_entropy's do (tests/test_cpu_precision.py). Rounded to fp32 once, a logsumexp near 1024 is off by
up to 2^-14, and every probability by as much relatively."""

import pytest
import torch
import torch.nn.functional as F

import fastsoftmax as fs
from fastsoftmax import heuristics

# (path, backend): row chunks in torch ops and in Triton kernels, row groups x slices, and the fused forward
PATHS = [("lce_chunked", "torch"), ("lce_chunked", "triton"), ("lce_sliced", "triton"), ("lce_fused", "triton")]
MEMORY = 2304  # (the slices' budget: groups of 4 rows, slices of 128 of the 513 classes, both ragged)


def _exact_far_logits(device, n=24, d=16, v=513, offset=1024.0):
    """x and W of small integers (W / 128) and a bias of ``offset``: logits offset + k / 128, exact in fp32
    and in every GEMM's sums, so torch's fp32 error is its loss math's alone; targets with one ignored."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(-3, 4, (n, d), generator=g).float()
    w = torch.randint(-3, 4, (v, d), generator=g).float() / 128
    b = torch.full((v,), offset)
    t = torch.randint(0, v, (n,), generator=g)
    t[3] = -100
    return x.to(device), w.to(device), b.to(device), t.to(device)


def _loss_and_grads(fn, x, w, b):
    leaves = [a.detach().clone().requires_grad_() for a in (x, w, b)]
    loss = fn(*leaves)
    return (loss.detach(), *torch.autograd.grad(loss, leaves, torch.tensor(0.7, dtype=loss.dtype)))


@pytest.mark.parametrize("path, backend", PATHS)
def test_far_logits_keep_torchs_precision(device, path, backend):
    """loss, dx, dW and db against float64 within twice torch's own fp32 error (largest error relative to the
    largest entry, plus 2^-22 of it): with the logsumexp rounded to fp32, dx was off by 5.1e-6 of its largest
    entry on every path, torch's by 7.4e-7."""
    x, w, b, t = _exact_far_logits(device)
    ref = _loss_and_grads(lambda a, c, e: F.cross_entropy(F.linear(a, c, e), t), x.double(), w.double(), b.double())
    base = _loss_and_grads(lambda a, c, e: F.cross_entropy(F.linear(a, c, e), t), x, w, b)
    memory = MEMORY if path != "lce_chunked" else None
    with heuristics.force(path=path, poison=True):
        got = _loss_and_grads(
            lambda a, c, e: fs.linear_cross_entropy(a, c, t, e, backend=backend, memory=memory), x, w, b
        )
        assert heuristics.last_plan().path == path
    for what, g, r, o in zip(("loss", "dx", "dW", "db"), got, ref, base, strict=True):
        scale = float(r.abs().max())
        err, torch_err = float((g.double() - r).abs().max()) / scale, float((o.double() - r).abs().max()) / scale
        assert err <= 2 * torch_err + 2**-22, f"{what}: error {err:.2e} of its largest entry, torch's {torch_err:.2e}"
