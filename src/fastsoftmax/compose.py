"""How a public call composes with PyTorch's machinery: the route it takes, and torch's autocast policy.

Routes (route() decides, in this order):
  op        the torch.library custom op (its fake implementation where there is no data): torch.compile
            tracing, torch.jit.trace, a TorchDispatchMode (FakeTensorMode, make_fx, FlopCounterMode, ...),
            fake, meta and other subclass tensors
  func      torch.func transforms (grad, vmap, jvp, jacrev, hessian) and forward-mode AD: an autograd
            Function with vmap and jvp rules (softmax, log_softmax), or torch ops (masked softmax, losses)
  function  eager autograd (an input requires grad): an autograd Function around the kernels
  plain     everything else: the kernels directly (fastpath.fast repeats these checks for the eager replay)
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad

from . import dtypes

# torch's own checks, bound once (a small call's host time is mostly Python calls); fastpath.py uses them too
transforms_active = torch._C._are_functorch_transforms_active
dispatch_modes = torch._C._len_torch_dispatch_stack
tracing = torch._C._get_tracing_state
compiling = torch.compiler.is_compiling
# the replay's guard (fastpath.py's C calls, which dynamo cannot trace): one Python call that dynamo folds to
# True; export's non-strict tracing needs none (fake tensors and its dispatch mode never replay)
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", compiling)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def eager() -> bool:
    """No torch.compile tracing, torch.func transform, forward-mode AD level, dispatch mode (fake tensors)
    or jit trace: route() would say 'plain' or 'function'. The CPU's direct paths (api.py, loss.py) check
    it first."""
    if compiling() or transforms_active() or _fwad._current_level >= 0:
        return False
    return not dispatch_modes() and tracing() is None


def transformed() -> bool:
    """Inside a torch.func transform or a forward-mode AD level."""
    return transforms_active() or _fwad._current_level >= 0


def route(*tensors) -> str:
    """'op', 'func', 'function' or 'plain' for a call on ``tensors`` (None entries are skipped)."""
    if compiling():
        return "op"
    if transforms_active() or _fwad._current_level >= 0:  # transformed(), inline: every call pays this
        return "func"
    if dispatch_modes() or tracing() is not None:
        return "op"
    grad = False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in PLAIN_TYPES or t.is_meta:
            return "op"
        grad = grad or t.requires_grad
    return "function" if grad and torch.is_grad_enabled() else "plain"


# torch's autocast lists (aten/src/ATen/autocast_mode.cpp): softmax and log_softmax run in fp32 on CUDA
# (when no dtype is given), not on the CPU; cross_entropy runs in fp32 on both. tests/test_compose.py checks
# these against torch on the device it runs on.
_SOFTMAX_FP32 = ("cuda",)
_LOSS_FP32 = ("cuda", "cpu")

if hasattr(torch._C, "_is_any_autocast_enabled"):
    any_autocast = torch._C._is_any_autocast_enabled
else:  # older torch

    def any_autocast() -> bool:
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch before 2.4 takes no device type
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def softmax_dtype(x: torch.Tensor, dtype):
    """The output dtype torch's autocast gives softmax / log_softmax of x: float32 for a 16-bit x under
    autocast on CUDA with no dtype given; else ``dtype`` as given."""
    if dtype is None and x.dtype in dtypes.LOW and any_autocast() and x.device.type in _SOFTMAX_FP32:
        if _autocast_on(x.device.type):
            return torch.float32
    return dtype


def loss_dtype(logits: torch.Tensor) -> torch.dtype:
    """The loss's dtype: float32 for 16-bit logits under autocast on their device (torch's cross_entropy
    policy), else the logits' dtype."""
    if logits.dtype in dtypes.LOW and any_autocast() and logits.device.type in _LOSS_FP32:
        if _autocast_on(logits.device.type):
            return torch.float32
    return logits.dtype


def autocasting(device_type: str) -> bool:
    """Whether autocast is on for this device type."""
    return any_autocast() and _autocast_on(device_type)


def autocast_linear(x, weight, bias):
    """x, weight and bias cast to the autocast dtype where autocast is on for their device (F.linear's
    policy: floating tensors other than float64); as given otherwise."""
    if not autocasting(x.device.type):
        return x, weight, bias
    dt = (
        torch.get_autocast_dtype(x.device.type)
        if hasattr(torch, "get_autocast_dtype")
        else torch.get_autocast_gpu_dtype()
    )

    def cast(t):
        keep = not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dtype == torch.float64
        return t if keep else t.to(dt)

    return cast(x), cast(weight), cast(bias)
