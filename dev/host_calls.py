"""Host time per eager call on a GPU, fastsoftmax beside torch in one process: wall time with the GPU kept
ahead of the host, the best of ROUNDS batches of CALLS calls, ours and torch's interleaved batch by batch
(30 rounds: the best of 9 moved by up to 1.5x between runs on the H200's host, for both sides alike).
Calls: softmax, log_softmax, softmax_backward, log_softmax_backward, cross_entropy, cross_entropy_fwd_bwd
and softmax_fwd_bwd (autograd), on 1x4096 and 8x4096, fp32 and bf16.

Records go to OUT.json as {"call": "softmax 1x4096 fp32", "triton": ..., "fastsoftmax_us", "torch_us",
"ratio"}, merged with the file's records of other Triton versions (run it once per Triton:
bench/results/h200_host.json holds the image's and the newest). COMMIT, where given, is recorded as the
tree measured (a copy of the working tree may carry a stale .git); else the file's is dropped.
Usage: python dev/host_calls.py OUT.json [COMMIT]"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

import fastsoftmax as fs

CALLS, ROUNDS = 200, 30
SHAPES = ((1, 4096), (8, 4096))
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def host_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    wall = time.perf_counter() - t
    torch.cuda.synchronize()
    return wall / calls * 1e6


def paired_us(ours, theirs) -> tuple[float, float]:
    a, b = [], []
    for _ in range(ROUNDS):
        a.append(host_us(ours, CALLS))
        b.append(host_us(theirs, CALLS))
    return min(a), min(b)


def cases(m: int, v: int, dtype: torch.dtype) -> dict:
    x = torch.randn(m, v, device="cuda", dtype=dtype)
    t = torch.randint(0, v, (m,), device="cuda")
    xg = x.clone().requires_grad_()
    y, ly = torch.softmax(x, -1), torch.log_softmax(x, -1)
    dy = torch.randn_like(y)
    return {
        "softmax": (lambda: fs.softmax(x, -1), lambda: torch.softmax(x, -1)),
        "log_softmax": (lambda: fs.log_softmax(x, -1), lambda: torch.log_softmax(x, -1)),
        "softmax_backward": (
            lambda: fs.softmax_backward(dy, y, -1),
            lambda: torch._softmax_backward_data(dy, y, -1, dtype),
        ),
        "log_softmax_backward": (
            lambda: fs.log_softmax_backward(dy, ly, -1),
            lambda: torch._log_softmax_backward_data(dy, ly, -1, dtype),
        ),
        "cross_entropy": (lambda: fs.cross_entropy(x, t), lambda: F.cross_entropy(x, t)),
        "cross_entropy_fwd_bwd": (
            lambda: torch.autograd.grad(fs.cross_entropy(xg, t), xg),
            lambda: torch.autograd.grad(F.cross_entropy(xg, t), xg),
        ),
        "softmax_fwd_bwd": (
            lambda: torch.autograd.grad(fs.softmax(xg, -1), xg, dy),
            lambda: torch.autograd.grad(torch.softmax(xg, -1), xg, dy),
        ),
    }


def main() -> None:
    out = sys.argv[1]
    print("launch:", fs.info()["replay"], "| triton", triton.__version__, triton.__file__, flush=True)
    records = []
    for m, v in SHAPES:
        for dtype in NAMES:
            for name, (ours, theirs) in cases(m, v, dtype).items():
                mine, torchs = paired_us(ours, theirs)
                rec = dict(call=f"{name} {m}x{v} {NAMES[dtype]}", triton=triton.__version__)
                rec |= dict(fastsoftmax_us=round(mine, 2), torch_us=round(torchs, 2), ratio=round(mine / torchs, 3))
                print(json.dumps(rec), flush=True)
                records.append(rec)
    doc = {"records": []}
    if os.path.exists(out):
        with open(out) as f:
            doc = json.load(f)
    kept = [r for r in doc["records"] if r.get("triton") != triton.__version__]
    doc |= dict(what=f"host us per eager call, best of {ROUNDS} batches of {CALLS} calls, ours and torch's interleaved")
    doc |= dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    doc["records"] = kept + records
    doc.pop("commit_measured", None)
    if len(sys.argv) > 2:
        doc["commit_measured"] = sys.argv[2]
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
