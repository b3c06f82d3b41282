"""The LM-head loss's float64 reference and tolerance check, shared by tests/test_lce.py and
tests/test_lce_autograd.py: torch_lce (F.linear, softcap, F.cross_entropy with weight=, label_smoothing and
ignore_index, and the z-loss, in a chosen dtype), the problems, and check(): fs.linear_cross_entropy's loss
and gradients against the reference.

Tolerance: per element atol + rtol·|ref| (TOL, per dtype) plus twice the worst error torch's own computation in
that dtype makes (logits from F.linear in the inputs' dtype, the loss in fp32, autograd through both), so the
GEMM's rounding (it grows with d and with the logits' size) is measured rather than guessed."""

import math

import torch
import torch.nn.functional as F

import fastsoftmax as fs
from fastsoftmax import heuristics

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2e-2, 1e-3),
    torch.float16: (4e-3, 1e-4),
    torch.float64: (1e-10, 1e-12),
}
LOSS_ATOL = 10  # the loss's atol is TOL's times this (as tests/test_cross_entropy.py)
DESIGNS = ["lce_chunked", "lce_recompute"]


def problem(device, dtype, shape, d, v, *, bias=True, seed=0):
    """x (*shape, d) with outliers (a few entries x20: logits far above the rest), weight (V, d) with an
    outlier class, bias (V,) or None, targets (*shape) with every fourth row ignored (-100)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=g)
    rows = x.view(-1, d)
    rows[0, :3] *= 20
    rows[-1, d // 2] *= 20
    w = torch.randn(v, d, generator=g) * (2 / d**0.5)
    w[v // 2] *= 4
    b = torch.randn(v, generator=g) if bias else None
    t = torch.randint(0, v, shape, generator=g)
    t.view(-1)[1::4] = -100
    b = b.to(device, dtype) if b is not None else None
    return x.to(device, dtype), w.to(device, dtype), t.to(device), b


def class_weights(v, device, seed=3):
    return (torch.rand(v, generator=torch.Generator().manual_seed(seed)) * 1.8 + 0.2).to(device)


def torch_lce(
    x,
    w,
    t,
    b,
    compute,
    *,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    class_weight=None,
    softcap=None,
    z_loss=0.0,
):
    """(loss, z term) with torch ops: logits = F.linear in the inputs' dtype, everything after in ``compute``
    (float64 for the reference, float32 for torch's own low-precision error), returned in x's dtype."""
    z = F.linear(x, w, b).to(compute)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    v = z.shape[-1]
    zf, tf = z.reshape(-1, v), t.reshape(-1).long()
    cw = None if class_weight is None else class_weight.to(compute)
    ce = F.cross_entropy(
        zf, tf, weight=cw, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
    )
    keep = tf != ignore_index
    zrow = torch.where(keep, z_loss * torch.logsumexp(zf, -1).square(), 0.0)
    zt = {"mean": zrow.sum() / keep.sum(), "sum": zrow.sum(), "none": zrow}[reduction]
    loss = ce + zt
    if reduction == "none":
        loss, zt = loss.reshape(t.shape), zt.reshape(t.shape)
    return loss.to(x.dtype), zt.detach().to(x.dtype)


def lowp(dtype):
    """The dtype torch's own computation does the loss math in: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upstream(loss):
    """The gradient fed to backward: not 1, so a backward that ignores it fails; per row, a ramp."""
    if loss.dim() == 0:
        return torch.tensor(0.7, dtype=loss.dtype, device=loss.device)
    ramp = torch.linspace(0.5, 1.5, loss.numel(), dtype=torch.float64, device=loss.device)
    return ramp.reshape(loss.shape).to(loss.dtype)


def run(fn, x, w, b, wrt):
    """(loss, z term or None, {name: grad}) of fn(x, w, b) on fresh leaves, grads of the names in wrt."""
    leaves = {"x": x, "w": w, "b": b}
    leaves = {k: (v.detach().clone().requires_grad_(k in wrt) if v is not None else None) for k, v in leaves.items()}
    out = fn(leaves["x"], leaves["w"], leaves["b"])
    loss, zt = out if isinstance(out, tuple) else (out, None)
    names = [k for k in wrt if leaves[k] is not None]
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], upstream(loss)) if names else ()
    return loss.detach(), zt, dict(zip(names, grads, strict=True))


def assert_near(got, ref, base, what, atol_scale=1.0):
    """got against the float64 ref: |got - ref| <= atol + rtol·|ref| + 2·max|base - ref| per element (base:
    torch's own computation in got's dtype); NaN exactly where ref has NaN; got's dtype and shape = base's."""
    assert got.dtype == base.dtype and got.shape == ref.shape, f"{what}: {got.dtype} {got.shape} vs {base.dtype}"
    rtol, atol = TOL[base.dtype]
    got, ref, base = got.detach().double(), ref.detach().double(), base.detach().double()
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan), (
        f"{what}: NaN at {got.isnan().nonzero()[:3].tolist()}, reference's {nan.any()}"
    )
    if nan.all():
        return
    err = (got - ref).abs()[~nan]
    slack = 2 * (base - ref).abs()[~nan].max()
    bound = atol * atol_scale + rtol * ref.abs()[~nan] + slack
    i = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"{what}: error {err[i]:.3g} > bound {bound[i]:.3g} at reference value {ref[~nan][i]:.6g}"
    )


def check(x, w, t, b, *, wrt=("x", "w", "b"), fs_opts=None, grad_atol_scale=1.0, **opts):
    """fs.linear_cross_entropy(x, w, t, b, **opts, **fs_opts) against the float64 reference (loss, z term when
    return_z_loss, grads of wrt, their atol times grad_atol_scale); returns fs's (loss, z, grads)."""
    fs_opts = fs_opts or {}
    loss, zt, grads = run(lambda a, c, e: fs.linear_cross_entropy(a, c, t, e, **opts, **fs_opts), x, w, b, wrt)
    ref = run(lambda a, c, e: torch_lce(a, c, t, e, torch.float64, **opts), x.double(), w.double(), b_double(b), wrt)
    base = run(lambda a, c, e: torch_lce(a, c, t, e, lowp(x.dtype), **opts), x, w, b, wrt)
    assert_near(loss, ref[0], base[0], "loss", LOSS_ATOL)
    if fs_opts.get("return_z_loss"):
        assert zt is not None and zt.grad_fn is None and not zt.requires_grad, "z term carries no gradient"
        assert_near(zt, ref[1], base[1], "z term", LOSS_ATOL)
    assert grads.keys() == ref[2].keys()
    for k in grads:
        assert_near(grads[k], ref[2][k], base[2][k], f"d{k}", grad_atol_scale)
    ignored = t == opts.get("ignore_index", -100)
    if opts.get("reduction") == "none":
        assert (loss[ignored] == 0).all(), "ignored rows' loss is 0"
    if "x" in grads:
        assert (grads["x"][ignored] == 0).all(), "ignored rows' dx is 0"
    return loss, zt, grads


def b_double(b):
    return b.double() if b is not None else None


def rows_for(memory, v, dtype):
    return max(1, memory // (v * torch.empty((), dtype=dtype).element_size()))


def assert_plan(backend, design, n, rows=None):
    plan = heuristics.last_plan()
    assert plan is not None and (plan.backend, plan.path) == (backend, design), plan
    if rows is not None:
        assert plan.rows == rows, plan
    assert plan.rows >= 1 and plan.splits == math.ceil(n / plan.rows), plan  # splits = number of chunks
