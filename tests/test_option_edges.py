"""Options and tensors at the edges of what the checks admit: a NumPy float scale (eager and compiled), an int
scale past int64, float8 logits and class weights, memory= past int64, softcap and z_loss outside float32's
range, and the name of the function in a backend's refusal. Each once passed the checks and then failed
inside torch, or gave NaN or a float8 loss silently."""

import numpy as np
import pytest
import torch
from helpers import close

import fastsoftmax as fs
from fastsoftmax import dispatch, heuristics


def rows(device, *shape, seed=0):
    x = torch.randn(*shape, device=device, generator=torch.Generator(device=device).manual_seed(seed))
    x[..., 1] = 30.0  # an outlier
    return x


@pytest.mark.parametrize("compiled", [None, "eager", "aot_eager"])
def test_numpy_scale_runs_as_its_float(device, compiled):
    """scale = 1 / np.sqrt(d) (a numpy.float64): torch.compile handed the custom op a FakeTensor for it."""
    x = rows(device, 2, 5, 9)
    keep = torch.ones(5, 9, dtype=torch.bool, device=device).tril()
    fmask = torch.zeros(5, 9, device=device).masked_fill(~keep, float("-inf"))
    want = torch.softmax(x.double() * 0.25 + fmask.double(), -1)

    def f(a):
        return fs.softmax(a, scale=1 / np.sqrt(16.0), mask=fmask)

    run = f if compiled is None else torch.compile(f, backend=compiled, fullgraph=True)
    close(run(x), want, torch.float32, "a numpy scale")
    module = fs.Softmax(scale=np.float32(0.25))  # (np.float32 is no float subclass)
    close((module if compiled is None else torch.compile(module, backend=compiled))(x),
          torch.softmax(x.double() * 0.25, -1), torch.float32, "a module's numpy scale")  # fmt: skip


def test_an_int_scale_past_int64_runs_as_its_float(device):
    """scale=2**64 passed the checks, then torch's ops raised OverflowError (a Python int past int64) on the
    autograd and torch.func paths: every path now takes the float."""
    x = rows(device, 3, 7) * 1e-18
    y = torch.softmax(x, -1)
    dy = rows(device, 3, 7, seed=1)
    want = fs.softmax_backward(dy, y, scale=float(2**64))
    assert torch.isfinite(want).all()
    close(fs.softmax_backward(dy, y.clone().requires_grad_(), scale=2**64), want, torch.float32, "autograd")
    close(fs.softmax(x.clone().requires_grad_(), scale=2**64), fs.softmax(x, scale=float(2**64)), torch.float32, "fwd")
    close(torch.func.grad(lambda a: fs.softmax(a, scale=2**64)[0, 0])(x),
          torch.func.grad(lambda a: fs.softmax(a, scale=float(2**64))[0, 0])(x), torch.float32, "grad")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_logits_and_class_weights_are_refused(device, dtype):
    x, t = rows(device, 4, 6), torch.tensor([0, 1, 5, 2], device=device)
    heuristics.record(None)
    with pytest.raises(TypeError, match=r"cross_entropy: logits must be floating point \(float16"):
        fs.cross_entropy(x.to(dtype), t)
    with pytest.raises(TypeError, match=r"cross_entropy: class_weight must be floating point \(float16"):
        fs.cross_entropy(x, t, class_weight=torch.ones(6, device=device).to(dtype))
    assert heuristics.last_plan() is None


def test_memory_past_int64_is_refused(device):
    """memory=2**63 ran eagerly and failed in the custom op's schema (int64) under fake tensors and compile."""
    x, w, t = rows(device, 3, 4), rows(device, 6, 4, seed=1), torch.tensor([0, 5, 2], device=device)
    for memory in (2**63, 2**70):
        with pytest.raises(ValueError, match="memory must be None or a positive int that fits in int64"):
            fs.linear_cross_entropy(x, w, t, memory=memory)
        with pytest.raises(ValueError, match="fits in int64"):
            fs.LinearCrossEntropy(4, 6, memory=memory)
    want = torch.nn.functional.cross_entropy(x.double() @ w.double().T, t)
    close(fs.linear_cross_entropy(x, w, t, memory=2**63 - 1), want, torch.float32, "the largest memory=")


@pytest.mark.parametrize(
    "options, message",
    [
        ({"softcap": 1e39}, "softcap must be None or in"),
        ({"softcap": 1e-40}, "softcap must be None or in"),
        ({"softcap": 10**400}, "softcap must be finite"),
        ({"z_loss": 1e39}, "z_loss must be in"),
    ],
)
def test_softcap_and_z_loss_outside_float32_are_refused(device, options, message):
    """The kernels cap and weigh in float32: softcap=1e39 became inf there, and inf * tanh(0) gave a NaN loss."""
    x, t = rows(device, 4, 7), torch.tensor([0, 1, 6, 2], device=device)
    with pytest.raises(ValueError, match=message):
        fs.cross_entropy(x, t, **options)
    with pytest.raises(ValueError, match=message):
        fs.linear_cross_entropy(x, rows(device, 7, 7, seed=2), t, **options)


def test_the_widest_softcap_is_the_uncapped_loss(device):
    x, t = rows(device, 4, 7), torch.tensor([0, 1, 6, 2], device=device)
    want = torch.nn.functional.cross_entropy(x.double(), t)
    close(fs.cross_entropy(x, t, softcap=3e38), want, torch.float32, "softcap=3e38")


def test_a_backends_refusal_names_the_function(device, monkeypatch):
    """A named backend that cannot run the tensors: the RuntimeError names the public function called (the
    softmax family's named none, the LM-head loss's named cross_entropy)."""
    x, t = rows(device, 4, 8), torch.tensor([0, 1, 7, 2], device=device)
    y = torch.softmax(x, -1)
    monkeypatch.setattr(dispatch.BACKENDS["triton"], "unavailable", lambda *a, **k: "a reason of the test's")
    calls = {
        "softmax": lambda: fs.softmax(x, backend="triton"),
        "log_softmax": lambda: fs.log_softmax(x, backend="triton"),
        "softmax_backward": lambda: fs.softmax_backward(x, y, backend="triton"),
        "log_softmax_backward": lambda: fs.log_softmax_backward(x, y, backend="triton"),
        "cross_entropy": lambda: fs.cross_entropy(x, t, backend="triton"),
        "linear_cross_entropy": lambda: fs.linear_cross_entropy(x, rows(device, 8, 8, seed=3), t, backend="triton"),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"^{name}: backend='triton' cannot run this tensor .*test's"):
            call()
