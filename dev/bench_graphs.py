"""Few-long-row shapes timed two ways: eager calls (host launch overhead included when the kernel is
shorter than it) and CUDA-graph replays (GPU time only), online vs split, beside torch. GB/s read+write."""

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics

SHAPES = [(8, 131072), (64, 131072), (128, 262144), (4, 1 << 20), (32, 151936), (256, 65536), (512, 262144)]


def graphed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def gbps(fn, nbytes):
    return nbytes / triton.testing.do_bench(fn, return_mode="median") / 1e6


def main():
    print(f"{'dtype':9} {'shape':14} {'torch e/g':>11} {'online e/g':>11} {'split e/g':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            nbytes = 2 * x.numel() * x.element_size()
            cols = []
            for name in ("torch", "online", "split"):
                if name == "torch":
                    fn = lambda x=x: torch.softmax(x, -1)  # noqa: E731
                    cols.append((gbps(fn, nbytes), gbps(graphed(fn), nbytes)))
                    continue
                with heuristics.force(path=name):
                    fn = lambda x=x: fs.softmax(x, backend="triton")  # noqa: E731
                    cols.append((gbps(fn, nbytes), gbps(graphed(fn), nbytes)))
            print(f"{str(dtype)[6:]:9} {m}x{n:<10} " + " ".join(f"{e:5.0f}/{g:<5.0f}" for e, g in cols), flush=True)


if __name__ == "__main__":
    main()
