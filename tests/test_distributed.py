"""fastsoftmax.distributed on 2 and 3 CPU processes with the gloo backend (a file:// store, no network
ports): softmax, log_softmax and cross_entropy of logits split along the classes, unequal and empty
slices, a slice that is -inf on a row, fully masked rows, ignore_index rows, label smoothing, every
reduction; values and gradients against torch on the concatenated logits."""

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import ZL, ref_cross_entropy, spawn_gloo, upstream

from fastsoftmax.core.reference import softmax_torch

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


@pytest.mark.parametrize("widths", [(11, 12), (5, 0, 18), (1, 21, 1)], ids=["2-even", "3-with-empty", "3-uneven"])
def test_vocabulary_parallel_gloo(tmp_path, monkeypatch, widths):
    assert sum(widths) == V
    spawn_gloo(tmp_path, monkeypatch, _checks, len(widths), widths)


def test_needs_an_initialised_group():
    import fastsoftmax.distributed as fsd

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fsd.softmax(torch.randn(2, 3))


def _changing_widths(rank, world, splits):
    """One rank's slice width changes between calls while another's stays (rank 0 keeps 5 at first): every
    call right, the collectives in step on every rank."""
    import fastsoftmax.distributed as fsd

    x = full_logits(torch.float64)
    x[1] = torch.randn(V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    t = targets()
    ref = F.cross_entropy(x, t, label_smoothing=0.1)
    for widths in splits:
        lo = sum(widths[:rank])
        xs = x[:, lo : lo + widths[rank]].clone().requires_grad_()
        loss = fsd.cross_entropy(xs, t, label_smoothing=0.1)
        torch.testing.assert_close(loss, ref)
        y = fsd.log_softmax(xs)
        torch.testing.assert_close(y, torch.log_softmax(x, -1)[:, lo : lo + widths[rank]])
        for tdtype in (torch.int16, torch.int32):  # narrow targets: compared as integers
            torch.testing.assert_close(fsd.cross_entropy(xs, t.to(tdtype), label_smoothing=0.1), ref)
        u = torch.where(t < 0, 0, t).to(torch.uint8)
        torch.testing.assert_close(fsd.cross_entropy(xs, u), F.cross_entropy(x, u.long()))


def _disagreeing(rank, world, case, out_dir):
    """Ranks that disagree: each records the error it raised (or that it returned)."""
    import fastsoftmax.distributed as fsd

    x = full_logits(torch.float32)[:, rank * 11 : rank * 11 + 11 + rank]
    t = targets()
    try:
        if case == "rows":
            fsd.cross_entropy(x[: M - rank], t[: M - rank])
        elif case == "dtype":
            fsd.cross_entropy(x.double() if rank else x, t)
        elif case == "options":
            fsd.cross_entropy(x, t, label_smoothing=0.1 * rank)
        else:
            fsd.softmax(x[: M - rank])
        msg = "returned"
    except ValueError as e:
        msg = f"ValueError: {e}"
    (out_dir / f"rank{rank}.txt").write_text(msg)


def test_slice_widths_change_between_calls(tmp_path, monkeypatch):
    spawn_gloo(tmp_path, monkeypatch, _changing_widths, 3, [(5, 0, 18), (5, 9, 9), (5, 9, 9), (1, 21, 1), (5, 0, 18)])


@pytest.mark.parametrize("case", ["rows", "dtype", "options", "softmax-rows"])
def test_disagreeing_ranks_all_raise_the_same_error(tmp_path, monkeypatch, case):
    """Different row counts, dtypes or loss options on two ranks: both raise the same ValueError (no crash
    on one and a result on the other, no hang)."""
    out = tmp_path / "out"
    out.mkdir()
    spawn_gloo(tmp_path, monkeypatch, _disagreeing, 2, case, out)
    msgs = [(out / f"rank{r}.txt").read_text() for r in range(2)]
    assert msgs[0] == msgs[1] and msgs[0].startswith("ValueError: distributed."), msgs
    assert "the ranks must pass shards of the same rows and dtype" in msgs[0]


def test_options_are_checked_before_any_collective():
    import fastsoftmax.distributed as fsd

    x, t = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    for bad, err in ((1.5, ValueError), (-0.1, ValueError), ("0.1", TypeError)):
        with pytest.raises(err, match="label_smoothing"):
            fsd.cross_entropy(x, t, label_smoothing=bad)
    with pytest.raises(ValueError, match="reduction"):
        fsd.cross_entropy(x, t, reduction="avg")
    with pytest.raises(TypeError, match="integer dtype"):
        fsd.cross_entropy(x, t.float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_forward_has_no_host_sync_and_captures_in_a_cuda_graph(tmp_path, device):
    """NCCL with one rank: log_softmax, cross_entropy (every option) and LM-head forwards (the signature and
    statistics all-gathers, the agreement and target assertions on the device, the shard kernels) are
    captured in a CUDA graph, which a host sync would abort, and replay right on new data."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd
    from fastsoftmax import heuristics

    if device != "cuda":
        pytest.skip("a GPU test (--device cuda)")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.randn(64, 1000, device="cuda")
        t = torch.randint(0, 1000, (64,), device="cuda")
        h, w = torch.randn(64, 32, device="cuda"), torch.randn(1000, 32, device="cuda") / 4
        opts = dict(label_smoothing=0.1, softcap=30.0, z_loss=1e-4)

        def step():
            lce = fsd.linear_cross_entropy(h, w, t, memory=1 << 16)
            return fsd.cross_entropy(x, t, **opts), fsd.log_softmax(x), lce

        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), heuristics.recording() as plans:  # warm up outside the capture
            step()
        assert [p.backend for p in plans if p.path == "shard"] == ["triton"] * 3, plans  # the kernels ran
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            loss, y, lce = step()
        for _ in range(2):
            x.copy_(torch.randn_like(x) * 3)
            h.copy_(torch.randn_like(h))
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(loss, fs.cross_entropy(x, t, **opts, backend="torch"))
            torch.testing.assert_close(y, torch.log_softmax(x, -1))
            torch.testing.assert_close(lce, fs.cross_entropy(h @ w.t(), t, backend="torch"), rtol=1e-4, atol=1e-4)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_slice_work_branch_is_the_one_asked_for(one_rank, backend, device):
    """Each branch of shard_merge.slice_work forced and checked: backend='triton' runs triton/shard.py's kernels
    (on the CPU in Triton's interpreter), 'torch' torch ops, 'auto' torch ops on CPU tensors and the kernels
    on CUDA ones: the plans recorded say which, on the forward and the backward. Outputs are poisoned with
    NaN first, so an element a kernel skips fails the comparison with float64 torch."""
    import fastsoftmax.distributed as fsd
    from fastsoftmax import heuristics

    want = "torch" if backend == "torch" or (backend == "auto" and device == "cpu") else "triton"
    x = full_logits(torch.float64)
    x[1] = torch.randn(V, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x32 = x.float().to(device)
    t = targets()
    w = torch.rand(V, generator=torch.Generator().manual_seed(4)) + 0.5
    tol = dict(atol=2e-5, rtol=2e-5)
    opts = dict(label_smoothing=0.1, class_weight=w.to(device), softcap=20.0, z_loss=1e-3, backend=backend)
    with heuristics.force(poison=True), heuristics.recording() as plans:
        xs = x32.clone().requires_grad_()
        loss = fsd.cross_entropy(xs, t.to(device), **opts)
        (dx,) = torch.autograd.grad(loss, xs)
        y = fsd.log_softmax(xs, backend=backend)
        (dy,) = torch.autograd.grad(y, xs, torch.ones_like(y))
    shard = [p.backend for p in plans if p.path == "shard"]
    assert shard == [want] * 4, plans
    xr = x.clone().requires_grad_()
    z = 20.0 * torch.tanh(xr / 20.0)
    lse = torch.logsumexp(z, -1)
    keep = t != -100
    ref = F.cross_entropy(z, t, weight=w.double(), label_smoothing=0.1) + (1e-3 * lse[keep] ** 2).mean()
    (dref,) = torch.autograd.grad(ref, xr)
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), **tol)
    torch.testing.assert_close(dx.double().cpu(), dref, **tol)
    torch.testing.assert_close(y.double().cpu(), torch.log_softmax(x, -1), **tol)
    torch.testing.assert_close(dy.double().cpu(), 1 - torch.softmax(x, -1) * V, **tol)
    xm = x32.clone()
    xm[3] = float("-inf")  # a row masked everywhere: log_softmax -inf, its gradient 0 (not dy)
    with heuristics.force(poison=True):
        for log in (False, True):
            xs = xm.clone().requires_grad_()
            y = (fsd.log_softmax if log else fsd.softmax)(xs, backend=backend)
            dym = torch.linspace(-1, 2, V, device=device).expand(M, V).clone()
            dym[3] = float("nan")  # (the masked row's gradient is 0 whatever dy holds there)
            (dxm,) = torch.autograd.grad(y, xs, dym)
            assert (dxm[3] == 0).all() and dxm[2].isfinite().all() and (dxm[2] != 0).any(), (log, dxm[3])


def test_torch_func_and_fake_tensors_are_refused_clearly(one_rank):
    """torch.func transforms and fake tensors cannot carry the collectives: every public function refuses
    them with NotImplementedError naming itself, before any collective."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import fastsoftmax.distributed as fsd

    x, t, w = torch.randn(4, 10), torch.randint(0, 10, (4,)), torch.randn(10, 3)
    calls = {
        "distributed.softmax": lambda a: fsd.softmax(a),
        "distributed.log_softmax": lambda a: fsd.log_softmax(a),
        "distributed.cross_entropy": lambda a: fsd.cross_entropy(a, t),
        "distributed.linear_cross_entropy": lambda a: fsd.linear_cross_entropy(a[:, :3], w, t),
    }
    for fn, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"{fn}: torch.func"):
            torch.func.grad(lambda a, call=call: call(a).sum())(x)
        with pytest.raises(NotImplementedError, match=f"{fn}: torch.func"):
            torch.vmap(call)(x[None])
        with FakeTensorMode() as mode, pytest.raises(NotImplementedError, match=f"{fn}: torch.func"):
            call(mode.from_tensor(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_z_loss_term_without_a_z_loss_as_fs_cross_entropys(one_rank, backend, device):
    """return_z_loss=True without a z-loss: the term fs.cross_entropy and fs.linear_cross_entropy give (zeros;
    the mean over no kept row 0 / 0 = NaN, as the loss), from both distributed losses (a regression test:
    they gave 0 for an all-ignored mean). Tensors on the test's device (Triton on CPU tensors: the
    interpreter, which --device cuda runs do not set)."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd

    x, w = torch.randn(4, 10, device=device), torch.randn(10, 3, device=device)
    for t in (torch.randint(0, 10, (4,), device=device), torch.full((4,), -100, device=device)):
        for reduction in ("none", "sum", "mean"):
            _, want = fs.cross_entropy(x, t, reduction=reduction, return_z_loss=True, backend=backend)
            got = (
                fsd.cross_entropy(x, t, reduction=reduction, return_z_loss=True, backend=backend)[1],
                fsd.linear_cross_entropy(x[:, :3], w, t, reduction=reduction, return_z_loss=True, backend=backend)[1],
            )
            for z in got:
                assert z.shape == want.shape and (z.isnan() == want.isnan()).all(), (reduction, t, z, want)
                assert (z[~z.isnan()] == 0).all()


def test_linear_cross_entropy_follows_autocast(one_rank, device):
    """Under torch.autocast (bf16) a bf16 x with an fp32 weight and bias: distributed.linear_cross_entropy
    casts them as F.linear's autocast does, as fs.linear_cross_entropy does (a regression test: it raised
    TypeError 'weight is torch.float32 but x is torch.bfloat16'); the loss fp32, the gradients in each
    input's dtype, equal to the single-process function's within bf16's tolerance, for every reduction."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd
    from fastsoftmax.core.reference import TOLERANCE

    g = torch.Generator().manual_seed(4)
    x = (torch.randn(12, 16, generator=g) * 2).to(device, torch.bfloat16)
    w, b = torch.randn(37, 16, generator=g).to(device), torch.randn(37, generator=g).to(device)
    t = torch.randint(0, 37, (12,), generator=g).to(device)
    t[3] = -100
    rtol, atol = TOLERANCE[torch.bfloat16]
    for reduction in ("none", "mean", "sum"):
        outs = []
        for f in (fs.linear_cross_entropy, fsd.linear_cross_entropy):
            leaves = [p.clone().requires_grad_() for p in (x, w, b)]
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = f(*leaves[:2], t, leaves[2], reduction=reduction, z_loss=ZL)
            grads = torch.autograd.grad(loss, leaves, torch.ones_like(loss))
            outs.append((loss, *grads))
        for name, want, got in zip(("loss", "dx", "dW", "db"), *outs, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape, (reduction, name, got.dtype, want.dtype)
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol + rtol, msg=f"{reduction} {name}")
        assert outs[0][0].dtype == torch.float32


def test_fully_masked_kept_row_with_a_z_loss(one_rank, device):
    """A kept row that is -inf everywhere, with a z-loss: its gradient is the library's for a fully masked
    row (p taken as 0, so the z-loss's 2 k lse p adds nothing: -g at the target), never NaN, on
    fs.cross_entropy (auto, torch, triton) and distributed.cross_entropy (auto, triton) alike, and equal to
    the same call's without a z-loss; the other rows' gradients match float64 torch. A regression test: the
    one-process paths gave NaN across the row (2 k lse with lse = -inf, times p = 0)."""
    import fastsoftmax as fs
    import fastsoftmax.distributed as fsd

    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 11, generator=g) * 3).to(device)
    x[1] = float("-inf")
    t = torch.tensor([0, 4, 10, -100, 7], device=device)
    calls = [(f"fs {b}", fs.cross_entropy, b) for b in ("auto", "torch", "triton")]
    calls += [(f"distributed {b}", fsd.cross_entropy, b) for b in ("auto", "triton")]
    for reduction in ("none", "mean", "sum"):
        up = upstream(reduction, (x.shape[0],), torch.float32).to(device)
        for name, f, backend in calls:
            grads = []
            for zl in (ZL, 0.0):
                xs = x.clone().requires_grad_()
                loss = f(xs, t, reduction=reduction, z_loss=zl, backend=backend)
                grads.append(torch.autograd.grad(loss, xs, up)[0])
            dx, dx_no_z = grads
            what = f"{name} {reduction}"
            assert dx.isfinite().all(), (what, dx[1])
            torch.testing.assert_close(dx[1], dx_no_z[1], rtol=0, atol=0, msg=what)
            assert dx[1, 4] < 0 and (dx[1, :4] == 0).all() and (dx[1, 5:] == 0).all(), (what, dx[1])
            rows = torch.tensor([0, 2, 3, 4])  # (the reference on the rows that are not fully masked)
            x64 = x[rows].double().cpu().requires_grad_()
            ref, _ = ref_cross_entropy(x64, t[rows].cpu(), reduction="none", z_loss=ZL)
            scale = up[rows] if reduction == "none" else up / (4 if reduction == "mean" else 1)
            (want,) = torch.autograd.grad(ref, x64, scale.double().expand(4).cpu())
            torch.testing.assert_close(dx[rows].double().cpu(), want, rtol=1e-5, atol=1e-6, msg=what)


def test_targets_digest_tells_targets_apart():
    """merge.targets_digest, which the ranks compare: different for targets that differ in one row, by a swap,
    by a shift of every row, and by patterns whose sum and whose sum weighted by the row are 0 (+1 -2 +1,
    +1 -1 -1 +1: a regression, row weights affine in the row summed those to the same digest), at random
    places in 3000 random trials (and from each other); equal for the same targets as int32, or strided."""
    from fastsoftmax.distributed.merge import targets_digest

    g = torch.Generator().manual_seed(5)
    n, v = 64, 1000
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    base = targets_digest(t)
    assert targets_digest(t.int()) == base and targets_digest(torch.stack([t, t], 1)[:, 0]) == base
    assert targets_digest(t.roll(1)) != base and targets_digest(t[[1, 0, *range(2, n)]]) != base
    seen = {(): int(base)}  # (each distinct change's digest)
    for trial in range(3000):
        d = torch.zeros(n, dtype=torch.int64)
        i = int(torch.randint(0, n - 4, (1,), generator=g))
        pattern = ((1, -2, 1), (1, -1, -1, 1), (3,), (5, -5))[trial % 4]
        d[i : i + len(pattern)] = torch.tensor(pattern) * int(torch.randint(1, 9, (1,), generator=g))
        other = int(targets_digest(t + d))
        assert other != base, (trial, pattern, i)
        seen[tuple(d.tolist())] = other
    assert len(set(seen.values())) == len(seen)  # (the changes' digests differ among themselves too)


def _compiled_losses(rank, world, out_dir):
    import fastsoftmax.distributed as fsd

    results = {}
    for n in (48, 64):
        g = torch.Generator().manual_seed(n)
        x, t = torch.randn(n, 10, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g)
        h, w = torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randn(10, 6, generator=g, dtype=torch.float64)
        for name, fn, args in (
            ("cross_entropy", fsd.cross_entropy, (x, t)),
            ("linear_cross_entropy", fsd.linear_cross_entropy, (h, w, t)),
        ):
            a = args[0].clone().requires_grad_()
            want = fn(a, *args[1:])
            (dwant,) = torch.autograd.grad(want, a)
            got = torch.compile(fn)(a, *args[1:])
            (dgot,) = torch.autograd.grad(got, a)
            right = torch.allclose(got, want, rtol=1e-12, atol=0) and torch.allclose(dgot, dwant, rtol=1e-12, atol=0)
            results[f"{name} {n}"] = "right" if right else f"wrong: {got} {want}"
    (out_dir / "compiled.json").write_text(json.dumps(results))


def test_torch_compile_of_the_losses_on_one_rank(tmp_path, monkeypatch):
    """torch.compile of cross_entropy and linear_cross_entropy, forward and backward, on one gloo rank (its own
    process: a crash fails the test) at 48 and 64 rows, against eager (a regression: Inductor's CPU code for
    the targets digest's wrapping int64 products crashed the process at these sizes)."""
    out = tmp_path / "out"
    out.mkdir()
    spawn_gloo(tmp_path, monkeypatch, _compiled_losses, 1, out, deadline_s=600)
    got = json.loads((out / "compiled.json").read_text())
    assert got == {f"{f} {n}": "right" for n in (48, 64) for f in ("cross_entropy", "linear_cross_entropy")}, got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_x_sample_tells_another_x_from_drift(dtype, device):
    """merge._sample and merge._another, the LM head's check that every rank holds x alike: the sample is the
    same in any layout (transposed, expanded, 3-D) and takes the first and the last element; x a few ulps
    off everywhere, or with NaN, infinities or zeros where rank 0 has them, is alike; x with its rows
    rolled (another rank's sequence shard) or another draw is another x; at most half the sample moved is
    not."""
    from fastsoftmax.distributed.merge import SAMPLE, SIGNATURE, _another, _sample

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 11, generator=g) * 4).to(dtype).to(device)
    x[5, 2], x[9, 1], x[0, 0] = float("nan"), float("inf"), 0.0
    base, k = _sample(x)
    assert k == min(x.numel(), SAMPLE) and base[0].item() == 0.0 and base[-1] == x[-1, -1].double()
    for y in (x.t().contiguous().t(), x.reshape(37, 1, 11), x[:, None].expand(37, 3, 11)[:, 0]):
        assert torch.equal(_sample(y)[0].nan_to_num(), base.nan_to_num())

    def another(y) -> bool:
        xs = torch.zeros(2, SIGNATURE, dtype=torch.float64, device=device)[:, :SAMPLE]
        xs[0, :k], xs[1, :k] = base, _sample(y)[0]
        flags = _another(xs, k).tolist()
        assert flags[0] is False
        return flags[1]

    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    drift = x.clone()
    drift.view(bits).add_(3)  # (3 ulps everywhere; the NaN stays NaN, the inf a NaN)
    assert not another(x.clone()) and not another(drift)
    assert another(x.roll(1, 0)) and another((torch.randn(37, 11, generator=g) * 4).to(dtype).to(device))
    half = x.clone().view(-1)
    idx = torch.arange(k, device=device) * (x.numel() - 1) // (k - 1)
    half[idx[: k // 2]] += 100.0  # (half the sample moved far: not most of it)
    assert not another(half.view(x.shape))
    half[idx[k // 2 : k // 2 + 2]] += 100.0
    assert another(half.view(x.shape))
    assert _sample(x[:0])[1] == 0


@pytest.mark.parametrize("wide", [torch.float32, torch.float64])
def test_merge_of_the_ranks_statistics(wide):
    """merge_max_sum, the one merge every distributed forward makes, against the whole row (in the default
    run: no process group needed): the max and the log of the sum of exp(x - max). Rows whose ranks' slices
    lie 1000 apart, where taking any one rank's own maximum instead of the global one overflows exp; a row
    -inf on one rank, on every rank (max -inf, log-sum 0); NaN and +inf on one rank (log-sum NaN)."""
    from fastsoftmax.core.reference import max_sum_torch
    from fastsoftmax.distributed.merge import merge_max_sum

    g = torch.Generator().manual_seed(0)
    slices = [torch.randn(6, w, generator=g, dtype=torch.float64) * 4 for w in (5, 3, 7)]
    slices[0][1] -= 1000.0  # rank 0's slice far below the others
    slices[2][2] += 1000.0  # rank 2's far above
    slices[1][3] = float("-inf")  # one rank fully masked in this row
    for s in slices:
        s[4] = float("-inf")  # every rank: the row is fully masked
    slices[2][5, 1] = float("nan")
    slices[0][0, 2] = float("inf")  # a row holding +inf on one rank
    stats = torch.stack([torch.stack(max_sum_torch(s.to(wide)), -1) for s in slices])
    m, ls = merge_max_sum(stats)
    full = torch.cat(slices, -1).to(wide).double()  # (the reference of the rounded input)
    want_m = full[1:4].amax(-1)
    want_ls = (full[1:4] - want_m[:, None]).exp().sum(-1).log()
    # (log S, S >= 1 summed in ``wide``: an absolute error of a few ulps of 1)
    tol = dict(rtol=1e-6 if wide == torch.float32 else 1e-12, atol=4 * torch.finfo(wide).eps)
    torch.testing.assert_close(m[1:4], want_m.to(wide), rtol=0.0, atol=0.0)
    torch.testing.assert_close(ls[1:4], want_ls.to(wide), **tol)
    assert m[4] == float("-inf") and ls[4] == 0.0
    assert ls[0].isnan() and ls[5].isnan()
    assert m.dtype == ls.dtype == wide
