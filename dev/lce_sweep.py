"""Chunk rows against time and peak memory for fs.linear_cross_entropy (bf16, fwd + bwd), per shape: the
measurement behind heuristics/lm_head.chunk_rows. Usage: python dev/lce_sweep.py OUT.json [NxdxV ...]"""

import json
import sys

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import lce as b

shapes = [tuple(int(s) for s in a.split("x")) for a in sys.argv[2:]] or b.LCE_SUITE
out = []
for shape in shapes:
    n, d, v = shape
    x, w, t = b.inputs(shape, torch.bfloat16, "cuda")
    floor = b.build("floor", x, w, 0)
    f_ms = b._time(lambda floor=floor, x=x, w=w, t=t: floor(x, w, t), "cuda")
    del floor
    torch.cuda.empty_cache()
    for rows in (128, 256, 512, 1024, 2048, 4096, 8192):
        if rows > n:
            continue
        mem = rows * v * 2

        def step(x=x, w=w, t=t, mem=mem):
            loss = fs.linear_cross_entropy(x, w, t, memory=mem)
            return torch.autograd.grad(loss, (x, w))

        step()
        plan = heuristics.last_plan()
        peak = b.peak_bytes(step, "cuda")
        ms = b._time(step, "cuda")
        rec = dict(
            N=n, d=d, V=v, rows=rows, splits=plan.splits, ms=ms, floor_ms=f_ms, vs_floor=ms / f_ms, peak_bytes=peak
        )
        print(json.dumps(rec), flush=True)
        out.append(rec)
        torch.cuda.empty_cache()
    del x, w, t
    torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
