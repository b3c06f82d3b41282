"""The tensor-parallel loss on two GPUs (issue 21): fastsoftmax.distributed's cross-entropy on a shard of the
logits and its LM-head loss on a shard of W, beside the peers, one process per GPU over NCCL.

Cross-entropy on given logits, V = 128256 and 256000 split evenly, 4096 / 8192 / 16384 tokens, bf16, step time
forward and forward + backward (dlogits):
  fastsoftmax        fastsoftmax.distributed.cross_entropy(shard, t)
  megatron_torch     Megatron-LM's _VocabParallelCrossEntropy in torch ops (fp32 logits, 3 all-reduces: max,
                     target logit, sum of exp; saves the fp32 softmax, backward softmax - onehot), then .mean()
  liger              Liger-Kernel's LigerVocabParallelCEFunction (liger_kernel.transformers.
                     LigerVocabParallelCrossEntropy in 0.8.5; there is no function named
                     vocab_parallel_cross_entropy), [S, B, V_r] logits, per-token loss, then .mean()
  torch_loss_parallel  F.cross_entropy on DTensor.from_local(shard, mesh, [Shard(1)]) under
                     torch.distributed.tensor.parallel.loss_parallel()
  fastsoftmax_dtensor  fs.cross_entropy on the same DTensor (the API's DTensor path; outside the issue's targets)
  fastsoftmax_gathered fs.cross_entropy on the gathered (N, V) logits, rank 0 alone (built once, untimed)
LM head, V = 128256, d = 4096, the same tokens, bf16: fastsoftmax.distributed.linear_cross_entropy(x, W_r, t)
beside the unfused torch TP head (Megatron's ColumnParallelLinear: x through an identity whose backward
all-reduces dx, logits_r = x @ W_r^T, then megatron_torch's loss) and, on rank 0, fs.linear_cross_entropy with
the whole W; step times and peak memory per GPU above the inputs.

Method: CUDA events around one call, a barrier and a device synchronise before each rep (the ranks start
together, so a collective does not time a straggler), warm-up then the median of the reps, per rank; a
step's time is the slowest rank's median. The implementations of a case run interleaved, rep by rep, in the
same processes. Forward: inputs that need no gradient; forward + backward: torch.autograd.grad to the
logits (LM head: to x and W). Inputs are far larger than L2 (no flush). Errors of every implementation
against megatron_torch, once per case (max over ranks): loss relative error, dlogits (dx, dW) max abs error
(Megatron's loss is fp32; F.cross_entropy's and fastsoftmax's come in the logits' dtype: in bf16 the loss's
relative error is bf16's rounding, ~2e-3).
Peak: torch.cuda.max_memory_allocated over one forward + backward minus the allocated bytes before it (the
inputs, stated per case, are not counted; the outputs dlogits / dx, dW are). The targets (issue 21) are
evaluated here and written under "targets".

Device (nvidia-h200-x2), carrying .wheels/part-a (dev/peers.sh pack) for Liger:
  pip install --no-deps --target /tmp/site .wheels/part-a/liger_kernel-*.whl &&
    PYTHONPATH=/tmp/site:$PWD/src python dev/tp_bench.py json=$OUT/h200x2_tp.json | tee $OUT/h200x2_tp.txt
Options: tokens=4096,8192 vocabs=128256 reps=20 warmup=5 parts=ce,lm (subsets of the default run);
backend=auto|triton|torch (every fastsoftmax call; default auto); dtype=bfloat16|float32 (default: bf16,
on CPUs fp32).
CPU smoke run (gloo, 2 processes, tiny fp32 shapes):  python dev/tp_bench.py cpu [json=PATH]
In Triton's interpreter, with Liger and fastsoftmax's kernels (the paths the GPUs run):
  TRITON_INTERPRET=1 PYTHONPATH=<liger's --target dir> python dev/tp_bench.py cpu backend=triton
NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the device README says.
"""

