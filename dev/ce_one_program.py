"""The cross-entropy forward as one program (heuristics/cross_entropy.ONE_PROGRAM) against the two-launch
forward (rows, then ce_finish; forced with rows=1), on the shapes the rule sends to one program: GPU time
per call from a CUDA graph of CALLS calls (no host in it), and host time per eager call (best of ROUNDS
batches), both forwards interleaved, torch's F.cross_entropy beside them.

Usage: python dev/ce_one_program.py OUT.json [COMMIT]"""

import json
import sys
import time

import torch
import torch.nn.functional as F
from host_calls import host_us  # (dev/ is the script's path)

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.heuristics import cross_entropy as rules

CALLS, ROUNDS = 100, 15
SHAPES = ((1, 4096), (8, 4096), (16, 2048), (1, 32768), (4, 8192))


def graph_us(fn) -> float:
    """GPU time per call: CALLS calls captured in one CUDA graph, the best of ROUNDS replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    best = float("inf")
    for _ in range(ROUNDS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / CALLS)
    return best


def main() -> None:
    records = []
    for m, v in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, v, device="cuda", dtype=dtype)
            t = torch.randint(0, v, (m,), device="cuda")
            assert m <= rules.launch_shape(v, x.element_size(), False, m)[0], (m, v)

            def one(x=x, t=t):
                return fs.cross_entropy(x, t)

            def two(x=x, t=t):
                with heuristics.force(rows=1):
                    return fs.cross_entropy(x, t)

            def torchs(x=x, t=t):
                return F.cross_entropy(x, t)

            one()
            assert heuristics.last_plan().fused
            two()
            assert not heuristics.last_plan().fused or m == 1
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # (the two sum the rows in different orders)
            torch.testing.assert_close(one(), two(), rtol=tol, atol=tol)
            gpu = {k: graph_us(f) for k, f in (("one", one), ("two", two), ("torch", torchs))}
            host = {"one": [], "two": [], "torch": []}
            for _ in range(ROUNDS):
                for k, f in (("one", one), ("two", two), ("torch", torchs)):
                    host[k].append(host_us(f, CALLS))
            rec = dict(shape=f"{m}x{v}", dtype=str(dtype).split(".")[-1])
            rec |= {f"gpu_us_{k}": round(u, 2) for k, u in gpu.items()}
            rec |= {f"host_us_{k}": round(min(u), 2) for k, u in host.items()}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    doc = dict(
        what="cross-entropy forward (mean, no options): one program against rows + ce_finish (forced rows=1); "
        f"GPU us per call from a CUDA graph of {CALLS} calls (best of {ROUNDS}); host us per eager call "
        f"(best of {ROUNDS} batches of {CALLS}); torch's F.cross_entropy beside them. The two-launch column "
        "runs inside heuristics.force, which also turns off the replay: its host time is the full path's",
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        records=records,
    )
    if len(sys.argv) > 2:
        doc["commit_measured"] = sys.argv[2]
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
