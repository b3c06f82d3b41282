"""What one lce_sliced tile costs the host, launch by launch (issue 40: is the sliced loss host-bound?). At a
tile of R rows x C classes with d features (bf16; default the 8192x4096x128256 plan at CCE's peak: 2048 x
4096, d 4096): the host's microseconds per call of each of the tile's launches, issued while the GPU is
still busy with a sleep queued before them (the host never waits on it), the median of 5 batches of 40
calls: the logits GEMM (torch.mm into the buffer), the loss kernels on the slice (ce_fwd's slice step,
ce_bwd's), the two gradient GEMMs (dW's rows: addmm beta 1 in bf16; dx's sums: addmm with out_dtype fp32,
beta 1; beside it the alternative of a bf16 part and an fp32 add, investigations/lce_dx_rounding.json's
bf16_parts_fp32), and lce_fused's dlogits_gemm; then a whole tile as ops/lm_head_sliced.sliced_sweep runs it.
Usage (GPU): python dev/lce_tile_host.py OUT.json [R C d]"""

import json
import statistics
import sys
import time

import torch

from fastsoftmax.core import options
from fastsoftmax.kernels.lm_head_steps import TritonSteps
from fastsoftmax.kernels.torch_loss import chunk_logits, tile_grads


def host_us(fn, batches: int = 5, calls: int = 40) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(batches):
        torch.cuda._sleep(200_000_000)  # (about 0.1 s of GPU time ahead of the calls)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def main(argv: list[str]) -> int:
    r, c, d = (int(a) for a in argv[1:4]) if len(argv) > 3 else (2048, 4096, 4096)
    v = 32 * c
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(r, d, device=dev, generator=g).to(dt)
    w = (torch.randn(c, d, device=dev, generator=g) * d**-0.5).to(dt)
    t = torch.randint(0, v, (r,), device=dev, generator=g)
    o = options.Loss(-100, "mean", 0.0, None, 0.0)
    k = TritonSteps(x, t, None, o, v)
    stats = torch.zeros(r + 3, device=dev)
    stats[r], stats[r + 2] = r, r
    rows_loss, rows_z, run = torch.empty(r, device=dev), torch.empty(r, device=dev), torch.empty(3 * r, device=dev)
    one = torch.ones((), device=dev)
    grp = k.group(0, r, stats, rows_loss, rows_z, run, one, r)
    loss_step, grads_step = k.slices(c, 2)
    buf = torch.empty(r, c, device=dev, dtype=dt)
    dw = torch.empty(c, d, device=dev, dtype=dt)
    acc = torch.zeros(r, d, device=dev)
    part = torch.empty(r, d, device=dev, dtype=dt)
    parts = {
        "logits_mm": lambda: chunk_logits(x, w, None, buf),
        "loss_step": lambda: loss_step(buf, c, v, grp),
        "grads_step": lambda: grads_step(buf, c, v, grp),
        "dw_addmm_bf16": lambda: tile_grads(buf, x, w, dw, None, None, add_dw=True, add_dx=True),
        "dx_addmm_fp32_out": lambda: tile_grads(buf, x, w, None, acc, None, add_dw=True, add_dx=True),
        "dx_mm_bf16_then_add": lambda: acc.add_(torch.mm(buf, w, out=part)),  # (bf16 parts, fp32 sums)
        "fused_dlogits_gemm": lambda: k.fused_grads(x, w, None, buf, c, v, grp),
    }

    def tile():  # (sliced_sweep's two sweeps on one tile)
        lg = buf[: r * c].view(r, c)
        chunk_logits(x, w, None, lg)
        loss_step(lg, c, v, grp)
        chunk_logits(x, w, None, lg)
        grads_step(lg, c, v, grp)
        tile_grads(lg, x, w, dw, acc, None, add_dw=True, add_dx=True)

    parts["whole_tile"] = tile
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tile": [r, c, d], "host_us": {}}
    for name, fn in parts.items():
        try:
            doc["host_us"][name] = round(host_us(fn), 2)
        except Exception as e:
            doc["host_us"][name] = f"{type(e).__name__}: {str(e)[:120]}"
        print(name, doc["host_us"][name], flush=True)
    with open(argv[0], "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
