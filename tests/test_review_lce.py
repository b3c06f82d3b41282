"""Regressions found in review of the loss options and fs.linear_cross_entropy (each fails before its fix)."""

import pytest
import torch
import torch.nn.functional as F

import fastsoftmax as fs


def _problem(device, n, d, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g)
    b = torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[1::4] = -100
    return x.to(device), w.to(device), b.to(device), t.to(device)


def _reference(x, w, b, t, **kw):
    """F.linear + F.cross_entropy in float64: (loss, dx, dW, db)."""
    x, w, b = (a.double().requires_grad_() for a in (x, w, b))
    cw = kw.pop("class_weight", None)
    loss = F.cross_entropy(F.linear(x, w, b), t, weight=None if cw is None else cw.double(), **kw)
    return (loss, *torch.autograd.grad(loss, (x, w, b)))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lce_triton_strided_class_weight(device, smoothing, reduction):
    """lm_head._lce hands class_weight to the Triton kernels as given; they index it with unit stride (w_ptr + t,
    w_ptr + cols), so a strided (V,) view reads the wrong classes' weights (an expanded one reads past its
    storage). fs.cross_entropy makes it contiguous (dispatch.cross_entropy); the LM-head loss does not."""
    v = 7
    x, w, b, t = _problem(device, 9, 5, v)
    cw = (torch.rand(2 * v, generator=torch.Generator().manual_seed(3)) + 0.2).to(device)[::2]
    assert not cw.is_contiguous()
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    loss = fs.linear_cross_entropy(xs, ws, t, bs, class_weight=cw, backend="triton", **kw)
    got = (loss, *torch.autograd.grad(loss, (xs, ws, bs)))
    want = _reference(x, w, b, t, class_weight=cw, **kw)
    for name, a, r in zip(("loss", "dx", "dW", "db"), got, want, strict=True):
        torch.testing.assert_close(a.double(), r.detach(), atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_lce_zero_features(device):
    """checks.linear_cross_entropy accepts d == 0 (weight (V, 0), as F.linear does: logits = bias), then
    linear_cross_entropy's x.reshape(-1, 0) raises torch's 'cannot reshape tensor of 0 elements' error."""
    x, w, b, t = _problem(device, 5, 0, 4)
    xs, ws, bs = (a.clone().requires_grad_() for a in (x, w, b))
    loss = fs.linear_cross_entropy(xs, ws, t, bs)
    got = (loss, *torch.autograd.grad(loss, (xs, ws, bs)))
    want = _reference(x, w, b, t)
    for a, r in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), r.detach(), atol=1e-5, rtol=1e-5)


def test_module_class_weight_is_a_buffer(device):
    """fs.LinearCrossEntropy kept class_weight in a plain options dict: .to() did not move it (a device
    mismatch at forward) and the state_dict missed it; it is a buffer now, as nn.CrossEntropyLoss's weight."""
    cw = torch.rand(11) + 0.5
    head = fs.LinearCrossEntropy(6, 11, bias=True, class_weight=cw).to(device, torch.float64)
    assert "class_weight" in head.state_dict() and head.class_weight.device.type == device
    assert head.class_weight.dtype == torch.float64
    x, _, _, t = _problem(device, 8, 6, 11)
    loss = head(x.double(), t)
    ref = F.cross_entropy(F.linear(x.double(), head.weight, head.bias), t, weight=head.class_weight)
    torch.testing.assert_close(loss, ref)
