"""The vocabulary-parallel run on several GPUs of one host (issue: softmax and cross-entropy on two H200s):
one process per GPU, NCCL. For vocabularies of 128K and 256K split evenly, bf16 and fp32, forward and
backward of fastsoftmax.distributed softmax / log_softmax / cross_entropy are checked against single-GPU
torch on the gathered logits, then timed: the whole step, and the collective alone, beside a
Megatron-style vocabulary-parallel cross-entropy written with torch ops (three all-reduces: max, sum of
exp, target logit). Bytes moved by the collective per row are printed.

Usage (device, e.g. nvidia-h200-x2):  python dev/dist_nccl.py [ROWS] > $OUT/dist.txt
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0), as the device README says.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def megatron_ce(x, t, offset, group):
    """Megatron-LM's vocab-parallel cross-entropy, forward only, with torch ops: three all-reduces."""
    m = x.float().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = x.float() - m[:, None]
    s = z.exp().sum(-1)
    local = t - offset
    own = (local >= 0) & (local < x.shape[-1])
    zt = torch.where(own, z.gather(-1, local.clamp(0, x.shape[-1] - 1)[:, None])[:, 0], 0.0)
    both = torch.stack([s, zt])
    dist.all_reduce(both[0], group=group)
    dist.all_reduce(both[1], group=group)
    return (both[0].log() - both[1]).mean()


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def one(fsd, v, dtype, rank, world, rows):
    """Check and time one (vocabulary, dtype); returns the report line."""
    g = torch.Generator(device="cuda").manual_seed(v)
    full = torch.randn(rows, v, device="cuda", dtype=dtype, generator=g) * 3
    t = torch.randint(0, v, (rows,), device="cuda", generator=g)
    w = v // world
    lo, hi = rank * w, (rank + 1) * w
    shard = full[:, lo:hi].contiguous()
    # correctness against single-GPU torch on the gathered logits
    xs = shard.clone().requires_grad_()
    loss = fsd.cross_entropy(xs, t)
    (dx,) = torch.autograd.grad(loss, xs)
    x64 = full.double().requires_grad_()
    ref = F.cross_entropy(x64, t)
    (dref,) = torch.autograd.grad(ref, x64)
    ce_err = abs(loss.double().item() - ref.item()) / ref.item()
    g_err = (dx.double() - dref[:, lo:hi]).abs().max().item()
    y = fsd.softmax(shard)
    y_err = (y.double() - torch.softmax(full.double(), -1)[:, lo:hi]).abs().max().item()
    # timing: step (forward + backward) and the collective alone
    xs2 = shard.clone().requires_grad_()
    step = timed(lambda: torch.autograd.grad(fsd.cross_entropy(xs2, t), xs2))
    stats = torch.empty(rows + 1, 3, device="cuda")
    gathered = [torch.empty_like(stats) for _ in range(world)]
    coll = timed(lambda: dist.all_gather(gathered, stats))
    soft = timed(lambda: fsd.softmax(shard))
    mega = timed(lambda: megatron_ce(shard, t, lo, None))
    m_red = torch.empty(rows, device="cuda")
    mega_coll = timed(lambda: [dist.all_reduce(m_red) for _ in range(3)])
    return (
        f"V={v} {str(dtype)[6:]:8} rows={rows}: ce rel.err {ce_err:.2e}, dlogits err {g_err:.2e}, "
        f"softmax err {y_err:.2e} | ce fwd+bwd {step:.3f} ms, softmax fwd {soft:.3f} ms, "
        f"all-gather {coll:.3f} ms ({3 * 4} bytes/row sent, {3 * 4 * world} received) | "
        f"Megatron fwd {mega:.3f} ms, its 3 all-reduces {mega_coll:.3f} ms (12 bytes/row)"
    )


def worker(rank, world, rows):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=world)
    import fastsoftmax.distributed as fsd

    out = [one(fsd, v, dtype, rank, world, rows) for v in (131072, 262144) for dtype in (torch.bfloat16, torch.float32)]
    if rank == 0:
        print("\n".join(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    world = torch.cuda.device_count()
    print(f"{world} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    mp.spawn(worker, args=(world, rows), nprocs=world, join=True)
