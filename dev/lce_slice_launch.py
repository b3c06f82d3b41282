"""The loss kernels' launch shapes on lce_sliced's slices of 4096 classes (bench/results/sweeps/lce_slice_launch.json):
one bf16 forward + backward of fs.linear_cross_entropy at CCE's peak budget on two shapes, forced to lce_sliced,
per (rows, block_n, num_warps) forced on the loss kernels; the kernel time of ce_fwd and ce_bwd from
torch.profiler, GB/s counting the slices' logits read (forward) and read + written (backward).

    PYTHONPATH=src python dev/lce_slice_launch.py        # on the GPU; prints one line per configuration
"""

from __future__ import annotations

import collections
import sys

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics

SHAPES = [(8192, 4096, 128256, 51876431), (16384, 2304, 256000, 60722833)]  # (N, d, V, memory=)
CONFIGS = [{}] + [
    dict(rows=r, block_n=b, num_warps=w)
    for r, b, w in [(1, 4096, 8), (1, 4096, 16), (2, 4096, 8), (2, 2048, 8), (4, 1024, 4), (4, 2048, 8),
                    (4, 4096, 16), (8, 512, 4), (1, 2048, 4), (2, 4096, 16), (1, 1024, 4)]
]  # fmt: skip


def inputs(n: int, d: int, v: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16).requires_grad_()
    return x, w, torch.randint(0, v, (n,), device="cuda", generator=g)


def main() -> int:
    for n, d, v, memory in SHAPES:
        x, w, t = inputs(n, d, v)
        for cfg in CONFIGS:

            def step(cfg=cfg, x=x, w=w, t=t, memory=memory):
                with heuristics.force(path="lce_sliced", **cfg):
                    loss = fs.linear_cross_entropy(x, w, t, memory=memory)
                    return torch.autograd.grad(loss, (x, w))

            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            us = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.name in ("ce_fwd", "ce_bwd"):
                    us[e.name] += e.device_time_total
            gb = n * v * 2 / 1e9
            fwd, bwd = us["ce_fwd"] / 1e3, us["ce_bwd"] / 1e3
            print(
                f"{n}x{d}x{v} {cfg or 'rule'}: fwd {fwd:.2f} ms ({gb / fwd * 1e3:.0f} GB/s) "
                f"bwd {bwd:.2f} ms ({2 * gb / bwd * 1e3:.0f} GB/s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
