"""Host (Python) cost of fastsoftmax's own layers per call, without a GPU: the Triton kernels are replaced
by no-ops, so what remains is argument checks, dispatch, layout, launch planning and the output allocation.
Run with TRITON_INTERPRET=1 on a CPU machine; `prof` adds a cProfile listing. (The GPU figure, which adds
Triton's launcher, comes from `fastsoftmax bench`'s host_us.)"""

import sys
import time

import torch

import fastsoftmax as fs
from fastsoftmax.triton import softmax_bwd, softmax_fwd


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, n=20000):
    for _ in range(100):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main():
    x = torch.randn(1, 4096)
    y = torch.softmax(x, -1)
    fs.softmax(x, backend="triton")
    for kernels in (softmax_fwd.KERNELS, softmax_bwd.KERNELS):
        for k in kernels:
            kernels[k] = (_NoLaunch(), _NoLaunch()) if k == "split" else _NoLaunch()
    print(f"fs.softmax, kernel not launched: {per_call_us(lambda: fs.softmax(x, backend='triton')):.1f} us")
    bwd = per_call_us(lambda: fs.softmax_backward(x, y, backend="triton"))
    print(f"fs.softmax_backward, kernel not launched: {bwd:.1f} us")
    print(f"torch.softmax on this CPU (for scale): {per_call_us(lambda: torch.softmax(x, -1)):.1f} us")
    if "prof" in sys.argv:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [fs.softmax(x, backend="triton") for _ in range(20000)])
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
