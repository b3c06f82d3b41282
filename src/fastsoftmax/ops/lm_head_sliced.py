"""fs.linear_cross_entropy's lce_sliced layout (ops/lm_head.py runs it where heuristics/lm_head.layout picks it):
groups of rows, each swept over slices of the classes, and skip_eps's choice of the (row, slice) pairs whose
gradient is computed."""

from __future__ import annotations

import math

import torch

from .. import heuristics
from ..core import dtypes
from ..heuristics import lm_head as rules
from ..kernels.torch_loss import chunk_logits, tile_grads


def sliced_sweep(x, weight, bias, k, stats, rows_loss, rows_z, g, forward, grads, wants, dx, dw, db, memory, skip,
                 fused):  # fmt: skip
    """lce_sliced: groups of rows, each swept over slices of the classes (rules.slice_plan), once for the
    loss (forward) and once for the gradients (where wanted). A slice's dW rows are written by the first
    group's GEMM and added to by the others' (one rounding a group, not a chunk); a group's dx is summed over
    the slices in fp32, then rounded once. With ``skip`` (> 0; a scalar loss's forward), a slice's gradient
    GEMMs run on the group's live rows there alone (_live_rows: a probability there reaches skip, or the
    target is there), gathered where they are at most rules.GATHER_SHARE of the group, the group's tile where
    more, none where none. ``fused``: lce_fused's kernels make the logits (the forward's choice,
    rules.layout's, which the backward's sweep follows: ops/lm_head._layout). Returns dW (None: not wanted)."""
    n, d = x.shape
    v = weight.shape[0]
    rows, cols = rules.slice_plan(n, d, v, x.element_size(), memory, skip > 0)
    loss_step, grads_step = k.slices(cols, x.element_size())
    buf = torch.empty(rows * cols, dtype=x.dtype, device=x.device) if grads or not fused else None
    wide = dtypes.wide(x.dtype)  # (dx's sums; the running numbers in fp64, as the stats: the lse exact)
    run = torch.empty(3 * rows, dtype=torch.float64, device=x.device) if forward and not fused else None
    acc = torch.empty((rows, d), dtype=wide, device=x.device) if grads and wants[0] else None
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=x.device) if grads and wants[1] else None  # (n > 0)
    if heuristics.poisoning():  # (tests: every element must be written before it is read)
        for buffer in (acc, dw):
            if buffer is not None:
                buffer.fill_(float("nan"))
    if skip and dw is not None:
        dw.zero_()  # (a slice skipped by every group: no GEMM writes it)
    gather = int(rows * rules.GATHER_SHARE) * d if skip and grads else 0  # (a skip's gathered rows, reused)
    xs_buf = torch.empty(gather, dtype=x.dtype, device=x.device) if gather else None
    part_buf = torch.empty(gather, dtype=wide, device=x.device) if gather and acc is not None else None

    def cut(v0: int, v1: int) -> tuple:
        """Classes v0 to v1's rows of the weight, bias, dW and db (None where there is none)."""
        return tuple(a[v0:v1] if a is not None else None for a in (weight, bias, dw, db))

    parts = [(v0, *cut(v0, v0 + cols)) for v0 in range(0, v, cols)]  # (made once: the host's cost a tile matters)
    tops = torch.empty((len(parts), n if fused else rows), dtype=torch.float32, device=x.device) if skip else None
    if fused and forward:  # the loss of every row and class at once (the tops of every row)
        k.fused(x, weight, bias, stats, rows_loss, rows_z, n, tops, cols)
    summed = bool(skip)

    span = rules.SKIP_SPAN if skip else 1
    spans = [(i, min(i + span, len(parts))) for i in range(0, len(parts), span)]  # (a skip's wide tiles)
    wide_grads = k.slices(min(span * cols, v), x.element_size())[1] if span > 1 and not fused else None
    widths = [part[1].shape[0] for part in parts]
    wides = 0

    def tile(xg, grp, picked, v0, w_s, b_s, dw_s, db_s, step, acc_g, add_dw, add_dx):
        """One gradient tile of a group (rows xg, views grp): the logits of its rows on w_s's classes made
        again, dlogits, dW's rows and dx's; ``picked`` (an index into the group's rows): those rows alone,
        gathered, their dx summed into acc_g from their own fp32 parts."""
        xt, gt = xg, grp
        if picked is not None:
            xt = torch.index_select(xg, 0, picked, out=xs_buf[: picked.numel() * d].view(-1, d))
            gt = k.pick(grp, picked)
        logits = buf[: xt.shape[0] * w_s.shape[0]].view(xt.shape[0], w_s.shape[0])
        if fused:  # (the dlogits straight from the GEMM)
            k.fused_grads(xt, w_s, b_s, logits, v0, v, gt)
        else:
            chunk_logits(xt, w_s, b_s, logits)
            step(logits, v0, v, gt)  # logits -> dlogits, in place
        if picked is None:
            tile_grads(logits, xt, w_s, dw_s, acc_g, db_s, add_dw=add_dw, add_dx=add_dx)
            return
        part = part_buf[: xt.numel()].view(xt.shape) if part_buf is not None else None
        tile_grads(logits, xt, w_s, dw_s, part, db_s, add_dw=True, add_dx=False)
        if part is not None:
            acc_g.index_add_(0, picked, part)

    def grads_sweep(r0, r1, grp, live) -> int:
        """The group's gradient tiles (``live``: a skip's flags, _live_rows); returns the pairs left out."""
        nonlocal wides
        xg, m, skipped = x[r0:r1], r1 - r0, 0
        acc_g = acc[:m] if acc is not None else None
        if skip and acc_g is not None:
            acc_g.zero_()
        counts, idx, unions, uidx = _resolve(*live) if live is not None else (None, None, None, None)
        at = uat = 0  # (idx, uidx: the live rows slice by slice, span by span)
        for j, (i0, i1) in enumerate(spans):
            if counts is not None and i1 - i0 > 1:  # (a skip's span of slices: one tile on their union?)
                u, uat = unions[j], uat + unions[j]
                sub = counts[i0:i1]
                if rules.widen(m, sub, u, widths[i0:i1], d, x.element_size(), buf.numel()):
                    v0 = parts[i0][0]
                    tile(
                        xg,
                        grp,
                        uidx[uat - u : uat],
                        v0,
                        *cut(v0, v0 + sum(widths[i0:i1])),
                        wide_grads,
                        acc_g,
                        True,
                        False,
                    )
                    skipped, at, wides = skipped + (m - u) * (i1 - i0), at + sum(sub), wides + 1
                    continue
            for i in range(i0, i1):
                picked = None
                if counts is not None:
                    c, at = counts[i], at + counts[i]
                    if not c:
                        skipped += m
                        continue
                    if c <= m * rules.GATHER_SHARE:  # (else the whole group's tile, every pair computed)
                        picked, skipped = idx[at - c : at], skipped + m - c
                # (a skip's sums start from 0: any slice or group may be skipped)
                v0 = parts[i][0]
                tile(xg, grp, picked, *parts[i], grads_step, acc_g, r0 > 0 or summed, v0 > 0 or summed)
        if acc_g is not None:
            dx[r0:r1].copy_(acc_g)
        return skipped

    tiles = skipped = 0
    pending = None  # (a group's gradients run after the next group's loss is queued: a skip's wait for its
    for r0 in [*range(0, n, rows), None]:  # flags on the host then overlaps that loss on the GPU)
        if r0 is not None:
            r1 = min(r0 + rows, n)
            grp = k.group(r0, r1, stats, rows_loss, rows_z, run, g, n)
            if forward and not fused:
                xg, m = x[r0:r1], r1 - r0
                for i, (v0, w_s, b_s, _, _) in enumerate(parts):
                    logits = buf[: m * w_s.shape[0]].view(m, w_s.shape[0])
                    chunk_logits(xg, w_s, b_s, logits)
                    loss_step(logits, v0, v, grp, tops[i, :m] if skip else None)
            top = (tops[:, r0:r1] if fused else tops[:, : r1 - r0]) if skip and grads else None
            live = _live_rows(top, stats[r0:r1], k.t[r0:r1], k.o, skip, cols, v, span) if top is not None else None
            tiles += len(parts) if grads or not fused else 0
        if pending is not None:
            skipped += grads_sweep(*pending)
        pending = (r0, r1, grp, live) if grads and r0 is not None else None
    plan = dict(block_n=cols, rows=rows, splits=tiles, skipped=skipped, fused=fused, spans=wides)
    heuristics.record(heuristics.Plan(k.name, rules.FUSED if fused else rules.SLICED, **plan))
    return dw


