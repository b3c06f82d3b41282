"""Which allocations are alive at the peak of one fs.linear_cross_entropy forward + backward (a probe)."""

import sys

import torch

import fastsoftmax as fs
from fastsoftmax import lm_head

n, d, v = (int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "8192x2048x32000").split("x"))
x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
w = (torch.randn(v, d, device="cuda") * d**-0.5).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")
ptrs = {}
orig = lm_head._scaled


def spy(ctx, g, *grads):
    out = orig(ctx, g, *grads)
    ptrs["saved"], ptrs["ret"] = [t.data_ptr() for t in grads], [t.data_ptr() for t in out]
    return out


lm_head._scaled = spy


def step():
    loss = fs.linear_cross_entropy(x, w, t)
    return torch.autograd.grad(loss, (x, w))


step()
torch.cuda.synchronize()
torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
base = torch.cuda.memory_allocated()
torch.cuda.reset_peak_memory_stats()
out = step()
torch.cuda.synchronize()
print("ptrs", ptrs, "returned", [o.data_ptr() for o in out])
print("peak above base GB", (torch.cuda.max_memory_allocated() - base) / 1e9, "dW+dx GB", (v * d + n * d) * 2 / 1e9)
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
live, cur, best, at = {}, 0, 0, None
for e in snap["device_traces"][0]:
    if e["action"] == "alloc":
        live[e["addr"]] = e
        cur += e["size"]
        if cur > best:
            best, at = cur, dict(live)
    elif e["action"] in ("free_requested",):
        if e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
print("peak of traced allocations GB", best / 1e9)
keys = ("autograd", "clone", "copy", "contiguous", "Engine", "validate", "ccumulate", "mul", "InputBuffer", ".py")
for e in sorted(at.values(), key=lambda e: -e["size"])[:4]:
    names = [f"{f['filename'].split('/')[-1]}:{f['line']} {f['name'][:90]}" for f in e["frames"]]
    print(f"{e['size'] / 1e6:10.1f} MB", " <- ".join(n for n in names if any(k in n for k in keys))[:1500])
