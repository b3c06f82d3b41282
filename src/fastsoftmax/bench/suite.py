"""The problems `fastsoftmax bench` times, and how it times them.

Order of work: the device-to-device copy bandwidth first (the ceiling), then for every (pass, dtype, shape)
every implementation is run once and checked against the float64 oracle on its first and last rows, then
timed: `triton.testing.do_bench` median with L2 flushed between runs, plus CUDA-graph replay timing for
small shapes (where eager timing measures the host). GB/s counts bytes read + written: forward 2 bytes
moved per element byte (x, y), backward 3 (y, dy, dx). An implementation that refuses or breaks on a shape
is recorded as unsupported with its error, never skipped silently. Host overhead: wall time per eager call
on 1x4096 fp32. Also attention scores with masks (run_masked) and cross-entropy (run_ce); worker processes
can fill the compile caches first (warm), so that the timing process meets only cache hits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TextIO

import torch

from .peers import BUILDERS, SAME_BYTES, Adapter, Thunk, ce_builder, masked_fn
from .report import STDERR, STDOUT, header, print_ce, print_masked, print_tables

Shape = tuple[int, int]

# The shape suite: 2^27 elements as MxN, odd and real vocabularies, few long rows, latency.
SUITE = [((1 << 27) // n, n) for n in (256, 1024, 4096, 16384, 32768, 65536, 131072, 262144)]
SUITE += [(262144, 513), (4096, 32000), (8192, 50257), (16384, 37984)]
SUITE += [(8, 131072), (64, 131072), (128, 262144), (1, 4096)]
QUICK = [(131072, 1024), (262144, 513), (8192, 50257), (1024, 131072), (8, 131072), (1, 4096)]
GRAPH_BELOW = 1 << 24  # elements: shapes smaller than this are also timed as CUDA-graph replays
PEER_SLACK = 16  # a peer within 16x fastsoftmax's own tolerance is timed, its error recorded


@dataclass
class Record:
    impl: str
    backend: str | None
    dtype: str
    M: int
    N: int
    pass_: str
    ms: float | None
    gbps: float | None
    ok: bool
    error: str | None
    graph_ms: float | None = None
    graph_gbps: float | None = None
    err_ratio: float | None = None  # worst error / fastsoftmax's tolerance on the checked rows
    case: str | None = None  # --masked: which attention-scores case

    def json(self) -> dict:
        d = asdict(self)
        d["pass"] = d.pop("pass_")
        return d


class Unsupported(Exception):
    """The implementation cannot run this problem (its own refusal, an import error, a failed check)."""


# ---- measurement --------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Thunk, device: str) -> float:
    """Median milliseconds per call: do_bench (L2 flushed) on a GPU; on a CPU (smoke runs only), the
    median wall time of a few calls."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[1]


