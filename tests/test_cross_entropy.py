"""fs.cross_entropy against torch.nn.functional.cross_entropy (float64): every reduction, ignore_index rows,
label smoothing, odd vocabularies, (B, T, V) logits, every dtype, values and gradients, the Triton kernels
(interpreter on CPU, compiled with --device cuda) and the torch path; errors before launch."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fastsoftmax as fs
from fastsoftmax import heuristics

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-3), torch.float16: (4e-3, 1e-4)}


def data(device, dtype, shape, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, v, generator=g) * 3
    x.view(-1, v)[0, 1] = 40.0  # an outlier
    t = torch.randint(0, v, shape, generator=g)
    t.view(-1)[1::4] = -100  # ignored rows
    return x.to(device, dtype), t.to(device)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("v", [7, 513, 5003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_matches_torch(device, backend, v, dtype):
    x, t = data(device, dtype, (3, 5), v)
    rtol, atol = TOL[dtype]
    for reduction in ("none", "mean", "sum"):
        for eps in (0.0, 0.2):
            xg = x.clone().requires_grad_()
            loss = fs.cross_entropy(xg, t, reduction=reduction, label_smoothing=eps, backend=backend)
            assert heuristics.last_plan().backend == backend and heuristics.last_plan().path == "cross_entropy"
            x64 = x.double().requires_grad_()
            ref = F.cross_entropy(x64.reshape(-1, v), t.reshape(-1), reduction=reduction, label_smoothing=eps)
            ref = ref.reshape(t.shape) if reduction == "none" else ref
            assert loss.dtype == dtype and loss.shape == ref.shape
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
            g = torch.rand_like(ref) + 0.5
            (dx,) = torch.autograd.grad(loss, xg, g.to(dtype))
            (dref,) = torch.autograd.grad(ref, x64, g)
            assert heuristics.last_plan().backend == backend  # the backward ran there too
            assert dx.dtype == dtype and (dx.reshape(-1, v)[1::4] == 0).all()  # ignored rows
            torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)


def test_backward_segments_rule(device):
    """The rule cuts backward rows into segments of at most BWD_SEGMENT_CHUNKS chunks (the forward never), and
    the plan a call records is the rule's: 1024 x 256000 bf16 rows of 63 chunks of 4096."""
    from fastsoftmax.heuristics import cross_entropy as ce_rules

    per = ce_rules.BWD_SEGMENT_CHUNKS
    assert ce_rules.launch_shape(256000, 2, True) == (1, 4096, 16, -(-63 // per))
    assert ce_rules.launch_shape(256000, 2, False)[3] == 1
    assert ce_rules.launch_shape(4096 * per, 4, True)[3] == 1  # fp32: 16384-wide chunks
    assert ce_rules.launch_shape(3001, 2, True)[3] == 1
    # 16-bit backward rows of 2049-4096 classes (lce_sliced's slices): 2048-wide chunks at 4 warps
    assert ce_rules.launch_shape(4096, 2, True) == ce_rules.launch_shape(2049, 2, True) == (1, 2048, 4, 1)
    assert ce_rules.launch_shape(4096, 4, True) == (1, 4096, 16, 1)
    assert ce_rules.launch_shape(2048, 2, True) == (2, 2048, 8, 1)
    assert ce_rules.launch_shape(4096, 2, False) == (1, 4096, 4, 1)
    v = 4096 * per + 5  # one chunk past a segment: two segments
    x, t = data(device, torch.bfloat16, (3,), v)
    xg = x.clone().requires_grad_()
    with heuristics.recording() as plans:  # the backward's plan, recorded on autograd's thread on CUDA
        loss = fs.cross_entropy(xg, t, backend="triton")
        (dx,) = torch.autograd.grad(loss, xg)
    assert [p.splits for p in plans] == [1, 2]
    x64 = x.double().requires_grad_()
    (dref,) = torch.autograd.grad(F.cross_entropy(x64, t), x64)
    torch.testing.assert_close(dx.double(), dref, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])
    x, t = data(device, torch.bfloat16, (5,), 3001)  # the short-row backward shape, run and right
    xg = x.clone().requires_grad_()
    with heuristics.recording() as plans:
        (dx,) = torch.autograd.grad(fs.cross_entropy(xg, t, backend="triton"), xg)
    assert (plans[-1].rows, plans[-1].block_n, plans[-1].num_warps) == (1, 2048, 4), plans
    x64 = x.double().requires_grad_()
    (dref,) = torch.autograd.grad(F.cross_entropy(x64, t), x64)
    torch.testing.assert_close(dx.double(), dref, rtol=TOL[torch.bfloat16][0], atol=TOL[torch.bfloat16][1])


@pytest.mark.parametrize(
    "rows,block_n,num_warps,splits,ran",
    [(1, 256, 2, 5, 4), (4, 1024, 4, 3, 3), (2, 8192, 8, 2, 1), (1, 256, 4, 12, 12)],
)
def test_forced_launch_shapes(device, rows, block_n, num_warps, splits, ran):
    """Every launch shape the rule or a tuning sweep can give (several rows a program, chunks shorter and
    longer than the row, rows cut into segments: 12 chunks of 256 in 5 asked segments are 4 of 3 chunks)
    computes the same loss and dlogits; the recorded plan is the forced one, with the segments launched."""
    x, t = data(device, torch.bfloat16, (7,), 3001)
    x64 = x.double().requires_grad_()
    ref = F.cross_entropy(x64, t, label_smoothing=0.1)
    (dref,) = torch.autograd.grad(ref, x64)
    xg = x.clone().requires_grad_()
    with heuristics.force(rows=rows, block_n=block_n, num_warps=num_warps, splits=splits, poison=True):
        loss = fs.cross_entropy(xg, t, label_smoothing=0.1, backend="triton")
        want = heuristics.Plan("triton", "cross_entropy", block_n=block_n, rows=rows, num_warps=num_warps)
        assert heuristics.last_plan() == want  # the forward: one segment a row
        with heuristics.recording() as plans:  # (on CUDA the backward runs on autograd's thread)
            (dx,) = torch.autograd.grad(loss, xg)
        assert plans == [dataclasses.replace(want, splits=ran)]
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
    torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)


