"""The public functions' argument checks: every check that can fail, before any launch, with a clear error
naming the function."""

from __future__ import annotations

import math
import operator

import torch

from . import compose, dtypes, masking

REDUCTIONS = ("none", "mean", "sum")
BACKENDS = ("auto", "triton", "cuda", "torch")  # the names backend= takes (dispatch.py maps them to code)
LOSS_BACKENDS = ("auto", "triton", "torch")  # the losses' (the CUDA backend has no loss kernels)
DEVICES = ("cpu", "cuda")  # devices with a path (meta tensors: the custom ops' fakes)


_FLOATS = frozenset(dtypes.FLOATS)
_STRIDED = torch.strided
_BACKENDS = frozenset(BACKENDS)
_I64 = (-(2**63), 2**63 - 1)  # ignore_index's range: the targets' widest dtype (and memory='s)
_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max  # softcap's, z_loss's range


def dense(fn: str, name: str, t: torch.Tensor) -> None:
    """t is dense: strided and not nested (sparse and nested tensors have no path; their sizes, strides or
    addresses cannot be read as a dense tensor's)."""
    if t.is_nested:
        raise TypeError(f"{fn}: {name} is a nested tensor; fastsoftmax takes dense tensors (pad it to one)")
    if t.layout is not _STRIDED:
        raise TypeError(f"{fn}: {name} has layout {t.layout}; fastsoftmax takes dense tensors ({name}.to_dense())")


def no_dtensor(fn: str, **tensors) -> None:
    """None of ``tensors`` (None entries skipped) is a DTensor: a DTensor has a path only as the logits of
    fs.softmax, fs.log_softmax (unmasked) and fs.cross_entropy, or the weight of fs.linear_cross_entropy,
    sharded on the classes (distributed/dtensor.py, which also takes the other arguments replicated)."""
    for name, t in tensors.items():
        if t is not None and type(t) not in compose.PLAIN_TYPES and compose.is_dtensor(t):
            raise NotImplementedError(
                f"{fn}: {name} is a DTensor, and this call has no DTensor path; DTensors run as the logits of "
                "fs.softmax, fs.log_softmax (no mask, scale or causal) and fs.cross_entropy, or the weight of "
                "fs.linear_cross_entropy, sharded on the classes (docs/semantics.md)"
            )


def softmax(fn: str, x, dim, dtype, backend, name: str = "x") -> tuple[int, torch.dtype]:
    """(dim made non-negative, output dtype); ``name``: x's in the errors (the backward's y)."""
    if (  # the common case, in few steps (a small call's host time is mostly Python's); else each check
        type(x) is torch.Tensor
        and type(dim) is int
        and x.layout is _STRIDED
        and not x.is_nested
        and x.dtype in _FLOATS
        and (dtype is None or dtype in dtypes.FLOATS)  # (a tuple: an unhashable dtype= gets the checks' error)
        and type(backend) is str
        and backend in _BACKENDS
        and ((x.is_cuda and "cuda" in DEVICES) or (x.is_cpu and "cpu" in DEVICES))
    ):
        ndim = x.dim() or 1
        if -ndim <= dim < ndim:
            return dim % ndim, (dtype or x.dtype)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    dense(fn, name, x)
    if x.dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: expected a floating-point tensor ({dtypes.FLOAT_NAMES}), got {x.dtype}")
    out_dtype(fn, dtype)
    if isinstance(dim, bool):
        raise TypeError(f"{fn}: dim must be an int, got bool")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{fn}: dim must be an int, got {type(dim).__name__}") from None
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{fn}: dim out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid: {', '.join(map(repr, BACKENDS))}")
    if x.device.type not in DEVICES and x.device.type != "meta":  # meta: the custom op's fake
        raise RuntimeError(
            f"{fn}: no path for tensors on device '{x.device}'; fastsoftmax runs cuda tensors (Triton "
            "kernels or torch ops) and cpu tensors (torch ops; Triton under TRITON_INTERPRET=1)"
        )
    return dim % ndim, (dtype or x.dtype)


def targets(t: torch.Tensor, v, ignore_index: int, fn: str = "cross_entropy", readable: bool = True) -> None:
    """Raise when a target is outside [0, v) and not ignore_index (``v``: an int or a 0-d tensor), comparing
    as int64 whatever the target's integer dtype (uint8 would wrap -100 to 156). On a GPU, and traced by
    torch.compile (a gather whose result is unused would be dropped from the graph), through
    torch._assert_async (on a GPU no host synchronisation: the error surfaces at the next synchronising call). The
    Triton kernels make the same check on the device as they read the targets. ``readable`` False (a target
    inside a torch.func transform, which vmap may batch: no value can be read on the host): a gather that
    raises on a bad index, as torch's own loss does (on a GPU, a device-side assertion)."""
    t = t.long()
    if not readable:
        kept = torch.where(t == ignore_index, 0, t).reshape(-1, 1)
        try:
            torch.zeros((), device=t.device).expand(kept.shape[0], int(v)).gather(1, kept)
        except RuntimeError as e:
            raise IndexError(f"{fn}: a target is outside [0, {int(v)}) and not ignore_index") from e
        return
    bad = ((t < 0) | (t >= v)) & (t != ignore_index)
    if t.is_cuda or compose.compiling():
        torch._assert_async(~bad.any(), f"{fn}: a target is outside [0, V) and not ignore_index")
    elif bad.any():
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"{fn}: target {int(t[i])} at row {i} is outside [0, {int(v)}) and not ignore_index")


