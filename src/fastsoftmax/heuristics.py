"""The one table that chooses a kernel path and its launch shape. No autotuning at call time.

Paths (forward):
  rowblock  the row tile is held in registers: 1 read + 1 write of x/y. Short rows are packed several to a
            program so that a program moves at least ``TILE`` elements.
  online    rows too long for registers: pass 1 keeps a running max and a rescaled running sum (Milakov &
            Gimelshein 2018), pass 2 normalises: 2 reads + 1 write, any length.

Thresholds are first estimates (2026-11-29), to be regenerated from H200 measurements by the benchmark
issue; ``ptxas`` reports no spills for any rowblock shape this table can produce (tests/test_snapshot.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace

PATHS = ("rowblock", "online")

ROWBLOCK_MAX_N = 16384  # longest row one program holds in registers (elements)
TILE = 4096  # elements a rowblock program should move at least (rows are packed up to this)
ONLINE_BLOCK = 4096  # elements per online chunk along the row, contiguous rows
STRIDED_ROWS = 64  # rows per program when rows, not the softmax dim, are contiguous
ELEMS_PER_THREAD = 16  # target fp32 values per thread in a tile


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
    copied: bool = False  # x was copied to contiguous first


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(elems: int) -> int:
    return min(16, max(1, _pow2(elems // (32 * ELEMS_PER_THREAD))))


def forward_shape(n: int, n_rows: int, rows_contiguous: bool, path: str | None = None):
    """(path, block_n, rows per program, num_warps) for rows of length n; ``path`` forces the path."""
    if rows_contiguous:
        # The softmax dim is strided and rows are adjacent: a program takes many rows so that each load
        # instruction covers a contiguous run of rows.
        rows = min(STRIDED_ROWS, _pow2(n_rows))
        block = min(_pow2(n), max(1, TILE // rows))
    else:
        block = _pow2(n) if _pow2(n) <= ROWBLOCK_MAX_N else ONLINE_BLOCK
        rows = max(1, min(TILE // block, _pow2(n_rows)))
    if path is None:
        path = "rowblock" if block >= n else "online"
    elif path == "rowblock":
        block = _pow2(n)
    return path, block, rows, _warps(rows * block)


# Test hooks: force a path or launch shape, poison outputs, and read back what ran (per thread).
_state = threading.local()


@contextmanager
def force(*, poison: bool = False, **overrides):
    """Within the block, every Triton launch uses ``overrides`` (path=, block_n=, rows=, num_warps=) and,
    with ``poison``, outputs are filled with NaN before the kernel writes them."""
    bad = set(overrides) - {"path", "block_n", "rows", "num_warps"}
    if bad:
        raise TypeError(f"force() got unknown overrides {sorted(bad)}")
    for k in ("block_n", "rows", "num_warps"):
        v = overrides.get(k)
        if v is not None and (not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise ValueError(f"{k} must be a power of two, got {v!r}")
    if "path" in overrides and overrides["path"] not in PATHS:
        raise ValueError(f"unknown path {overrides['path']!r}; valid: {', '.join(PATHS)}")
    old = getattr(_state, "force", None), getattr(_state, "poison", False)
    _state.force, _state.poison = overrides, poison
    try:
        yield
    finally:
        _state.force, _state.poison = old


def forced() -> dict | None:
    return getattr(_state, "force", None)


def poisoning() -> bool:
    return getattr(_state, "poison", False)


def record(plan: Plan) -> Plan:
    _state.last = plan
    return plan


def last_plan() -> Plan | None:
    """The plan of the last call on this thread."""
    return getattr(_state, "last", None)


def apply_overrides(plan: Plan, overrides: dict | None) -> Plan:
    return replace(plan, **overrides) if overrides else plan
