"""What a small CPU call costs above torch's own kernel, piece by piece, in one process and one thread: for
fs.softmax and fs.softmax_backward of 1x4096 fp32 (both replayed: kernels/replay.py), torch's kernel alone,
the whole fs call, the replay's closure (the leaf: torch's kernel and the masked-row test), the route
(core/compose.route), the key (replay.softmax_key) and the dict lookup; and the floor of trimming Python
frames: the forward's whole replay (the checks dispatch.replayed makes, the route, the output dtype, the key,
the lookup and the closure) written out in one function (inline_us). The CPU counterpart of
dev/host_floor.py. Two rounds, each the best of 7 batches of 20000 calls.
Usage: taskset -c 1 python dev/cpu_floor.py OUT.json"""

import json
import platform
import subprocess
import sys
import time
import timeit

import torch
from torch.autograd import forward_ad as fwad

import fastsoftmax as fs
from fastsoftmax.core import compose
from fastsoftmax.kernels import replay


def t(f, n=20000) -> float:
    for _ in range(200):
        f()
    return min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6


def inline_forward(x, dim: int = -1, dtype=None, backend: str = "auto", log: bool = False):
    """fs.softmax's replay in one frame: every rule of dispatch.replayed, compose.route, compose.softmax_dtype
    and replay.softmax_key copied inline (a measurement only: the library keeps each in its one home)."""
    if type(x) is not Tensor or type(dim) is not int:
        return None
    nd = x.dim()
    if not -nd <= dim < nd:
        return None
    if compiling() or transforms() or fwad._current_level >= 0 or modes() or tracing() is not None:
        return None
    if x.is_meta or (x.requires_grad and grad()):
        return None
    p = x.data_ptr() & 15
    if p:
        p = (p, x.untyped_storage().data_ptr() & 15)
    out = dtype or (compose.softmax_dtype(x) if autocast() else x.dtype)
    r = lookup(((x.shape, x.stride(), x.dtype, x.is_neg(), p), x.get_device(), dim % nd, out, log, backend))
    return None if r is None else r(x)


Tensor, lookup, compiling, grad = torch.Tensor, replay.lookup, compose.compiling, torch.is_grad_enabled
transforms, modes, tracing, autocast = (compose.transforms_active, compose.dispatch_modes, compose.tracing,
                                        compose.any_autocast)  # fmt: skip


def main() -> int:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4096, generator=g)
    dy = torch.randn(1, 4096, generator=g)
    y = torch.softmax(x, -1)
    replay.clear()
    fs.softmax(x)
    fs.softmax_backward(dy, y)
    forward, backward = replay.entries()
    fkey = replay.softmax_key(x, None, 1, torch.float32, False, "auto")
    bkey = replay.softmax_key(y, dy, 1, torch.float32, False, "auto")
    assert replay.lookup(fkey) is forward and replay.lookup(bkey) is backward
    assert torch.equal(inline_forward(x), fs.softmax(x))  # (the inline copy finds the same replay)
    rounds = []
    for _ in range(2):
        r = {
            "softmax": {
                "torch_kernel_us": t(lambda: torch._softmax(x, -1, False)),
                "fs_us": t(lambda: fs.softmax(x)),
                "closure_us": t(lambda: forward(x)),
                "route_us": t(lambda: compose.route(x)),
                "key_us": t(lambda: replay.softmax_key(x, None, 1, torch.float32, False, "auto")),
                "lookup_us": t(lambda: replay.lookup(fkey)),
                "inline_us": t(lambda: inline_forward(x)),
            },
            "softmax_backward": {
                "torch_kernel_us": t(lambda: torch._softmax_backward_data(dy, y, -1, torch.float32)),
                "fs_us": t(lambda: fs.softmax_backward(dy, y)),
                "closure_us": t(lambda: backward(y, dy)),
                "route_us": t(lambda: compose.route(dy, y)),
                "key_us": t(lambda: replay.softmax_key(y, dy, 1, torch.float32, False, "auto")),
                "lookup_us": t(lambda: replay.lookup(bkey)),
            },
        }
        r = {call: {k: round(v, 3) for k, v in parts.items()} for call, parts in r.items()}
        print(json.dumps(r), flush=True)
        rounds.append(r)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = dict(what=__doc__.split("Usage")[0].strip(), torch=torch.__version__, python=platform.python_version())
    doc |= dict(date=time.strftime("%Y-%m-%d"), threads=torch.get_num_threads(), commit_measured=commit or None)
    doc["rounds"] = rounds
    with open(sys.argv[1], "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
