"""torch ops: the reference path, on any device torch runs, float32 accumulation (float64 for float64); and
the native path ``auto`` takes on the CPU (dispatch.cpu_*): torch's own CPU kernels with the library's
conventions applied after them, where they differ (the last two sections)."""

from __future__ import annotations

import ctypes

import torch

from .. import dtypes, heuristics, masking, torch_build
from ..layout import alloc
from ..options import Loss
from ..reference import grad_torch, logsumexp_torch, softmax_torch


class TorchBackend:
    name = "torch"

    def unavailable(self, x, out_dtype, dy=None, dim=-1):
        return None

    def forward(self, x, dim, out_dtype, log, want_lse, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        if spec.active:
            wide = torch.float64 in (x.dtype, out_dtype)
            x = masking.logits(x, spec.mask, spec.scale, spec.causal, torch.float64 if wide else torch.float32)
        y, lse = softmax_torch(x, dim, log, out_dtype)
        # In the layout every backend promises (and the custom op's fake implementation states).
        return alloc(x, out_dtype).copy_(y), (lse.to(torch.float32) if want_lse else None)

    def backward(self, dy, y, dim, out_dtype, log, path=None, spec=masking.NONE):
        heuristics.record(heuristics.Plan("torch", "reference"))
        return alloc(y, out_dtype).copy_(grad_torch(dy, y, dim, log, out_dtype, spec.mask, spec.scale, spec.causal))

    def cross_entropy(self, x, t, w, o, out_dtype):
        """(loss, z-loss, stats) as the Triton kernels give them (stats: lse per row, rows kept, 1.0, their
        weight)."""
        m = x.shape[0]
        if m:
            heuristics.record(heuristics.Plan("torch", "cross_entropy"))
        ce, zr, lse = loss_rows_torch(x, t, o, w)
        kept, w_kept = kept_rows(t, o.ignore_index, w, x.shape[-1], lse.dtype)
        stats = torch.cat([lse, kept[None], torch.ones(1, dtype=lse.dtype, device=x.device), w_kept[None]])
        loss, z = reduce_terms(ce, zr, kept, w_kept, o.reduction, out_dtype)
        return loss, z, stats

    def cross_entropy_backward(self, x, t, w, stats, grad, o, out_dtype):
        m = x.shape[0]
        if m:
            heuristics.record(heuristics.Plan("torch", "cross_entropy"))
        g_ce, g_z = row_grads(grad, stats[m], stats[m + 2], o.reduction, m)  # the forward's counts
        return dlogits_options(x, t, stats[:m], g_ce, g_z, o, w).to(out_dtype)


def capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _target_weight(t, keep, w, v: int, dtype):
    """(each row's target, clamped into [0, v) where ignored or out of range; its class weight or 1)."""
    tt = torch.where(keep, t, 0).clamp(0, max(v - 1, 0))
    return tt, (w.to(dtype)[tt] if w is not None else torch.ones((), dtype=dtype, device=t.device))


def loss_rows_torch(x, t, o, w=None):
    """(ce per row, z-loss per row, lse per row) of (M, V) logits, fp32 (fp64 for fp64 logits), with torch
    ops differentiable in x: the formulas of triton/cross_entropy.py (0 on ignored rows)."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = capped(x.to(wide), o.softcap)
    lse = logsumexp_torch(z)
    t = t.long()
    keep = t != o.ignore_index
    tt, w_t = _target_weight(t, keep, w, x.shape[-1], wide)
    ce = w_t * (lse - z.gather(-1, tt[:, None]).squeeze(-1))
    if o.smoothing:
        v = x.shape[-1]
        zw = z * w.to(wide) if w is not None else z
        wsum = w.to(wide).sum() if w is not None else v
        ce = (1 - o.smoothing) * ce + (o.smoothing / v) * (lse * wsum - zw.sum(-1))
    zr = o.z_loss * lse * lse
    return torch.where(keep, ce, 0.0), torch.where(keep, zr, 0.0), lse


def kept_rows(t, ignore_index: int, w, v: int, dtype):
    """(the rows not ignored, their class weight) as 0-d tensors of ``dtype``: the mean's divisors."""
    keep = t.long() != ignore_index
    kept = keep.sum().to(dtype)
    if w is None:
        return kept, kept
    _, w_t = _target_weight(t.long(), keep, w, v, dtype)
    return kept, torch.where(keep, w_t, 0.0).sum()


def reduce_terms(ce, zr, kept, w_kept, reduction: str, out_dtype):
    """(loss, z-loss) as the reduction asks: the mean divides ce by the rows' weight and z-loss by their
    number (as Liger's lse_square_scale; the same without class weights). zr None: no z-loss term (the
    z-loss returned is then None)."""
    if zr is None:
        zr = torch.zeros((), dtype=ce.dtype, device=ce.device)
        return reduce_terms(ce, zr, kept, w_kept, reduction, out_dtype)[0], None
    if reduction == "none":
        return (ce + zr).to(out_dtype), zr.to(out_dtype)
    c, z = ce.sum(), zr.sum()
    if reduction == "mean":  # (kept weights summing to 0: NaN, as torch's 0 / 0 of its nll part)
        c, z = torch.where(w_kept == 0, float("nan"), c / w_kept), z / kept
    return (c + z).to(out_dtype), z.to(out_dtype)


def row_grads(grad, kept, w_kept, reduction: str, m: int):
    """(each row's upstream gradient of its ce, of its z-loss)."""
    if reduction == "none":
        g = grad.reshape(m)
        return g, g
    g = grad.reshape(()).expand(m)
    if reduction == "mean":
        return g / w_kept, g / kept
    return g, g


def dlogits_options(x, t, lse, g_ce, g_z, o, w=None):
    """dlogits with torch ops, in lse's dtype, with every loss option (triton/cross_entropy.py's formulas);
    differentiable in x, g_ce and g_z."""
    wide = lse.dtype
    z = capped(x.to(wide), o.softcap)
    p = (z - torch.where(lse == float("-inf"), 0.0, lse)[:, None]).exp()
    t = t.long()
    keep = t != o.ignore_index
    v = x.shape[-1]
    tt, w_t = _target_weight(t, keep, w, v, wide)
    hot = torch.arange(v, device=x.device) == tt[:, None]
    b = g_ce.to(wide) * w_t
    a = b
    d = None
    if o.smoothing:
        cc = g_ce.to(wide) * (o.smoothing / v)
        b = (1 - o.smoothing) * b
        wj = w.to(wide) if w is not None else torch.ones((), dtype=wide, device=x.device)
        a = b + cc * (wj.sum() if w is not None else v)
        d = -cc[:, None] * wj
    if o.z_loss:
        a = a + g_z.to(wide) * (2 * o.z_loss) * torch.where(keep, lse, 0.0)
    dz = a[:, None] * p - b[:, None] * hot.to(wide)
    if d is not None:
        dz = dz + d
    if o.softcap is not None:
        dz = dz * (1 - (z / o.softcap) ** 2)
    return torch.where(keep[:, None], dz, 0.0)


def dlogits_torch(x, t, lse, g, ignore_index: int, smoothing: float, offset: int = 0, v_total=None):
    """dlogits with torch ops, in lse's dtype, for the classes [offset, offset + V) of v_total (a slice of
    a vocabulary split across ranks; by default the whole row)."""
    xc = x.to(lse.dtype)
    p = (xc - torch.where(lse == float("-inf"), 0.0, lse)[:, None]).exp()
    t = t.long()
    keep = t != ignore_index
    local = t - offset
    own = keep & (local >= 0) & (local < x.shape[-1])
    hot = (torch.arange(x.shape[-1], device=x.device) == local[:, None]) & own[:, None]
    n = x.shape[-1] if v_total is None else v_total  # a 0-d tensor for a vocabulary split across ranks
    d = p - (1 - smoothing) * hot.to(p.dtype) - smoothing / (n.to(p.dtype) if isinstance(n, torch.Tensor) else n)
    return torch.where(keep[:, None], d * g.to(d.dtype)[:, None], 0.0)


# ---- native: torch's CPU kernels, the conventions applied after ----------------------------------------
# torch.softmax and log_softmax differ from the conventions only on a fully masked row, which they make NaN
# across, as they do every row holding NaN or +inf. So the rows to fix are among those whose first output is
# NaN: M reads, and a pass over x only when there is one. Their backward kernels give a fully masked row 0
# for softmax (NaN where dy is not finite: the same test finds those) and dy for log_softmax (found from y's
# first elements). torch's 16-bit log_softmax along rows in memory loses the digits of outputs near 0
# (errors past 100x the tolerance: tests/test_cpu_path.py), so those rows are computed in fp32 a chunk of
# rows at a time (in cache: no fp32 copy of x is made) and rounded once. Its fp64 log_softmax sums a row's
# exps in a few vector lanes, the small ones added one by one to the lane that holds the max's 1, each
# rounded to 1's ulp: outputs near 0 miss the fp64 tolerance (tests/test_cpu_path.py), so fp64 log_softmax
# takes the reference's torch ops instead (torch.sum's cascade sum). Traffic: the forward reads x once and
# writes y once, as torch's (fp64 log_softmax: a few passes more); the backward reads y and dy, writes dx.

NATIVE = heuristics.Plan("torch", "native")
CHUNK = 1 << 18  # elements of a chunk of fp32 rows (1 MiB, about a core's L2): dev/cpu_speed.py chunks
READ_ROWS = 64  # rows whose first elements are read from memory (more: torch ops, a few us whatever M)
_WIDER = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}  # exact conversions upwards
# per dtype: (its bits as an unsigned int, the bits of +inf, of 100.0, the sign bit; its values as a ctypes
# type, where Python has one)
_BITS = {
    torch.float32: (ctypes.c_uint32, 0x7F800000, 0x42C80000, 1 << 31, ctypes.c_float),
    torch.float64: (ctypes.c_uint64, 0x7FF0000000000000, 0x4059000000000000, 1 << 63, ctypes.c_double),
    torch.float16: (ctypes.c_uint16, 0x7C00, 0x5640, 1 << 15, None),
    torch.bfloat16: (ctypes.c_uint16, 0x7F80, 0x42C8, 1 << 15, None),
}
# ctypes arrays as long as any tensor: from_address reads nothing, and a slice reads only what it names
_SPAN = 1 << 40
_SPANS = {c: c * _SPAN for b in _BITS.values() for c in (b[0], b[4]) if c is not None}


