"""fastsoftmax.distributed on 2 and 3 CPU processes with the gloo backend (a file:// store, no network
ports): softmax, log_softmax and cross_entropy of logits split along the classes, unequal and empty
slices, a slice that is -inf on a row, fully masked rows, ignore_index rows, label smoothing, every
reduction; values and gradients against torch on the concatenated logits."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastsoftmax.reference import softmax_torch

M, V = 9, 23


def full_logits(dtype):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(M, V, generator=g, dtype=torch.float64) * 4
    x[1] = float("-inf")  # a fully masked row
    x[2, :8] = float("-inf")  # -inf over the first slices of this row
    x[3, 5] = 80.0  # an outlier
    return x.to(dtype)


def targets():
    t = torch.arange(M) * 5 % V
    t[4] = -100  # ignored
    t[7] = V - 1  # owned by the last slice
    return t


def _checks(rank, world, widths):
    import fastsoftmax.distributed as fsd

    lo = sum(widths[:rank])
    hi = lo + widths[rank]
    for dtype in (torch.float32, torch.float64):
        x = full_logits(dtype)
        dy = torch.randn(M, V, generator=torch.Generator().manual_seed(5), dtype=dtype)
        tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-9)
        for log, fn in ((False, fsd.softmax), (True, fsd.log_softmax)):
            xs = x[:, lo:hi].clone().requires_grad_()
            y = fn(xs)
            x64 = x.double().requires_grad_()
            ref = softmax_torch(x64, -1, log, torch.float64, torch.float64)[0]
            torch.testing.assert_close(y.double(), ref[:, lo:hi].detach(), **tol, equal_nan=True)
            (dx,) = torch.autograd.grad(y, xs, dy[:, lo:hi])
            dy_full = dy.double().clone()
            if log:
                dy_full[ref.detach().isinf()] = 0.0  # the gradient where y = -inf is defined as 0 there
                dy_slice = dy[:, lo:hi].masked_fill(ref[:, lo:hi].detach().isinf(), 0.0)
                (dx,) = torch.autograd.grad(fn(xs), xs, dy_slice)
            (dref,) = torch.autograd.grad(ref, x64, dy_full)
            dref[1] = 0.0  # fully masked row: gradient 0 by the library's convention
            torch.testing.assert_close(dx.double(), dref[:, lo:hi], **tol)
        # cross-entropy on finite rows (torch's cross_entropy has no fully-masked-row convention)
        xf = x.clone()
        xf[1] = torch.randn(V, generator=torch.Generator().manual_seed(2)).to(dtype)
        t = targets()
        for reduction in ("none", "mean", "sum"):
            for eps in (0.0, 0.1):
                xs = xf[:, lo:hi].clone().requires_grad_()
                loss = fsd.cross_entropy(xs, t, reduction=reduction, label_smoothing=eps)
                x64 = xf.double().requires_grad_()
                ref = F.cross_entropy(x64, t, reduction=reduction, label_smoothing=eps)
                torch.testing.assert_close(loss.double(), ref.detach(), **tol)
                g = torch.ones_like(ref) if reduction != "none" else torch.linspace(0.5, 1.5, M, dtype=torch.float64)
                (dx,) = torch.autograd.grad(loss, xs, g.to(dtype))
                (dref,) = torch.autograd.grad(ref, x64, g)
                torch.testing.assert_close(dx.double(), dref[:, lo:hi], **tol)
    with pytest.raises(IndexError, match="outside"):
        bad = targets()
        bad[0] = V + 3
        fsd.cross_entropy(full_logits(torch.float32)[:, lo:hi], bad)


def _worker(rank, world, init_file, widths):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _checks(rank, world, widths)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("widths", [(11, 12), (5, 0, 18), (1, 21, 1)], ids=["2-even", "3-with-empty", "3-uneven"])
def test_vocabulary_parallel_gloo(tmp_path, monkeypatch, widths):
    assert sum(widths) == V
    init_file = tmp_path / "store"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the children run torch ops only
    if os.path.exists("/sys/class/net/lo") and "GLOO_SOCKET_IFNAME" not in os.environ:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo's traffic stays on the loopback interface
    mp.spawn(_worker, args=(len(widths), str(init_file), widths), nprocs=len(widths), join=True)


def test_needs_an_initialised_group():
    import fastsoftmax.distributed as fsd

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsd.softmax(torch.randn(2, 3))
