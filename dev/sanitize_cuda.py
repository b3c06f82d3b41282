"""Every CUDA variant, forward (softmax, log_softmax, with logsumexp) and backward, on small odd shapes with
unaligned rows, for compute-sanitizer: `compute-sanitizer --tool {memcheck,racecheck,synccheck}
--error-exitcode 1 python dev/sanitize_cuda.py [small] [synccheck]` (memcheck with --report-api-errors no:
cuda-bindings probes driver entry points newer than the driver, which memcheck reports as API errors).
`synccheck`: the staged variant's clusters capped at 8 CTAs (synccheck itself faults kernels with mbarriers in
16-CTA clusters: docs/investigations.md, bench/results/sweeps/staged_cluster16_synccheck.json)."""

import sys

import torch

import fastsoftmax as fs
from fastsoftmax import dispatch, heuristics
from fastsoftmax.heuristics import softmax_cuda

CASES = {
    "three_pass": [1, 513, 4099],
    "warp": [7, 513, 1000],
    "block": [4099, 12289],
    "cluster": [513, 12289, 50257],
    "online": [7, 4099, 50257],
    "staged": [513, 12289, 131072],  # 1, 4 and 16 CTAs (9 rows spread) per row (synccheck: 8)
}


def main():
    runs = 0
    small = "small" in sys.argv  # one length per variant (racecheck is slow)
    cap = 8 if "synccheck" in sys.argv else None
    if cap:
        softmax_cuda.STAGE_CLUSTER_MAX = cap  # read at each launch; the plans below must show it held
    limit = softmax_cuda.STAGE_CLUSTER_MAX
    for variant, ns in CASES.items():
        for n in ns[1:2] if small else ns:
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(9, n + 3, device="cuda", dtype=dtype)[:, 3:]  # rows off 16-byte boundaries
                x[0] = float("-inf")
                with heuristics.force(path=variant):
                    for log in (False, True):
                        fn = "log_softmax" if log else "softmax"
                        y, lse = dispatch.softmax(x, 1, log, dtype, "cuda", want_lse=True, fn=fn)
                        plan = heuristics.last_plan()
                        assert plan.path == variant and (variant != "staged" or plan.splits <= limit), plan
                        bwd = fs.log_softmax_backward if log else fs.softmax_backward
                        dx = bwd(torch.randn_like(y), y, backend="cuda")
                        runs += 2
    torch.cuda.synchronize()
    assert not dx.isnan().all()
    print(f"sanitize_cuda: {runs} launches over {len(CASES)} variants ok")


if __name__ == "__main__":
    main()
