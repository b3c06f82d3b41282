"""fs.cross_entropy's options (class_weight, softcap, z_loss, return_z_loss) against a float64 reference:
every reduction, both backends (the Triton kernels: interpreter on CPU, compiled with --device cuda; the torch
path), every dtype, values and gradients, ignored rows, (B, T, V) logits, narrow and strided targets,
gradcheck and double backward, torch.compile, torch.func, poisoned outputs; errors before launch."""

import pytest
import torch
from helpers import ref_loss

import fastsoftmax as fs
from fastsoftmax import heuristics

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-3), torch.float16: (4e-3, 1e-4)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REDUCTIONS = ("none", "mean", "sum")
CAP, ZL, EPS = 15.0, 0.01, 0.1


# ---- the float64 reference -----------------------------------------------------------------------------


def hand_loss(logits, target, ignore_index, reduction, eps, class_weight, softcap, z_loss):
    """The same loss from explicit float64 formulas (no F.cross_entropy, no logsumexp): checks ref_loss."""
    v = logits.shape[-1]
    x = logits.double().reshape(-1, v)
    t = target.reshape(-1).long()
    z = softcap * torch.tanh(x / softcap) if softcap is not None else x
    w = class_weight.double() if class_weight is not None else torch.ones(v, dtype=torch.float64, device=x.device)
    m = z.max(-1, keepdim=True).values
    lse = m[:, 0] + torch.exp(z - m).sum(-1).log()
    logp = z - lse[:, None]
    keep = t != ignore_index
    safe = torch.where(keep, t, 0)
    wt = w[safe] * keep
    nll = -logp.gather(1, safe[:, None])[:, 0]
    smooth = -(logp * w).sum(-1) / v
    ce_row = (1 - eps) * wt * nll + eps * keep * smooth
    z_row = z_loss * lse * lse * keep
    if reduction == "mean":
        return ce_row.sum() / wt.sum() + z_row.sum() / keep.sum(), z_row.sum() / keep.sum()
    if reduction == "sum":
        return ce_row.sum() + z_row.sum(), z_row.sum()
    return (ce_row + z_row).reshape(target.shape), z_row.reshape(target.shape)


def ref_of(x, t, reduction, o, ignore_index=-100):
    return ref_loss(x, t, ignore_index, reduction, o["label_smoothing"], o["class_weight"], o["softcap"], o["z_loss"])


# ---- data ----------------------------------------------------------------------------------------------


