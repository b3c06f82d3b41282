"""The LM-head loss's rules (lm_head.py): which design runs and how many rows of logits a chunk holds.

Measurements: bench/results/h200_lce.json.
"""

from __future__ import annotations

import math

DESIGNS = ("lce_chunked", "lce_recompute")  # when the gradients are computed: in the forward, in the backward
SLICED = "lce_sliced"  # the layout for small budgets: row groups x vocabulary slices (heuristics.force path=)
MIN_ROWS = 2048  # fewer rows cost a read and write of dW per chunk more often: 1.12x the GEMMs at 1024 rows,
# 1.06x at 2048, 1.05x at 4096 (8192 x 4096 x 128256 bf16; bench/results/sweeps/lce_chunk_rows.json)
SLICE_ALIGN = 128  # a slice's columns: a multiple of the GEMMs' tile


def design(reduction: str, forced: str | None) -> str:
    """'lce_chunked' (the forward computes the gradients too, from each chunk's logits while they are in
    memory: 3 GEMMs in all) wherever a scalar loss lets the backward only scale them; 'lce_recompute' (the
    backward computes each chunk's logits again: 4 GEMMs) for per-row losses, whose upstream gradient is
    not known in the forward (a forced lce_chunked too)."""
    if reduction == "none":
        return "lce_recompute"
    return forced if forced in DESIGNS else "lce_chunked"


def sliced(n: int, v: int, elsize: int, memory: int | None, forced: str | None) -> bool:
    """Whether the Triton loss runs in row groups x vocabulary slices (lm_head.py's lce_sliced): where an
    explicit ``memory`` holds fewer than MIN_ROWS rows of logits (and fewer than n), row chunks would read and
    write all of dW once per chunk; slices write each part of dW once per row group instead."""
    if forced is not None and forced in DESIGNS + (SLICED,):
        return forced == SLICED
    return bool(memory) and memory // max(v * elsize, 1) < min(MIN_ROWS, n)


def slice_plan(n: int, d: int, v: int, elsize: int, memory: int | None, forced: dict | None) -> tuple[int, int]:
    """(rows a group, columns a slice) for ``memory`` bytes: a group's working set is its slice of logits
    (rows x columns, x's dtype) and its dx sums in fp32 (rows x d). About sqrt(memory) columns balance the
    two costs that grow as the budget shrinks: the dx sums are read and written once a slice (n v d / cols
    bytes in all), dW once a group (n v d / rows). Forced rows= and block_n= (tests) override."""
    memory = memory or 1
    cols = min(max(math.isqrt(memory) // SLICE_ALIGN * SLICE_ALIGN, SLICE_ALIGN), v)
    rows = memory // (cols * elsize + 4 * d)
    if rows >= n:  # one group: the rest of the budget widens the slices
        rows = n
        cols = min(max(cols, (memory - 4 * d * n) // max(elsize * n, 1) // SLICE_ALIGN * SLICE_ALIGN), v)
    rows = max(rows, 1)
    rows = -(-n // -(-n // rows))  # the groups evened out (no short last group)
    f = forced or {}
    return max(1, min(f.get("rows", rows), n)), max(1, min(f.get("block_n", cols), v))


def free_bytes(x) -> int | None:
    """Bytes the caching allocator can hand out on x's GPU (None on the CPU, and while a CUDA graph is
    captured: its chunks must not depend on what is free then)."""
    import torch

    if not x.is_cuda or torch.cuda.is_current_stream_capturing():
        return None
    free, _ = torch.cuda.mem_get_info(x.device)
    return free + torch.cuda.memory_reserved(x.device) - torch.cuda.memory_allocated(x.device)


def rows_per_chunk(x, v: int, memory: int | None) -> int:
    """Rows of (n, d) x whose logits against v classes a chunk holds (``memory`` bytes, or the rule's choice
    from the problem and the free memory where None or 0)."""
    n, d = x.shape
    return chunk_rows(n, d, v, x.element_size(), memory if memory else None, free_bytes(x))


def chunk_rows(n: int, d: int, v: int, elsize: int, memory: int | None, free: int | None) -> int:
    """Rows of logits per chunk: ``memory`` bytes of them when given (at least one row). Else about (n - d) / 2 rows,
    at least MIN_ROWS: the peak (dW + dx + the chunk) is then half of the materialised loss's (n rows of
    logits + dW + dx), where the shapes allow it; the chunks evened out (no short last chunk), at most a
    quarter of the free device memory. Never more than n."""
    if memory is not None:
        rows = memory // max(v * elsize, 1)
    else:
        rows = max((n * v - v * d - n * d) // (2 * v), MIN_ROWS)  # rows * V = (n * V - dW - dx) / 2
        if free is not None:
            rows = min(rows, free // 4 // max(v * elsize, 1))
        rows = max(rows, 1)
        chunks = max(-(-n // rows), 1)
        rows = -(-n // chunks)
        rows = -(-rows // 64) * 64  # GEMM-friendly (the chunk count stays)
    return max(1, min(rows, max(n, 1)))
