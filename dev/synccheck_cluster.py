"""The register-held cluster variant forced at 16 CTAs per row (9 rows of 131072 and 262144, bf16 and fp32)
under compute-sanitizer synccheck, one line per completed launch: the control for the staged variant's
16-CTA synccheck reports (dev/synccheck_staged.py). Usage: compute-sanitizer --tool synccheck python
dev/synccheck_cluster.py"""

import torch

from fastsoftmax import heuristics
from fastsoftmax.api import forward

for n, rows in ((131072, 9), (262144, 9)):
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(rows, n + 3, device="cuda", dtype=dtype)[:, 3:]
        with heuristics.force(path="cluster"):
            forward(x, -1, log=False, backend="cuda", want_lse=False)
            plan = heuristics.last_plan()
        torch.cuda.synchronize()
        print(f"launched cluster variant {rows}x{n} {dtype} cluster {plan.splits}", flush=True)
