"""torch.func transforms and forward-mode AD inside torch.compile: the values eager gives (route() asks for a
transform before it asks for torch.compile; the custom ops have no forward-mode rule, and torch gave their
tangents as zeros, silently). The losses' torch.func path compiles with fullgraph=True."""

import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.nn.functional as F
from torch.func import grad, hessian, jvp

import fastsoftmax as fs

T = torch.tensor([1, 2, 3])
CASES = {
    "softmax": (lambda a: fs.softmax(a, -1), lambda a: torch.softmax(a, -1)),
    "log_softmax dim 0": (lambda a: fs.log_softmax(a, 0), lambda a: torch.log_softmax(a, 0)),
    "masked": (lambda a: fs.softmax(a, -1, scale=0.5), lambda a: torch.softmax(a * 0.5, -1)),
    "cross_entropy": (lambda a: fs.cross_entropy(a, T), lambda a: F.cross_entropy(a, T)),
    "linear_cross_entropy": (lambda a: fs.linear_cross_entropy(a, torch.eye(4), T), lambda a: F.cross_entropy(a, T)),
}


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64) * 3
    x[1, 2] = 40.0  # (an outlier)
    return x.float(), torch.randn(3, 4, generator=g)


def _dual(f):
    def run(a, b):
        with fwad.dual_level():
            return fwad.unpack_dual(f(fwad.make_dual(a, b))).tangent

    return run


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["jvp", "dual"])
def test_forward_mode_under_compile(case, how):
    ours, ref = CASES[case]
    x, tx = _inputs()
    want = jvp(lambda a: ref(a.double()), (x,), (tx.double(),))[1]
    call = (lambda f: lambda a, b: jvp(f, (a,), (b,))[1]) if how == "jvp" else _dual
    torch._dynamo.reset()
    got = torch.compile(call(ours), backend="aot_eager")(x, tx)
    assert got is not None and want.abs().max() > 0.01
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["cross_entropy", "linear_cross_entropy", "masked"])
def test_reverse_transforms_compile_fullgraph(case):
    ours, ref = CASES[case]
    x, tx = _inputs()
    scalar = (lambda f: f) if "entropy" in case else (lambda f: lambda a: (f(a) * tx).sum())
    for transform in (grad, hessian):
        want = transform(scalar(lambda a: ref(a.double())))(x.double())
        torch._dynamo.reset()
        got = torch.compile(transform(scalar(ours)), fullgraph=True, backend="aot_eager")(x)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_bad_target_under_compiled_grad_raises(fullgraph):
    """The loss's torch.func path checks its targets under torch.compile too (its gather check, whose result
    nothing uses, was dropped from the graph: the gradient came back for a target past V)."""
    x, _ = _inputs()
    torch._dynamo.reset()
    f = torch.compile(grad(lambda a: fs.cross_entropy(a, torch.tensor([1, 7, 3]))), fullgraph=fullgraph,
                      backend="aot_eager")  # fmt: skip
    with pytest.raises((IndexError, RuntimeError), match="a target is outside"):
        f(x)
