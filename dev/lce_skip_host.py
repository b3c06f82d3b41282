"""Where the host's time goes in fs.linear_cross_entropy with skip_eps (issue 40: the skip is bound by the
host, investigations/h100_lce_skip_host.json): one call at CCE's peak under torch.profiler with CPU and CUDA
activities, after warm-up. Records the call's wall time, the GPU's busy time, the waits (synchronize,
tolist, item), and the torch ops by self CPU time with their counts: what a gathered tile's launches cost.
Usage (GPU): python dev/lce_skip_host.py OUT.json [NxdxV] [--spread S]"""

import json
import sys
import time

import torch
from lce_kernel_profile import cce_budget, profiled  # (dev/)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import lce


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    spread = float(rest[rest.index("--spread") + 1]) if "--spread" in rest else lce.SPREAD
    shapes = [a for a in rest if "x" in a and not a.startswith("--")]
    n, d, v = (int(s) for s in (shapes[0] if shapes else "8192x4096x128256").split("x"))
    x, w, t = lce.inputs((n, d, v), torch.bfloat16, "cuda", spread)
    budget = cce_budget(n, d, v)

    def step():
        loss = fs.linear_cross_entropy(x, w, t, memory=budget, skip_eps=lce.SKIP_EPS)
        return torch.autograd.grad(loss, (x, w))

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    doc = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": f"{n}x{d}x{v}",
        "spread": spread,
        "memory": budget,
        "plan": str(heuristics.last_plan()),
        "wall_ms": round(wall_ms, 3),
        "gpu": {k: v for k, v in profiled(step).items() if k in ("busy_ms", "kernel_ms", "kernels")},
        "ops": [
            dict(
                name=e.key,
                calls=e.count,
                self_cpu_ms=round(e.self_cpu_time_total / 1e3, 3),
                cpu_ms=round(e.cpu_time_total / 1e3, 3),
            )
            for e in ops
        ],  # fmt: skip
    }
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("shape", "plan", "wall_ms", "gpu")}))
    for o in doc["ops"]:
        print(f"{o['self_cpu_ms']:9.3f} ms self {o['cpu_ms']:9.3f} total {o['calls']:6d} x  {o['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
