"""Auto's backward (Triton) on strided rows, the layouts where a forced online tile of 64 rows x 16 columns
at 1 warp gave wrong gradients on the H200 (dev/debug_online_bwd.py): softmax along dim 0, and a permuted
x with a contiguous dy (dy copied to y's strides), rows from 65 to 50000 elements, against the oracle.
Usage: python dev/strided_bwd_check.py"""

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.reference import compare_grad

bad = 0
for dtype in (torch.float32, torch.bfloat16):
    for n in (65, 128, 1000, 4096, 50000):
        for layout in ("dim0", "permuted"):
            for log in (False, True):
                torch.manual_seed(n)
                if layout == "dim0":
                    x, dim = torch.randn(n, 96, device="cuda", dtype=dtype), 0
                else:
                    x, dim = torch.randn(n, 5, 24, device="cuda", dtype=dtype).permute(2, 1, 0), -1
                dy = torch.randn(x.shape, device="cuda", dtype=dtype)
                f, bwd = (fs.log_softmax, fs.log_softmax_backward) if log else (fs.softmax, fs.softmax_backward)
                with heuristics.force(poison=True):
                    y = f(x, dim, backend="triton")
                    dx = bwd(dy, y, dim, backend="triton")
                    plan = heuristics.last_plan()
                ratio, problem = compare_grad(dx, dy, y, dim, log)
                bad += problem is not None
                print(
                    f"{'BAD' if problem else 'ok '} {dtype} n={n} {layout} log={log}: {ratio:.3g} {problem or ''} "
                    f"{plan.path} rows={plan.rows} warps={plan.num_warps} block={plan.block_n} copied={plan.copied}"
                )
print("strided_bwd_check bad =", bad)
