"""lce_fused against lce_sliced and the rule at CCE's memory on a small problem, by rows a group (issue 40):
where a tile's host time exceeds its GPU work, the fused forward (one launch, no logits) and the fused
dlogits GEMM (no loss kernel a tile) should win. Per plan (rows a group, classes a slice), ROUNDS medians of
7 eager calls (CUDA events), so that a single slow run shows as one; the host's time to issue the call while
the GPU is busy (host_ms, lce_kernel_profile's); the call replayed from a CUDA graph (the GPU's time alone).
Usage (GPU): python dev/lce_fused_rows.py OUT.json [NxdxV ...]   (default 8192x2048x32000)"""

import json
import sys

import torch
from lce_kernel_profile import cce_budget, events_ms, graph_ms, host_ms  # (dev/, beside this script)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import lm_head as rules

ROUNDS = 3


def plans(n: int, d: int, v: int, budget: int) -> list[tuple[str, int, int]]:
    out = []
    for cols in (2048, 4096, 8192):
        most = budget // (2 * cols + 4 * d)
        for rows in sorted({most - most % 16, *range(128, most + 1, 64)}):
            if rows >= 16:
                out.append(("lce_fused", rows, cols))
    for cols in (4096, 16384):
        most = budget // (2 * cols + 4 * d)
        out.append(("lce_sliced", most - most % 16, cols))
    return out


def run_shape(n: int, d: int, v: int) -> list[dict]:
    from fastsoftmax.bench import lce

    x, w, t = lce.inputs((n, d, v), torch.bfloat16, "cuda")
    budget = cce_budget(n, d, v)
    real = rules.slice_plan
    records = []

    def step(path, plan):
        def fn():
            rules.slice_plan = (lambda *a, **k: plan) if plan else real
            try:
                with heuristics.force(**({"path": path} if path else {})):
                    loss = fs.linear_cross_entropy(x, w, t, memory=budget)
                    return torch.autograd.grad(loss, (x, w))
            finally:
                rules.slice_plan = real

        return fn

    xd, wd = x.detach(), w.detach()
    g_logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)

    def floor():
        lg = xd @ wd.t()
        return g_logits @ wd, lg.t() @ xd

    floor_ms = events_ms(floor)
    records.append({"N": n, "d": d, "V": v, "variant": "floor", "ms": round(floor_ms, 3)})
    print(json.dumps(records[-1]), flush=True)
    g_logits = None  # (its memory back before the plans run)
    for path, rows, cols in [(None, 0, 0), *plans(n, d, v, budget)]:
        rec = {"N": n, "d": d, "V": v, "variant": path or "rule", "rows": rows, "cols": cols, "memory": budget}
        try:
            fn = step(path, (rows, cols) if path else None)
            rec["ms"] = [round(events_ms(fn), 3) for _ in range(ROUNDS)]
            rec["vs_floor"] = round(min(rec["ms"]) / floor_ms, 3)
            rec["host_ms"] = round(host_ms(fn), 3)
            g = graph_ms(fn)
            rec["graph_ms"] = round(g, 3) if g is not None else None
            rec["chosen"] = str(heuristics.last_plan())
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        records.append(rec)
        print(json.dumps(rec), flush=True)
        torch.cuda.empty_cache()
    return records


def main():
    out, shapes = sys.argv[1], sys.argv[2:] or ["8192x2048x32000"]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": ROUNDS, "records": []}
    for s in shapes:
        n, d, v = (int(p) for p in s.split("x"))
        doc["records"] += run_shape(n, d, v)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
