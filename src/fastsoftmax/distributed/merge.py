"""One rank's slice of classes split across ranks, for distributed/__init__.py's functions: the collectives and the
merge of their statistics, and the slice's own work.

The collectives: agree (the first all-gather: each rank's signature, checked for agreement, giving the slice's
offset in the vocabulary) and gather (the second: per-row statistics, in rank order). merge_max_sum and
Rows.merge turn the gathered statistics into each row's global numbers; Rows.coefficients turns those into
the three numbers per row of the losses' backward. Between the two collectives is O(rows) work in torch ops.

A row's statistics are its max m and the sum of exp(z - m), not its logsumexp: outputs are (z - m) - log(sum),
whose error does not grow with the logits, where z - lse with lse rounded to fp32 errs by up to |z| * 2^-24
(label smoothing's term, lse * W - sum_j w_j z_j, still does).

The slice's own work is the kernels' (triton/shard.py: one read of the slice for its statistics, one read
and one write for the output or dlogits) on CUDA tensors, torch ops on the CPU and for float64 (``backend``
as fs.cross_entropy's): slice_work() picks _Kernels or TorchOps, which answer the same calls.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from .. import dispatch, heuristics
from ..core import dtypes
from ..core.reference import max_sum_torch
from ..kernels.torch_loss import capped, row_grads

# ---- the collectives and the merge -------------------------------------------------------------------------


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (its name from torch 2.13)


def gather(stats: torch.Tensor, group) -> torch.Tensor:
    """(world, *stats.shape): every rank's stats, in rank order (one all-gather)."""
    world = dist.get_world_size(group)
    out = torch.empty(world * stats.numel(), dtype=stats.dtype, device=stats.device)
    _all_gather(out, stats.contiguous().reshape(-1), group=group)
    return out.reshape(world, *stats.shape)


def refuse(fn: str, x, group) -> None:
    """This rank's arguments failed its checks: it takes part in agree's collective all the same, its
    signature flagged, so that the other ranks raise there (naming it) rather than wait; its caller then
    raises its own error. The collective's device: x's, else the group's (cuda for NCCL)."""
    if isinstance(x, torch.Tensor) and x.device.type in ("cpu", "cuda"):
        device = x.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    sig = torch.zeros(SIGNATURE, dtype=torch.float64, device=device)
    sig[FAILED].fill_(1.0)
    gather(sig, group)


def _disagreement(fn: str, every: torch.Tensor, k: int = 0) -> str:
    """agree's error, the same on every rank (from the gathered signatures; ``k`` sampled values of x)."""
    another = _another(every[:, BASE:], k).tolist() if k else [False] * len(every)
    every = every[:, :BASE].tolist()
    failed = [r for r, sig in enumerate(every) if sig[FAILED]]
    if failed:
        who = f"rank {failed[0]}'s arguments failed its" if len(failed) == 1 else f"ranks {failed} failed their"
        return f"{fn}: {who} checks (the error there names the argument); the call stops on every rank"
    names = {v: dtypes.NAME[k] for k, v in dtypes.CODE.items()}
    seen = []
    for r, (_, rows_r, code, digest_r, targets_r, *_) in enumerate(every):
        like = rows_r == every[0][ROWS]
        other = "" if digest_r == every[0][OPTIONS] else ", other options or requires_grad"
        other += "" if targets_r == every[0][TARGETS] or not like else ", other targets"
        other += ", another x" if another[r] and like and code == every[0][DTYPE] else ""
        seen.append(f"rank {r}: {int(rows_r)} rows of {names[int(code)]}{other}")
    return (
        f"{fn}: the ranks must pass shards of the same rows and dtype, with the same options, targets and x "
        f"({'; '.join(seen)})"
    )


