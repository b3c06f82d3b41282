"""Softmax / log_softmax backward in Triton.

  softmax:      dx = y * (dy - sum(y * dy))
  log_softmax:  dx = dy - exp(y) * sum(dy)
Both are dx = a - f * s with, per element, a = y*dy, f = y (softmax) or a = dy, f = exp(y) (log_softmax),
and s = sum(a) over the row. t = sum(f) over the row is 0 exactly when the row was fully masked (all y = 0,
or all y = -inf): such rows get dx = 0, never NaN, whatever dy holds. NaN in dy or y propagates (as torch).

Traffic budget per element (s = element size of y, dy, dx):
  rowblock  1 read of y + 1 read of dy + 1 write of dx (3·s bytes); y and dy rows held in registers.
  online    2 reads of y and dy + 1 write of dx (5·s bytes); any row length.
  split     as online, segments of a row on different programs, plus 8 bytes of (s, t) per segment.

Same row geometry as the forward (rows.py): y is the anchor; dy shares y's strides
and 16-byte misalignment (the launcher copies dy into y's layout when it does not); dy keeps its dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .rows import in_first_split, mask_rows, prologue, row_edges, row_exp, row_head


@triton.jit
def _load_terms(y_ptr, dy_ptr, offs, mask, LOG: tl.constexpr):
    """(a, f) per element, fp32; masked lanes give a = f = 0 (y loads as -inf for log_softmax, 0 else)."""
    if LOG:
        y = tl.load(y_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        a = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        f = row_exp(y)
    else:
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        a = y * tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        f = y
    return a, f


@triton.jit
def _grad(a, f, s, t):
    # t == 0: a fully masked row, whose gradient is 0 even where dy is NaN or inf.
    return tl.where((t == 0)[:, None], 0.0, a - f * s[:, None])


@triton.jit
def _finish(
    g, ok, col, mrow, q, m_ptr, msn, scale, c_off, MASK: tl.constexpr, CAUSAL: tl.constexpr, SCALED: tl.constexpr
):
    """dx from the plain gradient g when the forward had a scale, a mask or the causal rule: times scale, and
    0 at masked positions (False in a bool mask, -inf in an additive one, above the causal diagonal)."""
    if SCALED:
        g = g * scale
    if MASK == 1:
        g = tl.where(tl.load(m_ptr + mrow[:, None] + col * msn, mask=ok, other=1) != 0, g, 0.0)
    if MASK == 2:
        g = tl.where(tl.load(m_ptr + mrow[:, None] + col * msn, mask=ok, other=0.0) == float("-inf"), 0.0, g)
    if CAUSAL:
        g = tl.where(col <= q[:, None] + c_off, g, 0.0)
    return g


@triton.jit
def _sums_range(
    y_ptr, dy_ptr, xs, c, ok, length, sxn, j0, j1, s, t, LOG: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Add chunks j0 <= j < j1 of the body to the row sums (s, t). A row sum inside the loop is rewritten by
    Triton 3.6 into thread-local partial sums through a reshape that may reorder elements: harmless for one
    row per program, but on tiles where a thread holds several rows (64 rows at 1 warp) it mixed rows, wrong
    gradients on the H200 (Triton 3.8 does not rewrite it; docs/investigations.md). Several rows: the chunks
    are summed element-wise and reduced once after the loop (more registers, so one row keeps the in-loop sum
    that was measured)."""
    sa = tl.zeros([ROWS, BLOCK_N], tl.float32)
    ta = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for j in range(j0, j1):
        cols = j * BLOCK_N + c
        a, f = _load_terms(y_ptr, dy_ptr, xs[:, None] + cols * sxn, ok[:, None] & (cols < length), LOG)
        if ROWS == 1:
            s += tl.sum(a, axis=1)
            t += tl.sum(f, axis=1)
        else:
            sa += a
            ta += f
    if ROWS > 1:
        s += tl.sum(sa, axis=1)
        t += tl.sum(ta, axis=1)
    return s, t


