"""Sweep launch shapes of the forward paths on the GPU (GB/s, read + write), to regenerate heuristics.py.
Each configuration is checked against the oracle before it is timed."""

import itertools
import sys

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.reference import compare, compare_grad


def gbps(x, bwd=False, **force):
    """Forward GB/s (2 bytes moved per element byte), or backward (3) with ``bwd``; checked first."""
    with heuristics.force(**force):
        if bwd:
            y, dy = torch.softmax(x, -1), torch.randn_like(x)
            err, problem = compare_grad(
                fs.softmax_backward(dy[:64], y[:64], backend="triton"), dy[:64], y[:64], -1, False
            )
            fn, moved = (lambda: fs.softmax_backward(dy, y, backend="triton")), 3
        else:
            err, problem = compare(fs.softmax(x[:64], backend="triton"), x[:64], -1, False)
            fn, moved = (lambda: fs.softmax(x, backend="triton")), 2
        assert problem is None, (force, problem)
        ms = triton.testing.do_bench(fn, return_mode="median")
    return moved * x.numel() * x.element_size() / ms / 1e6


def sweep(m, n, dtype, grid, bwd=False):
    x = torch.randn(m, n, device="cuda", dtype=dtype)
    res = []
    for cfg in grid:
        try:
            res.append((gbps(x, bwd, **cfg), cfg))
        except Exception as e:  # a configuration that does not compile or fit is reported, not fatal
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
    res.sort(key=lambda t: -t[0])
    top = "  ".join(f"{g:.0f} {c}" for g, c in res[:4])
    print(f"{'bwd' if bwd else 'fwd'} {str(dtype)[6:]:9} {m}x{n:<8} best: {top}", flush=True)


def main():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    print(f"copy {2 * src.numel() / ms / 1e6:.0f} GB/s", flush=True)
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    for dtype in (torch.bfloat16, torch.float32):
        if part in ("all", "bwd"):
            for m, n in [(262144, 513), (131072, 1024), (32768, 4096), (8192, 16384)]:
                shapes = itertools.product([1, 2, 4, 8], [1, 2, 4, 8, 16])
                fits = [(r, w) for r, w in shapes if r * triton.next_power_of_2(n) <= 16384]
                sweep(m, n, dtype, [dict(path="rowblock", rows=r, num_warps=w) for r, w in fits], bwd=True)
            for m, n in [(4096, 32000), (8192, 50257), (1024, 131072), (64, 131072)]:
                grid = [dict(path="rowblock")] if n <= 32768 else []
                for path, b, w in itertools.product(["online", "split"], [2048, 4096, 8192], [4, 8, 16]):
                    grid.append(dict(path=path, block_n=b, num_warps=w))
                sweep(m, n, dtype, grid, bwd=True)
        if part in ("all", "split"):
            for m, n in [(8, 131072), (64, 131072), (128, 262144), (4, 1 << 20), (32, 151936), (256, 65536)]:
                grid = [dict(path="online")]
                for b, w, p in itertools.product([1024, 2048, 4096, 8192], [4, 8, 16], [2, 4, 8]):
                    if b // (32 * w) >= 4:
                        splits = max(1, min(-(-n // b), -(-p * 132 // m)))
                        grid.append(dict(path="split", block_n=b, num_warps=w, splits=splits))
                sweep(m, n, dtype, grid)
        if part in ("all", "short"):
            for m, n in [(262144, 513), (524288, 256), (131072, 1024), (65536, 2053)]:
                shapes = itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8])
                fits = [(r, w) for r, w in shapes if r * triton.next_power_of_2(n) <= 16384]
                grid = [dict(path="rowblock", rows=r, num_warps=w) for r, w in fits]
                sweep(m, n, dtype, grid)
        if part in ("all", "long"):
            for m, n in [(8192, 16384), (4096, 32000), (2048, 32768), (8192, 12289)]:
                grid = [dict(path="rowblock", rows=1, num_warps=w) for w in (4, 8, 16, 32)]
                sweep(m, n, dtype, grid)
            for m, n in [(8192, 50257), (2048, 65536), (1024, 131072), (512, 262144)]:
                shapes = itertools.product([1024, 2048, 4096, 8192], [4, 8, 16])
                grid = [dict(path="online", rows=1, block_n=b, num_warps=w) for b, w in shapes if b // (32 * w) <= 64]
                sweep(m, n, dtype, grid)


if __name__ == "__main__":
    main()
