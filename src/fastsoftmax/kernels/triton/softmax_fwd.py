"""Softmax / log_softmax forward in Triton.

Traffic budget per element of an M×N problem (s = element size):
  rowblock  1 read of x + 1 write of y (2·s bytes); the row tile lives in registers.
  online    2 reads of x + 1 write of y (3·s bytes); any row length.
  split     as online, with each row's segments on different programs (two launches), plus 8 bytes of
            (max, sum) per segment written and read back.
Optional per-row statistic: logsumexp (fp32, 4 bytes per row), for backward passes, losses and
cross-GPU merges. Rows, edges and conventions: rows.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rows import (
    LN2,
    chunk_stats,
    in_first_split,
    load_logits,
    mask_args,
    mask_rows,
    normalise,
    prologue,
    row_edges,
    row_exp,
    row_factor,
    row_head,
    safe_max,
    stats_range,
    write_range,
)


@triton.jit
def softmax_fwd_rowblock(
    x_ptr,
    y_ptr,
    lse_ptr,
    n_b,
    n,
    n_i,
    tiles_i,
    sxb,
    sxn,
    sxi,
    syb,
    syn,
    syi,
    x_mis,
    m_ptr,
    scale,
    md1,
    md2,
    md3,
    mb0,
    mb1,
    mb2,
    mb3,
    msn,
    c_off,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    EDGES: tl.constexpr,
    Y_VEC: tl.constexpr,
    IDX64: tl.constexpr,
    LOG: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """ROWS rows per program, each held whole in registers. Precondition: BLOCK_N >= the body's
    length (n, or at most n // VEC * VEC with EDGES; the edges hold the rest)."""
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    x_ptr += bx
    y_ptr += by
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    body = row_ok[:, None] & (c < length)
    x = load_logits(
        x_ptr + xs[:, None] + c * sxn,
        body,
        row_head(h, EDGES) + c,
        mrow,
        q,
        m_ptr,
        msn,
        scale,
        c_off,
        MASK,
        CAUSAL,
        SCALED,
    )
    m = tl.max(x, axis=1)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        xe = load_logits(
            x_ptr + ox[:, None] + e_idx, e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
        )
        m = tl.maximum(m, tl.max(xe, axis=1))
    m_safe = safe_max(m)
    z = x - m_safe[:, None]
    e = row_exp(z)
    s = tl.sum(e, axis=1)
    if EDGES:
        ze = xe - m_safe[:, None]
        ee = row_exp(ze)
        s += tl.sum(ee, axis=1)
    f = row_factor(s, LOG)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + ys[:, None] + c * syn, normalise(z, e, f, LOG).to(out_ty), mask=body)
    if EDGES:
        tl.store(y_ptr + oy[:, None] + e_idx, normalise(ze, ee, f, LOG).to(out_ty), mask=e_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + row, m_safe + tl.math.log2(s) * LN2, mask=row_ok)