def merge_max_sum(ms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-rank (max, sum of exp(z - max)) pairs, (world, rows, 2), into each row's (m, ls): its max
    and the log of its sum of exp(z - m), so that log_softmax is (z - m) - ls and the logsumexp m + ls. A row
    -inf on every rank has m = -inf and ls = 0 ((z - m) - ls is then -inf with m taken as 0); a row holding
    NaN or +inf on any rank has ls NaN (the library's rule: NaN across the row)."""
    m_r, s_r = ms[..., 0], ms[..., 1]
    bad = m_r.isnan().any(0) | (m_r == float("inf")).any(0) | s_r.isnan().any(0)
    m = m_r.amax(0)
    masked = m == float("-inf")
    s = (s_r * (m_r - torch.where(masked, 0.0, m)).exp()).sum(0)
    ls = torch.where(masked, 0.0, s.log())
    return m, torch.where(bad, float("nan"), ls)


# the signature's entries: slice width, rows, dtype code, options digest, targets digest, the rank's checks
# failed (1) or passed (0), class-weight sum (entries ROWS to FAILED must agree across ranks), then SAMPLE
# values of an input every rank must hold alike (the LM head's x; zeros for the others)
BASE, ROWS, DTYPE, OPTIONS, TARGETS, FAILED = 7, 1, 2, 3, 4, 5
SAMPLE = 64
SIGNATURE = BASE + SAMPLE
X_RTOL = 0.25  # a sampled value differs from rank 0's beyond this share of the larger of the two ...
# ... and x differs where most of them do: ulps of drift between ranks pass, another rank's rows do not
_P = 2**31 - 1  # (a prime: targets that differ in one row never have the same digest)


def _row_weights(n: int, device) -> torch.Tensor:
    """r_i in [1, p) for rows 0..n-1: three rounds of an affine map mod p and a xor-shift of the row (every
    product below 2^62: a wrapped int64 product broke torch.compile's CPU code, and splitmix64's and hash32's
    outputs mod p kept r(2i) = 2 r(i) for some rows), so that no pattern of rows (a permutation, a shift,
    +1 -2 +1, one row's change against another's) cancels in targets_digest but by chance."""
    z = torch.arange(n, device=device, dtype=torch.int64)
    for m in (0x2C1B3C6D, 0x297A2D39, 0x1B873593):
        z = (z * m + 0x3C6EF372) % _P
        z = z ^ (z >> 15)
    return z % (_P - 1) + 1


def targets_digest(t: torch.Tensor) -> torch.Tensor:
    """sum_i (t_i mod p) * r_i mod p (_row_weights): a 0-d int64 tensor on t's device (no host
    synchronisation), equal for equal targets, different for targets that differ in one row, and for others
    but by a chance of about 1 in p."""
    return ((t.reshape(-1).long() % _P) * _row_weights(t.numel(), t.device) % _P).sum() % _P


def _sample(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(up to SAMPLE values of x spread evenly over it, the first and the last among them, in float64; how
    many): what the ranks compare of an input they must hold alike. No copy of x."""
    n = x.numel()
    k = min(n, SAMPLE)
    idx = torch.arange(k, device=x.device, dtype=torch.int64) * max(n - 1, 0) // max(k - 1, 1)
    return torch.take(x, idx).double(), k


def _another(xs: torch.Tensor, k: int) -> torch.Tensor:
    """Per rank, whether its sampled values (xs: (world, SAMPLE), the first k compared) differ from rank 0's:
    most of them by more than X_RTOL of the larger (NaN and infinities count as alike)."""
    a, ref = xs[:, :k], xs[:1, :k]
    far = (a - ref).abs() > X_RTOL * torch.maximum(a.abs(), ref.abs())
    return far.sum(1) * 2 > k


def agree(fn: str, x: torch.Tensor, width: int, rows: int, group, opts: tuple, w_local=None, target=None,
          shared=None):  # fmt: skip
    """The first collective: every rank's signature (its slice's width, rows, x's dtype, options digest,
    targets digest, whether its checks failed, class-weight sum, and a sample of ``shared``, an input every
    rank must hold alike), checked for agreement. Returns (this rank's offset in the vocabulary, the
    vocabulary's size, the sum of the class weights over every rank or None), 0-d tensors on x's device."""
    digest = float(int(hashlib.sha256(repr(opts).encode()).hexdigest()[:13], 16))  # < 2^52: exact in float64
    sig = torch.zeros(SIGNATURE, dtype=torch.float64, device=x.device)
    for i, v in enumerate((width, rows, dtypes.CODE[x.dtype], digest)):
        sig[i].fill_(v)  # a fill kernel each: no host-to-device copy, so a CUDA graph can capture it
    if target is not None:
        sig[TARGETS].copy_(targets_digest(target))
    k = 0
    if shared is not None:
        values, k = _sample(shared)
        sig[BASE : BASE + k].copy_(values)
    if w_local is not None:
        sig[BASE - 1].copy_(w_local.sum(dtype=torch.float64))
    every = gather(sig, group)  # (world, SIGNATURE)
    same = (every[:, ROWS:FAILED] == every[:1, ROWS:FAILED]).all() & (every[:, FAILED] == 0).all()
    if k:
        same = same & ~_another(every[:, BASE:], k).any()
    if x.is_cuda:
        torch._assert_async(
            same, f"{fn}: the ranks disagree on the row count, dtype, options, targets or x, or a rank's checks failed"
        )
    elif not bool(same):
        raise ValueError(_disagreement(fn, every, k))
    widths = every[:, 0].long()
    w_total = every[:, BASE - 1].sum() if w_local is not None else None
    return widths[: dist.get_rank(group)].sum(), widths.sum(), w_total


# ---- the slice's work: the kernels, or torch ops ------------------------------------------------------------


class _Kernels:
    """The slice's statistics and outputs by triton/shard.py's kernels."""

    name = "triton"

    def __init__(self, x, backward: bool):
        from ..kernels.triton.backend import kernels  # (the kernels import Triton)

        self.k, self.shape = kernels("shard"), kernels("cross_entropy").shape(x.shape[-1], x.element_size(), backward)

    def stats(self, x, w, cap, smooth):
        """(each row's max of capped x, its sum of exp(z - max), its sum of w * z or None), fp32."""
        n = x.shape[0]
        m, s = empty_out(n, torch.float32, x.device), empty_out(n, torch.float32, x.device)
        sums = empty_out(n, torch.float32, x.device) if smooth else s
        self.k.stats(x, None, w, m, s, sums, cap, self.shape, smooth=smooth)
        return m, s, (sums if smooth else None)

    def dot(self, y, dy, log: bool):
        """Each row's sum of dy (log) or of y * dy, fp32."""
        s = empty_out(y.shape[0], torch.float32, y.device)
        self.k.stats(y, dy, None, s, s, s, None, self.shape, dot=not log, logdot=log)
        return s

    def normalise(self, x, m, ls, log: bool, out):
        self.k.apply(1 if log else 0, x, None, out, m, ls, m, m, m, m, None, None, self.shape)
        return out

    def dlogits(self, x, m, ls, a, b, cc, t, w, cap, smooth, out):
        self.k.apply(2, x, None, out, m, ls, a, b, cc, t, w, cap, self.shape, smooth=smooth)
        return out

    def softmax_backward(self, y, dy, s, m, log: bool, out):
        self.k.apply(4 if log else 3, y, dy, out, m, m, s, s, s, s, None, None, self.shape)
        return out


class TorchOps:
    """The same in torch ops (the CPU, float64, backend='torch')."""

    name = "torch"

    def stats(self, x, w, cap, smooth):
        z = capped(x.to(dtypes.wide(x.dtype)), cap)
        m, s = max_sum_torch(z)
        if not smooth:
            return m, s, None
        return m, s, (z * w.to(z.dtype) if w is not None else z).sum(-1)

    def dot(self, y, dy, log: bool):
        acc = dtypes.wide(y.dtype) if dy.dtype != torch.float64 else torch.float64
        return (dy.to(acc) if log else y.to(acc) * dy.to(acc)).sum(-1)

    def normalise(self, x, m, ls, log: bool, out):
        d = (x.to(m.dtype) - _safe(m)[:, None]) - ls[:, None]
        return out.copy_(d if log else d.exp())

    def dlogits(self, x, m, ls, a, b, cc, t, w, cap, smooth, out):
        z = capped(x.to(m.dtype), cap)
        hot = torch.arange(x.shape[-1], device=x.device) == t[:, None]
        d = a[:, None] * ((z - _safe(m)[:, None]) - ls[:, None]).exp() - b[:, None] * hot
        if smooth:
            d = d - cc[:, None] * (w.to(d.dtype) if w is not None else 1.0)
        if cap is not None:
            d = d * (1 - (z / cap) ** 2)
        return out.copy_(torch.where((t != -2)[:, None], d, 0.0))

    def softmax_backward(self, y, dy, s, m, log: bool, out):
        yc, dyc = y.to(s.dtype), dy.to(s.dtype)
        dx = dyc - yc.exp() * s[:, None] if log else yc * (dyc - s[:, None])
        return out.copy_(torch.where((m == float("-inf"))[:, None], 0.0, dx))


def _safe(m):
    return torch.where(m == float("-inf"), 0.0, m)


def slice_work(x, backend: str, backward: bool = False):
    """The slice's worker for x: the kernels where the loss kernels run x (dispatch.select_loss), else
    torch ops; a slice without rows or columns is torch ops' (nothing to launch). Recorded (Plan 'shard')."""
    kernels = x.numel() and dispatch.select_loss(backend, x)[0].name == "triton"
    worker = _Kernels(x, backward) if kernels else TorchOps()
    heuristics.record(heuristics.Plan("triton" if kernels else "torch", "shard"))
    return worker


def empty_out(shape, dtype, device):
    """An output the kernels write whole (NaN first under heuristics.force(poison=True): a test hook)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if heuristics.poisoning() else t


def slice_stats(impl, x, w, cap, smooth):
    """impl.stats: (each row's max, sum of exp(z - max), smoothing sum or None); for an empty slice -inf
    maxima and zero sums."""
    if x.shape[-1] == 0 or x.shape[0] == 0:
        m = torch.full(x.shape[:1], float("-inf"), dtype=dtypes.wide(x.dtype), device=x.device)
        return m, torch.zeros_like(m), (torch.zeros_like(m) if smooth else None)
    return impl.stats(x, w, cap, smooth)


# ---- a loss's rows: their statistics, merged, and the backward's coefficients -------------------------------


class Rows:
    """One loss call's rows: the targets as this slice sees them, the merged statistics, the mean's divisors."""

    def __init__(self, t, o, offset, v_local: int, w_local):
        self.t, self.o = t.long(), o
        self.keep = self.t != o.ignore_index
        local = self.t - offset
        own = self.keep & (local >= 0) & (local < v_local)
        self.own = own
        self.local = torch.where(own, local, 0)
        self.code = torch.where(own, local, torch.where(self.keep, -1, -2)).to(torch.int32)  # (triton/shard.py's t)
        self.w_local = w_local

    def code_in(self, rows: slice, v0: int, v1: int) -> torch.Tensor:
        """The code of ``rows`` (the kernels' t) on this slice's classes v0 to v1: the target's column there,
        else -1 (kept) or -2 (ignored)."""
        c = self.code[rows]
        return torch.where((c >= v0) & (c < v1), c - v0, c.clamp(max=-1))

    def local_stats(self, impl, x, stats_dtype, r0: int = 0):
        """(m, 5) this slice's [max z, sum of exp(z - max), target's z, target's class weight, sum of w * z]
        for x (m, V_r): rows r0 to r0 + m of the call."""
        o = self.o
        smooth = o.smoothing != 0.0
        top, sum_e, swz = slice_stats(impl, x, self.w_local, o.softcap, smooth)
        m = x.shape[0]
        if x.shape[-1] and m:
            own, local = self.own[r0 : r0 + m], self.local[r0 : r0 + m]
            z_t = capped(x.gather(-1, local[:, None])[:, 0].to(stats_dtype), o.softcap)
            w_t = self.w_local.to(stats_dtype)[local] if self.w_local is not None else 1.0
            z_t, w_t = torch.where(own, z_t, 0.0), torch.where(own, w_t, 0.0)
        else:
            z_t = w_t = torch.zeros(m, dtype=stats_dtype, device=x.device)
        swz = swz if swz is not None else torch.zeros(m, dtype=stats_dtype, device=x.device)
        return torch.stack([top.to(stats_dtype), sum_e.to(stats_dtype), z_t, w_t, swz.to(stats_dtype)], -1)

    def merge(self, gathered, v_total, w_total):
        """The loss per row, and the numbers its backward needs, from every rank's local_stats (world, M, 5)."""
        o = self.o
        self.m, self.ls = merge_max_sum(gathered[..., :2])
        self.lse = self.m + self.ls
        z_t, self.w_t, swz = gathered[..., 2].sum(0), gathered[..., 3].sum(0), gathered[..., 4].sum(0)
        self.v_total = v_total.to(self.lse.dtype)
        self.w_total = w_total.to(self.lse.dtype) if w_total is not None else self.v_total
        ce = self.w_t * ((self.m - z_t) + self.ls)  # (lse - z_t without rounding lse: m - z_t is exact)
        if o.smoothing:
            ce = (1 - o.smoothing) * ce + (o.smoothing / self.v_total) * (self.lse * self.w_total - swz)
        ce = torch.where(self.keep, ce, 0.0)
        zr = torch.where(self.keep, o.z_loss * self.lse * self.lse, 0.0) if o.z_loss else None
        self.kept = self.keep.sum().to(self.lse.dtype)
        self.w_kept = torch.where(self.keep, self.w_t, 0.0).sum()
        return ce, zr

    def coefficients(self, grad):
        """Each row's (a, b, cc) of dlogits = a * p - b * [j == t] - cc * w_j for the upstream gradient."""
        o = self.o
        g_ce, g_z = row_grads(grad.to(self.lse.dtype), self.kept, self.w_kept, o.reduction, self.t.shape[0])
        b = g_ce * (1 - o.smoothing) * self.w_t
        cc = g_ce * (o.smoothing / self.v_total) if o.smoothing else torch.zeros_like(b)
        a = b + cc * self.w_total if o.smoothing else b
        if o.z_loss:
            a = a + g_z * (2 * o.z_loss) * _safe(self.lse)
        zero = torch.zeros((), dtype=a.dtype, device=a.device)
        return tuple(torch.where(self.keep, c, zero).contiguous() for c in (a, b, cc))
