"""Docs from data: every figure the markdown files of DOCS quote, rendered from the committed result files.

A markdown file holds generated regions, a table or a figure inside a sentence:

    <!-- generated: NAME ARGS -->text<!-- /generated -->

`python -m fastsoftmax.bench.docs` rewrites the text of every region in place; `--check` rewrites nothing and
exits 1 naming each region whose text differs from what the files give. Files are read under bench/results/.

Figures (FILE, then a JSON pointer into it, then ` | FORMAT`):
    value FILE POINTER     the one field the pointer names
    range FILE POINTER     lo-hi over every field it names (one figure when they agree)
    geomean FILE POINTER   their geometric mean (report's rule)
    count FILE POINTER     how many fields it names
    ratio FILE A ; B       lo-hi of A's fields over B's, pairwise (A and B name as many)
    quote FILE POINTER     the figure after ` | `, which the text field named must contain (a figure a file
                           keeps only in its prose: `decision`, `finding`)
A pointer step is a key, a list index, `*` (every key or item) or a filter `[key=value,key!=value,...]` (the
list items whose fields match; `a|b` is either value). On records of a suite file (`fastsoftmax bench`), a
last step may also be derived as report.py derives it: `best` (GB/s, the CUDA-graph figure where higher),
`pct` (best as % of the file's copy_gbps), `same` (% of the same-bytes `copy` twin), `graph` (graph_gbps over
gbps), `x_PEER` (best over best of PEER's twin, as print_tables), `xe_PEER` / `xg_PEER` (eager / CUDA-graph GB/s
over PEER's). FORMAT: an optional scale (`/1e9`, `*100`), then a format spec (`,.0f`) or `date` (its first 10
characters).
Tables (no arguments unless said): readme_softmax_speedups, perf_softmax_summary, perf_softmax_shapes PASS,
perf_ce, readme_lce, perf_lce, perf_staged_milestones, perf_cpu; each docstring names the file and fields.
A field the file lacks raises DocsError naming the region, the file and the field; no text is kept stale.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

from .peers import SAME_BYTES
from .report import best_gbps, geomean

REGION = re.compile(r"<!-- generated: (?P<name>.+?) -->(?P<text>.*?)<!-- /generated -->", re.S)
DOCS = ("README.md", "docs/*.md", "bench/results/README.md")  # every file rendered and checked
LABELS = {"torch": "torch", "torch.compile": "torch.compile", "liger": "Liger", "quack": "QuACK"}


class DocsError(Exception):
    """A region that cannot be rendered from the files: the message names the file and the field."""


def repo_root() -> Path:
    """The checkout this module sits in (src/fastsoftmax/bench/docs.py), else the working directory."""
    here = Path(__file__).resolve().parents[3]
    return here if (here / "bench" / "results").is_dir() else Path.cwd()


@functools.cache
def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise DocsError(f"no result file {path}")
    return json.loads(path.read_text())


# --- pointers -------------------------------------------------------------------------------------------------


def _text(v) -> str:
    return "null" if v is None else ("true" if v is True else "false" if v is False else str(v))


def _matches(item, conds: list[tuple[str, bool, set[str]]]) -> bool:
    return isinstance(item, dict) and all((k in item and _text(item[k]) in vals) == eq for k, eq, vals in conds)


def _filter(step: str) -> list[tuple[str, bool, set[str]]]:
    conds = [re.fullmatch(r"([^=!]+)(!?=)(.*)", cond.strip()).groups() for cond in step[1:-1].split(",")]
    return [(key, op == "=", set(vals.split("|"))) for key, op, vals in conds]


def _twin(doc: dict, rec: dict, impl: str, ok: bool = True) -> dict | None:
    """impl's record of the same problem as rec (pass, dtype, M, N, case); with ok, only one that ran right."""
    key = tuple(rec.get(k) for k in ("pass", "dtype", "M", "N", "case"))
    for r in doc["records"]:
        if r["impl"] == impl and tuple(r.get(k) for k in ("pass", "dtype", "M", "N", "case")) == key:
            return r if r["ok"] or not ok else None
    return None


