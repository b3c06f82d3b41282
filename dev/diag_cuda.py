"""Every CUDA variant (and the cluster/block caps of bench_cuda.py long) on a few rows of some shapes,
forward and backward, softmax and log_softmax, against the float64 oracle: prints each problem found.
Usage: python dev/diag_cuda.py"""

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.reference import compare, compare_grad

CAPS = [{}, {"k_max": 4}, {"group_max": 256}, {"k_max": 4, "group_max": 256}]
bad = 0
for dtype in (torch.bfloat16, torch.float32):
    for n in (1024, 1000, 4096, 32768, 50257, 65536):
        x = torch.randn(6, n, device="cuda", dtype=dtype) * 3
        y, dy = torch.softmax(x, -1), torch.randn_like(x)
        for v in ("warp", "block", "cluster", "online"):
            for caps in CAPS:
                for log in (False, True):
                    try:
                        with heuristics.force(path=v, **caps):
                            f = fs.log_softmax if log else fs.softmax
                            out = f(x, backend="cuda")
                            plan = heuristics.last_plan()
                            ratio, problem = compare(out, x, -1, log)
                            yy = torch.log_softmax(x, -1) if log else y
                            bwd = fs.log_softmax_backward if log else fs.softmax_backward
                            gr = compare_grad(bwd(dy, yy, backend="cuda"), dy, yy, -1, log)
                    except ValueError:
                        continue
                    if problem or gr[1]:
                        bad += 1
                        print(f"BAD {dtype} n={n} {v} {caps} log={log} {plan}: fwd {ratio:.3g} {problem} | bwd {gr}")
                        if problem:
                            err = (out.double() - (torch.log_softmax if log else torch.softmax)(x.double(), -1)).abs()
                            print("  max err", err.amax(-1).tolist(), (err > 1e-2).nonzero()[:4].tolist())
print("diag done, bad =", bad)
