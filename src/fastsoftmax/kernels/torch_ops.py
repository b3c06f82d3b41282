"""The torch backend: torch ops, on any device torch runs. Two paths, each a Plan:
reference  backend='torch', and masks and logsumexp outputs on any backend's behalf: the library's formulas
           in torch ops, float32 accumulation (float64 for float64)
native     backend='auto' on CPU tensors (dispatch.select's choice): torch's own CPU kernels, with the
           library's conventions applied after them where they differ (torch_native.py)"""

from __future__ import annotations

import torch

from .. import heuristics
from ..core import masking
from ..core.layout import alloc
from ..core.reference import grad_torch, softmax_torch
from . import launch
from . import torch_native as native
from .torch_loss import dlogits_options, kept_rows, loss_rows_torch, no_z_term, reduce_terms, row_grads

REFERENCE = heuristics.Plan("torch", "reference")
_record, _NATIVE = heuristics.record, native.NATIVE
_recorded_call = launch.recorded_call
CROSS_ENTROPY = heuristics.Plan("torch", "cross_entropy")


class TorchBackend:
    """The backend's methods (dispatch.py's interface); ``path`` is "native" or None (the reference)."""

    name = "torch"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE):
        if path == "native":
            _record(_NATIVE)
            fn, args = native.softmax_call(x, dim, log, out_dtype)  # (the call the replay makes again)
            _recorded_call(fn, args)
            return fn(x, *args), None
        heuristics.record(REFERENCE)
        if spec.active:
            wide = torch.float64 in (x.dtype, out_dtype)
            x = masking.logits(x, spec.mask, spec.scale, spec.causal, torch.float64 if wide else torch.float32)
        y, lse = softmax_torch(x, dim, log, out_dtype)
        # In the layout every backend promises (and the custom op's fake implementation states).
        return alloc(x, out_dtype).copy_(y), (lse.to(torch.float32) if want_lse else None)

    def backward(self, dy, y, dim, out_dtype, log, path=None, spec=masking.NONE):
        if path == "native":
            _record(_NATIVE)
            fn, args = native.softmax_backward_call(dy, y, dim, log, out_dtype)
            _recorded_call(fn, args, swap=True)
            return fn(dy, y, *args)
        heuristics.record(REFERENCE)
        return alloc(y, out_dtype).copy_(grad_torch(dy, y, dim, log, out_dtype, spec.mask, spec.scale, spec.causal))

    def cross_entropy(self, x, t, w, o, out_dtype, path=None, stats=True):
        """(loss, z-loss, stats) as the Triton kernels give them (stats: lse per row, rows kept, 1.0, their
        weight; None where ``stats`` is False on the native path)."""
        m = x.shape[0]
        if path == "native":
            heuristics.record(native.NATIVE_CE)
            t, w = native.loss_inputs(x, t, w)
            if not stats:  # (a plain call: the loss alone; the z-loss is 0 here, made where asked for)
                opts = (o.ignore_index, o.reduction, o.smoothing, out_dtype)
                _recorded_call(native.plain_loss, opts if w is not None else (None, *opts))  # (for the replay)
                return native.native_cross_entropy(x, t, w, *opts), None, None
            loss, st = native.native_loss_stats(x, t, w, o.ignore_index, o.reduction, o.smoothing, out_dtype)
            return loss, no_z_term(loss, t, o.ignore_index, o.reduction), st
        if m:
            heuristics.record(CROSS_ENTROPY)
        ce, zr, lse = loss_rows_torch(x, t, o, w)
        kept, w_kept = kept_rows(t, o.ignore_index, w, x.shape[-1], lse.dtype)
        stats = torch.cat([lse, kept[None], torch.ones(1, dtype=lse.dtype, device=x.device), w_kept[None]])
        loss, z = reduce_terms(ce, zr, kept, w_kept, o.reduction, out_dtype)
        return loss, z, stats

    def cross_entropy_backward(self, x, t, w, stats, grad, o, out_dtype, path=None):
        m = x.shape[0]
        if path == "native":
            heuristics.record(native.NATIVE_CE)
            t, w = native.loss_inputs(x, t, w)
            dx = native.native_cross_entropy_backward(x, t, w, grad, o.ignore_index, o.reduction, o.smoothing)
            return dx if dx.dtype == out_dtype else dx.to(out_dtype)
        if m:
            heuristics.record(CROSS_ENTROPY)
        g_ce, g_z = row_grads(grad, stats[m], stats[m + 2], o.reduction, m)  # the forward's counts
        return dlogits_options(x, t, stats[:m], g_ce, g_z, o, w).to(out_dtype)
