"""Launch-shape sweep on the GPU for kernels whose shape comes from a fixed rule, each config checked
before timing (do_bench median, L2 flushed; GB/s counts the bytes the step must move):
  ce       the cross-entropy kernels (forward: logits read once; backward: read once, dlogits written once),
           BLOCK_N x num_warps, one row a program, over vocabularies of 32K-256K.
  masked   the masked rowblock forward on attention scores (8, 16, 2048) with a padding mask, causal and
           a scale (GB/s counts the mask bytes): rows per program x warps, bf16 and fp32.
  oddbwd   the backward rowblock at odd lengths past heuristics.BWD_LONG_N (the edge code: N not a multiple
           of the vector), where Triton 3.6 spills fp32 at 16 warps, beside an even length
  rowblock the Triton rowblock path (the row in registers, one read) at 16K-64K elements: warps per row
           (more warps: fewer values per thread, fewer registers), forward and backward, beside the path
           the rules pick.
Usage (device):  python3 dev/sweep_launch.py [ce] [masked] [rowblock] [oddbwd] > $OUT/sweep_launch.txt
"""

import sys

import torch
import torch.nn.functional as F
import triton

import fastsoftmax as fs
from fastsoftmax import heuristics, loss
from fastsoftmax.bench import ATTENTION, SCALE, copy_gbps, masked_inputs
from fastsoftmax.triton import cross_entropy as ce

CE_SHAPES = [(8192, 32000), (4096, 50257), (4096, 128256), (2048, 151936), (1024, 256000)]
CE_CONFIGS = [(2048, 4), (4096, 4)] + [(b, w) for b in (4096, 8192, 16384, 32768) for w in (8, 16) if b <= 2048 * w]


def bench(fn):
    return triton.testing.do_bench(fn, return_mode="median")


def ce_row(dt, m, v):
    g = torch.Generator(device="cuda").manual_seed(v)
    x = torch.randn(m, v, device="cuda", dtype=dt, generator=g) * 2
    t = torch.randint(0, v, (m,), device="cuda", generator=g)
    t[::7] = -100
    ref = F.cross_entropy(x[:16].double(), t[:16], reduction="none")
    gw = torch.tensor(1.0, device="cuda")  # a mean's upstream gradient
    nb = x.numel() * x.element_size()
    stats = [None]

    def fwd():
        shape = loss._launch(ce, v, x.element_size(), backward=False)
        out = ce.forward(x, t, -100, 0.0, "none", torch.float32, shape)
        stats[0] = out[1]
        return out

    def bwd():
        shape = loss._launch(ce, v, x.element_size(), backward=True)
        return ce.backward(x, t, stats[0], gw, -100, 0.0, True, torch.empty_like(x), shape)

    fwd()
    f_rule = f"{heuristics.last_plan().block_n}/{heuristics.last_plan().num_warps}"
    bwd()
    b_rule = f"{heuristics.last_plan().block_n}/{heuristics.last_plan().num_warps}"
    cells = [f"rule {f_rule}|{b_rule}: {nb / bench(fwd) / 1e6:.0f}|{2 * nb / bench(bwd) / 1e6:.0f}"]
    for block, warps in CE_CONFIGS:
        with heuristics.force(rows=1, block_n=block, num_warps=warps):
            if not torch.allclose(fwd()[0][:16].double(), ref, rtol=2e-2, atol=1e-3):
                cells.append(f"{block}/{warps}: WRONG")
                continue
            cells.append(f"{block}/{warps}: {nb / bench(fwd) / 1e6:.0f}|{2 * nb / bench(bwd) / 1e6:.0f}")
    print(f"ce {str(dt)[6:]:8} {m}x{v} (fwd|bwd GB/s per BLOCK_N/warps): " + "  ".join(cells), flush=True)


def masked_row(dt):
    b, h, s = ATTENTION
    x, pad = masked_inputs(ATTENTION, dt, "cuda", pad=True)
    nb = 2 * x.numel() * x.element_size() + pad.numel()

    def run():
        return fs.softmax(x, mask=pad, scale=SCALE, causal=True, backend="triton")

    ref = run().float()
    plan = heuristics.last_plan()
    cells = [f"rule {plan.path} rows={plan.rows} warps={plan.num_warps}: {nb / bench(run) / 1e6:.0f}"]
    for rows in (1, 2, 4):
        for warps in (1, 2, 4, 8):
            with heuristics.force(path="rowblock", rows=rows, num_warps=warps):
                if not torch.allclose(run().float(), ref, rtol=1e-2, atol=1e-5):
                    cells.append(f"{rows}/{warps}: DIFFERS")
                    continue
                cells.append(f"{rows}/{warps}: {nb / bench(run) / 1e6:.0f}")
    print(f"masked causal+padding fwd {str(dt)[6:]:8} ({b},{h},{s},{s}); rows/warps GB/s: " + "  ".join(cells),
          flush=True)  # fmt: skip


ROWBLOCK = {  # pass, dtype -> suite shapes
    ("fwd", torch.bfloat16): [(8192, 16384), (4096, 32000), (4096, 32768), (8192, 50257), (2048, 65536)],
    ("fwd", torch.float32): [(4096, 32768), (8192, 50257), (2048, 65536)],
    ("bwd", torch.bfloat16): [(8192, 16384), (4096, 32000), (4096, 32768)],
    ("bwd", torch.float32): [(8192, 16384), (4096, 32768)],
}
ODD_BWD = [(4096, 16385), (3276, 20481), (2730, 24577), (2048, 32001), (2048, 32767), (2048, 32768)]


def rowblock_row(pass_, dt, m, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(m, n, device="cuda", dtype=dt, generator=g) * 3
    y = torch.softmax(x.float(), -1).to(dt)
    dy = torch.randn(m, n, device="cuda", dtype=dt, generator=g)
    nb = (2 if pass_ == "fwd" else 3) * x.numel() * x.element_size()

    def run():
        if pass_ == "fwd":
            return fs.softmax(x, backend="triton")
        return fs.softmax_backward(dy, y, backend="triton")

    ref = run().float()
    d = heuristics.last_plan()
    cells = [f"rule {d.path}/{d.num_warps}w: {nb / bench(run) / 1e6:.0f}"]
    for warps in (8, 16, 32):
        with heuristics.force(path="rowblock", rows=1, num_warps=warps):
            if not torch.allclose(run().float(), ref, rtol=1e-2, atol=1e-5):
                cells.append(f"rowblock/{warps}w: DIFFERS")
                continue
            cells.append(f"rowblock/{warps}w: {nb / bench(run) / 1e6:.0f}")
    print(f"rowblock {pass_} {str(dt)[6:]:8} {m}x{n} GB/s: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    copy = copy_gbps("cuda")
    print(f"{torch.cuda.get_device_name(0)}: copy {copy:.0f} GB/s, torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    which = sys.argv[1:] or ["ce", "masked", "rowblock"]
    for dt in (torch.bfloat16, torch.float32):
        if "ce" in which:
            for m, v in CE_SHAPES:
                ce_row(dt, m, v)
        if "masked" in which:
            masked_row(dt)
        if "rowblock" in which:
            for pass_ in ("fwd", "bwd"):
                for m, n in ROWBLOCK[pass_, dt]:
                    rowblock_row(pass_, dt, m, n)
        if "oddbwd" in which:
            for m, n in ODD_BWD:
                rowblock_row("bwd", dt, m, n)
