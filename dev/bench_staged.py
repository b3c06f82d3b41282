"""The CUDA staged forward (row slices in shared memory by cp.async.bulk) against the register-held cluster
variant, the Triton backend (auto) and torch, on long rows; the staged slice size and CTA size
(kernels.STAGE_BYTES, STAGE_GROUP) swept.
Forward GB/s (2 bytes moved per element byte), backward GB/s (3: y and dy read, dx written), do_bench medians
with L2 flushed (CUDA-graph replays for few rows); every output checked in full against the float64 oracle
first. Copy bandwidth first.
Usage: python dev/bench_staged.py [fwd|bwd ...] [bf16|fp32 ...] [quick (the default slice and CTA size only)]
                                  [long (the shapes of 2^26+ elements with rows of 32768+ only)]
                                  [big (slices of 128 and 192 KiB against the default)]
                                  [budgets (slice budgets of 48-192 KiB, no cluster variant)] [c16 (clusters up
                                  to 16 CTAs)]
The slice budget swept is the pass's own: kernels.STAGE_BYTES (forward) or STAGE_BYTES_BWD (backward)."""

import functools
import sys

import torch
import triton.testing
from forced_cell import forced_cell

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import copy_gbps, graphed
from fastsoftmax.cuda import kernels
from fastsoftmax.reference import compare, compare_grad

SHAPES = [(4096, 32768), (4096, 32000), (16384, 37984), (8192, 50257), (2048, 65536), (1024, 131072),
          (512, 262144), (8, 131072), (64, 131072), (128, 262144), (8192, 16384)]  # fmt: skip
CONFIGS = [(32768, 256), (65536, 256), (102400, 256), (102400, 512)]  # (STAGE_BYTES, STAGE_GROUP)


def gbps(fn, nbytes, graph):
    return nbytes / triton.testing.do_bench(graphed(fn) if graph else fn, return_mode="median") / 1e6


def main():
    defaults = kernels.STAGE_BYTES, kernels.STAGE_BYTES_BWD, kernels.STAGE_GROUP
    if "c16" in sys.argv:
        kernels.STAGE_CLUSTER_MAX = 16
    dts = [d for d in sys.argv[1:] if d in ("bf16", "fp32")] or ["bf16", "fp32"]
    passes = [p for p in sys.argv[1:] if p in ("fwd", "bwd")] or ["fwd"]
    configs = [(None, defaults[2])] if "quick" in sys.argv else CONFIGS
    if "big" in sys.argv:  # slices past the default (fewer CTAs per SM and per cluster)
        configs = [(None, defaults[2]), (131072, 256), (196608, 256), (196608, 512)]
    if "budgets" in sys.argv:
        configs = [(b, 256) for b in (49152, 65536, 102400, 131072, 196608)]
    shapes = [(m, n) for m, n in SHAPES if "long" not in sys.argv or (m * n >= 1 << 26 and n >= 32768)]
    print(f"{torch.cuda.get_device_name(0)}: copy {copy_gbps('cuda'):.0f} GB/s", flush=True)
    for ps, dt in [(p, d) for p in passes for d in dts]:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        for m, n in shapes:
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) * 3
            x[0, 5] = 300.0  # an outlier
            if ps == "fwd":
                run = fs.softmax
                args = (x,)
                check = lambda out, x=x: compare(out, x, -1, False)  # noqa: E731
                ref = lambda x=x: torch.softmax(x, -1)  # noqa: E731
            else:
                y = torch.softmax(x.float(), -1).to(dtype)
                dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
                run = fs.softmax_backward
                args = (dy, y)
                check = lambda out, dy=dy, y=y: compare_grad(out, dy, y, -1, False)  # noqa: E731
                ref = functools.partial(torch._softmax_backward_data, dy, y, -1, dtype)
            nbytes = (2 if ps == "fwd" else 3) * x.numel() * x.element_size()
            del x
            graph = m < 264
            cols = [f"torch={gbps(ref, nbytes, graph):.0f}"]
            run(*args)
            cols.append(f"auto={gbps(functools.partial(run, *args), nbytes, graph):.0f}({heuristics.last_plan().path})")
            runs = [("staged", b, t) for b, t in configs]
            if "budgets" not in sys.argv:
                runs.insert(0, ("cluster", None, None))
            for variant, slice_bytes, threads in runs:
                if variant == "staged":  # None: the pass's default budget
                    budget = slice_bytes or defaults[0 if ps == "fwd" else 1]
                    kernels.STAGE_BYTES, kernels.STAGE_BYTES_BWD, kernels.STAGE_GROUP = budget, budget, threads
                tag = f"{variant}{budget // 1024}k/{threads}" if variant == "staged" else variant
                cols.append(forced_cell(tag, variant, "cuda", run, args, check,
                                        lambda fn, b=nbytes, g=graph: gbps(fn, b, g)))  # fmt: skip
            kernels.STAGE_BYTES, kernels.STAGE_BYTES_BWD, kernels.STAGE_GROUP = defaults
            print(f"{ps} {dt} {m}x{n}: " + " ".join(cols), flush=True)


if __name__ == "__main__":
    main()
