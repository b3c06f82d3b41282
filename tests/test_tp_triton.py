"""fastsoftmax.distributed with backend='triton' on 2 and 3 processes over gloo (tests/helpers.py's
tensor-parallel problems): on CPU tensors the kernels run in Triton's interpreter, with --device cuda
compiled on GPU 0 (gloo carrying the collectives); softmax and log_softmax with -inf shards and a fully
masked row, cross_entropy with every option, linear_cross_entropy in chunks, values and gradients against
float64 torch, each call checked to launch some kernel (backend='torch' none)."""

import contextlib
import os
from unittest import mock

import pytest
import torch
from helpers import (
    ALL_OPTIONS,
    CAP,
    EPS,
    ZL,
    D,
    V,
    bounds,
    ce_logits,
    close,
    lce_one,
    leaf64,
    ref_cross_entropy,
    ref_grad,
    spawn_gloo,
    split_options,
    targets,
    upstream,
)

TM = 7  # rows in the interpreter (slow): 7 x 23


def _count_interpreted_launches():
    """Counts every kernel the Triton interpreter runs from now on in this (child) process: proof that
    backend='triton' ran kernels, not torch ops. Returns the list the launches' names go into."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = []
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches.append(getattr(getattr(self, "fn", None), "__name__", "?"))
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    return launches


def _count_gpu_launches(stack):
    """Counts every Triton kernel launched on the GPU from now on in this (child) process, by name: the
    library's one launcher (triton/launch.launch) compiles or looks up each kernel through compiled() before
    it launches (not Triton's launch hook, which would send the kernels through Triton's own launcher)."""
    from fastsoftmax.kernels.triton import launch as tlaunch

    launches, compiled = [], tlaunch.compiled

    def counted(kernel, *args, **kwargs):
        launches.append(getattr(getattr(kernel, "fn", None), "__name__", "?"))
        return compiled(kernel, *args, **kwargs)

    stack.enter_context(mock.patch.object(tlaunch, "compiled", counted))
    return launches


def _triton_checks(rank, world, widths, dev="cpu"):
    """The checks below on CPU tensors (the interpreter), or on ``dev`` 'cuda' (compiled kernels: every rank
    on GPU 0, gloo carrying the collectives through host copies)."""
    with contextlib.ExitStack() as stack:
        if dev == "cpu":
            assert os.environ.get("TRITON_INTERPRET") == "1"
            launches = _count_interpreted_launches()
        else:
            launches = _count_gpu_launches(stack)
        _triton_cases(rank, widths, dev, launches)


def _triton_cases(rank, widths, dev, launches):
    import fastsoftmax.distributed as fsd
    from fastsoftmax import heuristics

    lo, hi = bounds(widths, rank)
    f32 = torch.float32
    x = ce_logits(f32, rows=TM)  # rows 1 (all -inf), 2 and 6 (-inf shards), an outlier of 80
    x64 = x.double()
    for log, fn in ((False, fsd.softmax), (True, fsd.log_softmax)):
        what = f"rank {rank} widths {widths} triton {fn.__name__}"
        xs = x[:, lo:hi].clone().to(dev).requires_grad_()
        n0 = len(launches)
        y = fn(xs, backend="triton")
        ref = torch.log_softmax(x64, -1) if log else torch.softmax(x64, -1)
        ref[1] = float("-inf") if log else 0.0  # a row -inf everywhere: zeros (log: -inf), the library's rule
        close(y, ref[:, lo:hi], f32, f"{what}: values")
        dy = torch.randn(TM, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        dy[ref.isinf()] = 0.0  # (log_softmax's -inf outputs: no gradient flows into them)
        x64g = x64.clone().requires_grad_()
        r = torch.log_softmax(x64g, -1) if log else torch.softmax(x64g, -1)
        (dref,) = torch.autograd.grad(r, x64g, dy)
        dref[1] = 0.0
        (dx,) = torch.autograd.grad(y, xs, dy[:, lo:hi].float().to(dev))
        close(dx, dref[:, lo:hi], f32, f"{what}: gradient")
        assert len(launches) > n0 or hi == lo, f"{what}: no Triton kernel ran"
    cases = [("plain", {}, "mean", True), ("all", ALL_OPTIONS, "none", True)]
    cases += [("class_weight+smoothing", {"class_weight": True, "label_smoothing": EPS}, "sum", False)]
    cases += [("ignore_index=7", {"ignore_index": 7, "z_loss": ZL}, "mean", True)]
    for name, opts, reduction, masked in cases:
        what = f"rank {rank} widths {widths} triton cross_entropy {name} {reduction}"
        xc = ce_logits(f32, masked, rows=TM)
        ii = opts.get("ignore_index", -100)
        t = targets(TM, ii)
        local, full = split_options(opts, f32, lo, hi)
        xs = xc[:, lo:hi].clone().to(dev).requires_grad_()
        n0 = len(launches)
        local = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in local.items()}
        out = fsd.cross_entropy(xs, t.to(dev), reduction=reduction, backend="triton", **local)
        loss, z = out if opts.get("return_z_loss") else (out, None)
        xr = leaf64(xc)
        ref, zref = ref_cross_entropy(xr, t, reduction=reduction, **full)
        close(loss, ref, f32, f"{what}: loss")
        if z is not None:
            close(z, zref, f32, f"{what}: z-loss term")
        g = upstream(reduction, ref.shape, f32)
        (dx,) = torch.autograd.grad(loss, xs, g.to(dev))
        close(dx, ref_grad(ref, xr, g, t, ii)[:, lo:hi], f32, f"{what}: dlogits")
        assert len(launches) > n0 or hi == lo, f"{what}: no Triton kernel ran"
    n0 = len(launches)
    xs = x[:, lo:hi].clone().to(dev).requires_grad_()
    fsd.cross_entropy(xs, targets(TM).to(dev), backend="torch", label_smoothing=EPS, softcap=CAP).backward()
    fsd.softmax(xs, backend="torch").sum().backward()
    assert len(launches) == n0, f"rank {rank}: backend='torch' launched {launches[n0:]}"
    for name, opts, reduction, bias in (("all", ALL_OPTIONS, "mean", True), ("plain", {}, "none", False)):
        n0 = len(launches)
        what = f"rank {rank} widths {widths} triton linear_cross_entropy {name} {reduction}"
        lce_one(fsd, rank, lo, hi, f32, opts, reduction, bias=bias, memory=3 * V * 4, shape=(TM, 1), backend="triton",
                 what=what, dev=dev)  # fmt: skip
        assert len(launches) > n0 or hi == lo, f"{what}: no Triton kernel ran"
    # the backward in row groups x slices of the rank's classes (forced; 300 classes: slices of 128; 20 rows:
    # groups of 16 and 4), the slice's dlogits by the kernels
    lo, hi = bounds((130, 170) if len(widths) == 2 else (130, 0, 170), rank)
    what = f"rank {rank} [{lo}, {hi}) triton linear_cross_entropy sliced backward"
    n0 = len(launches)
    with heuristics.force(path="lce_sliced", poison=True), heuristics.recording() as plans:
        lce_one(fsd, rank, lo, hi, f32, ALL_OPTIONS, "mean", memory=16 * (128 * 4 + 4 * D), v=300, rows=20,
                backend="triton", what=what, dev=dev)  # fmt: skip
    # (recording(): on a GPU the backward's plan is recorded on autograd's thread, not this one's)
    assert hi == lo or any(p.path == "lce_sliced" for p in plans), (what, plans)
    assert hi == lo or "shard_apply" in launches[n0:], f"{what}: no dlogits kernel ran ({launches[n0:]})"


@pytest.mark.parametrize("widths", [(5, 18), (5, 0, 18)], ids=["2-uneven", "3-empty"])
def test_triton_kernels_in_the_interpreter(device, tmp_path, monkeypatch, widths):
    """backend='triton' on CPU tensors (the kernels in Triton's interpreter, each call checked to launch
    some): softmax and log_softmax with -inf shards and a fully masked row, cross_entropy with every option,
    linear_cross_entropy in chunks; values and gradients against float64 torch."""
    if device != "cpu":
        pytest.skip("the interpreter's run (CPU); --device cuda runs test_triton_kernels_on_the_gpu")
    spawn_gloo(tmp_path, monkeypatch, _triton_checks, len(widths), widths, interpret=True)


@pytest.mark.parametrize("widths", [(5, 18), (5, 0, 18)], ids=["2-uneven", "3-empty"])
def test_triton_kernels_on_the_gpu(device, tmp_path, monkeypatch, widths):
    """The same checks with compiled kernels (--device cuda): every rank's tensors on GPU 0, gloo carrying
    the collectives; launch.recorded, patched, counts the launches."""
    if device != "cuda":
        pytest.skip("needs --device cuda: the interpreter's run is test_triton_kernels_in_the_interpreter")
    spawn_gloo(tmp_path, monkeypatch, _triton_checks, len(widths), widths, "cuda")