def graphed(fn: Thunk) -> Thunk:
    """fn captured in a CUDA graph (warmed up on a side stream first); returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_gbps(device: str) -> float:
    n = (1 << 30) if device == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * n / time_ms(lambda: dst.copy_(src), device) / 1e6


def host_us(fn: Thunk, device: str, calls: int = 2000) -> float:
    """Wall time per eager call, the GPU kept ahead of the host (the kernel is far shorter than the call)."""
    for _ in range(20):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / calls * 1e6


def check_rows(out, x, y, dy, pass_: str) -> tuple[float, str | None]:
    """(worst error / tolerance, problem or None): the first and last rows of an implementation's output
    against the float64 oracle."""
    from ..core.reference import compare, compare_grad

    rows = sorted({0, min(1, x.shape[0] - 1), x.shape[0] - 1})
    if pass_ == "fwd":
        return compare(out[rows], x[rows], -1, False)
    return compare_grad(out[rows], dy[rows], y[rows], -1, False)


def measure(
    name: str,
    built: Adapter | Exception,
    pass_: str,
    x: torch.Tensor,
    y: torch.Tensor,
    dy: torch.Tensor,
    nbytes: int,
    device: str,
    graph: bool,
) -> Record:
    """One implementation on one problem: checked, then timed (eager, and as a graph replay if `graph`);
    `built` is its adapter, or the exception its builder raised."""
    dtype = str(x.dtype).removeprefix("torch.")
    m, n = x.shape
    rec = Record(name, BUILDERS[name][1], dtype, m, n, pass_, None, None, False, None)
    try:
        if isinstance(built, Exception):
            raise Unsupported(f"{type(built).__name__}: {built}")
        fwd, bwd = built
        fn = fwd(x) if pass_ == "fwd" else bwd(dy, y)
        rec.err_ratio, problem = check_rows(fn(), x, y, dy, pass_) if name != SAME_BYTES else (None, None)
        if problem and (name.startswith("fastsoftmax") or not rec.err_ratio <= PEER_SLACK):
            raise Unsupported(f"wrong result: {problem}")
        if problem:  # a peer less accurate than fastsoftmax promises to be, but not wrong: timed, and said
            rec.error = f"less accurate than fastsoftmax's tolerance (x{rec.err_ratio:.1f}): {problem}"
        rec.ms = time_ms(fn, device)
        rec.gbps = nbytes / rec.ms / 1e6
        if graph:
            rec.graph_ms = time_ms(graphed(fn), device)
            rec.graph_gbps = nbytes / rec.graph_ms / 1e6
        rec.ok = True
    except Exception as e:  # a peer's refusal is a result: recorded with its message
        msg = str(e).strip().splitlines()
        rec.error = f"{type(e).__name__}: {msg[0] if msg else ''}"[:300]
    return rec


def run(
    shapes: Sequence[Shape],
    dtypes: Sequence[str],
    passes: Sequence[str],
    impls: Sequence[str],
    device: str = "cuda",
    graph: str = "auto",
    out: TextIO | None = STDOUT,
    progress: TextIO | None = STDERR,
    jobs: int = 0,
) -> dict:
    """Every measurement, as the JSON document (see the README's schema). jobs > 0: compile caches are
    filled first by that many worker processes (warm)."""

    if device == "cuda":
        warm(jobs_for(shapes, dtypes, passes, lambda *_: impls), jobs, progress)

    copy = copy_gbps(device)
    built = {}
    for name in impls:
        try:
            built[name] = BUILDERS[name][0]()
        except Exception as e:  # not importable here: unsupported on every shape, with the reason
            built[name] = e
    records = []
    total = len(shapes) * len(dtypes) * len(passes) * len(impls)
    done = 0
    t0 = time.time()
    for pass_ in passes:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            for m, n in shapes:
                gen = torch.Generator(device=device).manual_seed(m * 31 + n)
                x = torch.randn(m, n, device=device, dtype=dtype, generator=gen) * 3
                y = torch.softmax(x, -1)
                dy = torch.randn(m, n, device=device, dtype=dtype, generator=gen)
                nbytes = (2 if pass_ == "fwd" else 3) * x.numel() * x.element_size()
                use_graph = device == "cuda" and (graph == "always" or (graph == "auto" and m * n < GRAPH_BELOW))
                for name in impls:
                    done += 1
                    if progress is not None and (progress.isatty() or done % max(1, total // 10) == 0):
                        bar = "#" * (30 * done // total)
                        end = "\r" if progress.isatty() else "\n"
                        progress.write(f"[{bar:30}] {done}/{total} {pass_} {dt} {m}x{n} {name:20}"[:110] + end)
                        progress.flush()
                    records.append(measure(name, built[name], pass_, x, y, dy, nbytes, device, use_graph))
                del x, y, dy
    if progress is not None:
        progress.write(f"done: {total} measurements in {time.time() - t0:.0f} s{' ' * 60}\n")
    host = {}
    xs = torch.randn(1, 4096, device=device)
    import fastsoftmax as fs

    host["fastsoftmax"] = host_us(lambda: fs.softmax(xs), device)
    host["torch"] = host_us(lambda: torch.softmax(xs, -1), device)
    doc = {
        **header(device, copy),
        "records": [r.json() for r in records],
        "host_us": host,
        "method": "do_bench median, L2 flushed; graph_* columns: CUDA-graph replay"
        if device == "cuda"
        else "wall clock, CPU",
    }
    if out is not None:
        print_tables(doc, out)
    return doc


# ---- --masked: attention scores, softmax(scale * x + mask) -------------------------------------------------

ATTENTION = (8, 16, 2048)  # (B, H, S): scores of shape (B, H, S, S), softmax over the keys
MASKED_CASES = {  # name: (padding mask, causal); every case scales by 1/sqrt(128)
    "padding": (True, False),
    "causal": (False, True),
    "padding+causal": (True, True),
}
SCALE = 128**-0.5


def masked_inputs(
    shape: tuple[int, int, int], dtype: torch.dtype, device: str, pad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores and a (B, 1, 1, S) bool padding mask: batch b keeps its first S - b*S/(2B) keys (every row keeps
    at least half; none is fully masked, so torch's NaN convention does not enter)."""
    b, h, s = shape
    gen = torch.Generator(device=device).manual_seed(b * h + s)
    x = torch.randn(b, h, s, s, device=device, dtype=dtype, generator=gen) * 3
    if not pad:
        return x, None
    keep = s - torch.arange(b, device=device) * s // (2 * b)
    return x, (torch.arange(s, device=device)[None, :] < keep[:, None])[:, None, None, :]


def _masked_check(out, x, y, dy, pad, causal, pass_) -> tuple[float, str | None]:
    """First and last query rows against the float64 torch path of fastsoftmax (masking.py's semantics)."""
    import fastsoftmax as fs

    from ..core.reference import TOLERANCE

    rows = [0, x.shape[-2] - 1]
    sel = (slice(None), slice(None), rows)
    m = pad
    if causal:  # the causal rule of the full problem, for the selected query rows
        from ..core.masking import causal_keep

        keep = causal_keep(x)[rows]
        m = keep[None, None] if m is None else (m & keep[None, None])
    if pass_ == "fwd":
        ref = fs.softmax(x[sel].double(), mask=m, scale=SCALE, backend="torch")
    else:
        ref = fs.softmax_backward(dy[sel].double(), y[sel].double(), mask=m, scale=SCALE, backend="torch")
    got = out[sel].double()
    if not torch.equal(got.isnan(), ref.isnan()):
        return float("nan"), "NaN where the reference has none or vice versa"
    rtol, atol = TOLERANCE[out.dtype]
    fin = ref.isfinite()
    ratio = ((got[fin] - ref[fin]).abs() / (4 * (atol + rtol * ref[fin].abs()))).max().item()
    return ratio, (f"error {ratio:.2g}x the tolerance" if ratio > 1 else None)


def run_masked(
    dtypes: Sequence[str],
    passes: Sequence[str],
    impls: Sequence[str],
    device: str = "cuda",
    shape: tuple[int, int, int] = ATTENTION,
    out: TextIO | None = STDOUT,
) -> dict:
    """Every (case, pass, dtype, impl) on attention scores; GB/s counts the mask bytes read."""

    import fastsoftmax as fs

    copy = copy_gbps(device)
    records = []
    for case, (pad_on, causal) in MASKED_CASES.items():
        for pass_ in passes:
            for dt in dtypes:
                x, pad = masked_inputs(shape, getattr(torch, dt), device, pad_on)
                y = fs.softmax(x, mask=pad, scale=SCALE, causal=causal, backend="torch")
                dy = torch.randn_like(x)
                mask_bytes = pad.numel() if pad is not None else 0
                nbytes = (2 if pass_ == "fwd" else 3) * x.numel() * x.element_size() + mask_bytes
                for name in impls:
                    m, n = x.numel() // x.shape[-1], x.shape[-1]
                    rec = Record(name, BUILDERS[name][1], dt, m, n, pass_, None, None, False, None, case=case)
                    try:
                        fn = masked_fn(name, pass_, x, y, dy, pad, causal, SCALE)
                        rec.err_ratio, problem = _masked_check(fn(), x, y, dy, pad, causal, pass_)
                        if problem:
                            raise Unsupported(f"wrong result: {problem}")
                        rec.ms = time_ms(fn, device)
                        rec.gbps = nbytes / rec.ms / 1e6
                        rec.ok = True
                    except Exception as e:  # recorded with its reason
                        rec.error = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    records.append(rec)
                del x, y, dy
    doc = {
        **header(device, copy),
        "shape": list(shape),
        "scale": SCALE,
        "records": [r.json() for r in records],
        "method": "do_bench median, L2 flushed; GB/s counts x, y (dy, dx) and the mask bytes",
    }
    if out is not None:
        print_masked(doc, out)
    return doc


# ---- --ce: cross-entropy over vocabularies -------------------------------------------------------------------

CE_SUITE = [(8192, 32000), (4096, 50257), (4096, 128256), (2048, 151936), (1024, 256000)]


def run_ce(
    shapes: Sequence[Shape],
    dtypes: Sequence[str],
    impls: Sequence[str],
    device: str = "cuda",
    out: TextIO | None = STDOUT,
    graph: bool = False,
) -> dict:
    """Forward (loss only) and forward + backward (loss, then dlogits) per implementation. GB/s: the bytes
    the step must move at least (forward: the logits once; forward + backward: logits twice, dlogits once),
    the same count for every implementation, so ratios are time ratios. ``graph``: each step replayed from
    a CUDA graph too (GPU time without the host's; an implementation that cannot be captured keeps its
    eager figure and says why in ``error``)."""
    import torch.nn.functional as F

    copy = copy_gbps(device)
    records = []
    for dt in dtypes:
        for m, v in shapes:
            gen = torch.Generator(device=device).manual_seed(m + v)
            x0 = torch.randn(m, v, device=device, dtype=getattr(torch, dt), generator=gen) * 2
            t = torch.randint(0, v, (m,), device=device, generator=gen)
            t[::7] = -100
            x64 = x0[:8].double().requires_grad_()
            ref = F.cross_entropy(x64, t[:8])
            (dref,) = torch.autograd.grad(ref, x64)
            for name in impls:
                for pass_ in ("fwd", "fwd+bwd"):
                    backend = "auto" if name == "fastsoftmax" else None
                    rec = Record(name, backend, dt, m, v, pass_, None, None, False, None, case="cross_entropy")
                    try:
                        f = ce_builder(name)
                        xs = x0[:8].clone().requires_grad_()  # the check: 8 rows, against float64 torch
                        loss = f(xs, t[:8])
                        (dx,) = torch.autograd.grad(loss, xs)
                        rel = ((loss.double() - ref).abs() / ref.abs()).item()
                        gerr = (dx.double() - dref).abs().max().item()
                        rec.err_ratio = max(rel / 1e-2, gerr / 1e-3)
                        if not rec.err_ratio <= 1:
                            raise Unsupported(f"wrong result: loss rel. error {rel:.2g}, dlogits error {gerr:.2g}")
                        x = x0.clone().requires_grad_(pass_ != "fwd")
                        if pass_ == "fwd":
                            fn = lambda f=f, x=x, t=t: f(x, t)  # noqa: E731
                        else:
                            fn = lambda f=f, x=x, t=t: torch.autograd.grad(f(x, t), x)  # noqa: E731
                        nbytes = (1 if pass_ == "fwd" else 3) * x0.numel() * x0.element_size()
                        with torch.no_grad() if pass_ == "fwd" else contextlib.nullcontext():
                            rec.ms = time_ms(fn, device)
                            rec.gbps = nbytes / rec.ms / 1e6
                            rec.ok = True
                            if graph:
                                try:
                                    rec.graph_ms = time_ms(graphed(fn), device)
                                    rec.graph_gbps = nbytes / rec.graph_ms / 1e6
                                except Exception as e:  # eager figure kept
                                    rec.error = f"graph: {type(e).__name__}: {str(e).strip()[:200]}"
                    except Exception as e:  # recorded with its reason
                        rec.error = f"{type(e).__name__}: {str(e).strip()[:200]}"
                    records.append(rec)
            del x0
    doc = {
        **header(device, copy),
        "records": [r.json() for r in records],
        "method": "do_bench median, L2 flushed; GB/s: minimum bytes of the step (see run_ce)",
    }
    if out is not None:
        print_ce(doc, out)
    return doc


# ---- compile caches filled in parallel processes ---------------------------------------------------------
# Compiling (a Triton kernel, an inductor graph or an NVRTC cubin per problem) is most of a cold run's time,
# and every one of those caches lands on disk: workers that run each job once leave the timing process only
# cache hits. Timing stays in one process.

Job = tuple[str, str, int, int, str]  # (pass, dtype, M, N, name)


def jobs_for(
    shapes: Sequence[Shape],
    dtypes: Sequence[str],
    passes: Sequence[str],
    names: Callable[[int, int, str, str], Sequence[str]],
) -> list[Job]:
    """(pass, dtype, M, N, name) per problem; a name is a bench implementation or 'backend/path'."""
    return [(p, d, m, n, name) for p in passes for d in dtypes for m, n in shapes for name in names(m, n, d, p)]


def _warm_worker(task: tuple[str, list[Job]]) -> int:
    from .. import heuristics

    device, jobs = task
    built, failed, last = {}, 0, None
    for pass_, dt, m, n, name in jobs:
        try:
            if last != (pass_, dt, m, n):
                x = torch.randn(m, n, device=device, dtype=getattr(torch, dt))
                y, dy, last = torch.softmax(x, -1), torch.randn_like(x), (pass_, dt, m, n)
            if "/" in name:  # a tuning candidate
                backend, path = name.split("/")
                import fastsoftmax as fs

                with heuristics.force(path=path):
                    fs.softmax(x, backend=backend) if pass_ == "fwd" else fs.softmax_backward(dy, y, backend=backend)
            else:
                if name not in built:
                    built[name] = BUILDERS[name][0]()
                fwd, bwd = built[name]
                (fwd(x) if pass_ == "fwd" else bwd(dy, y))()
        except Exception:  # the timing process meets the same error and records it
            failed += 1
    _sync(device)
    return failed


def _worker_env() -> None:
    import os

    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # not 16 compile processes per worker


def warm(jobs: list[Job], workers: int, progress: TextIO | None = STDERR, device: str = "cuda") -> int:
    """Run every job once in `workers` spawned processes; returns how many raised."""
    if workers <= 0 or not jobs:
        return 0
    import multiprocessing

    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    chunks = [sorted(c, key=lambda j: j[:4]) for c in chunks if c]
    with multiprocessing.get_context("spawn").Pool(len(chunks), initializer=_worker_env) as pool:
        failed = sum(pool.map(_warm_worker, [(device, c) for c in chunks]))
    if progress is not None:
        progress.write(
            f"warm-up: {len(jobs)} jobs in {len(chunks)} processes, {time.time() - t0:.0f} s "
            f"({failed} raised; measured below)\n"
        )
    return failed


def default_jobs(device: str) -> int:
    """Warm-up processes for --jobs's default: CPU cores - 2, at most 12, on a GPU; none on a CPU."""
    import os

    return max(1, min(12, (os.cpu_count() or 2) - 2)) if device == "cuda" else 0
