"""Why lce_sliced sums dx in fp32 (bench/results/investigations/lce_dx_rounding.json): the LM-head loss's dx
summed over k vocabulary slices, each slice's dl @ W_s added into a bf16 dx (one rounding a slice, as
cuBLAS beta = 1 on a bf16 output), into fp32 sums rounded once, or rounded to bf16 a slice (a bf16 GEMM's
output) then summed in fp32 (bf16_parts_fp32), against a float64 reference; torch's own
error (bf16 logits and dlogits, one GEMM) beside. CPU, float64 arithmetic with bf16 roundings where the
GPU rounds; N 512, d 1024, V 32768, logits of unit spread, seed 0.

    python dev/lce_dx_rounding.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

N, D, V = 512, 1024, 32768
SLICES = (1, 4, 16, 38, 64, 133, 256)


def main() -> int:
    torch.manual_seed(0)
    x = torch.randn(N, D, dtype=torch.float64).bfloat16().double()
    w = (torch.randn(V, D, dtype=torch.float64) / D**0.5).bfloat16().double()
    t = torch.randint(0, V, (N,))
    rows = torch.arange(N)

    def dlogits(logits, lse, v0=0):
        p = torch.exp(logits - lse[:, None])
        inside = (t >= v0) & (t < v0 + logits.shape[1])
        p[rows[inside], t[inside] - v0] -= 1
        return p / N

    exact = x @ w.T
    lse = torch.logsumexp(exact, -1)
    ref = dlogits(exact, lse) @ w

    def rel(a):
        return ((a.double() - ref).norm() / ref.norm()).item()

    logits16 = exact.bfloat16().double()  # torch: logits in bf16, the loss in fp32, dl in bf16, one GEMM
    torch_err = rel((dlogits(logits16, torch.logsumexp(logits16, -1)).bfloat16().double() @ w).bfloat16())
    records = []
    for k in SLICES:
        cols = -(-V // k)
        low, wide = torch.zeros(N, D, dtype=torch.bfloat16), torch.zeros(N, D, dtype=torch.float64)
        parts = torch.zeros(N, D, dtype=torch.float64)
        for v0 in range(0, V, cols):
            logits = exact[:, v0 : v0 + cols].bfloat16().double()  # (bf16 logits, as the GEMM writes them)
            part = dlogits(logits, lse, v0).bfloat16().double() @ w[v0 : v0 + cols]
            low = (low.double() + part).bfloat16()  # bf16 dx, rounded once a slice
            wide = (wide + part).float().double()  # fp32 sums
            parts = (parts + part.bfloat16().double()).float().double()  # each slice's part rounded, fp32 sums
        for sums, dx in (("bf16", low), ("fp32", wide.bfloat16()), ("bf16_parts_fp32", parts.bfloat16())):
            err = rel(dx)
            records.append(dict(slices=k, sums=sums, dx_err=err, vs_torch=err / torch_err))
            print(json.dumps(records[-1]), flush=True)
    doc = dict(
        what="dx of the LM-head loss summed over k vocabulary slices in bf16 (rounded a slice), in fp32 sums "
        "(rounded once), or each slice's part rounded to bf16 and summed in fp32 (bf16_parts_fp32): relative "
        "error against float64, and over torch's own (bf16 logits, one GEMM)",
        shape=dict(N=N, d=D, V=V),
        torch_dx_err=torch_err,
        date=time.strftime("%Y-%m-%d"),
        software=f"torch {torch.__version__}, CPU",
        command="python dev/lce_dx_rounding.py OUT.json",
        records=records,
    )
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