def data(device, dtype, shape, v, seed=0, spread=False):
    """Logits (*shape, v) of scale 3 with an outlier (40; x20 with ``spread``, where 5% of the elements are
    also x20 so that tanh saturates past the softcap) and targets with every 4th row ignored; the first
    target is class 0 (weight 0 in weights()), the third class 1 (weight > 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, v, generator=g) * 3
    flat = x.view(-1, v)
    flat[0, 1] = 40.0
    if spread:
        flat[torch.rand(flat.shape, generator=g) < 0.05] *= 20
        flat[0, 1] *= 20
    t = torch.randint(0, v, shape, generator=g)
    tf = t.view(-1)
    tf[0] = 0
    if tf.numel() > 2:
        tf[2] = 1
    tf[1::4] = -100
    return x.to(device, dtype), t.to(device)


def weights(v, device, seed=1, dtype=torch.float32):
    """Random positive class weights, every third (class 0 included) 0."""
    w = torch.rand(v, generator=torch.Generator().manual_seed(seed)) + 0.2
    w[::3] = 0
    return w.to(device, dtype)


def options(case, v, device):
    o = {"label_smoothing": 0.0, "class_weight": None, "softcap": None, "z_loss": 0.0}
    if case in ("class_weight", "all"):
        o["class_weight"] = weights(v, device)
    if case in ("softcap", "all"):
        o["softcap"] = CAP
    if case in ("z_loss", "all"):
        o["z_loss"] = ZL
    if case == "all":
        o["label_smoothing"] = EPS
    return o


def upstream(shape, dtype, device, seed=2):
    """A random upstream gradient in dtype (and the same values for the float64 reference)."""
    g = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) + 0.5).to(device, dtype)
    return g, g.double()


def ignored(t, ignore_index=-100):
    return t.reshape(-1) == ignore_index


# ---- the reference itself ------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", ["plain", "class_weight", "softcap", "z_loss", "all"])
def test_reference_matches_hand_formula(device, case, reduction):
    """ref_loss (through F.cross_entropy) equals the explicit formulas, values and gradients; and every option
    moves the loss on this data, so a kernel that drops one cannot match the reference."""
    x, t = data(device, torch.float64, (3, 5), 513, spread=case in ("softcap", "all"))
    opts = options(case, 513, device)
    # smoothing factors exact in float32: torch's F.cross_entropy rounds label_smoothing to float32
    for eps in (0.125,) if case == "all" else (0.0, 0.25):
        o = {**opts, "label_smoothing": eps}
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        loss, z = ref_of(xa, t, reduction, o)
        hand, hz = hand_loss(xb, t, -100, reduction, o["label_smoothing"], o["class_weight"], o["softcap"], o["z_loss"])
        assert loss.dtype == torch.float64 and loss.shape == hand.shape
        torch.testing.assert_close(loss, hand, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(z, hz, rtol=1e-12, atol=1e-12)
        _, g = upstream(loss.shape, torch.float64, device)
        (da,) = torch.autograd.grad(loss, xa, g)
        (db,) = torch.autograd.grad(hand, xb, g)
        torch.testing.assert_close(da, db, rtol=1e-10, atol=1e-12)
        assert (da.reshape(-1, 513)[ignored(t)] == 0).all()
        if reduction == "none":
            assert (loss.reshape(-1)[ignored(t)] == 0).all() and (z.reshape(-1)[ignored(t)] == 0).all()
    if case != "plain":
        base, _ = ref_of(x, t, reduction, options("plain", 513, device))
        loss, z = ref_of(x, t, reduction, opts)
        assert ((loss - base).abs() > 1e-3 * base.abs() + 1e-3).any()
        assert (z.abs().sum() > 0) == (opts["z_loss"] > 0)


# ---- values and gradients ------------------------------------------------------------------------------

CASES = [(c, v) for c in ("class_weight", "softcap", "z_loss", "all") for v in (7, 513)] + [("all", 5003)]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("case,v", CASES, ids=[f"{c}-{v}" for c, v in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_options_match_reference(device, backend, case, v, dtype):
    """Each option alone and all together (with label smoothing), every reduction: loss (dtype, shape,
    value) and dlogits for a random upstream gradient against the float64 reference; ignored rows' dlogits
    exactly 0; the plan of the forward and of the backward is the backend asked."""
    opts = options(case, v, device)
    x, t = data(device, dtype, (3, 5) if v < 5003 else (3, 4), v, spread=opts["softcap"] is not None)
    rtol, atol = TOL[dtype]
    for reduction in REDUCTIONS:
        xg = x.clone().requires_grad_()
        loss = fs.cross_entropy(xg, t, reduction=reduction, backend=backend, **opts)
        assert heuristics.last_plan().backend == backend and heuristics.last_plan().path == "cross_entropy"
        x64 = x.double().requires_grad_()
        ref, _ = ref_of(x64, t, reduction, opts)
        assert isinstance(loss, torch.Tensor) and loss.dtype == dtype and loss.shape == ref.shape
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10, msg=reduction)
        g, g64 = upstream(ref.shape, dtype, device)
        (dx,) = torch.autograd.grad(loss, xg, g)
        (dref,) = torch.autograd.grad(ref, x64, g64)
        assert heuristics.last_plan().backend == backend  # the backward ran there too
        assert dx.dtype == dtype and dx.shape == x.shape
        assert (dx.reshape(-1, v)[ignored(t)] == 0).all(), reduction
        torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol, msg=reduction)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_large_odd_vocab(device, backend):
    """V = 50257 (GPT-2's), 3 rows (a class of weight 0, an ignored row, the last class but one), every
    option: loss and dlogits."""
    v = 50257
    opts = options("all", v, device)
    x, t = data(device, torch.float32, (3,), v, spread=True)
    t[2] = v - 2
    for reduction in ("mean", "none"):
        xg = x.clone().requires_grad_()
        loss = fs.cross_entropy(xg, t, reduction=reduction, backend=backend, **opts)
        assert heuristics.last_plan().backend == backend
        x64 = x.double().requires_grad_()
        ref, _ = ref_of(x64, t, reduction, opts)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        g, g64 = upstream(ref.shape, torch.float32, device)
        (dx,) = torch.autograd.grad(loss, xg, g)
        (dref,) = torch.autograd.grad(ref, x64, g64)
        torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logits_3d(device, backend, dtype):
    """(B, T, V) logits with (B, T) targets, every option: "none" gives (B, T); values and dlogits."""
    v = 513
    opts = options("all", v, device)
    x, t = data(device, dtype, (2, 5), v, spread=True)
    rtol, atol = TOL[dtype]
    for reduction in REDUCTIONS:
        xg = x.clone().requires_grad_()
        loss, z = fs.cross_entropy(xg, t, reduction=reduction, backend=backend, return_z_loss=True, **opts)
        x64 = x.double().requires_grad_()
        ref, zref = ref_of(x64, t, reduction, opts)
        assert loss.shape == z.shape == (t.shape if reduction == "none" else ())
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
        torch.testing.assert_close(z.double(), zref.detach(), rtol=rtol, atol=atol * 10)
        g, g64 = upstream(ref.shape, dtype, device)
        (dx,) = torch.autograd.grad(loss, xg, g)
        (dref,) = torch.autograd.grad(ref, x64, g64)
        assert dx.shape == x.shape and (dx.reshape(-1, v)[ignored(t)] == 0).all()
        torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_class_weight_target_dtypes_and_strides(device, backend):
    """Class weights with uint8 targets (class 156, weight 0, is a class: -100 does not wrap to it), int32
    targets (with ignore_index -100 and with ignore_index a class), and strided (B, 2T)[:, ::2] targets of
    int64 and int32 for (B, T, V) logits, those with class weights at stride 2: loss and dlogits."""
    g = torch.Generator().manual_seed(7)
    x200, _ = data(device, torch.float32, (4,), 200, seed=3)
    x513, t513 = data(device, torch.float32, (6,), 513, seed=4)
    x3d, _ = data(device, torch.float32, (3, 4), 513, seed=5, spread=True)
    wide = torch.randint(0, 513, (3, 8), generator=g)
    wide[0, 2] = -100
    wide[1, 0] = 0
    wide = wide.to(device)
    cases = {
        "uint8": (x200, torch.tensor([156, 0, 199, 3], dtype=torch.uint8, device=device), -100),
        "int32": (x513, t513.to(torch.int32), -100),
        "int32-ignore-a-class": (x513, torch.where(t513 == -100, 3, t513).to(torch.int32), 3),
        "int64-strided": (x3d, wide[:, ::2], -100),
        "int32-strided": (x3d, wide.to(torch.int32)[:, ::2], -100),
    }
    for name, (x, t, ii) in cases.items():
        v = x.shape[-1]
        opts = {**options("all", v, device), "softcap": CAP if name.endswith("strided") else None}
        if name.endswith("strided"):  # targets and class weights (NaN between them) not contiguous
            opts["class_weight"] = torch.stack([w := opts["class_weight"], w.new_full((v,), float("nan"))], 1)[:, 0]
            assert not t.is_contiguous() and not opts["class_weight"].is_contiguous()
        for reduction in ("mean", "none"):
            xg = x.clone().requires_grad_()
            loss = fs.cross_entropy(xg, t, ignore_index=ii, reduction=reduction, backend=backend, **opts)
            x64 = x.double().requires_grad_()
            ref, _ = ref_of(x64, t.contiguous(), reduction, opts, ignore_index=ii)
            torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5, msg=name)
            if reduction == "none":
                assert ((loss.reshape(-1) == 0) == ignored(t.long(), ii)).all(), name
            gr, g64 = upstream(ref.shape, torch.float32, device)
            (dx,) = torch.autograd.grad(loss, xg, gr)
            (dref,) = torch.autograd.grad(ref, x64, g64)
            torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("wdtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_class_weight_dtypes(device, backend, wdtype):
    """class_weight of any floating dtype (the spec asks a floating tensor): its values are the weights."""
    v = 513
    x, t = data(device, torch.float32, (3, 5), v)
    opts = {**options("all", v, device), "class_weight": weights(v, device, dtype=wdtype)}
    loss = fs.cross_entropy(x, t, backend=backend, **opts)
    ref, _ = ref_of(x, t, "mean", opts)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)


# ---- return_z_loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_return_z_loss(device, backend, dtype):
    """return_z_loss=True: (loss, z_term); z_term equals the reference's z term, reduced as the loss; the loss
    includes it (loss - z_term = the loss with z_loss=0); z_term carries no gradient while the loss's
    gradient includes the z-loss's. return_z_loss=False (and the default) returns the loss tensor alone."""
    v = 513
    opts = options("all", v, device)
    x, t = data(device, dtype, (3, 5), v, spread=True)
    rtol, atol = TOL[dtype]
    for reduction in REDUCTIONS:
        xg = x.clone().requires_grad_()
        out = fs.cross_entropy(xg, t, reduction=reduction, backend=backend, return_z_loss=True, **opts)
        assert heuristics.last_plan().backend == backend
        assert isinstance(out, tuple) and len(out) == 2
        loss, z = out
        x64 = x.double().requires_grad_()
        ref, zref = ref_of(x64, t, reduction, opts)
        assert loss.shape == z.shape == ref.shape and loss.dtype == dtype
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
        torch.testing.assert_close(z.double(), zref.detach(), rtol=rtol, atol=atol * 10)
        assert z.grad_fn is None and not z.requires_grad and loss.requires_grad
        if reduction == "none":
            assert (z.reshape(-1)[ignored(t)] == 0).all()
        base, _ = ref_of(x, t, reduction, {**opts, "z_loss": 0.0})
        torch.testing.assert_close((loss.double() - z.double()), base, rtol=rtol, atol=atol * 20)
        g, g64 = upstream(ref.shape, dtype, device)
        (dx,) = torch.autograd.grad(loss, xg, g)
        (dref,) = torch.autograd.grad(ref, x64, g64)
        torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)
        for kw in ({"return_z_loss": False}, {}):
            alone = fs.cross_entropy(x, t, reduction=reduction, backend=backend, **kw, **opts)
            assert isinstance(alone, torch.Tensor) and not isinstance(alone, tuple)
            torch.testing.assert_close(alone.double(), ref.detach(), rtol=rtol, atol=atol * 10)
    # z_loss=0: the z term is zero, the loss that of the options without it
    loss, z = fs.cross_entropy(x, t, backend=backend, return_z_loss=True, **{**opts, "z_loss": 0.0})
    ref, zref = ref_of(x, t, "mean", {**opts, "z_loss": 0.0})
    assert zref == 0 and z == 0
    torch.testing.assert_close(loss.double(), ref, rtol=rtol, atol=atol * 10)


