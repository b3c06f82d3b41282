"""Launch rules of the Triton softmax paths: the default path (where no tuning table entry names one:
heuristics/tables.py) and every launch's shape. No autotuning at call time.

Paths (forward):
  rowblock  the row tile is held in registers: 1 read + 1 write of x/y. Short rows are packed several to a
            program and warps are sized so each thread holds about BYTES_PER_THREAD bytes of row, counting
            valid (not padded) elements so that odd N gets the right warps.
  online    rows too long for registers: pass 1 keeps a running max and a rescaled running sum (Milakov &
            Gimelshein 2018), pass 2 normalises: 2 reads + 1 write, any length.
  split     online, for too few rows to fill the GPU: each row is cut into segments across programs; one
            launch writes each segment's (max, sum), a second merges them and normalises: 2 reads + 1
            write, plus 8 bytes per segment.
Backward (inputs=2: y and dy held per element): the same rules with half the row per thread; rowblock moves
3 units of traffic (y, dy, dx), online 5. Backward rows of BWD_LONG_N < N <= ROWBLOCK_MAX_N are the only
rowblock shapes ptxas spills on (a bound tests/test_snapshot.py checks); it reports no spills for any other
rowblock shape this table produces.

Measurements: bench/results/sweeps/triton_rowblock.json, triton_online.json, triton_split.json,
triton_bwd_register_cap.json.
"""

from __future__ import annotations

from typing import NamedTuple

PATHS = ("rowblock", "online", "split")

# Longest row (elements) a program holds in registers, forward and backward: past it the two-read online
# path is as fast.
ROWBLOCK_MAX_N = 32768
# Backward rows past BWD_LONG_N get BWD_LONG_WARPS on the rowblock path: 16 warps keep rowblock 1.3-1.45x
# the online path despite small spills (the forward gains nothing from more warps there).
BWD_LONG_N = 16384
BWD_LONG_WARPS = 16
# Row bytes each thread of a rowblock program holds in flight: 128 was fastest (fewer warps and packed rows
# than filling a block).
BYTES_PER_THREAD = 128
# Online chunk (elements along the row) and warps: the sweep's best on long rows, near the two-read ceiling
# (2/3 of copy).
ONLINE_BLOCK = 8192
ONLINE_WARPS = 16
# Split chunk (elements), warps and segments per row (enough for SPLIT_PROGRAMS_PER_SM programs per SM):
# best of the few-long-rows sweep in GPU time.
SPLIT_BLOCK = 4096
SPLIT_WARPS = 8
SPLIT_PROGRAMS_PER_SM = 4
# Split rows only when there are fewer than this many rows per SM: at about 2 per SM split ties the online
# path.
SPLIT_BELOW_ROWS_PER_SM = 2
MAX_SPLITS = 1024
# 32-bit registers one block may hold: CUDA's limit on every GPU Triton supports (sm_80 to sm_12x)
REGS_PER_BLOCK = 65536
STRIDED_ROWS = 64  # rows per program when rows, not the softmax dim, are contiguous
STRIDED_TILE = 4096  # elements per program then (not yet measured)


def _pow2(n: int) -> int:
    """The power of two at or above n."""
    return 1 << max(0, (n - 1).bit_length())


def _pow2_near(v: float) -> int:
    """The power of two nearest to v (v >= 1), by ratio."""
    lo = 1 << (int(v).bit_length() - 1)
    return lo * 2 if v / lo > 1.5 else lo


def row_body(n: int, vec: int) -> int:
    """Elements of an N-element row a rowblock tile must hold: its 16-byte-aligned body, at most
    n // vec * vec where rows are read in vectors of ``vec`` (triton/launch.vector_plan; vec > 1 only where
    n >= 4 * vec), the edge code holding the rest; the whole row for scalar rows (vec 1)."""
    return n // vec * vec or n  # (n < vec: no vectors, the row is scalar code)


class TritonShape(NamedTuple):
    path: str
    block_n: int
    rows: int
    num_warps: int
    splits: int = 1


