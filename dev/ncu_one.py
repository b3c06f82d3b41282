"""One forced kernel, launched 5 times, for Nsight Compute. Usage:
ncu -k regex:'fs_|softmax' --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats python dev/ncu_one.py BACKEND PATH DTYPE M N [fwd|bwd] [CLUSTER]
(CLUSTER: the staged variant's CTAs per row, forced past launch_shape's choice)"""

import dataclasses
import sys

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.cuda import kernels

backend, path, dt, m, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
pass_ = sys.argv[6] if len(sys.argv) > 6 else "fwd"
if len(sys.argv) > 7:
    cluster, shape_of = int(sys.argv[7]), kernels.launch_shape
    kernels.STAGE_CLUSTER_MAX = max(kernels.STAGE_CLUSTER_MAX, cluster)
    kernels.launch_shape = lambda *a, **k: dataclasses.replace(shape_of(*a, **k), cluster=cluster)
x = torch.randn(m, n, device="cuda", dtype=getattr(torch, dt))
y, dy = torch.softmax(x, -1), torch.randn_like(x)
with heuristics.force(path=path):
    for _ in range(5):
        fs.softmax(x, backend=backend) if pass_ == "fwd" else fs.softmax_backward(dy, y, backend=backend)
torch.cuda.synchronize()
print(heuristics.last_plan())
