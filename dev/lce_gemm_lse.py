"""Issue 40's go/no-go for lce_fused: does the LM-head loss's fused forward (triton/lm_head.py: lse_gemm, a
GEMM with an online-logsumexp epilogue, then lse_merge) run at cuBLAS's rate? Per shape N x d x V (bf16),
the time of cuBLAS's x @ W^T (torch.mm into a preallocated (N, V) buffer: the GEMM alone, no loss) beside
the fused forward's at its rule's launch shape (heuristics/lm_head.fused_shape) and at other tiles, waves
and stages (FUSED_TILE, FUSED_WAVES, FUSED_STAGES patched), and the loss's logsumexp against fp32
torch.logsumexp of the bf16 logits. A measurement only.
Usage: python dev/lce_gemm_lse.py OUT.json [NxdxV ...]  (GPU; --cpu: a small fp32 case in Triton's
interpreter, TRITON_INTERPRET=1, to check the script)."""

import json
import sys

import torch

from fastsoftmax.core import options
from fastsoftmax.heuristics import lm_head as rules
from fastsoftmax.kernels.triton import lm_head

VARIANTS = [  # (BM, BN, BK, warps, stages, waves); None: the rule's own
    None,
    (128, 128, 64, 8, 4, 2),
    (128, 128, 64, 8, 3, 1),
    (128, 256, 64, 8, 3, 2),
    (64, 128, 64, 4, 4, 2),
]


def fused_lse(x, w, t, o, variant):
    n = x.shape[0]
    saved = rules.FUSED_TILE.copy(), rules.FUSED_WARPS, rules.FUSED_STAGES, rules.FUSED_WAVES
    if variant is not None:
        bm, bn, bk, warps, stages, waves = variant
        rules.FUSED_TILE[x.element_size()] = (bm, bn, bk)
        rules.FUSED_WARPS, rules.FUSED_STAGES, rules.FUSED_WAVES = warps, stages, waves
    try:
        rows_loss = torch.empty(n, device=x.device)
        lse = torch.empty(n, device=x.device)
        lm_head.loss_forward(x, w, None, t, None, o, rows_loss, rows_loss, lse)
    finally:
        rules.FUSED_TILE.clear()
        rules.FUSED_TILE.update(saved[0])
        rules.FUSED_WARPS, rules.FUSED_STAGES, rules.FUSED_WAVES = saved[1:]
    return lse


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv
    rest = [a for a in argv[1:] if a != "--cpu"]
    out_path = argv[0]
    if cpu:
        shapes, dev, dt, variants = [(40, 48, 300)], "cpu", torch.float32, [None]
    else:
        shapes = [tuple(int(s) for s in a.split("x")) for a in rest] or [
            (8192, 4096, 128256),
            (16384, 2304, 256000),
            (8192, 2048, 32000),
        ]
        dev, dt, variants = "cuda", torch.bfloat16, VARIANTS
    o = options.Loss(-100, "mean", 0.0, None, 0.0)
    doc = {"device": torch.cuda.get_device_name() if not cpu else "cpu", "records": []}
    for n, d, v in shapes:
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(n, d, device=dev, generator=g).to(dt)
        w = (torch.randn(v, d, device=dev, generator=g) * d**-0.5).to(dt)
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        ref = torch.logsumexp((x @ w.t()).double() if cpu else (x @ w.t()).float(), 1)
        rec = {"shape": [n, d, v], "variants": []}
        flops = 2 * n * d * v
        if not cpu:
            import triton.testing

            buf = torch.empty(n, v, device=dev, dtype=dt)
            ms = triton.testing.do_bench(lambda x=x, w=w, buf=buf: torch.mm(x, w.t(), out=buf), warmup=50, rep=300)
            rec["cublas_mm_ms"], rec["cublas_tflops"] = ms, flops / ms / 1e9
            del buf
            print(n, d, v, f"cuBLAS mm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOPS", flush=True)
        for variant in variants:
            try:
                got = fused_lse(x, w, t, o, variant)
                r = {"variant": variant}
                r["max_abs_err"] = (got.double() - ref.double()).abs().max().item()
                if not cpu:
                    ms = triton.testing.do_bench(
                        lambda variant=variant, x=x, w=w, t=t: fused_lse(x, w, t, o, variant), warmup=50, rep=300
                    )
                    r |= {"ms": ms, "tflops": flops / ms / 1e9, "vs_cublas": ms / rec["cublas_mm_ms"]}
            except Exception as e:
                r = {"variant": variant, "error": f"{type(e).__name__}: {str(e)[:160]}"}
            rec["variants"].append(r)
            keys = ("variant", "ms", "tflops", "vs_cublas", "max_abs_err", "error")
            print("  ", json.dumps({k: r.get(k) for k in keys}), flush=True)
        doc["records"].append(rec)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
