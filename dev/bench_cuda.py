"""CUDA backend variants vs the Triton backend (auto) vs torch eager, forward and backward, GB/s (forward
2 bytes moved per element byte, backward 3), do_bench medians with L2 flushed; copy bandwidth first.
Each implementation is checked against the float64 oracle on a few rows before it is timed.
Usage: bench_cuda.py [fwd|bwd|all] [graph] [quick] [long] [occupancy] (quick: six shapes, no three_pass;
long: the suite's rows of 16384 and more plus two short shapes, no three_pass, the cluster and block variants
also under LONG_EXPERIMENTS; occupancy: also each variant under the EXPERIMENTS caps: CTAs per SM, vectors
per thread, CTA size)."""

import sys

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench.suite import SUITE, graphed
from fastsoftmax.core.reference import compare, compare_grad
from fastsoftmax.kernels.cuda import build

SHAPES = [s for s in SUITE if s != (1, 4096)]  # bench/suite.py's SUITE (1x4096: host-bound)
VARIANTS = ["warp", "block", "cluster", "online", "staged", "three_pass"]
# occupancy mode: registers capped for more CTAs per SM, fewer vectors per thread, smaller CTAs
EXPERIMENTS = [
    {"min_ctas": 8},
    {"min_ctas": 16},
    {"k_max": 4},
    {"k_max": 2},
    {"group_max": 256},
    {"group_max": 128},
    {"k_max": 4, "group_max": 256},
]
LONG_EXPERIMENTS = [{"k_max": 4}, {"group_max": 256}, {"k_max": 4, "group_max": 256}]
QUICK = [(131072, 1024), (32768, 4096), (4096, 32000), (2048, 65536), (512, 262144), (8, 131072)]


def gbps(fn, nbytes, graph):
    return nbytes / triton.testing.do_bench(graphed(fn) if graph else fn, return_mode="median") / 1e6


def row(p, x, graph):
    """One table line: torch, Triton auto, CUDA auto, each CUDA variant that holds the row; checked first."""
    y, dy = torch.softmax(x, -1), torch.randn_like(x)
    nbytes = (2 if p == "fwd" else 3) * x.numel() * x.element_size()

    def fn(backend):
        if p == "fwd":
            return lambda: fs.softmax(x, backend=backend)
        return lambda: fs.softmax_backward(dy, y, backend=backend)

    def ok(backend):
        if p == "fwd":
            return compare(fs.softmax(x[:4], backend=backend), x[:4], -1, False)[1] is None
        dx = fs.softmax_backward(dy[:4], y[:4], backend=backend)
        return compare_grad(dx, dy[:4], y[:4], -1, False)[1] is None

    if p == "fwd":
        torch_fn = lambda: torch.softmax(x, -1)  # noqa: E731
    else:
        torch_fn = lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)  # noqa: E731
    cols = [f"torch={gbps(torch_fn, nbytes, graph):.0f}"]
    assert ok("cuda") and ok("triton")
    cols.append(f"triton={gbps(fn('triton'), nbytes, graph):.0f}({heuristics.last_plan().path})")
    cols.append(f"cuda={gbps(fn('cuda'), nbytes, graph):.0f}({heuristics.last_plan().path})")
    for v in VARIANTS:
        extras = EXPERIMENTS if "occupancy" in sys.argv and v != "three_pass" else []
        if "long" in sys.argv and v in ("cluster", "block"):
            extras = LONG_EXPERIMENTS
        for extra in [{}] + extras:
            try:
                with heuristics.force(path=v, **extra):
                    assert ok("cuda")
                    tag = ",".join(f"{k}={val}" for k, val in extra.items())
                    cols.append(f"{v}{'[' + tag + ']' if tag else ''}={gbps(fn('cuda'), nbytes, graph):.0f}")
            except ValueError:
                pass  # the variant does not hold this row length with these caps
    return " ".join(cols)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    graph = "graph" in sys.argv
    quick = "quick" in sys.argv
    shapes = QUICK if quick else SHAPES
    if "long" in sys.argv:
        shapes = [(m, n) for m, n in SHAPES if n >= 16384 or (m, n) in ((131072, 1024), (32768, 4096))]
    if quick or "long" in sys.argv:
        VARIANTS.remove("three_pass")
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = gbps(lambda: dst.copy_(src), 2 * src.numel(), False)
    fast = "on" if build.FAST_MATH else "off"
    print(
        f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; NVRTC {build.nvrtc_version()}, "
        f"-use_fast_math {fast}; timing: {'CUDA graph replay' if graph else 'eager'}"
    )
    for p in ("fwd", "bwd"):
        if which not in (p, "all"):
            continue
        for dtype in (torch.bfloat16, torch.float32):
            for m, n in shapes:
                x = torch.randn(m, n, device="cuda", dtype=dtype)
                print(f"{p} {str(dtype)[6:]:9} {m}x{n:<8} {row(p, x, graph)}", flush=True)


if __name__ == "__main__":
    main()
