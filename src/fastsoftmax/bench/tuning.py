"""`fastsoftmax bench --tune`: the sweep that writes the table backend="auto" reads (heuristics/tables.py).

Every (backend, path) candidate is timed per problem of a grid of row lengths, twice (many rows, few rows);
an entry covers the bucket of lengths from the previous grid length to its own, and a candidate replaces the
heuristics' default there only if it also wins inside the bucket (see tune)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

import torch

from .report import STDERR, header
from .suite import Shape, Unsupported, check_rows, copy_gbps, graphed, jobs_for, time_ms, warm

TUNE_GRID = [1 << k for k in range(8, 21)]  # row lengths 256 .. 2^20: each measured one closes a bucket


def tune_shapes(sm_count: int) -> list[Shape]:
    """Per grid length, a many-rows shape (2^26 elements, at least 2 rows per SM) and a few-rows one."""
    from ..heuristics.tables import FEW_ROWS_PER_SM

    many = [(max(FEW_ROWS_PER_SM * sm_count, (1 << 26) // n), n) for n in TUNE_GRID]
    return many + [(64, n) for n in TUNE_GRID]


def candidates(n: int, n_rows: int, elsize: int, pass_: str, device: str) -> list[tuple[str, str]]:
    """(backend, path) pairs that can run this problem here."""
    from ..heuristics import device as gpu
    from ..heuristics import softmax_cuda, softmax_triton
    from ..kernels.cuda import backend as cuda_backend

    inputs = 1 if pass_ == "fwd" else 2
    rowblock_max = softmax_triton.ROWBLOCK_MAX_N
    out = [("triton", p) for p in softmax_triton.PATHS if p != "rowblock" or n <= rowblock_max]
    if device == "cuda" and not cuda_backend.off():
        facts = gpu.of(torch.cuda.current_device())
        for v in ("warp", "block", "cluster", "online", "staged"):
            try:
                softmax_cuda.launch_shape(n, n_rows, elsize, facts, v, inputs)
                out.append(("cuda", v))
            except ValueError:
                pass
    return out


def tune(
    shapes: Sequence[Shape],
    dtypes: Sequence[str],
    passes: Sequence[str],
    device: str,
    progress: TextIO | None = STDERR,
    jobs: int = 0,
) -> dict:
    """Measure every (backend, path) candidate per problem (CUDA-graph GPU time for few-row problems, eager
    do_bench otherwise); every candidate's GB/s is kept in the entry. The fastest (the challenger) replaces
    the heuristics' default only over the bucket the entry covers: both timed again at its top length, then
    the default and the candidates within tuning.BAND of the fastest timed at odd lengths inside it (the
    entry's "probes"); the best of those over all lengths is the challenger (tuning.band_challenger), and
    tuning.bucket_pick decides between it and the default."""

    import fastsoftmax as fs

    from .. import heuristics
    from ..heuristics import device as gpu
    from ..heuristics import softmax_triton
    from ..heuristics import tables as tuning
    from ..info import info

    facts = gpu.of(torch.cuda.current_device()) if device == "cuda" else gpu.INTERPRETER
    sms = facts.sm_count

    def names(m, n, dt, pass_):
        elsize = torch.empty((), dtype=getattr(torch, dt)).element_size()
        return [f"{b}/{p}" for b, p in candidates(n, m, elsize, pass_, device)]

    if device == "cuda":
        warm(jobs_for(shapes, dtypes, passes, names), jobs, progress)

    def inputs(m, n, dtype):
        x = torch.randn(m, n, device=device, dtype=dtype) * 3
        return x, torch.softmax(x, -1), torch.randn(m, n, device=device, dtype=dtype)

    def gbps(name, pass_, cls, x, y, dy):
        backend, path = name.split("/")
        nbytes = (2 if pass_ == "fwd" else 3) * x.numel() * x.element_size()
        with heuristics.force(path=path):
            if pass_ == "fwd":
                fn = lambda: fs.softmax(x, backend=backend)  # noqa: E731
            else:
                fn = lambda: fs.softmax_backward(dy, y, backend=backend)  # noqa: E731
            problem = check_rows(fn(), x, y, dy, pass_)[1]
            if problem:
                raise Unsupported(problem)
            timed = graphed(fn) if device == "cuda" and cls == "few" else fn
            return nbytes / time_ms(timed, device) / 1e6

    entries = []
    for pass_ in passes:
        for dt in dtypes:
            dtype = getattr(torch, dt)
            below: dict = {}  # rows class -> the previous length measured: the bucket's lower end
            for m, n in shapes:
                cls = tuning.rows_class(m, sms)
                x, y, dy = inputs(m, n, dtype)
                results = {}
                for backend, path in candidates(n, m, x.element_size(), pass_, device):
                    try:
                        results[f"{backend}/{path}"] = gbps(f"{backend}/{path}", pass_, cls, x, y, dy)
                    except Exception as e:  # a candidate that fails is left out, and said
                        if progress is not None:
                            progress.write(f"  {pass_} {dt} {m}x{n} {backend}/{path}: {type(e).__name__}: {e}\n")
                lo, below[cls] = below.get(cls, n // 2), n
                if not results:
                    continue
                plan = softmax_triton.launch_shape(
                    n, m, x.element_size(), False, sms, None, inputs=1 if pass_ == "fwd" else 2
                )
                default = "triton/" + plan.path
                # The challenger: the fastest candidate at n (the default keeps the bucket when it is the one).
                challenger = max(results, key=results.get)
                contested = challenger != default and default in results
                probes = []
                if contested:
                    # One timing can be an outlier: both are timed again, each keeping its better figure, and
                    # the challenger named again.
                    for name in (default, challenger):
                        results[name] = max(results[name], gbps(name, pass_, cls, x, y, dy))
                    challenger = max(results, key=results.get)
                    contested = challenger != default
                # The entry covers (lo, n], and a path can win at n and lose inside the bucket or the reverse:
                # the default and every candidate within tuning.BAND of the fastest at n are also timed a
                # quarter and half way in (odd lengths); tuning.entry_path decides from what the entry records.
                for n2 in sorted({(3 * lo + n) // 4 | 1, (lo + n) // 2 | 1}):
                    if not contested or not lo < n2 < n:
                        break
                    m2 = m if cls == "few" else max(m, (m * n) // n2)
                    del x, y, dy
                    x, y, dy = inputs(m2, n2, dtype)
                    probe = {"M": m2, "N": n2, "candidates": {}}
                    probes.append(probe)
                    for name in [default, *tuning.band(results, default)]:
                        try:
                            probe["candidates"][name] = gbps(name, pass_, cls, x, y, dy)
                        except Exception as e:  # a candidate that cannot run inside its bucket does not take it
                            probe.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                entry = {
                    "pass": pass_,
                    "dtype": dt,
                    "rows": cls,
                    "n_max": n,
                    "M": m,
                    "default": default,
                    "candidates": results,
                }
                if probes:
                    entry["probes"] = probes
                if contested:
                    entry["challenger"] = tuning.band_challenger(entry)
                best = tuning.entry_path(entry, tuning.RULE)
                backend, path = best.split("/")
                entry.update(backend=backend, path=path, gbps=results[best])
                entries.append(entry)
                if progress is not None:
                    progress.write(f"{pass_} {dt} {m}x{n} ({cls}): {best} {results[best]:.0f} GB/s\n")
                    progress.flush()
                del x, y, dy

    return tuning.validate(
        {
            **header(device, copy_gbps(device)),
            "generated_by": "fastsoftmax bench --tune",
            "rule": tuning.RULE,
            "nvrtc": info()["nvrtc"],
            "sm_count": sms,
            "arch": tuning.arch(facts),
            "few_rows_per_sm": tuning.FEW_ROWS_PER_SM,
            "entries": entries,
        }
    )
