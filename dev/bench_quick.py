"""Copy bandwidth, then fastsoftmax (auto, each forced path) vs torch eager forward, GB/s (read + write)."""

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics

SHAPES = [(524288, 256), (262144, 513), (131072, 1024), (32768, 4096), (8192, 16384), (4096, 32000),
          (8192, 50257), (2048, 65536), (1024, 131072), (512, 262144), (8, 131072), (128, 262144)]  # fmt: skip


def gbps(fn, arg, nbytes):
    return nbytes / triton.testing.do_bench(lambda: fn(arg), return_mode="median") / 1e6


def main():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = gbps(dst.copy_, src, 2 * src.numel())
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s")
    print(f"{'dtype':9} {'shape':16} {'torch':>7} {'fs auto':>8} {'path':9} {'%copy':>6} {'xTorch':>6}  forced")
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            nbytes = 2 * x.numel() * x.element_size()
            t = gbps(lambda a: torch.softmax(a, -1), x, nbytes)
            f = gbps(fs.softmax, x, nbytes)
            plan = heuristics.last_plan()
            forced = []
            for path in ("rowblock", "online"):
                if path == "rowblock" and n > 32768:
                    continue
                with heuristics.force(path=path):
                    g = gbps(fs.softmax, x, nbytes)
                forced.append(f"{path}={g:.0f}")
            print(f"{str(dtype)[6:]:9} {m}x{n:<10} {t:7.0f} {f:8.0f} {plan.path:9} {100 * f / copy:5.0f}% "
                  f"{f / t:6.2f}  {' '.join(forced)}")  # fmt: skip


if __name__ == "__main__":
    main()
