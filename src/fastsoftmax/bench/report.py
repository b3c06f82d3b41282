"""`fastsoftmax bench` output: the result document's header, the JSON file, the tables printed after a run
and the plot. Tables and plot read the document alone, so a committed JSON can be shown again; matplotlib is
imported by plot() only."""

from __future__ import annotations

import datetime
import json
import math
import sys
from collections.abc import Iterable
from typing import TextIO

from .peers import PEERS, SAME_BYTES


class _Stream:
    """sys.stdout or sys.stderr as it is when written to: the default out and progress of the bench functions
    (a default argument of sys.stdout itself keeps the stream of the moment its module was imported)."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(getattr(sys, self._name), attr)


STDOUT, STDERR = _Stream("stdout"), _Stream("stderr")


def header(device: str, copy: float) -> dict:
    """The fields every result document starts with: where, when, with what, and the copy bandwidth."""
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke run: wall-clock timing)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy,
    }


def write_json(doc: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def best_gbps(r: dict) -> float:
    """GB/s of a record: the CUDA-graph figure where measured (GPU time without the host), else eager."""
    return max(r["gbps"], r["graph_gbps"] or 0)


def geomean(values: Iterable[float]) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def print_tables(doc: dict, out: TextIO = STDOUT) -> None:
    """A table per pass: GB/s per implementation (graph-replay GB/s in brackets where measured), % of copy
    for fastsoftmax auto, and its speed-up over each peer; geometric means at the end."""
    copy = doc["copy_gbps"]
    recs = doc["records"]
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    peers = [p for p in PEERS if p in impls]
    print(
        f"{doc['device']}: copy {copy:.0f} GB/s; torch {doc['torch']}, triton {doc['triton']}; {doc['method']}",
        file=out,
    )
    if SAME_BYTES in impls:
        print(
            f"column {SAME_BYTES!r}: not a softmax, an elementwise op moving the same bytes (x copied; backward: "
            "y + dy), this size's speed of light under the same timing; %copy: of the 1 GiB copy",
            file=out,
        )
    for pass_ in dict.fromkeys(r["pass"] for r in recs):
        print(
            f"\n{pass_}: GB/s (read + written){' [CUDA graph]' if any(r['graph_gbps'] for r in recs) else ''}", file=out
        )
        head = f"{'dtype':9} {'shape':14}" + "".join(f" {i[:18]:>18}" for i in impls) + f" {'%copy':>6}"
        head += "".join(f" {'x' + p[:9]:>10}" for p in peers)
        print(head, file=out)
        speedups = {p: [] for p in peers}
        for dt in dict.fromkeys(r["dtype"] for r in recs):
            for m, n in dict.fromkeys((r["M"], r["N"]) for r in recs):
                key = (pass_, dt, m, n)
                row = {r["impl"]: r for r in recs if (r["pass"], r["dtype"], r["M"], r["N"]) == key}
                if not row:
                    continue
                cells = []
                for i in impls:
                    r = row.get(i)
                    if r is None or not r["ok"]:
                        cells.append(f" {'unsupported':>18}")
                    else:
                        cell = _num(r["gbps"]) + (f" [{_num(r['graph_gbps'])}]" if r["graph_gbps"] else "")
                        cells.append(f" {cell:>18}")
                fs_rec = row.get("fastsoftmax")
                line = f"{dt:9} {f'{m}x{n}':14}" + "".join(cells)
                line += f" {100 * fs_rec['gbps'] / copy:5.0f}%" if fs_rec and fs_rec["ok"] else f" {'-':>6}"
                for p in peers:
                    pr = row.get(p)
                    if fs_rec and fs_rec["ok"] and pr and pr["ok"]:
                        s = best_gbps(fs_rec) / best_gbps(pr)
                        speedups[p].append(s)
                        line += f" {s:10.2f}"
                    else:
                        line += f" {'-':>10}"
                print(line, file=out)
        means = "  ".join(f"x{p} {geomean(v):.2f}" for p, v in speedups.items() if v)
        print(f"geometric-mean speed-up of fastsoftmax ({pass_}): {means}", file=out)
    failures: dict[tuple, list] = {}
    notes: dict[tuple, list] = {}
    for r in recs:
        if r["error"]:
            where = f"{r['pass']} {r['dtype']} {r['M']}x{r['N']}"
            (failures if not r["ok"] else notes).setdefault((r["impl"], r["error"]), []).append(where)
    for title, group in (("unsupported", failures), ("timed, but less accurate than fastsoftmax", notes)):
        if group:
            print(f"\n{title} (implementation: error, on which problems):", file=out)
        for (impl, error), where in group.items():
            shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
            print(f"  {impl}: {error} ({shown})", file=out)
    h = doc["host_us"]
    print(
        f"\nhost overhead per eager call, 1x4096 fp32: fastsoftmax {h['fastsoftmax']:.1f} us, torch "
        f"{h['torch']:.1f} us",
        file=out,
    )


def print_masked(doc: dict, out: TextIO = STDOUT) -> None:
    """--masked: a row per (case, pass, dtype), GB/s per implementation, % of copy and the speed-up over torch
    for fastsoftmax auto; then every error."""
    copy, recs = doc["copy_gbps"], doc["records"]
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    print(
        f"{doc['device']}: copy {copy:.0f} GB/s; scores {tuple(doc['shape'])} -> (B, H, S, S); {doc['method']}",
        file=out,
    )
    print(
        f"{'case':15} {'pass':4} {'dtype':9}" + "".join(f" {i[:18]:>18}" for i in impls) + "  %copy  xtorch", file=out
    )
    for case in dict.fromkeys(r["case"] for r in recs):
        for pass_ in dict.fromkeys(r["pass"] for r in recs):
            for dt in dict.fromkeys(r["dtype"] for r in recs):
                row = {r["impl"]: r for r in recs if (r["case"], r["pass"], r["dtype"]) == (case, pass_, dt)}
                cells = "".join(f" {(_num(r['gbps']) if r['ok'] else 'unsupported'):>18}" for r in row.values())
                f, t = row.get("fastsoftmax"), row.get("torch")
                pct = f" {100 * f['gbps'] / copy:5.0f}%" if f and f["ok"] else "      -"
                sp = f" {f['gbps'] / t['gbps']:7.2f}" if f and f["ok"] and t and t["ok"] else "       -"
                print(f"{case:15} {pass_:4} {dt:9}{cells} {pct}{sp}", file=out)
    for r in recs:
        if r["error"]:
            print(f"  {r['impl']} {r['case']} {r['pass']} {r['dtype']}: {r['error']}", file=out)


def print_ce(doc: dict, out: TextIO = STDOUT) -> None:
    """--ce: a row per (pass, dtype, shape), GB/s per implementation and % of copy for fastsoftmax; then every
    error."""
    copy, recs = doc["copy_gbps"], doc["records"]
    impls = list(dict.fromkeys(r["impl"] for r in recs))
    print(f"{doc['device']}: copy {copy:.0f} GB/s; cross-entropy, mean over rows (1 in 7 ignored)", file=out)
    print(f"{'pass':8} {'dtype':9} {'shape':14}" + "".join(f" {i[:14]:>14}" for i in impls) + "  %copy", file=out)
    for pass_ in dict.fromkeys(r["pass"] for r in recs):
        for dt in dict.fromkeys(r["dtype"] for r in recs):
            for m, v in dict.fromkeys((r["M"], r["N"]) for r in recs):
                row = {r["impl"]: r for r in recs if (r["pass"], r["dtype"], r["M"], r["N"]) == (pass_, dt, m, v)}
                cells = "".join(f" {(_num(r['gbps']) if r['ok'] else 'unsupported'):>14}" for r in row.values())
                f = row.get("fastsoftmax")
                pct = f" {100 * f['gbps'] / copy:5.0f}%" if f and f["ok"] else "      -"
                print(f"{pass_:8} {dt:9} {f'{m}x{v}':14}{cells} {pct}", file=out)
    for r in recs:
        if r["error"]:
            print(f"  {r['impl']} {r['pass']} {r['dtype']} {r['M']}x{r['N']}: {r['error']}", file=out)


def plot(doc: dict, path: str) -> None:
    """GB/s against N per implementation, one panel per (pass, dtype), the copy bandwidth as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(f"--plot needs matplotlib ({e}); pip install 'fastsoftmax[bench]'") from e
    recs = [r for r in doc["records"] if r["ok"]]
    panels = list(dict.fromkeys((r["pass"], r["dtype"]) for r in doc["records"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (pass_, dt) in zip(axes[0], panels, strict=True):
        for impl in dict.fromkeys(r["impl"] for r in doc["records"]):
            widest = {}  # per N, the shape with the most rows (the bandwidth shape, not the few-rows one)
            for r in recs:
                mine = (r["impl"], r["pass"], r["dtype"]) == (impl, pass_, dt)
                if mine and r["M"] > widest.get(r["N"], {"M": 0})["M"]:
                    widest[r["N"]] = r
            pts = sorted((n, best_gbps(r)) for n, r in widest.items())
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        ax.axhline(doc["copy_gbps"], color="k", linestyle="--", label="copy (1 GiB)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (row length)")
        ax.set_ylabel("GB/s (read + written)")
        ax.set_title(f"{pass_} {dt} - {doc['device']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