@triton.jit
def softmax_fwd_online(
    x_ptr,
    y_ptr,
    lse_ptr,
    n_b,
    n,
    n_i,
    tiles_i,
    sxb,
    sxn,
    sxi,
    syb,
    syn,
    syi,
    x_mis,
    m_ptr,
    scale,
    md1,
    md2,
    md3,
    mb0,
    mb1,
    mb2,
    mb3,
    msn,
    c_off,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    EDGES: tl.constexpr,
    Y_VEC: tl.constexpr,
    IDX64: tl.constexpr,
    LOG: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Rows of any length in BLOCK_N chunks: pass 1 carries (max, rescaled sum), pass 2 normalises."""
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    x_ptr += bx
    y_ptr += by
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    hc = row_head(h, EDGES)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        xe = load_logits(
            x_ptr + ox[:, None] + e_idx, e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
        )
        m, s = chunk_stats(xe)
    n_chunks = tl.cdiv(n, BLOCK_N)
    m, s = stats_range(
        x_ptr,
        xs,
        c,
        row_ok,
        length,
        sxn,
        0,
        n_chunks,
        m,
        s,
        hc,
        mrow,
        q,
        m_ptr,
        msn,
        scale,
        c_off,
        MASK,
        CAUSAL,
        SCALED,
        BLOCK_N,
    )
    m_safe = safe_max(m)
    f = row_factor(s, LOG)
    if EDGES:
        ze = xe - m_safe[:, None]
        tl.store(y_ptr + oy[:, None] + e_idx, normalise(ze, row_exp(ze), f, LOG).to(y_ptr.dtype.element_ty), mask=e_ok)
    write_range(
        x_ptr,
        y_ptr,
        xs,
        ys,
        c,
        row_ok,
        length,
        sxn,
        syn,
        0,
        n_chunks,
        m_safe,
        f,
        hc,
        mrow,
        q,
        m_ptr,
        msn,
        scale,
        c_off,
        MASK,
        CAUSAL,
        SCALED,
        LOG,
        BLOCK_N,
    )
    if WRITE_LSE:
        tl.store(lse_ptr + row, m_safe + tl.math.log2(s) * LN2, mask=row_ok)


@triton.jit
def softmax_fwd_split_stats(
    x_ptr,
    ws_ptr,
    n_b,
    n,
    n_i,
    tiles_i,
    sxb,
    sxn,
    sxi,
    x_mis,
    chunks_per_split,
    n_splits,
    m_ptr,
    scale,
    md1,
    md2,
    md3,
    mb0,
    mb1,
    mb2,
    mb3,
    msn,
    c_off,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
    EDGES: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Split path, step 1 of 2: program (rows, split) writes (max, sum) of its segment of the row to the
    fp32 workspace ws[row, split, 0:2]. Split 0 also takes the edges."""
    split = tl.program_id(1)
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, 0, 0, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, False, IDX64
    )
    x_ptr += bx
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        xe = load_logits(
            x_ptr + ox[:, None] + e_idx,
            in_first_split(e_ok, split),
            e_idx,
            mrow,
            q,
            m_ptr,
            msn,
            scale,
            c_off,
            MASK,
            CAUSAL,
            SCALED,
        )
        m, s = chunk_stats(xe)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    m, s = stats_range(
        x_ptr,
        xs,
        c,
        row_ok,
        length,
        sxn,
        j0,
        j1,
        m,
        s,
        row_head(h, EDGES),
        mrow,
        q,
        m_ptr,
        msn,
        scale,
        c_off,
        MASK,
        CAUSAL,
        SCALED,
        BLOCK_N,
    )
    ws = ws_ptr + (row * n_splits + split) * 2
    tl.store(ws, m, mask=row_ok)
    tl.store(ws + 1, s, mask=row_ok)


