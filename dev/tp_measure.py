"""dev/tp_bench.py's measurement, over the ranks of a process group: an implementation's step time (a barrier
and a device synchronise before each rep, then CUDA events around one call; on CPUs the wall clock), its peak
memory over one forward + backward, its errors against the reference implementation (the worst over the
ranks), and the records and ratios tp_bench.py writes. ``dev`` is "cuda" or "cpu" (gloo's smoke run)."""

import contextlib
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def barrier(dev):
    dist.barrier(device_ids=[torch.cuda.current_device()]) if dev == "cuda" else dist.barrier()


def rep(fn, active, dev):
    """ms of one call on this rank (0 where the rank takes no part), the ranks started together."""
    barrier(dev)
    sync(dev)
    if dev == "cpu":
        t0 = time.perf_counter()
        if active:
            fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    if active:
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def peak_bytes(fn, active, dev):
    """Peak allocated bytes above those allocated before, over one call (None on CPU or a passive rank)."""
    barrier(dev)
    if dev == "cpu" or not active:
        return None
    sync(dev)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(dev)
    return torch.cuda.max_memory_allocated() - base


def agree(fn):
    """fn() on every rank: (its value, the first failing rank's error or None), the same verdict on every rank,
    so that none goes on to a collective the others skip."""
    try:
        out, err = fn(), None
    except Exception as e:  # noqa: BLE001 (a failing implementation is recorded, not fatal)
        out, err = None, f"{type(e).__name__}: {e}"
        if os.environ.get("TP_BENCH_TRACE"):
            traceback.print_exc()
    first = next((e for e in gather(err) if e), None)
    return (None if first else out), first


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def worst(values):
    """The largest of the values present (over ranks); NaN if any is NaN; None if none is present."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return float("nan") if any(v != v for v in vals) else max(vals)


def local(t):
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    return t.full_tensor() if isinstance(t, DTensor) and t.dim() == 0 else t.to_local() if isinstance(t, DTensor) else t


def errors(res, ref, names):
    """{loss_rel, <name>: max abs error} of res = (loss, grads) against ref, on this rank's slices."""
    (loss, grads), (rloss, rgrads) = res, ref
    loss, rloss = local(loss).detach().double(), rloss.double()
    out = {"loss_rel": ((loss - rloss).abs() / rloss.abs()).item()}
    for name, g, r in zip(names, grads, rgrads, strict=True):
        out[name] = (local(g).double() - r.double()).abs().max().item() if r.numel() else 0.0
    return out


def step(loss_fn, wrt, context=contextlib.nullcontext):
    """run(inputs, backward): loss_fn(*inputs), and with backward its gradients to inputs[i] for i in wrt, all
    inside context() (loss_parallel wants its backward inside it too)."""

    def run(inputs, backward):
        with context():
            loss = loss_fn(*inputs)
            return (loss, torch.autograd.grad(loss, [inputs[i] for i in wrt])) if backward else loss

    return run


class Impl:
    """One implementation of a case: run(inputs, backward), the ranks it runs on, its inputs (forward: no
    gradient wanted; backward: leaves that want one)."""

    def __init__(self, run, active, fwd_inputs, bwd_inputs):
        self.run, self.active, self.fwd_inputs, self.bwd_inputs = run, active, fwd_inputs, bwd_inputs

    def call(self, backward):
        return lambda: self.run(self.bwd_inputs if backward else self.fwd_inputs, backward)


def check(impls, ref_name, names, slices):
    """Each implementation's fwd+bwd once against ref_name's; drops those that fail (on any rank). Returns
    ({name: errors, worst over ranks}, {name: error message})."""
    ref = impls[ref_name].call(True)()
    ref = (ref[0].detach(), [g.detach() for g in ref[1]])
    errs, skipped = {}, {}
    for name in [n for n in impls if n != ref_name]:
        impl = impls[name]
        res, err = agree(lambda impl=impl: impl.call(True)() if impl.active else None)
        if err:
            skipped[name] = err
            del impls[name]
            continue
        mine = None
        if impl.active:
            grads = [s(name, local(g)) for g, s in zip(res[1], slices, strict=True)]
            mine = errors((res[0], grads), ref, names)
        del res
        per = [e for e in gather(mine) if e is not None]
        errs[name] = {k: worst([e[k] for e in per]) for k in per[0]}
    return errs, skipped


def measure(impls, dev, warmup, reps):
    """Warm-up, then ``reps`` rounds, each implementation and pass once per round. Returns, for this rank,
    {name: {"fwd": median ms, "fwd_bwd": median ms, "peak": bytes}} (None where the rank takes no part)."""
    plans = [(name, backward) for name in impls for backward in (False, True)]
    for name, backward in plans:
        for _ in range(warmup):
            rep(impls[name].call(backward), impls[name].active, dev)
    times = {plan: [] for plan in plans}
    for _ in range(reps):
        for name, backward in plans:
            times[name, backward].append(rep(impls[name].call(backward), impls[name].active, dev))
    out = {}
    for name, impl in impls.items():
        out[name] = {
            "fwd": statistics.median(times[name, False]) if impl.active else None,
            "fwd_bwd": statistics.median(times[name, True]) if impl.active else None,
            "peak": peak_bytes(impl.call(True), impl.active, dev),
        }
    return out


def collect(impls, errs, times):
    """The case's per-implementation records from every rank's measure()."""
    recs = {}
    for name in impls:
        per = [r[name] for r in times]
        recs[name] = {
            "ms_fwd": worst([p["fwd"] for p in per]),
            "ms_fwd_bwd": worst([p["fwd_bwd"] for p in per]),
            "ms_fwd_per_rank": [p["fwd"] and round(p["fwd"], 4) for p in per],
            "ms_fwd_bwd_per_rank": [p["fwd_bwd"] and round(p["fwd_bwd"], 4) for p in per],
            "peak_bytes_fwd_bwd": worst([p["peak"] for p in per]),
            "errors_vs_reference": errs.get(name),
        }
    return recs


def ratios(recs, peers):
    """fastsoftmax's step time over each peer's, per pass."""
    fs = recs.get("fastsoftmax")
    out = {}
    for peer in peers:
        if fs is None or peer not in recs:
            continue
        out[peer] = {p: fs[f"ms_{p}"] / recs[peer][f"ms_{p}"] for p in ("fwd", "fwd_bwd")}
    return out
