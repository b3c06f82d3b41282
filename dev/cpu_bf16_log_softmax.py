"""How far torch's own bf16 softmax and log_softmax on the CPU land from the exact result, beside fs's (computed in
fp32, rounded once: the library's convention for 16-bit inputs), at logit spreads 1 to 100, over 64 rows of 50257
against float64: the largest relative error in bf16 ulps (2^-8) over the outputs of magnitude at least 2^-8 for
log_softmax (nearer 0 an fp32 subtraction x - logsumexp cancels, for torch and fs alike) and of bf16's normal range
for softmax, and the largest absolute error. The reason the CPU path does not take torch's bf16 log_softmax kernel,
whatever it would save.
Usage: python dev/cpu_bf16_log_softmax.py OUT.json"""

import json
import sys
import time

import torch

import fastsoftmax as fs


def errors(y: torch.Tensor, ref: torch.Tensor, least: float) -> tuple[float, float]:
    """(the largest relative error in bf16 ulps where |ref| >= least, the largest absolute error)."""
    d = (y.double() - ref).abs()
    away = ref.abs() >= least
    return round(float((d[away] / ref.abs()[away]).max()) * 2**8, 2), float(d.max())


def main() -> int:
    g = torch.Generator().manual_seed(0)
    records = []
    for spread in (1, 3, 10, 30, 100):
        x = (torch.randn(64, 50257, generator=g) * spread).bfloat16()
        rec = {"spread": spread}
        for name, theirs, ours, ref, least in (
            ("log_softmax", torch.log_softmax, fs.log_softmax, torch.log_softmax, 2.0**-8),
            ("softmax", torch.softmax, fs.softmax, torch.softmax, 2.0**-126),
        ):
            want = ref(x.double(), -1)
            rec[f"torch_{name}_ulps"], rec[f"torch_{name}_abs"] = errors(theirs(x, -1), want, least)
            rec[f"fastsoftmax_{name}_ulps"], rec[f"fastsoftmax_{name}_abs"] = errors(ours(x, -1), want, least)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    doc = dict(what=__doc__.split("Usage")[0].strip(), torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
    doc["records"] = records
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
