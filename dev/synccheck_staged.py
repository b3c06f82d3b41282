"""The staged forward alone under compute-sanitizer synccheck, one launch per line (printed after each
launch completes, so a report falls between the lines of its launch): bf16/fp32, 1 to 16 CTAs per row.
Usage: compute-sanitizer --tool synccheck python dev/synccheck_staged.py [CLUSTER_MAX]"""

import sys

import torch

from fastsoftmax import heuristics
from fastsoftmax.api import forward
from fastsoftmax.cuda import kernels

if len(sys.argv) > 1:
    kernels.STAGE_CLUSTER_MAX = int(sys.argv[1])

for n, rows in ((513, 9), (12289, 9), (50257, 9), (131072, 64), (131072, 9)):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, n + 3, device="cuda", dtype=dtype)[:, 3:]
        with heuristics.force(path="staged"):
            forward(x, -1, log=False, backend="cuda", want_lse=False)
            plan = heuristics.last_plan()
        torch.cuda.synchronize()
        print(f"launched {rows}x{n} {dtype} cluster {plan.splits}", flush=True)
