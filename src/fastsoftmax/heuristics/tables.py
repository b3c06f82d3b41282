"""The tables `backend="auto"` reads on a GPU: for each (pass, dtype, row-length bucket, rows class), the
backend and path that were fastest on the GPU a table was measured on, measured by `fastsoftmax bench
--tune` and committed as src/fastsoftmax/heuristics/tables/<device>.json (dated, with the GB/s of every
candidate). No autotuning at call time.

A table is keyed by the architecture it was measured on (its "arch": compute capability, SMs, shared memory
per block, cluster limit), never by the GPU's name: a GPU with the same facts reads it ("exact"); an
unlisted GPU of the same compute capability reads the table nearest to it in SMs and shared memory
("nearest"; the rows class still counts the GPU's own SMs); any other GPU, or a problem outside the table's
buckets, gets the Triton backend with heuristics/softmax_triton.py's rules.

Buckets: an entry measured at row length n_max covers (previous n_max, n_max]; lengths past the largest
measured one have no entry. A path other than the default must win over the bucket: at n_max and at odd
lengths a quarter and half way in (bench.tune's probes, recorded in the entry; the rule, RULE, is named in
the table and entry_path applies it). Rows class: "few" when
there are fewer than FEW_ROWS_PER_SM rows per SM (the GPU is filled only by spreading a row over several
SMs), else "many".

Measurements behind the rule: bench/results/sweeps/tuning_rule.json.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import re
from importlib import resources

from .device import Facts

FEW_ROWS_PER_SM = 2
MARGIN = 0.03  # another candidate replaces the default path only when it is this much faster where measured
FIELDS = ("pass", "dtype", "rows", "n_max", "backend", "path")


ARCH = ("cc", "sm_count", "smem_per_block", "cluster_max")  # the facts a table is keyed by


def slug(device_name: str) -> str:
    """A table's file name (the GPU it was measured on, for people; lookups go by its "arch")."""
    return re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")


def arch(facts: Facts) -> dict:
    """The facts a table measured on this GPU is keyed by."""
    return {k: getattr(facts, k) for k in ARCH}


@functools.cache
def committed() -> tuple[tuple[str, dict], ...]:
    """(file stem, table) of every committed table, validated (read once, at the first lookup)."""
    out = []
    for f in sorted(resources.files(__package__).joinpath("tables").iterdir(), key=lambda f: f.name):
        if f.name.endswith(".json"):
            out.append((f.name[:-5], validate(json.loads(f.read_text()))))
    return tuple(out)


def lookup(facts: Facts, tables=None) -> tuple[str | None, dict | None, str]:
    """(file stem, table, match) for a GPU: match "exact" (a table measured on these facts), "nearest" (the
    closest table of the same compute capability: by the ratios of SMs and of shared memory per block, then
    the cluster limit), or "none" (None, None). ``tables``: (stem, table) pairs (default: committed())."""
    key = arch(facts)
    same = [(stem, doc) for stem, doc in (committed() if tables is None else tables) if doc["arch"]["cc"] == facts.cc]
    for stem, doc in same:
        if doc["arch"] == key:
            return stem, doc, "exact"
    if not same:
        return None, None, "none"

    def distance(item):
        a = item[1]["arch"]
        return (
            abs(math.log(a["sm_count"] / facts.sm_count)) + abs(math.log(a["smem_per_block"] / facts.smem_per_block)),
            a["cluster_max"] != facts.cluster_max,
            item[0],
        )

    stem, doc = min(same, key=distance)
    return stem, doc, "nearest"


@functools.cache
def for_device(facts: Facts) -> dict | None:
    """The table backend='auto' reads on this GPU (lookup's), or None: cached per GPU, as choose() runs on
    every auto call."""
    return lookup(facts)[1]


def validate(doc: dict) -> dict:
    """A table's shape, checked once when it is read (a malformed committed table fails loudly)."""
    for key in ("device", "date", "entries", "arch"):
        if key not in doc:
            raise ValueError(f"tuning table lacks {key!r}")
    if not isinstance(doc["arch"], dict) or sorted(doc["arch"]) != sorted(ARCH):
        raise ValueError(f"tuning table's arch must give {', '.join(ARCH)}: {doc['arch']!r}")
    for e in doc["entries"]:
        missing = [k for k in FIELDS if k not in e]
        if missing or e["rows"] not in ("few", "many") or e["pass"] not in ("fwd", "bwd"):
            raise ValueError(f"malformed tuning entry {e}")
    return doc