def _live_rows(tops, lse, t, o, skip: float, cols: int, v: int, span: int):
    """Which of a row group's (row, slice) pairs get their gradient computed: a kept row's pairs where its
    largest probability on the slice, exp(its largest z there - its logsumexp), is at least ``skip`` (a NaN
    keeps it), and the pair holding its target (the target's -1 term is never small). Returns the (slices,
    rows) flags, their union over each ``span`` slices (spans, rows), and the counts of both on their way to
    the host (_resolve reads them): nothing waits here."""
    m = t.shape[0]
    tt = t.long()  # (widened: a uint8 target 156 is not ignore_index -100)
    keep = tt != o.ignore_index
    home = torch.where(keep, tt, 0).clamp(0, v - 1) // cols  # (a target out of range is refused at the end)
    live = tops < lse.to(tops.dtype)[None, :] + math.log(skip)  # (the negligible pairs: z - lse < log skip)
    live.logical_not_()  # (NaN compares False: live)
    live[home, torch.arange(m, device=t.device)] = True
    live &= keep[None, :]
    whole = live.shape[0] // span * span  # (the spans of ``span`` slices, then a shorter last one)
    union = torch.cat(
        [live[:whole].view(-1, span, m).any(1), live[whole:].any(0, keepdim=True)[: live.shape[0] - whole]]
    )
    counts = torch.cat([live.sum(1), union.sum(1)])
    if not counts.is_cuda:
        return live, union, counts, None
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return live, union, host, done


def _resolve(live, union, counts, done):
    """_live_rows' counts a slice and a span (lists) and their live rows slice by slice and span by span (on
    the device, an int64 a pair): the skip's one host synchronisation a group, on its flags alone (the next
    group's loss queued behind them runs meanwhile; the skip is eager only)."""
    if done is not None:
        done.synchronize()
    counts = counts.tolist()
    counts, unions = counts[: live.shape[0]], counts[live.shape[0] :]
    rows, urows = (
        torch.nonzero_static(f.reshape(-1), size=sum(c)).view(-1).remainder_(live.shape[1])  # (no wait: size known)
        for f, c in ((live, counts), (union, unions))
    )
    return counts, rows, unions, urows
