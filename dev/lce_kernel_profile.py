"""Where the LM-head loss's GPU time goes at CCE's memory (issue 40): per shape, the three-GEMM floor, then
fs.linear_cross_entropy forward + backward to dx and dW at a small budget (fastsoftmax_mem), the same with
the fused forward forced (lce_fused), with skip_eps (fastsoftmax_skip; fused and lce_sliced forced too) and
at the default budget. For each: the median time of eager calls (CUDA events); the host's time to issue a
call while the GPU is busy (host_ms); the call replayed from a CUDA graph (no host in the way; not for the
skip, which synchronises); one call under torch.profiler: kernel time by kind (GEMMs, the loss kernels, the
rest), the GPU's busy time (the union of kernel intervals) and its span. Eager minus replayed is what the
host costs the call.
Usage (GPU): python dev/lce_kernel_profile.py OUT.json [NxdxV ...] [--spread S] [--memory BYTES]
(default shapes 8192x4096x128256 16384x2304x256000 8192x2048x32000; memory: 4.5% of x and W's bytes, about
bench --lce's budget from CCE's peak, which is x and W's bytes and a few MB)."""

import json
import statistics
import sys

import torch

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import lce
from fastsoftmax.bench.suite import graphed

SHAPES = ("8192x4096x128256", "16384x2304x256000", "8192x2048x32000")


def events_ms(fn, reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def host_ms(fn) -> float:
    """The host's time to issue the call while the GPU is still busy with a sleep queued before it (the
    launch queue, about a thousand launches deep, may make the host wait too)."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # (about a second of GPU time ahead of the call)
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms


def graph_ms(fn) -> float | None:
    """The call replayed from a CUDA graph (bench.suite.graphed): the GPU's time with the host out of the way."""
    try:
        replay = graphed(fn)
    except Exception as e:  # (the skip synchronises)
        print("   graph:", type(e).__name__, str(e)[:120], flush=True)
        return None
    return events_ms(replay)


def kind(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_", "sm100_", "ampere_", "cublas")):
        return "gemm"
    if any(k in low for k in ("rows_forward", "rows_backward", "ce_", "cross_entropy", "finish", "scale_by")):
        return "loss"
    return "other"


def profiled(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    by_kind: dict[str, float] = {}
    names: dict[str, list] = {}
    for e in evs:
        k = kind(e.name)
        by_kind[k] = by_kind.get(k, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        n = names.setdefault(e.name[:90], [0, 0.0])
        n[0] += 1
        n[1] += (e.time_range.end - e.time_range.start) / 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in evs)
    busy, cur = 0.0, None
    for s, t in spans:
        if cur is None or s > cur[1]:
            if cur is not None:
                busy += cur[1] - cur[0]
            cur = [s, t]
        else:
            cur[1] = max(cur[1], t)
    if cur is not None:
        busy += cur[1] - cur[0]
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "kernel_ms": {k: round(v, 3) for k, v in by_kind.items()},
        "busy_ms": round(busy / 1e3, 3),
        "span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 3) if spans else 0.0,
        "kernels": len(evs),
        "top": [dict(name=k, calls=c, ms=round(ms, 3)) for k, (c, ms) in top],
    }


def cce_budget(n: int, d: int, v: int) -> int:
    """memory= at about bench --lce's budget from CCE's peak (x and W's bf16 bytes and a few MB): what the
    LM-head loss may hold beyond its inputs (this module's, lce_plan_sweep's and the skip scripts')."""
    base = (v * d + n * d) * 2
    return int(lce.CCE_SLACK * base) - base - 16 * n


def run_shape(n: int, d: int, v: int, spread: float, memory: int | None) -> list[dict]:
    x, w, t = lce.inputs((n, d, v), torch.bfloat16, "cuda", spread)
    budget = memory or cce_budget(n, d, v)
    xd, wd = x.detach(), w.detach()
    g_logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)

    def floor():
        lg = xd @ wd.t()
        return g_logits @ wd, lg.t() @ xd

    variants = {"floor": floor}
    skip = dict(memory=budget, skip_eps=lce.SKIP_EPS)
    for name, kw, path in (("mem", dict(memory=budget), None), ("fused", dict(memory=budget), "lce_fused"),
                           ("skip", skip, None), ("fused_skip", skip, "lce_fused"), ("sliced_skip", skip, "lce_sliced"),
                           ("default", {}, None)):  # fmt: skip

        def step(kw=kw, path=path):
            with heuristics.force(**({"path": path} if path else {})):
                loss = fs.linear_cross_entropy(x, w, t, **kw)
                return torch.autograd.grad(loss, (x, w))

        variants[name] = step
    records = []
    for name, fn in variants.items():
        rec = {"N": n, "d": d, "V": v, "variant": name, "memory": budget if name not in ("floor", "default") else None}
        try:
            rec["eager_ms"] = round(events_ms(fn), 3)
            rec["plan"] = str(heuristics.last_plan()) if name != "floor" else None
            rec["host_ms"] = round(host_ms(fn), 3)
            rec["graph_ms"] = None if "skip" in name else graph_ms(fn)
            rec |= profiled(fn)
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        records.append(rec)
        keys = ("N", "d", "V", "variant", "eager_ms", "host_ms", "graph_ms", "busy_ms", "kernel_ms", "plan", "error")
        print(json.dumps({k: rec.get(k) for k in keys}), flush=True)
        torch.cuda.empty_cache()
    return records


def main(argv: list[str]) -> int:
    out_path, rest = argv[0], argv[1:]
    spread, memory = lce.SPREAD, None
    shapes = []
    it = iter(rest)
    for a in it:
        if a == "--spread":
            spread = float(next(it))
        elif a == "--memory":
            memory = int(next(it))
        else:
            shapes.append(a)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "spread": spread, "records": []}
    for spec in shapes or SHAPES:
        n, d, v = (int(s) for s in spec.split("x"))
        doc["records"] += run_shape(n, d, v, spread, memory)
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
