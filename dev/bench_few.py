"""Few long rows (the suite's 8x131072, 64x131072, 128x262144, and 512x262144): every candidate path, the
CUDA staged variant at each cluster size it can take (2-16 CTAs per row) and CTA size (GROUPS), forced,
against torch, auto, and an elementwise op moving the same bytes (copy_: forward, add: backward).
CUDA-graph replays timed by do_bench (L2 flushed), medians; every output checked in full against the float64
oracle first. Also the method's floor: the same timing of a one-element kernel.
Usage: python dev/bench_few.py [fwd|bwd ...] [bf16|fp32 ...] [SHAPE=MxN ...] [staged (no other path)]"""

import dataclasses
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

SHAPES = [(8, 131072), (64, 131072), (128, 262144), (512, 262144)]
GROUPS = (256, 512, 1024)
_orig_shape = kernels.launch_shape
_cluster, _group = None, None  # the staged variant's CTAs per row and threads per CTA, forced


def _shape(*args, **kw):
    s = _orig_shape(*args, **kw)
    return dataclasses.replace(s, cluster=_cluster, group=_group) if _cluster and s.variant == "staged" else s


kernels.launch_shape = _shape


def us(fn, graph=True):
    return 1e3 * triton.testing.do_bench(graphed(fn) if graph else fn, return_mode="median")


def main():
    global _cluster, _group
    dts = [d for d in sys.argv[1:] if d in ("bf16", "fp32")] or ["bf16", "fp32"]
    passes = [p for p in sys.argv[1:] if p in ("fwd", "bwd")] or ["fwd", "bwd"]
    shapes = [tuple(map(int, a[6:].split("x"))) for a in sys.argv[1:] if a.startswith("SHAPE=")] or SHAPES
    kernels.STAGE_CLUSTER_MAX = 16
    print(f"{torch.cuda.get_device_name(0)}: copy {copy_gbps('cuda'):.0f} GB/s", flush=True)
    one = torch.zeros(1, device="cuda")
    print(f"floor: one-element kernel {us(one.zero_):.2f} us (graph), {us(one.zero_, False):.2f} us (eager)")
    for ps, dt in [(p, d) for p in passes for d in dts]:
        dtype = torch.bfloat16 if dt == "bf16" else torch.float32
        for m, n in shapes:
            g = torch.Generator(device="cuda").manual_seed(n)
            x = torch.randn(m, n, device="cuda", dtype=dtype, generator=g) * 3
            x[0, 5] = 300.0
            if ps == "fwd":
                run, args = fs.softmax, (x,)
                check = lambda out, x=x: compare(out, x, -1, False)  # noqa: E731
                ref = lambda x=x: torch.softmax(x, -1)  # noqa: E731
            else:
                y = torch.softmax(x.float(), -1).to(dtype)
                dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=g)
                run, args = fs.softmax_backward, (dy, y)
                check = lambda out, dy=dy, y=y: compare_grad(out, dy, y, -1, False)  # noqa: E731
                ref = functools.partial(torch._softmax_backward_data, dy, y, -1, dtype)
            nbytes = (2 if ps == "fwd" else 3) * x.numel() * x.element_size()
            gb = functools.partial(lambda t, b: b / t / 1e3, b=nbytes)
            out0 = torch.empty_like(x)  # the same bytes moved by a copy (forward) or an add (backward)
            same = functools.partial(out0.copy_, x) if ps == "fwd" else functools.partial(torch.add, y, dy, out=out0)
            cols = [f"{'copy' if ps == 'fwd' else 'add'}={gb(us(same)):.0f}"]
            cols.append(f"torch={gb(us(ref)):.0f}")
            run(*args)
            cols.append(f"auto={gb(us(functools.partial(run, *args))):.0f}({heuristics.last_plan().backend}/"
                        f"{heuristics.last_plan().path})")  # fmt: skip
            cands = [("triton", "split", None), ("triton", "online", None), ("cuda", "cluster", None),
                     ("cuda", "online", None)] if "staged" not in sys.argv else []  # fmt: skip
            cands += [("cuda", "staged", (c, g)) for c in (1, 2, 4, 8, 16) for g in GROUPS]
            for backend, path, c in cands:
                _cluster, _group = c or (None, None)
                tag = f"{path}{_cluster}/{_group}" if _cluster else f"{backend[0]}.{path}"
                inputs = 1 if ps == "fwd" else 2
                if _cluster and inputs * -(-n * x.element_size() // (16 * _cluster)) * 16 > kernels.STAGE_MAX:
                    continue  # the slice would not fit
                cols.append(forced_cell(tag, path, backend, run, args, check, lambda fn, gb=gb: gb(us(fn))))
            _cluster = _group = None
            print(f"{ps} {dt} {m}x{n}: " + " ".join(cols), flush=True)


if __name__ == "__main__":
    main()