# ---- all ignored, zero weight sum ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_ignored_and_zero_weight_sum(device, backend):
    """Every row ignored: "mean" is NaN (torch's 0/0), z term too; "sum" 0; "none" zeros; dlogits of "sum"
    zeros. With class weights whose sum over the targets is 0 (rows kept): "mean" is NaN as torch's
    weighted mean; the z term (divided by the number of rows) stays finite."""
    v = 9
    x, t = data(device, torch.float32, (4,), v)
    t[:] = -100
    for case in ("class_weight", "all"):
        opts = options(case, v, device)
        loss, z = fs.cross_entropy(x, t, backend=backend, return_z_loss=True, **opts)
        ref, zref = ref_of(x, t, "mean", opts)
        assert ref.isnan() and loss.isnan(), case
        assert zref.isnan() == z.isnan() and (opts["z_loss"] == 0 or z.isnan()), case
        xg = x.clone().requires_grad_()
        loss, z = fs.cross_entropy(xg, t, reduction="sum", backend=backend, return_z_loss=True, **opts)
        assert loss == 0 and z == 0, case
        (dx,) = torch.autograd.grad(loss, xg)
        assert (dx == 0).all(), case
        loss = fs.cross_entropy(x, t, reduction="none", backend=backend, **opts)
        assert loss.shape == (4,) and (loss == 0).all(), case
    t = torch.tensor([0, 3, -100, 6], device=device)  # classes of weight 0
    # the weighted CE mean is 0/0: NaN as torch's, with smoothing too (a regression test: the smoothing term
    # over a zero weight sum gave inf, where torch adds it to its nll part's NaN)
    for smoothing in (0.0, 0.1):
        opts = {**options("all", v, device), "label_smoothing": smoothing}
        loss, z = fs.cross_entropy(x, t, backend=backend, return_z_loss=True, **opts)
        ref, zref = ref_of(x, t, "mean", opts)
        assert ref.isnan() and loss.isnan(), smoothing
        assert zref.isfinite() and zref > 0
        torch.testing.assert_close(z.double(), zref, rtol=1e-5, atol=1e-5)


