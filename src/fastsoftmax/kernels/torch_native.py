"""The torch backend's native path (kernels/torch_ops.py): what backend='auto' runs on CPU tensors, torch's own
CPU kernels with the library's conventions applied after them, where they differ."""

from __future__ import annotations

import ctypes

import torch

from .. import heuristics
from ..core import dtypes
from ..core.layout import flat
from ..core.options import Loss
from ..core.reference import logsumexp_torch, softmax_torch
from .torch_loss import dlogits_options, kept_rows

# torch.softmax and log_softmax differ from the conventions only on a fully masked row, which they make NaN
# across, as they do every row holding NaN or +inf. So the rows to fix are among those whose first output is
# NaN: M reads, and a pass over x only when there is one. Their backward kernels give a fully masked row 0
# for softmax (NaN where dy is not finite: the same test finds those) and dy for log_softmax (found from y's
# first elements). torch's 16-bit log_softmax along rows in memory loses the digits of outputs near 0
# (errors past 100x the tolerance: tests/test_cpu_precision.py), so those rows are computed in fp32 a chunk of
# rows at a time (in cache: no fp32 copy of x is made) and rounded once. Its fp64 log_softmax sums a row's
# exps in a few vector lanes, the small ones added one by one to the lane that holds the max's 1, each
# rounded to 1's ulp: outputs near 0 miss the fp64 tolerance (tests/test_cpu_precision.py), so fp64 log_softmax
# takes the reference's torch ops instead (torch.sum's cascade sum). Its fp32 kernels sum in vector lanes too:
# past LONG_FP32 elements a row's sum misses the fp32 tolerance (tests/test_cpu_precision.py), so such rows are
# computed in fp64 a chunk at a time and rounded once (about 2x torch's time there). Traffic: the forward
# reads x once and writes y once, as torch's (fp64 log_softmax: a few passes more); the backward reads y and
# dy, writes dx.

NATIVE = heuristics.Plan("torch", "native")
CHUNK = 1 << 18  # elements of a chunk of fp32 rows (1 MiB, about a core's L2): dev/cpu_speed.py chunks
LONG_FP32 = 1 << 16  # fp32 rows longer: computed in fp64 (2^17 already missed twice torch ops' error)
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


def _firsts_reader(t: torch.Tensor, dim: int, ctype):
    """A function of a contiguous tensor of t's shape: its rows' first elements, read from its memory as
    ``ctype`` (a list), where there are at most READ_ROWS rows and they lie in memory (a torch op on a small
    tensor costs as much as the softmax of a row of 4096); else None."""
    n = t.shape[dim]
    m = t.numel() // n if n else 0
    if m > READ_ROWS or (m > 1 and not _last(t, dim)):
        return None
    picks, span = slice(0, (m - 1) * n + 1, n), _SPANS[ctype]
    return lambda u: span.from_address(u.data_ptr())[picks]


def nan_first_test(t: torch.Tensor, dim: int):
    """The test _any_nan_first makes on every contiguous tensor of t's shape and dtype, chosen once (a
    replay keeps it): a function of such a tensor."""
    uint, inf, _, sign, value = _BITS[t.dtype]
    mask = sign - 1
    if t.numel() == t.shape[dim] and value is not None:  # one row: its first value (NaN iff unequal to itself)

        def one_value(u):
            v = value.from_address(u.data_ptr()).value
            return v != v

        return one_value
    firsts = _firsts_reader(t, dim, value or uint)
    if firsts is None:
        return lambda u: bool(u.select(dim, 0).isnan().any())
    if value is not None:

        def values(u):
            s = sum(firsts(u))
            return s != s  # (NaN iff one is NaN, or both infinities are there)

        return values
    return lambda u: any(b & mask > inf for b in firsts(u))


def _any_nan_first(t: torch.Tensor, dim: int) -> bool:
    """Whether a row of the contiguous t starts with NaN; may also say so for a first column that holds
    both +inf and -inf (callers confirm)."""
    return nan_first_test(t, dim)(t)


