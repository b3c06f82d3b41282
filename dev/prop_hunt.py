"""Hunt for a failing gradient on the device: test_properties' problem strategy with one forced Triton path
(online/split: block_n 16), many examples, each failure printed with its shape, strides, dim and dtypes
(the property test shows only the first). Usage: python dev/prop_hunt.py [online|split|rowblock] [N]"""

import sys

import torch
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, "tests")
import test_properties as tp  # noqa: E402

from fastsoftmax import heuristics  # noqa: E402
from fastsoftmax.api import forward  # noqa: E402
from fastsoftmax.reference import compare_grad  # noqa: E402

PATH = sys.argv[1] if len(sys.argv) > 1 else "online"  # or "auto": nothing forced
N = int(sys.argv[2]) if len(sys.argv) > 2 else 300
failures = []


@settings(max_examples=N, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(problem=tp.problems())
def hunt(problem):
    x, dim, _, log, out_dtype = problem
    x = x.to("cuda").requires_grad_()
    dy = torch.randn(x.shape).to(out_dtype or x.dtype).to("cuda")
    force = {} if PATH == "auto" else {"path": PATH, **({"block_n": 16} if PATH in ("online", "split") else {})}
    with heuristics.force(poison=True, **force):
        y = forward(x.detach(), dim, log=log, dtype=out_dtype, backend="triton")[0]
        (dx,) = torch.autograd.grad(tp.FNS[log](x, dim, dtype=out_dtype, backend="triton"), x, dy)
    err, text = compare_grad(dx, dy, y, dim, log, x.dtype)
    if text is not None:
        failures.append(text)
        print(f"FAIL {tuple(x.shape)} strides {x.stride()} dim {dim} log {log} {x.dtype} out {out_dtype}: {text}")
        if x.numel() <= 64:
            print("  x", x.detach().cpu().tolist(), "\n  dx", dx.cpu().tolist(), "\n  dy", dy.cpu().tolist())


hunt()
print(f"{PATH}: {len(failures)} failures")