def _last(x: torch.Tensor, dim: int) -> bool:
    """Whether dim's rows lie in memory, as torch's kernels see them (every later dim of size 1)."""
    return dim == x.dim() - 1 or all(s == 1 for s in x.shape[dim + 1 :])


def _firsts(t: torch.Tensor, dim: int, ctype):
    """Each row's first element along dim of a contiguous t, read from its memory as ``ctype`` (a list)
    where its rows lie in memory and there are at most READ_ROWS of them (a torch op on a small tensor costs
    as much as the softmax of a row of 4096); else None."""
    n = t.shape[dim]
    m = t.numel() // n
    if m > READ_ROWS or (m > 1 and not _last(t, dim)):
        return None
    return _SPANS[ctype].from_address(t.data_ptr())[0 : (m - 1) * n + 1 : n]


def _any_nan_first(t: torch.Tensor, dim: int) -> bool:
    """Whether a row of the contiguous t starts with NaN; may also say so for a first column that holds
    both +inf and -inf (callers confirm)."""
    uint, inf, _, sign, value = _BITS[t.dtype]
    if t.numel() == t.shape[dim]:  # one row: its first element's bits
        return uint.from_address(t.data_ptr()).value & (sign - 1) > inf
    if value is not None:
        values = _firsts(t, dim, value)
        if values is not None:
            s = sum(values)  # NaN iff one is NaN (or both infinities are there)
            return s != s
    else:
        bits = _firsts(t, dim, uint)
        if bits is not None:
            return any(b & (sign - 1) > inf for b in bits)
    return bool(t.select(dim, 0).isnan().any())


