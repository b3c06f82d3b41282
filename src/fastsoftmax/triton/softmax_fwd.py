"""Softmax / log_softmax forward in Triton.

Traffic budget per element of an M×N problem (s = element size):
  rowblock  1 read of x + 1 write of y (2·s bytes); the row tile lives in registers.
  online    2 reads of x + 1 write of y (3·s bytes); any row length.
  split     as online, with each row's segments on different programs (two launches), plus 8 bytes of
            (max, sum) per segment written and read back.
Optional per-row statistic: logsumexp (fp32, 4 bytes per row), for backward passes, losses and
cross-GPU merges.

Conventions, shared with the torch path (reference.py): the row maximum is subtracted before exp; a row
whose elements are all -inf gives zeros (softmax) / -inf (log_softmax) and lse = -inf; a row holding NaN or
+inf gives NaN everywhere. Masked lanes load as -inf, the identity of max and (through exp) of sum.

16-byte access for any N: a row that does not start on a 16-byte boundary (N = 513, a sliced view) is split
into an aligned body, read and written with vector instructions, and at most VEC-1 head and VEC-1 tail
elements ("edges") handled by scalar code. Edges lie in sectors the body or the neighbouring rows also
touch, so the bytes moved stay 1 read + 1 write.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _rows(
    pid,
    n_b,
    n_i,
    tiles_i,
    sxb,
    sxi,
    syb,
    syi,
    x_mis,
    ROWS: tl.constexpr,
    INNER: tl.constexpr,
    VEC: tl.constexpr,
    EDGES: tl.constexpr,
    Y_VEC: tl.constexpr,
    IDX64: tl.constexpr,
):
    """This program's rows: a 64-bit base offset per tensor (one scalar, on a 16-byte boundary when rows
    are vectorised) and each row's offset from it (32-bit unless IDX64), plus flat row index and validity.

    Rows run along b (ROWS consecutive b) or, with INNER, along i for one b. Keeping the per-element
    address arithmetic in 32 bits halves the registers it needs."""
    r = tl.arange(0, ROWS)
    if IDX64:
        r = r.to(tl.int64)
    if INNER:
        b = (pid // tiles_i).to(tl.int64)
        i0 = (pid % tiles_i).to(tl.int64) * ROWS
        bx = b * sxb + i0 * sxi + x_mis
        by = b * syb + i0 * syi
        ox = r * sxi
        oy = r * syi
        row = b * n_i + i0 + r
        ok = i0 + r < n_i
    else:
        b0 = pid.to(tl.int64) * ROWS
        bx = b0 * sxb + x_mis
        by = b0 * syb
        ox = r * sxb
        oy = r * syb
        row = b0 + r
        ok = row < n_b
    if EDGES:
        # Round the bases down to a 16-byte boundary the compiler can see; rows keep the remainder.
        # Y_VEC means y's rows are misaligned exactly as x's, so y's base shares the remainder.
        rem = (bx % VEC).to(ox.dtype)
        bx = tl.multiple_of(bx - rem, VEC)
        ox = ox + rem
        if Y_VEC:
            by = tl.multiple_of(by - rem, VEC)
            oy = oy + rem
    return bx, by, ox, oy, row, ok


@triton.jit
def _body(ox, oy, n, VEC: tl.constexpr, EDGES: tl.constexpr, Y_VEC: tl.constexpr):
    """Split each row into a 16-byte-aligned body of ``length`` elements (a multiple of VEC) starting at
    element ``h``, and edges: the h elements before it and the n - h - length after it. Offsets are
    relative to 16-byte-aligned bases (see _rows).

    Without EDGES the launcher has checked that n and every row stride are multiples of 16 elements, so
    the JIT's own divisibility specialisation proves alignment and the body is the whole row."""
    if EDGES:
        h = tl.minimum((VEC - ox % VEC) % VEC, n)
        length = tl.multiple_of((n - h) // VEC * VEC, VEC)[:, None]
        xs = tl.multiple_of(ox + h, VEC)
        ys = oy + h
        if Y_VEC:
            ys = tl.multiple_of(ys, VEC)
    else:
        h = 0
        length = n
        xs = ox
        ys = oy
    return xs, ys, h, length


@triton.jit
def prologue(
    n_b,
    n,
    n_i,
    tiles_i,
    sxb,
    sxi,
    syb,
    syi,
    x_mis,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    VEC: tl.constexpr,
    INNER: tl.constexpr,
    EDGES: tl.constexpr,
    Y_VEC: tl.constexpr,
    IDX64: tl.constexpr,
):
    """Every kernel's start: this program's rows (_rows), their aligned bodies (_body) and the column
    offsets of a chunk. Returns (bx, by, ox, oy, xs, ys, h, length, c, row, row_ok)."""
    bx, by, ox, oy, row, row_ok = _rows(
        tl.program_id(0), n_b, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, INNER, VEC, EDGES, Y_VEC, IDX64
    )
    xs, ys, h, length = _body(ox, oy, n, VEC, EDGES, Y_VEC)
    c = tl.arange(0, BLOCK_N)[None, :]
    if IDX64:
        c = c.to(tl.int64)
    return bx, by, ox, oy, xs, ys, h, length, c, row, row_ok


@triton.jit
def row_edges(h, length, n, row_ok, VEC: tl.constexpr):
    """Row-relative indices of the edge elements (lanes [0, VEC) the head, [VEC, 2·VEC) the tail) and
    which exist, rows outside the tensor excluded."""
    j = tl.arange(0, 2 * VEC)[None, :]
    head = j < VEC
    idx = tl.where(head, j, h[:, None] + length + (j - VEC))
    ok = tl.where(head, j < h[:, None], idx < n)
    return idx, ok & row_ok[:, None]


@triton.jit
def in_first_split(ok, split):
    """ok in split 0, False in the others. split is compared as a block of ints: Triton's interpreter splats
    a bool scalar into int32 data, which 3.9's masked loads reject, and 3.2 and 3.3's have no bool literal."""
    return ok & (tl.full(ok.shape, split, tl.int32) == 0)


@triton.jit
def mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3):
    """Each row's mask offset (elements) and query index (its index along the last row dim), from the
    row's flat index over x's row dims (md1..md3: sizes of the last three; mb0..mb3: mask strides)."""
    r3 = row % md3
    t = row // md3
    r2 = t % md2
    t = t // md2
    r1 = t % md1
    r0 = t // md1
    return r0 * mb0 + r1 * mb1 + r2 * mb2 + r3 * mb3, r3


