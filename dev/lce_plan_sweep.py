"""lce_sliced's tile plan against time at CCE's memory (issue 40): per shape, the three-GEMM floor, then
fs.linear_cross_entropy forward + backward to dx and dW with heuristics.lm_head.slice_plan replaced by each
candidate (rows a group, classes a slice), both as lce_sliced (cuBLAS GEMMs and loss kernels a tile) and as
lce_fused, beside the rule's own choice (row chunks or slices) at the same budget. Each record: the median
time of eager calls (CUDA events), the peak above the inputs (dx and dW included) and the tile count. The
question: how much of the sliced time over four GEMMs is the per-tile read and write of the dx sums (fp32,
rows x d, once a slice) and of dW's slice (once a group), which wider slices or taller groups trade.
--fused-rows: lce_fused by rows a group (slices of 2048, 4096 and 8192 classes) beside two lce_sliced plans,
where the tiles are host-bound (default shape 8192x2048x32000): per plan ROUNDS medians (a single slow run
shows as one), the host's time to issue the call while the GPU is busy and the call replayed from a CUDA
graph (lce_kernel_profile's host_ms and graph_ms): heuristics/lm_head.HOST_FUSED_TILE_S.
Usage (GPU): python dev/lce_plan_sweep.py OUT.json [--fused-rows] [NxdxV ...]   (budget: bench --lce's from
CCE's peak, approximated as lce_kernel_profile does: 4.5% above x and W's bytes)"""

import json
import sys

import torch
from lce_kernel_profile import cce_budget, events_ms, graph_ms, host_ms  # (dev/, beside this script)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import lce
from fastsoftmax.heuristics import lm_head as rules

SHAPES = ("8192x4096x128256", "16384x2304x256000", "8192x2048x32000")
ROUNDS = 3  # --fused-rows: medians a plan


def peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def candidates(n: int, d: int, v: int, budget: int) -> list[tuple[int, int]]:
    out = []
    for cols in (2048, 4096, 8192, 16384):
        rows = budget // (cols * 2 + 4 * d)
        for align in (16, 128):
            if rows < align:
                continue
            r = rows - rows % align
            per = -(-n // -(-n // r))  # the groups evened out
            even = -(-per // align) * align
            out.append((min(r, even), cols))
    return sorted(set(out))


def fused_candidates(n: int, d: int, v: int, budget: int) -> list[tuple[str, tuple[int, int]]]:
    """--fused-rows' plans: lce_fused at rows a group from 128 up in steps of 64 and the most the budget holds,
    then lce_sliced at the most, for slices of 4096 and 16384 classes."""
    out = []
    for cols in (2048, 4096, 8192):
        most = budget // (2 * cols + 4 * d)
        out += [("lce_fused", (r, cols)) for r in sorted({most - most % 16, *range(128, most + 1, 64)}) if r >= 16]
    for cols in (4096, 16384):
        most = budget // (2 * cols + 4 * d)
        out.append(("lce_sliced", (most - most % 16, cols)))
    return out


def floor_ms(xd, wd) -> float:
    """The three GEMMs any of them does (bench --lce's floor), on a preallocated logits-shaped gradient."""
    g_logits = torch.randn(xd.shape[0], wd.shape[0], device="cuda", dtype=torch.bfloat16)

    def floor():
        lg = xd @ wd.t()
        return g_logits @ wd, lg.t() @ xd

    return events_ms(floor)


def planned(x, w, t, budget: int, path: str | None, plan: tuple[int, int] | None):
    """fs.linear_cross_entropy forward + backward to dx and dW at ``budget`` with ``path`` forced (None: the
    rule's) and heuristics.lm_head.slice_plan replaced by ``plan`` (rows, cols; None: the rule's): a function."""
    real = rules.slice_plan

    def fn():
        rules.slice_plan = (lambda *a, **k: plan) if plan else real
        try:
            with heuristics.force(**({"path": path} if path else {})):
                loss = fs.linear_cross_entropy(x, w, t, memory=budget)
                return torch.autograd.grad(loss, (x, w))
        finally:
            rules.slice_plan = real

    return fn


def run_shape(n: int, d: int, v: int, fused_rows: bool = False) -> list[dict]:
    x, w, t = lce.inputs((n, d, v), torch.bfloat16, "cuda")
    base = (v * d + n * d) * 2  # (the inputs' bytes: peaks are taken above them)
    budget = cce_budget(n, d, v)
    records = [{"N": n, "d": d, "V": v, "variant": "floor", "ms": round(floor_ms(x.detach(), w.detach()), 3)}]
    torch.cuda.empty_cache()

    if fused_rows:
        runs = [(None, None), *fused_candidates(n, d, v, budget)]
    else:
        runs = [(None, None)] + [("lce_sliced", p) for p in candidates(n, d, v, budget)]
        runs += [("lce_fused", p) for p in candidates(n, d, v, budget) if p[1] == 4096]
    for path, plan in runs:
        rec = {"N": n, "d": d, "V": v, "variant": path or "rule", "plan": plan, "memory": budget}
        if plan:
            rec["rows"], rec["cols"] = plan
        try:
            fn = planned(x, w, t, budget, path, plan)
            if fused_rows:
                rec["ms"] = [round(events_ms(fn), 3) for _ in range(ROUNDS)]
                rec["host_ms"] = round(host_ms(fn), 3)
                g = graph_ms(fn)
                rec["graph_ms"] = round(g, 3) if g is not None else None
            else:
                rec["ms"] = round(events_ms(fn), 3)
                rec["peak_over_base"] = peak(fn) - base
            rec["chosen"] = str(heuristics.last_plan())
            rec["vs_floor"] = round(min(rec["ms"] if fused_rows else [rec["ms"]]) / records[0]["ms"], 3)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
        torch.cuda.empty_cache()
    return records


def main():
    args = sys.argv[2:]
    fused_rows = "--fused-rows" in args
    shapes = [a for a in args if a != "--fused-rows"] or (["8192x2048x32000"] if fused_rows else SHAPES)
    out = sys.argv[1]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": []}
    for s in shapes:
        n, d, v = (int(p) for p in s.split("x"))
        doc["records"] += run_shape(n, d, v, fused_rows)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
