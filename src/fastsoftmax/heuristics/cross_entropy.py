"""Launch rules of the Triton cross-entropy kernels (triton/cross_entropy.py): rows per program, chunk
width along the vocabulary and warps, forward and backward.

Measurements: bench/results/sweeps/cross_entropy_launch.json, sweeps/ce_backward_segments.json.
"""

from __future__ import annotations

# The backward's rows are cut into segments of at most this many chunks, one program each (dlogits need
# no reduction along the row): 1024 rows of 256000 are then 16 programs a row instead of 1, so few long rows
# fill the GPU instead of running in two uneven waves.
BWD_SEGMENT_CHUNKS = 8


# A forward of at most this many logits runs as one program over all its rows, which also finishes (the
# reduction, the counts, the targets' check): one launch and no row buffers instead of two launches and two
# buffers (as does any forward whose usual shape holds every row: one long row). Such calls are bound by
# host time (bench/results/h100_host.json). One program holds at most ONE_TILE logits at a time (8192 spill
# in fp32: test_snapshot) and ONE_ROWS rows. Its GPU time alone (a CUDA graph: checks/ce_one_program.json)
# is level with the two launches' in bf16, and above it in fp32 past one row (by less than the host time
# it saves an eager call); 64 fp32 rows of 512 took 1.7x theirs (checks/ce_one_program-3919065.json).
ONE_PROGRAM = 32768
ONE_ROWS = 16
ONE_TILE = 4096


def launch_shape(v: int, elsize: int, backward: bool, m: int = 0) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, num_warps, splits): whole short rows per program, 4096-wide chunks for long ones (the
    backward of fp32 rows: 16384). Forward at 4 warps, backward at 16: best or within 3% on 19 of the 20 swept
    cells. splits: segments per row (backward only; forward 1). A forward of m <= ONE_ROWS rows with m x v <=
    ONE_PROGRAM: all m rows in one program (ROWS >= m), chunks of at most ONE_TILE / ROWS, 8 warps."""
    if not backward and 0 < m <= ONE_ROWS and m * v <= ONE_PROGRAM:
        rows = 1 << (m - 1).bit_length()
        return rows, min(1 << (v - 1).bit_length(), max(16, ONE_TILE // rows)), 8, 1
    block = min(1 << (v - 1).bit_length(), 16384 if backward and elsize == 4 else 4096)  # next power of two
    rows = max(1, min(16, 4096 // block))
    chunks = -(-v // block)
    splits = -(-chunks // BWD_SEGMENT_CHUNKS) if backward else 1
    if backward and elsize == 2 and 2048 < v <= 4096:  # 16-bit rows of 2049-4096 classes (lce_sliced's slices):
        # 2048-wide chunks at 4 warps, 3,480-3,700 GB/s against 2,504-2,598 at 4096 / 16 (sweeps/lce_slice_launch.json)
        return 1, 2048, 4, 1
    if block >= 4096:
        return rows, block, 16 if backward else 4, splits
    return rows, block, 4 if block * rows <= 2048 else 8, splits