@triton.jit
def _load_logits(
    ptrs, ok, col, mrow, q, m_ptr, msn, scale, c_off, MASK: tl.constexpr, CAUSAL: tl.constexpr, SCALED: tl.constexpr
):
    """The one place logits enter a kernel, as fp32: z = scale * x, a bool mask (MASK 1) or an additive
    one (MASK 2) read at the same row and column (``col``: row-relative column, ``mrow``: the row's mask
    offset, ``q``: its query index), and the causal rule col <= q + c_off. Lanes outside the row and removed
    positions are -inf: the identity of max, and exp(-inf - m) = 0 is the identity of sum."""
    if MASK == 0 and not CAUSAL and not SCALED:
        return tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32)
    z = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
    if SCALED:
        z = z * scale
    keep = ok
    if MASK == 1:
        keep = keep & (tl.load(m_ptr + mrow[:, None] + col * msn, mask=ok, other=0) != 0)
    if MASK == 2:
        z = z + tl.load(m_ptr + mrow[:, None] + col * msn, mask=ok, other=0.0).to(tl.float32)
    if CAUSAL:
        keep = keep & (col <= q[:, None] + c_off)
    return tl.where(keep, z, float("-inf"))


@triton.jit
def row_head(h, EDGES: tl.constexpr):
    """The body's first column within the row, per row (a [ROWS, 1] tile) or 0."""
    if EDGES:
        return h[:, None]
    else:
        return 0


@triton.jit
def safe_max(m):
    # A fully masked row has max -inf; subtracting it would give -inf - -inf = NaN, so subtract 0 instead.
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def row_exp(z):
    return tl.math.exp2(z * LOG2E)


@triton.jit
def _row_factor(s, LOG: tl.constexpr):
    """Per-row factor applied to every element: log(s) for log_softmax, 1/s for softmax.

    s == 0 only for an all -inf row, where z = -inf and exp(z) = 0 already give -inf / 0 when s is taken
    as 1. s = NaN (a NaN or +inf in the row) passes through to every element."""
    s = tl.where(s == 0, 1.0, s)
    if LOG:
        f = tl.math.log2(s) * LN2
    else:
        f = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return f