# ---- autograd machinery --------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_gradcheck_and_gradgradcheck(device, backend, reduction):
    """float64 (the torch path) with softcap, z_loss, class weights and label smoothing: gradcheck and
    gradgradcheck, and the value against the reference."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 3).to(device).requires_grad_()
    t = torch.tensor([1, -100, 5, 0], device=device)
    w = (torch.rand(6, generator=g, dtype=torch.float64) + 0.2).to(device)
    w[3] = 0
    opts = {"label_smoothing": EPS, "class_weight": w, "softcap": 2.0, "z_loss": 0.1}

    def f(a):
        return fs.cross_entropy(a, t, reduction=reduction, backend=backend, **opts)

    ref, _ = ref_of(x, t, reduction, opts)
    torch.testing.assert_close(f(x), ref)
    assert torch.autograd.gradcheck(f, (x,))
    assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_double_backward_hessian_vector(device, backend):
    """create_graph=True on fp32 logits with every option: dlogits and the Hessian-vector product equal the
    reference's (softcap's second derivative and the z-loss's curvature included)."""
    v = 513
    opts = options("all", v, device)
    x, t = data(device, torch.float32, (5,), v, spread=True)
    vec = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).to(device)
    for reduction in REDUCTIONS:
        xg = x.clone().requires_grad_()
        out = fs.cross_entropy(xg, t, reduction=reduction, backend=backend, **opts)
        x64 = x.double().requires_grad_()
        ref, _ = ref_of(x64, t, reduction, opts)
        go, go64 = upstream(ref.shape, torch.float32, device)
        (gr,) = torch.autograd.grad(out, xg, go, create_graph=True)
        (gr_ref,) = torch.autograd.grad(ref, x64, go64, create_graph=True)
        (hv,) = torch.autograd.grad((gr * vec).sum(), xg)
        (hv_ref,) = torch.autograd.grad((gr_ref * vec.double()).sum(), x64)
        torch.testing.assert_close(gr.double(), gr_ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(hv.double(), hv_ref, rtol=1e-4, atol=1e-5)


def test_compile_fullgraph(device):
    """torch.compile(fullgraph=True) of a function calling fs.cross_entropy with softcap and class weights
    (and one returning the z term too): the same loss and dlogits as the reference."""
    v = 33
    x, t = data(device, torch.float32, (6,), v, spread=True)
    w = weights(v, device)
    opts = {**options("plain", v, device), "class_weight": w, "softcap": CAP}
    f = torch.compile(
        lambda a: fs.cross_entropy(a * 2, t, softcap=CAP, class_weight=w), fullgraph=True, backend="aot_eager"
    )
    xg = x.clone().requires_grad_()
    loss = f(xg)
    x64 = x.double().requires_grad_()
    ref, _ = ref_of(x64 * 2, t, "mean", opts)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    (dx,) = torch.autograd.grad(loss, xg)
    (dref,) = torch.autograd.grad(ref, x64)
    torch.testing.assert_close(dx.double(), dref, rtol=1e-5, atol=1e-6)
    opts = {**opts, "z_loss": ZL}
    fz = torch.compile(
        lambda a: fs.cross_entropy(a, t, softcap=CAP, class_weight=w, z_loss=ZL, return_z_loss=True),
        fullgraph=True,
        backend="aot_eager",
    )
    loss, z = fz(x)
    ref, zref = ref_of(x, t, "mean", opts)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(z.double(), zref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_func_grad_matches_autograd(device, reduction):
    """torch.func.grad of the loss with every option equals autograd's gradient and the reference's."""
    v = 33
    opts = options("all", v, device)
    x, t = data(device, torch.float32, (6,), v, spread=True)
    go, go64 = upstream((6,), torch.float32, device)

    def f(a):
        out = fs.cross_entropy(a, t, reduction=reduction, **opts)
        return (out * go).sum() if reduction == "none" else out

    gf = torch.func.grad(f)(x)
    xg = x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(f(xg), xg)
    x64 = x.double().requires_grad_()
    ref, _ = ref_of(x64, t, reduction, opts)
    (dref,) = torch.autograd.grad((ref * go64).sum() if reduction == "none" else ref, x64)
    torch.testing.assert_close(gf, ga, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gf.double(), dref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_poisoned_outputs_are_written(device, dtype):
    """With every output NaN-filled before the Triton kernels write it: loss, z term and dlogits (ignored
    rows included) are all written, and right."""
    v = 513
    opts = options("all", v, device)
    x, t = data(device, dtype, (3, 5), v, spread=True)
    rtol, atol = TOL[dtype]
    for reduction in REDUCTIONS:
        xg = x.clone().requires_grad_()
        x64 = x.double().requires_grad_()
        ref, zref = ref_of(x64, t, reduction, opts)
        g, g64 = upstream(ref.shape, dtype, device)
        with heuristics.force(poison=True):
            loss, z = fs.cross_entropy(xg, t, reduction=reduction, backend="triton", return_z_loss=True, **opts)
            (dx,) = torch.autograd.grad(loss, xg, g)
            assert heuristics.last_plan().backend == "triton"
        assert loss.isfinite().all() and z.isfinite().all() and dx.isfinite().all(), reduction
        (dref,) = torch.autograd.grad(ref, x64, g64)
        torch.testing.assert_close(loss.double(), ref.detach(), rtol=rtol, atol=atol * 10)
        torch.testing.assert_close(z.double(), zref.detach(), rtol=rtol, atol=atol * 10)
        torch.testing.assert_close(dx.double(), dref, rtol=rtol, atol=atol)
        assert (dx.reshape(-1, v)[ignored(t)] == 0).all()


# ---- errors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "triton", "torch"])
def test_errors_before_launch(device, backend):
    """Bad options raise, naming the option, before anything runs (no plan recorded)."""
    x = torch.randn(4, 9, device=device)
    t = torch.zeros(4, dtype=torch.long, device=device)
    other = "meta" if device == "cpu" else "cpu"
    either = (TypeError, ValueError)
    bad = [
        (either, "class_weight", {"class_weight": [1.0] * 9}),
        (either, "class_weight", {"class_weight": torch.ones(8, device=device)}),
        (either, "class_weight", {"class_weight": torch.ones(1, 9, device=device)}),
        (either, "class_weight", {"class_weight": torch.ones((), device=device)}),
        (either, "class_weight", {"class_weight": torch.ones(9, dtype=torch.long, device=device)}),
        (either, "class_weight", {"class_weight": torch.ones(9, dtype=torch.bool, device=device)}),
        (either, "class_weight", {"class_weight": torch.ones(9, device=other)}),
        (ValueError, "softcap", {"softcap": 0.0}),
        (ValueError, "softcap", {"softcap": -1.0}),
        (TypeError, "softcap", {"softcap": "30"}),
        (either, "softcap", {"softcap": float("nan")}),
        (ValueError, "z_loss", {"z_loss": -0.1}),
        (either, "z_loss", {"z_loss": "0.1"}),
        (TypeError, "return_z_loss", {"return_z_loss": 1}),
        (TypeError, "return_z_loss", {"return_z_loss": "yes"}),
    ]
    for exc, word, kw in bad:
        heuristics.record(None)
        with pytest.raises(exc, match=word):
            fs.cross_entropy(x, t, backend=backend, **kw)
        assert heuristics.last_plan() is None, kw
    fs.cross_entropy(x, t, backend=backend, class_weight=torch.ones(9, device=device), softcap=1.0, z_loss=0.0)
    assert heuristics.last_plan() is not None  # the good options run
