"""Rows off 16-byte boundaries (N = 513, ...) on the rowblock path: the tile sized to the row's aligned body
(heuristics/softmax_triton.launch_shape with the launch's vector width: 512 for N = 513) against the tile
sized to N (the rule before: 1024, half its lanes idle), forward and backward, beside a copy of the same
bytes, in one process. GPU time: triton.testing.do_bench's median with L2 flushed; both shapes forced
(heuristics.force), interleaved, best of ROUNDS medians.

Usage: python dev/edge_body.py OUT.json [COMMIT]"""

import json
import sys

import torch
import triton
from triton.testing import do_bench

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.core.reference import compare, compare_grad
from fastsoftmax.heuristics import softmax_triton as rules

ROUNDS = 3
SHAPES = ((262144, 513), (131072, 1025), (65536, 2049), (16384, 8193))
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def measure(m: int, n: int, dtype: torch.dtype, pass_: str, sms: int) -> dict:
    """One shape, dtype and pass: the two tiles' and the copy's best medians, outputs checked equal."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    dy = torch.randn(m, n, device="cuda", dtype=dtype, generator=gen)
    y = fs.softmax(x)
    inputs = 1 if pass_ == "fwd" else 2
    vec = 16 // x.element_size()
    new = rules.launch_shape(n, m, x.element_size(), False, sms, "rowblock", inputs, vec)
    old = rules.launch_shape(n, m, x.element_size(), False, sms, "rowblock", inputs)  # the tile of N
    src = torch.empty(inputs * m * n, dtype=dtype, device="cuda")
    dst = torch.empty(m * n, dtype=dtype, device="cuda")

    def call(shape):
        force = dict(path="rowblock", block_n=shape.block_n, rows=shape.rows, num_warps=shape.num_warps)
        with heuristics.force(**force):
            return fs.softmax(x, backend="triton") if pass_ == "fwd" else fs.softmax_backward(dy, y, backend="triton")

    def copy():  # the same bytes: one read and one write (forward), two reads and one write (backward)
        return dst.copy_(src) if inputs == 1 else torch.add(src[: m * n], src[m * n :], out=dst)

    for shape in (new, old):  # both right against the float64 oracle (sums differ in order: not bitwise)
        got = call(shape)
        problem = compare(got, x, -1, False)[1] if pass_ == "fwd" else compare_grad(got, dy, y, -1, False)[1]
        assert problem is None, (shape, problem)
    fns = {"new": lambda: call(new), "old": lambda: call(old), "copy": copy}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(ROUNDS):
        for k, fn in fns.items():
            best[k] = min(best[k], ms(fn))
    moved = (inputs + 1) * m * n * x.element_size()
    return dict(
        shape=f"{m}x{n}",
        dtype=DTYPES[dtype],
        pass_=pass_,
        new=new._asdict(),
        old=old._asdict(),
        **{f"{k}_ms": v for k, v in best.items()},
        **{f"{k}_gbps": moved / v / 1e6 for k, v in best.items()},
        new_vs_copy=best["copy"] / best["new"],
        old_vs_copy=best["copy"] / best["old"],
    )


def main() -> int:
    out, records = sys.argv[1], []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n in SHAPES:
        for dtype in DTYPES:
            for pass_ in ("fwd", "bwd"):
                records.append(measure(m, n, dtype, pass_, sms))
                print(json.dumps(records[-1]), flush=True)
    doc = dict(
        what=__doc__.split("\n\n")[0],
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        records=records,
    )
    if len(sys.argv) > 2:
        doc["commit_measured"] = sys.argv[2]
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
