"""Where torch's own CPU kernels miss the library's tolerance, and the native path (kernels/torch_native.py)
computes otherwise: 16-bit log_softmax along rows in memory (fp32, rounded once), fp64 log_softmax near 0
(the reference's formula), fp32 rows past torch_native.LONG_FP32 (fp64, rounded once). Each test shows
torch's miss or the library's fix against the float64 oracle, outputs poisoned first."""

import pytest
import torch
from helpers import assert_close, cpu_logits, run_poisoned

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare

FNS = {False: fs.softmax, True: fs.log_softmax}
NATIVE = heuristics.Plan("torch", "native")
INF = float("inf")
LOGS = pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])


def test_torch_16bit_log_softmax_needs_the_fp32_rows():
    """Why 16-bit log_softmax along rows in memory is computed in fp32 here: torch's own is far outside the
    tolerance near 0 (if this fails, torch fixed it, and the native path may call it directly). The oracle
    also sees what torch's softmax gives a fully masked row."""
    x = cpu_logits((64, 513), torch.bfloat16, 5, special=False)
    err, problem = compare(torch.log_softmax(x, -1), x, -1, True)
    assert problem is not None and err > 100
    assert compare(fs.log_softmax(x), x, -1, True)[1] is None
    x = cpu_logits((5, 64), torch.float32, 6)
    assert "NaN" in compare(torch.softmax(x, -1), x, -1, False)[1]


def test_float64_log_softmax_near_zero():
    """fp64 log_softmax of rows that one logit leads by ~40 (its output about -1e-12): torch's can miss the
    fp64 tolerance near 0 on some CPUs; the native path takes the reference's formula. Rows in memory and
    not, fp32 in with dtype=float64 out, under autograd (the Function) too."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 513, generator=gen, dtype=torch.float64) * 3
    x[:, 7] += 40
    for t, dim, od in ((x, -1, None), (x.t().contiguous(), 0, None), (x.t(), 0, None), (x.float(), -1, x.dtype)):
        y, plans = run_poisoned(fs.log_softmax, t, dim, dtype=od)
        assert plans == [NATIVE]
        assert_close(y, t, dim, True, od)
    y, plans = run_poisoned(fs.log_softmax, x.clone().requires_grad_())
    assert plans == [NATIVE] and y.grad_fn.name() == "SoftmaxFunctionBackward"
    assert_close(y, x, -1, True)


@LOGS
@pytest.mark.parametrize("n", [2**18, 2**20 + 3])
def test_forward_long_fp32_rows(log, n):
    """fp32 rows past torch_native.LONG_FP32 within the fp32 tolerance and twice torch ops' error. (Regression:
    torch's fp32 kernels sum a row's exps in a few vector lanes; at 2^18 log_softmax missed twice torch ops'
    error, at 2^20 softmax missed the tolerance: ratios up to 1.39.)"""
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(1)) * 3
    x[1, n // 3] = -INF  # (special values still take the conventions)
    x[1, :5] = -INF
    y, plans = run_poisoned(FNS[log], x)
    assert plans == [NATIVE]
    assert_close(y, x, -1, log)
    xt = x.t()  # (rows not in memory: the same sums)
    assert_close(run_poisoned(FNS[log], xt, 0)[0], xt, 0, log)
    xg = x.clone().requires_grad_()  # (autograd: the Function, not torch's own node and its fp32 kernel)
    y, plans = run_poisoned(FNS[log], xg)
    assert plans == [NATIVE] and type(y.grad_fn).__name__ != ("LogSoftmaxBackward0" if log else "SoftmaxBackward0")
    assert_close(y.detach(), x, -1, log)