def masked(fn: str, x, dim: int, mask, scale, causal) -> float | None:
    """The scale as a Python float (None where there is none: what every path then takes), after the checks
    of a masked call (a mask, a scale or causal): scale a finite float (a NumPy float or an int too), then
    masking.check's errors (the mask and causal)."""
    if mask is None and scale is None and causal is False:
        return None
    no_dtensor(fn, x=x, mask=mask)
    if scale is not None:
        scale = _number(fn, "scale", scale)
    if isinstance(mask, torch.Tensor):
        dense(fn, "mask", mask)
    masking.check(fn, x, dim, mask, causal)
    return scale


def softmax_backward(fn, dy, y, dim, dtype, backend) -> tuple[int, torch.dtype]:
    if (
        type(dy) is torch.Tensor
        and type(y) is torch.Tensor
        and dy.layout is _STRIDED
        and not dy.is_nested
        and not y.is_nested
        and dy.dtype in _FLOATS
        and dy.shape == y.shape
    ):
        # (is_cpu too: a meta tensor's is_cuda and get_device() are a cpu tensor's)
        if dy.is_cuda == y.is_cuda and dy.is_cpu == y.is_cpu and dy.get_device() == y.get_device():
            return softmax(fn, y, dim, dtype, backend, "y")
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"{fn}: expected dy to be a torch.Tensor, got {type(dy).__name__}")
    no_dtensor(fn, dy=dy, y=y)
    dim, out_dtype = softmax(fn, y, dim, dtype, backend, "y")
    dense(fn, "dy", dy)
    if dy.dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: dy must be floating point ({dtypes.FLOAT_NAMES}), got {dy.dtype}")
    if dy.shape != y.shape:
        raise ValueError(f"{fn}: dy has shape {tuple(dy.shape)} but y has {tuple(y.shape)}")
    if dy.device != y.device:
        raise ValueError(f"{fn}: dy is on {dy.device} but y is on {y.device}")
    return dim, out_dtype


