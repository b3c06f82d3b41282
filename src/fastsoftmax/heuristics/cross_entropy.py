"""Launch rules of the Triton cross-entropy kernels (triton/cross_entropy.py): rows per program, chunk
width along the vocabulary and warps, forward and backward.

Measurements: bench/results/sweeps/cross_entropy_launch.json.
"""

from __future__ import annotations


def launch_shape(v: int, elsize: int, backward: bool) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps): whole short rows per program, 4096-wide chunks for long ones (the backward
    of fp32 rows: 16384). Forward at 4 warps, backward at 16: best or within 3% on 19 of the 20 swept cells."""
    block = min(1 << (v - 1).bit_length(), 16384 if backward and elsize == 4 else 4096)  # next power of two
    rows = max(1, min(16, 4096 // block))
    if block >= 4096:
        return rows, block, 16 if backward else 4
    return rows, block, 4 if block * rows <= 2048 else 8
