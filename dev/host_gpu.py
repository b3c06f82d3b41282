"""Host overhead per eager call on the GPU, 1x4096 fp32: torch.softmax against fastsoftmax per backend, with
the env-selected launcher (FASTSOFTMAX_FAST_LAUNCH=0/1). Usage: python dev/host_gpu.py"""

import os

import torch

import fastsoftmax as fs
from fastsoftmax.bench import host_us

x = torch.randn(1, 4096, device="cuda")
y = torch.softmax(x, -1)
dy = torch.randn_like(x)
fast = os.environ.get("FASTSOFTMAX_FAST_LAUNCH", "0")
rows = {
    "torch.softmax": lambda: torch.softmax(x, -1),
    "fs.softmax auto": lambda: fs.softmax(x),
    "fs.softmax triton": lambda: fs.softmax(x, backend="triton"),
    "fs.softmax cuda": lambda: fs.softmax(x, backend="cuda"),
    "torch softmax_backward": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype),
    "fs.softmax_backward": lambda: fs.softmax_backward(dy, y),
}
for name, fn in rows.items():
    t = sorted(host_us(fn, "cuda") for _ in range(3))[1]
    print(f"FAST_LAUNCH={fast} {name:24} {t:6.1f} us")
