"""Property tests (hypothesis) over shapes, dims, dtypes, layouts and special values, on every path,
forward and backward. Sized for CI on the interpreter: small shapes, a bounded number of examples."""

import math

import pytest
import torch
from helpers import DTYPES, assert_close, forward
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fastsoftmax as fs
from fastsoftmax import heuristics

FNS = {False: fs.softmax, True: fs.log_softmax}

# The interpreter runs a program per row one after another: a 4-d draw of 129s would take an hour.
MAX_ELEMENTS = 20000

SPECIALS = [float("-inf"), float("inf"), float("nan"), 0.0, 1e4, -1e4]


@st.composite
def problems(draw):
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 17, 33, 64, 129]), min_size=ndim, max_size=ndim))
    assume(math.prod(shape) <= MAX_ELEMENTS)
    dim = draw(st.integers(-ndim, ndim - 1))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * draw(st.sampled_from([0.1, 3.0, 30.0]))
    if x.numel():
        k = draw(st.integers(0, 3))
        flat = x.view(-1)
        for _ in range(k):
            flat[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIALS))
        if draw(st.booleans()):  # mask a whole row along dim
            idx = [0] * ndim
            idx[dim] = slice(None)
            x[tuple(idx)] = float("-inf")
    x = x.to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transpose", "slice", "expand"]))
    if layout == "transpose" and ndim >= 2:
        x = x.transpose(0, -1)
    elif layout == "slice" and x.shape[-1] > 2:
        x = x[..., 1:]
    elif layout == "expand" and ndim >= 1:
        x = x.unsqueeze(0).expand(2, *x.shape)
        dim = dim - 1 if dim < 0 else dim + 1
    path = draw(st.sampled_from(["rowblock", "online", "split", None]))
    log = draw(st.booleans())
    out_dtype = draw(st.sampled_from([None, torch.float32]))
    return x, dim, path, log, out_dtype


@pytest.mark.parametrize("backend", ["triton", "torch"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_matches_oracle(device, backend, problem):
    x, dim, path, log, out_dtype = problem
    x = x.to(device)
    force = {"path": path} if path and backend == "triton" else {}
    if path in ("online", "split"):
        force["block_n"] = 16  # several chunks (and segments) per row
    with heuristics.force(poison=True, **force):
        y, _ = forward(x, dim, log=log, dtype=out_dtype, backend=backend)
    plan = heuristics.last_plan()
    assert plan.backend == backend
    if path and x.numel() and backend == "triton":
        assert plan.path == path
    assert_close(y, x, dim, log, out_dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=problems())
def test_gradients_match_oracle(device, problem):
    """Gradients through the custom op, every path, against the float64 oracle of the backward."""
    from fastsoftmax.core.reference import compare_grad

    x, dim, path, log, out_dtype = problem
    x = x.to(device).requires_grad_()
    dy = torch.randn(x.shape).to(out_dtype or x.dtype).to(device)
    force = {"path": path} if path else {}
    if path in ("online", "split"):
        force["block_n"] = 16
    with heuristics.force(poison=True, **force):
        y = forward(x.detach(), dim, log=log, dtype=out_dtype, backend="triton")[0]
        (dx,) = torch.autograd.grad(FNS[log](x, dim, dtype=out_dtype, backend="triton"), x, dy)
    if path and x.numel():
        assert heuristics.last_plan().path == path
    err, problem_text = compare_grad(dx, dy, y, dim, log, x.dtype)
    assert problem_text is None, problem_text