@triton.jit
def _grad_range(
    y_ptr,
    dy_ptr,
    dx_ptr,
    xs,
    ys,
    c,
    ok,
    length,
    sxn,
    syn,
    j0,
    j1,
    s,
    t,
    hc,
    mrow,
    q,
    m_ptr,
    msn,
    scale,
    c_off,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
    LOG: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write dx for chunks j0 <= j < j1, last first (the likeliest still in L2)."""
    for k in range(j0, j1):
        cols = (j1 - 1 - (k - j0)) * BLOCK_N + c
        body = ok[:, None] & (cols < length)
        a, f = _load_terms(y_ptr, dy_ptr, xs[:, None] + cols * sxn, body, LOG)
        g = _finish(_grad(a, f, s, t), body, hc + cols, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED)
        tl.store(dx_ptr + ys[:, None] + cols * syn, g.to(dx_ptr.dtype.element_ty), mask=body)


@triton.jit
def softmax_bwd_rowblock(
    y_ptr,
    dx_ptr,
    dy_ptr,
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
):
    """ROWS rows per program, y and dy held whole in registers. Strides: sx* of y and dy, sy* of dx.
    Precondition: BLOCK_N >= the body's length (n, or at most n // VEC * VEC with EDGES; the edges
    hold the rest)."""
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    y_ptr += bx
    dy_ptr += bx
    dx_ptr += by
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    body = row_ok[:, None] & (c < length)
    a, f = _load_terms(y_ptr, dy_ptr, xs[:, None] + c * sxn, body, LOG)
    s = tl.sum(a, axis=1)
    t = tl.sum(f, axis=1)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        ae, fe = _load_terms(y_ptr, dy_ptr, ox[:, None] + e_idx, e_ok, LOG)
        s += tl.sum(ae, axis=1)
        t += tl.sum(fe, axis=1)
        ge = _finish(_grad(ae, fe, s, t), e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED)
        tl.store(dx_ptr + oy[:, None] + e_idx, ge.to(dx_ptr.dtype.element_ty), mask=e_ok)
    g = _finish(
        _grad(a, f, s, t), body, row_head(h, EDGES) + c, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
    )
    tl.store(dx_ptr + ys[:, None] + c * syn, g.to(dx_ptr.dtype.element_ty), mask=body)


@triton.jit
def softmax_bwd_online(
    y_ptr,
    dx_ptr,
    dy_ptr,
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
):
    """Rows of any length in BLOCK_N chunks: pass 1 sums (s, t), pass 2 writes dx."""
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    y_ptr += bx
    dy_ptr += bx
    dx_ptr += by
    s = tl.zeros([ROWS], tl.float32)
    t = tl.zeros([ROWS], tl.float32)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        ae, fe = _load_terms(y_ptr, dy_ptr, ox[:, None] + e_idx, e_ok, LOG)
        s += tl.sum(ae, axis=1)
        t += tl.sum(fe, axis=1)
    n_chunks = tl.cdiv(n, BLOCK_N)
    s, t = _sums_range(y_ptr, dy_ptr, xs, c, row_ok, length, sxn, 0, n_chunks, s, t, LOG, ROWS, BLOCK_N)
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    if EDGES:
        ge = _finish(_grad(ae, fe, s, t), e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED)
        tl.store(dx_ptr + oy[:, None] + e_idx, ge.to(dx_ptr.dtype.element_ty), mask=e_ok)
    _grad_range(
        y_ptr,
        dy_ptr,
        dx_ptr,
        xs,
        ys,
        c,
        row_ok,
        length,
        sxn,
        syn,
        0,
        n_chunks,
        s,
        t,
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


@triton.jit
def softmax_bwd_split_sums(
    y_ptr,
    dy_ptr,
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
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    EDGES: tl.constexpr,
    IDX64: tl.constexpr,
    LOG: tl.constexpr,
):
    """Split path, step 1 of 2: program (rows, split) writes (s, t) of its segment to ws[row, split, 0:2].
    Split 0 also takes the edges."""
    split = tl.program_id(1)
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, 0, 0, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, False, IDX64
    )
    y_ptr += bx
    dy_ptr += bx
    s = tl.zeros([ROWS], tl.float32)
    t = tl.zeros([ROWS], tl.float32)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        ae, fe = _load_terms(y_ptr, dy_ptr, ox[:, None] + e_idx, in_first_split(e_ok, split), LOG)
        s += tl.sum(ae, axis=1)
        t += tl.sum(fe, axis=1)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    s, t = _sums_range(y_ptr, dy_ptr, xs, c, row_ok, length, sxn, j0, j1, s, t, LOG, ROWS, BLOCK_N)
    ws = ws_ptr + (row * n_splits + split) * 2
    tl.store(ws, s, mask=row_ok)
    tl.store(ws + 1, t, mask=row_ok)


@triton.jit
def softmax_bwd_split_write(
    y_ptr,
    dx_ptr,
    dy_ptr,
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
    SPLITS: tl.constexpr,
    MASK: tl.constexpr,
    CAUSAL: tl.constexpr,
    SCALED: tl.constexpr,
):
    """Split path, step 2 of 2: program (rows, split) adds the row's per-split (s, t) and writes dx for
    its segment."""
    split = tl.program_id(1)
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    y_ptr += bx
    dy_ptr += bx
    dx_ptr += by
    k = tl.arange(0, SPLITS)[None, :]
    ws_ok = row_ok[:, None] & (k < n_splits)
    ws = ws_ptr + (row[:, None] * n_splits + k) * 2
    s = tl.sum(tl.load(ws, mask=ws_ok, other=0.0), axis=1)
    t = tl.sum(tl.load(ws + 1, mask=ws_ok, other=0.0), axis=1)
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        e_ok = in_first_split(e_ok, split)
        ae, fe = _load_terms(y_ptr, dy_ptr, ox[:, None] + e_idx, e_ok, LOG)
        ge = _finish(_grad(ae, fe, s, t), e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED)
        tl.store(dx_ptr + oy[:, None] + e_idx, ge.to(dx_ptr.dtype.element_ty), mask=e_ok)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    _grad_range(
        y_ptr,
        dy_ptr,
        dx_ptr,
        xs,
        ys,
        c,
        row_ok,
        length,
        sxn,
        syn,
        j0,
        j1,
        s,
        t,
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


KERNELS = {
    "rowblock": softmax_bwd_rowblock,
    "online": softmax_bwd_online,
    "split": (softmax_bwd_split_sums, softmax_bwd_split_write),
}


# ---------------------------------------------------------------------------------------------- launcher
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from ...core import masking  # noqa: E402
from ...core.layout import alloc, plan_layout  # noqa: E402
from ...heuristics import softmax_triton  # noqa: E402
from ...heuristics.device import selected  # noqa: E402
from ..launch import scratch  # noqa: E402
from .launch import aligned_view, launch, prepare  # noqa: E402
from .rows import mask_args  # noqa: E402


def backward(
    dy: torch.Tensor,
    y: torch.Tensor,
    dim: int,
    out_dtype: torch.dtype,
    log: bool,
    path: str | None = None,
    spec=masking.NONE,
):
    """The gradient of softmax (or log_softmax) along ``dim`` in out_dtype, laid out as torch.empty_like(y),
    from the forward output y and the output gradient dy (the same shape). ``path``: the tuning table's
    choice; ``spec``: the forward's mask, scale or causal rule (dx scaled, 0 at masked positions): then dim is
    the last dim and rows are in logical order."""
    dx = alloc(y, out_dtype)
    with selected(y):
        y, lay = plan_layout(y, dx, dim)
        if spec.active and (lay.I != 1 or lay.copied):
            raise AssertionError("masked rows must be y's rows in logical order (dispatch ensures it)")
        margs, mflags = mask_args(spec, y)
        # dy is addressed with y's element offsets (in its own dtype): it needs y's strides and the same
        # 16-byte misalignment, which for another element size means both aligned.
        aligned_alike = (dy.data_ptr() - y.data_ptr()) % 16 == 0 and (dy.dtype == y.dtype or y.data_ptr() % 16 == 0)
        if dy.stride() != y.stride() or not aligned_alike:
            # Copy dy into y's layout. If y is not dense (empty_like would not keep its strides) or not 16-byte
            # aligned, y is first copied into a fresh dense buffer too, so that both share one layout.
            like = torch.empty_like(y)
            if like.stride() != y.stride() or y.data_ptr() % 16:
                y, lay = plan_layout(like.copy_(y), dx, dim)
            dy = torch.empty_like(y, dtype=dy.dtype).copy_(dy)
            lay = replace(lay, copied=True)
        L = prepare(y, dx, lay, inputs=2, path=path)
        dy_arg = aligned_view(dy, L.x_mis)
        sx, sy = L.strides[:3], L.strides[3:]
        tail = dict(**L.flags, **mflags, Y_VEC=L.y_vec, LOG=log, num_warps=L.plan.num_warps)
        if L.plan.path == "split":
            sums, write = KERNELS["split"]
            ws = scratch(torch.empty(L.n_rows * L.plan.splits * 2, dtype=torch.float32, device=y.device))
            args = (L.x_arg, dy_arg, ws, *L.rows_args, *sx, L.x_mis, L.chunks_per_split, L.plan.splits)
            launch(sums, L.grid, args, dict(**L.flags, LOG=log, num_warps=L.plan.num_warps))
            args = (L.x_arg, dx, dy_arg, ws, *L.rows_args, *sx, *sy, L.x_mis, L.chunks_per_split, L.plan.splits, *margs)
            launch(write, L.grid, args, dict(**tail, SPLITS=triton.next_power_of_2(L.plan.splits)))
        else:
            if cap := softmax_triton.max_registers(L.plan, 2):
                tail["maxnreg"] = cap
            launch(KERNELS[L.plan.path], L.grid, (L.x_arg, dx, dy_arg, *L.rows_args, *sx, *sy, L.x_mis, *margs), tail)
    return dx
