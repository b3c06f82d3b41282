"""The cross-entropy backward against segments per row (the second grid axis of triton/cross_entropy.ce_bwd):
GPU time of the backward kernel alone, bf16 and fp32, each vocabulary at 1, 2, 4, 8, 16 chunks a segment and
one segment a row: the measurement behind heuristics/cross_entropy.BWD_SEGMENT_CHUNKS.
Usage: python dev/ce_segments.py OUT.json [MxV ...]"""

import json
import sys

import torch
import triton.testing

from fastsoftmax.core.options import Loss
from fastsoftmax.heuristics import cross_entropy as rules
from fastsoftmax.kernels.triton import cross_entropy as k

shapes = [tuple(int(s) for s in a.split("x")) for a in sys.argv[2:]] or [
    (1024, 256000),
    (2048, 151936),
    (4096, 128256),
    (16384, 128256),
    (4096, 50257),
    (8192, 32000),
]


def sweep(m: int, v: int, dtype: torch.dtype) -> list[dict]:
    x = torch.randn(m, v, device="cuda", dtype=dtype) * 3
    t = torch.randint(0, v, (m,), device="cuda")
    t[::7] = -100
    o = Loss()
    _, _, stats = k.forward(x, t, None, o, torch.float32, rules.launch_shape(v, x.element_size(), False))
    dx = torch.empty_like(x)
    g = torch.ones((), device="cuda")
    rows, block, warps, default = rules.launch_shape(v, x.element_size(), True)
    chunks = -(-v // block)
    ref, recs = None, []
    for splits in sorted({-(-chunks // per) for per in (chunks, 16, 8, 4, 2, 1)}):
        shape = (rows, block, warps, splits)
        k.backward(x, t, None, stats, g, o, dx, shape)
        if ref is None:
            ref = dx.clone()
        assert torch.equal(dx, ref), (m, v, dtype, splits)  # the same bytes, whatever the segments
        ms = triton.testing.do_bench(lambda shape=shape: k.backward(x, t, None, stats, g, o, dx, shape))
        rec = dict(M=m, V=v, dtype=str(dtype).split(".")[-1], chunks_per_segment=-(-chunks // splits), splits=splits)
        rec |= dict(default=splits == default, ms=ms, gbps=2 * x.numel() * x.element_size() / ms / 1e6)
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


out = []
for m, v in shapes:
    for dtype in (torch.bfloat16, torch.float32):
        out += sweep(m, v, dtype)
        torch.cuda.empty_cache()
doc = dict(
    what="cross-entropy backward kernel alone (ce_bwd: read logits, write dlogits; GB/s count that read + "
    "write), against segments per row",
    device=torch.cuda.get_device_name(),
    torch=torch.__version__,
    triton=triton.__version__,
    script="dev/ce_segments.py",
    method="triton.testing.do_bench median, L2 flushed; 1 in 7 targets ignored; upstream grad 1 (mean)",
    records=out,
)
with open(sys.argv[1], "w") as f:
    json.dump(doc, f, indent=1)