def test_all_ignored_mean_is_nan_like_torch(device):
    x, t = data(device, torch.float32, (4,), 9)
    t[:] = -100
    assert fs.cross_entropy(x, t).isnan() and F.cross_entropy(x, t).isnan()
    assert fs.cross_entropy(x, t, reduction="sum") == 0


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
def test_no_z_loss_term_is_zero_on_nan_and_inf_rows(device, backend):
    """return_z_loss=True with z_loss=0: the z term is 0 on a row holding NaN and on a kept row of -inf,
    whose losses are NaN, on every backend (a regression: the torch backend gave 0 * lse^2 = NaN there)."""
    x = torch.randn(3, 8, device=device)
    x[0, 7], x[1] = float("nan"), float("-inf")
    loss, z = fs.cross_entropy(x, torch.arange(3, device=device), reduction="none", backend=backend, return_z_loss=True)
    assert (z == 0).all() and loss[:2].isnan().all() and loss[2].isfinite(), (z, loss)


def test_custom_ignore_index_and_int32_targets(device):
    x, t = data(device, torch.float32, (6,), 11)
    t = torch.where(t == -100, 3, t).to(torch.int32)
    ref = F.cross_entropy(x.double(), t.long(), ignore_index=3)
    torch.testing.assert_close(fs.cross_entropy(x, t, ignore_index=3, backend="triton").double(), ref)


