"""Where a 1x4096 fp32 eager call's host time goes on the GPU, part by part (wall time per call, the GPU kept
ahead, median of 7 rounds, every variant measured in each round so drift hits all alike): torch.softmax;
fs.softmax with the direct replay (ints to Triton's C launch function) and with the previous replay
(CompiledKernel.run with tensors); the replay's own pieces. Usage: python dev/host_parts.py"""

import statistics

import torch

import fastsoftmax as fs
from fastsoftmax import api, fastpath
from fastsoftmax.bench import host_us

x = torch.randn(1, 4096, device="cuda")
y = torch.softmax(x, -1)
dy = torch.randn_like(x)
made = []
real_make = fastpath._make_direct
fastpath._make_direct = lambda *a: made.append(a) or real_make(*a)
fs.softmax(x)
fs.softmax(x)
fastpath._make_direct = real_make
k = fastpath.key(x, None, -1, None, False, "auto")
entry = fastpath._cache[k]
ck, (raw, coop, pdl), g, vals_t, slots, _, _ = made[0]
print("args recorded (tensor slots None):", vals_t, "slots", slots)
stream = torch._C._cuda_getCurrentRawStream(0)
y_out = torch.empty_like(x)
tens = list(vals_t)
for i, r in slots:
    tens[i] = x if r == "x" else y_out
ints = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in tens]
g = tuple(g)
flags = (ck.function, coop, pdl, None, None, ck.packed_metadata, None, None, None)


def old_replay():
    saved = fastpath._direct
    fastpath._direct = lambda ck: None
    fastpath.clear()
    fs.softmax(x)
    fs.softmax(x)
    e = fastpath._cache[k]
    fastpath._direct = saved
    fastpath.clear()
    fs.softmax(x)
    fs.softmax(x)
    return e


old = old_replay()
rows = {
    "torch.softmax": lambda: torch.softmax(x, -1),
    "fs.softmax (direct replay)": lambda: fs.softmax(x),
    "api._public_forward (direct)": lambda: api._public_forward(
        x, -1, False, "softmax", None, None, False, None, "auto"
    ),  # noqa: E501
    "previous replay entry (ck.run, tensors)": lambda: old(x, None, 0),
    "direct replay entry": lambda: entry(x, None, 0),
    "fastpath.key": lambda: fastpath.key(x, None, -1, None, False, "auto"),
    "fastpath.replay": lambda: fastpath.replay(k, x),
    "torch.empty_like": lambda: torch.empty_like(x),
    "raw launch, ints": lambda: raw(*g, stream, *flags, *ints),
    "raw launch, tensors": lambda: raw(*g, stream, *flags, *tens),
    "ck.run, tensors": lambda: ck.run(*g, stream, ck.function, ck.packed_metadata, None, None, None, *tens),
    "_autograd(x)": lambda: api._autograd(x),
    "hooks_idle": fastpath.hooks_idle,
    "torch._C._cuda_getDevice": torch._C._cuda_getDevice,
    "torch.cuda.current_device": torch.cuda.current_device,
    "torch.softmax_backward (aten)": lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype),
    "fs.softmax_backward": lambda: fs.softmax_backward(dy, y),
}
got = {name: [] for name in rows}
for _ in range(7):
    for name, fn in rows.items():
        got[name].append(host_us(fn, "cuda", 3000))
for name, v in got.items():
    print(f"{name:42s} {statistics.median(v):6.2f} us   (min {min(v):.2f})")
