"""Masked, scaled and causal softmax against the float64 reference (torch's masked_fill / add, then
softmax, with the library's conventions): every broadcast pattern, bool and additive masks, causal with
Sq == Sk and Sq != Sk, scale, fully masked rows, every dtype, each Triton path forced and identified,
outputs poisoned; gradients; the errors before launch. Triton in the interpreter on CPU, compiled with
--device cuda."""

import pytest
import torch
from helpers import DTYPES

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core import masking
from fastsoftmax.core.reference import TOLERANCE, softmax_torch

FNS = {False: fs.softmax, True: fs.log_softmax}
B, H, SQ, SK = 2, 3, 5, 37


def reference(x, mask, scale, causal, log, dim=-1):
    """float64: z = scale * x; where(mask, z, -inf) or z + mask; causal; then softmax with the library's
    conventions (a fully masked row gives zeros / -inf)."""
    z = x.double()
    if scale is not None:
        z = z * scale
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask.double()
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        z = z.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril(sk - sq), float("-inf"))
    return softmax_torch(z, dim, log, torch.float64, torch.float64)[0]


def check(y, ref, dtype):
    """Infinities and zeros exactly where the reference has them; finite values within the dtype's
    tolerance (relative to the value, plus an absolute floor); no NaN anywhere."""
    assert not y.isnan().any()
    y = y.double().cpu()
    ref = ref.cpu()
    assert torch.equal(y.isinf(), ref.isinf()) and torch.equal(y[ref.isinf()], ref[ref.isinf()])
    assert (y[ref == 0] == 0).all()  # masked positions and fully masked rows: exactly 0
    fin = ref.isfinite()
    rtol, atol = TOLERANCE[dtype]
    err = (y[fin] - ref[fin]).abs()
    bound = 4 * (atol + rtol * ref[fin].abs())
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


def masks(device):
    """(name, mask) for the broadcast patterns attention uses, bool and additive."""
    g = torch.Generator().manual_seed(7)
    pad = torch.rand(B, 1, 1, SK, generator=g) > 0.3
    pad[1] = False  # batch 1 fully padded: its rows are fully masked
    add = torch.randn(SQ, SK, generator=g)
    add[0, 5:] = float("-inf")
    head = torch.rand(H, 1, SK, generator=g) > 0.5
    full = torch.randn(B, H, SQ, SK, generator=g)
    out = [
        ("none", None),
        ("pad-bool", pad),
        ("sq-sk-add", add),
        ("head-bool", head),
        ("full-add", full),
        ("pad-add", torch.where(pad, 0.0, float("-inf"))),
    ]
    return [(n, m.to(device) if m is not None else None) for n, m in out]


def logits(device, dtype, sq=SQ, sk=SK):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, sq, sk, generator=g) * 4
    x[0, 0, 0, min(3, sk - 1)] = 60.0  # an outlier
    return x.to(device, dtype)


PATHS = [("rowblock", {}), ("online", {"block_n": 16}), ("split", {"block_n": 16})]


COMBOS = {
    "mask": (None, False),  # the padding and (Sq, Sk) masks
    "mask-more": (None, False),  # the per-head, full and additive padding masks
    "scale-causal": (0.125, True),
    "causal": (None, True),
    "negative-scale": (-2.0, False),
}
# split (two launches, many programs: slow in the interpreter) takes the combinations that cover all
PATTERN_CASES = [(p, f, c) for p, f in PATHS for c in COMBOS if p != "split" or c not in ("causal", "negative-scale")]