def derived(doc: dict, rec: dict, name: str) -> float | None:
    """A figure report.py derives from a suite record (module docstring); None where the twin did not run."""
    if not rec.get("ok"):
        return None
    if name in ("best", "pct", "graph"):
        own = {"best": (best_gbps(rec), 1), "pct": (100 * best_gbps(rec), doc["copy_gbps"])}
        a, b = own.get(name, (rec["graph_gbps"], rec["gbps"]))
    else:
        kind, _, peer = ("same", "", SAME_BYTES) if name == "same" else name.partition("_")
        if (twin := _twin(doc, rec, peer)) is None:
            return None
        pairs = {"x": (best_gbps(rec), best_gbps(twin)), "same": (100 * best_gbps(rec), best_gbps(twin))}
        pairs |= {"xe": (rec["gbps"], twin["gbps"]), "xg": (rec["graph_gbps"], twin["graph_gbps"])}
        a, b = pairs[kind]
    return a / b if a and b else None


def select(doc: dict, pointer: str) -> list:
    """Every value the pointer names (see the module docstring); DocsError where a step finds nothing."""
    nodes = [doc]
    for raw in pointer.strip("/").split("/"):
        step = raw.replace("~1", "/").replace("~0", "~")
        out = []
        for node in nodes:
            if step == "*":
                out += list(node.values() if isinstance(node, dict) else node)
            elif step.startswith("[") and step.endswith("]"):
                out += [item for item in node if _matches(item, _filter(step))]
            elif isinstance(node, dict) and step in node:
                out.append(node[step])
            elif isinstance(node, list) and step.lstrip("-").isdigit() and -len(node) <= int(step) < len(node):
                out.append(node[int(step)])
            elif isinstance(node, dict) and "impl" in node and re.fullmatch(r"best|pct|same|graph|xe?_.+|xg_.+", step):
                value = derived(doc, node, step)
                out += [] if value is None else [value]
            else:
                raise DocsError(f"no {step!r} in {pointer!r}")
        if not out:
            raise DocsError(f"nothing matches {step!r} in {pointer!r}")
        nodes = out
    return nodes


def fmt(value, spec: str = "") -> str:
    """FORMAT of the module docstring: an optional scale, then a format spec or `date`."""
    for part in spec.split():
        if part[0] in "/*" and part[1:2].isdigit():
            value = value / float(part[1:]) if part[0] == "/" else value * float(part[1:])
        elif part == "date":
            value = str(value)[:10]
        else:
            value = format(value, part)
    return str(value)


