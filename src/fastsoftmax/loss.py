"""fs.cross_entropy: torch.nn.functional.cross_entropy's semantics for logits with the classes along the last
dim ((M, V), or (..., V) with targets shaped (...)), from one read of the logits forward (a loss and a
logsumexp per row) and one read + one write backward (dlogits from the saved logsumexp).

Targets outside [0, V) that are not ignore_index raise: on a GPU through torch._assert_async (a device-side
check, no host synchronisation: the error surfaces at the next synchronising call, as CUDA's own asserts
do); on the CPU at once. On the Triton path the check is a by-product of the forward's last kernel
(ce_finish), so a forward is three launches (rows, finish, assert) and a backward one; the kernels never
address memory with a bad target. reduction='mean' divides by the number of rows not ignored (all ignored: NaN, as
torch). Label smoothing e: loss = (1 - e) * nll + e * mean_j(-log p_j), as torch.
"""

from __future__ import annotations

import torch

from . import compose, dispatch, heuristics
from .layout import storage_problem
from .reference import logsumexp_torch

REDUCTIONS = ("none", "mean", "sum")
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def check_options(fn: str, ignore_index, reduction, label_smoothing) -> None:
    """The loss options' checks, shared with fastsoftmax.distributed."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{fn}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"{fn}: label_smoothing must be a float")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{fn}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{fn}: ignore_index must be an int")


def check_target(fn: str, logits, target) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{fn}: target must be a torch.Tensor")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"{fn}: target must hold class indices (an integer dtype), got {target.dtype}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{fn}: target has shape {tuple(target.shape)}, expected logits' shape without "
                         f"the class dim, {tuple(logits.shape[:-1])}")  # fmt: skip


def _check(logits, target, ignore_index, reduction, label_smoothing, backend):
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise TypeError("cross_entropy: logits and target must be torch.Tensors")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"cross_entropy: logits must be floating point, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"cross_entropy: logits need a class dim (the last) of size >= 1, got {tuple(logits.shape)}")
    check_target("cross_entropy", logits, target)
    if target.device != logits.device:
        raise ValueError(f"cross_entropy: target is on {target.device} but logits on {logits.device}")
    check_options("cross_entropy", ignore_index, reduction, label_smoothing)
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"cross_entropy: backend must be 'auto', 'triton' or 'torch', got {backend!r}")


def _assert_targets(t: torch.Tensor, v, ignore_index: int) -> None:
    """Raise when a target is outside [0, v) and not ignore_index (``v``: an int or a 0-d tensor), comparing
    as int64 whatever the target's integer dtype (uint8 would wrap -100 to 156)."""
    t = t.long()
    bad = ((t < 0) | (t >= v)) & (t != ignore_index)
    if t.is_cuda:
        torch._assert_async(~bad.any(), "cross_entropy: a target is outside [0, V) and not ignore_index")
    elif bad.any():
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"cross_entropy: target {int(t[i])} at row {i} is outside [0, {int(v)}) and not ignore_index")


def _backend(x: torch.Tensor, backend: str) -> str:
    if backend == "torch" or x.dtype == torch.float64:
        return "torch"
    tb = dispatch.BACKENDS["triton"]
    why = tb.unavailable(x, x.dtype)
    if backend == "triton" and why:
        raise RuntimeError(f"cross_entropy: backend='triton' cannot run this tensor ({x.device}, {x.dtype}): {why}")
    if backend == "auto" and (x.device.type != "cuda" or why):
        return "torch"
    return "triton"


