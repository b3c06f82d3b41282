"""Cross-entropy over rows of logits in Triton: the forward reads each row once and writes one loss and one
logsumexp per row (a plain call's one program: the loss alone); the backward reads each row once more and
writes dlogits once, from the saved logsumexp.

Per row i with target t, V classes, label smoothing e, class weights w (1 without), softcap c and z-loss
coefficient k, on z = c * tanh(x / c) (z = x without a softcap):
  lse  = log sum_j exp(z_j)                          (max subtracted first; an all -inf row gives -inf)
  ce   = (1 - e) * w_t * (lse - z_t) + (e / V) * sum_j w_j * (lse - z_j)      (torch's weight= semantics)
  zl   = k * lse^2                                   (0 for rows whose target is ignore_index, as ce)
  dz_j = g_ce * ((1 - e) * w_t * (p_j - [j == t]) + (e / V) * (W * p_j - w_j)) + g_z * 2 k lse p_j
  dx_j = dz_j * (1 - (z_j / c)^2)                    (W = sum_j w_j; p = exp(z - lse))
g_ce, g_z: the row's upstream gradient, divided for the mean by the weight of the rows kept and by their
number. Rows are (M, V) with unit stride along V; programs take ROWS rows and sweep V in BLOCK_N chunks.

A forward is two launches: ce_fwd (the rows), then ce_finish (one program: the reduction over rows, the
rows kept and their weight, and whether every target is in range, which on CUDA it asserts on the device);
or one, where one ce_fwd program holds every row (heuristics/cross_entropy.ONE_PROGRAM) and does both
(FINISH). A backward is one (ce_bwd reads the upstream gradient and the mean's divisors from device
memory). A target outside [0, V) never addresses memory (its row's z_t is taken as 0); the forward's last
program counts it (the flag in the stats, the assertion on CUDA). The LM-head loss (ops/lm_head.py) runs
the same kernels on chunks of rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ... import heuristics
from ...heuristics import cross_entropy as rules
from ...heuristics import poisoning
from ...heuristics.device import selected
from .. import launch as fastlaunch
from .launch import launch
from .loss_terms import dlogits, row_grads, row_terms, split_lse, store_lse
from .rows import LN2, merge_stats, row_max_sum, safe_max, softcapped


@triton.jit
def ce_fwd(
    x_ptr,
    t_ptr,
    w_ptr,
    wsum_ptr,
    run_ptr,
    part_ptr,
    loss_ptr,
    z_ptr,
    lse_ptr,
    n_rows,
    v,
    nc,
    col0,
    sx,
    ignore_index,
    smoothing,
    cap,
    zl,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ZLOSS: tl.constexpr,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    PART: tl.constexpr,
    FINISH: tl.constexpr,
    REDUCTION: tl.constexpr,
    ZOUT: tl.constexpr,
    STATS: tl.constexpr,
    CHECK: tl.constexpr,
):
    """loss_ptr: each row's ce (fp32), z_ptr: its z-loss (ZLOSS), lse_ptr: its logsumexp; w_ptr: the class
    weights and wsum_ptr their sum (WEIGHT; the sum only read with SMOOTH). The rows' logits at x_ptr are
    the classes [col0, col0 + nc) of v: all of them (col0 = 0, nc = v, FIRST and LAST), or the LM-head loss's
    vocabulary slices, taken in order: each slice's logsumexp, target logit and (SMOOTH) sum of w_j * z_j
    merged into the running ones at run_ptr (3 x n_rows float64, the logsumexp exact, as in the stats;
    FIRST: none yet), the outputs stored at the LAST slice. PART: each row's largest z on the slice stored
    at part_ptr (lm_head.py's skip).
    FINISH (one program holding every row, all classes): it also does ce_finish's work, with loss_ptr and
    z_ptr as its out and zout (zout written only with ZOUT), its counts at lse_ptr + n_rows, and the rows'
    logsumexp and the counts stored only with STATS."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    base = x_ptr + row * sx
    top, sum_e, sum_z = row_max_sum(base, row_ok, nc, w_ptr + col0, cap, ROWS, BLOCK_N, SMOOTH, WEIGHT, SOFTCAP)
    m = safe_max(top)
    ls = tl.math.log2(sum_e) * LN2  # (the logsumexp is m + ls, kept apart: row_terms)
    if PART:
        tl.store(part_ptr + row, top, mask=row_ok)
    t = tl.load(t_ptr + row, mask=row_ok, other=ignore_index).to(tl.int64)
    keep = row_ok & (t != ignore_index)
    inside = keep & (t >= 0) & (t < v)  # an out-of-range target reads nothing (the finish flags it)
    here = inside & (t >= col0) & (t < col0 + nc)
    z_t = tl.load(base + tl.where(here, t - col0, 0), mask=here, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = softcapped(z_t, cap)
    z_t = tl.where(here, z_t, 0.0)
    if not FIRST:  # the running logsumexp (hi + lo: exact) merged with the slice's (-inf where both are)
        hi, lo = split_lse(tl.load(run_ptr + row, mask=row_ok, other=0.0))
        m, s = merge_stats(hi, tl.exp(lo), top, sum_e)
        m = safe_max(m)
        ls = tl.math.log2(s) * LN2
        z_t += tl.load(run_ptr + n_rows + row, mask=row_ok, other=0.0).to(tl.float32)
        if SMOOTH:
            sum_z += tl.load(run_ptr + 2 * n_rows + row, mask=row_ok, other=0.0).to(tl.float32)
    if not LAST:
        store_lse(run_ptr + row, m, ls, row_ok)
        tl.store(run_ptr + n_rows + row, z_t, mask=row_ok)
        if SMOOTH:
            tl.store(run_ptr + 2 * n_rows + row, sum_z, mask=row_ok)
    else:
        loss, zr, w_t = row_terms(m, ls, z_t, sum_z, t, keep, inside, w_ptr, wsum_ptr, v, smoothing, zl, SMOOTH, WEIGHT,
                                  ZLOSS)  # fmt: skip
        if FINISH:
            finish_rows(loss_ptr, z_ptr, row, row_ok, loss, zr, REDUCTION, ZOUT)
            wk = tl.zeros([ROWS], tl.float32)
            if WEIGHT:
                wk = w_t
            kept, bad = keep.to(tl.int32), (keep != inside).to(tl.int32)
            finish_total(loss_ptr, z_ptr, lse_ptr + n_rows, loss, zr, kept, bad, wk, REDUCTION, WEIGHT, True, CHECK,
                         ZOUT, STATS)  # fmt: skip
        else:
            tl.store(loss_ptr + row, loss, mask=row_ok)
            if ZLOSS:
                tl.store(z_ptr + row, zr, mask=row_ok)
        if STATS:
            store_lse(lse_ptr + row, m, ls, row_ok)


@triton.jit
def finish_rows(out_ptr, zout_ptr, r, ok, row_loss, zr, REDUCTION: tl.constexpr, ZOUT: tl.constexpr):
    """REDUCTION 0: rows r's loss (ce + z-loss) in out's dtype and (ZOUT) their z-loss in zout's."""
    if REDUCTION == 0:
        tl.store(out_ptr + r, (row_loss + zr).to(out_ptr.dtype.element_ty), mask=ok)
        if ZOUT:
            tl.store(zout_ptr + r, zr.to(zout_ptr.dtype.element_ty), mask=ok)


@triton.jit
def finish_total(
    out_ptr,
    zout_ptr,
    stats_ptr,
    acc,
    zacc,
    kept,
    bad,
    wk,
    REDUCTION: tl.constexpr,
    WEIGHT: tl.constexpr,
    REDUCE: tl.constexpr,
    CHECK: tl.constexpr,
    ZOUT: tl.constexpr,
    COUNTS: tl.constexpr,
):
    """The reduction's end over vectors of per-lane sums of every row's terms (acc: ce, zacc: z-loss, kept:
    rows not ignored, bad: rows kept with a target outside [0, v), wk: the kept rows' weights). With REDUCE
    and REDUCTION 1 or 2: the sums or means into out (ce + z-loss) and zout (z-loss, with ZOUT); ce over the
    weight of the rows kept, z-loss over their number (0 / 0 = NaN when all are ignored, as torch). COUNTS:
    stats_ptr[0] = the number of rows not ignored, [1] = 1 if every target not ignored is in [0, v) (else
    0), [2] = the weight of the rows kept (their number without class weights), in stats_ptr's dtype. CHECK:
    a target out of range stops here, at a device-side assertion (as torch's own device asserts do: the error
    surfaces at the next synchronising call), so the caller launches no check of its own."""
    n_kept = tl.sum(kept, axis=0).to(tl.float32)
    w_kept = n_kept
    if WEIGHT:
        w_kept = tl.sum(wk, axis=0)
    if REDUCE:
        if REDUCTION != 0:
            total = tl.sum(acc, axis=0)
            ztotal = tl.sum(zacc, axis=0)
            if REDUCTION == 2:  # (kept weights summing to 0: NaN, as torch's 0 / 0 of its nll part)
                total = tl.where(w_kept == 0.0, float("nan"), total / w_kept)
                ztotal = ztotal / n_kept
            tl.store(out_ptr, (total + ztotal).to(out_ptr.dtype.element_ty))
            if ZOUT:
                tl.store(zout_ptr, ztotal.to(zout_ptr.dtype.element_ty))
    n_bad = tl.sum(bad, axis=0)
    if CHECK:
        tl.device_assert(n_bad == 0, "cross_entropy: a target is outside [0, V) and not ignore_index")
    if COUNTS:
        tl.store(stats_ptr, n_kept)
        tl.store(stats_ptr + 1, (n_bad == 0).to(tl.float32))
        tl.store(stats_ptr + 2, w_kept)


@triton.jit
def ce_finish(
    loss_ptr,
    z_ptr,
    t_ptr,
    w_ptr,
    out_ptr,
    zout_ptr,
    stats_ptr,
    n_rows,
    v,
    ignore_index,
    REDUCTION: tl.constexpr,
    BLOCK: tl.constexpr,
    WEIGHT: tl.constexpr,
    ZLOSS: tl.constexpr,
    REDUCE: tl.constexpr,
    CHECK: tl.constexpr,
):
    """One program over all rows of ce_fwd's row buffers, in a fixed order (deterministic): with REDUCE,
    REDUCTION 0 writes each row's loss and z-loss (finish_rows), 1 and 2 their sums or means; always the
    counts at stats_ptr and, on CUDA (CHECK, compiled with debug=True), the targets' assertion
    (finish_total)."""
    acc = tl.zeros([BLOCK], tl.float32)
    zacc = tl.zeros([BLOCK], tl.float32)
    wk = tl.zeros([BLOCK], tl.float32)
    kept = tl.zeros([BLOCK], tl.int32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        ok = r < n_rows
        t = tl.load(t_ptr + r, mask=ok, other=ignore_index).to(tl.int64)
        keep = ok & (t != ignore_index)
        inside = keep & (t >= 0) & (t < v)
        kept += keep.to(tl.int32)
        bad += (keep != inside).to(tl.int32)  # kept but outside [0, v): inside implies keep
        if WEIGHT:
            wk += tl.load(w_ptr + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
        if REDUCE:
            row_loss = tl.load(loss_ptr + r, mask=ok, other=0.0)
            zr = tl.zeros([BLOCK], tl.float32)
            if ZLOSS:
                zr = tl.load(z_ptr + r, mask=ok, other=0.0)
            finish_rows(out_ptr, zout_ptr, r, ok, row_loss, zr, REDUCTION, True)
            acc += row_loss
            zacc += zr
    finish_total(out_ptr, zout_ptr, stats_ptr, acc, zacc, kept, bad, wk, REDUCTION, WEIGHT, REDUCE, CHECK, True, True)


@triton.jit
def ce_bwd(
    x_ptr,
    t_ptr,
    w_ptr,
    wsum_ptr,
    lse_ptr,
    cnt_ptr,
    g_ptr,
    dx_ptr,
    idx_ptr,
    n_rows,
    v,
    nc,
    col0,
    sx,
    sdx,
    g_stride,
    span,
    ignore_index,
    smoothing,
    cap,
    zl,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SMOOTH: tl.constexpr,
    MEAN: tl.constexpr,
    WEIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ZLOSS: tl.constexpr,
    PICKED: tl.constexpr,
):
    """g_ptr: the upstream gradient, per row (g_stride 1) or one for all rows (g_stride 0); MEAN divides it by
    the weight of the rows kept (ce) and their number (z-loss), which the forward left at cnt_ptr[2] and
    cnt_ptr[0]. The rows' logits at x_ptr are the classes [col0, col0 + nc) of v (all: col0 = 0, nc = v; the
    LM-head loss's vocabulary slices). dx_ptr may be x_ptr (in place: each element is read, then written, by
    one program). The second
    grid axis splits each row into segments of ``span`` columns (a multiple of BLOCK_N), one program each:
    dlogits need no reduction along the row, so few long rows still fill the GPU. PICKED: the numbers of row i
    are row idx_ptr[i]'s (row_grads)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = row < n_rows
    t, keep, inside, lse, lo, a, b, cc = row_grads(
        row, row_ok, t_ptr, lse_ptr, g_ptr, g_stride, cnt_ptr, w_ptr, wsum_ptr, ignore_index, v, smoothing, zl,
        idx_ptr, MEAN, SMOOTH, WEIGHT, ZLOSS, PICKED,
    )  # fmt: skip
    lse_safe = safe_max(lse)  # an all -inf row: exp(-inf - 0) = 0
    seg0 = tl.program_id(1).to(tl.int64) * span  # this segment's first column (a scalar: columns stay int32)
    width = tl.minimum(span, nc - seg0).to(tl.int32)
    t_here = tl.where(inside, t - col0 - seg0, -1)
    t_here = tl.where((t_here >= 0) & (t_here < width), t_here, -1).to(tl.int32)
    xs = x_ptr + row[:, None] * sx + seg0
    dxs = dx_ptr + row[:, None] * sdx + seg0
    c = tl.arange(0, BLOCK_N)[None, :]
    for j in range(0, tl.cdiv(width, BLOCK_N)):
        cols = j * BLOCK_N + c
        ok = row_ok[:, None] & (cols < width)
        z = tl.load(xs + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            z = tl.where(ok, softcapped(z, cap), float("-inf"))
        wj = 0.0
        if SMOOTH and WEIGHT:
            wj = tl.load(w_ptr + col0 + seg0 + cols, mask=cols < width, other=0.0).to(tl.float32)
        d = dlogits(z, cols == t_here[:, None], lse_safe, lo, a, b, cc, wj, keep, cap, SMOOTH, WEIGHT, SOFTCAP)
        tl.store(dxs + cols, d.to(dx_ptr.dtype.element_ty), mask=ok)


FINISH_BLOCK = 1024
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _flags(o, w) -> dict:
    return dict(SMOOTH=o.smoothing != 0.0, WEIGHT=w is not None, SOFTCAP=o.softcap is not None, ZLOSS=o.z_loss != 0.0)


def _scalars(o) -> tuple:
    return float(o.smoothing), float(o.softcap or 1.0), float(o.z_loss)


def weight_sum(o, w, like):
    """The class weights' sum as a device scalar where the kernels read it (smoothing with weights), else a
    placeholder pointer."""
    if w is not None and o.smoothing != 0.0:
        return w.float().sum().reshape(1)
    return like


def rows_forward(x, t, w, wsum, o, rows_loss, rows_z, lse, shape, col0=0, v=None, run=None, part=None,
                 finish=None) -> None:  # fmt: skip
    """ce_fwd over (M, nc) logits x into the (M,) buffers: each row's ce, z-loss and logsumexp. x holds the
    classes [col0, col0 + nc) of v (default: all); slices are taken in order, the running numbers in run (3,
    M) until the last slice; each row's largest z on the slice into part (M,) where given. ``finish``: the
    constexprs of one program over every row that also finishes (forward()'s; the loss into rows_loss, the
    z-loss into rows_z, the counts behind the logsumexp in lse), else none."""
    m, nc = x.shape
    v = nc if v is None else v
    rows, block, warps, _ = shape
    eps, cap, zl = _scalars(o)
    run = run if run is not None else rows_loss  # (placeholders where FIRST and LAST, or not PART)
    args = (x, t, w if w is not None else x, wsum, run, part if part is not None else run, rows_loss, rows_z, lse)
    args += (m, v, nc, col0, x.stride(0), o.ignore_index, eps, cap, zl)
    meta = dict(ROWS=rows, BLOCK_N=block, num_warps=warps, FIRST=col0 == 0, LAST=col0 + nc == v, PART=part is not None)
    meta |= finish or dict(FINISH=False, REDUCTION=0, ZOUT=True, STATS=True, CHECK=False)
    launch(ce_fwd, (-(-m // rows),), args, meta | _flags(o, w))


def _checked(check: bool) -> dict:
    """The constexpr and compile options of the targets' device assertion (Triton compiles device_assert
    only into debug kernels; no overflow checks wanted)."""
    return dict(CHECK=True, debug=True, sanitize_overflow=False) if check else dict(CHECK=False)


def finish(rows_loss, rows_z, t, w, out, zout, tail, v: int, o, reduce: bool = True, check: bool | None = None):
    """ce_finish: the reduction into out / zout (with ``reduce``) and the counts into tail (3,). ``check``
    (default: on CUDA) compiles in the device-side assertion on the targets; otherwise the caller reads
    tail[1] (dispatch.cross_entropy)."""
    flags = _flags(o, w)
    check = t.is_cuda if check is None else check
    meta = dict(REDUCTION=REDUCTIONS[o.reduction], BLOCK=FINISH_BLOCK, WEIGHT=flags["WEIGHT"], ZLOSS=flags["ZLOSS"])
    meta |= dict(REDUCE=reduce, num_warps=4) | _checked(check)
    launch(
        ce_finish,
        (1,),
        (rows_loss, rows_z, t, w if w is not None else rows_loss, out, zout, tail, t.shape[0], v, o.ignore_index),
        meta,
    )


def rows_backward(x, t, w, wsum, lse, tail, g, o, dx, shape, col0: int = 0, v: int | None = None, rows=None) -> None:
    """ce_bwd: dlogits of (M, nc) logits x into dx (may be x) from the rows' logsumexp, the counts (tail, as
    finish writes them) and g: (M,) per row, or a 0-d tensor for every row (divided for the mean). x holds
    the classes [col0, col0 + nc) of v (default: all, nc = v). ``rows`` (M,) int64: x's row i is row rows[i]
    of t, lse and g (the skip's gathered rows), else row i."""
    m, nc = x.shape
    v = nc if v is None else v
    per_program, block, warps, splits = shape
    chunks = -(-nc // block)
    per = -(-chunks // splits)  # chunks per segment; the last segment may be shorter
    eps, cap, zl = _scalars(o)
    args = (x, t, w if w is not None else x, wsum, lse, tail, g, dx, rows if rows is not None else t, m, v, nc, col0)
    args += (x.stride(0), dx.stride(0), g.stride(0) if g.dim() else 0, per * block, o.ignore_index, eps, cap, zl)
    meta = dict(ROWS=per_program, BLOCK_N=block, MEAN=o.reduction == "mean", num_warps=warps, PICKED=rows is not None)
    launch(ce_bwd, (-(-m // per_program), -(-chunks // per)), args, meta | _flags(o, w))


def shape(v: int, elsize: int, backward: bool, m: int = 0) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, num_warps, splits) of the kernels for m rows of v classes: the rule
    (heuristics/cross_entropy.py), or what heuristics.force() sets (rows=, block_n=, num_warps=, splits=:
    segments per row, backward only); recorded as the call's plan. A forward whose ROWS hold all m rows runs
    as one program that also finishes (the plan's ``fused``)."""
    rows, block, warps, splits = rules.launch_shape(v, elsize, backward, m)
    f = heuristics.forced()
    if f:
        rows, block, warps = f.get("rows", rows), f.get("block_n", block), f.get("num_warps", warps)
        splits = f.get("splits", splits) if backward else 1
    chunks = -(-v // block)
    splits = -(-chunks // -(-chunks // splits))  # as many as rows_backward launches: none empty
    heuristics.record(heuristics.Plan("triton", "cross_entropy", block_n=block, rows=rows, num_warps=warps,
                                      splits=splits, fused=not backward and 0 < m <= rows))  # fmt: skip
    return rows, block, warps, splits


def forward(x, t, w, o, out_dtype, path=None, stats=True, check: bool | None = None):
    """(loss, z-loss, stats) of (M, V) logits x (unit stride along V) and (M,) targets: loss and z-loss as
    the reduction asks (rows, or scalars) in out_dtype; stats (M + 3,) fp64: each row's logsumexp (its max
    plus the log of its sum, exact in fp64: the backward keeps its precision whatever the logits' offset),
    then the rows not ignored, 1.0 if every target not ignored is in [0, V) (else 0.0), the weight of the
    rows kept.
    ``w``: the class weights or None; ``o``: the loss options; ``path``: unused (the backend interface);
    ``check``: finish()'s. ``stats`` False (a plain call: no backward) lets the one-program forward (rows
    that fit one program, shape()) write no stats, nor a z-loss without one: both are then None."""
    import torch

    m, v = x.shape
    with selected(x):
        launch_shape = shape(v, x.element_size(), False, m)
        one = 0 < m <= launch_shape[0]  # one program: one launch and no row buffers (small calls: host time)
        out = torch.empty(m if o.reduction == "none" else (), dtype=out_dtype, device=x.device)
        zout = torch.empty_like(out) if stats or o.z_loss or not one else None
        st = torch.empty(m + 3, dtype=torch.float64, device=x.device) if stats or not one else None
        rows_loss = rows_z = None
        if not one:  # (workspaces the kernels write first: a replay allocates its own)
            rows_loss = fastlaunch.scratch(torch.empty(m, dtype=torch.float32, device=x.device))
            rows_z = fastlaunch.scratch(torch.empty_like(rows_loss)) if o.z_loss else rows_loss
        if poisoning():  # tests: every output element must be written by the kernels
            for b in (rows_loss, rows_z, st, out, zout):
                if b is not None:
                    b.fill_(float("nan"))
        check = x.is_cuda if check is None else check
        if one:  # (ce_fwd that also finishes; zout and st None: not written, placeholders)
            fin = dict(FINISH=True, REDUCTION=REDUCTIONS[o.reduction], ZOUT=zout is not None, STATS=st is not None)
            z_, st_ = (b if b is not None else out for b in (zout, st))
            rows_forward(x, t, w, weight_sum(o, w, out), o, out, z_, st_, launch_shape, finish=fin | _checked(check))
        else:
            rows_forward(x, t, w, weight_sum(o, w, st), o, rows_loss, rows_z, st, launch_shape)
            finish(rows_loss, rows_z, t, w, out, zout, st[m:], v, o, check=check)
    return out, zout, st


def backward(x, t, w, stats, g, o, out_dtype, path=None):
    """dlogits of (M, V) logits x in out_dtype (contiguous) from the forward's stats and the upstream
    gradient g (a 0-d tensor, or (M,) for reduction='none'); ``path``: unused (the backend interface)."""
    import torch

    m = x.shape[0]
    dx = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if poisoning():
        dx.fill_(float("nan"))
    g = g.reshape(m) if o.reduction == "none" else g.reshape(())
    with selected(x):
        launch_shape = shape(x.shape[1], x.element_size(), True)
        rows_backward(x, t, w, weight_sum(o, w, stats), stats, stats[m:], g, o, dx, launch_shape)
    return dx
