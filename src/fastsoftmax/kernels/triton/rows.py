"""What the softmax kernels share (kernels/triton/softmax_fwd.py, softmax_bwd.py, and the loss kernels): a
program's rows and their addressing, 16-byte access with scalar edges, the mask's load, the running
(max, sum) of a row read in chunks, and the loss kernels' (cross_entropy.py, shard.py, lm_head.py) softcap
and row (max, sum); their per-row terms are in loss_terms.py.

Rows: (b, i) x N with strides from core/layout.py, an anchor input x (forward: x; backward: y) and an
output. 16-byte access for any N: a row that does not start on a 16-byte boundary (N = 513, a sliced view)
is split into an aligned body, read and written with vector instructions, and at most VEC-1 head and VEC-1
tail elements ("edges") handled by scalar code. Edges lie in sectors the body or the neighbouring rows also
touch, so the bytes moved stay 1 read + 1 write.

Conventions, shared with the torch path (core/reference.py): the row maximum is subtracted before exp; a row
whose elements are all -inf gives zeros (softmax) / -inf (log_softmax) and lse = -inf; a row holding NaN or
+inf gives NaN everywhere. Masked lanes load as -inf, the identity of max and (through exp) of sum.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def row_geometry(
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
def body_offsets(ox, oy, n, VEC: tl.constexpr, EDGES: tl.constexpr, Y_VEC: tl.constexpr):
    """Split each row into a 16-byte-aligned body of ``length`` elements (a multiple of VEC) starting at
    element ``h``, and edges: the h elements before it and the n - h - length after it. Offsets are
    relative to 16-byte-aligned bases (see row_geometry).

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
    """Every kernel's start: this program's rows (row_geometry), their aligned bodies (body_offsets) and the column
    offsets of a chunk. Returns (bx, by, ox, oy, xs, ys, h, length, c, row, row_ok)."""
    bx, by, ox, oy, row, row_ok = row_geometry(
        tl.program_id(0), n_b, n_i, tiles_i, sxb, sxi, syb, syi, x_mis, ROWS, INNER, VEC, EDGES, Y_VEC, IDX64
    )
    xs, ys, h, length = body_offsets(ox, oy, n, VEC, EDGES, Y_VEC)
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
def load_logits(
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
def row_factor(s, LOG: tl.constexpr):
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
def normalise(z, e, f, LOG: tl.constexpr):
    if LOG:
        y = z - f[:, None]
    else:
        y = e * f[:, None]
    return y


@triton.jit
def chunk_stats(x):
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
def softcapped(x, cap):
    """cap * tanh(x / cap), accurate for small |x / cap| too (1 - e^-2a cancels there: a series instead);
    -inf maps to -cap, so callers re-mask."""
    u = x / cap
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    u2 = u * u
    series = a * (1.0 + u2 * (-0.3333333333333333 + u2 * (0.13333333333333333 - u2 * 0.05396825396825397)))
    th = tl.where(a < 0.125, series, (1.0 - e) / (1.0 + e))
    return cap * tl.where(u < 0, -th, th)


@triton.jit
def row_max_sum(
    base,
    row_ok,
    v,
    w_ptr,
    cap,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One sweep of ROWS rows of v logits (base: each row's first element): each row's max z (z the softcapped
    logits with SOFTCAP; -inf for a row of -inf), its sum of exp(z - max) (0 for a row of -inf) and with
    SMOOTH its sum of w_j * z_j (w = 1 without WEIGHT), fp32. The pair keeps what a logsumexp rounded to fp32
    loses: z - max is exact where z - lse is not (logits in the thousands)."""
    c = tl.arange(0, BLOCK_N)[None, :]
    m = tl.full([ROWS], float("-inf"), tl.float32)
    s = tl.zeros([ROWS], tl.float32)
    sum_z = tl.zeros([ROWS], tl.float32)
    for j in range(0, tl.cdiv(v, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < v)
        x = tl.load(base[:, None] + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            x = tl.where(ok, softcapped(x, cap), float("-inf"))
        m2 = tl.max(x, axis=1)
        s2 = tl.sum(row_exp(x - safe_max(m2)[:, None]), axis=1)
        m, s = merge_stats(m, s, m2, s2)
        if SMOOTH:
            if WEIGHT:
                wj = tl.load(w_ptr + cols, mask=cols < v, other=0.0).to(tl.float32)
                sum_z += tl.sum(tl.where(ok, x * wj, 0.0), axis=1)
            else:
                sum_z += tl.sum(tl.where(ok, x, 0.0), axis=1)
    return m, s, sum_z


@triton.jit
def stats_range(
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
        x = load_logits(
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
        m2, s2 = chunk_stats(x)
        m, s = merge_stats(m, s, m2, s2)
    return m, s


@triton.jit
def write_range(
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
        x = load_logits(
            x_ptr + xs[:, None] + cols * sxn, body, hc + cols, mrow, q, m_ptr, msn, scale, c_off, MASK, CAUSAL, SCALED
        )
        z = x - m_safe[:, None]
        y = normalise(z, row_exp(z), f, LOG)
        tl.store(y_ptr + ys[:, None] + cols * syn, y.to(y_ptr.dtype.element_ty), mask=body)


# ---- launch arguments


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
