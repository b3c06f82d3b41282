"""One forced kernel, launched 5 times, for Nsight Compute. Usage:
ncu -k regex:'fs_|softmax' --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats python dev/ncu_one.py BACKEND PATH DTYPE M N [fwd|bwd]"""

import sys

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics

backend, path, dt, m, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
pass_ = sys.argv[6] if len(sys.argv) > 6 else "fwd"
x = torch.randn(m, n, device="cuda", dtype=getattr(torch, dt))
y, dy = torch.softmax(x, -1), torch.randn_like(x)
with heuristics.force(path=path):
    for _ in range(5):
        fs.softmax(x, backend=backend) if pass_ == "fwd" else fs.softmax_backward(dy, y, backend=backend)
torch.cuda.synchronize()
print(heuristics.last_plan())
