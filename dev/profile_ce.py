"""Where a cross-entropy forward + backward's time goes on the GPU (fs.cross_entropy vs the kernels alone):
torch.profiler's CUDA kernel times and the wall time per step, for the shapes where `fastsoftmax bench --ce`
showed fwd+bwd far below the kernels' own speed. Usage (device): python3 dev/profile_ce.py"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import fastsoftmax as fs

for dt, (m, v) in ((torch.bfloat16, (8192, 32000)), (torch.bfloat16, (4096, 50257)), (torch.bfloat16, (4096, 128256))):
    g = torch.Generator(device="cuda").manual_seed(v)
    x = (torch.randn(m, v, device="cuda", dtype=dt, generator=g) * 2).requires_grad_()
    t = torch.randint(0, v, (m,), device="cuda", generator=g)
    t[::7] = -100

    def step(x=x, t=t):
        return torch.autograd.grad(fs.cross_entropy(x, t), x)

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 20 * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"== {dt} {m}x{v}: {wall:.3f} ms per fwd+bwd step (wall, 20 steps back to back)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