def pick(candidates: dict[str, float], default: str | None) -> str:
    """The 'backend/path' an entry names: the fastest candidate, unless the default path (what the heuristics
    pick without a table) is within MARGIN of it. A table entry covers a bucket of lengths but is measured
    at one: a near-tie there (0.3% at N = 1024) must not send N = 513 down a path that is 2x slower for it."""
    best = max(candidates, key=candidates.get)
    if default in candidates and candidates[best] < (1 + MARGIN) * candidates[default]:
        return default
    return best


RULE = "band"  # how `bench --tune` decides an entry (recorded in the table, checked by entry_path)
BAND = 0.9  # rule "band": candidates within this fraction of the fastest at the top length are timed at probes


def bucket_pick(points: list[tuple[float, float]], challenger: str, default: str) -> str:
    """An entry's path from (challenger GB/s, default GB/s) pairs measured at the bucket's top length and at
    its probes inside: the challenger when its geometric-mean speed-up over them is at least 1 + MARGIN and
    it is nowhere slower by more than MARGIN, else the default. (A win at the top length alone missed
    buckets a path wins inside.)"""
    ratios = [c / d for c, d in points]
    geo = math.prod(ratios) ** (1 / len(ratios))
    return challenger if geo >= 1 + MARGIN and min(ratios) >= 1 - MARGIN else default


def band(cands: dict, default: str) -> list[str]:
    """Rule "band": the candidates other than the default within BAND of the fastest at the top length, the
    ones timed again at the probes."""
    top = max(cands.values())
    return [name for name, g in cands.items() if name != default and g >= BAND * top]


def band_challenger(e: dict) -> str | None:
    """Rule "band": of the candidates timed at the top length and at every probe (without error), the one
    other than the default with the best geometric mean of GB/s over those lengths; with no probe, the
    fastest at the top length when that is not the default; else none. A path that ties or loses at the top
    length can win inside (the staged forward at 37984-50257)."""
    default, cands, probes = e["default"], e["candidates"], e.get("probes", [])
    if not probes:
        others = {k: v for k, v in cands.items() if k != default}
        return max(others, key=others.get) if others and max(cands, key=cands.get) != default else None
    names = [k for k in cands if k != default and all(k in p["candidates"] for p in probes)]
    if not names:
        return None

    def geo(k):
        vals = [cands[k]] + [p["candidates"][k] for p in probes]
        return math.prod(vals) ** (1 / len(vals))

    return max(names, key=geo)


def entry_path(e: dict, rule: str | None) -> str:
    """The 'backend/path' a table entry must name, recomputed from what it recorded (its candidates at the
    bucket's top length, its probes) under the table's rule: what tests check a committed table against.
    Tables of another rule (earlier versions) raise: re-tune."""
    if rule != RULE:
        raise ValueError(f"a table of rule {rule!r}: this version decides entries by rule {RULE!r} (re-tune)")
    default, cands, probes = e["default"], e["candidates"], e.get("probes", [])
    if default not in cands:
        return pick(cands, default)
    challenger = band_challenger(e)
    if challenger is None:
        return default
    if e.get("challenger") != challenger:
        raise ValueError(f"entry names challenger {e.get('challenger')}, its measurements {challenger}: {e}")
    if any(default not in p["candidates"] for p in probes):
        return default
    points = [(cands[challenger], cands[default])] + [
        (p["candidates"][challenger], p["candidates"][default]) for p in probes
    ]
    return bucket_pick(points, challenger, default)


def rows_class(n_rows: int, sm_count: int) -> str:
    return "few" if n_rows < FEW_ROWS_PER_SM * sm_count else "many"


_indexes: dict[int, tuple[dict, dict]] = {}  # id(doc) -> (doc, index); the doc is kept so its id stays its own


def _index(doc: dict) -> dict:
    """(pass, dtype, rows) -> (sorted n_max list, (backend, path) per n_max), built once per table: choose()
    runs on every auto call, so it must not scan the entries."""
    hit = _indexes.get(id(doc))
    if hit is not None and hit[0] is doc:
        return hit[1]
    groups: dict = {}
    for e in sorted(doc["entries"], key=lambda e: e["n_max"]):
        ns, picks = groups.setdefault((e["pass"], e["dtype"], e["rows"]), ([], []))
        if not ns or ns[-1] != e["n_max"]:
            ns.append(e["n_max"])
            picks.append((e["backend"], e["path"]))
    _indexes[id(doc)] = (doc, groups)
    return groups


def choose(doc: dict | None, pass_: str, dtype: str, n: int, n_rows: int, sm_count: int) -> tuple[str, str] | None:
    """(backend, path) for the problem from table ``doc``, or None when the table has no bucket for it."""
    if doc is None:
        return None
    group = _index(doc).get((pass_, dtype, rows_class(n_rows, sm_count)))
    if group is None:
        return None
    i = bisect.bisect_left(group[0], n)  # the smallest n_max >= n
    return group[1][i] if i < len(group[0]) else None
