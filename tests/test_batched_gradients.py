"""Batched gradients: torch.autograd.grad(..., is_grads_batched=True), what jacobian(vectorize=True) and
gradcheck's batched check run. torch batches the backward with its legacy vmap, whose gradients hold no
memory of their own and come with no torch.func transform active: every backward of the library that
would hand them to its kernels runs torch ops instead (compose.torch_backward), and the batch of
vector-Jacobian products equals torch's own, in float64."""

import pytest
import torch
import torch.nn.functional as F

import fastsoftmax as fs

N, V, D = 5, 13, 6
NAMES = ["softmax", "log_softmax dim 0", "softmax masked", "cross_entropy", "cross_entropy smoothed", "lce"]


def _case(name, device, backend):
    """(the fp32 input differentiated, fastsoftmax's call on it, torch's float64 call)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(N, V, generator=g) * 3).to(device)
    mask = (torch.rand(1, V, generator=g) > 0.3).to(device)
    t = torch.randint(0, V, (N,), generator=g).to(device)
    t[1] = -100
    h, w = torch.randn(N, D, generator=g).to(device), torch.randn(V, D, generator=g).to(device)
    b = {"backend": backend}
    if name == "softmax":
        return x, lambda a: fs.softmax(a, **b), lambda a: torch.softmax(a, -1)
    if name == "log_softmax dim 0":
        return x, lambda a: fs.log_softmax(a, 0, **b), lambda a: torch.log_softmax(a, 0)
    if name == "softmax masked":
        return x, lambda a: fs.softmax(a, mask=mask, **b), lambda a: torch.softmax(a.masked_fill(~mask, -1e300), -1)
    if name == "cross_entropy":
        return (
            x,
            lambda a: fs.cross_entropy(a, t, reduction="none", **b),
            lambda a: F.cross_entropy(a, t, reduction="none"),
        )
    if name == "cross_entropy smoothed":
        return (
            x,
            lambda a: fs.cross_entropy(a, t, label_smoothing=0.1, **b),
            lambda a: F.cross_entropy(a, t, label_smoothing=0.1),
        )
    w64 = w.double()
    return (
        h,
        lambda a: fs.linear_cross_entropy(a, w, t, reduction="none", **b),
        lambda a: F.cross_entropy(F.linear(a, w64), t, reduction="none"),
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("name", NAMES)
def test_batched_vector_jacobian_products(device, backend, name):
    """Three vectors at once: the products equal torch's float64 ones within fp32's error (the library's
    backward raised "Cannot access data pointer of Tensor that doesn't have storage")."""
    inp, ours, theirs = _case(name, device, backend)
    a = inp.clone().requires_grad_()
    y = ours(a)
    v = torch.randn(3, *y.shape, generator=torch.Generator().manual_seed(7)).to(device)
    (got,) = torch.autograd.grad(y, a, v, is_grads_batched=True)
    ref = inp.double().requires_grad_()
    (want,) = torch.autograd.grad(theirs(ref), ref, v.double(), is_grads_batched=True)
    assert got.shape == want.shape == (3, *inp.shape)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
