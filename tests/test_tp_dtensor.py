"""DTensor inputs (Shard on the classes) through fs.cross_entropy, fs.linear_cross_entropy and fs.softmax on
a CPU DeviceMesh over gloo, 2 and 3 processes: values and gradients against float64 torch on the full
problem (tests/helpers.py's tensor-parallel problems); placements other than Shard on the classes refused."""

import atexit
import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    CAP,
    EPS,
    LCE_MEMORY,
    TP_LCE_TOL,
    ZL,
    M,
    V,
    ce_logits,
    class_weights,
    close,
    lce_problem,
    leaf64,
    ref_cross_entropy,
    ref_grad,
    spawn_gloo,
    targets,
    upstream,
)


def _gloo_threads() -> list[str]:
    """The names of this process's threads that gloo runs (its I/O loop, torch's gloo workers)."""
    names = []
    for task in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ():
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return sorted(n for n in names if "gloo" in n)


def _report_teardown_with_gloo_threads(path):
    """At the interpreter's teardown (atexit), write the gloo threads still running to ``path``, if any."""
    if threads := _gloo_threads():
        with open(path, "w") as f:
            f.write(", ".join(threads))


def _dtensor_checks(rank, world, out_dir):
    atexit.register(_report_teardown_with_gloo_threads, os.path.join(out_dir, f"teardown-rank{rank}.txt"))
    _dtensor_cases(rank, world)


