"""fastsoftmax.distributed's tensor-parallel API (issue 21) on 2 and 3 CPU processes with gloo (a file://
store, no network ports): cross_entropy with every option (class_weight slices, softcap, z_loss and
return_z_loss, label smoothing with and without class weights, ignore_index, every reduction) and
linear_cross_entropy with the LM head's weight split along the classes (several chunks, non-uniform upstream
gradients), values and gradients against float64 torch on the gathered problem in one process; equal,
unequal and empty shards, shards -inf on a row, fully masked rows, outliers, narrow and strided targets; the
Triton kernels in the interpreter; ranks that disagree (the same ValueError on every rank, no hang); double
backward refused; DTensor inputs (Shard on the classes) through fs.cross_entropy, fs.linear_cross_entropy and
fs.softmax."""

import contextlib
import json
import os
from unittest import mock

import helpers
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import spawn_gloo

M, V = 9, 23  # cross_entropy's rows and classes
N, D = 13, 8  # linear_cross_entropy's rows and features
CAP, ZL, EPS = 15.0, 1e-3, 0.1
IGNORED = (1, 4)  # rows of targets() that are ignore_index (row 1 is -inf everywhere in masked logits)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}
LCE_TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-11)}


# ---- the float64 reference on the gathered problem, in one process ---------------------------------------


def ref_loss(logits, target, *, label_smoothing=0.0, **options):
    """helpers.ref_loss with fs.cross_entropy's keyword for the smoothing: (loss, z-loss term) in float64."""
    return helpers.ref_loss(logits, target, eps=label_smoothing, **options)


def leaf64(t):
    """A float64 copy of t that requires grad (a new leaf: t.double() would be t itself for float64)."""
    return t.detach().to(torch.float64, copy=True).requires_grad_()


def ref_grad(loss, x64, grad, target, ignore_index):
    """d loss / d x64 for the upstream ``grad``; 0 on ignored rows (the library's rule; torch's
    log_softmax gives NaN there for a row that is -inf everywhere)."""
    (dx,) = torch.autograd.grad(loss, x64, grad.double(), retain_graph=True)
    dx = dx.reshape(-1, dx.shape[-1])
    dx[target.reshape(-1).long() == ignore_index] = 0.0
    return dx.reshape(x64.shape)


def close(got, want, dtype, what, tol=TOL):
    """got within tol[dtype] of want (NaN equal to NaN, inf to inf of the same sign). torch.isclose rather
    than torch.testing.assert_close, whose first call imports torch.distributed.tensor (seconds a process)."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    rtol, atol = tol[dtype]["rtol"], tol[dtype]["atol"]
    ok = torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not bool(ok.all()):
        i = tuple((~ok).nonzero()[0].tolist())
        err = ((got - want).abs() / (atol + rtol * want.abs())).nan_to_num(float("inf")).max().item()
        raise AssertionError(
            f"{what}: {int((~ok).sum())} of {ok.numel()} elements differ, at {i} {got[i].item()!r} vs "
            f"{want[i].item()!r}; worst |err| / (atol + rtol |want|) = {err:.3g} (rtol {rtol}, atol {atol})"
        )


def upstream(reduction, shape, dtype):
    """A non-unit upstream gradient: 0.7 for a reduced loss, one per row in [0.5, 1.5] for reduction='none'."""
    if reduction == "none":
        n = 1
        for s in shape:
            n *= s
        return torch.linspace(0.5, 1.5, n, dtype=dtype).reshape(shape)
    return torch.tensor(0.7, dtype=dtype)


# ---- data ------------------------------------------------------------------------------------------------


def ce_logits(dtype, masked=True, rows=M, seed=11):
    """(rows, V) logits of scale 4 with outliers (80, -80); ``masked``: row 1 -inf everywhere, row 2 -inf on
    classes 0-11 and row 6 on 11-22 (whole shards of the splits below)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g, dtype=torch.float64) * 4
    x[3, 5] = 80.0
    x[5, 19] = -80.0
    if masked:
        x[1] = float("-inf")
        x[2, :12] = float("-inf")
        x[6, 11:] = float("-inf")
    return x.to(dtype)