def _launch(k, v: int, elsize: int, backward: bool) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps) of the cross-entropy kernels for rows of v classes: the module's rule, or
    what heuristics.force() sets (rows=, block_n=, num_warps=; tests and dev/sweep_launch.py); recorded."""
    rows, block, warps = k._shape(v, elsize, backward)
    f = heuristics.forced()
    if f:
        rows, block, warps = f.get("rows", rows), f.get("block_n", block), f.get("num_warps", warps)
    heuristics.record(heuristics.Plan("triton", "cross_entropy", block_n=block, rows=rows, num_warps=warps))
    return rows, block, warps


def _rows_torch(x, t, ignore_index: int, smoothing: float):
    """(loss per row, lse per row), fp32 (fp64 for fp64 logits), with torch ops (differentiable in x)."""
    lse = logsumexp_torch(x)
    xc = x.to(lse.dtype)
    t = t.long()
    keep = t != ignore_index
    x_t = xc.gather(-1, torch.where(keep, t, 0).long()[:, None]).squeeze(-1)
    loss = lse - x_t if smoothing == 0 else lse - (1 - smoothing) * x_t - smoothing * xc.mean(-1)
    return torch.where(keep, loss, 0.0), lse


def _raise_bad_targets(ok: torch.Tensor, t: torch.Tensor, v: int, ignore_index: int) -> None:
    """After the Triton forward: ok (a 0-d tensor) is 1 when every target not ignored was in [0, v)."""
    if t.is_cuda:
        torch._assert_async(ok, f"cross_entropy: a target is outside [0, {v}) and not ignore_index")
    elif not ok.item():
        _assert_targets(t, v, ignore_index)


def dlogits_torch(x, t, lse, g, ignore_index: int, smoothing: float, offset: int = 0, v_total: int | None = None):
    """dlogits with torch ops, in lse's dtype, for the classes [offset, offset + V) of v_total (a slice of
    a vocabulary split across ranks; by default the whole row)."""
    xc = x.to(lse.dtype)
    p = (xc - torch.where(lse == float("-inf"), 0.0, lse)[:, None]).exp()
    t = t.long()
    keep = t != ignore_index
    local = t - offset
    own = keep & (local >= 0) & (local < x.shape[-1])
    hot = (torch.arange(x.shape[-1], device=x.device) == local[:, None]) & own[:, None]
    n = x.shape[-1] if v_total is None else v_total  # a 0-d tensor for a vocabulary split across ranks
    d = p - (1 - smoothing) * hot.to(p.dtype) - smoothing / (n.to(p.dtype) if isinstance(n, torch.Tensor) else n)
    return torch.where(keep[:, None], d * g.to(d.dtype)[:, None], 0.0)


def dlogits_differentiable(logits, target, stats, grad, ignore_index: int, reduction: str, smoothing: float):
    """dlogits in torch ops, differentiable in the logits (the logsumexp recomputed from them, not the saved
    one: the Hessian's -p p^T term) and in grad: create_graph=True and torch.func transforms."""
    x, t = _flat(logits, target)
    m = x.shape[0]
    g = _row_grad(grad, stats[m], reduction, m).to(stats.dtype)
    dx = dlogits_torch(x, t, logsumexp_torch(x), g, ignore_index, smoothing)
    return dx.to(logits.dtype).reshape(logits.shape)


def _reduce(loss_rows, kept, reduction, out_dtype):
    """``kept``: the number of rows not ignored (a 0-d tensor), the mean's divisor."""
    if reduction == "none":
        return loss_rows.to(out_dtype)
    total = loss_rows.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    return (total / kept).to(out_dtype)


def _row_grad(grad, kept, reduction, m):
    """The upstream gradient of each row's loss (``kept``: as _reduce's)."""
    if reduction == "none":
        return grad.reshape(m)
    g = grad.reshape(()).expand(m)
    if reduction == "mean":
        g = g / kept
    return g


def cross_entropy(logits, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, backend="auto"):
    """torch.nn.functional.cross_entropy for logits with the classes along the last dim; see the module.
    Under torch.autocast the loss is float32 (as torch's); target: any integer dtype, any strides."""
    _check(logits, target, ignore_index, reduction, label_smoothing, backend)
    eps, out_dtype = float(label_smoothing), compose.loss_dtype(logits)
    route = compose.route(logits, target)
    if route == "plain":
        return _forward(logits, target, ignore_index, reduction, eps, backend, out_dtype)[0]
    if route == "op":
        return torch.ops.fastsoftmax.cross_entropy(logits, target, ignore_index, reduction, eps, backend, out_dtype)[0]
    if route == "func":
        return _composite(logits, target, ignore_index, reduction, eps, out_dtype)
    from .ops import CrossEntropyEager  # the custom op's code without its dispatch (ops.py)

    return CrossEntropyEager.apply(logits, target, ignore_index, reduction, eps, backend, out_dtype)[0]


def _composite(logits, target, ignore_index, reduction, smoothing, out_dtype):
    """The loss in torch ops, differentiable to any order (torch.func transforms); targets are checked where
    they are plain tensors (a batched one cannot be read: its gather raises on a bad index)."""
    heuristics.record(heuristics.Plan("torch", "composite"))
    x, t = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if not torch._C._functorch.is_functorch_wrapped_tensor(t):
        _assert_targets(t, x.shape[-1], ignore_index)
    loss_rows, _ = _rows_torch(x, t, ignore_index, smoothing)
    loss = _reduce(loss_rows, (t.long() != ignore_index).sum(), reduction, out_dtype)
    return loss.reshape(target.shape) if reduction == "none" else loss


def _flat(logits, target):
    """(M, V) logits with unit stride along V, and the (M,) targets in memory order (what the kernels index:
    a strided or expanded target is copied, M integers)."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    if x.stride(-1) != 1:
        x = x.contiguous()
    t = target.reshape(-1)
    if t.numel() > 1 and t.stride(0) != 1:
        t = t.contiguous()
    return x, t


def _forward(logits, target, ignore_index, reduction, smoothing, backend, out_dtype=None):
    """(loss in out_dtype (default: the logits'), stats): stats (M + 2,) holds each row's logsumexp, then the
    number of rows not ignored (the mean's divisor, for the backward), then 1.0 if every target was in range."""
    if why := storage_problem(logits, target):
        raise RuntimeError(f"cross_entropy: {why}")
    out_dtype = out_dtype or logits.dtype
    x, t = _flat(logits, target)
    m, v = x.shape
    if m and _backend(x, backend) == "triton":
        from .triton import cross_entropy as k

        shape = _launch(k, v, x.element_size(), backward=False)
        with dispatch._on_device(x):
            loss, stats = k.forward(x, t, ignore_index, smoothing, reduction, out_dtype, shape)
        _raise_bad_targets(stats[m + 1], t, v, ignore_index)
        return (loss.reshape(target.shape) if reduction == "none" else loss), stats
    _assert_targets(t, v, ignore_index)
    if m:
        heuristics.record(heuristics.Plan("torch", "cross_entropy"))
        loss_rows, lse = _rows_torch(x, t, ignore_index, smoothing)
    else:
        loss_rows = lse = torch.zeros(0, dtype=torch.float32, device=x.device)
    kept = (t.long() != ignore_index).sum().to(lse.dtype)
    stats = torch.cat([lse, kept[None], torch.ones(1, dtype=lse.dtype, device=x.device)])
    loss = _reduce(loss_rows, kept, reduction, out_dtype)
    return (loss.reshape(target.shape) if reduction == "none" else loss), stats


def _backward(logits, target, stats, grad, ignore_index, reduction, smoothing, backend):
    if why := storage_problem(logits, target, stats, grad):
        raise RuntimeError(f"cross_entropy: {why}")
    x, t = _flat(logits, target)
    m, v = x.shape
    if m and _backend(x, backend) == "triton":
        from .triton import cross_entropy as k

        shape = _launch(k, v, x.element_size(), backward=True)
        g = grad.reshape(m) if reduction == "none" else grad.reshape(())
        dx = torch.empty(x.shape, dtype=logits.dtype, device=x.device)
        with dispatch._on_device(x):
            k.backward(x, t, stats, g, ignore_index, smoothing, reduction == "mean", dx, shape)
        return dx.reshape(logits.shape)
    if m:
        heuristics.record(heuristics.Plan("torch", "cross_entropy"))
    g = _row_grad(grad, stats[m], reduction, m).to(stats.dtype)  # stats[m]: the forward's kept-row count
    return dlogits_torch(x, t, stats[:m], g, ignore_index, smoothing).to(logits.dtype).reshape(logits.shape)