def loss_options(fn: str, ignore_index, reduction, label_smoothing) -> None:
    """The loss options' checks, shared with fastsoftmax.distributed."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"{fn}: label_smoothing must be a float")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: ignore_index must be an int")
    if not _I64[0] <= ignore_index <= _I64[1]:  # (torch's own message: an overflow unpacking a long long)
        raise ValueError(f"{fn}: ignore_index must fit in int64, got {ignore_index}")


def target(fn: str, logits, target) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{fn}: target must be a torch.Tensor")
    if target.dtype not in dtypes.TARGETS:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes.TARGETS)
        raise TypeError(f"{fn}: target must hold class indices (an integer dtype: {names}), got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{fn}: target has shape {tuple(target.shape)}, expected logits' shape without "
            f"the class dim, {tuple(logits.shape[:-1])}"
        )


def loss_backend(fn: str, backend) -> None:
    """backend= of the losses and of the distributed functions (no CUDA-backend kernels for them)."""
    if backend not in LOSS_BACKENDS:
        raise ValueError(f"{fn}: backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def cross_entropy_options(fn: str, ignore_index, reduction, label_smoothing, backend) -> None:
    loss_options(fn, ignore_index, reduction, label_smoothing)
    loss_backend(fn, backend)


def out_dtype(fn: str, dtype) -> None:
    """dtype= of the softmax family: None or a floating dtype the library computes in."""
    if dtype is not None and dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: dtype must be None, {dtypes.FLOAT_NAMES}, got {dtype!r}")


def shard(fn: str, x, backend=None, tgt=None, dtype=None) -> None:
    """fastsoftmax.distributed's checks of this rank's slice of the classes (and of a softmax's backend and
    dtype=, and the loss's target): what can fail before a collective."""
    if compose.is_dtensor(x):
        raise TypeError(
            f"{fn}: takes this rank's slice as a plain tensor (DTensor.to_local()); a DTensor sharded on the "
            "classes goes to fs.softmax, fs.log_softmax or fs.cross_entropy"
        )
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise TypeError(f"{fn}: expected a floating-point torch.Tensor shard ({dtypes.FLOAT_NAMES})")
    dense(fn, "x", x)
    if x.dim() < 1:
        raise ValueError(f"{fn}: the shard needs the split class dim (the last)")
    if backend is not None:
        loss_backend(fn, backend)
    out_dtype(fn, dtype)
    if tgt is not None:
        if isinstance(tgt, torch.Tensor):
            dense(fn, "target", tgt)
        target(fn, x, tgt)


_TARGETS, _REDUCTIONS, _LOSS_BACKENDS = frozenset(dtypes.TARGETS), frozenset(REDUCTIONS), frozenset(LOSS_BACKENDS)


def cross_entropy(logits, tgt, ignore_index, reduction, label_smoothing, backend) -> None:
    if (  # the common case, in few steps (a small call's host time is mostly Python's); else each check
        type(logits) is torch.Tensor
        and type(tgt) is torch.Tensor
        and logits.layout is _STRIDED
        and tgt.layout is _STRIDED
        and not logits.is_nested
        and not tgt.is_nested
        and logits.dtype in _FLOATS
        and tgt.dtype in _TARGETS
        and type(ignore_index) is int
        and _I64[0] <= ignore_index <= _I64[1]
        and type(reduction) is str
        and reduction in _REDUCTIONS
        and type(label_smoothing) is float
        and 0.0 <= label_smoothing <= 1.0
        and type(backend) is str
        and backend in _LOSS_BACKENDS
        and logits.dim()
        and logits.shape[:-1] == tgt.shape
        and logits.shape[-1]
        and logits.is_cuda == tgt.is_cuda
        and logits.is_cpu == tgt.is_cpu  # (a meta tensor's is_cuda and get_device() are a cpu tensor's)
        and logits.get_device() == tgt.get_device()
    ):
        return
    if not isinstance(logits, torch.Tensor) or not isinstance(tgt, torch.Tensor):
        raise TypeError("cross_entropy: logits and target must be torch.Tensors")
    dense("cross_entropy", "logits", logits)
    dense("cross_entropy", "target", tgt)
    no_dtensor("cross_entropy", target=tgt)  # (DTensor logits: distributed/dtensor.py, before the checks)
    if logits.dtype not in dtypes.FLOATS:
        raise TypeError(f"cross_entropy: logits must be floating point ({dtypes.FLOAT_NAMES}), got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"cross_entropy: logits need a class dim (the last) of size >= 1, got {tuple(logits.shape)}")
    target("cross_entropy", logits, tgt)
    if tgt.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {tgt.device} but logits on {logits.device}")
    cross_entropy_options("cross_entropy", ignore_index, reduction, label_smoothing, backend)


def _number(fn: str, name: str, value) -> float:
    """value as a float: a Python float or int (not a bool), or a NumPy number, that is finite as a float."""
    if type(value).__module__ == "numpy" and type(value).__name__ not in ("bool", "bool_"):
        try:  # (torch.compile's Dynamo traces a NumPy number as an array: no isinstance holds there, float() does)
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{fn}: {name} must be a Python float, got a NumPy array") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name} must be a Python float, got {type(value).__name__}")
    if -math.inf < value < math.inf:  # (not math.isfinite: Dynamo traces comparisons of a SymFloat)
        try:
            return float(value)
        except OverflowError:  # (an int past the largest float)
            raise ValueError(f"{fn}: {name} must be finite, got an int past the largest float") from None
    raise ValueError(f"{fn}: {name} must be finite, got {value}")


def loss_extras(fn: str, logits, class_weight, softcap, z_loss, return_z_loss: bool = False) -> None:
    """class_weight: None or a (V,) floating tensor on the logits' device; softcap: None or a float > 0;
    z_loss: a float >= 0; return_z_loss: a bool. ``logits``: the logits, or (V, device) of a weight matrix."""
    if class_weight is None and softcap is None and type(z_loss) is float and z_loss == 0.0:
        if type(return_z_loss) is bool:  # (the common case)
            return
    v, device = (logits.shape[-1], logits.device) if isinstance(logits, torch.Tensor) else logits
    if class_weight is not None:
        if not isinstance(class_weight, torch.Tensor):
            raise TypeError(f"{fn}: class_weight must be None or a torch.Tensor, got {type(class_weight).__name__}")
        dense(fn, "class_weight", class_weight)
        no_dtensor(fn, class_weight=class_weight)
        if class_weight.dtype not in dtypes.FLOATS:
            raise TypeError(
                f"{fn}: class_weight must be floating point ({dtypes.FLOAT_NAMES}), got {class_weight.dtype}"
            )
        if tuple(class_weight.shape) != (v,):
            raise ValueError(
                f"{fn}: class_weight must have shape ({v},) (one per class), got {tuple(class_weight.shape)}"
            )
        if class_weight.device != device:
            raise ValueError(f"{fn}: class_weight is on {class_weight.device} but the logits on {device}")
        if class_weight.requires_grad and torch.is_grad_enabled():  # (torch's weight= refuses it alike)
            raise RuntimeError(
                f"{fn}: class_weight requires grad, and the loss has no gradient for it (as torch's weight=); "
                "pass class_weight.detach()"
            )
    if softcap is not None and not _F32_TINY <= _number(fn, "softcap", softcap) <= _F32_MAX:
        raise ValueError(
            f"{fn}: softcap must be None or in [{_F32_TINY:.4g}, {_F32_MAX:.4g}] (a normal float32: the kernels "
            f"cap in float32), got {softcap}"
        )
    if not 0 <= _number(fn, "z_loss", z_loss) <= _F32_MAX:
        raise ValueError(f"{fn}: z_loss must be in [0, {_F32_MAX:.4g}] (a float32: the kernels' math), got {z_loss}")
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"{fn}: return_z_loss must be a bool, got {type(return_z_loss).__name__}")