def targets(rows=M, ignore_index=-100):
    """Global class indices, rows IGNORED ignore_index; rows 2 and 6 aim at classes their masked logits keep,
    row 7 at the last class."""
    t = torch.arange(rows) * 5 % V
    for r, c in ((2, V - 1), (6, 0), (7, V - 1)) + tuple((r, ignore_index) for r in IGNORED):
        if r < rows:
            t[r] = c
    return t


def class_weights(dtype, seed=3):
    """Positive class weights, every fifth (class 0 among them) 0."""
    w = torch.rand(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.2
    w[::5] = 0.0
    return w.to(dtype)


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
    ("all", {"class_weight": True, "label_smoothing": EPS, "softcap": CAP, "z_loss": ZL, "return_z_loss": True}),
]


def split_options(opts, dtype, lo, hi):
    """(the rank's options: its class-weight slice; the reference's: the full weights)."""
    local, full = dict(opts), dict(opts)
    if opts.get("class_weight"):
        w = class_weights(dtype)
        local["class_weight"], full["class_weight"] = w[lo:hi], w
    full.pop("return_z_loss", None)
    return local, full


def masked_ok(opts):
    """-inf logits give an infinite smoothing term unless a softcap makes them finite."""
    return not opts.get("label_smoothing") or opts.get("softcap") is not None


def bounds(widths, rank):
    lo = sum(widths[:rank])
    return lo, lo + widths[rank]


# ---- the spawn ---------------------------------------------------------------------------------------------


def _same_on_every_rank(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, t) for o in out)


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
                    ref, zref = ref_loss(x64, t, reduction=reduction, **full)
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
    ref, _ = ref_loss(x64, t, label_smoothing=0.0)
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
    refn, _ = ref_loss(x64, t, reduction="none")
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
        ref3, _ = ref_loss(x364, t3, reduction=reduction, softcap=CAP, z_loss=ZL)
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


