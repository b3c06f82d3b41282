"""Where a 1x4096 fp32 eager call's host time goes on the GPU, part by part (wall time per call, the GPU kept
ahead, median of 7 rounds, every variant measured in each round so drift hits all alike): torch.softmax;
fs.softmax through each kind of replay the fast path has (prepared: cuda/launch.py's ctypes cuLaunchKernel;
direct: Triton's C launch function with ints; run: CompiledKernel.run with tensors), on the auto (Triton)
and the CUDA backend; the replay's own pieces. Usage: python dev/host_parts.py"""

import statistics

import torch

import fastsoftmax as fs
from fastsoftmax import api, compose, fastpath
from fastsoftmax.bench import host_us
from fastsoftmax.cuda import launch

x = torch.randn(1, 4096, device="cuda")
y = torch.softmax(x, -1)
dy = torch.randn_like(x)


def entry_of(kind, backend="auto"):
    """The replay entry of fs.softmax(x, backend=backend) built as `kind` (the others turned off; "ctypes":
    prepared, without the native launcher)."""
    saved = fastpath._prepared, fastpath._direct, launch._native_mod[:]
    if kind == "ctypes":
        launch._native_mod[:] = [None]
    if kind not in ("prepared", "ctypes"):
        fastpath._prepared = lambda steps: None
    if kind == "run":
        fastpath._direct = lambda ck: None
    fastpath.clear()
    fs.softmax(x, backend=backend)
    fs.softmax(x, backend=backend)
    fastpath._prepared, fastpath._direct, launch._native_mod[:] = saved
    (e,) = fastpath._cache.values()
    assert e.kind == ("prepared" if kind == "ctypes" else kind), (e.kind, kind)
    return e


entries = {f"{b} {k}": entry_of(k, b) for b in ("auto", "cuda") for k in ("prepared", "ctypes", "direct", "run")
           if not (b == "cuda" and k == "direct")}  # fmt: skip
assert launch._native() is not None  # built before the timing
fastpath.clear()
fs.softmax(x)
fs.softmax(x)
fs.softmax(x, backend="cuda")
fs.softmax(x, backend="cuda")
fs.softmax_backward(dy, y)
fs.softmax_backward(dy, y)
stream = torch._C._cuda_getCurrentRawStream(0)
rows = {
    "torch.softmax": lambda: torch.softmax(x, -1),
    "fs.softmax (auto, replay as built)": lambda: fs.softmax(x),
    "fs.softmax (cuda, replay as built)": lambda: fs.softmax(x, backend="cuda"),
    "api._public_forward (auto)": lambda: api._public_forward(x, -1, False, "softmax", None, None, False, None, "auto"),
    **{f"entry {name}": (lambda e=e: e(x, None, 0)) for name, e in entries.items()},
    "fastpath.key": lambda: fastpath.key(x, None, -1, None, False, "auto"),
    "fastpath.fast": lambda: fastpath.fast(x, None, -1, None, False, "auto"),
    "torch.empty_like": lambda: torch.empty_like(x),
    "compose.route(x)": lambda: compose.route(x),
    "hooks_idle": fastpath.hooks_idle,
    "torch._C._cuda_getDevice": torch._C._cuda_getDevice,
    "torch.softmax_backward (aten)": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype),
    "fs.softmax_backward": lambda: fs.softmax_backward(dy, y),
}
got = {name: [] for name in rows}
for _ in range(7):
    for name, fn in rows.items():
        got[name].append(host_us(fn, "cuda", 3000))
for name, v in got.items():
    print(f"{name:42s} {statistics.median(v):6.2f} us   (min {min(v):.2f})")
