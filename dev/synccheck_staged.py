"""The staged forward alone under compute-sanitizer synccheck, one line per completed launch (a report falls
between the lines of its launch): bf16/fp32, 1 to STAGE_CLUSTER_MAX CTAs per row. `cluster`: the control,
the register-held cluster variant forced at 16 CTAs per row (9 rows of 131072 and 262144).
Usage: compute-sanitizer --tool synccheck python dev/synccheck_staged.py [CLUSTER_MAX | cluster]"""

import sys

import torch

from fastsoftmax import heuristics
from fastsoftmax.api import forward
from fastsoftmax.cuda import kernels

variant, problems = "staged", ((513, 9), (12289, 9), (50257, 9), (131072, 64), (131072, 9))
if sys.argv[1:] == ["cluster"]:
    variant, problems = "cluster", ((131072, 9), (262144, 9))
elif len(sys.argv) > 1:
    kernels.STAGE_CLUSTER_MAX = int(sys.argv[1])
for n, rows in problems:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, n + 3, device="cuda", dtype=dtype)[:, 3:]
        with heuristics.force(path=variant):
            forward(x, -1, log=False, backend="cuda", want_lse=False)
            plan = heuristics.last_plan()
        torch.cuda.synchronize()
        print(f"launched {variant} {rows}x{n} {dtype} cluster {plan.splits}", flush=True)
