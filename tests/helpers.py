"""Test helpers over the library's one reference and one tolerance rule (fastsoftmax.reference)."""

from __future__ import annotations

import torch

from fastsoftmax.reference import compare, random_logits, special_rows  # noqa: F401

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WORST: dict[str, float] = {}  # worst err/tol seen per output dtype, printed at the end of the run


def assert_close(y: torch.Tensor, x: torch.Tensor, dim: int, log: bool, out_dtype=None) -> float:
    """y must match the float64 oracle of x under the library's tolerance rule; returns err/tol."""
    err, problem = compare(y, x, dim, log, out_dtype)
    assert problem is None, problem
    key = str(out_dtype or x.dtype).removeprefix("torch.")
    WORST[key] = max(WORST.get(key, 0.0), err)
    return err
