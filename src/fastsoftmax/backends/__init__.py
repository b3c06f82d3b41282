"""The backends, one class each with the same methods; dispatch.py is the only place that chooses one.

    name: str
    unavailable(x, out_dtype, dy=None, dim=-1) -> str | None
        why this backend cannot run x along dim (None: it can)
    forward(x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE) -> (y, lse | None)
        x non-empty, at least 1-d, dim non-negative; lse: fp32 logsumexp per row, x's shape without dim;
        path: the tuning table's choice for this backend, or None for its own
    backward(dy, y, dim, out_dtype, log, path=None, spec=masking.NONE) -> dx
        the same preconditions, on y; dy has y's shape
Cross-entropy (torch and Triton), on (M, V) logits with unit stride along V and (M,) targets:
    cross_entropy(x, t, w, o, out_dtype) -> (loss, z-loss, stats)
    cross_entropy_backward(x, t, w, stats, g, o, out_dtype) -> dx
        w: the class weights or None; o: options.Loss
The CUDA backend takes no mask, scale or causal (dispatch keeps such calls off it) and no cross-entropy.
"""
