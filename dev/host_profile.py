"""Where a 1x4096 eager call's host time goes on the GPU: cProfile over 3000 calls, the top functions by own
time. Usage: python dev/host_profile.py [auto|triton|cuda|bwd]"""

import cProfile
import pstats
import sys

import torch

import fastsoftmax as fs

what = sys.argv[1] if len(sys.argv) > 1 else "auto"
x = torch.randn(1, 4096, device="cuda")
y, dy = torch.softmax(x, -1), torch.randn_like(x)
fn = (lambda: fs.softmax_backward(dy, y)) if what == "bwd" else (lambda: fs.softmax(x, backend=what))
for _ in range(200):
    fn()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(3000):
    fn()
prof.disable()
torch.cuda.synchronize()
print(f"== {what}")
pstats.Stats(prof).sort_stats("tottime").print_stats(22)