import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tp_measure import Impl, check, collect, gather, measure, ratios, step  # (beside this script: sys.path[0])
from tp_report import document, environment, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this tree's fastsoftmax rather than an installed one, unless PYTHONPATH names one
if not any(
    os.path.isdir(os.path.join(p, "fastsoftmax")) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p
):
    sys.path.insert(0, os.path.join(ROOT, "src"))

ARGS = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
DEV = "cpu" if "cpu" in sys.argv[1:] else "cuda"
JSON = ARGS.get("json")
if DEV == "cuda":
    VOCABS = tuple(int(v) for v in ARGS.get("vocabs", "128256,256000").split(","))
    TOKENS = tuple(int(n) for n in ARGS.get("tokens", "4096,8192,16384").split(","))
    LM_VOCAB, LM_D, DTYPE = 128256, 4096, torch.bfloat16
    WARMUP, REPS = int(ARGS.get("warmup", 5)), int(ARGS.get("reps", 20))
else:  # the smoke run: every code path that runs without CUDA, tiny shapes
    VOCABS, TOKENS, LM_VOCAB, LM_D, DTYPE, WARMUP, REPS = (1000, 4096), (64,), 1000, 32, torch.float32, 1, 3
DTYPE = getattr(torch, ARGS["dtype"]) if "dtype" in ARGS else DTYPE
PARTS = ARGS.get("parts", "ce,lm").split(",")
KW = {"backend": ARGS["backend"]} if "backend" in ARGS else {}  # fastsoftmax's backend= (every fastsoftmax call)
METHOD = __doc__.split("Method: ", 1)[1].split("\n\nDevice")[0].replace("\n", " ")


