"""The one table that chooses a kernel path and its launch shape. No autotuning at call time.

Paths (forward):
  rowblock  the row tile is held in registers: 1 read + 1 write of x/y. Short rows are packed several to a
            program and warps are sized so each thread holds about BYTES_PER_THREAD bytes of row.
  online    rows too long for registers: pass 1 keeps a running max and a rescaled running sum (Milakov &
            Gimelshein 2018), pass 2 normalises: 2 reads + 1 write, any length.
  split     online, for too few rows to fill the GPU: each row is cut into segments across programs; one
            launch writes each segment's (max, sum), a second merges them and normalises: 2 reads + 1
            write, plus 8 bytes per segment.

Measured on an NVIDIA H200 on 2026-11-29 (dev/sweep_forward.py, triton 3.6, torch 2.11; copy 4,251 GB/s):
  - rowblock is fastest with about 128 bytes of row per thread in flight (8 16-byte vectors): fewer warps
    and fewer packed rows than a "fill the block" rule gives. 262144x513 bf16: 700 GB/s with 4 rows and
    8 warps, 3,340 with 2 rows and 1 warp; fp32 4,148. Counting valid (not padded) elements picks the
    right warps for odd N (bf16 N=2053: 1 warp 3,469 GB/s, 2 warps 2,941).
  - rowblock beats online up to N = 32768 (bf16 4096x32000: 3,257 vs 2,865 GB/s; fp32 4,067 vs 2,784).
  - online: 8192-element chunks, 16 warps (bf16 2048x65536: 2,886 GB/s; fp32 2,855), near the 2-read
    ceiling of 2/3 of copy.
  - split (few long rows), GPU time from CUDA-graph replays (dev/bench_graphs.py): bf16 8x131072 449 GB/s
    (online 128, torch 117), 64x131072 1,606 (910), 4x2^20 1,046 (74); fp32 4x2^20 1,748 (123). Even at
    256 rows it ties online (bf16 1,992 vs 2,009), at 512 rows it is within 4% either way, so rows split
    below 2 per SM. Timed eagerly, small shapes measure host launch overhead instead (split's two
    launches: 25 GB/s at 8x131072), which the benchmark issue addresses.
Backward (inputs=2: y and dy held per element): the same rules with half the row per thread (rowblock up
to N = 16384 until 2026-11-29; now up to 32768, below). Measured 2026-11-29 (dev/sweep_forward.py bwd,
bench_quick.py bwd; copy 4,223 GB/s):
rowblock 4,220-4,335 GB/s for N = 256..16384 (bf16 N = 513: 3,476), online 2,550-2,900 (5 units of
traffic: the 3/5 ceiling), split best for few long rows in GPU time (bf16 8x131072 612 vs torch 248).
Not taken (they spill, see test_no_spills): bf16 rowblock at N = 32000 (3,722 vs online 2,844), bf16
N = 16384 with 4 warps (4,180 vs 3,914).
Backward rows of 16384 < N <= 32768: rowblock with 16 warps (BWD_LONG_WARPS), though ptxas spills 36-80
bytes per thread there (fp32 log_softmax: 168; the only rowblock shapes that spill, as tests/test_snapshot.py
checks), because it is 1.3-1.45x the 2-read online path: measured 2026-11-29 (dev/sweep_launch.py rowblock, copy 4,247
GB/s) bf16 4096x32000 4,106 GB/s (8 warps 3,847, 32 warps 3,757; online 2,840), 4096x32768 4,120; fp32
4096x32768 3,860 (8 warps 4,050 with 255 registers, 32 warps 3,013; online 2,890). The forward gains
nothing from more warps there (bf16 4096x32768: 16 warps 3,299, 32 warps 3,272) nor from rowblock past
32768 (bf16 2048x65536 2,792 vs online 2,838).
ptxas reports no spills for any other rowblock shape this table produces (tests/test_snapshot.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

PATHS = ("rowblock", "online", "split")  # the Triton backend's
CUDA_PATHS = ("three_pass", "warp", "block", "cluster", "online", "staged")  # the CUDA backend's variants

ROWBLOCK_MAX_N = 32768  # longest row one program holds in registers (elements), forward and backward
BWD_LONG_N = 16384  # backward rows longer than this get BWD_LONG_WARPS on the rowblock path
BWD_LONG_WARPS = 16
BYTES_PER_THREAD = 128  # row bytes each thread of a rowblock program holds
ONLINE_BLOCK = 8192  # elements per online chunk along the row
ONLINE_WARPS = 16
SPLIT_BLOCK = 4096  # elements per chunk on the split path
SPLIT_WARPS = 8
SPLIT_PROGRAMS_PER_SM = 4  # segments per row: enough for this many programs per SM
SPLIT_BELOW_ROWS_PER_SM = 2  # split rows when there are fewer than this many rows per SM
MAX_SPLITS = 1024
STRIDED_ROWS = 64  # rows per program when rows, not the softmax dim, are contiguous
STRIDED_TILE = 4096  # elements per program then (not yet measured)


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


def _pow2(n: int) -> int:
    """The power of two at or above n."""
    return 1 << max(0, (n - 1).bit_length())


def _pow2_near(v: float) -> int:
    """The power of two nearest to v (v >= 1), by ratio."""
    lo = 1 << (int(v).bit_length() - 1)
    return lo * 2 if v / lo > 1.5 else lo


class Shape(NamedTuple):
    path: str
    block_n: int
    rows: int
    num_warps: int
    splits: int = 1


def launch_shape(
    n: int, n_rows: int, elsize: int, rows_contiguous: bool, sm_count: int, path: str | None = None, inputs: int = 1
) -> Shape:
    """The launch shape for n_rows rows of n elements of elsize bytes on a GPU of sm_count SMs; ``path``
    forces the path. ``inputs``: tensors a kernel holds per element (forward 1: x; backward 2: y and dy),
    which divides the row a rowblock program can hold in registers."""
    if rows_contiguous:
        # The softmax dim is strided and rows are adjacent: a program takes many rows so that each load
        # instruction covers a contiguous run of rows.
        rows = min(STRIDED_ROWS, _pow2(n_rows))
        block = min(_pow2(n), max(1, STRIDED_TILE // rows))
        path = path or ("rowblock" if block >= n else "online")
        if path == "rowblock":
            block = _pow2(n)
        return Shape(
            path, block, rows, min(16, max(1, rows * block // 512)), split_count(n, block, n_rows, sm_count, path)
        )
    if path is None and n > ROWBLOCK_MAX_N:
        few_rows = n_rows < SPLIT_BELOW_ROWS_PER_SM * sm_count
        path = "split" if few_rows and split_count(n, SPLIT_BLOCK, n_rows, sm_count, "split") > 1 else "online"
    path = path or "rowblock"
    if path == "online":
        block = min(ONLINE_BLOCK, _pow2(n))
        return Shape(path, block, 1, max(1, min(ONLINE_WARPS, block // 512)))
    if path == "split":
        block = min(SPLIT_BLOCK, _pow2(n))
        return Shape(path, block, 1, SPLIT_WARPS, split_count(n, block, n_rows, sm_count, path))
    per_warp = 32 * BYTES_PER_THREAD // (elsize * inputs)  # row elements one warp holds
    rows = min(_pow2(n_rows), 1 << (max(1, per_warp // n).bit_length() - 1))
    warps = min(32, _pow2_near(max(1.0, n * rows / per_warp)))
    if inputs > 1 and n > BWD_LONG_N:
        warps = BWD_LONG_WARPS
    return Shape(path, _pow2(n), rows, warps)


def max_registers(n: int, num_warps: int, inputs: int) -> int | None:
    """The register cap (Triton's maxnreg) for a rowblock program, or None to leave ptxas its own choice.
    Backward rows past BWD_LONG_N: every register a thread may have at that block size. Without the cap
    ptxas (Triton 3.6's) chose 32 registers and 1,520 bytes of spills for fp32 softmax rows that are not a
    multiple of 4 elements (the edge code), 128 and 136 bytes with it, as for even rows
    (tests/test_snapshot.py). Measured 2026-11-30 on the H200 (dev/sweep_launch.py oddbwd, 16 warps): fp32
    3276x20481 575 -> 2,601 GB/s, 2048x32001 809 -> 2,748 (2048x32768: 3,668 -> 3,768). 8 warps measured
    faster still for fp32 softmax (2,965-3,126 at odd N, 3,905 at 32768) but spill 572 bytes for fp32
    log_softmax (Triton 3.6): left for a tune that times log_softmax too."""
    if inputs > 1 and n > BWD_LONG_N:
        return min(255, 65536 // (32 * num_warps))
    return None


def split_count(n: int, block: int, n_rows: int, sm_count: int, path: str) -> int:
    """Segments per row on the split path: enough programs for SPLIT_PROGRAMS_PER_SM per SM, at least
    one chunk each."""
    if path != "split":
        return 1
    chunks = -(-n // block)
    want = -(-SPLIT_PROGRAMS_PER_SM * sm_count // n_rows)
    return max(1, min(chunks, want, MAX_SPLITS))


# Test hooks: force a path or launch shape and poison outputs (process-wide: on CUDA autograd runs the
# backward on its own thread, which must obey the block too), and read back what ran (per thread).
_state = threading.local()
_force: dict | None = None
_poison = False


@contextmanager
def force(*, poison: bool = False, **overrides):
    """Within the block, every launch (on any thread: autograd's too) uses ``overrides`` (Triton: path=,
    block_n=, rows=, num_warps=, splits=; CUDA: path= a variant, min_ctas= CTAs per SM its registers must
    allow, k_max= vectors per thread, group_max= threads per row in a CTA) and, with ``poison``,
    outputs are filled with NaN before the kernel writes them."""
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
    if "path" in overrides and overrides["path"] not in PATHS + CUDA_PATHS:
        valid = ", ".join(dict.fromkeys(PATHS + CUDA_PATHS))
        raise ValueError(f"unknown path {overrides['path']!r}; valid: {valid} (Triton: {', '.join(PATHS)})")
    global _force, _poison
    old = _force, _poison
    _force, _poison = overrides, poison
    try:
        yield
    finally:
        _force, _poison = old


def forced() -> dict | None:
    return _force


def poisoning() -> bool:
    return _poison


def overridden() -> bool:
    """Whether a force() block is active (overrides or poisoning): one read for the hot path."""
    return _force is not None


def record(plan: Plan) -> Plan:
    _state.last = plan
    return plan


def last_plan() -> Plan | None:
    """The plan of the last call on this thread."""
    return getattr(_state, "last", None)