def _span(values: list, spec: str) -> str:
    lo, hi = fmt(min(values), spec), fmt(max(values), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def figure(kind: str, results: Path, args: str) -> str:
    file, _, rest = args.strip().partition(" ")
    pointer, _, spec = rest.partition(" | ")
    doc = load(results, file)
    if kind == "ratio":
        a, b = (select(doc, p.strip()) for p in pointer.split(" ; "))
        if len(a) != len(b):
            raise DocsError(f"{pointer!r}: {len(a)} numerators, {len(b)} denominators")
        return _span([x / y for x, y in zip(a, b, strict=True)], spec)
    values = select(doc, pointer.strip())
    if kind in ("range", "geomean"):  # a null field: a case that did not run
        values = [v for v in values if v is not None] or values
    if kind == "quote":
        if len(values) != 1 or spec not in str(values[0]):
            raise DocsError(f"{pointer!r} does not say {spec!r}")
        return spec
    if kind == "count":
        return str(len(values))
    if kind == "value" and len(values) != 1:
        raise DocsError(f"{pointer!r} names {len(values)} fields, not one")
    if kind == "geomean":
        return fmt(geomean(values), spec)
    return _span(values, spec) if kind == "range" else fmt(values[0], spec)


# --- tables ---------------------------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n" + "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _fs(doc: dict, **where) -> list[dict]:
    """fastsoftmax's (`auto`) records of a suite file matching `where`."""
    return [r for r in doc["records"] if r["impl"] == "fastsoftmax" and all(r[k] == v for k, v in where.items())]


def _mean_x(doc: dict, pass_: str, peer: str) -> str:
    values = [v for r in _fs(doc, **{"pass": pass_}) if (v := derived(doc, r, f"x_{peer}")) is not None]
    return f"{geomean(values):.2f}" if values else "-"


def readme_softmax_speedups(results: Path) -> str:
    """h200.json (softmax fwd, bwd) and h200_ce.json (cross-entropy fwd, fwd+bwd): the geometric mean of `auto`'s
    speed-up over each peer on the shapes both ran, GB/s by report.best_gbps (print_tables' rule), bf16 and fp32."""
    suite, ce = load(results, "h200.json"), load(results, "h200_ce.json")
    which = [("softmax forward", suite, "fwd"), ("softmax backward", suite, "bwd")]
    which += [("cross-entropy forward", ce, "fwd"), ("cross-entropy forward + backward", ce, "fwd+bwd")]
    rows = [[label, *(_mean_x(doc, p, peer) for peer in LABELS)] for label, doc, p in which]
    head = ["geometric mean of `auto`'s speed-up, bf16 + fp32", *(f"x {v}" for v in LABELS.values())]
    return _table(head, rows)


def perf_softmax_summary(results: Path) -> str:
    """h200.json: per pass, the geometric mean of `auto`'s speed-up over each peer (x_PEER) and of its GB/s as a
    share of the same-bytes copy at the same shape (`same`)."""
    doc = load(results, "h200.json")
    rows = []
    for p, label in (("fwd", "softmax forward"), ("bwd", "softmax backward")):
        same = geomean([v for r in _fs(doc, **{"pass": p}) if (v := derived(doc, r, "same"))])
        if p == "fwd":
            dtypes = list(dict.fromkeys(r["dtype"] for r in _fs(doc, **{"pass": p})))
            shapes = len(_fs(doc, **{"pass": p, "dtype": dtypes[0]}))
            label += f" ({' + '.join(_short(dt) for dt in dtypes)}, {shapes} shapes each)"
        rows.append([label, *(_mean_x(doc, p, peer) for peer in LABELS), f"{same:.0f}%"])
    return _table(["", *(f"x {v}" for v in LABELS.values()), "% of the same-bytes copy"], rows)


def _short(dtype: str) -> str:
    return dtype.replace("bfloat", "bf").replace("float", "fp")


def perf_softmax_shapes(results: Path, pass_: str) -> str:
    """h200.json, one pass: per shape and dtype `auto`'s GB/s (best; * where a CUDA-graph replay was timed), as %
    of copy_gbps (pct) and of the same-bytes copy (same), and its speed-up over torch and QuACK (x_torch,
    x_quack)."""
    doc = load(results, "h200.json")
    dtypes = list(dict.fromkeys(r["dtype"] for r in doc["records"]))
    head, rows = ["M x N"], []
    for dt in dtypes:
        head += [_short(dt), "% copy", "% same bytes", "x torch", "x QuACK"]
    for m, n in dict.fromkeys((r["M"], r["N"]) for r in _fs(doc, **{"pass": pass_})):
        row = [f"{m} x {n}"]
        for dt in dtypes:
            (r,) = _fs(doc, **{"pass": pass_, "dtype": dt, "M": m, "N": n})
            best = best_gbps(r)
            cells = [(f"{best:,.0f}" if best >= 10 else f"{best:.2g}") + ("*" if r["graph_gbps"] else "")]
            for name, spec in (("pct", ".0f"), ("same", ".0f"), ("x_torch", ".2f"), ("x_quack", ".2f")):
                v = derived(doc, r, name)
                cells.append("-" if v is None else format(v, spec) + ("%" if spec == ".0f" else ""))
            row += cells
        rows.append(row)
    return _table(head, rows)


def perf_ce(results: Path) -> str:
    """h200_ce.json: per dtype, pass and shape, fastsoftmax's eager / CUDA-graph GB/s (gbps, graph_gbps), eager
    as % of copy_gbps, the peers' eager GB/s, QuACK's both and fastsoftmax's speed-up over them (xe_, xg_)."""
    doc = load(results, "h200_ce.json")
    rows = []
    for dt in dict.fromkeys(r["dtype"] for r in doc["records"]):
        for p in dict.fromkeys(r["pass"] for r in doc["records"]):
            for r in _fs(doc, **{"dtype": dt, "pass": p}):
                peers = {i: _twin(doc, r, i) for i in ("torch", "torch.compile", "liger", "quack")}
                q, err = peers["quack"], (_twin(doc, r, "quack", ok=False) or {}).get("error") or ""
                bad = "NaN loss" if "nan" in err.lower() else "fails"
                quack = f"{q['gbps']:,.0f} / {q['graph_gbps']:,.0f}" if q else bad
                vs = f"{derived(doc, r, 'xe_quack'):.2f} / {derived(doc, r, 'xg_quack'):.2f}" if q else bad
                row = [p, f"{r['M']} x {r['N']}", _short(dt)]
                row += [f"{r['gbps']:,.0f} / {r['graph_gbps']:,.0f}", f"{100 * r['gbps'] / doc['copy_gbps']:.0f}%"]
                row += [f"{t['gbps']:,.0f}" if t else "fails" for t in list(peers.values())[:3]] + [quack, vs]
                rows.append(row)
    head = ["pass", "M x V", "dtype", "fastsoftmax eager / graph", "% copy (eager)", "torch", "torch.compile"]
    return _table(head + ["Liger", "QuACK eager / graph", "x QuACK eager / graph"], rows)


def _ms(v: float) -> str:
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def _lce(results: Path, columns: dict[str, str], ratio: set[str]) -> str:
    doc = load(results, "h200_lce.json")
    recs = {(r["impl"], r["N"], r["d"], r["V"]): r for r in doc["records"]}
    columns = {k: c for k, c in columns.items() if any(k == impl for impl, *_ in recs)}  # (impls the file ran)
    rows = []
    for n, d, v in dict.fromkeys((r["N"], r["d"], r["V"]) for r in doc["records"]):
        row = [f"{n}, {d}, {v}", _ms(recs["floor", n, d, v]["ms"])]
        for impl in columns:
            r = recs.get((impl, n, d, v))
            if r is None or not r["ok"]:
                row.append("fails")
                continue
            x = f" {r['vs_floor']:.2f}x" if impl in ratio else ""
            row.append(f"{_ms(r['ms'])}{x}{' /' if not ratio else ''} {_ms(r['peak_bytes'] / 1e9)}")
        rows.append(row)
    head = [c.format(**doc["peers"]) for c in columns.values()]
    return _table(["N, d, V", "3 GEMMs" if not ratio else "floor", *head], rows)


def readme_lce(results: Path) -> str:
    """h200_lce.json: per (N, d, V) the floor's ms, then each implementation's ms / peak_bytes (GB above the
    inputs); the peers' versions from its `peers`."""
    cols = {"torch": "torch", "compile": "torch.compile", "liger": "Liger {liger}", "cce": "CCE {cce}"}
    return _lce(results, cols | {"fastsoftmax": "fastsoftmax"}, set())


def perf_lce(results: Path) -> str:
    """h200_lce.json: per (N, d, V) the floor's ms, then each implementation's ms, vs_floor (not for CCE and
    our skip, which drop gradient terms) and peak_bytes in GB; an implementation the file did not run has no
    column."""
    cols = {"compile": "torch.compile", "liger": "Liger", "cce": "CCE", "cce_exact": "CCE exact"}
    cols |= {"fastsoftmax": "fastsoftmax", "fastsoftmax_mem": "fastsoftmax, peak at CCE's"}
    cols |= {"fastsoftmax_skip": "fastsoftmax skip_eps 2^-12, peak at CCE's"}
    return _lce(results, cols, {"compile", "liger", "fastsoftmax", "fastsoftmax_mem"})


def perf_staged_milestones(results: Path) -> str:
    """investigations/staged_milestones.json: per milestone its name and the staged variant's GB/s (`staged`) on
    the five long-row cells the page follows."""
    doc = load(results, "investigations/staged_milestones.json")
    cells = [("fwd", "bfloat16", 2048, 65536), ("fwd", "bfloat16", 16384, 37984), ("fwd", "float32", 1024, 131072)]
    cells += [("bwd", "bfloat16", 1024, 131072), ("bwd", "float32", 2048, 65536)]
    rows = []
    for m in doc["milestones"]:
        got = {(r["pass"], r["dtype"], r["M"], r["N"]): r["staged"] for r in m["results"]}
        rows.append([m["milestone"], *(f"{got[c]:,}" if c in got else "" for c in cells)])
    head = [f"{_short(dt)} {p} {m}x{n}" for p, dt, m, n in cells]
    return _table(["step", *head], rows)


def perf_cpu(results: Path) -> str:
    """cpu_torch.json: per case and shape the `ratio` (fastsoftmax / torch), fp32 / bf16."""
    doc = load(results, "cpu_torch.json")
    recs = doc["records"]
    shapes = list(dict.fromkeys((r["M"], r["N"]) for r in recs))
    rows = []
    for case in dict.fromkeys(r["case"] for r in recs):
        row = [case.replace("_fwd_bwd", " fwd+bwd")]
        for m, n in shapes:
            got = {r["dtype"]: r for r in recs if (r["case"], r["M"], r["N"]) == (case, m, n)}
            if set(got) != {"float32", "bfloat16"}:
                raise DocsError(f"cpu_torch.json has {sorted(got)} for {case} {m}x{n}, not fp32 and bf16")
            row.append(" / ".join(f"{got[dt]['ratio']:.2f}" for dt in sorted(got)[::-1]))
        rows.append(row)
    return _table(["", *(f"{m}x{n}" for m, n in shapes)], rows)


TABLES = {f.__name__: f for f in (readme_softmax_speedups, perf_softmax_summary, perf_softmax_shapes, perf_ce,
                                  readme_lce, perf_lce, perf_staged_milestones, perf_cpu)}  # fmt: skip
FIGURES = ("value", "range", "geomean", "count", "ratio", "quote")


def render(name: str, results: Path) -> str:
    """The text of the region called `name` (its marker's words; `\\|` stands for `|`, as a marker in a table
    cell must write it: GitHub's tables split a row at every bare `|`, inside a comment too)."""
    kind, _, args = name.replace("\\|", "|").strip().partition(" ")
    try:
        if kind in FIGURES:
            return figure(kind, results, args)
        if kind in TABLES:
            return TABLES[kind](results, *args.split())
    except DocsError as e:
        raise DocsError(f"{name}: {e}") from None
    except (KeyError, IndexError, TypeError, ValueError) as e:
        reads = (TABLES[kind].__doc__ or "").split(":")[0] if kind in TABLES else args.split(" ")[0]
        raise DocsError(f"{name}: {reads} lacks a field it reads ({type(e).__name__}: {e})") from None
    raise DocsError(f"unknown region {kind!r}; regions: {', '.join(FIGURES + tuple(TABLES))}")


def update(text: str, results: Path, where: str = "") -> tuple[str, list[str]]:
    """The text with every region rendered again, and `file:line name` of each region that changed."""
    changed = []

    def one(m: re.Match) -> str:
        line = f"{where}:{text.count(chr(10), 0, m.start()) + 1}"
        try:
            new = render(m["name"], results)
        except DocsError as e:
            raise DocsError(f"{line} {e}") from None
        indent = text[text.rfind("\n", 0, m.start()) + 1 : m.start()]
        if indent.isspace():  # a table inside a list item keeps the item's indentation
            new = new.replace("\n", "\n" + indent)
        if new != m["text"]:
            changed.append(f"{line} {m['name']}")
        return f"<!-- generated: {m['name']} -->{new}<!-- /generated -->"

    return REGION.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastsoftmax.bench.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 naming every region that differs")
    p.add_argument("--root", type=Path, default=None, help="the repository (default: this checkout)")
    args = p.parse_args(argv)
    root = args.root or repo_root()
    results, stale = root / "bench" / "results", []
    for path in [p for pattern in DOCS for p in sorted(root.glob(pattern))]:
        text = path.read_text()
        try:
            new, changed = update(text, results, str(path.relative_to(root)))
        except DocsError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        stale += changed
        if changed and not args.check:
            path.write_text(new)
    for line in stale:
        print(("differs: " if args.check else "rewrote: ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    raise SystemExit(main())