class MegatronCE(torch.autograd.Function):
    """Megatron-LM's _VocabParallelCrossEntropy (megatron/core/tensor_parallel/cross_entropy.py, no label
    smoothing), op for op: the logits in fp32, in-place shift / exp / normalise, three all-reduces; per-token
    loss. The gradient goes back in the logits' dtype (Megatron's caller casts with .float(), whose backward
    does the same)."""

    @staticmethod
    def forward(ctx, logits, target, lo, group):
        x = logits.float()
        if x.data_ptr() == logits.data_ptr():  # fp32 logits: the in-place steps below would overwrite the input
            x = x.clone()
        logits_max = torch.max(x, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        x -= logits_max.unsqueeze(dim=-1)
        hi = lo + x.shape[-1]
        target_mask = (target < lo) | (target >= hi)
        masked_target = target.clone() - lo
        masked_target[target_mask] = 0
        x2 = x.view(-1, x.shape[-1])
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(x2.shape[0], device=x2.device)
        predicted = x2[arange_1d, masked_target_1d].clone().contiguous().view_as(target)
        predicted[target_mask] = 0.0
        torch.exp(x, out=x)
        sum_exp = x.sum(dim=-1)
        dist.all_reduce(predicted, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        loss = torch.log(sum_exp) - predicted
        x.div_(sum_exp.unsqueeze(dim=-1))
        ctx.save_for_backward(x, target_mask, masked_target_1d)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax  # in place, as Megatron
        grad_2d = grad_input.view(-1, grad_input.shape[-1])
        arange_1d = torch.arange(grad_2d.shape[0], device=grad_2d.device)
        grad_2d[arange_1d, masked_target_1d] -= 1.0 - target_mask.view(-1).float()
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input.to(ctx.dtype), None, None, None


class CopyToTP(torch.autograd.Function):
    """Megatron's _CopyToModelParallelRegion: identity forward, all-reduce of the gradient backward (the input
    of a ColumnParallelLinear is replicated; each rank's x.grad is one shard's part)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def liger_function():
    """Liger-Kernel 0.8.5's vocab-parallel cross-entropy: LigerVocabParallelCEFunction.apply(logits [S, B, V_r],
    target [S, B], tp_group, ignore_index, label_smoothing, formula, mode) -> per-token loss [S, B]
    (liger_kernel/ops/vocab_parallel_cross_entropy.py; the nn.Module is transformers.LigerVocabParallelCrossEntropy)."""
    try:
        from liger_kernel.ops.vocab_parallel_cross_entropy import LigerVocabParallelCEFunction  # noqa: PLC0415
    except ImportError as e:
        return None, f"not importable: {e}"
    return LigerVocabParallelCEFunction, None


def ce_case(fs, fsd, v, n, rank, world, mesh, liger):
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import loss_parallel  # noqa: PLC0415

    w = v // world
    lo = rank * w
    shard = torch.randn(n, w, device=DEV, dtype=DTYPE, generator=torch.Generator(DEV).manual_seed(v + n + rank)) * 2
    t = torch.randint(0, v, (n,), device=DEV, generator=torch.Generator(DEV).manual_seed(n))  # every rank's same
    parts = [torch.empty_like(shard) for _ in range(world)]
    dist.all_gather(parts, shard)
    full = torch.cat(parts, -1) if rank == 0 else None  # the gathered logits: rank 0's alone, untimed
    del parts
    xg = shard.detach().requires_grad_()
    world_group = dist.group.WORLD  # Liger runs single-GPU (no all-reduce) when given None

    def dt(x):
        return DTensor.from_local(x, mesh, [Shard(1)])

    impls = {
        "megatron_torch": step(lambda x: MegatronCE.apply(x, t, lo, None).mean(), [0]),
        "fastsoftmax": step(lambda x: fsd.cross_entropy(x, t, **KW), [0]),
        "torch_loss_parallel": step(lambda x: F.cross_entropy(dt(x), t), [0], loss_parallel),
        "fastsoftmax_dtensor": step(lambda x: fs.cross_entropy(dt(x), t, **KW), [0]),
    }
    skipped = {}
    if liger[0] is not None:
        fn = liger[0]
        impls["liger"] = step(
            lambda x: fn.apply(x.view(n, 1, w), t.view(n, 1), world_group, -100, 0.0, "pytorch", "global").mean(), [0]
        )
    else:
        skipped["liger"] = liger[1]
    impls = {name: Impl(run, True, [shard], [xg]) for name, run in impls.items()}
    if rank == 0:
        fg = full.detach().requires_grad_()
    impls["fastsoftmax_gathered"] = Impl(
        step(lambda x: fs.cross_entropy(x, t, **KW), [0]), rank == 0, [full], [fg if rank == 0 else None]
    )

    def own_slice(name, g):  # the gathered run's dlogits: this rank's columns
        return g[:, lo : lo + w] if name == "fastsoftmax_gathered" else g

    errs, failed = check(impls, "megatron_torch", ["dlogits_max_abs"], [own_slice])
    skipped.update(failed)
    recs = collect(impls, errs, gather(measure(impls, DEV, WARMUP, REPS)))
    return {
        "V": v,
        "shard": w,
        "tokens": n,
        "dtype": str(DTYPE)[6:],
        "input_bytes_per_rank": shard.nbytes + t.nbytes,
        "impls": recs,
        "fastsoftmax_over": ratios(recs, [p for p in recs if p != "fastsoftmax"]),
        "skipped": skipped,
    }


def lm_case(fs, fsd, n, rank, world, mesh):
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    v, d = LM_VOCAB, LM_D
    w = v // world
    lo = rank * w
    gen = torch.Generator(DEV).manual_seed(n)  # every rank's same x, W and targets
    x = torch.randn(n, d, device=DEV, dtype=DTYPE, generator=gen)
    w_full = torch.randn(v, d, device=DEV, dtype=DTYPE, generator=gen) * (2 / d**0.5)  # logits of std 2
    t = torch.randint(0, v, (n,), device=DEV, generator=gen)
    wr = w_full[lo : lo + w].contiguous()
    if rank != 0:
        w_full = None
    xg, wg = x.detach().requires_grad_(), wr.detach().requires_grad_()
    impls = {
        "torch_tp_unfused": step(
            lambda x, W: MegatronCE.apply(F.linear(CopyToTP.apply(x, None), W), t, lo, None).mean(), [0, 1]
        ),
        "fastsoftmax": step(lambda x, W: fsd.linear_cross_entropy(x, W, t, **KW), [0, 1]),
        "fastsoftmax_dtensor": step(
            lambda x, W: fs.linear_cross_entropy(x, DTensor.from_local(W, mesh, [Shard(0)]), t, **KW), [0, 1]
        ),
    }
    impls = {name: Impl(run, True, [x, wr], [xg, wg]) for name, run in impls.items()}
    wfg = w_full.detach().requires_grad_() if rank == 0 else None
    impls["fastsoftmax_single"] = Impl(
        step(lambda x, W: fs.linear_cross_entropy(x, W, t, **KW), [0, 1]), rank == 0, [x, w_full], [xg, wfg]
    )

    def own_rows(name, g):  # the whole W's gradient: this rank's rows
        return g[lo : lo + w] if name == "fastsoftmax_single" and g.shape[0] == v else g

    errs, skipped = check(impls, "torch_tp_unfused", ["dx_max_abs", "dW_max_abs"], [lambda name, g: g, own_rows])
    recs = collect(impls, errs, gather(measure(impls, DEV, WARMUP, REPS)))
    inputs = {"x": x.nbytes, "W_shard": wr.nbytes, "W_full_rank0": v * d * x.element_size(), "target": t.nbytes}
    return {
        "V": v,
        "d": d,
        "shard": w,
        "tokens": n,
        "dtype": str(DTYPE)[6:],
        "input_bytes": inputs,
        "impls": recs,
        "fastsoftmax_over": ratios(recs, [p for p in recs if p != "fastsoftmax"]),
        "skipped": skipped,
    }


def worker(rank, world, port):
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (device README)
    if DEV == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # two processes on a small machine: no oversubscription
    backend = "nccl" if DEV == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=5),  # a rank stuck in a collective ends the run instead of hanging it
    )
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    import fastsoftmax as fs  # noqa: PLC0415
    import fastsoftmax.distributed as fsd  # noqa: PLC0415

    mesh = init_device_mesh(DEV, (world,))
    if DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":  # on CPU tensors: Triton's interpreter
        liger = liger_function()
    else:
        liger = (None, "CPU run: Liger's kernels need CUDA (or TRITON_INTERPRET=1)")
    env = environment(fs, world, backend, DEV)
    ce, lm = [], []
    cases = [("cross_entropy", v, n) for v in VOCABS for n in TOKENS] if "ce" in PARTS else []
    cases += [("lm_head", LM_VOCAB, n) for n in TOKENS] if "lm" in PARTS else []
    for i, (part, v, n) in enumerate(cases):
        if part == "cross_entropy":
            ce.append(ce_case(fs, fsd, v, n, rank, world, mesh, liger))
        else:
            lm.append(lm_case(fs, fsd, n, rank, world, mesh))
        if DEV == "cuda":
            torch.cuda.empty_cache()
        if rank == 0:
            print(f"done: {part} V={v} tokens={n}", flush=True)
            doc = document(env, ce, lm, world, i == len(cases) - 1, method=METHOD, warmup=WARMUP, reps=REPS)
            if JSON:  # after every case: a run cut short keeps what it measured
                with open(JSON, "w") as f:
                    json.dump(doc, f, indent=1)
    if rank == 0 and cases:
        print(table(doc), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    if DEV == "cuda":
        world = torch.cuda.device_count()
        print(f"{world} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, NCCL", flush=True)
    else:
        world = 2
        print(f"{world} CPU processes, torch {torch.__version__}, gloo", flush=True)
    mp.spawn(worker, args=(world, free_port()), nprocs=world, join=True)