def linear_cross_entropy(
    x, weight, tgt, bias, memory, autocast: bool = False, fn: str = "linear_cross_entropy", min_v: int = 1
) -> None:
    """x (..., d), weight (V, d) with V >= min_v (a rank's slice may be empty: 0), bias (V,) or None:
    floating, on one device, of one dtype (with ``autocast``, the public functions', not where autocast is
    on for x's device: linear_autocast casts them and checks that after the cast); target x's shape without
    d; memory None or an int > 0."""
    for name, t in (("x", x), ("weight", weight), ("target", tgt)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"{fn}: bias must be None or a torch.Tensor, got {type(bias).__name__}")
    no_dtensor(fn, x=x, weight=weight, target=tgt, bias=bias)  # (a DTensor weight: distributed/dtensor.py)
    for name, t in (("x", x), ("weight", weight), ("target", tgt), ("bias", bias)):
        if t is not None:
            dense(fn, name, t)
    if x.dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: x must be floating point ({dtypes.FLOAT_NAMES}), got {x.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{fn}: x must have a feature dim (the last), got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] < min_v:
        raise ValueError(
            f"{fn}: weight must be (V, d) with V >= {min_v} and d = x.shape[-1] = {x.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{fn}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and not t.dtype.is_floating_point:
            raise TypeError(f"{fn}: {name} must be floating point, got {t.dtype}")
    if not (autocast and compose.autocasting(x.device.type)):
        linear_dtypes(x, weight, bias, fn)
    for name, t in (("weight", weight), ("target", tgt), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but x on {x.device}")
    if x.device.type not in DEVICES and x.device.type != "meta":
        raise RuntimeError(f"{fn}: no path for tensors on device '{x.device}' (cuda and cpu tensors run)")
    target(fn, x, tgt)  # (x's shape without d, as the logits' without the classes)
    memory_budget(fn, memory)


def skip_eps(fn: str, eps, reduction: str, label_smoothing) -> None:
    """The LM-head loss's skip_eps: a number in [0, 1); above 0 only for a scalar loss without label smoothing
    (smoothing's gradient is dense, and 'none''s upstream gradient comes only with the backward)."""
    if _number(fn, "skip_eps", eps) < 0 or eps >= 1:
        raise ValueError(f"{fn}: skip_eps must be in [0, 1), got {eps}")
    if eps and reduction == "none":
        raise ValueError(f"{fn}: skip_eps needs reduction 'mean' or 'sum' (got 'none')")
    if eps and label_smoothing:
        raise ValueError(f"{fn}: skip_eps needs label_smoothing=0 (smoothing's gradient reaches every class)")


def memory_budget(fn: str, memory) -> None:
    """The LM-head loss's memory=: None or an int > 0 (bytes of logits a chunk holds)."""
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or not 1 <= memory <= _I64[1]):
        raise ValueError(
            f"{fn}: memory must be None or a positive int that fits in int64 (bytes of logits a chunk holds), "
            f"got {memory!r}"
        )


def linear_autocast(x, weight, bias, fn: str = "linear_cross_entropy"):
    """The LM head's (x, weight, bias) as F.linear's autocast casts them where autocast is on for x's device
    (compose.autocast_linear), then checked to be of one dtype; as given otherwise. After
    linear_cross_entropy(..., autocast=True): the public functions' one rule, one- and multi-GPU."""
    if not compose.autocasting(x.device.type):
        return x, weight, bias
    x, weight, bias = compose.autocast_linear(x, weight, bias)
    linear_dtypes(x, weight, bias, fn)
    return x, weight, bias


def linear_dtypes(x, weight, bias, fn: str = "linear_cross_entropy") -> None:
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            raise TypeError(f"{fn}: {name} is {t.dtype} but x is {x.dtype} (one dtype, as F.linear needs)")
