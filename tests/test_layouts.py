"""Sparse and nested tensors: every public function refuses them with a clear TypeError naming the argument,
before any launch (they once reached the replay's key, which read an address a sparse tensor does not have,
or sizes a nested one does not have: torch's internal RuntimeError)."""

import pytest
import torch

import fastsoftmax as fs
from fastsoftmax import heuristics

LAYOUTS = ["sparse_coo", "sparse_csr", "nested", "jagged"]


def odd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """t (2-D) in ``layout``: a nested tensor of its rows split in two."""
    if layout == "sparse_coo":
        return t.to_sparse()
    if layout == "sparse_csr":
        return t.to_sparse_csr()
    parts = [t[:3], t[3:]]
    if layout == "nested":
        return torch.nested.nested_tensor(parts)
    return torch.nested.nested_tensor(parts, layout=torch.jagged)


def calls(device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(5, 513, device=device, generator=g)
    y = torch.softmax(x, -1)
    t = torch.randint(0, 513, (5,), device=device, generator=g)
    w = torch.randn(513, 16, device=device, generator=g)
    h = torch.randn(5, 16, device=device, generator=g)
    return {  # name: (the argument named in the error, the call with that argument made odd)
        "softmax": ("x", lambda f: fs.softmax(f(x))),
        "log_softmax": ("x", lambda f: fs.log_softmax(f(x))),
        "Softmax": ("x", lambda f: fs.Softmax()(f(x))),
        "softmax_backward-y": ("y", lambda f: fs.softmax_backward(x, f(y))),
        "softmax_backward-dy": ("dy", lambda f: fs.softmax_backward(f(x), y)),
        "log_softmax_backward-dy": ("dy", lambda f: fs.log_softmax_backward(f(x), y)),
        "softmax-mask": ("mask", lambda f: fs.softmax(x, mask=f(x))),
        "cross_entropy-logits": ("logits", lambda f: fs.cross_entropy(f(x), t)),
        "cross_entropy-target": ("target", lambda f: fs.cross_entropy(x, f(x.long()))),
        "cross_entropy-class_weight": ("class_weight", lambda f: fs.cross_entropy(x, t, class_weight=f(y[:1]))),
        "linear_cross_entropy-x": ("x", lambda f: fs.linear_cross_entropy(f(h), w, t)),
        "linear_cross_entropy-weight": ("weight", lambda f: fs.linear_cross_entropy(h, f(w), t)),
    }


NAMES = list(calls("cpu"))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", NAMES)
def test_sparse_and_nested_are_refused_before_any_launch(device, name, layout):
    arg, call = calls(device)[name]
    fs.softmax(torch.randn(5, 513, device=device))  # (a dense call of a like shape recorded first)
    heuristics.record(None)
    with pytest.raises(TypeError, match=rf": {arg} (is a nested tensor|has layout torch\.sparse)"):
        call(lambda t: odd(t, layout))
    assert heuristics.last_plan() is None
