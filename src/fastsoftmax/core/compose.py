"""How a public call composes with PyTorch's machinery: the route it takes, torch's autocast policy, and Op,
the one helper that makes an implementation a custom op with its fake, its autograd and its eager Functions.

Routes:
  op        the torch.library custom op (its fake implementation where there is no data): torch.compile
            tracing, torch.jit.trace, a TorchDispatchMode (FakeTensorMode, make_fx, FlopCounterMode, ...),
            fake, meta and other subclass tensors
  func      torch.func transforms (grad, vmap, jvp, jacrev, hessian) and forward-mode AD: an autograd
            Function with vmap and jvp rules (softmax, log_softmax), or torch ops (masked softmax, losses)
  function  eager autograd (an input requires grad): the op's eager autograd Function
  plain     everything else: dispatch.py directly
route() asks in this order: torch.func and forward-mode AD (func, under torch.compile too: the custom ops have no
forward-mode rule, and torch gives their tangents as zeros), then torch.compile (op), then torch.jit.trace, a
dispatch mode and the tensors' types (op), then autograd (function); plain otherwise.
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad

from . import dtypes

# torch's own checks, bound once (a small call's host time is mostly Python calls)
transforms_active = torch._C._are_functorch_transforms_active
dispatch_modes = torch._C._len_torch_dispatch_stack
tracing = torch._C._get_tracing_state
# (torch.compile's Dynamo folds this to True as it traces; export and AOT tracing run under a dispatch mode)
compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
grad_enabled = torch.is_grad_enabled
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(t) -> bool:
    """t is a DTensor (False where torch.distributed.tensor cannot be imported): the public functions hand
    DTensors sharded on the classes to fastsoftmax.distributed."""
    if type(t) in PLAIN_TYPES or not isinstance(t, torch.Tensor):
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (torch built without distributed)
        return False
    return isinstance(t, DTensor)


def transformed() -> bool:
    """Inside a torch.func transform or a forward-mode AD level (route() asks the same, inline)."""
    return transforms_active() or _fwad._current_level >= 0


# gradients batched by torch.autograd.grad(is_grads_batched=True) (jacobian(vectorize=True), gradcheck's batched
# check): legacy vmap's tensors, which hold no memory of their own (no torch.func transform is active then)
_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)


def torch_backward(*grads) -> bool:
    """Whether a backward must run in torch ops (differentiable, and batched by vmap's rules) rather than the
    kernels: create_graph=True (grad mode on in the backward), a torch.func transform or forward-mode AD, or
    a gradient batched by is_grads_batched (None entries skipped)."""
    if torch.is_grad_enabled() or transformed():
        return True
    return _legacy_batched is not None and any(g is not None and _legacy_batched(g) for g in grads)


def route(*tensors) -> str:
    """'op', 'func', 'function' or 'plain' for a call on ``tensors`` (None entries are skipped)."""
    if transforms_active() or _fwad._current_level >= 0:  # transformed(), inline: every call pays this
        return "func"
    if compiling():
        return "op"
    if dispatch_modes() or tracing() is not None:
        return "op"
    if len(tensors) == 1:  # (the common case, unrolled)
        t = tensors[0]
        if type(t) not in PLAIN_TYPES or t.is_meta:
            return "op"
        return "function" if t.requires_grad and grad_enabled() else "plain"
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in PLAIN_TYPES or t.is_meta:
                return "op"
            if t.requires_grad:
                grad = True
    return "function" if grad and grad_enabled() else "plain"


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


def softmax_dtype(x: torch.Tensor, dtype=None) -> torch.dtype:
    """The output dtype torch's autocast gives softmax / log_softmax of x: float32 for a 16-bit x under
    autocast on CUDA with no dtype given; else ``dtype`` as given (None: x's)."""
    if dtype is None and x.dtype in dtypes.LOW and any_autocast() and x.device.type in _SOFTMAX_FP32:
        if _autocast_on(x.device.type):
            return torch.float32
    return dtype or x.dtype


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
    """x, weight and bias cast to the autocast dtype of x's device, where autocast is on (the caller asks,
    autocasting()): F.linear's policy, floating tensors other than float64 cast."""
    dt = (
        torch.get_autocast_dtype(x.device.type)
        if hasattr(torch, "get_autocast_dtype")
        else torch.get_autocast_gpu_dtype()
    )

    def cast(t):
        keep = not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dtype == torch.float64
        return t if keep else t.to(dt)

    return cast(x), cast(weight), cast(bias)


class Op:
    """One implementation as a custom op (``fastsoftmax::<name>``, ``schema`` as torch.library writes it, or None
    for the one torch.library infers from impl's annotations) with
    its fake implementation and, where ``backward`` is given, its autograd formula; the same forward, context
    and backward as an eager torch.autograd.Function (``eager``, in the ctx-first style: a Function with
    setup_context binds its arguments through inspect.signature on every apply); and where there are jvp or
    vmap rules, the same in the setup_context style torch.func requires (``transform``). ``func``: what
    torch.func transforms run instead (a composite of torch ops), also eager autograd's where the op has no
    backward. ``call(route, *args)`` runs the op on a route other than plain (the callers run the plain route
    themselves: one frame less on the way to the kernels). ``checked``: the custom op's implementation where
    it is not ``impl``: the public functions check their arguments before any route, but the custom op may
    also be called directly (torch.ops.fastsoftmax.*), and then checks them itself."""

    def __init__(self, name, impl, fake, schema: str | None, *, setup_context=None, backward=None, jvp=None, vmap=None,
                 func=None, checked=None):  # fmt: skip
        op_impl = checked or impl
        if schema is None and checked is not None:  # (impl's annotations give it: checked() need not repeat them)
            schema = torch.library.infer_schema(impl, mutates_args=())
        self.custom = torch.library.custom_op(f"fastsoftmax::{name}", op_impl, mutates_args=(), schema=schema)
        self.custom.register_fake(fake)
        self.eager = self.transform = None
        self.func = func
        title = "".join(w.title() for w in name.split("_"))
        if backward is not None:
            self.custom.register_autograd(backward, setup_context=setup_context)

            def forward(ctx, *args):
                out = impl(*args)
                setup_context(ctx, args, out)
                return out

            body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
            self.eager = type(f"{title}Function", (torch.autograd.Function,), body)
        if jvp is not None or vmap is not None:

            def tforward(*args):  # (impl's defaults beyond the schema must not reach the vmap rule)
                return impl(*args)

            body = {"forward": staticmethod(tforward), "setup_context": staticmethod(setup_context)}
            body |= {k: staticmethod(f) for k, f in (("backward", backward), ("jvp", jvp), ("vmap", vmap)) if f}
            self.transform = type(f"{title}TransformFunction", (torch.autograd.Function,), body)

    def call(self, route: str, *args):
        if route == "op":
            return self.custom(*args)
        if route == "function" and self.eager is not None:
            return self.eager.apply(*args)
        if self.func is not None:
            return self.func(*args)
        return (self.transform or self.eager).apply(*args)
