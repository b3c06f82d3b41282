"""fs.cross_entropy: torch.nn.functional.cross_entropy's semantics for logits with the classes along the last
dim ((M, V), or (..., V) with targets shaped (...)), from one read of the logits forward (a loss and a
logsumexp per row) and one read + one write backward (dlogits from the saved logsumexp).

Targets outside [0, V) that are not ignore_index raise: on a GPU through torch._assert_async (a device-side
check, no host synchronisation: the error surfaces at the next synchronising call, as CUDA's own asserts
do); on the CPU at once. On the Triton path the check is a by-product of the forward's last kernel
(ce_finish), so a forward is three launches (rows, finish, assert) and a backward one; the kernels never
address memory with a bad target. reduction='mean' divides by the number of rows not ignored (all ignored:
NaN, as torch). Label smoothing e: loss = (1 - e) * nll + e * mean_j(-log p_j), as torch.
"""

from __future__ import annotations

import torch

from . import checks, compose, fastpath, ops


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    class_weight: torch.Tensor | None = None,
    softcap: float | None = None,
    z_loss: float = 0.0,
    return_z_loss: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.cross_entropy for logits with the classes along the last dim; see the module.
    Under torch.autocast the loss is float32 (as torch's); target: any integer dtype, any strides.
    class_weight: torch's ``weight=``; softcap, z_loss: see the module. return_z_loss=True returns (loss,
    the z-loss term alone, reduced the same way; it carries no gradient)."""
    k = _key(
        logits, target, class_weight, ignore_index, reduction, label_smoothing, softcap, z_loss, return_z_loss, backend
    )
    if k is not None and (out := _fast(k, logits, target)) is not None:
        return out  # a call seen before, replayed (fastpath.py)
    checks.cross_entropy(logits, target, ignore_index, reduction, label_smoothing, backend)
    checks.loss_extras("cross_entropy", logits, class_weight, softcap, z_loss, return_z_loss)
    eps, out_dtype = float(label_smoothing), compose.loss_dtype(logits)
    cap = None if softcap is None else float(softcap)
    args = (logits, target, class_weight, ignore_index, reduction, eps, cap, float(z_loss), backend, out_dtype)
    if k is not None:
        run = lambda: ops.cross_entropy(*args)  # noqa: E731
        loss, z, _ = fastpath.loss_record(
            k, logits, target, run, ops.cross_entropy_backward, ops.dlogits_differentiable
        )
    else:
        loss, z, _ = ops.cross_entropy(*args)
    return (loss, z) if return_z_loss else loss


_key, _fast = fastpath.loss_key, fastpath.loss_fast
