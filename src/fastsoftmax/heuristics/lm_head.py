"""The LM-head loss's rules (lm_head.py): which design runs and how many rows of logits a chunk holds.

Measurements: bench/results/h200_lce.json.
"""

from __future__ import annotations

from typing import NamedTuple

DESIGNS = ("lce_chunked", "lce_recompute")  # when the gradients are computed: in the forward, in the backward
SLICED = "lce_sliced"  # the layout for small budgets: row groups x vocabulary slices (heuristics.force path=)
FUSED = "lce_fused"  # lce_sliced with its forward in one GEMM launch that keeps no logits (triton/lm_head.py)
ROWS = "rows"  # layout()'s answer for row chunks (DESIGNS: design() picks which)
MIN_ROWS = 2048  # fewer rows cost a read and write of dW per chunk more often: 1.12x the GEMMs at 1024 rows,
# 1.06x at 2048, 1.05x at 4096 (8192 x 4096 x 128256 bf16; bench/results/sweeps/lce_chunk_rows.json)


def design(reduction: str, forced: str | None) -> str:
    """'lce_chunked' (the forward computes the gradients too, from each chunk's logits while they are in
    memory: 3 GEMMs in all) wherever a scalar loss lets the backward only scale them; 'lce_recompute' (the
    backward computes each chunk's logits again: 4 GEMMs) for per-row losses, whose upstream gradient is
    not known in the forward (a forced lce_chunked too)."""
    if reduction == "none":
        return "lce_recompute"
    return forced if forced in DESIGNS else "lce_chunked"


