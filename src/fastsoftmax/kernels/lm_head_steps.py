"""The LM-head loss's steps on a chunk (or slice) of logits, per backend (ops/lm_head.py runs them): the Triton
loss kernels (triton/cross_entropy.py, triton/lm_head.py), or the same formulas in torch ops (the CPU,
float64, backend='torch'). Each takes views of the call's buffers: stats (each row's logsumexp, then the
counts), the rows' losses and z-losses."""

from __future__ import annotations

from .torch_loss import dlogits_options, kept_rows, loss_rows_torch, reduce_terms, row_grads


class TritonSteps:
    """The loss kernels on one chunk or slice of logits at a time."""

    name = "triton"

    def __init__(self, x, t, w, o, v: int):
        from .triton.backend import kernels  # (the kernels import Triton)

        self.k, self.t, self.w, self.o = kernels("cross_entropy"), t, w, o
        self.fwd_shape, self.bwd_shape = (
            self.k.shape(v, x.element_size(), False),
            self.k.shape(v, x.element_size(), True),
        )
        self.wsum = self.k.weight_sum(o, w, t)  # (t: a placeholder pointer where no sum is read)

    def start(self, stats, rows_loss, rows_z, n: int, v: int):
        """The counts (the mean's divisors) into stats[n:], before any chunk's backward reads them."""
        self.k.finish(rows_loss, rows_z, self.t, self.w, stats, stats, stats[n:], v, self.o, reduce=False)

    def forward(self, logits, r0, r1, stats, rows_loss, rows_z):
        t, z = self.t[r0:r1], rows_z[r0:r1]
        self.k.rows_forward(logits, t, self.w, self.wsum, self.o, rows_loss[r0:r1], z, stats[r0:r1], self.fwd_shape)

    def backward(self, logits, r0, r1, stats, g, n: int):
        gc = g[r0:r1] if g.dim() else g
        t = self.t[r0:r1]
        self.k.rows_backward(logits, t, self.w, self.wsum, stats[r0:r1], stats[n:], gc, self.o, logits, self.bwd_shape)

    def slices(self, cols: int, elsize: int):
        """lce_sliced's two steps on a slice of ``cols`` classes (launch shapes for that width): the loss's
        (the rows' numbers merged slice by slice) and the gradients' (dlogits in place), each taking the
        slice's logits, its first class, V and the row group's views (group())."""
        fs, bs = self.k.shape(cols, elsize, False), self.k.shape(cols, elsize, True)
        k, w, ws, o = self.k, self.w, self.wsum, self.o

        def loss(logits, v0, v, grp, part=None):
            t, rows_loss, rows_z, lse, run, _, _, _ = grp
            k.rows_forward(logits, t, w, ws, o, rows_loss, rows_z, lse, fs, v0, v, run, part)

        def grads(logits, v0, v, grp):
            t, _, _, lse, _, tail, g, rows = grp
            k.rows_backward(logits, t, w, ws, lse, tail, g, o, logits, bs, v0, v, rows)

        return loss, grads

    def fused(self, x, weight, bias, stats, rows_loss, rows_z, n: int, tops=None, cols: int = 0):
        """The loss over every row and class with no logits in memory (lce_fused: triton/lm_head.py): the
        rows' ce, z-loss and logsumexp, as the slices' loss steps leave them; ``tops`` as their part."""
        from .triton.backend import kernels

        lse = stats[:n]
        kernels("lm_head").loss_forward(x, weight, bias, self.t, self.w, self.o, rows_loss, rows_z, lse, tops, cols)

    def fused_grads(self, xg, w_s, b_s, dl, v0: int, v: int, grp):
        """lce_fused's gradient step on a tile: its dlogits into dl from the logits made again in the GEMM (as
        fused() made them), none in memory before."""
        from .triton.backend import kernels

        t, _, _, lse, _, tail, g, rows = grp
        kernels("lm_head").slice_dlogits(xg, w_s, b_s, t, self.w, self.wsum, self.o, lse, tail, g, dl, v0, v, rows)

    def group(self, r0, r1, stats, rows_loss, rows_z, run, g, n: int):
        """Rows r0 to r1's views the slice steps take, made once a group (the last, the rows a gradient step
        reads them through: None, every row in order)."""
        fwd = run is not None  # (the slices' loss steps run: not fused)
        t, lse, tail = self.t[r0:r1], stats[r0:r1], stats[n:]
        loss, z, run = (rows_loss[r0:r1], rows_z[r0:r1], run[: 3 * (r1 - r0)]) if fwd else (None, None, None)
        return t, loss, z, lse, run, tail, (g[r0:r1] if g is not None and g.dim() else g), None

    def pick(self, grp, rows):
        """A group's views (group()) for its ``rows`` alone (an int64 index tensor), as the gradient steps take
        them: the kernels read the targets, logsumexps and upstream gradients through ``rows`` (a skip's live
        rows on a slice), no copy."""
        t, _, _, lse, _, tail, g, _ = grp
        return t, None, None, lse, None, tail, g, rows

    def finish(self, rows_loss, rows_z, stats, out, zout, n: int, v: int):
        self.k.finish(rows_loss, rows_z, self.t, self.w, out, zout, stats[n:], v, self.o)


class TorchSteps:
    """The same steps in torch ops (the CPU, float64, backend='torch')."""

    name = "torch"

    def __init__(self, x, t, w, o, v: int):
        self.t, self.w, self.o = t, w, o

    def start(self, stats, rows_loss, rows_z, n: int, v: int):
        kept, w_kept = kept_rows(self.t, self.o.ignore_index, self.w, v, stats.dtype)
        stats[n], stats[n + 1], stats[n + 2] = kept, 1.0, w_kept

    def forward(self, logits, r0, r1, stats, rows_loss, rows_z):
        ce, zr, lse = loss_rows_torch(logits, self.t[r0:r1], self.o, self.w)
        rows_loss[r0:r1], rows_z[r0:r1], stats[r0:r1] = ce, zr, lse  # (rows_z: its own buffer)

    def backward(self, logits, r0, r1, stats, g, n: int):
        g = g[r0:r1] if g.dim() else g
        g_ce, g_z = row_grads(g, stats[n], stats[n + 2], self.o.reduction, r1 - r0)
        lse = stats[r0:r1]
        logits.copy_(dlogits_options(logits, self.t[r0:r1], lse, g_ce.to(lse.dtype), g_z.to(lse.dtype), self.o, self.w))

    def finish(self, rows_loss, rows_z, stats, out, zout, n: int, v: int):
        loss, z = reduce_terms(rows_loss, rows_z, stats[n], stats[n + 2], self.o.reduction, out.dtype)
        out.copy_(loss)
        zout.copy_(z)