@triton.jit
def softmax_fwd_split_write(
    x_ptr,
    y_ptr,
    lse_ptr,
    ws_ptr,
    n_b,
    n,
    n_i,
    tiles_i,
    sxb,
    sxn,
    sxi,
    syb,
    syn,
    syi,
    x_mis,
    chunks_per_split,
    n_splits,
    m_ptr,
    scale,
    md1,
    md2,
    md3,
    mb0,
    mb1,
    mb2,
    mb3,
    msn,
    c_off,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    EDGES: tl.constexpr,
    Y_VEC: tl.constexpr,
    IDX64: tl.constexpr,
    LOG: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Split path, step 2 of 2: program (rows, split) merges the row's per-split statistics (the same
    merge crosses GPUs for a vocabulary split across ranks) and normalises its segment."""
    split = tl.program_id(1)
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    x_ptr += bx
    y_ptr += by
    k = tl.arange(0, SPLITS)[None, :]
    ws_ok = row_ok[:, None] & (k < n_splits)
    ws = ws_ptr + (row[:, None] * n_splits + k) * 2
    m_k = tl.load(ws, mask=ws_ok, other=float("-inf"))
    s_k = tl.load(ws + 1, mask=ws_ok, other=0.0)
    m = tl.max(m_k, axis=1)
    s = tl.sum(s_k * row_exp(m_k - safe_max(m)[:, None]), axis=1)
    m_safe = safe_max(m)
    f = row_factor(s, LOG)
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        e_ok = in_first_split(e_ok, split)
        ze = (
            load_logits(
                x_ptr + ox[:, None] + e_idx, e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
            )
            - m_safe[:, None]
        )
        tl.store(y_ptr + oy[:, None] + e_idx, normalise(ze, row_exp(ze), f, LOG).to(y_ptr.dtype.element_ty), mask=e_ok)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    write_range(
        x_ptr,
        y_ptr,
        xs,
        ys,
        c,
        row_ok,
        length,
        sxn,
        syn,
        j0,
        j1,
        m_safe,
        f,
        row_head(h, EDGES),
        mrow,
        q,
        m_ptr,
        msn,
        scale,
        c_off,
        MASK,
        CAUSAL,
        SCALED,
        LOG,
        BLOCK_N,
    )
    if WRITE_LSE:
        tl.store(lse_ptr + row, m_safe + tl.math.log2(s) * LN2, mask=in_first_split(row_ok, split))


KERNELS = {
    "rowblock": softmax_fwd_rowblock,
    "online": softmax_fwd_online,
    "split": (softmax_fwd_split_stats, softmax_fwd_split_write),
}


# ---------------------------------------------------------------------------------------------- launcher
# (imports here keep the kernels above readable on their own)
import torch  # noqa: E402

from ...core import masking  # noqa: E402
from ...core.layout import alloc, plan_layout  # noqa: E402
from ...heuristics.device import selected  # noqa: E402
from ..launch import scratch  # noqa: E402
from .launch import launch, prepare  # noqa: E402


def forward(
    x: torch.Tensor,
    dim: int,
    out_dtype: torch.dtype,
    log: bool,
    want_lse: bool,
    path: str | None = None,
    spec=masking.NONE,
):
    """(softmax or log_softmax of x along ``dim`` in out_dtype, laid out as torch.empty_like(x); its fp32
    logsumexp per row, x's shape without dim, or None). ``path``: the tuning table's choice; ``spec``: a mask,
    scale or causal rule (masking.Spec) applied as the logits load: then dim is the last dim and rows are in
    logical order."""
    y = alloc(x, out_dtype)
    with selected(x):
        x, lay = plan_layout(x, y, dim)
        if spec.active and (lay.I != 1 or lay.copied):
            raise AssertionError("masked rows must be x's rows in logical order (dispatch ensures it)")
        margs, mflags = mask_args(spec, x)
        lse = None
        if want_lse:
            lse = alloc(x, torch.float32, x.shape[:dim] + x.shape[dim + 1 :], lay.stat_strides)
        L = prepare(x, y, lay, path=path)
        lse_arg = y if lse is None else lse
        sx, sy = L.strides[:3], L.strides[3:]
        tail = dict(**L.flags, **mflags, Y_VEC=L.y_vec, LOG=log, WRITE_LSE=lse is not None, num_warps=L.plan.num_warps)
        if L.plan.path == "split":
            stats, write = KERNELS["split"]
            ws = scratch(torch.empty(L.n_rows * L.plan.splits * 2, dtype=torch.float32, device=x.device))
            args = (L.x_arg, ws, *L.rows_args, *sx, L.x_mis, L.chunks_per_split, L.plan.splits, *margs)
            launch(stats, L.grid, args, dict(**L.flags, **mflags, num_warps=L.plan.num_warps))
            args = (L.x_arg, y, lse_arg, ws, *L.rows_args, *sx, *sy, L.x_mis, L.chunks_per_split, L.plan.splits, *margs)
            launch(write, L.grid, args, dict(**tail, SPLITS=triton.next_power_of_2(L.plan.splits)))
        else:
            launch(KERNELS[L.plan.path], L.grid, (L.x_arg, y, lse_arg, *L.rows_args, *sx, *sy, L.x_mis, *margs), tail)
        return y, lse
