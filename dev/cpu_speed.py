"""fastsoftmax on CPU tensors (backend='auto': torch's own kernels with the library's conventions)
beside torch's own ops, single-threaded, in one process: softmax, log_softmax, softmax forward + backward
(autograd), fs.softmax_backward and fs.log_softmax_backward, cross_entropy forward and forward + backward,
fp32 and bf16, from 1x4096 to 4096x4096.
Each repetition times fastsoftmax and torch back to back (the order alternating), so both see the same
machine; the figure is the median of each. ``chunks`` adds the sweep behind kernels/torch_native.CHUNK
(rows computed a chunk at a time: cross-entropy, 16-bit log_softmax).
Usage: python dev/cpu_speed.py OUT.json [MxN ...] [chunks] (pin it: taskset -c 1 ...)."""

import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fastsoftmax as fs
from fastsoftmax.kernels import torch_native as native

SHAPES = ((1, 4096), (8, 4096), (64, 50257), (1024, 32000), (4096, 4096))
BUDGET_S = float(os.environ.get("BUDGET", "1.5"))  # per case, both sides together
CHUNKS = tuple(1 << k for k in range(15, 22))


def cases(m: int, n: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, n, generator=g) * 3).to(dtype)
    t = torch.randint(0, n, (m,), generator=g)
    dy = torch.randn(m, n, generator=g).to(dtype)
    xg = x.clone().requires_grad_()
    y, ly = torch.softmax(x, -1), torch.log_softmax(x, -1)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg, -1), xg, dy)

    def ce_fwd_bwd(f):
        return lambda: torch.autograd.grad(f(xg, t), xg)

    return {
        "softmax": (lambda: fs.softmax(x, -1), lambda: torch.softmax(x, -1)),
        "log_softmax": (lambda: fs.log_softmax(x, -1), lambda: torch.log_softmax(x, -1)),
        "softmax_fwd_bwd": (fwd_bwd(fs.softmax), fwd_bwd(torch.softmax)),
        "softmax_backward": (
            lambda: fs.softmax_backward(dy, y, -1),
            lambda: torch._softmax_backward_data(dy, y, -1, dtype),
        ),
        "log_softmax_backward": (
            lambda: fs.log_softmax_backward(dy, ly, -1),
            lambda: torch._log_softmax_backward_data(dy, ly, -1, dtype),
        ),
        "cross_entropy": (lambda: fs.cross_entropy(x, t), lambda: F.cross_entropy(x, t)),
        "cross_entropy_fwd_bwd": (ce_fwd_bwd(fs.cross_entropy), ce_fwd_bwd(F.cross_entropy)),
    }


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(ours, theirs) -> tuple[float, float, int]:
    """(our median us, torch's median us, repetitions), interleaved."""
    for _ in range(3):
        ours(), theirs()
    once = timed(ours) + timed(theirs)
    reps = max(7, min(3000, int(BUDGET_S / max(once, 1e-7))))
    a, b = [], []
    for i in range(reps):
        if i % 2:
            b.append(timed(theirs))
            a.append(timed(ours))
        else:
            a.append(timed(ours))
            b.append(timed(theirs))
    return statistics.median(a) * 1e6, statistics.median(b) * 1e6, reps


def chunk_sweep() -> list:
    """ms per call of the chunked cases against CHUNK (elements), on the shapes past one chunk."""
    default, records = native.CHUNK, []
    for m, n in SHAPES[2:]:
        for dtype in (torch.float32, torch.bfloat16):
            c = cases(m, n, dtype)
            names = ["cross_entropy", "cross_entropy_fwd_bwd"] + (["log_softmax"] if dtype != torch.float32 else [])
            for chunk in CHUNKS:
                native.CHUNK = chunk
                for name in names:
                    fn = c[name][0]
                    fn()
                    reps = max(5, min(50, int(BUDGET_S / 2 / max(timed(fn), 1e-7))))
                    ms = statistics.median(timed(fn) for _ in range(reps)) * 1e3
                    rec = dict(case=name, M=m, N=n, dtype=str(dtype).removeprefix("torch."), chunk=chunk)
                    records.append(rec | dict(ms=round(ms, 3)))
                    print(json.dumps(records[-1]), flush=True)
    native.CHUNK = default
    return records


def commit() -> str:
    """The checkout's commit (short), or '?' outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} cores)"
    except (OSError, IndexError):
        return platform.processor() or platform.machine()


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    sweep = "chunks" in sys.argv[2:]
    shapes = [tuple(int(v) for v in s.split("x")) for s in sys.argv[2:] if s != "chunks"] or SHAPES
    torch.set_num_threads(1)
    records = []
    print(f"{'case':24} {'M x N':>12} {'dtype':>9} {'fs us':>11} {'torch us':>11} {'fs/torch':>9}")
    for m, n in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for name, (ours, theirs) in cases(m, n, dtype).items():
                us, ref, reps = measure(ours, theirs)
                rec = dict(case=name, M=m, N=n, dtype=str(dtype).removeprefix("torch."), reps=reps)
                rec |= dict(fastsoftmax_us=round(us, 2), torch_us=round(ref, 2), ratio=round(us / ref, 3))
                records.append(rec)
                print(
                    f"{name:24} {f'{m}x{n}':>12} {rec['dtype']:>9} {us:11.1f} {ref:11.1f} {us / ref:9.2f}", flush=True
                )
    doc = dict(
        what="us per call on CPU tensors, median of interleaved repetitions, one thread; ratio = fastsoftmax / torch",
        torch=torch.__version__,
        python=platform.python_version(),
        cpu=cpu_name(),
        date=time.strftime("%Y-%m-%d"),
        threads=torch.get_num_threads(),
        chunk=native.CHUNK,
        commit_measured=commit(),
        records=records,
    )
    if sweep:
        doc["chunk_sweep"] = chunk_sweep()
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


main()
