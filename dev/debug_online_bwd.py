"""The forced Triton online backward (block_n 16) on rows of 2-3 elements along dim 0 (strided rows, several
per program), direct call and through autograd, against the float64 oracle; prints errors and plans.
Usage: python dev/debug_online_bwd.py"""

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.reference import compare_grad

for shape, dim, log in [((2, 129, 2), 0, False), ((3, 5, 3, 8), 0, False), ((129, 5, 2), -1, True),
                        ((4096, 64), 0, False), ((2, 129), 0, False), ((129, 2), -1, False)]:  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(shape, device="cuda")
    if shape == (129, 5, 2):
        x = torch.randn(shape[::-1], device="cuda").permute(2, 1, 0)
    dy = torch.randn(shape, device="cuda")
    f, bwd = (fs.log_softmax, fs.log_softmax_backward) if log else (fs.softmax, fs.softmax_backward)
    for force in ({"path": "online", "block_n": 16}, {"path": "online"}, {"path": "rowblock"}, {"path": "split"}):
        with heuristics.force(poison=True, **force):
            y = f(x, dim, backend="triton")
            fplan = heuristics.last_plan()
            dx = bwd(dy, y, dim, backend="triton")
            bplan = heuristics.last_plan()
            xa = x.detach().requires_grad_()
            (dxa,) = torch.autograd.grad(f(xa, dim, backend="triton"), xa, dy)
        torch.cuda.synchronize()
        e1 = compare_grad(dx, dy, y, dim, log)
        e2 = compare_grad(dxa, dy, y, dim, log)
        print(f"{shape} dim {dim} log {log} {force}: direct {e1[0]:.3g} {e1[1]} | autograd {e2[0]:.3g} {e2[1]}")
        print(f"   fwd {fplan}\n   bwd {bplan}")
        if e1[1]:
            ref = dy - y.exp() * dy.sum(dim, keepdim=True) if log else y * (dy - (y * dy).sum(dim, keepdim=True))
            bad = ((dx - ref).abs() > 1e-3).nonzero()
            print("   bad at", bad[:8].tolist(), "of", bad.shape[0], "dx", dx.flatten()[:6].tolist(),
                  "ref", ref.flatten()[:6].tolist())  # fmt: skip