# lce_sliced against row chunks, a time model of each (layout()), from the H200 (bench/results/h200_lce.json):
GEMM_FLOPS = {2: 6.6e14, 4: 5.0e13}  # cuBLAS's rate by element size (bf16 / fp16; fp32 without TF32)
DW_BYTES_S = 4.0e12  # HBM bytes a second of a pass that reads and adds into dW
HOST_CHUNK_S = 2.5e-4  # host time a row chunk takes (a GEMM, 2 loss kernels, 2 GEMMs; 68 chunks: 19.3 ms)
HOST_TILE_S = 2.0e-4  # and a tile of lce_sliced (2 GEMMs and a kernel, then 3 GEMMs and a kernel)
HOST_FUSED_TILE_S = 1.0e-4  # and of lce_fused (a Triton GEMM, 2 GEMMs): on the H100 at 8192 x 2048 x 32000, 432
# rows x 4096 classes, 152 tiles took the host 13.5 ms where 73 row chunks took 15.7 (0.41 of a chunk's time
# a tile, HOST_CHUNK_S's scale); their GPU time, 12.2 ms from a CUDA graph, is then the call's: 13.2-14.9 ms
# against 20.5 for row chunks (bench/results/sweeps/h100_lce_fused_rows.json)
FUSED_GEMM_COST = 2.0  # lce_fused's Triton GEMMs (the forward's, a tile's dlogits) over cuBLAS's time: 1.4-2.2x on
# the H100 (investigations/h100_lce_fused_gemm.json); it wins only where the sliced tiles are host-bound
SLICE_COLS = 4096  # a slice's classes where the budget allows: one block of the loss kernels, GEMMs of
# N x 4096 run at the floor's rate (the dx GEMM's fp32 sums, read and written once a slice, stay hidden)
ROW_ALIGN = 16  # a group's rows: a multiple of 16 keeps each group's views 16-byte aligned (one compile)
SKIP_SPAN = 4  # a skip's gradient tile may span this many slices (widen()): the union of their live rows
SKIP_PAIR_BYTES = 4 + 2 + 8 + -(-(2 + 8) // SKIP_SPAN)  # a skip's (row, slice) pair: its largest logit, live
# flags (two groups') and row index, and its share of a span's flags and index
GATHER_SHARE = 0.5  # a skip's slice whose live rows are at most this share of the group's runs on them alone
# (gathered: their x rows in x's dtype and their dx parts in fp32, in the budget); more run the whole tile


def layout(
    n: int, d: int, v: int, elsize: int, memory: int | None, forced: str | None, skip: bool = False,
    recompute: bool = False, fusable: bool = False,
) -> str:  # fmt: skip
    """How the loss's gradients run: ROWS (row chunks, every class), SLICED (row groups x vocabulary slices:
    lm_head.py's lce_sliced, the tensor-parallel head's backward) or FUSED (the same tiles, lce_fused: its
    forward one GEMM launch with the loss in its epilogue, a tile's dlogits straight from one GEMM; where
    ``fusable``, the one-GPU loss). A forced path decides. Else row chunks where the budget holds every
    row's logits (no skip asked), and otherwise the fastest by a time model: row chunks do 3 GEMMs (4 where
    the backward computes the logits again anyway: ``recompute``, as lce_recompute and the tensor-parallel
    head do) but read and write all of dW once a chunk; tiles do 4 GEMMs and pass over dW once a group;
    lce_fused's two Triton GEMMs take FUSED_GEMM_COST times cuBLAS's, but a tile costs the host
    HOST_FUSED_TILE_S, not HOST_TILE_S. Each one's time is its GPU work or its host's, the larger (small
    budgets make many small tiles, and the host cannot keep the GPU busy). With a ``skip`` (only tiles
    skip), the data decides how much GPU work it saves, not the host's time a tile: tiles run unless that
    alone passes row chunks' whole time (a small problem at a small budget: ROWS, and ops/lm_head.py then
    runs the call exactly, in the layout picked without the skip)."""
    if forced is not None and forced in DESIGNS + (SLICED, FUSED):
        return forced if forced in (SLICED, FUSED) else ROWS
    rows = memory // max(v * elsize, 1) if memory else n
    if rows >= n and not skip:
        return ROWS
    gemm = 2 * n * d * v / GEMM_FLOPS.get(elsize, GEMM_FLOPS[4])
    dw_pass = 2 * v * d * elsize / DW_BYTES_S
    chunks = -(-n // max(rows, 1))
    group, cols = slice_plan(n, d, v, elsize, memory, skip)
    groups, tiles = -(-n // group), -(-n // group) * -(-v // cols)
    t_rows = max((4 if recompute else 3) * gemm + (chunks - 1) * dw_pass, chunks * HOST_CHUNK_S)
    passes = (groups - 1) * dw_pass
    t_sliced = max(4 * gemm + passes, tiles * HOST_TILE_S)
    t_fused = max((2 + 2 * FUSED_GEMM_COST) * gemm + passes, tiles * HOST_FUSED_TILE_S) if fusable else t_sliced
    best, host = (FUSED, HOST_FUSED_TILE_S) if t_fused < t_sliced else (SLICED, HOST_TILE_S)
    if skip:
        return best if tiles * host < t_rows else ROWS
    return best if min(t_sliced, t_fused) < t_rows else ROWS


def sliced(
    n: int, d: int, v: int, elsize: int, memory: int | None, forced: str | None, skip: bool = False,
    recompute: bool = False,
) -> bool:  # fmt: skip
    """Whether the gradients run in row groups x vocabulary slices (lce_sliced; layout() without lce_fused):
    the tensor-parallel head's backward."""
    return layout(n, d, v, elsize, memory, forced, skip, recompute) != ROWS


def slice_plan(n: int, d: int, v: int, elsize: int, memory: int | None, skip: bool = False) -> tuple[int, int]:
    """(rows a group, classes a slice) for ``memory`` bytes: a group's working set is a slice of its logits
    (rows x classes, x's dtype) and its dx sums in fp32 (rows x d); with a ``skip``, its gathered live rows
    too (up to GATHER_SHARE of the rows: x's rows and their dx parts in fp32) and, per (row, slice), its
    largest logit (fp32), live flag and index (SKIP_PAIR_BYTES). SLICE_COLS classes, as many rows as then
    fit (a multiple of ROW_ALIGN, the groups evened out); one group where all rows fit, its slices widened
    to the rest of the budget (not for a ``skip``: it drops a row's slices where all of the row's
    probabilities are negligible, and wide ones would rarely be); narrower slices where not even ROW_ALIGN
    rows fit."""

    def per_row(cols: int) -> int:  # (beside the slice's logits)
        return 4 * d + (int(GATHER_SHARE * (elsize + 4) * d) + -(-v // cols) * SKIP_PAIR_BYTES if skip else 0)

    cols = min(SLICE_COLS, v)
    memory = memory or MIN_ROWS * (cols * elsize + per_row(cols))  # (none given: the path forced, or a skip)
    rows = memory // (cols * elsize + per_row(cols))
    if rows < ROW_ALIGN:  # a small budget: ROW_ALIGN rows, the slice what is left (at least 128 classes)
        cols = min(v, max(128, (memory // ROW_ALIGN - per_row(128)) // elsize // 128 * 128))
        rows = max(1, memory // (cols * elsize + per_row(cols)))
    if rows >= n:  # one group: the rest of the budget widens the slices
        wide = (memory - 4 * d * n) // max(elsize * n, 1)
        return n, cols if skip else min(v, max(cols, wide // SLICE_COLS * SLICE_COLS))
    if rows >= ROW_ALIGN:
        rows -= rows % ROW_ALIGN
        per = -(-n // -(-n // rows))  # the groups evened out
        rows = min(rows, -(-per // ROW_ALIGN) * ROW_ALIGN)
    return rows, cols


def widen(m: int, counts: list, union: int, widths: list, d: int, elsize: int, room: int) -> bool:
    """Whether a skip's gradients on SKIP_SPAN slices of a group of m rows run as one gathered tile on the
    union of their live rows (``union`` rows, every pair of them computed exactly) rather than a tile a
    slice (``counts`` live rows a slice, ``widths`` its classes): where the union fits the gather buffers
    (GATHER_SHARE of the rows) and ``room`` elements of logits, and the GEMM work it adds (3 GEMMs of the
    pairs it computes beyond the slices' tiles) costs less than the host time of the tiles it saves
    (HOST_TILE_S each: a sparse skip's tiles are small, and their launches, not their GEMMs, set its time)."""
    tiles = sum(c > 0 for c in counts)
    width = sum(widths)
    if tiles < 2 or union > m * GATHER_SHARE or union * width > room:
        return False
    per_slice = sum((c if c <= m * GATHER_SHARE else m) * w for c, w in zip(counts, widths, strict=True))
    extra = (union * width - per_slice) * 6 * d / GEMM_FLOPS.get(elsize, GEMM_FLOPS[4])
    return extra < (tiles - 1) * HOST_TILE_S


class FusedShape(NamedTuple):
    bm: int  # rows a program
    bn: int  # classes a block of its sweep
    bk: int  # features a step of each block's GEMM
    per: int  # classes a split (a program's sweep): a multiple of bn, of the skip's slice where it has one
    splits: int
    warps: int
    stages: int


FUSED_TILE = {2: (128, 128, 64), 4: (128, 64, 16)}  # (BM, BN, BK) by element size: the largest tiles whose
# epilogue spills nothing on sm_90a with every option, on Triton 3.6 and 3.8 (tests/test_snapshot.py; 16-bit
# 128 x 256 spills, and 4 warps; fp32, whose tl.dot runs on FMA units in full precision, spills at 128 x 128,
# and at BK 32 on Triton 3.6: lse_gemm with every option, 8 bytes, seen on the H100's image)
FUSED_WARPS, FUSED_STAGES = 8, 3
FUSED_WAVES = 2  # programs enough for this many per SM


def fused_shape(n: int, v: int, elsize: int, cols: int, sms: int) -> FusedShape:
    """lse_gemm's launch shape for n rows, v classes: FUSED_TILE's tile, the classes split into ranges enough
    for FUSED_WAVES programs an SM; ``cols`` > 0 (the skip's slices of cols classes, a multiple of 128 or
    all v): each range whole slices, so that one program finds each slice's largest logit."""
    bm, bn, bk = FUSED_TILE[4 if elsize == 4 else 2]
    unit = -(-max(cols, bn) // bn) * bn  # (a slice not a multiple of 128 is all v classes: one split)
    want = max(1, -(-FUSED_WAVES * sms // -(-n // bm)))  # splits wanted
    per = -(-v // want)
    per = max(unit, -(-per // unit) * unit)
    return FusedShape(bm, bn, bk, per, -(-v // per), FUSED_WARPS, FUSED_STAGES)


STEP_SHARE = 4  # a training step's LM-head loss (integrations' apply): logits of at most dW's bytes / this at a
# time. The loss runs at the step's activation peak and the backward's peak is dW above it; the default
# 2048-row chunk (525 MB at Llama 3.2 1B's 128256 classes) put the step's peak 2.7% above CCE's, dW / 4 at
# +0.09% (4096 tokens) and level (8192, 8 x 1024) for 1-1.5% of the step's time; dW / 8 level too, 7-9% slower
# (the default at every length: bench/results/h100_train_step.json; the H200's, h200_train_step.json: +0.09%
# at 4096 tokens, the lowest at 8192 and 8 x 1024, and the fastest of the four at each)


def step_memory(weight) -> int:
    """The LM-head loss's memory= in a training step (integrations/transformers.apply's default): the
    head's gradient bytes / STEP_SHARE."""
    return max(1, weight.numel() * weight.element_size() // STEP_SHARE)


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