def _dtensor_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import fastsoftmax as fs

    mesh = init_device_mesh("cpu", (world,))
    for dtype in (torch.float32, torch.float64):
        x = ce_logits(dtype, masked=False)
        t = targets()
        cw = class_weights(dtype)
        for reduction, opts, t_in in (
            ("mean", {"label_smoothing": EPS, "class_weight": cw}, t),  # (the full class weights, plain)
            ("none", {"softcap": CAP, "z_loss": ZL}, distribute_tensor(t, mesh, [Replicate()])),
        ):
            what = f"rank {rank} {dtype} DTensor cross_entropy {reduction}"
            dt = distribute_tensor(x.clone(), mesh, [Shard(1)]).requires_grad_()
            loss = fs.cross_entropy(dt, t_in, reduction=reduction, **opts)
            assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),), (what, loss)
            x64 = leaf64(x)
            ref, _ = ref_cross_entropy(x64, t, reduction=reduction, **opts)
            close(loss.full_tensor(), ref, dtype, f"{what}: loss")
            g = upstream(reduction, ref.shape, dtype)
            loss.backward(distribute_tensor(g, mesh, [Replicate()]))
            assert isinstance(dt.grad, DTensor), (what, type(dt.grad))
            close(dt.grad.full_tensor(), ref_grad(ref, x64, g, t, -100), dtype, f"{what}: dlogits")
        # (B, T, V) logits sharded on the last dim
        x3 = x.reshape(3, 3, V).clone()
        dt3 = distribute_tensor(x3.clone(), mesh, [Shard(2)]).requires_grad_()
        loss = fs.cross_entropy(dt3, t.reshape(3, 3), z_loss=ZL)
        x364 = leaf64(x3)
        ref, _ = ref_cross_entropy(x364, t.reshape(3, 3), z_loss=ZL)
        close(loss.full_tensor(), ref, dtype, f"rank {rank} {dtype} DTensor (B, T, V)")
        loss.backward()
        close(dt3.grad.full_tensor(), ref_grad(ref, x364, torch.tensor(1.0), t.reshape(3, 3), -100), dtype,
              f"rank {rank} {dtype} DTensor (B, T, V) dlogits")  # fmt: skip
        # softmax and log_softmax: the placements kept, values and gradients of the full rows
        xm = ce_logits(dtype)  # a row -inf everywhere, rows -inf on whole shards
        dy = torch.randn(M, V, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        for log in (False, True):
            what = f"rank {rank} {dtype} DTensor {'log_softmax' if log else 'softmax'}"
            dt = distribute_tensor(xm.clone(), mesh, [Shard(1)]).requires_grad_()
            y = (fs.log_softmax if log else fs.softmax)(dt)
            assert isinstance(y, DTensor) and tuple(y.placements) == (Shard(1),), (what, y)
            x64 = leaf64(xm)
            r = torch.log_softmax(x64, -1) if log else torch.softmax(x64, -1)
            want = r.detach().clone()
            want[1] = float("-inf") if log else 0.0
            close(y.full_tensor(), want, dtype, f"{what}: values")
            d = dy.masked_fill(want.isinf(), 0.0)
            (dref,) = torch.autograd.grad(r, x64, d)
            dref[1] = 0.0
            (dx,) = torch.autograd.grad(y, dt, distribute_tensor(d.to(dtype), mesh, [Shard(1)]))
            close(dx.full_tensor(), dref, dtype, f"{what}: gradient")
        # linear_cross_entropy with W sharded by rows: x plain and no bias, then x a replicated DTensor and
        # the bias sharded as W is
        xl, wl, bl, tl = lce_problem(dtype)
        for x_kind, bias in (("plain", False), ("replicated", True)):
            what = f"rank {rank} {dtype} DTensor linear_cross_entropy, x {x_kind}, bias {bias}"
            x64, w64, b64 = leaf64(xl), leaf64(wl), leaf64(bl) if bias else None
            ref = F.cross_entropy(F.linear(x64, w64, b64), tl, label_smoothing=EPS)
            want = torch.autograd.grad(ref, [p for p in (x64, w64, b64) if p is not None])
            wd = distribute_tensor(wl.clone(), mesh, [Shard(0)]).requires_grad_()
            bd = distribute_tensor(bl.clone(), mesh, [Shard(0)]).requires_grad_() if bias else None
            xin = xl.clone() if x_kind == "plain" else distribute_tensor(xl.clone(), mesh, [Replicate()])
            xin.requires_grad_()
            loss = fs.linear_cross_entropy(xin, wd, tl, bd, label_smoothing=EPS, memory=LCE_MEMORY)
            assert isinstance(loss, DTensor) and tuple(loss.placements) == (Replicate(),), (what, loss)
            close(loss.full_tensor(), ref, dtype, f"{what}: loss", TP_LCE_TOL)
            loss.backward()
            dx = xin.grad.full_tensor() if isinstance(xin.grad, DTensor) else xin.grad
            close(dx, want[0], dtype, f"{what}: dx", TP_LCE_TOL)
            for name, p, dref in (("dW", wd, want[1]), ("db", bd, want[-1])):
                if p is not None:
                    assert isinstance(p.grad, DTensor), (what, name, type(p.grad))
                    close(p.grad.full_tensor(), dref, dtype, f"{what}: {name}", TP_LCE_TOL)
    # a 2-D mesh: the classes sharded on one mesh dim, replicated on the other (each order)
    x = ce_logits(torch.float32, masked=False)
    t = targets()
    for shape, placements in (((1, world), [Replicate(), Shard(1)]), ((world, 1), [Shard(1), Replicate()])):
        what = f"rank {rank} DTensor on a {shape} mesh, {placements}"
        mesh2 = init_device_mesh("cpu", shape)
        x64 = leaf64(x)
        ref, _ = ref_cross_entropy(x64, t, label_smoothing=EPS)
        dt = distribute_tensor(x.clone(), mesh2, placements).requires_grad_()
        loss = fs.cross_entropy(dt, t, label_smoothing=EPS)
        assert all(isinstance(p, Replicate) for p in loss.placements), (what, loss.placements)
        close(loss.full_tensor(), ref, torch.float32, f"{what}: loss")
        loss.backward()
        close(dt.grad.full_tensor(), ref_grad(ref, x64, torch.tensor(1.0), t, -100), torch.float32, f"{what}: grad")
    # dim checked as for a plain tensor (it ran along the last dim whatever it was): out of range, not an int
    dt = distribute_tensor(x, mesh, [Shard(1)])
    for fn in (fs.softmax, fs.log_softmax):
        for dim, error in ((2, IndexError), (-3, IndexError), (1.0, TypeError), (True, TypeError)):
            with pytest.raises(error, match="dim"):
                fn(dt, dim)
        with pytest.raises(NotImplementedError, match="last dim"):
            fn(dt, 0)
    # placements other than Shard on the class dim
    for placement in (Shard(0), Replicate()):
        dt = distribute_tensor(x, mesh, [placement])
        with pytest.raises(NotImplementedError, match=type(placement).__name__):
            fs.cross_entropy(dt, t)
        with pytest.raises(NotImplementedError, match=type(placement).__name__):
            fs.softmax(dt)
    xl, wl, _, tl = lce_problem(torch.float32)
    for placement in (Shard(1), Replicate()):
        with pytest.raises(NotImplementedError, match=type(placement).__name__):
            fs.linear_cross_entropy(xl, distribute_tensor(wl, mesh, [placement]), tl)
    # a DTensor where the call has no DTensor path (masked softmax, the backward functions, a loss's other
    # tensors beside plain logits or weight): refused by name before anything runs (torch's errors before)
    dt, rep = distribute_tensor(x, mesh, [Shard(1)]), lambda t: distribute_tensor(t, mesh, [Replicate()])
    refused = (
        ("x", lambda: fs.softmax(dt, scale=0.5)),
        ("x", lambda: fs.log_softmax(dt, causal=True)),
        ("x", lambda: fs.softmax(dt, mask=torch.zeros_like(x))),
        ("mask", lambda: fs.softmax(x, mask=rep(torch.zeros_like(x)))),
        ("dy", lambda: fs.softmax_backward(dt, x)),
        ("y", lambda: fs.log_softmax_backward(x, dt)),
        ("target", lambda: fs.cross_entropy(x, rep(t))),
        ("class_weight", lambda: fs.cross_entropy(x, t, class_weight=rep(class_weights(torch.float32)))),
        ("x", lambda: fs.linear_cross_entropy(rep(xl), wl, tl)),
        ("target", lambda: fs.linear_cross_entropy(xl, wl, rep(tl))),
    )
    for name, call in refused:
        with pytest.raises(NotImplementedError, match=f": {name} is a DTensor, and this call has no DTensor path"):
            call()


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_inputs(tmp_path, monkeypatch, world):
    """DTensors on a 1-D CPU DeviceMesh over gloo, the 23 classes sharded unevenly by torch (12/11, 8/8/7):
    fs.cross_entropy returns a Replicate DTensor equal to float64 torch on the full logits, and gives the
    logits DTensor the full gradient; fs.linear_cross_entropy with W Shard(0) (x plain or replicated);
    fs.softmax / fs.log_softmax return Shard(1) DTensors; rows sharded or replicated logits raise
    NotImplementedError. No rank reaches the interpreter's teardown with gloo threads running (torch keeps
    the groups its DTensor collectives used alive after destroy_process_group; helpers.spawn_gloo ends the
    ranks before the teardown, where one can abort)."""
    spawn_gloo(tmp_path, monkeypatch, _dtensor_checks, world, str(tmp_path))
    torn_down = {p.name: p.read_text() for p in tmp_path.glob("teardown-rank*.txt")}
    assert not torn_down, f"ranks torn down with gloo threads running: {torn_down}"
