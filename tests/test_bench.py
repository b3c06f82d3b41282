"""`fastsoftmax bench`: the harness on the CPU (a smoke run: JSON schema, plot, peers that cannot import
shown as unsupported with their error), and the table arithmetic on known records. Its GPU figures come
from the H200 (bench/results/)."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch

from fastsoftmax import bench, heuristics
from fastsoftmax.bench import tuning as sweep
from fastsoftmax.heuristics import device as gpu
from fastsoftmax.heuristics import tables
from fastsoftmax.kernels.triton import backend as triton_backend

KEYS = {"impl", "backend", "dtype", "M", "N", "pass", "ms", "gbps", "ok", "error", "graph_ms", "graph_gbps"}
KEYS |= {"err_ratio", "case"}


def test_cpu_smoke_run(tmp_path):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    cmd = [
        sys.executable,
        "-m",
        "fastsoftmax",
        "bench",
        "--device",
        "cpu",
        "--shapes",
        "4x33,3x1000",
        "--dtypes",
        "float32,bfloat16",
        "--impls",
        "fastsoftmax,fastsoftmax-triton,torch,quack,copy",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    assert {"device", "date", "torch", "triton", "copy_gbps", "records", "host_us"} <= set(doc)
    assert doc["copy_gbps"] > 0 and doc["host_us"]["fastsoftmax"] > 0 and doc["host_us"]["torch"] > 0
    recs = doc["records"]
    assert len(recs) == 2 * 2 * 2 * 5 and all(set(r) == KEYS for r in recs)

    problem = triton_backend.interpreter_problem()  # this Triton's interpreter cannot run here (the H200 image)
    for r in recs:
        if r["impl"] == "quack":  # not importable here: unsupported, with the reason
            assert not r["ok"] and "quack" in r["error"] and r["gbps"] is None
        elif r["impl"] == "fastsoftmax-triton" and problem:
            assert not r["ok"] and problem[:40] in r["error"], r
        elif r["impl"] == "copy":  # the same bytes moved, not a softmax: timed, never checked
            assert r["ok"] and r["err_ratio"] is None and r["gbps"] > 0, r
        else:
            assert r["ok"] and r["error"] is None and r["gbps"] > 0 and r["ms"] > 0, r
    triton = [r for r in recs if r["impl"] == "fastsoftmax-triton"]
    assert all(r["backend"] == "triton" for r in triton)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "unsupported" in run.stdout and "No module named 'quack'" in run.stdout
    assert "host overhead per eager call" in run.stdout
    assert "column 'copy': not a softmax" in run.stdout and "xcopy" not in run.stdout  # no speed-up over it


def rec(impl, gbps, n=1024, pass_="fwd", ok=True, graph=None):
    return {
        "impl": impl,
        "backend": None,
        "dtype": "bfloat16",
        "M": 1 << 17,
        "N": n,
        "pass": pass_,
        "ms": 1.0,
        "gbps": gbps,
        "ok": ok,
        "error": None if ok else "ValueError: refused",
        "graph_ms": None,
        "graph_gbps": graph,
    }


def test_tables_speedups_and_unsupported():
    doc = {
        "device": "test",
        "torch": "t",
        "triton": "t",
        "method": "m",
        "copy_gbps": 4000.0,
        "host_us": {"fastsoftmax": 10.0, "torch": 11.0},
        "records": [
            rec("fastsoftmax", 4000.0),
            rec("torch", 1000.0),
            rec("quack", 2000.0),
            rec("fastsoftmax", 2000.0, n=513),
            rec("torch", 1000.0, n=513),
            rec("quack", None, n=513, ok=False),
            rec("fastsoftmax", 100.0, n=8, graph=800.0),
            rec("torch", 200.0, n=8),
        ],
    }
    out = io.StringIO()
    bench.print_tables(doc, out)
    text = out.getvalue()
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith("bfloat16")}
    assert "100%" in lines["131072x1024"] and "4.00" in lines["131072x1024"] and "2.00" in lines["131072x1024"]
    assert "unsupported" in lines["131072x513"]
    assert "4.00" in lines["131072x8"]  # the CUDA-graph figure counts where measured (800 vs 200)
    assert "xtorch 3.17" in text  # geometric mean of 4, 2, 4


def test_cpu_tune_writes_a_table_auto_can_read(tmp_path):

    out = tmp_path / "t.json"
    cmd = [
        sys.executable,
        "-m",
        "fastsoftmax",
        "bench",
        "--device",
        "cpu",
        "--tune",
        str(out),
        "--shapes",
        "2x64,2x100",
        "--dtypes",
        "float32",
        "--passes",
        "fwd,bwd",
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    problem = triton_backend.interpreter_problem()
    if problem:  # this Triton's interpreter cannot run here: every candidate fails, each with the reason
        assert run.returncode != 0 and run.stderr.count(problem) >= 4 * 3, run.stderr[-3000:]
        return
    assert run.returncode == 0, run.stderr[-3000:]
    doc = tables.validate(json.loads(out.read_text()))
    assert doc["generated_by"] == "fastsoftmax bench --tune" and len(doc["entries"]) == 4
    for e in doc["entries"]:  # the winner is the fastest candidate measured, every candidate kept
        assert e["backend"] == "triton" and f"{e['backend']}/{e['path']}" == tables.pick(e["candidates"], e["default"])
        assert e["candidates"][f"{e['backend']}/{e['path']}"] == e["gbps"]
        assert {"triton/rowblock", "triton/online", "triton/split"} == set(e["candidates"]), run.stderr[-3000:]
    assert tables.choose(doc, "bwd", "float32", 80, 2, 132) == (doc["entries"][3]["backend"], doc["entries"][3]["path"])


def test_tune_times_a_replacing_pick_twice(monkeypatch, device):
    """A candidate that would replace the default is timed again, with the default: an outlier slow timing of
    the default (first timing) does not hand the bucket to another path."""
    calls = []
    scripted = {"triton/rowblock": [10.0, 1.0], "triton/online": [5.0, 5.0], "triton/split": [6.0]}

    def fake_time_ms(fn, device):
        name = f"triton/{heuristics.forced()['path']}"
        calls.append(name)
        return scripted[name].pop(0)

    monkeypatch.setattr(sweep, "time_ms", fake_time_ms)
    monkeypatch.setattr(
        sweep, "candidates", lambda *a: [("triton", "rowblock"), ("triton", "online"), ("triton", "split")]
    )
    monkeypatch.setattr(sweep, "graphed", lambda fn: fn)  # few rows on CUDA: the scripted clock needs no graph
    doc = bench.tune([(2, 64)], ["float32"], ["fwd"], device, progress=None)
    (e,) = doc["entries"]
    # first timings: online (5 ms) beat rowblock (10 ms, the outlier); timed again, rowblock takes 1 ms
    assert calls == ["triton/rowblock", "triton/online", "triton/split", "triton/rowblock", "triton/online"]
    assert e["default"] == "triton/rowblock" and (e["backend"], e["path"]) == ("triton", "rowblock")
    assert e["candidates"]["triton/rowblock"] == 2 * (2 * 64) * 4 / 1.0 / 1e6  # bytes read + written, 1 ms
    assert "probes" not in e  # the default kept: nothing to probe


@pytest.mark.parametrize("inside,won", [(2.0, True), (6.0, False)])
def test_tune_probes_a_pick_inside_its_bucket(monkeypatch, device, inside, won):
    """A pick that replaces the default at the bucket's top length (128) must also beat it at odd lengths
    inside the bucket ((64, 128]: 81 and 97); the entry records those probes."""

    def fake_time_ms(fn, device):
        f = heuristics.forced()
        (n,) = {c.cell_contents.shape[-1] for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)}
        return {"rowblock": 5.0, "online": inside if n == 97 else 2.0, "split": 9.0}[f["path"]]

    monkeypatch.setattr(sweep, "time_ms", fake_time_ms)
    monkeypatch.setattr(
        sweep, "candidates", lambda *a: [("triton", "rowblock"), ("triton", "online"), ("triton", "split")]
    )
    monkeypatch.setattr(sweep, "graphed", lambda fn: fn)  # few rows on CUDA: the scripted clock needs no graph
    doc = bench.tune([(2, 64), (2, 128)], ["float32"], ["fwd"], device, progress=None)
    e = doc["entries"][1]
    assert e["n_max"] == 128 and [p["N"] for p in e["probes"]] == [81, 97]  # a quarter and half way in
    assert all(set(p["candidates"]) == {"triton/rowblock", "triton/online"} for p in e["probes"])
    assert (e["backend"], e["path"]) == (("triton", "online") if won else ("triton", "rowblock"))


def test_tune_takes_a_bucket_won_inside_it(monkeypatch, device):
    """A challenger that ties the default at the bucket's top length (1% faster, under tables.MARGIN) but wins
    clearly at both probes takes the bucket (tables.bucket_pick: geometric mean over the three); one that wins
    on the geometric mean but loses a probe by more than MARGIN does not."""

    def run(times):
        def fake_time_ms(fn, device):
            f = heuristics.forced()
            (n,) = {c.cell_contents.shape[-1] for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)}
            return times[f["path"]].get(n, times[f["path"]]["top"])

        monkeypatch.setattr(sweep, "time_ms", fake_time_ms)
        monkeypatch.setattr(sweep, "candidates", lambda *a: [("triton", "rowblock"), ("triton", "online")])
        monkeypatch.setattr(sweep, "graphed", lambda fn: fn)
        doc = bench.tune([(2, 64), (2, 128)], ["float32"], ["fwd"], device, progress=None)
        assert doc["rule"] == tables.RULE
        e = doc["entries"][1]
        assert e["challenger"] == "triton/online" and [p["N"] for p in e["probes"]] == [81, 97]
        assert f"{e['backend']}/{e['path']}" == tables.entry_path(e, doc["rule"])
        return e["path"]

    tie_top = {"rowblock": {"top": 5.0}, "online": {"top": 5.0 / 1.01, 81: 3.0, 97: 3.0}}
    assert run(tie_top) == "online"
    assert tables.pick({"triton/online": 1.01, "triton/rowblock": 1.0}, "triton/rowblock") == "triton/rowblock"
    loses_inside = {"rowblock": {"top": 5.0}, "online": {"top": 2.0, 81: 2.0, 97: 5.5}}
    assert run(loses_inside) == "rowblock"


def test_tune_band_challenger(monkeypatch, device):
    """Rule "band": at the probes the tuner times the default and every candidate within tables.BAND of the
    fastest at the top length; the best geometric mean over all lengths is the challenger. Here split is
    fastest at the top length, online 7% slower there but far faster inside: online takes the bucket;
    rowblock (the default) and a candidate outside the band are not the challenger."""
    times = {
        "rowblock": {"top": 5.0},
        "split": {"top": 2.0, 81: 4.0, 97: 4.0},
        "online": {"top": 2.14, 81: 1.0, 97: 1.0},
        "cluster": {"top": 2.5, 81: 0.5, 97: 0.5},
    }
    timed = []

    def fake_time_ms(fn, device):
        f = heuristics.forced()
        (n,) = {c.cell_contents.shape[-1] for c in fn.__closure__ if isinstance(c.cell_contents, torch.Tensor)}
        timed.append((f["path"], n))
        return times[f["path"]].get(n, times[f["path"]]["top"])

    monkeypatch.setattr(sweep, "time_ms", fake_time_ms)
    cands = [("triton", "rowblock"), ("triton", "split"), ("triton", "online"), ("cuda", "cluster")]
    monkeypatch.setattr(sweep, "candidates", lambda *a: cands)
    monkeypatch.setattr(sweep, "graphed", lambda fn: fn)
    monkeypatch.setattr(sweep, "check_rows", lambda *a: (0.0, None))
    doc = bench.tune([(2, 64), (2, 128)], ["float32"], ["fwd"], device, progress=None)
    e = doc["entries"][1]
    assert doc["rule"] == tables.RULE == "band"
    assert sorted(p for p, n in timed if n == 81) == ["online", "rowblock", "split"]  # cluster: 0.8x, outside
    assert e["challenger"] == "triton/online" and (e["backend"], e["path"]) == ("triton", "online")
    assert tables.entry_path(e, "band") == "triton/online"
    e["challenger"] = "triton/split"  # a table whose challenger is not what its measurements say
    with pytest.raises(ValueError, match="challenger"):
        tables.entry_path(e, "band")


def test_tune_rows_classes(monkeypatch, device):
    """Both rows classes get their own entries (the threshold lowered so that tiny shapes span both)."""
    monkeypatch.setattr(tables, "FEW_ROWS_PER_SM", 0.01)  # 132 SMs: 1 row is few, 2 or more many
    doc = bench.tune([(1, 64), (3, 64)], ["bfloat16"], ["fwd"], device, progress=None)
    assert [(e["rows"], e["n_max"]) for e in doc["entries"]] == [("few", 64), ("many", 64)]


def test_tuning_buckets():
    entries = [
        {"pass": "fwd", "dtype": "bfloat16", "rows": r, "n_max": n, "backend": b, "path": p}
        for r, n, b, p in [
            ("many", 1024, "triton", "rowblock"),
            ("many", 65536, "cuda", "cluster"),
            ("few", 65536, "triton", "split"),
        ]
    ]
    doc = tables.validate({"device": "x", "date": "d", "arch": tables.arch(gpu.INTERPRETER), "entries": entries})
    assert tables.choose(doc, "fwd", "bfloat16", 513, 4096, 132) == ("triton", "rowblock")
    assert tables.choose(doc, "fwd", "bfloat16", 1024, 4096, 132) == ("triton", "rowblock")
    assert tables.choose(doc, "fwd", "bfloat16", 1025, 4096, 132) == ("cuda", "cluster")
    assert tables.choose(doc, "fwd", "bfloat16", 50257, 8, 132) == ("triton", "split")  # few rows
    assert tables.choose(doc, "fwd", "bfloat16", 65537, 4096, 132) is None  # past the grid: heuristics
    assert tables.choose(doc, "bwd", "bfloat16", 513, 4096, 132) is None
    assert tables.choose(None, "fwd", "bfloat16", 513, 4096, 132) is None
    assert tables.rows_class(263, 132) == "few" and tables.rows_class(264, 132) == "many"
    bad = {"device": "x", "date": "d", "arch": doc["arch"], "entries": [{**entries[0], "rows": "some"}]}
    try:
        tables.validate(bad)
    except ValueError as e:
        assert "malformed" in str(e)
    else:
        raise AssertionError("a malformed entry was accepted")
    assert tables.slug("NVIDIA H200") == "nvidia_h200"
    # a near-tie keeps the default path; a clear win replaces it
    assert tables.pick({"triton/online": 3918.0, "triton/rowblock": 3905.0}, "triton/rowblock") == "triton/rowblock"
    assert tables.pick({"cuda/cluster": 3773.0, "triton/online": 2845.0}, "triton/online") == "cuda/cluster"
    assert tables.pick({"cuda/cluster": 3773.0}, None) == "cuda/cluster"


def test_warm_runs_every_job_in_worker_processes():
    # Two spawned processes, four jobs: the ones that can run fill caches; a broken one is counted, not fatal.
    jobs = bench.jobs_for([(3, 40)], ["float32"], ["fwd", "bwd"], lambda m, n, d, p: ["torch", "no-such-impl"])
    assert len(jobs) == 4 and {j[4] for j in jobs} == {"torch", "no-such-impl"}
    assert bench.warm(jobs, 2, progress=None, device="cpu") == 2
    assert bench.warm(jobs, 0, progress=None, device="cpu") == 0  # jobs=0: nothing runs
    assert bench.default_jobs("cpu") == 0 and 1 <= bench.default_jobs("cuda") <= 12


def test_committed_tables_are_valid():
    """Every committed table loads, names only backends and paths that exist, names per entry what its rule
    makes of its measured candidates and probes (tables.entry_path), and covers both passes, rows classes and
    its dtypes."""
    from importlib import resources

    from fastsoftmax import dispatch, heuristics

    files = [
        f for f in resources.files("fastsoftmax").joinpath("heuristics", "tables").iterdir() if f.name.endswith(".json")
    ]
    assert files, "no tuning table committed"
    for f in files:
        doc = tables.validate(json.loads(f.read_text()))
        assert tables.slug(doc["device"]) == f.name[:-5]
        facts = gpu.Facts(doc["device"], **doc["arch"])
        assert tables.lookup(facts) == (f.name[:-5], doc, "exact")  # what backend='auto' reads on that GPU
        assert doc["arch"]["sm_count"] == doc["sm_count"]
        for e in doc["entries"]:
            assert e["backend"] in dispatch.BACKENDS
            assert e["path"] in (heuristics.PATHS if e["backend"] == "triton" else heuristics.CUDA_PATHS)
            assert f"{e['backend']}/{e['path']}" == tables.entry_path(e, doc.get("rule")), e
            assert e["gbps"] == e["candidates"][f"{e['backend']}/{e['path']}"]
        keys = {(e["pass"], e["dtype"], e["rows"]) for e in doc["entries"]}
        assert {(p, "bfloat16", r) for p in ("fwd", "bwd") for r in ("few", "many")} <= keys
        big = max(e["n_max"] for e in doc["entries"])
        assert tables.choose(doc, "fwd", "bfloat16", big + 1, 4096, doc["sm_count"]) is None  # past the table
        assert tables.choose(doc, "fwd", "bfloat16", 300, 1 << 20, doc["sm_count"]) is not None


def test_check_before_timing_peer_slack_and_wrong_results():
    """fastsoftmax must be within its tolerance to be timed; a peer is timed up to PEER_SLACK times it (the
    error recorded), and a wrong peer (NaN, far off) is unsupported with the reason."""
    import torch

    x = torch.randn(4, 300, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)) * 3
    j = int(x[0].float().argmax())  # the largest probability of row 0: far above the absolute tolerance
    y, dy = torch.softmax(x, -1), torch.randn(4, 300, dtype=torch.bfloat16)
    ref = torch.softmax(x.double(), -1)

    def built(scale):  # softmax off by a relative `scale` on one element of the first row
        def out():
            o = ref.clone()
            o[0, j] *= 1 + scale
            return o.to(torch.bfloat16)

        return (lambda x: out), (lambda dy, y: None)

    def run(name, scale):
        return bench.measure(name, built(scale), "fwd", x, y, dy, 1, "cpu", False)

    ok = run("torch", 0.0)
    assert ok.ok and ok.error is None and ok.err_ratio <= 1 and ok.gbps > 0
    slightly = 0.04  # bf16's tolerance is ~2^-8 relative: ~10x over it
    peer = run("torch", slightly)
    assert peer.ok and peer.gbps > 0 and 1 < peer.err_ratio <= bench.PEER_SLACK and "less accurate" in peer.error
    own = run("fastsoftmax", slightly)
    assert not own.ok and own.gbps is None and "wrong result" in own.error
    far = run("torch", 1.0)
    assert not far.ok and "wrong result" in far.error


def test_cpu_masked_smoke_run(tmp_path):
    """--masked: attention scores with a padding mask, causal, both; every implementation checked first, the
    mask bytes counted; the Triton kernels run in the interpreter here."""

    out_json = tmp_path / "m.json"
    cmd = [
        sys.executable,
        "-m",
        "fastsoftmax",
        "bench",
        "--device",
        "cpu",
        "--masked",
        "--attention",
        "2,2,40",
        "--impls",
        "fastsoftmax,fastsoftmax-triton,torch",
        "--json",
        str(out_json),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    recs = doc["records"]
    assert doc["shape"] == [2, 2, 40] and len(recs) == 3 * 2 * 2 * 3
    assert {r["case"] for r in recs} == {"padding", "causal", "padding+causal"}
    for r in recs:
        if r["impl"] == "fastsoftmax-triton" and triton_backend.interpreter_problem():
            assert not r["ok"]
        else:
            assert r["ok"] and r["err_ratio"] <= 1 and r["gbps"] > 0, r
    assert "padding+causal  bwd" in run.stdout


def test_cpu_ce_smoke_run(tmp_path):
    """--ce: cross-entropy forward and forward + backward, each implementation checked first; peers that cannot
    import are unsupported with the reason."""
    out_json = tmp_path / "ce.json"
    cmd = [
        sys.executable,
        "-m",
        "fastsoftmax",
        "bench",
        "--device",
        "cpu",
        "--ce",
        "--shapes",
        "16x300,8x513",
        "--dtypes",
        "float32",
        "--impls",
        "fastsoftmax,torch,quack",
        "--json",
        str(out_json),
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = json.loads(out_json.read_text())["records"]
    assert len(recs) == 2 * 3 * 2 and {r["pass"] for r in recs} == {"fwd", "fwd+bwd"}
    for r in recs:
        if r["impl"] == "quack":
            assert not r["ok"] and "quack" in r["error"]
        else:
            assert r["ok"] and r["err_ratio"] <= 1 and r["gbps"] > 0, r


def test_cpu_lce_smoke_run(tmp_path, monkeypatch):
    """--lce: the LM-head loss, fwd+bwd to dx and dW, through the CLI's main on the CPU: every record has its
    errors against fp32 torch; the GPU-only peers are skipped with the reason, never fatal; memory= small
    enough that fastsoftmax_mem runs in several chunks."""
    from fastsoftmax import cli

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for --device cpu; restored after the test
    out_json = tmp_path / "lce.json"
    impls = "floor,torch,fs_logits,fastsoftmax,fastsoftmax_mem,liger,cce,quack"
    argv = ["bench", "--lce", "--device", "cpu", "--impls", impls, "--lce-memory", "32000", "--json", str(out_json)]
    assert cli.main(argv) == 0
    doc = json.loads(out_json.read_text())
    assert {"device", "date", "torch", "triton", "copy_gbps", "records", "method", "peers", "memory"} <= set(doc)
    recs = {r["impl"]: r for r in doc["records"]}
    assert list(recs) == impls.split(",") and doc["memory"] == 32000
    assert all((r["N"], r["d"], r["V"], r["dtype"]) == (64, 32, 1000, "float32") for r in recs.values())
    assert all({"peak_bytes", "loss_err", "dx_err", "dw_err", "ms", "ok", "error"} <= set(r) for r in recs.values())
    assert recs["floor"]["ok"] and recs["floor"]["ms"] > 0 and recs["floor"]["loss_err"] is None
    for name in ("liger", "cce", "quack"):
        assert not recs[name]["ok"] and recs[name]["error"] == "skipped: needs CUDA", recs[name]
    for name in ("torch", "fs_logits", "fastsoftmax", "fastsoftmax_mem"):
        r = recs[name]
        assert r["ok"] and r["error"] is None and r["ms"] > 0 and r["peak_bytes"] is None, r
        assert r["vs_floor"] > 0 and max(r["loss_err"], r["dx_err"], r["dw_err"]) < 1e-5, r
    assert recs["fastsoftmax_mem"]["memory"] == 32000 and recs["fastsoftmax"]["memory"] is None
    assert recs["fastsoftmax_mem"]["plan"].endswith("splits=8")  # 32000 B / (1000 x 4 B) = 8 rows per chunk


def test_check_loss_rows(device, monkeypatch):
    """`fastsoftmax check`'s loss rows: cross-entropy with every option and the LM-head loss's four designs
    pass against float64 torch, and a gradient 1% off (the backward scaling of the designs that compute the
    gradients in the forward: chunked, and sliced or fused for a scalar loss) fails them."""
    import torch

    from fastsoftmax import cli
    from fastsoftmax.ops import lm_head

    rows = cli._loss_rows(device, [torch.float32, torch.bfloat16], torch.Generator().manual_seed(0))
    assert len(rows) == 2 * (2 + 4 * 3)
    assert all(r[5] for r in rows), [r for r in rows if not r[5]]
    paths = {"triton/cross_entropy", "triton/lce_chunked", "triton/lce_recompute", "triton/lce_sliced"}
    paths.add("triton/lce_fused")
    assert {r[0] for r in rows} == paths
    scaled = lm_head._scaled
    monkeypatch.setattr(lm_head, "_scaled", lambda ctx, g, b, *gr: tuple(t * 1.01 for t in scaled(ctx, g, b, *gr)))
    rows = cli._loss_rows(device, [torch.float32], torch.Generator().manual_seed(0))
    bad = {(r[0], r[3]) for r in rows if not r[5]}
    bad_paths = ("lce_chunked", "lce_sliced", "lce_fused")
    assert bad == {(f"triton/{p}", g) for p in bad_paths for g in ("lce_dx", "lce_dw")}, bad
