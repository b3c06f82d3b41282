"""Launch rules and the test hooks around them.

One module per kernel family holds its rules, every constant with its reason: softmax_triton (the Triton
softmax paths), softmax_cuda (the CUDA C variants), cross_entropy (the Triton loss kernels). device.py
reads the GPU facts they are derived from; tables.py holds the per-GPU tables ``backend="auto"`` reads.
This module: what ran (Plan, recorded for every call so tests can check the branch) and force(), which
lets tests pick a path or a launch shape and poison outputs.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

from .lm_head import DESIGNS, FUSED, SLICED
from .softmax_cuda import VARIANTS as CUDA_PATHS
from .softmax_triton import PATHS

LCE_DESIGNS = DESIGNS + (SLICED, FUSED)

__all__ = [
    "CUDA_PATHS",
    "LCE_DESIGNS",
    "PATHS",
    "Plan",
    "force",
    "forced",
    "last_plan",
    "overridden",
    "poisoning",
    "record",
]


@dataclass(frozen=True)
class Plan:
    """What ran: recorded for every call so tests can check the branch."""

    backend: str
    path: str
    block_n: int = 0
    rows: int = 0
    num_warps: int = 0
    vec: int = 1  # elements per 16-byte access along the row (1: the row is not contiguous)
    edges: bool = False  # rows not 16-byte aligned: aligned body + scalar head/tail
    inner: bool = False  # two row groups: a program's rows run along the inner one
    copied: bool = False  # an input was copied first (x; in backward y or dy) to fit one layout
    splits: int = 1  # segments per row (split path)
    skipped: int = 0  # the LM-head loss's (row, slice) pairs whose gradient skip_eps left uncomputed
    spans: int = 0  # and its gradient tiles that spanned several slices (heuristics/lm_head.widen)
    fused: bool = False  # a cross-entropy forward as one program that also finishes (one launch)


# Test hooks: force a path or launch shape and poison outputs (process-wide: on CUDA autograd runs the
# backward on its own thread, which must obey the block too), and read back what ran (per thread).
_state = threading.local()
_open: list = []  # (overrides, poison) of each open force() block, the innermost last
_opened = [0]  # force() blocks ever opened: a replay recorded while one opened is not kept (kernels/replay.py)


@contextmanager
def force(*, poison: bool = False, **overrides):
    """Within the block, every launch (on any thread: autograd's too) uses ``overrides`` (Triton: path=,
    block_n=, rows=, num_warps=, splits=; CUDA: path= a variant, min_ctas= CTAs per SM its registers must
    allow, k_max= vectors per thread, group_max= threads per row in a CTA) and, with ``poison``,
    outputs are filled with NaN before the kernel writes them. One exception: an LM-head loss's backward
    that makes the logits again runs lce_fused exactly where its forward did, whatever ``path`` says (its
    probabilities must match the forward's logsumexp). A forward run again under another force than it
    first ran under (a non-reentrant checkpoint's, a graph traced once by aot_function) is not supported."""
    bad = set(overrides) - {"path", "block_n", "rows", "num_warps", "splits", "min_ctas", "k_max", "group_max"}
    if bad:
        raise TypeError(f"force() got unknown overrides {sorted(bad)}")
    for k in ("block_n", "rows", "num_warps", "k_max", "group_max"):
        v = overrides.get(k)
        if v is not None and (not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise ValueError(f"{k} must be a power of two, got {v!r}")
    for k in ("splits", "min_ctas"):
        if k in overrides and not (isinstance(overrides[k], int) and overrides[k] >= 1):
            raise ValueError(f"{k} must be a positive int, got {overrides[k]!r}")
    if "path" in overrides and overrides["path"] not in PATHS + CUDA_PATHS + LCE_DESIGNS:
        valid = ", ".join(dict.fromkeys(PATHS + CUDA_PATHS + LCE_DESIGNS))
        raise ValueError(f"unknown path {overrides['path']!r}; valid: {valid} (Triton: {', '.join(PATHS)})")
    entry = (overrides, poison)
    _opened[0] += 1
    _open.append(entry)
    try:
        yield
    finally:  # (its own entry, or one equal to it: another thread's block may have opened after it)
        _open.remove(entry)


def forces_opened() -> int:
    """How many force() blocks have opened in this process (on any thread)."""
    return _opened[0]


def forced() -> dict | None:
    return _open[-1][0] if _open else None


def poisoning() -> bool:
    return _open[-1][1] if _open else False


# overridden(): the number of force() blocks open (overrides or poisoning), 0 outside: a C call, no Python
# frame, for the replay's path
overridden = _open.__len__


_plans: list | None = None


@contextmanager
def recording():
    """Within the block, the plan of every call on any thread (autograd's backward thread too) is appended to
    the list this yields, in order: a test hook for the backward's plan on CUDA."""
    global _plans
    old, _plans = _plans, []
    try:
        yield _plans
    finally:
        _plans = old


def record(plan: Plan) -> Plan:
    _state.last = plan
    if _plans is not None:
        _plans.append(plan)
    return plan


def last_plan() -> Plan | None:
    """The plan of the last call on this thread."""
    return getattr(_state, "last", None)