@pytest.mark.parametrize("path,force,combo", PATTERN_CASES, ids=[f"{p}-{c}" for p, _, c in PATTERN_CASES])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_every_mask_pattern(device, path, force, combo, log):
    scale, causal = COMBOS[combo]
    x = logits(device, torch.float32)
    patterns = {"mask": masks(device)[:3], "mask-more": masks(device)[3:], "causal": masks(device)[:2]}
    patterns = patterns.get(combo, masks(device))
    for name, mask in patterns:
        if mask is None and scale is None and not causal:
            continue
        with heuristics.force(path=path, poison=True, **force):
            y = FNS[log](x, mask=mask, scale=scale, causal=causal, backend="triton")
        assert heuristics.last_plan().path == path, name
        check(y, reference(x, mask, scale, causal, log), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sq,sk", [(5, 37), (37, 5), (1, 64), (64, 1)], ids=["sq<sk", "sq>sk", "1-query", "1-key"])
def test_causal_shapes_and_dtypes(device, dtype, sq, sk):
    """Bottom-right alignment: with Sq > Sk the first Sq - Sk query rows see no key and are fully masked
    (zeros); with Sq < Sk every query sees Sk - Sq + q + 1 keys."""
    x = logits(device, dtype, sq, sk)
    for log in (False, True):
        with heuristics.force(poison=True):
            y = FNS[log](x, causal=True, backend="triton")
        ref = reference(x, None, None, True, log)
        check(y, ref, dtype)
        if not log and sq > sk:
            assert (y[..., : sq - sk, :] == 0).all()


def test_fully_masked_rows_are_zero_not_nan(device):
    x = logits(device, torch.bfloat16)
    mask = torch.zeros(B, 1, 1, SK, dtype=torch.bool, device=device)
    mask[0, ..., :4] = True
    for backend in ("triton", "torch"):
        y = fs.softmax(x, mask=mask, backend=backend)
        assert (y[1] == 0).all() and not y.isnan().any()
        lp = fs.log_softmax(x, mask=mask, backend=backend)
        assert (lp[1] == float("-inf")).all() and (lp[0, ..., 4:] == float("-inf")).all()
        torch.testing.assert_close(y[0].float().sum(-1), torch.ones(H, SQ, device=device), atol=1e-2, rtol=0)


def test_masked_positions_ignore_nan_in_x(device):
    """A bool mask replaces the logit (as masked_fill does): NaN or +inf under the mask does not reach the row."""
    x = logits(device, torch.float32)
    x[..., 0] = float("nan")
    x[..., 1] = float("inf")
    mask = torch.ones(SK, dtype=torch.bool, device=device)
    mask[:2] = False
    y = fs.softmax(x, mask=mask, backend="triton")
    check(y, reference(x, mask, None, False, False), torch.float32)
    assert (y[..., :2] == 0).all()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_other_dims(device, dim):
    """A mask with the softmax along another dim: the dim is moved last as a view (the output too)."""
    x = logits(device, torch.float32)
    mask = masks(device)[3][1]  # (H, 1, SK) bool
    y = fs.softmax(x, dim, mask=mask, scale=0.5, backend="triton")
    ref = reference(x.movedim(dim, -1), mask.expand(x.shape).movedim(dim, -1), 0.5, False, False).movedim(-1, dim)
    check(y, ref, torch.float32)


def test_non_contiguous_x_and_mask(device):
    x = logits(device, torch.float32, SQ, 2 * SK)[..., ::2]  # strided rows and columns
    xt = logits(device, torch.float32).transpose(1, 2)  # rows out of logical order: copied once
    mask = (torch.rand(SK, B * 2, device=device) > 0.4).t()[::2]  # (B, SK), a transposed, strided view
    mask = mask[:, None, None, :]
    for xx in (x, xt):
        y = fs.softmax(xx, mask=mask, causal=True, backend="triton")
        check(y, reference(xx, mask, None, True, False), torch.float32)


def test_torch_backend_and_auto_agree(device):
    x = logits(device, torch.float32)
    for _, mask in masks(device):
        y_t = fs.softmax(x, mask=mask, scale=0.3, causal=True, backend="torch")
        y_a = fs.softmax(x, mask=mask, scale=0.3, causal=True)
        ref = reference(x, mask, 0.3, True, False)
        check(y_t, ref, torch.float32)
        check(y_a, ref, torch.float32)


def test_mask_is_read_in_place():
    """The spec the kernels get addresses the caller's mask through broadcast strides: no copy, no expand."""
    x = torch.empty(B, H, SQ, SK)
    pad = torch.ones(B, 1, 1, SK, dtype=torch.bool)
    spec = masking.spec(x, pad, None, False)
    assert spec.mask.data_ptr() == pad.data_ptr() and spec.mask.untyped_storage().nbytes() == pad.numel()
    assert spec.strides == (0, 0, SK, 0) and spec.dims == (1, B, H * SQ) and spec.col_stride == 1
    sq = torch.ones(SQ, SK)
    spec = masking.spec(x, sq, 2.0, True)
    assert spec.kind == 2 and spec.scale == 2.0 and spec.dims[-1] == SQ and spec.strides[-1] == SK
    assert spec.causal_offset == SK - SQ
    assert masking.spec(x, None, None, False) is masking.NONE


def test_gradients(device):
    """Autograd against float64 torch autograd of the same composite; zero at removed positions and on fully
    masked rows; scale applied; no gradient for the mask."""
    for name, mask in masks(device):
        for log in (False, True):
            x = logits(device, torch.float32).requires_grad_()
            y = FNS[log](x, mask=mask, scale=0.25, causal=True)
            dy = torch.randn_like(y)
            (dx,) = torch.autograd.grad(y, x, dy)
            x64 = x.detach().double().requires_grad_()
            ref = reference(x64, mask, 0.25, True, log)
            (dx_ref,) = torch.autograd.grad(ref, x64, dy.double())
            removed = masking.removed(x, mask, True).expand(x.shape)  # masked positions: gradient 0
            assert (dx.masked_select(removed) == 0).all(), name
            dx_ref = dx_ref.masked_fill(removed, 0)
            fin = dx_ref.isfinite()
            assert torch.equal(fin, dx.isfinite()), name
            torch.testing.assert_close(dx.double()[fin], dx_ref[fin], atol=1e-5, rtol=1e-4)


def test_gradcheck_float64():
    """Numerical against analytical gradients. log_softmax only where its outputs stay finite: at -inf
    outputs the numerical derivative is -inf - -inf (test_gradients checks those positions)."""
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    pad = torch.rand(2, 1, 1, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    add = torch.randn(4, 6, dtype=torch.float64)
    for mask in (pad, add, None):
        assert torch.autograd.gradcheck(lambda t, m=mask: fs.softmax(t, mask=m, scale=0.7, causal=True), (x,))
    assert torch.autograd.gradcheck(lambda t: fs.log_softmax(t, mask=add, scale=-1.5), (x,))


def test_module_takes_a_mask(device):
    x = logits(device, torch.float32)
    pad = masks(device)[1][1]
    m = fs.Softmax(scale=0.5, causal=True)
    assert "scale=0.5" in repr(m) and "causal=True" in repr(m)
    check(m(x, pad), reference(x, pad, 0.5, True, False), torch.float32)
    check(fs.LogSoftmax()(x, pad), reference(x, pad, None, False, True), torch.float32)


def test_errors_before_launch():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"\(2, 7\).*\(2, 3, 4, 5\)"):
        fs.softmax(x, mask=torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="broadcast"):
        fs.softmax(x, mask=torch.ones(2, 3, 4, 5, 1, dtype=torch.bool))  # broadcasts, but not to x's shape
    with pytest.raises(TypeError, match="bool .* or floating"):
        fs.softmax(x, mask=torch.ones(5, dtype=torch.int64))
    with pytest.raises(TypeError, match="bool .* or floating"):
        fs.softmax(x, mask=torch.ones(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mask is on meta"):
        fs.softmax(x, mask=torch.ones(5, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="dim must be -1"):
        fs.softmax(x, 1, causal=True)
    with pytest.raises(ValueError, match="at least 2 dims"):
        fs.softmax(torch.randn(5), causal=True)
    with pytest.raises(TypeError, match="scale must be a Python float"):
        fs.softmax(x, scale=torch.tensor(2.0))
    for bad in (float("nan"), float("inf"), -float("inf"), 10**400):  # (every output NaN, or past a float)
        with pytest.raises(ValueError, match="scale must be finite"):
            fs.log_softmax(x, scale=bad)
    with pytest.raises(TypeError, match="causal must be a bool"):
        fs.softmax(x, causal=1)


def test_custom_ops_check_masks_before_launch():
    """The custom ops called directly (torch.ops.fastsoftmax.*, as torch.compile or a user may) check the
    mask, scale and causal as the public functions do: an integer mask is not added as logits, causal on
    another dim is refused."""
    ops = torch.ops.fastsoftmax
    x, y = torch.randn(3, 4), torch.softmax(torch.randn(3, 4), -1)
    bad = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    with pytest.raises(TypeError, match="bool .* or floating"):
        ops.softmax_masked(x, -1, False, None, "auto", bad, None, False)
    with pytest.raises(ValueError, match="dim must be -1"):
        ops.softmax_masked(x, 0, False, None, "auto", None, None, True)
    with pytest.raises(TypeError, match="bool .* or floating"):
        ops.softmax_backward_masked(y, y, -1, False, None, "auto", bad, None, False)
    with pytest.raises(ValueError, match=r"\(2, 7\)"):
        ops.softmax_backward_masked(y, y, -1, False, None, "auto", torch.ones(2, 7, dtype=torch.bool), None, False)


def test_compile_fullgraph_masked():
    pad = torch.rand(2, 1, 1, 8) > 0.3

    def f(t):
        return fs.softmax(t * 2, mask=pad, scale=0.5, causal=True).sum()

    x = torch.randn(2, 3, 4, 8, requires_grad=True)
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(out, f(x))


@pytest.mark.parametrize("half", [0, 1], ids=["masks01", "masks23"])
@pytest.mark.parametrize("path,force", PATHS, ids=[p for p, _ in PATHS])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_backward_paths_fused(device, path, force, log, half):
    """The masked backward on each Triton path (scale applied and masked positions zeroed in the same pass
    that writes dx), forced and identified, against the torch path, outputs poisoned."""
    x = logits(device, torch.float32)
    f, fb = FNS[log], {False: fs.softmax_backward, True: fs.log_softmax_backward}[log]
    for name, mask in masks(device)[2 * half : 2 * half + 2]:
        for scale, causal in ((None, True), (-0.5, False)):
            y = f(x, mask=mask, scale=scale, causal=causal, backend="torch")
            dy = torch.randn_like(y)
            ref = fb(dy, y, mask=mask, scale=scale, causal=causal, backend="torch")
            with heuristics.force(path=path, poison=True, **force):
                dx = fb(dy, y, mask=mask, scale=scale, causal=causal, backend="triton")
            assert heuristics.last_plan().path == path, name
            assert torch.equal(dx.isnan(), ref.isnan()) and not dx.isnan().any(), name
            torch.testing.assert_close(dx, ref, atol=1e-5, rtol=1e-4)
            removed = masking.removed(x, mask, causal)
            if removed is not None:
                assert (dx.masked_select(removed.expand(x.shape)) == 0).all(), name


def test_mask_over_more_than_four_row_dims(device):
    """A mask whose broadcast row dims do not merge into four: 'auto' runs torch ops (and says so in the
    plan), an explicitly named kernel backend raises before any launch."""
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 3, 2, 3, 2, 7, generator=g) * 3).to(device)
    mask = (torch.rand(2, 1, 2, 1, 2, 7, generator=g) > 0.3).to(device)  # five row dims alternate 0 strides
    assert masking.spec(x, mask, None, False) is None
    y = fs.softmax(x, mask=mask)
    assert heuristics.last_plan().backend == "torch"
    check(y, reference(x, mask, None, False, False), torch.float32)
    with pytest.raises(RuntimeError, match="at most 4 row dims"):
        fs.softmax(x, mask=mask, backend="triton")
    y_torch = fs.softmax(x, mask=mask, backend="torch")  # torch ops take any mask (the error named them)
    assert heuristics.last_plan().backend == "torch"
    torch.testing.assert_close(y_torch, y)
    dy = torch.randn_like(y)
    dx = fs.softmax_backward(dy, y, mask=mask, backend="torch")
    torch.testing.assert_close(dx, fs.softmax_backward(dy, y, mask=mask))