def test_out_of_range_target_raises_under_transforms():
    """Under torch.func transforms the loss runs as torch ops on a clamped gather: a bad target must still
    raise (it gave a gradient silently when torch.func.grad wrapped the reshaped target), with the full
    message where the target can be read (a plain one, as fs.cross_entropy gets it) and a gather's where it
    cannot (vmap batches it; linear_cross_entropy's is reshaped inside the transform), naming the function.
    A good target still gives torch's gradient and values."""
    x, t = data("cpu", torch.float32, (4,), 9)
    w = torch.randn(9, 5, dtype=torch.float64)
    h = torch.randn(4, 5, dtype=torch.float64)
    for bad in (9, -5):
        t[2] = bad
        for fn, call in (
            ("cross_entropy", lambda: torch.func.grad(lambda a: fs.cross_entropy(a, t))(x)),
            ("cross_entropy", lambda: torch.func.jacrev(lambda a: fs.cross_entropy(a, t, reduction="none"))(x)),
            ("linear_cross_entropy", lambda: torch.func.grad(lambda a: fs.linear_cross_entropy(a, w, t))(h)),
        ):
            full = fn == "cross_entropy"
            with pytest.raises(IndexError, match=rf"^{fn}: (target {bad} at row 2|a target) is outside" if not full
                               else rf"^{fn}: target {bad} at row 2 is outside"):  # fmt: skip
                call()
        bt = torch.stack([t % 9, t])  # (the first row good, the second bad: read by no host code)
        for fn, call in (
            ("cross_entropy", lambda bt=bt: torch.func.vmap(lambda tt: fs.cross_entropy(x, tt))(bt)),
            ("linear_cross_entropy", lambda bt=bt: torch.func.vmap(lambda tt: fs.linear_cross_entropy(h, w, tt))(bt)),
        ):
            with pytest.raises(IndexError, match=rf"^{fn}: a target is outside \[0, 9\)"):
                call()
    t[2] = 4
    grad = torch.func.grad(lambda a: fs.cross_entropy(a, t))(x.double())
    torch.testing.assert_close(grad, torch.func.grad(lambda a: F.cross_entropy(a, t))(x.double()))
    ok = torch.func.vmap(lambda tt: fs.cross_entropy(x.double(), tt))(torch.stack([t, t.roll(1)]))
    torch.testing.assert_close(ok, torch.stack([F.cross_entropy(x.double(), tt) for tt in (t, t.roll(1))]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_out_of_range_target_raises(device, backend):
    """On the CPU at once (the Triton path: the host's check before any launch; the kernels' own flag is
    test_ce_one_program's). On a GPU the forward's last program asserts on the device, which ends the
    process's CUDA context (test_gpu.py checks that in a process of its own): here the test reads the flag
    the Triton kernels leave, with the assertion left out."""
    x, t = data(device, torch.float32, (4,), 9)
    t[2] = 9
    if device == "cuda":
        if backend == "torch":
            pytest.skip("torch._assert_async would end this process's CUDA context (test_gpu.py: in a subprocess)")
        from fastsoftmax.core.options import Loss
        from fastsoftmax.heuristics import cross_entropy as ce_rules
        from fastsoftmax.kernels.triton import cross_entropy as k

        for bad, flag in ((9, 0.0), (-5, 0.0), (-100, 1.0), (8, 1.0)):
            t[2] = bad
            loss, _, stats = k.forward(x, t, None, Loss(), x.dtype, ce_rules.launch_shape(9, 4, False), check=False)
            assert stats[4].item() == (t != -100).sum().item() and stats[5].item() == flag
            if flag:
                torch.testing.assert_close(loss.double(), F.cross_entropy(x.double(), t))
        return
    with pytest.raises(IndexError, match="target 9 at row 2 is outside"):
        fs.cross_entropy(x, t, backend=backend)
    t[2] = -5
    with pytest.raises(IndexError, match="outside"):
        fs.cross_entropy(x, t, backend=backend)
    t[2] = -100  # ignore_index: fine
    torch.testing.assert_close(fs.cross_entropy(x, t, backend=backend).double(), F.cross_entropy(x.double(), t))


def test_errors_before_launch():
    x = torch.randn(4, 9)
    with pytest.raises(ValueError, match="target has shape"):
        fs.cross_entropy(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer dtype"):
        fs.cross_entropy(x, torch.zeros(4))
    with pytest.raises(ValueError, match="reduction"):
        fs.cross_entropy(x, torch.zeros(4, dtype=torch.long), reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        fs.cross_entropy(x, torch.zeros(4, dtype=torch.long), label_smoothing=1.5)
    for ii in (2**63, -(2**63) - 1):  # (torch's own message was "Overflow when unpacking long long")
        with pytest.raises(ValueError, match="cross_entropy: ignore_index must fit in int64"):
            fs.cross_entropy(x, torch.zeros(4, dtype=torch.long), ignore_index=ii)
    # the custom op called directly checks its options too (it used to take reduction="avg" as the mean)
    t = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="reduction"):
        torch.ops.fastsoftmax.cross_entropy(x, t, None, -100, "avg", 0.0, None, 0.0, "auto", torch.float32)
    with pytest.raises(ValueError, match="backend must be"):
        torch.ops.fastsoftmax.cross_entropy(x, t, None, -100, "mean", 0.0, None, 0.0, "cuda", torch.float32)


def test_float64_no_rows_keeps_float64_stats():
    """M == 0 in float64: the stats are float64, as the fake implementation promises (opcheck)."""
    x = torch.empty(0, 5, dtype=torch.float64, requires_grad=True)
    t = torch.empty(0, dtype=torch.long)
    args = (
        x,
        t,
        None,
        -100,
        "sum",
        0.0,
        None,
        0.0,
        "auto",
        torch.float64,
    )  # (the mean of no rows is NaN, which opcheck rejects)
    torch.library.opcheck(torch.ops.fastsoftmax.cross_entropy.default, args)
    loss, _, stats = torch.ops.fastsoftmax.cross_entropy(*args)
    assert stats.dtype == torch.float64 and loss.item() == 0.0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_and_compile(device, backend):
    x = torch.randn(6, 10, device=device, requires_grad=True)
    t = torch.randint(0, 10, (6,), device=device)
    for reduction in ("mean", "none"):
        args = (x, t, None, -100, reduction, 0.1, None, 0.0, backend, x.dtype)
        torch.library.opcheck(torch.ops.fastsoftmax.cross_entropy.default, args)
    f = torch.compile(lambda a: fs.cross_entropy(a * 2, t, label_smoothing=0.1), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(f(x), F.cross_entropy(x * 2, t, label_smoothing=0.1))


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_strided_and_expanded_targets(device, backend):
    """A target column of a label table (stride 3), every other label (stride 2) and one label expanded to
    every row (stride 0): read at their strides, as torch does, on every backend; loss and dlogits."""
    x, _ = data(device, torch.float32, (64,), 513)
    table = torch.randint(0, 513, (64, 3), generator=torch.Generator().manual_seed(4)).to(device)
    table[5, 1] = -100
    wide = torch.randint(0, 513, (64, 2), generator=torch.Generator().manual_seed(5)).to(device)
    cases = {
        "column": table[:, 1],
        "every-other": wide.reshape(-1)[::2],
        "expanded": torch.tensor([7], device=device).expand(64),
    }
    for name, t in cases.items():
        assert not t.is_contiguous(), name
        for reduction in ("mean", "none"):
            xg = x.clone().requires_grad_()
            loss = fs.cross_entropy(xg, t, reduction=reduction, backend=backend)
            x64 = x.double().requires_grad_()
            ref = F.cross_entropy(x64, t.contiguous(), reduction=reduction)
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5, msg=name)
            g = torch.linspace(0.5, 1.5, ref.numel(), dtype=torch.float64, device=device).reshape(ref.shape)
            (dx,) = torch.autograd.grad(loss, xg, g.float())
            (dref,) = torch.autograd.grad(ref, x64, g)
            torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
@pytest.mark.parametrize("tdtype", [torch.uint8, torch.int8, torch.int16, torch.int32], ids=str)
def test_narrow_integer_targets(device, backend, tdtype):
    """Targets of every integer dtype are class indices compared as integers, never in their own dtype: a
    uint8 class 156 is a class (ignore_index -100 does not wrap to it), int16 targets index V = 40000 (the
    comparison with V does not overflow), float64 logits (the torch path) included."""
    for logit_dtype in (torch.float32, torch.float64):
        if backend == "triton" and logit_dtype == torch.float64:
            continue
        v = 40000 if tdtype in (torch.int16, torch.int32) else 200
        hi = {torch.uint8: 199, torch.int8: 127, torch.int16: 32767, torch.int32: 39999}[tdtype]
        t = torch.tensor([156 if tdtype == torch.uint8 else 100, 0, hi, 3], dtype=tdtype, device=device)
        if tdtype != torch.uint8:
            t[3] = -100  # ignored
        x = torch.randn(4, v, generator=torch.Generator().manual_seed(6), dtype=logit_dtype).to(device)
        xg = x.clone().requires_grad_()
        loss = fs.cross_entropy(xg, t, reduction="none", backend=backend)
        ref = F.cross_entropy(x.double(), t.long(), reduction="none")
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
        assert (loss != 0).sum() == (t.long() != -100).sum()  # class 156 (uint8) is not ignored
        (dx,) = torch.autograd.grad(loss.sum(), xg)
        x64 = x.double().requires_grad_()
        (dref,) = torch.autograd.grad(F.cross_entropy(x64, t.long(), reduction="sum"), x64)
        torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weight"])
def test_float32_error_independent_of_a_common_offset(device, backend, weighted):
    """A common offset c on every logit changes neither the loss nor its gradient, and float32 results keep
    the error they have at c = 0 (a few ulps of the loss's own scale), against float64 on the same float32
    inputs: the rows' logsumexp is kept wider than float32 between the forward and the backward, and the
    loss is taken as (max - z_t) + log(sum). Regression: with the logsumexp rounded to float32 the errors grew
    with c, at c = 3000 1.2e-4 in the loss and 2.9e-5 in dlogits (torch's own: 4e-7 and 3e-8)."""
    g = torch.Generator().manual_seed(0)
    m, v = 37, 513
    base = torch.randn(m, v, generator=g, dtype=torch.float64) * 2
    t = torch.randint(0, v, (m,), generator=g)
    t[::5] = -100
    w = (torch.rand(v, generator=g, dtype=torch.float64) + 0.5).float() if weighted else None
    for c in (0.0, 300.0, 3000.0):
        x = (base + c).float()
        x64 = x.double().requires_grad_()
        ref = F.cross_entropy(x64, t, weight=None if w is None else w.double(), reduction="none")
        (dref,) = torch.autograd.grad(ref.sum(), x64)
        xg = x.to(device).requires_grad_()
        wd = None if w is None else w.to(device)
        loss = fs.cross_entropy(xg, t.to(device), class_weight=wd, reduction="none", backend=backend)
        (dx,) = torch.autograd.grad(loss.sum(), xg)
        assert (loss.double().cpu() - ref.detach()).abs().max() < 2.5e-6, c
        assert (dx.double().cpu() - dref).abs().max() < 4e-7, c


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_float64_gradient_exact_at_any_offset(device, backend):
    """float64 logits (torch ops on every device) get float64's gradient whatever their common offset, as
    torch's x - max gives it: fs.cross_entropy (plain; class weights with smoothing; double backward) and
    the LM-head loss. Regression: p was exp(x - lse) with the saved float64 logsumexp, which loses |max| *
    2^-53 (at logits near 1e6 an error of 4e-11, 40x float64's tolerance; near 1e30, p = 1 across a row)."""
    g = torch.Generator().manual_seed(8)
    m, v = 9, 31
    base = torch.randn(m, v, generator=g, dtype=torch.float64) * 3
    base[1, 4] += 40.0  # (an outlier)
    t = torch.randint(0, v, (m,), generator=g)
    t[5] = -100
    w = torch.rand(v, generator=g, dtype=torch.float64) + 0.5
    for c in (0.0, 1e6, 1e8, 1e30):
        x = base + c
        x[3] = float("-inf")  # (a kept row, -inf everywhere: semantics.md's gradient)
        for opts in ({}, {"class_weight": w, "label_smoothing": 0.1}):
            x64 = x.clone().requires_grad_()
            ref = F.cross_entropy(x64, t, reduction="sum", weight=opts.get("class_weight"),
                                  label_smoothing=opts.get("label_smoothing", 0.0))  # fmt: skip
            (dref,) = torch.autograd.grad(ref, x64)
            dref[3] = 0.0
            dref[3, t[3]] = -(w[t[3]] if opts else 1.0) * (1 - opts.get("label_smoothing", 0.0))
            if opts:
                dref[3] -= 0.1 / v * w
            xg = x.to(device).requires_grad_()
            od = {k: (a.to(device) if torch.is_tensor(a) else a) for k, a in opts.items()}
            loss = fs.cross_entropy(xg, t.to(device), reduction="sum", backend=backend, **od)
            (dx,) = torch.autograd.grad(loss, xg, create_graph=bool(opts))  # (torch ops' rebuilt gradient too)
            torch.testing.assert_close(dx.detach().cpu(), dref, rtol=1e-12, atol=1e-13, msg=f"offset {c}")
        d = 4
        h = torch.randn(m, d, generator=g, dtype=torch.float64)
        wt = torch.randn(v, d, generator=g, dtype=torch.float64)
        b = (torch.randn(v, generator=g, dtype=torch.float64) + c).requires_grad_()  # (logits near c)
        ref = F.cross_entropy(F.linear(h, wt, b), t, reduction="sum")
        (dref,) = torch.autograd.grad(ref, b)
        bg = b.detach().to(device).requires_grad_()
        loss = fs.linear_cross_entropy(h.to(device), wt.to(device), t.to(device), bg, reduction="sum", backend=backend)
        (db,) = torch.autograd.grad(loss, bg)
        torch.testing.assert_close(db.cpu(), dref, rtol=1e-12, atol=1e-13, msg=f"LM head, offset {c}")


@pytest.mark.parametrize("backend", ["triton", "torch", "auto"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_stats_hold_the_logsumexp_in_float64(device, backend, smoothing):
    """Every backend and path (the native CPU path under 'auto' too) saves each row's logsumexp in float64 for
    every logits dtype (the fake's promise, and the signature tests/compile_facts.py compiles the kernels
    with), exact at logits around 1e4: within 1e-6 of float64's, where fp32's rounding is 5e-4 (as the
    native path's label-smoothing branch stored it). All -inf rows keep -inf; the counts follow."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        offset = 1e4 if dtype in (torch.float32, torch.float64) else 0.0
        x = (torch.randn(6, 513, generator=g, dtype=torch.float64) * 3 + offset).to(dtype)
        x[2] = float("-inf")
        t = torch.randint(0, 513, (6,), generator=g)
        t[4] = -100
        args = (x.to(device), t.to(device), None, -100, "sum", smoothing, None, 0.0, backend, dtype)
        _, _, stats = torch.ops.fastsoftmax.cross_entropy(*args)
        assert stats.dtype == torch.float64 and stats.shape == (9,), (dtype, stats.dtype)
        ref = torch.logsumexp(x.double(), -1)
        assert stats[2].item() == float("-inf")
        keep = torch.arange(6) != 2
        assert (stats[:6].cpu()[keep] - ref[keep]).abs().max() < 1e-6, dtype
        assert stats[6:].tolist() == [5.0, 1.0, 5.0]


@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"z_loss": 0.01}, {"softcap": 5.0}], ids=str)
def test_masked_rows_keep_finite_gradients_under_transforms(device, opts):
    """A kept row and an ignored row that are -inf everywhere: the gradient semantics.md gives (-g * w_t at
    the target, smoothing's term; 0 on the ignored row) under torch.func.grad as in eager autograd, a finite
    jvp, and finite second derivatives through create_graph. (The torch ops took log(0) of those rows'
    sums, whose gradient 0 / 0 made every one of these NaN.)"""
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(2)).to(device)
    x[1] = x[2] = float("-inf")
    t = torch.tensor([0, 3, -100, 6], device=device)

    def loss(a):
        return fs.cross_entropy(a, t, reduction="sum", **opts)

    a = x.clone().requires_grad_()
    (eager,) = torch.autograd.grad(loss(a), a)
    # (capped, a -inf logit is -softcap: finite, and tanh's slope there is 0)
    assert eager.isfinite().all() and (eager[1, 3] != 0) == ("softcap" not in opts) and (eager[2] == 0).all()
    torch.testing.assert_close(torch.func.grad(loss)(x), eager)
    _, tangent = torch.func.jvp(loss, (x,), (torch.ones_like(x),))
    assert tangent.isfinite(), tangent
    (g,) = torch.autograd.grad(loss(a), a, create_graph=True)
    torch.testing.assert_close(g.detach(), eager)
    (h,) = torch.autograd.grad((g * torch.linspace(-1, 1, g.numel(), device=device).reshape(g.shape)).sum(), a)
    assert h.isfinite().all(), h


def test_a_class_weight_that_requires_grad_is_refused_as_torch_refuses_it(device):
    """The loss has no gradient for its class weights, as torch's weight= has none: a weight that requires
    grad raises as torch's does, eager and under torch.func.grad taken in it (the eager call left w.grad
    None silently, and torch.func computed one), and runs under no_grad or detached."""
    x = torch.randn(4, 7, device=device)
    t = torch.tensor([0, 3, -100, 6], device=device)
    w = torch.rand(7, device=device).requires_grad_()
    h, head = torch.randn(4, 5, device=device), torch.randn(7, 5, device=device)
    calls = {
        "torch": lambda w: F.cross_entropy(x, t, weight=w),
        "cross_entropy": lambda w: fs.cross_entropy(x, t, class_weight=w),
        "linear_cross_entropy": lambda w: fs.linear_cross_entropy(h, head, t, class_weight=w),
    }
    for name, call in calls.items():
        match = "class_weight requires grad" if name != "torch" else "weight"
        with pytest.raises(RuntimeError, match=match):
            call(w)
        with pytest.raises(RuntimeError, match=match):
            torch.func.grad(call)(w.detach())
        with torch.no_grad():
            call(w)
        assert call(w.detach()).isfinite()