def lce_problem(dtype, rows=N, ignore_index=-100, seed=21):
    """(x (rows, D), W (V, D), b (V,), targets): logits of scale ~2, one of 80 + b[5] (row 3, class 5),
    rows 1 and 8 ignored."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7
    b = torch.randn(V, generator=g, dtype=torch.float64)
    x[3] = w[5] * (80.0 / w[5].dot(w[5]))
    t = torch.randint(0, V, (rows,), generator=g)
    t[3] = 0
    for r in (1, 8):
        if r < rows:
            t[r] = ignore_index
    return x.to(dtype), w.to(dtype), b.to(dtype), t


LCE_CASES = [
    ("plain", {}),
    ("no-bias", {}),
    ("smoothing", {"label_smoothing": EPS}),
    ("class_weight+smoothing", {"class_weight": True, "label_smoothing": EPS}),
    ("class_weight", {"class_weight": True}),
    ("softcap", {"softcap": CAP}),
    ("z_loss", {"z_loss": ZL, "return_z_loss": True}),
    ("ignore_index=4", {"ignore_index": 4}),
    ("all", {"class_weight": True, "label_smoothing": EPS, "softcap": CAP, "z_loss": ZL, "return_z_loss": True}),
]
LCE_MEMORY = 160  # bytes of logits a chunk may hold: 1-13 rows a chunk for these shards (several chunks)


def _lce_one(fsd, rank, lo, hi, dtype, opts, reduction, *, bias=True, memory=LCE_MEMORY, shape=None, wrt="xwb",
             backend="auto", tol=LCE_TOL, what="", dev="cpu"):  # fmt: skip
    """One call against F.cross_entropy(F.linear(x, W, b)) in float64: the loss (and z-loss term), dx (full,
    the same on every rank), dW and db (the rank's slices)."""
    ii = opts.get("ignore_index", -100)
    rows = N if shape is None else shape[0] * shape[1]
    x, w, b, t = lce_problem(dtype, rows=rows, ignore_index=ii)
    if shape is not None:
        x, t = x.reshape(*shape, D), t.reshape(shape)
    local, full = split_options(opts, dtype, lo, hi)
    xr = x.to(dev, copy=True).requires_grad_("x" in wrt)
    wr = w[lo:hi].to(dev, copy=True).requires_grad_("w" in wrt)
    br = b[lo:hi].to(dev, copy=True).requires_grad_("b" in wrt) if bias else None
    local = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in local.items()}
    out = fsd.linear_cross_entropy(xr, wr, t.to(dev), br, reduction=reduction, memory=memory, backend=backend, **local)
    loss, z = out if opts.get("return_z_loss") else (out, None)
    x64, w64 = leaf64(x), leaf64(w)
    b64 = leaf64(b) if bias else None
    ref, zref = ref_loss(F.linear(x64, w64, b64), t, reduction=reduction, **full)
    assert loss.dtype == dtype and loss.shape == ref.shape, (what, loss.dtype, loss.shape)
    close(loss, ref, dtype, f"{what}: loss", tol)
    if z is not None:
        close(z, zref, dtype, f"{what}: z-loss term", tol)
    ours = [p for p, k in ((xr, "x"), (wr, "w"), (br, "b")) if p is not None and k in wrt]
    refs = [p for p, k in ((x64, "x"), (w64, "w"), (b64, "b")) if p is not None and k in wrt]
    g = upstream(reduction, ref.shape, dtype)
    got = torch.autograd.grad(loss, ours, g.to(dev))
    want = torch.autograd.grad(ref, refs, g.double())
    for p, dp, dref in zip(ours, got, want, strict=True):
        name = "dx" if p is xr else "dW" if p is wr else "db"
        assert dp.shape == p.shape and dp.dtype == p.dtype, (what, name, dp.shape, dp.dtype)
        close(dp, dref if p is xr else dref[lo:hi], dtype, f"{what}: {name}", tol)
        if p is xr:
            assert _same_on_every_rank(dp), f"{what}: dx differs between ranks"


def _lce_checks(rank, world, splits):
    import fastsoftmax.distributed as fsd

    for i, widths in enumerate(splits):
        lo, hi = bounds(widths, rank)
        for dtype in (torch.float32, torch.float64):
            for k, (name, opts) in enumerate(LCE_CASES if i == 0 else [c for c in LCE_CASES if c[0] in SHORT]):
                every = name in ("plain", "all")  # every reduction; the other cases one each, in turn
                for reduction in ("none", "mean", "sum") if every else (("none", "mean", "sum")[k % 3],):
                    what = f"rank {rank} widths {widths} {dtype} {name} {reduction}"
                    _lce_one(fsd, rank, lo, hi, dtype, opts, reduction, bias=name != "no-bias", what=what)
            if i:
                continue
            # the default chunks (memory=None), (B, T, d) x, a frozen x, a frozen weight
            for reduction in ("none", "mean"):
                what = f"rank {rank} widths {widths} {dtype} {reduction}"
                _lce_one(fsd, rank, lo, hi, dtype, {}, reduction, memory=None, what=f"{what} memory=None")
                _lce_one(fsd, rank, lo, hi, dtype, {"softcap": CAP}, reduction, shape=(3, 4), what=f"{what} (B, T, d)")
            _lce_one(fsd, rank, lo, hi, dtype, {}, "sum", wrt="wb", what=f"rank {rank} {widths} {dtype} x frozen")
            _lce_one(fsd, rank, lo, hi, dtype, {}, "mean", wrt="x", what=f"rank {rank} {widths} {dtype} W frozen")
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