def launch_shape(
    n: int,
    n_rows: int,
    elsize: int,
    rows_contiguous: bool,
    sm_count: int,
    path: str | None = None,
    inputs: int = 1,
    vec: int = 1,
) -> TritonShape:
    """The launch shape for n_rows rows of n elements of elsize bytes on a GPU of sm_count SMs; ``path``
    forces the path. ``inputs``: tensors a kernel holds per element (forward 1: x; backward 2: y and dy),
    which divides the row a rowblock program can hold in registers. ``vec``: the elements per 16-byte
    vector of the launch's vector plan (triton/launch.vector_plan; 1 for scalar rows): a rowblock tile then
    holds the row's aligned body, at most n // vec * vec elements, and the edge code the rest (N = 513 in
    bf16: a 512-wide tile, where a 1024-wide one left half its lanes idle)."""
    if rows_contiguous:
        # The softmax dim is strided and rows are adjacent: a program takes many rows so that each load
        # instruction covers a contiguous run of rows.
        rows = min(STRIDED_ROWS, _pow2(n_rows))
        block = min(_pow2(n), max(1, STRIDED_TILE // rows))
        path = path or ("rowblock" if block >= n else "online")
        if path == "rowblock":
            block = _pow2(n)
        return TritonShape(
            path, block, rows, min(16, max(1, rows * block // 512)), split_count(n, block, n_rows, sm_count, path)
        )
    if path is None and n > ROWBLOCK_MAX_N:
        few_rows = n_rows < SPLIT_BELOW_ROWS_PER_SM * sm_count
        path = "split" if few_rows and split_count(n, SPLIT_BLOCK, n_rows, sm_count, "split") > 1 else "online"
    path = path or "rowblock"
    if path == "online":
        block = min(ONLINE_BLOCK, _pow2(n))
        return TritonShape(path, block, 1, max(1, min(ONLINE_WARPS, block // 512)))
    if path == "split":
        block = min(SPLIT_BLOCK, _pow2(n))
        return TritonShape(path, block, 1, SPLIT_WARPS, split_count(n, block, n_rows, sm_count, path))
    per_warp = 32 * BYTES_PER_THREAD // (elsize * inputs)  # row elements one warp holds
    body = row_body(n, vec)
    rows = min(_pow2(n_rows), 1 << (max(1, per_warp // body).bit_length() - 1))
    warps = min(32, _pow2_near(max(1.0, body * rows / per_warp)))
    if inputs > 1 and body > BWD_LONG_N:
        warps = BWD_LONG_WARPS
    return TritonShape(path, _pow2(body), rows, warps)


def max_registers(shape, inputs: int) -> int | None:
    """The register cap (Triton's maxnreg) of a launch whose ``shape`` (a TritonShape, or the Plan recorded
    from one: its path, block_n and num_warps) runs a rowblock program, or None to leave ptxas its own choice
    (every other path, and short rows). Backward tiles past BWD_LONG_N (those of rows whose body is past
    it: launch_shape's long rows): every register a thread may have at that block size. Without the cap
    ptxas (Triton 3.6's) chose 32 registers and 1,520 bytes of spills for fp32 softmax rows that are not a
    multiple of 4 elements (the edge code), 128 and 136 bytes with it, as for even rows
    (tests/test_snapshot.py): without it the odd rows ran 3-5x slower. 8 warps, faster for fp32 softmax,
    would spill 572 bytes in fp32 log_softmax, so these rows keep 16 until a tune times log_softmax too."""
    if shape.path == "rowblock" and inputs > 1 and shape.block_n > BWD_LONG_N:
        return min(255, REGS_PER_BLOCK // (32 * shape.num_warps))
    return None


def split_count(n: int, block: int, n_rows: int, sm_count: int, path: str) -> int:
    """Segments per row on the split path: enough programs for SPLIT_PROGRAMS_PER_SM per SM, at least
    one chunk each."""
    if path != "split":
        return 1
    chunks = -(-n // block)
    want = -(-SPLIT_PROGRAMS_PER_SM * sm_count // n_rows)
    return max(1, min(chunks, want, MAX_SPLITS))
