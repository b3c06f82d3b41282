"""Where the LM-head loss's host time goes on a small problem at a small budget, the shape the time model
calls host-bound (heuristics/lm_head.HOST_CHUNK_S, HOST_TILE_S): fs.linear_cross_entropy forward and
backward to dx and dW under cProfile, row chunks and lce_sliced forced in turn, after warm-up. Writes the
GPU time of a call without the profiler (CUDA events), the wall time with it, and per design the
functions with the most own time (tottime) and their call counts, per chunk or tile.
Usage: python dev/lce_host_profile.py OUT.json [N d V MEMORY] (default 8192 2048 32000 7777379, bf16 on
a GPU; --cpu: fp32 64 x 16 x 513 on the CPU under TRITON_INTERPRET=1, a smoke run of the script itself)."""

import cProfile
import json
import pstats
import sys
import time

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics


def step(x, w, t, memory):
    loss = fs.linear_cross_entropy(x, w, t, memory=memory, backend="triton")
    return torch.autograd.grad(loss, (x, w))


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    rest = [a for a in argv[1:] if a != "--cpu"]
    n, d, v, memory = (int(a) for a in rest) if rest else ((64, 16, 513, 2304) if cpu else (8192, 2048, 32000, 7777379))
    dev, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, d, device=dev, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device=dev, generator=g) * d**-0.5).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    out = {"shape": [n, d, v], "memory": memory, "device": dev, "designs": {}}
    for path in ("lce_chunked", "lce_sliced"):
        with heuristics.force(path=path):
            for _ in range(2 if cpu else 5):
                step(x, w, t, memory)
            plan = heuristics.last_plan()
            tiles = plan.splits  # (row chunks; lce_sliced: groups x slices)
            gpu_ms = None
            if not cpu:
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(5):
                    step(x, w, t, memory)
                b.record()
                torch.cuda.synchronize()
                gpu_ms = a.elapsed_time(b) / 5
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            step(x, w, t, memory)
            prof.disable()
            if not cpu:
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:40]  # (own time)
        top = [
            dict(function=f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}:{fn[2]}", calls=s[1], tottime_ms=round(s[2] * 1e3, 3),
                 cumtime_ms=round(s[3] * 1e3, 3))
            for fn, s in rows
        ]  # fmt: skip
        out["designs"][path] = {
            "plan": str(plan), "tiles": tiles, "gpu_ms_unprofiled": gpu_ms, "wall_ms_profiled": round(wall, 2),
            "profiled_ms_per_tile": round(wall / max(tiles, 1), 3), "top_own_time": top,
        }  # fmt: skip
        print(path, plan, f"tiles {tiles}", f"gpu {gpu_ms} ms", f"profiled wall {wall:.1f} ms", flush=True)
        for r in top[:15]:
            print(f"   {r['tottime_ms']:9.3f} ms  {r['calls']:6d}  {r['function']}")
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
