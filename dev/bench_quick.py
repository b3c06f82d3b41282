"""Copy bandwidth, then fastsoftmax (auto, and each forced path) vs torch eager, forward and backward, GB/s
counting bytes read + written (forward 2 per element, backward 3). Usage: bench_quick.py [fwd|bwd|all]."""

import sys

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics

SHAPES = [(524288, 256), (262144, 513), (131072, 1024), (32768, 4096), (8192, 16384), (4096, 32000), (16384, 37984),
          (8192, 50257), (2048, 65536), (1024, 131072), (512, 262144), (8, 131072), (64, 131072), (128, 262144),
          (1, 4096)]  # fmt: skip


def gbps(fn, nbytes):
    return nbytes / triton.testing.do_bench(fn, return_mode="median") / 1e6


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = gbps(lambda: dst.copy_(src), 2 * src.numel())
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s")
    print(
        f"{'pass':4} {'dtype':9} {'shape':16} {'torch':>7} {'fs auto':>8} {'path':9} {'%copy':>6} {'xTorch':>6}  forced"
    )
    for p in ("fwd", "bwd"):
        if which not in (p, "all"):
            continue
        for dtype in (torch.bfloat16, torch.float32):
            for m, n in SHAPES:
                x = torch.randn(m, n, device="cuda", dtype=dtype)
                if p == "fwd":
                    nbytes = 2 * x.numel() * x.element_size()
                    t_fn = lambda x=x: torch.softmax(x, -1)  # noqa: E731
                    f_fn = lambda x=x: fs.softmax(x)  # noqa: E731
                else:
                    y, dy = torch.softmax(x, -1), torch.randn_like(x)
                    nbytes = 3 * x.numel() * x.element_size()
                    t_fn = lambda y=y, dy=dy: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)  # noqa: E731
                    f_fn = lambda y=y, dy=dy: fs.softmax_backward(dy, y)  # noqa: E731
                t = gbps(t_fn, nbytes)
                f = gbps(f_fn, nbytes)
                plan = heuristics.last_plan()
                forced = []
                for path in ("rowblock", "online", "split"):
                    if path == "rowblock" and n > heuristics.ROWBLOCK_MAX_N // (1 if p == "fwd" else 2):
                        continue
                    with heuristics.force(path=path):
                        forced.append(f"{path}={gbps(f_fn, nbytes):.0f}")
                print(f"{p:4} {str(dtype)[6:]:9} {m}x{n:<10} {t:7.0f} {f:8.0f} {plan.path:9} {100 * f / copy:5.0f}% "
                      f"{f / t:6.2f}  {' '.join(forced)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
