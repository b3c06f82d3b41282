"""The public functions' argument checks: every check that can fail, before any launch, with a clear error
naming the function."""

from __future__ import annotations

import operator

import torch

from . import dispatch, dtypes, masking

REDUCTIONS = ("none", "mean", "sum")


def softmax(fn: str, x, dim, dtype, backend) -> tuple[int, torch.dtype]:
    """(dim made non-negative, output dtype)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: expected a floating-point tensor ({dtypes.FLOAT_NAMES}), got {x.dtype}")
    if dtype is not None and dtype not in dtypes.FLOATS:
        raise TypeError(f"{fn}: dtype must be None, {dtypes.FLOAT_NAMES}, got {dtype}")
    if isinstance(dim, bool):
        raise TypeError(f"{fn}: dim must be an int, got bool")
    try:
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"{fn}: dim must be an int, got {type(dim).__name__}") from None
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"{fn}: dim out of range (expected to be in range of [{-ndim}, {ndim - 1}], but got {dim})")
    if not isinstance(backend, str) or backend not in dispatch.NAMES:
        raise ValueError(f"{fn}: unknown backend {backend!r}; valid: {', '.join(map(repr, dispatch.NAMES))}")
    if x.device.type not in dispatch.DEVICES and x.device.type != "meta":  # meta: the custom op's fake
        raise RuntimeError(
            f"{fn}: no path for tensors on device '{x.device}'; fastsoftmax runs cuda tensors (Triton "
            "kernels or torch ops) and cpu tensors (torch ops; Triton under TRITON_INTERPRET=1)"
        )
    return dim % ndim, (dtype or x.dtype)


def masked(fn: str, x, dim: int, mask, scale, causal) -> bool:
    """Whether the call is masked (a mask, a scale or causal), with masking.check's errors."""
    if mask is None and scale is None and causal is False:
        return False
    masking.check(fn, x, dim, mask, scale, causal)
    return True


def softmax_backward(fn, dy, y, dim, dtype, backend) -> tuple[int, torch.dtype]:
    if not isinstance(dy, torch.Tensor):
        raise TypeError(f"{fn}: expected dy to be a torch.Tensor, got {type(dy).__name__}")
    dim, out_dtype = softmax(fn, y, dim, dtype, backend)
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


def target(fn: str, logits, target) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{fn}: target must be a torch.Tensor")
    if target.dtype not in dtypes.TARGETS:
        raise TypeError(f"{fn}: target must hold class indices (an integer dtype), got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{fn}: target has shape {tuple(target.shape)}, expected logits' shape without "
            f"the class dim, {tuple(logits.shape[:-1])}"
        )


def cross_entropy(logits, tgt, ignore_index, reduction, label_smoothing, backend) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(tgt, torch.Tensor):
        raise TypeError("cross_entropy: logits and target must be torch.Tensors")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"cross_entropy: logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"cross_entropy: logits need a class dim (the last) of size >= 1, got {tuple(logits.shape)}")
    target("cross_entropy", logits, tgt)
    if tgt.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {tgt.device} but logits on {logits.device}")
    loss_options("cross_entropy", ignore_index, reduction, label_smoothing)
    if backend not in dispatch.LOSS_BACKENDS:
        raise ValueError(f"cross_entropy: backend must be 'auto', 'triton' or 'torch', got {backend!r}")
