"""The vocabulary-parallel run on several GPUs of one host (issue: softmax and cross-entropy on two H200s):
one process per GPU, NCCL. For vocabularies of 128K and 256K split evenly, bf16 and fp32, forward and
backward of fastsoftmax.distributed softmax / log_softmax / cross_entropy are checked against single-GPU
torch on the gathered logits, then timed: the whole step, and the collective alone, beside a
Megatron-style vocabulary-parallel cross-entropy written with torch ops (three all-reduces: max, sum of
exp, target logit). Bytes moved by the collective per row are printed.

Usage (device, e.g. nvidia-h200-x2):  python dev/dist_nccl.py [ROWS] [json=PATH] > $OUT/dist.txt
(bench/results/h200x2_dist.json: ROWS 1024; the float64 references of 4096 rows do not fit in 141 GB)
Smoke run on CPUs (gloo, small shapes):  python dev/dist_nccl.py cpu [json=PATH]
Keep NVLink multicast off (NCCL_NVLS_ENABLE=0), as the device README says.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

DEV = "cpu" if "cpu" in sys.argv[1:] else "cuda"
JSON = next((a[5:] for a in sys.argv[1:] if a.startswith("json=")), None)
# the errors one() measures, in its order
ERRORS = tuple(f"{f}_{o}" for f in ("softmax", "log_softmax") for o in ("y", "dx"))
ERRORS += ("cross_entropy_loss_rel", "cross_entropy_dlogits")


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


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def one(fsd, v, dtype, rank, world, rows):
    """Check and time one (vocabulary, dtype); returns the report line and its record (errors are the worst
    over ranks)."""
    g = torch.Generator(device=DEV).manual_seed(v)
    full = torch.randn(rows, v, device=DEV, dtype=dtype, generator=g) * 3
    t = torch.randint(0, v, (rows,), device=DEV, generator=g)
    dy_full = torch.randn(rows, v, device=DEV, dtype=dtype, generator=g)
    w = v // world
    lo, hi = rank * w, (rank + 1) * w
    shard, dy = full[:, lo:hi].contiguous(), dy_full[:, lo:hi].contiguous()
    x64 = full.double().requires_grad_()
    errs, torch_errs = [], []  # ours on the shards; torch in the same dtype on the whole logits (a yardstick)
    # correctness against single-GPU torch (float64) on the gathered logits: forward, then backward
    pairs = ((fsd.softmax, lambda z: torch.softmax(z, -1)), (fsd.log_softmax, lambda z: torch.log_softmax(z, -1)))
    for ours, ref in pairs:
        xs = shard.clone().requires_grad_()
        y = ours(xs)
        (dx,) = torch.autograd.grad(y, xs, dy)
        y64 = ref(x64)
        (dx64,) = torch.autograd.grad(y64, x64, dy_full.double())
        errs += [(y.double() - y64[:, lo:hi]).abs().max(), (dx.double() - dx64[:, lo:hi]).abs().max()]
        xt = full.clone().requires_grad_()
        yt = ref(xt)
        (dxt,) = torch.autograd.grad(yt, xt, dy_full)
        torch_errs += [(yt.double() - y64).abs().max(), (dxt.double() - dx64).abs().max()]
    xs = shard.clone().requires_grad_()
    loss = fsd.cross_entropy(xs, t)
    (dx,) = torch.autograd.grad(loss, xs)
    ref = F.cross_entropy(x64, t)
    (dref,) = torch.autograd.grad(ref, x64)
    errs += [(loss.double() - ref).abs() / ref.abs(), (dx.double() - dref[:, lo:hi]).abs().max()]
    xt = full.clone().requires_grad_()
    lt = F.cross_entropy(xt, t)
    (dxt,) = torch.autograd.grad(lt, xt)
    torch_errs += [(lt.double() - ref).abs() / ref.abs(), (dxt.double() - dref).abs().max()]
    errs = torch.stack([e.detach().double() for e in errs])
    dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    torch_errs = torch.stack([e.detach().double() for e in torch_errs])
    del x64, dref, xt, dxt
    # timing: steps, and the collectives alone (the same shapes as distributed.py sends)
    xs2 = shard.clone().requires_grad_()
    ce_fwd = timed(lambda: fsd.cross_entropy(shard, t))
    ce_step = timed(lambda: torch.autograd.grad(fsd.cross_entropy(xs2, t), xs2))
    soft = timed(lambda: fsd.softmax(shard))
    soft_step = timed(lambda: torch.autograd.grad(fsd.softmax(xs2), xs2, dy))
    ce_stats = torch.empty(rows + 1, 3, device=DEV)
    ce_gathered = [torch.empty_like(ce_stats) for _ in range(world)]
    ce_coll = timed(lambda: dist.all_gather(ce_gathered, ce_stats))
    lse = torch.empty(rows, device=DEV)
    lse_gathered = [torch.empty_like(lse) for _ in range(world)]
    soft_coll = timed(lambda: dist.all_gather(lse_gathered, lse))
    mega = timed(lambda: megatron_ce(shard, t, lo, None))
    m_red = torch.empty(rows, device=DEV)
    mega_coll = timed(lambda: [dist.all_reduce(m_red) for _ in range(3)])
    ring = 2 * (world - 1) / world  # bytes a ring all-reduce sends per byte reduced
    e = [f"{x:.1e} (torch {y:.1e})" for x, y in zip(errs.tolist(), torch_errs.tolist(), strict=True)]
    rec = {
        "V": v,
        "dtype": str(dtype)[6:],
        "rows": rows,
        "shard": w,
        "max_abs_error_vs_float64": {
            n: {"ours": float(f"{x:.2g}"), "torch_unsplit": float(f"{y:.2g}")}
            for n, x, y in zip(ERRORS, errs.tolist(), torch_errs.tolist(), strict=True)
        },
        "ms": {
            k: round(t, 3)
            for k, t in (
                ("ce_fwd", ce_fwd),
                ("ce_fwd_bwd", ce_step),
                ("softmax_fwd", soft),
                ("softmax_fwd_bwd", soft_step),
                ("ce_all_gather", ce_coll),
                ("softmax_all_gather", soft_coll),
                ("megatron_ce_fwd", mega),
                ("megatron_3_all_reduces", mega_coll),
            )
        },
    }
    return rec, (
        f"V={v} {str(dtype)[6:]:8} rows={rows} (shard {w}), max abs error vs float64, ours (torch's in this dtype, "
        f"unsplit): softmax y {e[0]} dx {e[1]}, "
        f"log_softmax y {e[2]} dx {e[3]}; cross_entropy rel.err {e[4]}, dlogits {e[5]}\n"
        f"    ours: ce fwd {ce_fwd:.3f} ms, ce fwd+bwd {ce_step:.3f} ms, softmax fwd {soft:.3f} ms, "
        f"softmax fwd+bwd {soft_step:.3f} ms; collectives alone: ce all-gather {ce_coll:.3f} ms "
        f"(sends 12 B/row, receives {12 * world} B/row), softmax all-gather {soft_coll:.3f} ms "
        f"(sends 4 B/row, receives {4 * world} B/row)\n"
        f"    Megatron (torch ops): ce fwd {mega:.3f} ms; its 3 all-reduces alone {mega_coll:.3f} ms "
        f"(3 x 4 B/row reduced, ring sends {3 * 4 * ring:.0f} B/row)"
    )


def worker(rank, world, rows, vocabs):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (device README)
    if DEV == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if DEV == "cuda" else "gloo"
    dist.init_process_group(backend, init_method="tcp://127.0.0.1:29517", rank=rank, world_size=world)
    import fastsoftmax.distributed as fsd

    out = [one(fsd, v, dtype, rank, world, rows) for v in vocabs for dtype in (torch.bfloat16, torch.float32)]
    if rank == 0:
        print("\n".join(text for _, text in out), flush=True)
        if JSON:
            name = torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"
            doc = {
                "device": f"{world} x {name}",
                "date": datetime.date.today().isoformat(),
                "torch": torch.__version__,
                "backend": backend,
                "world": world,
                "rows": rows,
                "method": "wall time per call, 3 warm-up then 20 calls back to back, synchronised; errors: max over "
                "ranks, against float64 torch on the gathered logits (cross_entropy_loss_rel: relative)",
                "collective_bytes_per_row": {
                    "ce_all_gather_sent": 12,
                    "softmax_all_gather_sent": 4,
                    "megatron_all_reduces": "3 x 4 (ring sends 12 per rank)",
                },
                "records": [rec for rec, _ in out],
            }
            with open(JSON, "w") as f:
                json.dump(doc, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    if DEV == "cuda":
        rows = next((int(a) for a in sys.argv[1:] if a.isdigit()), 4096)
        vocabs, world = (131072, 262144), torch.cuda.device_count()
        print(f"{world} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL", flush=True)
    else:  # a smoke run of this script on CPUs (gloo): small shapes
        rows, vocabs, world = 8, (1000, 4096), 2
        print(f"{world} CPU processes, torch {torch.__version__}, gloo", flush=True)
    mp.spawn(worker, args=(world, rows, vocabs), nprocs=world, join=True)