# ---- the Triton kernels (Triton's interpreter on CPU tensors) ----------------------------------------------


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
    """Counts every kernel launched on the GPU from now on in this (child) process through the library's one
    launcher (launch.submit, which every kernel of the full path goes through: not Triton's launch hook,
    which would send them through Triton's own launcher instead)."""
    from fastsoftmax.kernels import launch

    launches, submit = [], launch.submit

    def counted(ln, stream, values, index, what):
        launches.append(what)
        return submit(ln, stream, values, index, what)

    stack.enter_context(mock.patch.object(launch, "submit", counted))
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
    cases = [("plain", {}, "mean", True), ("all", CE_CASES[-1][1], "none", True)]
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
        ref, zref = ref_loss(xr, t, reduction=reduction, **full)
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
    for name, opts, reduction, bias in (("all", LCE_CASES[-1][1], "mean", True), ("plain", {}, "none", False)):
        n0 = len(launches)
        what = f"rank {rank} widths {widths} triton linear_cross_entropy {name} {reduction}"
        _lce_one(fsd, rank, lo, hi, f32, opts, reduction, bias=bias, memory=3 * V * 4, shape=(TM, 1), backend="triton",
                 what=what, dev=dev)  # fmt: skip
        assert len(launches) > n0 or hi == lo, f"{what}: no Triton kernel ran"


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
    the collectives; launch.submit, patched, counts the launches."""
    if device != "cuda":
        pytest.skip("needs --device cuda: the interpreter's run is test_triton_kernels_in_the_interpreter")
    spawn_gloo(tmp_path, monkeypatch, _triton_checks, len(widths), widths, "cuda")


# ---- ranks that disagree, bad targets, double backward --------------------------------------------------------


def _disagreements(rank):
    """(function, case, call) where the ranks differ: rank 1's rows, dtype or options differ from rank 0's."""
    import fastsoftmax.distributed as fsd

    x = ce_logits(torch.float32, masked=False)[:, rank * 11 : rank * 11 + 11 + rank]
    t = targets()
    kept = torch.where(t < 0, 3, t)  # (no target outside [0, V) whichever ignore_index a rank passes)
    w = class_weights(torch.float32)[rank * 11 : rank * 11 + 11 + rank]
    xl, wl, bl, tl = lce_problem(torch.float32)
    wl, bl = wl[rank * 11 : rank * 11 + 11 + rank], bl[rank * 11 : rank * 11 + 11 + rank]
    r = rank
    ce = fsd.cross_entropy
    lce = fsd.linear_cross_entropy
    return [
        ("cross_entropy", "rows", lambda: ce(x[: M - r], t[: M - r])),
        ("cross_entropy", "dtype", lambda: ce(x.double() if r else x, t)),
        ("cross_entropy", "reduction", lambda: ce(x, t, reduction="sum" if r else "mean")),
        ("cross_entropy", "label_smoothing", lambda: ce(x, t, label_smoothing=EPS * r)),
        ("cross_entropy", "softcap", lambda: ce(x, t, softcap=CAP if r else None)),
        ("cross_entropy", "z_loss", lambda: ce(x, t, z_loss=ZL * r)),
        ("cross_entropy", "ignore_index", lambda: ce(x, kept, ignore_index=7 if r else -100)),
        ("cross_entropy", "class_weight", lambda: ce(x, t, class_weight=w if r else None)),
        ("linear_cross_entropy", "rows", lambda: lce(xl[: N - r], wl, tl[: N - r], bl)),
        ("linear_cross_entropy", "dtype", lambda: lce(xl.double(), wl.double(), tl) if r else lce(xl, wl, tl)),
        ("linear_cross_entropy", "softcap", lambda: lce(xl, wl, tl, bl, softcap=CAP if r else None)),
        ("linear_cross_entropy", "label_smoothing", lambda: lce(xl, wl, tl, bl, label_smoothing=EPS * r)),
        ("linear_cross_entropy", "class_weight", lambda: lce(xl, wl, tl, bl, class_weight=w if r else None)),
        ("linear_cross_entropy", "reduction", lambda: lce(xl, wl, tl, bl, reduction="none" if r else "sum")),
        ("softmax", "dtype", lambda: fsd.softmax(x.double() if r else x)),
    ]


def _record(out_dir, rank, results):
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))


def _errors(rank, world, out_dir):
    import fastsoftmax.distributed as fsd

    results = {}
    for fn, case, call in _disagreements(rank):
        try:
            call()
            results[f"{fn} {case}"] = "returned"
        except Exception as e:  # noqa: BLE001 (recorded, compared across ranks by the test)
            results[f"{fn} {case}"] = f"{type(e).__name__}: {e}"
        _record(out_dir, rank, results)  # after each case: a hang shows where
    # a target outside [0, V) that is not ignore_index: IndexError on every rank
    lo, hi = rank * 11, rank * 11 + 11 + rank
    x = ce_logits(torch.float32, masked=False)[:, lo:hi]
    xl, wl, bl, tl = lce_problem(torch.float32)
    for case, bad in (("V", V), ("-5", -5)):
        t = targets()
        t[0] = bad
        for fn, call in (
            ("cross_entropy", lambda t=t: fsd.cross_entropy(x, t)),
            ("linear_cross_entropy", lambda t=t: fsd.linear_cross_entropy(xl[:M], wl[lo:hi], t, bl[lo:hi])),
        ):
            try:
                call()
                results[f"{fn} target {case}"] = "returned"
            except Exception as e:  # noqa: BLE001
                results[f"{fn} target {case}"] = f"{type(e).__name__}: {e}"
            _record(out_dir, rank, results)
    # different memory= on the ranks: chunks that differ may not desynchronise the collectives
    x64, w64, b64, t64 = lce_problem(torch.float64)
    try:
        got = fsd.linear_cross_entropy(x64, w64[lo:hi], t64, b64[lo:hi], memory=100 if rank else 10_000)
        ref = F.cross_entropy(F.linear(x64, w64, b64), t64)
        results["memory"] = "right" if torch.allclose(got, ref, rtol=1e-10, atol=1e-12) else f"wrong: {got} {ref}"
    except Exception as e:  # noqa: BLE001
        results["memory"] = f"{type(e).__name__}: {e}"
    _record(out_dir, rank, results)
    _double_backward(fsd, rank, lo, hi)
    results["double backward"] = "refused"
    _record(out_dir, rank, results)


def _double_backward(fsd, rank, lo, hi):
    """create_graph=True through each backward: NotImplementedError naming double backward, on every rank
    (at the first backward, or at the second)."""
    x = ce_logits(torch.float64, masked=False)[:, lo:hi]
    t = targets()
    xl, wl, bl, tl = lce_problem(torch.float64)
    calls = [
        ("cross_entropy", lambda a: fsd.cross_entropy(a, t), x),
        ("cross_entropy options", lambda a: fsd.cross_entropy(a, t, softcap=CAP, label_smoothing=EPS, z_loss=ZL), x),
        ("softmax", lambda a: (fsd.softmax(a) * torch.arange(hi - lo)).sum(), x),
        ("log_softmax", lambda a: (fsd.log_softmax(a) * torch.arange(hi - lo)).sum(), x),
        ("linear_cross_entropy x", lambda a: fsd.linear_cross_entropy(a, wl[lo:hi], tl, bl[lo:hi]), xl),
        ("linear_cross_entropy W", lambda a: fsd.linear_cross_entropy(xl, a, tl, bl[lo:hi]), wl[lo:hi]),
    ]
    for name, f, a in calls:
        a = a.clone().requires_grad_()
        try:
            (g,) = torch.autograd.grad(f(a), a, create_graph=True)
            torch.autograd.grad((g * g).sum(), a)
        except NotImplementedError as e:
            assert "double backward" in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: create_graph=True gave a second derivative")
        dist.barrier()  # (every rank past this case before the next one's collectives)


def test_disagreeing_ranks_bad_targets_double_backward(tmp_path, monkeypatch):
    """2 processes whose rows, dtypes or options differ, case by case (cross_entropy, linear_cross_entropy,
    softmax): every rank raises the same ValueError, and no case hangs; a target outside [0, V) raises
    IndexError on every rank; ranks passing different memory= agree on the right loss (or raise the same
    error); create_graph=True through any backward raises NotImplementedError (double backward)."""
    out = tmp_path / "out"
    out.mkdir()
    try:
        spawn_gloo(tmp_path, monkeypatch, _errors, 2, out)
    finally:
        got = [json.loads(p.read_text()) if p.exists() else {} for p in (out / "rank0.json", out / "rank1.json")]
        print(json.dumps(got, indent=1))  # (shown when the test fails: what each rank saw, up to a hang)
    r0, r1 = got
    assert r0.keys() == r1.keys(), (r0, r1)
    for case in r0:
        assert r0[case] == r1[case], f"{case}: rank 0 {r0[case]!r}, rank 1 {r1[case]!r}"
        fn = case.split()[0]
        if " target " in case:
            assert r0[case].startswith("IndexError: "), (case, r0[case])
        elif case == "memory":
            assert r0[case] == "right" or r0[case].startswith("ValueError: distributed."), r0[case]
        elif case != "double backward":
            prefix = f"ValueError: distributed.{fn}: the ranks must pass shards of the same rows and dtype"
            assert r0[case].startswith(prefix), (case, r0[case])
    assert r0.get("double backward") == "refused", r0


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
    with pytest.raises(ValueError, match="bias"):
        fsd.linear_cross_entropy(xl, w, t, torch.randn(4))
    with pytest.raises(ValueError, match="backend"):
        fsd.softmax(x, backend="bogus")


# ---- DTensor ---------------------------------------------------------------------------------------------


def _dtensor_checks(rank, world):
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
            ref, _ = ref_loss(x64, t, reduction=reduction, **opts)
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
        ref, _ = ref_loss(x364, t.reshape(3, 3), z_loss=ZL)
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
            close(loss.full_tensor(), ref, dtype, f"{what}: loss", LCE_TOL)
            loss.backward()
            dx = xin.grad.full_tensor() if isinstance(xin.grad, DTensor) else xin.grad
            close(dx, want[0], dtype, f"{what}: dx", LCE_TOL)
            for name, p, dref in (("dW", wd, want[1]), ("db", bd, want[-1])):
                if p is not None:
                    assert isinstance(p.grad, DTensor), (what, name, type(p.grad))
                    close(p.grad.full_tensor(), dref, dtype, f"{what}: {name}", LCE_TOL)
    # a 2-D mesh: the classes sharded on one mesh dim, replicated on the other (each order)
    x = ce_logits(torch.float32, masked=False)
    t = targets()
    for shape, placements in (((1, world), [Replicate(), Shard(1)]), ((world, 1), [Shard(1), Replicate()])):
        what = f"rank {rank} DTensor on a {shape} mesh, {placements}"
        mesh2 = init_device_mesh("cpu", shape)
        x64 = leaf64(x)
        ref, _ = ref_loss(x64, t, label_smoothing=EPS)
        dt = distribute_tensor(x.clone(), mesh2, placements).requires_grad_()
        loss = fs.cross_entropy(dt, t, label_smoothing=EPS)
        assert all(isinstance(p, Replicate) for p in loss.placements), (what, loss.placements)
        close(loss.full_tensor(), ref, torch.float32, f"{what}: loss")
        loss.backward()
        close(dt.grad.full_tensor(), ref_grad(ref, x64, torch.tensor(1.0), t, -100), torch.float32, f"{what}: grad")
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


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_inputs(tmp_path, monkeypatch, world):
    """DTensors on a 1-D CPU DeviceMesh over gloo, the 23 classes sharded unevenly by torch (12/11, 8/8/7):
    fs.cross_entropy returns a Replicate DTensor equal to float64 torch on the full logits, and gives the
    logits DTensor the full gradient; fs.linear_cross_entropy with W Shard(0) (x plain or replicated);
    fs.softmax / fs.log_softmax return Shard(1) DTensors; rows sharded or replicated logits raise
    NotImplementedError."""
    spawn_gloo(tmp_path, monkeypatch, _dtensor_checks, world)


# ---- one rank in-process -------------------------------------------------------------------------------------


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
