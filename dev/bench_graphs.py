"""Few-long-row shapes timed two ways: eager calls (host launch overhead included when the kernel is
shorter than it) and CUDA-graph replays (GPU time only), online vs split, beside torch. GB/s read+write
(forward 2 bytes moved per element byte, backward 3). Usage: bench_graphs.py [fwd|bwd]."""

import sys

import torch
import triton.testing

import fastsoftmax as fs
from fastsoftmax import heuristics

SHAPES = [(8, 131072), (64, 131072), (128, 262144), (4, 1 << 20), (32, 151936), (256, 65536), (512, 262144), (1, 4096)]


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
    bwd = len(sys.argv) > 1 and sys.argv[1] == "bwd"
    print(f"{'bwd' if bwd else 'fwd'}: {'dtype':9} {'shape':14} {'torch e/g':>11} {'online e/g':>11} {'split e/g':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            y, dy = torch.softmax(x, -1), torch.randn_like(x)
            nbytes = (3 if bwd else 2) * x.numel() * x.element_size()
            cols = []
            for name in ("torch", "online", "split"):
                if name == "torch" and bwd:
                    fn = lambda y=y, dy=dy: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)  # noqa: E731
                elif name == "torch":
                    fn = lambda x=x: torch.softmax(x, -1)  # noqa: E731
                elif bwd:
                    fn = lambda y=y, dy=dy: fs.softmax_backward(dy, y, backend="triton")  # noqa: E731
                else:
                    fn = lambda x=x: fs.softmax(x, backend="triton")  # noqa: E731
                with heuristics.force(**({} if name == "torch" else {"path": name})):
                    cols.append((gbps(fn, nbytes), gbps(graphed(fn), nbytes)))
            print(f"{str(dtype)[6:]:9} {m}x{n:<10} " + " ".join(f"{e:5.0f}/{g:<5.0f}" for e, g in cols), flush=True)


if __name__ == "__main__":
    main()
