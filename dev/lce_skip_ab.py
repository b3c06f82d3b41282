"""The skip's gradient tiles three ways, in one process, calls interleaved: separate processes differ by more
than the changes (investigations/h100_lce_skip_host.json). "gathers": a tile a slice, with the old
TritonSteps.pick (targets, logsumexps and upstream gradients gathered, no index for the kernels); "fine": a
tile a slice, today's pick; "span4", "span8": today's, a span of 4 or 8 slices' live rows as one tile where
heuristics/lm_head.widen says. Records each side's median ms over the interleaved calls, its plan, and its
dx and dW against "fine" (gathers: bitwise equal; spans: compute more pairs, so may differ by rounding).
--force PATH runs every variant under heuristics.force(path=PATH) (lce_sliced where the rule keeps row chunks).
Usage (GPU): python dev/lce_skip_ab.py OUT.json [NxdxV ...] [--spread S] [--reps R] [--force PATH]"""

import contextlib
import json
import statistics
import sys

import torch
from lce_kernel_profile import cce_budget  # (dev/)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import lce
from fastsoftmax.heuristics import lm_head as rules
from fastsoftmax.kernels.lm_head_steps import TritonSteps


def gathers(self, grp, rows):
    """The pick before the kernels read through the index: three gathers a tile (two for a scalar g)."""
    t, _, _, lse, _, tail, g, _ = grp
    g = g.index_select(0, rows) if g is not None and g.dim() else g
    return t.index_select(0, rows), None, None, lse.index_select(0, rows), None, tail, g, None


VARIANTS = {"fine": (1, TritonSteps.pick), "gathers": (1, gathers), "span4": (4, TritonSteps.pick),
            "span8": (8, TritonSteps.pick)}  # fmt: skip


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    spread = float(rest[rest.index("--spread") + 1]) if "--spread" in rest else lce.SPREAD
    reps = int(rest[rest.index("--reps") + 1]) if "--reps" in rest else 8
    force = {"path": rest[rest.index("--force") + 1]} if "--force" in rest else {}
    shapes = [a for a in rest if "x" in a and not a.startswith("--")] or ["8192x4096x128256"]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "spread": spread, "force": force}
    doc["records"] = []
    for spec in shapes:
        n, d, v = (int(s) for s in spec.split("x"))
        x, w, t = lce.inputs((n, d, v), torch.bfloat16, "cuda", spread)
        budget = cce_budget(n, d, v)

        def step(x=x, w=w, t=t, budget=budget):
            with heuristics.force(**force) if force else contextlib.nullcontext():
                loss = fs.linear_cross_entropy(x, w, t, memory=budget, skip_eps=lce.SKIP_EPS)
                return torch.autograd.grad(loss, (x, w))

        times: dict[str, list] = {k: [] for k in VARIANTS}
        grads, plans = {}, {}
        names = list(VARIANTS)
        for i in range(reps + 2):
            for name in names[i % len(names) :] + names[: i % len(names)]:  # (the order rotated a round)
                rules.SKIP_SPAN, TritonSteps.pick = VARIANTS[name]
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                out_grads = step()
                b.record()
                torch.cuda.synchronize()
                if i >= 2:  # (two rounds of warm-up: compiles)
                    times[name].append(a.elapsed_time(b))
                grads[name], plans[name] = out_grads, str(heuristics.last_plan())
        rules.SKIP_SPAN, TritonSteps.pick = VARIANTS["fine"]
        rec = {"shape": spec, "budget": budget, "plans": plans}
        rec |= {f"{k}_ms": round(statistics.median(s), 3) for k, s in times.items()}
        rec |= {f"{k}_all_ms": [round(s, 2) for s in ss] for k, ss in times.items()}
        fine = grads["fine"]
        rec["gathers_same_grads"] = all(torch.equal(p, q) for p, q in zip(fine, grads["gathers"], strict=True))
        for k in ("span4", "span8"):
            rec[f"{k}_max_diff"] = [
                float((p.float() - q.float()).abs().max()) for p, q in zip(grads[k], fine, strict=True)
            ]
        doc["records"].append(rec)
        print(json.dumps({k: rec[k] for k in rec if not k.endswith("_all_ms")}), flush=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
