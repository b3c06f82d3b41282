"""Where an eager call's host time goes (investigation for the portability issue's host-time target): the
pieces of fs.softmax's and fs.cross_entropy's replay timed alone on CUDA tensors, beside torch's calls.
Usage: python dev/host_parts.py [OUT.json]"""

import ctypes
import json
import sys
import time

import torch
import torch.nn.functional as F

import fastsoftmax as fs
from fastsoftmax.kernels import replay as fastpath
from fastsoftmax.kernels import launch


def host_ns(fn, calls: int = 200) -> float:
    """Best of 10 batches (each well inside the launch queue, so the GPU never holds the host back)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t)
        torch.cuda.synchronize()
    return best / calls * 1e9


def _scale(x, g):
    from fastsoftmax.kernels.triton import cross_entropy as ce

    ce.scale_(x, g)


def main() -> None:
    x = torch.randn(8, 4096, device="cuda")
    t = torch.randint(0, 4096, (8,), device="cuda")
    fs.softmax(x)
    fs.softmax(x)
    (entry,) = fastpath._cache.values()
    mod = launch.native()
    fs.cross_entropy(x, t)
    fs.cross_entropy(x, t)
    stream = torch._C._cuda_getCurrentRawStream(0)
    y = torch.empty_like(x)
    desc = ctypes.addressof(entry.launch.desc)
    px, py = x.data_ptr(), y.data_ptr()
    opts = (-100, "mean", 0.0, None, 0.0, False, "auto")
    k = fastpath.loss_key(x, t, None, *opts)

    class Nop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    xg = x.clone().requires_grad_()
    # the same launch with an empty grid: fastlaunch's own work, no driver call
    ln = entry.launch
    empty = launch.Launch.__new__(launch.Launch)
    empty.fills = ln.fills
    empty._build(ln.function, (0, 1, 1), ln.block, ln.smem, ln.cluster, ln.offsets, ln.raw)
    g1 = torch.ones((), device="cuda")
    rec = launch.start()  # scale_by's prepared launch (3 parameters; g == 1: no work past a load)
    _scale(x, g1)
    launch.abort()
    ((ln_scale, _),) = rec.launches
    pg = g1.data_ptr()
    parts = {
        "torch x.neg_() (one launch, no allocation)": lambda: x.neg_(),
        "torch.neg(x, out=y)": lambda: torch.neg(x, out=y),
        "launch, empty grid (no driver call)": lambda: empty.call(stream, px, py, 0, 0),
        "scale_by launch (3 parameters, g == 1)": lambda: ln_scale.call(stream, px, pg),
        "is_compiling()": torch.compiler.is_compiling,
        "is_dynamo_compiling()": torch.compiler.is_dynamo_compiling,
        "torch.softmax": lambda: torch.softmax(x, -1),
        "fs.softmax (replay)": lambda: fs.softmax(x),
        "fastpath.fast (C)": lambda: fastpath.fast(x, None, -1, None, False, "auto"),
        "softmax_key (C)": lambda: mod.softmax_key(x, None, -1, None, False, "auto"),
        "launch only": lambda: entry.launch.call(stream, px, py, 0, 0),
        "launch_steps (1 launch)": lambda: mod.launch_steps(stream, ((desc, (0, 0, 1, 0, -1, 0, -1, 0)),), (px, py)),
        "torch.empty_like": lambda: torch.empty_like(x),
        "torch.empty(n, dtype, device)": lambda: torch.empty(11, dtype=torch.float32, device=x.device),
        "torch.empty((), dtype, device)": lambda: torch.empty((), dtype=torch.float32, device=x.device),
        "x.device": lambda: x.device,
        "getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "F.cross_entropy": lambda: F.cross_entropy(x, t),
        "fs.cross_entropy (replay)": lambda: fs.cross_entropy(x, t),
        "loss_key (C)": lambda: fastpath.loss_key(x, t, None, *opts),
        "loss_fast": lambda: fastpath.loss_fast(k, x, t),
        "Function.apply (nop)": lambda: Nop.apply(xg),
        "grad(xg.sum())": lambda: torch.autograd.grad(xg.sum(), xg),
        "grad(Nop(xg).sum())": lambda: torch.autograd.grad(Nop.apply(xg).sum(), xg),
        "grad(F.cross_entropy)": lambda: torch.autograd.grad(F.cross_entropy(xg, t), xg),
        "grad(fs.cross_entropy)": lambda: torch.autograd.grad(fs.cross_entropy(xg, t), xg),
    }
    res = {}
    for name, fn in parts.items():
        res[name] = host_ns(fn)
        print(f"{res[name] / 1000:8.2f} us  {name}", flush=True)
    torch.autograd.set_multithreading_enabled(False)  # the backward on the calling thread: no thread hop
    for name in [n for n in parts if n.startswith("grad(")]:
        res[name + ", one thread"] = host_ns(parts[name])
        print(f"{res[name + ', one thread'] / 1000:8.2f} us  {name}, one thread", flush=True)
    torch.autograd.set_multithreading_enabled(True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            doc = dict(what="host ns per call, 8x4096 fp32 on CUDA", torch=torch.__version__, parts=res)
            json.dump(doc, f, indent=1)


main()
