"""`fastsoftmax bench --lce`: the LM-head loss, linear + cross-entropy forward and backward to dx and dW, of
fastsoftmax against its peers, in one process on one GPU.

Per (N, d, V) shape, bf16 (fp32 on the CPU smoke run): x ~ randn(N, d), W ~ randn(V, d) * spread / sqrt(d)
(logits of that spread: 1 unless --lce-spread), targets uniform in [0, V) with ~5% ignore_index rows, seed 0.
The fp32 reference (F.linear + F.cross_entropy on the same inputs upcast, TF32 off) runs first; then every
implementation runs once for its errors (relative Frobenius norm ||a - ref|| / ||ref|| of loss, dx and dW),
once more for its peak memory (max_memory_allocated above what was allocated before the call: inputs
excluded, dx and dW included), then is timed (do_bench median, L2 flushed). "floor" is not a loss: the three
cuBLAS GEMMs any of them must do (x @ W^T, g @ W, g^T @ x on a preallocated logits-shaped g), the speed floor
every time is divided by. fastsoftmax_mem and fastsoftmax_skip run at CCE's peak (MEMORY), the second with
skip_eps=SKIP_EPS.

An implementation that cannot import or run is recorded with its error; the run goes on. The document is
written after every shape, so a run cut short keeps what it measured. Peers are imported where built.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

from .report import STDERR, STDOUT, header, write_json
from .suite import copy_gbps, time_ms

LceShape = tuple[int, int, int]  # (N tokens, d hidden, V vocabulary)
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]  # (x, w, t) -> (loss or None, dx, dW)

LCE_SUITE: list[LceShape] = [
    (8192, 4096, 128256),  # Llama 3 8B
    (16384, 2304, 256000),  # Gemma 2 2B: the largest logits (8.4 GB bf16)
    (4096, 8192, 128256),  # Llama 3 70B
    (8192, 2048, 32000),  # small vocabulary: the loss is a small share of the step
    (8192, 4096, 151936),  # Qwen 2.5 7B
]
CPU_SHAPES: list[LceShape] = [(64, 32, 1000)]
LCE_IMPLS = ("floor", "torch", "compile", "fs_logits", "fastsoftmax", "liger", "cce", "cce_exact")
LCE_IMPLS += ("fastsoftmax_mem", "fastsoftmax_skip", "quack")  # (after CCE: their budget comes from CCE's peak)
CUDA_ONLY = {"liger", "cce", "cce_exact", "quack"}  # Triton / CuTe kernels with no CPU path
# fastsoftmax_mem's default logits-chunk budget, per shape (MEMORY None): what keeps its peak (dW + dx + the
# chunk + 16 B a row) at 1.045x CCE's peak measured just before on the same shape (CCE holds no logits:
# dW + dx + a few MB), or, without a CCE record, 4% of dW + dx.
MEMORY = None
MEMORY_SHARE = 0.04
CCE_SLACK = 1.045
SKIP_EPS = 2.0**-12  # fastsoftmax_skip: fastsoftmax_mem with skip_eps, the largest probability a skipped pair holds
SPREAD = 1.0  # the logits' standard deviation (W's scale); CCE's filter skips far more at 0.5


def memory_for(shape: LceShape, elsize: int, memory: int | None, recs: dict | None = None) -> int:
    n, d, v = shape
    if memory is not None:
        return memory
    base = (v * d + n * d) * elsize
    cce = [r.peak_bytes for k, r in (recs or {}).items() if k.startswith("cce") and r.ok and r.peak_bytes]
    if cce:
        return max(int(CCE_SLACK * max(cce)) - base - 16 * n, v * elsize)
    return int(MEMORY_SHARE * base)


IGNORE_SHARE = 0.05
PEER_DISTS = {"liger": "liger-kernel", "cce": "cut-cross-entropy", "quack": "quack-kernels"}


@dataclass
class LceRecord:
    impl: str
    backend: str | None
    dtype: str
    N: int
    d: int
    V: int
    ms: float | None = None
    tflops: float | None = None  # the three GEMMs' 6*N*d*V flops over the time: the same count for all
    vs_floor: float | None = None  # ms / the floor's ms on this shape
    peak_bytes: int | None = None  # above the inputs, dx and dW included; None on the CPU
    loss_err: float | None = None
    dx_err: float | None = None
    dw_err: float | None = None
    err_vs_torch: float | None = None  # worst of the three errors over torch's own on this shape
    memory: int | None = None  # the memory= budget passed (fastsoftmax_mem)
    plan: str | None = None  # fastsoftmax: heuristics.last_plan() after its forward
    ok: bool = False
    error: str | None = None
    pass_: str = "fwd+bwd"
    case: str = "linear_cross_entropy"

    def json(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return d


class Skipped(Exception):
    """Not attempted here (a peer with GPU kernels only, on the CPU smoke run)."""


def _grads(loss_fn: Callable, seen: dict | None = None) -> Step:
    """A loss function as a step: forward, then dx and dW through autograd.grad (nothing accumulates into
    .grad between timed calls, which would add a read and write of dW per call). `seen`: the forward's plan
    is kept there (a backward may record its own)."""
    from .. import heuristics

    def step(x, w, t):
        loss = loss_fn(x, w, t)
        if seen is not None:
            seen["plan"] = heuristics.last_plan()
        dx, dw = torch.autograd.grad(loss, (x, w))
        return loss.detach(), dx, dw

    return step


def build(name: str, x: torch.Tensor, w: torch.Tensor, memory: int, seen: dict | None = None) -> Step:
    """The step of one implementation on this shape's inputs (the floor's g is allocated here, as an input);
    fastsoftmax's steps leave their forward's plan in `seen`."""
    import torch.nn.functional as F

    if name in CUDA_ONLY and x.device.type != "cuda":
        raise Skipped("needs CUDA")
    if name == "floor":
        g = torch.randn(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

        def floor(x, w, t):
            with torch.no_grad():
                logits = x @ w.T  # held to the end, as a materialised loss holds it
                dx, dw = g @ w, g.T @ x
            del logits
            return None, dx, dw

        return floor
    if name == "torch":
        return _grads(lambda x, w, t: F.cross_entropy(F.linear(x, w), t))
    if name == "compile":
        return _grads(torch.compile(lambda x, w, t: F.cross_entropy(F.linear(x, w), t), dynamic=False))
    import fastsoftmax as fs

    if name == "fs_logits":
        return _grads(lambda x, w, t: fs.cross_entropy(F.linear(x, w), t), seen)
    if name in ("fastsoftmax", "fastsoftmax_mem", "fastsoftmax_skip"):
        lce = fs.linear_cross_entropy  # AttributeError until it exists: recorded, the peers still run
        budget = None if name == "fastsoftmax" else memory
        skip = SKIP_EPS if name == "fastsoftmax_skip" else 0.0
        return _grads(lambda x, w, t: lce(x, w, t, memory=budget, skip_eps=skip), seen)
    if name == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

        return _grads(lambda x, w, t: liger(x, w, t))
    if name in ("cce", "cce_exact"):
        from cut_cross_entropy import linear_cross_entropy as cce

        # filter_eps=None keeps every gradient term; the default ("high") skips those under bf16's epsilon
        kw = {"filter_eps": None} if name == "cce_exact" else {}
        return _grads(lambda x, w, t: cce(x, w, t, **kw))
    if name == "quack":
        from quack.linear_cross_entropy import chunked_linear_cross_entropy as quack

        return _grads(lambda x, w, t: quack(x, w, t))
    raise ValueError(f"unknown implementation {name!r}; valid: {', '.join(LCE_IMPLS)}")


def inputs(
    shape: LceShape, dtype: torch.dtype, device: str, spread: float = SPREAD
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, d, v = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, d, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(v, d, device=device, generator=gen) * (spread * d**-0.5)).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=device, generator=gen)
    t[torch.rand(n, device=device, generator=gen) < IGNORE_SHARE] = -100
    return x, w, t


def reference(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> tuple:
    """(loss, dx, dW) in fp32 from the same inputs upcast; TF32 off, so that the GEMMs are fp32's."""
    import torch.nn.functional as F

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        loss = F.cross_entropy(F.linear(x32, w32), t)
        dx, dw = torch.autograd.grad(loss, (x32, w32))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return loss.detach(), dx, dw


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a.float() - ref) / torch.linalg.vector_norm(ref)).item()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn: Callable, device: str) -> float:
    """do_bench median on a GPU with a longer window than its 100 ms default: a 130 ms step would get one
    timed repeat there; wall-clock median of three on the CPU."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=100, rep=1000, return_mode="median")
    return time_ms(fn, device)


def peak_bytes(fn: Callable, device: str) -> int | None:
    """Bytes allocated at the peak of one call above those allocated before it (its inputs)."""
    if device != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def measure(name: str, shape: LceShape, x, w, t, ref, memory: int | None, device: str, recs: dict) -> LceRecord:
    """One implementation on one shape: errors, peak memory, time; any exception ends it with its message."""
    n, d, v = shape
    fs_impl = name.startswith("fastsoftmax") or name == "fs_logits"
    rec = LceRecord(name, "auto" if fs_impl else None, str(x.dtype).removeprefix("torch."), n, d, v)
    memory = memory_for(shape, x.element_size(), memory, recs)
    rec.memory = memory if name in ("fastsoftmax_mem", "fastsoftmax_skip") else None
    step = None
    try:
        seen: dict = {}
        step = build(name, x, w, memory, seen)
        loss, dx, dw = step(x, w, t)
        if (p := seen.get("plan")) is not None:
            rec.plan = f"{p.backend}/{p.path} rows={p.rows} splits={p.splits}"
            rec.plan += f" skipped={p.skipped}" if p.skipped else ""
            rec.plan += f" spans={p.spans}" if p.spans else ""
        if loss is not None:
            rec.loss_err, rec.dx_err, rec.dw_err = _rel(loss, ref[0]), _rel(dx, ref[1]), _rel(dw, ref[2])
        del loss, dx, dw
        fn = lambda: step(x, w, t)  # noqa: E731
        rec.peak_bytes = peak_bytes(fn, device)
        rec.ms = _time(fn, device)
        rec.tflops = 6 * n * d * v / rec.ms / 1e9
        floor = recs.get("floor")
        rec.vs_floor = rec.ms / floor.ms if floor and floor.ms else None
        tr = recs.get("torch")
        if tr and tr.ok and rec.loss_err is not None:
            pairs = [(rec.loss_err, tr.loss_err), (rec.dx_err, tr.dx_err), (rec.dw_err, tr.dw_err)]
            ratios = [e / te for e, te in pairs if te]  # torch exact (fp32 on the CPU): no ratio
            rec.err_vs_torch = max(ratios) if ratios else None
        rec.ok = True
    except Exception as e:  # a refusal, an import error, a skip, out of memory: the record says which
        msg = str(e).strip().splitlines()
        kind = "skipped" if isinstance(e, Skipped) else type(e).__name__
        rec.error = f"{kind}: {msg[0] if msg else ''}"[:300]
    finally:
        step = None  # its buffers (the floor's g, a compiled graph's) freed before empty_cache
        if device == "cuda":
            torch.cuda.empty_cache()  # what one implementation cached is not the next one's headroom
    return rec


def peer_versions() -> dict:
    from importlib import metadata

    out = {}
    for name, dist in PEER_DISTS.items():
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_lce(
    shapes: Sequence[LceShape],
    impls: Sequence[str],
    device: str = "cuda",
    memory: int | None = MEMORY,
    path: str | None = None,
    out: TextIO | None = STDOUT,
    progress: TextIO | None = STDERR,
    spread: float = SPREAD,
) -> dict:
    """Every (shape, implementation) record as the result document (report.header's fields first); written
    to `path` after each shape."""
    from ..version import __version__

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    doc = {
        **header(device, copy_gbps(device)),
        "fastsoftmax": __version__,
        "peers": peer_versions(),
        "memory": memory,
        "ignore_share": IGNORE_SHARE,
        "spread": spread,
        "skip_eps": SKIP_EPS,
        "records": [],
        "method": "fwd+bwd (loss, dx, dW) per call; do_bench median (warmup 100 ms, rep 1000 ms), L2 flushed; "
        "peak_bytes: max_memory_allocated above the inputs; *_err: ||a - ref|| / ||ref|| against fp32 torch"
        if device == "cuda"
        else "fwd+bwd (loss, dx, dW) per call; wall clock, CPU (smoke run)",
    }
    t0 = time.time()
    for i, shape in enumerate(shapes):
        x, w, t = inputs(shape, dtype, device, spread)
        ref = reference(x, w, t)
        recs: dict[str, LceRecord] = {}
        for name in impls:
            recs[name] = rec = measure(name, shape, x, w, t, ref, memory, device, recs)
            doc["records"].append(rec.json())
            if progress is not None:
                what = f"{rec.ms:.2f} ms" if rec.ok else rec.error[:80]
                progress.write(f"[{time.time() - t0:5.0f} s] {i + 1}/{len(shapes)} {shape} {name}: {what}\n")
                progress.flush()
        del x, w, t, ref
        write_json(doc, path)
    if out is not None:
        print_lce(doc, out)
    return doc


def _g(v: float | None, f: str) -> str:
    return "-" if v is None else format(v, f)


def print_lce(doc: dict, out: TextIO = STDOUT) -> None:
    """A block per shape: ms, x floor, peak GB above the inputs, the three errors and the worst over torch's
    per implementation; then every error."""
    peers = ", ".join(f"{k} {v}" for k, v in doc["peers"].items() if v)
    print(f"{doc['device']}: torch {doc['torch']}, triton {doc['triton']}{'; ' + peers if peers else ''}", file=out)
    mem = f"{doc['memory']} B" if doc["memory"] is not None else f"peak {CCE_SLACK}x CCE's"
    print(f"linear + cross-entropy, fwd+bwd; memory= {mem} for fastsoftmax_mem; {doc['method']}", file=out)
    cols = f"{'impl':16} {'ms':>9} {'xfloor':>7} {'TFLOP/s':>8} {'peak GB':>8} {'loss err':>9} {'dx err':>9}"
    cols += f" {'dW err':>9} {'xtorch':>7}"
    recs = doc["records"]
    for shape in dict.fromkeys((r["N"], r["d"], r["V"]) for r in recs):
        print(f"\nN, d, V = {shape[0]}, {shape[1]}, {shape[2]} ({recs[0]['dtype']})\n{cols}", file=out)
        for r in (r for r in recs if (r["N"], r["d"], r["V"]) == shape):
            if not r["ok"]:
                print(f"{r['impl']:16} {'unsupported':>9}", file=out)
                continue
            peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 1e9
            line = f"{r['impl']:16} {r['ms']:9.3f} {_g(r['vs_floor'], '7.2f'):>7} {r['tflops']:8.1f}"
            line += f" {_g(peak, '8.2f'):>8} {_g(r['loss_err'], '9.2e'):>9} {_g(r['dx_err'], '9.2e'):>9}"
            print(line + f" {_g(r['dw_err'], '9.2e'):>9} {_g(r['err_vs_torch'], '7.2f'):>7}", file=out)
    errors = [r for r in recs if r["error"]]
    if errors:
        print("\nunsupported (implementation, shape: error):", file=out)
    for r in errors:
        print(f"  {r['impl']} {r['N']}x{r['d']}x{r['V']}: {r['error']}", file=out)