def _any_underflow_first(t: torch.Tensor, dim: int) -> bool:
    """Whether a row of the contiguous t starts below -100 (its exp may be 0 in fp32, as every exp of a
    fully masked row is); NaN does not."""
    uint, inf, hundred, sign, _ = _BITS[t.dtype]
    bits = _firsts(t, dim, uint)
    if bits is None:
        return bool((t.select(dim, 0) < -100.0).any())
    return any(b & sign and hundred < b & (sign - 1) <= inf for b in bits)


def _dense_order(t: torch.Tensor) -> list[int] | None:
    """The permutation of t's dims that makes it contiguous, or None (overlapping or with gaps)."""
    perm = sorted(range(t.dim()), key=t.stride, reverse=True)
    return perm if t.permute(perm).is_contiguous() else None


def _unpermute(out: torch.Tensor, perm: list[int], like: torch.Tensor) -> torch.Tensor:
    """out, computed on like.permute(perm), in like's layout (torch.empty_like(like)'s: like's own strides,
    size-1 dims included)."""
    out = out.permute([perm.index(d) for d in range(len(perm))])
    return out if out.stride() == like.stride() else out.as_strided(like.shape, like.stride())


def _empty_like_layout(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """out (contiguous) in torch.empty_like(like)'s layout, copied once if that is another."""
    want = torch.empty_like(like, dtype=out.dtype, device="meta").stride()
    return out if out.stride() == want else torch.empty_like(like, dtype=out.dtype).copy_(out)


def _rows_wide(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype, wide: torch.dtype) -> torch.Tensor:
    """softmax / log_softmax of the contiguous x along dim, whose rows lie in memory, computed in ``wide``
    and rounded once to out_dtype, a chunk of rows at a time."""
    kernel = torch._log_softmax if log else torch._softmax
    if x.numel() <= CHUNK:  # one chunk
        if x.dtype == wide:
            return kernel(x, dim, False).to(out_dtype)
        b = x.to(wide)
        return kernel(b, dim, False, out=b).to(out_dtype)
    n = x.shape[dim]
    y = torch.empty(x.shape, dtype=out_dtype)
    xs, ys = x.view(-1, n), y.view(-1, n)
    rows = max(1, CHUNK // n)
    buf = torch.empty((rows, n), dtype=wide)
    for i in range(0, xs.shape[0], rows):
        b = buf[: min(rows, xs.shape[0] - i)]
        kernel(b.copy_(xs[i : i + rows]), 1, False, out=b)
        ys[i : i + rows].copy_(b)
    return y


def native_softmax(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """softmax (log_softmax) of x along dim (non-negative) with torch's CPU kernels and the library's
    conventions, in out_dtype, laid out as torch.empty_like(x). Precondition: x has elements and dims."""
    if not x.is_contiguous():
        perm = _dense_order(x)
        if perm is None:  # (torch's kernels would copy it contiguous too)
            return _empty_like_layout(native_softmax(x.contiguous(), dim, log, out_dtype), x)
        return _unpermute(native_softmax(x.permute(perm), perm.index(dim), log, out_dtype), perm, x)
    low_log = log and x.dtype in dtypes.LOW and _last(x, dim)
    rows = torch_build.row_kernels() if out_dtype == x.dtype else None
    if rows is not None and (y := rows.softmax_rows(x, dim, log)) is not None:
        pass  # (the row kernels, where they apply)
    elif log and out_dtype == torch.float64:  # the reference's formula (see above)
        y = softmax_torch(x, dim, True, out_dtype)[0]
    elif out_dtype == x.dtype and not low_log:
        y = torch._log_softmax(x, dim, False) if log else torch._softmax(x, dim, False)
    elif _WIDER[out_dtype] > _WIDER[x.dtype] and not low_log:  # x converted exactly, computed in out_dtype
        y = torch.log_softmax(x, dim, dtype=out_dtype) if log else torch.softmax(x, dim, dtype=out_dtype)
    else:  # computed in fp32 (fp64 where either is), rounded once
        wide = torch.float64 if torch.float64 in (x.dtype, out_dtype) else torch.float32
        if _last(x, dim):
            y = _rows_wide(x, dim, log, out_dtype, wide)
        else:
            y = (torch.log_softmax if log else torch.softmax)(x, dim, dtype=wide).to(out_dtype)
    if _any_nan_first(y, dim):  # a fully masked row, or one holding NaN or +inf (which stays NaN)
        y.masked_fill_(x.amax(dim, keepdim=True) == float("-inf"), float("-inf") if log else 0.0)
    return y


NATIVE_GRAPH = heuristics.Plan("torch", "native_graph")  # the forward; its backward is a C++ node's (no plan)


def native_softmax_graph(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor | None:
    """native_softmax of a contiguous x that requires grad, in x's dtype, with a C++ autograd graph, at a
    fraction of a Python Function's host time. fp32 and bf16 rows in memory: the row kernels with their node
    (fastlaunch_torch's SoftmaxRowsBackward: the backward row kernels, native_softmax_backward's, and the
    library's fp32 formula under create_graph; torch's own node would run it in 16 bits for bf16). Else fp32
    (fp64 softmax): torch's own graph, whose backward runs the kernel native_softmax_backward runs for y and
    dy of x's dtype and whose double backward the formula of the library's. None where none applies (fp16,
    fp64 log_softmax: another formula; bf16 without the row kernels), or where a row's first output is NaN: a
    fully masked row, whose gradient torch makes NaN and the library 0 (or a row holding NaN or +inf); the
    caller then takes the Function."""
    if x.dtype not in (torch.float32, torch.bfloat16) and (log or x.dtype is not torch.float64):
        return None
    rows = torch_build.row_kernels()
    if rows is None or (y := rows.softmax_rows(x, dim, log)) is None:  # (the row kernels and their graph)
        if x.dtype is torch.bfloat16:
            return None
        y = torch._log_softmax(x, dim, False) if log else torch._softmax(x, dim, False)
    return None if _any_nan_first(y, dim) else y


def native_softmax_backward(
    dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """dx of softmax (log_softmax) from its output y with the row kernels (fp32 and bf16 rows in memory, one
    dtype) or torch's CPU kernels, in out_dtype, laid out as torch.empty_like(y), computed in fp32 (fp64
    where any of them is); 0 on fully masked rows whatever dy holds: for log_softmax the rows whose exps sum
    to 0, as on every backend; for softmax the rows of zeros (a y of mixed signs that merely sums to 0,
    never a softmax output, gets the formula's value)."""
    if not y.is_contiguous():
        perm = _dense_order(y)
        if perm is None:
            return _empty_like_layout(native_softmax_backward(dy, y.contiguous(), dim, log, out_dtype), y)
        dx = native_softmax_backward(dy.permute(perm), y.permute(perm), perm.index(dim), log, out_dtype)
        return _unpermute(dx, perm, y)
    rows = torch_build.row_kernels() if y.dtype == dy.dtype == out_dtype else None
    if rows is not None and (dx := rows.softmax_backward_rows(dy, y, dim, log)) is not None:
        return dx  # (the row kernels, where they apply: fully masked rows 0 there)
    kernel = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    if y.dtype == dy.dtype == out_dtype:
        dx = kernel(dy, y, dim, y.dtype)
    else:  # computed in fp32 (fp64 where any is one) from exact conversions, rounded once
        wide = torch.float64 if torch.float64 in (y.dtype, dy.dtype, out_dtype) else torch.float32
        dx = kernel(dy.to(wide), y.to(wide), dim, wide).to(out_dtype)
    if _any_underflow_first(y, dim) if log else _any_nan_first(dx, dim):
        wide = torch.float64 if torch.float64 in (y.dtype, dy.dtype, out_dtype) else torch.float32
        f = y.to(wide).exp() if log else y.to(wide)
        dx.masked_fill_(f.sum(dim, keepdim=True) == 0, 0.0)
    return dx


# ---- native cross-entropy: torch's loss on fp32 rows, and dlogits from a softmax recomputed ----------------
# torch.nn.functional.cross_entropy is the library's formula (class weights, smoothing, ignore_index, the
# mean over the kept weight) on fp32 and fp64 logits. 16-bit logits go through it in fp32 chunks, as its
# 16-bit log_softmax would lose digits (see above). Logits past one chunk run a chunk of rows at a time in
# every dtype, with reduction 'none', reduced here: torch would write an M x V log_softmax first. The
# backward writes dlogits = a * softmax(x) - b * onehot(t) - c * w per row, a chunk at a time: one read of
# the logits, one write, no M x V temporary (torch's writes a dense upstream gradient and reads it back).
# Without smoothing, logits that need a gradient keep a C++ graph instead (native_cross_entropy_graph): the
# row kernels' at any size, else torch's within one chunk.

NATIVE_CE = heuristics.Plan("torch", "native_cross_entropy")
NATIVE_CE_GRAPH = heuristics.Plan("torch", "native_cross_entropy_graph")  # torch's autograd graph backward
_REDUCTION = {"none": 0, "mean": 1, "sum": 2}  # torch's enum


def native_cross_entropy(x, t, w, ignore_index: int, reduction: str, smoothing: float) -> torch.Tensor:
    """The loss of (M, V) logits x (unit stride along V) and int64 targets t (M,), in x's dtype, computed in
    fp32 (fp64 for fp64 x); w: (V,) class weights in that dtype, or None. Targets out of range and not
    ignore_index raise torch's IndexError."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    m, v = x.shape
    rows = torch_build.row_kernels() if w is None else None
    if rows is not None:  # (the row kernels, where they apply: any number of rows, no chunks)
        if (y := rows.cross_entropy_rows(x, t, ignore_index, _REDUCTION[reduction], smoothing)) is not None:
            return y
    loss = torch._C._nn.cross_entropy_loss
    if x.numel() <= CHUNK:
        if x.dtype == wide:
            return loss(x, t, w, _REDUCTION[reduction], ignore_index, smoothing)
        return loss(x.to(wide), t, w, _REDUCTION[reduction], ignore_index, smoothing).to(x.dtype)
    per = torch.empty(m, dtype=wide)
    rows = max(1, CHUNK // v)
    buf = None if x.dtype == wide else torch.empty((rows, v), dtype=wide)
    for i in range(0, m, rows):
        xc = x[i : i + rows]
        per[i : i + rows] = loss(
            xc if buf is None else buf[: xc.shape[0]].copy_(xc), t[i : i + rows], w, 0, ignore_index, smoothing
        )
    if reduction == "none":
        return per.to(x.dtype)
    total = per.sum()
    if reduction == "sum":
        return total.to(x.dtype)
    _, w_kept = kept_rows(t, ignore_index, w, v, wide)
    return torch.where(w_kept == 0, float("nan"), total / w_kept).to(x.dtype)  # (as reduce_terms)


def native_cross_entropy_graph(x, t, w, ignore_index: int, reduction: str, rows_only: bool = False):
    """native_cross_entropy of logits that require grad, without smoothing, with a C++ graph: the row
    kernels' (CrossEntropyRowsBackward: no M x V temporary, any size) where they apply, else, within one
    chunk, torch's log_softmax and nll_loss on fp32 (fp64) rows, whose backward torch runs in C++ (on a
    small problem a Python backward costs more than the whole of torch's). None where a row's log_softmax
    is NaN (there torch's gradient is not the library's), or with ``rows_only`` (logits past one chunk)
    where the row kernels do not apply: the caller takes its Function instead."""
    rows = torch_build.row_kernels() if w is None else None
    if (
        rows is not None
        and (loss := rows.cross_entropy_rows(x, t, ignore_index, _REDUCTION[reduction], 0.0)) is not None
    ):
        return loss  # (the row kernels and their graph; None where they do not apply or a row is NaN)
    if rows_only:
        return None
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    ls = torch._log_softmax(x if x.dtype == wide else x.to(wide), 1, False)
    if _any_nan_first(ls, 1):
        return None
    loss = torch._C._nn.nll_loss_nd(ls, t, w, _REDUCTION[reduction], ignore_index)
    return loss if loss.dtype == x.dtype else loss.to(x.dtype)


def native_cross_entropy_backward(x, t, w, g, ignore_index: int, reduction: str, smoothing: float) -> torch.Tensor:
    """dlogits (M, V) in x's dtype, computed in fp32 (fp64 for fp64 x), for native_cross_entropy's arguments
    (targets already checked) and the loss's gradient g; ignored rows 0, NaN or +inf logits NaN on kept rows,
    and a fully masked row as the reference has it (its softmax taken as 0)."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    m, v = x.shape
    keep = t != ignore_index
    kept = int(keep.sum())
    if reduction == "none":
        g_row = g.reshape(m).to(wide)
    elif reduction == "mean":
        g_row = g.to(wide) / (kept if w is None else kept_rows(t, ignore_index, w, v, wide)[1])
    else:
        g_row = g.to(wide)
    if kept == m:  # (no row ignored: no index to clamp; a scalar factor when every row has the same)
        tt = t[:, None]
        b = (g_row.item() if g_row.dim() == 0 else g_row[:, None]) if w is None else (g_row * w[t])[:, None]
    else:
        tt = torch.where(keep, t, 0)
        b = torch.where(keep, g_row if w is None else g_row * w[tt], 0.0)[:, None]  # each row's factor
        tt = tt[:, None]
    # dlogits = b * (softmax - (1 - e) * onehot - e / V) without class weights; with them and smoothing,
    # a * softmax - (1 - e) * b * onehot - c * w, a = (1 - e) * b + c * sum(w), c = (e / V) * g per kept row.
    if w is not None and smoothing:
        c = torch.where(keep, g_row * (smoothing / v), 0.0)[:, None]
        a, hot = (1 - smoothing) * b + c * w.sum(), (smoothing - 1) * b

        def finish(p, r):
            p.mul_(a[r]).scatter_add_(1, tt[r], hot[r]).addcmul_(c[r], w, value=-1.0)
    else:

        def finish(p, r):
            p.scatter_(1, tt[r], smoothing - 1.0, reduce="add")
            if smoothing:
                p.sub_(smoothing / v)
            p.mul_(b if type(b) is float else b[r])

    rows = max(1, CHUNK // v)
    if m <= rows:  # one chunk
        p = torch._softmax(x, 1, False) if x.dtype == wide else torch._softmax(xw := x.to(wide), 1, False, out=xw)
        finish(p, slice(None))
        dx = p.to(x.dtype)
    else:
        dx = torch.empty((m, v), dtype=x.dtype)
        buf = None if x.dtype == wide else torch.empty((rows, v), dtype=wide)
        for i in range(0, m, rows):
            r = slice(i, min(i + rows, m))
            p = dx[r] if buf is None else buf[: r.stop - i].copy_(x[r])
            finish(torch._softmax(x[r] if buf is None else p, 1, False, out=p), r)
            if buf is not None:
                dx[r].copy_(p)
    if _any_nan_first(dx, 1):  # a NaN softmax: logits holding NaN or +inf, or a fully masked row
        r = dx[:, 0].isnan().nonzero()[:, 0]
        xr = x[r].to(wide)
        o = Loss(ignore_index, "none", smoothing)
        zero = torch.zeros((), dtype=wide)
        dx[r] = dlogits_options(xr, t[r], logsumexp_torch(xr), g_row.expand(m)[r], zero, o, w).to(x.dtype)
    return dx


def native_dlogits_differentiable(logits, t, w, g, ignore_index: int, reduction: str, smoothing: float):
    """dlogits in torch ops differentiable in the logits (of any shape (..., V)) and in g: create_graph's
    (ops.dlogits_differentiable's formulas, the counts taken from the targets)."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    kept, w_kept = kept_rows(t, ignore_index, w, v, wide)
    g_ce, g_z = row_grads(g, kept, w_kept, reduction, x.shape[0])
    o = Loss(ignore_index, reduction, smoothing)
    lse = logsumexp_torch(x.to(wide))
    dx = dlogits_options(x, t, lse, g_ce.to(wide), g_z.to(wide), o, w)
    return dx.to(logits.dtype).reshape(logits.shape)