def underflow_first_test(t: torch.Tensor, dim: int):
    """The test _any_underflow_first makes on every contiguous tensor of t's shape and dtype, chosen once (a
    replay keeps it): a function of such a tensor."""
    uint, inf, hundred, sign, _ = _BITS[t.dtype]
    mask = sign - 1
    firsts = _firsts_reader(t, dim, uint)
    if firsts is None:
        return lambda u: bool((u.select(dim, 0) < -100.0).any())
    return lambda u: any(b & sign and hundred < b & mask <= inf for b in firsts(u))


def _any_underflow_first(t: torch.Tensor, dim: int) -> bool:
    """Whether a row of the contiguous t starts below -100 (its exp may be 0 in fp32, as every exp of a
    fully masked row is); NaN does not."""
    return underflow_first_test(t, dim)(t)


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
    """softmax / log_softmax of the contiguous x along dim, whose rows lie in memory, past one chunk (CHUNK
    elements), computed in ``wide`` and rounded once to out_dtype, a chunk of rows at a time."""
    kernel = torch._log_softmax if log else torch._softmax
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


def _usual(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> bool:
    """The usual case: torch's kernel in x's own dtype on rows in memory (fp32 for log_softmax)."""
    if out_dtype is not x.dtype or (log and out_dtype is not torch.float32) or _long_fp32(x, dim):
        return False
    return x.is_contiguous() and _last(x, dim)


def _long_fp32(x: torch.Tensor, dim: int) -> bool:
    """fp32 rows too long for torch's fp32 kernels' sums (LONG_FP32)."""
    return x.dtype is torch.float32 and x.shape[dim] > LONG_FP32


def _usual_softmax(x: torch.Tensor, dim: int, log: bool, nan_first) -> torch.Tensor:
    """torch's kernel, then the fully masked rows set to 0 (-inf), found by ``nan_first`` (nan_first_test's)."""
    y = torch._log_softmax(x, dim, False) if log else torch._softmax(x, dim, False)
    if nan_first(y):  # a fully masked row, or one holding NaN or +inf (which stays NaN)
        y.masked_fill_(x.amax(dim, keepdim=True) == float("-inf"), float("-inf") if log else 0.0)
    return y


def softmax_call(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> tuple:
    """(fn, args): native_softmax's call for every tensor of x's shape, strides and dtype, fn(x, *args), the
    usual case's own function where it is one (what the eager replay makes again: no choice on the way)."""
    if _usual(x, dim, log, out_dtype):
        return _usual_softmax, (dim, log, nan_first_test(x, dim))
    return native_softmax, (dim, log, out_dtype)


def native_softmax(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """softmax (log_softmax) of x along dim (non-negative) with torch's CPU kernels and the library's
    conventions, in out_dtype, laid out as torch.empty_like(x). Precondition: x has elements and dims."""
    if _usual(x, dim, log, out_dtype):
        return _usual_softmax(x, dim, log, nan_first_test(x, dim))
    if not x.is_contiguous():
        perm = _dense_order(x)
        if perm is None:  # (torch's kernels would copy it contiguous too)
            return _empty_like_layout(native_softmax(x.contiguous(), dim, log, out_dtype), x)
        return _unpermute(native_softmax(x.permute(perm), perm.index(dim), log, out_dtype), perm, x)
    if not _last(x, dim):  # rows not in memory: torch's kernels would add each row's exps up one by one
        y = native_softmax(x.movedim(dim, -1).contiguous(), x.dim() - 1, log, out_dtype)
        return y.movedim(-1, dim).contiguous()
    low_log = log and x.dtype in dtypes.LOW and _last(x, dim)
    long = out_dtype == x.dtype and _long_fp32(x, dim)  # (fp32 in and out: computed in fp64)
    if log and out_dtype == torch.float64:  # the reference's formula (see above)
        y = softmax_torch(x, dim, True, out_dtype)[0]
    elif _WIDER[out_dtype] > _WIDER[x.dtype] and not low_log:  # x converted exactly, computed in out_dtype
        y = torch.log_softmax(x, dim, dtype=out_dtype) if log else torch.softmax(x, dim, dtype=out_dtype)
    else:  # computed in fp32 (fp64 where either is, or for long fp32 rows), rounded once
        wide = torch.float64 if torch.float64 in (x.dtype, out_dtype) or long else torch.float32
        if _last(x, dim) and x.numel() > CHUNK:
            y = _rows_wide(x, dim, log, out_dtype, wide)
        else:
            y = (torch.log_softmax if log else torch.softmax)(x, dim, dtype=wide).to(out_dtype)
    if _any_nan_first(y, dim):  # a fully masked row, or one holding NaN or +inf (which stays NaN)
        y.masked_fill_(x.amax(dim, keepdim=True) == float("-inf"), float("-inf") if log else 0.0)
    return y


NATIVE_GRAPH = heuristics.Plan("torch", "native_graph")  # the forward; its backward is a torch node's (no plan)


def softmax_graph(x: torch.Tensor, dim: int, log: bool) -> torch.Tensor | None:
    """native_softmax of a contiguous x that requires grad, in x's dtype, with torch's own autograd nodes,
    at a fraction of a Python Function's host time, where torch's kernels are the native path's: softmax in
    x's dtype, fp32 log_softmax (grad_fn SoftmaxBackward0, LogSoftmaxBackward0: their backward is
    native_softmax_backward's kernel); 16-bit log_softmax computed in fp32 and rounded once, as
    native_softmax does (the node's backward in fp32, then ToCopyBackward0). None where a row's first output
    is NaN (a fully masked row, whose gradient torch makes NaN and the library 0, or a row holding NaN or
    +inf), for fp64 log_softmax (the reference's formula), long fp32 rows (computed in fp64) and rows not in
    memory: the caller then runs its Function."""
    if not x.is_contiguous() or not _last(x, dim) or (log and x.dtype is torch.float64) or _long_fp32(x, dim):
        return None  # (rows not in memory: native_softmax moves them last first, torch's node would not)
    if log and x.dtype in dtypes.LOW:
        y = torch.log_softmax(x, dim, dtype=torch.float32)
    else:
        y = torch._log_softmax(x, dim, False) if log else torch._softmax(x, dim, False)
    if _any_nan_first(y, dim):
        return None
    return y.to(x.dtype) if y.dtype is not x.dtype else y


def cross_entropy_graph(x, t, w, ignore_index: int, reduction: str, out_dtype) -> torch.Tensor | None:
    """native_cross_entropy of (M, V) logits that require grad, without smoothing, softcap or z-loss, with
    torch's own autograd nodes (log_softmax and nll_loss in fp32, fp64 for fp64; grad_fn NllLossBackward0),
    within one chunk (CHUNK elements: beyond, torch's backward writes an M x V temporary). None past a chunk,
    or where a row's log_softmax is NaN (there torch's gradient is not the library's): the caller then runs
    its Function. The class weights never require grad here (checks.loss_extras refuses them)."""
    if x.numel() > CHUNK:
        return None
    t, w = loss_inputs(x, t, w)
    wide = dtypes.wide(x.dtype)
    ls = torch._log_softmax(x if x.dtype is wide else x.to(wide), 1, False)
    if _any_nan_first(ls, 1):
        return None
    loss = torch._C._nn.nll_loss_nd(ls, t, w, _REDUCTION[reduction], ignore_index)
    return loss if loss.dtype is out_dtype else loss.to(out_dtype)


def _usual_backward(dy: torch.Tensor, y: torch.Tensor, dim: int, out_dtype: torch.dtype) -> bool:
    """The backward's usual case: torch's kernel in the tensors' own dtype on rows in memory."""
    return out_dtype is y.dtype is dy.dtype and y.is_contiguous() and _last(y, dim)


def _usual_softmax_backward(dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, first) -> torch.Tensor:
    """torch's kernel, then the fully masked rows set to 0 (see native_softmax_backward), found by ``first``:
    nan_first_test's for softmax, underflow_first_test's for log_softmax (of y)."""
    dx = (torch._log_softmax_backward_data if log else torch._softmax_backward_data)(dy, y, dim, y.dtype)
    if not first(y if log else dx):
        return dx
    wide = torch.float64 if y.dtype is torch.float64 else torch.float32
    f = y.to(wide).exp() if log else y
    dx.masked_fill_(f.sum(dim, keepdim=True, dtype=wide) == 0, 0.0)
    return dx


def softmax_backward_call(dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype) -> tuple:
    """(fn, args): native_softmax_backward's call for every dy and y of these shapes, strides and dtypes (and
    negation), fn(dy, y, *args), as softmax_call."""
    if _usual_backward(dy, y, dim, out_dtype):
        return _usual_softmax_backward, (dim, log, (underflow_first_test if log else nan_first_test)(y, dim))
    return native_softmax_backward, (dim, log, out_dtype)


def native_softmax_backward(
    dy: torch.Tensor, y: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """dx of softmax (log_softmax) from its output y with torch's CPU kernels, in out_dtype, laid out as
    torch.empty_like(y), computed in fp32 (fp64 where any of them is); 0 on fully masked rows whatever dy
    holds: for log_softmax the rows whose exps sum to 0, as on every backend; for softmax the rows of zeros
    (a y of mixed signs that merely sums to 0, never a softmax output, gets the formula's value). y and dy
    hold their values in memory (no lazily negated view: dispatch.py resolves them, layout.values)."""
    if _usual_backward(dy, y, dim, out_dtype):
        return _usual_softmax_backward(dy, y, dim, log, (underflow_first_test if log else nan_first_test)(y, dim))
    if not y.is_contiguous():
        perm = _dense_order(y)
        if perm is None:
            return _empty_like_layout(native_softmax_backward(dy, y.contiguous(), dim, log, out_dtype), y)
        dx = native_softmax_backward(dy.permute(perm), y.permute(perm), perm.index(dim), log, out_dtype)
        return _unpermute(dx, perm, y)
    if not _last(y, dim):  # rows not in memory: torch's kernel would add each row's terms up one by one
        last = y.dim() - 1
        dx = native_softmax_backward(dy.movedim(dim, -1).contiguous(), y.movedim(dim, -1).contiguous(), last, log,
                                     out_dtype)  # fmt: skip
        return dx.movedim(-1, dim).contiguous()
    kernel = torch._log_softmax_backward_data if log else torch._softmax_backward_data
    # (the dtypes differ here: computed in fp32, fp64 where any is one, from exact conversions, rounded once)
    wide = torch.float64 if torch.float64 in (y.dtype, dy.dtype, out_dtype) else torch.float32
    dx = kernel(dy.to(wide), y.to(wide), dim, wide).to(out_dtype)
    if _any_underflow_first(y, dim) if log else _any_nan_first(dx, dim):
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

NATIVE_CE = heuristics.Plan("torch", "native_cross_entropy")


def loss_inputs(x, t, w):
    """(int64 targets, the class weights in the loss's compute dtype (fp32; fp64 for fp64 x) with no gradient,
    or None): what torch's CPU loss kernels take."""
    t = t if t.dtype == torch.int64 else t.long()
    if w is not None:
        w = w.detach().to(dtypes.wide(x.dtype))
    return t, w


_REDUCTION = {"none": 0, "mean": 1, "sum": 2}  # torch's enum


def native_cross_entropy(x, t, w, ignore_index: int, reduction: str, smoothing: float, out_dtype, lse=None):
    """The loss of (M, V) logits x (unit stride along V) and int64 targets t (M,), in out_dtype, computed in
    fp32 (fp64 for fp64 x); w: (V,) class weights in that dtype, or None. ``lse``: an (M,) float64 tensor,
    or None: each row's logsumexp written there from the same chunk (one read of the logits, one
    conversion, for the loss and the statistics autograd keeps). Targets out of range and not ignore_index
    raise torch's IndexError."""
    wide = dtypes.wide(x.dtype)
    m, v = x.shape
    if x.numel() <= CHUNK:
        xw = x if x.dtype == wide else x.to(wide)
        out = _loss_rows(xw, t, w, _REDUCTION[reduction], ignore_index, smoothing, lse, xw is not x)
        return out if out.dtype == out_dtype else out.to(out_dtype)
    per = torch.empty(m, dtype=wide)
    rows = max(1, CHUNK // v)
    buf = torch.empty((rows, v), dtype=wide) if x.dtype != wide or lse is not None else None
    for i in range(0, m, rows):
        xc = x[i : i + rows]
        b = xc if buf is None else buf[: xc.shape[0]].copy_(xc)
        r = slice(i, i + xc.shape[0])
        per[r] = _loss_rows(b, t[r], w, 0, ignore_index, smoothing, None if lse is None else lse[r], b is not xc)
    if reduction == "none":
        return per.to(out_dtype)
    total = per.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    _, w_kept = kept_rows(t, ignore_index, w, v, wide)
    return torch.where(w_kept == 0, float("nan"), total / w_kept).to(out_dtype)  # (as reduce_terms)


def _loss_rows(b, t, w, reduction: int, ignore_index: int, smoothing: float, lse, scratch: bool):
    """torch's loss of the fp32 (fp64) logits b; with ``lse``, each row's logsumexp written there too:
    without smoothing from b's log_softmax (in place where b is ``scratch``, a buffer of the caller's), one
    pass where torch.logsumexp and the loss would make three: lse = max - max(log_softmax), exact where the
    max is, and -inf for a fully masked row, as logsumexp."""
    if lse is None:
        return torch._C._nn.cross_entropy_loss(b, t, w, reduction, ignore_index, smoothing)
    top = b.amax(1)
    if smoothing:  # (the max plus the log of the sum, added in float64: exact, as the other branch)
        safe = torch.where(top == float("-inf"), 0.0, top)
        torch.add(safe.double(), (b - safe[:, None]).exp_().sum(1).log_(), out=lse)
        return torch._C._nn.cross_entropy_loss(b, t, w, reduction, ignore_index, smoothing)
    ls = torch._log_softmax(b, 1, False, out=b) if scratch else torch._log_softmax(b, 1, False)
    top64 = top.double()  # (the difference in float64: the stats' logsumexp, exact)
    torch.where(top == float("-inf"), top64, top64 - ls.amax(1), out=lse)
    return torch._C._nn.nll_loss_nd(ls, t, w, reduction, ignore_index)


def plain_loss(logits, target, w, ignore_index: int, reduction: str, smoothing: float, out_dtype):
    """(loss, None, None): native_cross_entropy of a plain call's logits and targets as the caller has them
    (flattened here): the call the replay makes again (kernels/replay.py)."""
    x, t = flat(logits, target)
    t, w = loss_inputs(x, t, w)
    return native_cross_entropy(x, t, w, ignore_index, reduction, smoothing, out_dtype), None, None


def native_loss_stats(x, t, w, ignore_index: int, reduction: str, smoothing: float, out_dtype):
    """(loss, stats): native_cross_entropy's loss, and the stats the kernels' forward gives (each row's
    logsumexp, the rows kept, 1.0, their weight) in fp64, from one pass over the logits: what autograd saves
    for the backward."""
    wide = dtypes.wide(x.dtype)
    m, v = x.shape
    stats = torch.empty(m + 3, dtype=torch.float64)
    loss = native_cross_entropy(x, t, w, ignore_index, reduction, smoothing, out_dtype, lse=stats[:m])
    kept, w_kept = kept_rows(t, ignore_index, w, v, wide)
    stats[m], stats[m + 1], stats[m + 2] = kept, 1.0, w_kept
    return loss, stats


def native_cross_entropy_backward(x, t, w, g, ignore_index: int, reduction: str, smoothing: float) -> torch.Tensor:
    """dlogits (M, V) in x's dtype, computed in fp32 (fp64 for fp64 x), for native_cross_entropy's arguments
    (targets already checked) and the loss's gradient g; ignored rows 0, NaN or +inf logits NaN on kept rows,
    and a fully masked row as the reference has it (its softmax taken as 0)."""
    wide = dtypes.wide(x.dtype)
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
