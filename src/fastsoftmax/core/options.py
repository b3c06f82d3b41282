"""The loss options every loss path takes (cross-entropy on logits, the LM-head loss), as one value: the
kernels, the torch ops and the custom ops' arguments are built from it. The class weights are a tensor and
travel beside it."""

from __future__ import annotations

from typing import NamedTuple


class Loss(NamedTuple):
    """ignore_index, reduction ('none', 'mean', 'sum') and label smoothing as torch's cross_entropy; softcap:
    logits become softcap * tanh(logits / softcap) first (None: off); z_loss: the coefficient of each kept
    row's logsumexp^2 (0: off)."""

    ignore_index: int = -100
    reduction: str = "mean"
    smoothing: float = 0.0
    softcap: float | None = None
    z_loss: float = 0.0
