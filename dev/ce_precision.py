"""How far cross-entropy's loss and gradient land from float64 as fp32 logits move away from 0, fs beside
torch: fs.cross_entropy (backend torch and triton: Triton's interpreter on the CPU) and F.cross_entropy on
64 x 513 rows of spread 3 around each offset, random targets; the loss's relative error and the gradient's
largest error relative to its largest entry (docs/semantics.md, cross-entropy's precision).
Usage (CPU): TRITON_INTERPRET=1 python dev/ce_precision.py OUT.json"""

import json
import sys

import torch
import torch.nn.functional as F

import fastsoftmax as fs

OFFSETS = (0.0, 30.0, 1e3, 1e4)


def errors(fn, x, t, ref_loss, ref_grad) -> tuple[float, float]:
    xg = x.clone().requires_grad_()
    loss = fn(xg, t)
    loss.backward()
    grad = (xg.grad.double() - ref_grad).abs().max() / ref_grad.abs().max()
    return abs(loss.item() - ref_loss) / abs(ref_loss), grad.item()


def main(out: str) -> None:
    torch.manual_seed(0)
    records = []
    for off in OFFSETS:
        x = torch.randn(64, 513) * 3 + off
        t = torch.randint(0, 513, (64,))
        x64 = x.double().requires_grad_()
        ref = F.cross_entropy(x64, t)
        ref.backward()
        impls = {"torch_F": F.cross_entropy}
        for b in ("torch", "triton"):
            impls[f"fastsoftmax_{b}"] = lambda a, t_, b=b: fs.cross_entropy(a, t_, backend=b)
        for name, fn in impls.items():
            loss_err, grad_err = errors(fn, x, t, ref.item(), x64.grad)
            rec = dict(impl=name, offset=off, loss_err=loss_err, grad_err=grad_err)
            print(json.dumps(rec))
            records.append(rec)
    doc = dict(what=__doc__.split("\n\n")[0].replace("\n", " "), torch=torch.__version__, records=records)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
