"""Host time per eager call (wall time, the GPU kept ahead of the host; best of 7 (--rounds) batches of 200
calls, ours and torch's interleaved) of fs.softmax, fs.log_softmax, both backward functions, fs.cross_entropy
forward and forward + backward, beside torch's, on 1x4096 and 8x4096 fp32/bf16
(issue: portability, host time <= torch's) and on the cross-entropy suite's 1024x256000; then cProfile's
top functions of fs.cross_entropy forward + backward. --python-calls: fastlaunch.c reaching torch through
Python, as where fastlaunch_torch.cpp cannot be built. Usage: python dev/host_calls.py [OUT.json] [profile]
[--python-calls] [--rounds N]"""

import cProfile
import io
import json
import pstats
import sys
import time

import torch
import torch.nn.functional as F

import fastsoftmax as fs


def host_us(fn, calls: int = 500) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t
    torch.cuda.synchronize()
    return wall / calls * 1e6


def paired_us(ours, theirs, calls: int, rounds: int = 7) -> tuple[float, float]:
    """(ours, theirs) host us per call: the best of ``rounds`` batches each, the two interleaved batch by
    batch, so that a drift of the host's speed during the run reaches both alike."""
    a, b = [], []
    for _ in range(rounds):
        a.append(host_us(ours, calls))
        b.append(host_us(theirs, calls))
    return min(a), min(b)


def cases(m: int, v: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, v, device="cuda", dtype=dtype)
    t = torch.randint(0, v, (m,), device="cuda")
    xg = x.clone().requires_grad_()
    y, ly = torch.softmax(x, -1), torch.log_softmax(x, -1)
    dy = torch.randn_like(y)
    return {
        "softmax": (lambda: fs.softmax(x, -1), lambda: torch.softmax(x, -1)),
        "log_softmax": (lambda: fs.log_softmax(x, -1), lambda: torch.log_softmax(x, -1)),
        "softmax_backward": (
            lambda: fs.softmax_backward(dy, y, -1),
            lambda: torch._softmax_backward_data(dy, y, -1, dtype),
        ),
        "log_softmax_backward": (
            lambda: fs.log_softmax_backward(dy, ly, -1),
            lambda: torch._log_softmax_backward_data(dy, ly, -1, dtype),
        ),
        "cross_entropy": (lambda: fs.cross_entropy(x, t), lambda: F.cross_entropy(x, t)),
        "cross_entropy_fwd_bwd": (
            lambda: torch.autograd.grad(fs.cross_entropy(xg, t), xg),
            lambda: torch.autograd.grad(F.cross_entropy(xg, t), xg),
        ),
    }


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].endswith(".json") else None
    from fastsoftmax import torch_build
    from fastsoftmax.kernels import replay as fastpath

    fs.softmax(torch.randn(1, device="cuda"))  # (fastlaunch built and configured)
    torch_build.torch_calls()  # (its build, where one runs in the background, waited for)
    if "--python-calls" in sys.argv:
        fastpath._native().configure_torch(None)
        fastpath.clear()
    print("launch:", fs.info()["replay"], flush=True)
    records = []
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 7
    for m, v in ((1, 4096), (8, 4096), (1024, 256000)):
        for dtype in (torch.float32, torch.bfloat16):
            for name, (ours, theirs) in cases(m, v, dtype).items():
                if m == 1024 and not name.startswith("cross_entropy"):
                    continue
                calls = 50 if m == 1024 else 200
                rec = dict(case=name, M=m, N=v, dtype=str(dtype).split(".")[-1])
                mine, torchs = paired_us(ours, theirs, calls, rounds)
                rec |= dict(fastsoftmax_us=mine, torch_us=torchs)
                print(json.dumps(rec), flush=True)
                records.append(rec)
    if out:
        import triton

        doc = dict(what="host us per eager call", torch=torch.__version__, triton=triton.__version__)
        doc |= dict(device=torch.cuda.get_device_name(), launch=fs.info()["replay"], rounds=rounds)
        with open(out, "w") as f:
            json.dump(doc | dict(records=records), f, indent=1)
    if "profile" in sys.argv:
        from fastsoftmax import ops

        x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, 4096, (8,), device="cuda")
        opts = (-100, "mean", 0.0, None, 0.0)
        _, _, stats = ops.cross_entropy(x, t, None, *opts, "auto", torch.float32)
        g = torch.ones((), device="cuda")
        xg = x.clone().requires_grad_()
        steps = {
            "forward": lambda: fs.cross_entropy(xg, t),
            "backward op": lambda: ops.cross_entropy_backward(x, t, None, stats, g, *opts, "auto"),
            "forward + backward": lambda: torch.autograd.grad(fs.cross_entropy(xg, t), xg),
            "torch forward + backward": lambda: torch.autograd.grad(F.cross_entropy(xg, t), xg),
        }
        for name, fn in steps.items():
            print(f"{name}: {host_us(fn):.1f} us per call")
            # the backward on this thread (autograd's CUDA thread is not profiled): the same work, serial
            torch.autograd.set_multithreading_enabled(False)
            print(f"{name}, backward on the calling thread: {host_us(fn):.1f} us per call")
            p = cProfile.Profile()
            p.enable()
            for _ in range(200):
                fn()
            p.disable()
            torch.autograd.set_multithreading_enabled(True)
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(22)
            print(s.getvalue())


main()