@triton.jit
def _normalise(z, e, f, LOG: tl.constexpr):
    if LOG:
        y = z - f[:, None]
    else:
        y = e * f[:, None]
    return y


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
    """ROWS rows per program, each held whole in registers. Precondition: BLOCK_N >= n."""
    bx, by, ox, oy, xs, ys, h, length, c, row, row_ok = prologue(
        n_b, n, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, BLOCK_N, VEC, INNER, EDGES, Y_VEC, IDX64
    )
    x_ptr += bx
    y_ptr += by
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    body = row_ok[:, None] & (c < length)
    x = _load_logits(
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
        xe = _load_logits(
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
    f = _row_factor(s, LOG)
    out_ty = y_ptr.dtype.element_ty
    tl.store(y_ptr + ys[:, None] + c * syn, _normalise(z, e, f, LOG).to(out_ty), mask=body)
    if EDGES:
        tl.store(y_ptr + oy[:, None] + e_idx, _normalise(ze, ee, f, LOG).to(out_ty), mask=e_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + row, m_safe + tl.math.log2(s) * LN2, mask=row_ok)


@triton.jit
def _chunk_stats(x):
    """(max, sum of exp(x - max)) per row of a tile; an all -inf row gives (-inf, 0)."""
    m = tl.max(x, axis=1)
    return m, tl.sum(row_exp(x - safe_max(m)[:, None]), axis=1)


@triton.jit
def merge_stats(m, s, m2, s2):
    """Merge two (max, rescaled sum) pairs (Milakov & Gimelshein 2018). -inf maxima merge to sum 0; a NaN
    sum, or +inf meeting +inf (inf - inf), poisons the result, as it must."""
    m_new = tl.maximum(m, m2)
    ms = safe_max(m_new)
    return m_new, s * row_exp(m - ms) + s2 * row_exp(m2 - ms)


@triton.jit
def _stats_range(
    x_ptr,
    xs,
    c,
    ok,
    length,
    sxn,
    j0,
    j1,
    m,
    s,
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
    BLOCK_N: tl.constexpr,
):
    """Fold chunks j0 <= j < j1 of the body into the running (max, sum). One exp per element."""
    for j in range(j0, j1):
        cols = j * BLOCK_N + c
        x = _load_logits(
            x_ptr + xs[:, None] + cols * sxn,
            ok[:, None] & (cols < length),
            hc + cols,
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
        m2, s2 = _chunk_stats(x)
        m, s = merge_stats(m, s, m2, s2)
    return m, s


@triton.jit
def _write_range(
    x_ptr,
    y_ptr,
    xs,
    ys,
    c,
    ok,
    length,
    sxn,
    syn,
    j0,
    j1,
    m_safe,
    f,
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
    """Normalise chunks j0 <= j < j1, last first: the chunks the statistics pass read last are the
    likeliest still in L2."""
    for k in range(j0, j1):
        cols = (j1 - 1 - (k - j0)) * BLOCK_N + c
        body = ok[:, None] & (cols < length)
        x = _load_logits(
            x_ptr + xs[:, None] + cols * sxn, body, hc + cols, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
        )
        z = x - m_safe[:, None]
        y = _normalise(z, row_exp(z), f, LOG)
        tl.store(y_ptr + ys[:, None] + cols * syn, y.to(y_ptr.dtype.element_ty), mask=body)


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
        xe = _load_logits(
            x_ptr + ox[:, None] + e_idx, e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
        )
        m, s = _chunk_stats(xe)
    n_chunks = tl.cdiv(n, BLOCK_N)
    m, s = _stats_range(
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
    f = _row_factor(s, LOG)
    if EDGES:
        ze = xe - m_safe[:, None]
        tl.store(y_ptr + oy[:, None] + e_idx, _normalise(ze, row_exp(ze), f, LOG).to(y_ptr.dtype.element_ty), mask=e_ok)
    _write_range(
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
        xe = _load_logits(
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
        m, s = _chunk_stats(xe)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    m, s = _stats_range(
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
    f = _row_factor(s, LOG)
    mrow, q = mask_rows(row, md1, md2, md3, mb0, mb1, mb2, mb3)
    if EDGES:
        e_idx, e_ok = row_edges(h, length, n, row_ok, VEC)
        e_ok = in_first_split(e_ok, split)
        ze = (
            _load_logits(
                x_ptr + ox[:, None] + e_idx, e_ok, e_idx, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
            )
            - m_safe[:, None]
        )
        tl.store(y_ptr + oy[:, None] + e_idx, _normalise(ze, row_exp(ze), f, LOG).to(y_ptr.dtype.element_ty), mask=e_ok)
    j0 = split * chunks_per_split
    j1 = tl.minimum(j0 + chunks_per_split, tl.cdiv(n, BLOCK_N))
    _write_range(
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

from .. import masking  # noqa: E402
from ..launch import scratch  # noqa: E402
from ..layout import alloc, plan_layout  # noqa: E402
from .launch import launch, prepare  # noqa: E402


def mask_args(spec, x: torch.Tensor) -> tuple[tuple, dict]:
    """The mask, scale and causal arguments every forward kernel takes (placeholders when inactive)."""
    m = spec.mask if spec.mask is not None else x
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    d1, d2, d3 = spec.dims
    b0, b1, b2, b3 = spec.strides
    args = (
        m,
        1.0 if spec.scale is None else spec.scale,
        d1,
        d2,
        d3,
        b0,
        b1,
        b2,
        b3,
        spec.col_stride,
        spec.causal_offset,
    )
    return args, dict(MASK=spec.kind, CAUSAL=spec.causal, SCALED=spec.scale is not None)


def forward(
    x: torch.Tensor,
    y: torch.Tensor,
    dim: int,
    log: bool,
    want_lse: bool,
    path: str | None = None,
    spec=masking.NONE,
):
    """Write softmax (or log_softmax) of x along ``dim`` into y (same shape). Returns (the plan that ran,
    logsumexp per row as fp32 shaped like x without dim, or None). ``spec``: a mask, scale or causal rule
    (masking.Spec) applied as the logits load; then dim is the last dim and rows are in logical order."""
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
    return L.plan, lse
