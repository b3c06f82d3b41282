"""The CUDA backend without a GPU: every variant compiles with NVRTC (sm_90a, and sm_80 where it applies)
and its code has the facts it promises; the compile cache (memory, disk, threads, processes); compiler
errors reach Python with the log; variant selection; clear errors before any launch."""

import functools
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

import fastsoftmax as fs
from fastsoftmax import cache as disk_cache
from fastsoftmax import heuristics
from fastsoftmax.heuristics import device as gpu
from fastsoftmax.heuristics import softmax_cuda
from fastsoftmax.heuristics.softmax_cuda import VARIANTS, launch_shape
from fastsoftmax.kernels.cuda import build, kernels
from fastsoftmax.kernels.cuda.kernels import config_for, function_attributes

pytest.importorskip("cuda.bindings.nvrtc", reason="the CUDA backend's NVRTC bindings are a default dependency")

H200 = gpu.INTERPRETER
A100 = gpu.Facts("NVIDIA A100-SXM4-80GB", 108, 80, 166912, 167936)

CASES = [  # (variant, dtype, n, rows): what each variant runs on an H200
    ("three_pass", "float32", 513, 4096),
    ("warp", "bfloat16", 513, 4096),
    ("warp", "float32", 100, 4096),  # a sub-warp row (8 threads): the CTA reduction compiled out
    ("warp", "float32", 1024, 4096),
    ("block", "bfloat16", 8192, 4096),
    ("block", "float32", 16384, 4096),
    ("cluster", "bfloat16", 262144, 128),
    ("cluster", "float32", 262144, 8),
    ("cluster", "float16", 65536, 64),
    ("online", "bfloat16", 1 << 21, 512),
    ("online", "float32", 1 << 20, 4),
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("cubins")
    build._memory.clear()  # the facts come from this module's own compiles (with their ptxas -v lines)
    old = os.environ.get("FASTSOFTMAX_CACHE_DIR")
    os.environ["FASTSOFTMAX_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("FASTSOFTMAX_CACHE_DIR")
    else:
        os.environ["FASTSOFTMAX_CACHE_DIR"] = old


def registers(cfg) -> int:
    """Registers per thread of cfg's sm_90a cubin: from ptxas -v in NVRTC's log, else (the H200 image's NVRTC
    logs none) from the driver."""
    regs = build.ptxas_facts(build.compile_kernel(cfg, "sm_90a").log)["registers"]
    if regs == 0 and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        regs = function_attributes(cfg, torch.cuda.current_device())["registers"]
    return regs


# CTA barriers (bar.sync) per entry point, by variant: the one before the per-warp partials are read in
# reduce() (block, cluster, online), the staged slice's two more (its mbarriers initialised before the copies
# are issued; every wait past before they are invalidated); none in a warp's row. A barrier dropped from the
# source (each was tried) changes these counts: no CPU test saw it before.
BARRIERS = {"warp": 0, "block": 1, "cluster": 1, "online": 1, "staged": 3}


def barriers(ptx: str) -> dict:
    """bar.sync (barrier.sync) instructions per entry point of ``ptx``."""
    entries = ptx.split(".entry ")[1:]
    return {e.split("(")[0]: len(re.findall(r"\bbar(?:rier)?\.sync", e)) for e in entries}


def compiled(variant, dtype, n, rows, backward, arch="sm_90a"):
    facts = gpu.with_cc(int(arch[3:5]))
    shape, cfg = config_for(variant, dtype, n, backward=backward, n_rows=rows, facts=facts)
    ptx = build.compile_kernel(cfg, arch, "ptx").binary.decode()
    facts = build.ptxas_facts(build.compile_kernel(cfg, arch).log)
    return shape, cfg, ptx, facts


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("variant,dtype,n,rows", CASES)
def test_variant_compiles_with_its_facts(cache, variant, dtype, n, rows, backward):
    shape, cfg, ptx, facts = compiled(variant, dtype, n, rows, backward)
    assert shape.variant == variant
    assert (shape.cluster > 1) == (variant == "cluster" or (variant, rows) == ("online", 4))
    assert f".entry {cfg.entry}(" in ptx
    if variant != "three_pass":  # softmax and log_softmax: an entry point each, no runtime branch between them
        assert f".entry {cfg.entry_for(True)}(" in ptx and cfg.entry_for(True) == cfg.entry + "_log"
        if backward:  # softmax's backward has no exp; log_softmax's has (f = exp(y))
            soft, log = (ptx.split(f".entry {name}(")[1].split(".entry")[0] for name in (cfg.entry, cfg.entry + "_log"))
            assert "ex2.approx" not in soft and "ex2.approx" in log
    log = build.compile_kernel(cfg, "sm_90a").log
    assert "warning" not in log, log
    if facts["registers"] == 0 and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        # The H200 image's NVRTC returns an empty log (no ptxas -v lines): the driver reports the same facts
        # for the loaded cubin. (CI's NVRTC prints them: the branch below is the one CI takes.)
        attrs = function_attributes(cfg, torch.cuda.current_device())
        assert attrs["registers"] > 0 and attrs["local_bytes"] == 0, (cfg, attrs)
    else:
        assert facts["registers"] > 0, f"no ptxas -v lines in the NVRTC {build.nvrtc_version()} log of {cfg}:\n{log}"
        assert facts["spill_stores"] == facts["spill_loads"] == facts["stack_bytes"] == 0, facts
    if variant == "three_pass":
        # the seed kernel: scalar accesses, shared-memory trees with barriers between the passes
        assert "ld.global.v4" not in ptx and ptx.count("bar.sync") >= 2
    else:
        assert set(barriers(ptx).values()) == {BARRIERS[variant]}, barriers(ptx)
        # 16-byte accesses for the row body (scalar code stays for edges and strided rows)
        assert re.search(r"ld\.global(\.nc)?\.v4\.[ubf]32", ptx) and re.search(r"st\.global\.v4\.[ubf]32", ptx)
    if shape.cluster > 1:  # the cluster variant, and the online one spreading few rows
        assert "barrier.cluster.arrive" in ptx and "barrier.cluster.wait" in ptx and "mapa.shared::cluster" in ptx
        assert "ld.shared::cluster" in ptx and "st.async" not in ptx  # partials read remotely (staged: pushed)
    else:
        assert "barrier.cluster" not in ptx
    if not backward:
        assert "ex2.approx" in ptx  # as fs.info() says
        if cfg.online:  # outputs exp2((x - m)*log2 e - log2 s) by ex2.approx.ftz (one instruction per element)
            assert "ex2.approx.ftz.f32" in ptx
        else:  # held exp values scaled by one IEEE (correctly rounded) 1/sum per row
            assert "rcp.rn.f32" in ptx or "div.rn.f32" in ptx


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("variant", ["three_pass", "warp", "block", "online"])
def test_sm80_variants_compile(cache, variant, backward):
    n = {"three_pass": 4096, "warp": 1000, "block": 8192, "online": 1 << 20}[variant]
    shape, cfg, ptx, facts = compiled(variant, "bfloat16", n, 4096, backward, arch="sm_80")
    assert ".target sm_80" in ptx and facts["spill_stores"] == 0


def test_cluster_needs_sm90():
    with pytest.raises(ValueError, match="sm_90"):
        launch_shape(65536, 8, 2, A100, "cluster")
    assert launch_shape(65536, 8, 2, A100).variant == "online"  # auto on an A100


def test_auto_variants():
    h200 = dict(facts=H200)
    assert launch_shape(513, 1 << 16, 2, **h200).variant == "warp"
    assert launch_shape(2048, 1 << 16, 2, **h200).variant == "warp"
    assert launch_shape(4096, 1 << 16, 2, **h200).variant == "block"
    assert launch_shape(32768, 4096, 2, **h200).variant == "block"
    assert launch_shape(32768, 16, 2, **h200).variant == "cluster"  # few rows: spread
    assert launch_shape(65536, 4096, 2, **h200).variant == "cluster"
    assert launch_shape(262144, 512, 4, **h200).variant == "cluster"
    assert launch_shape(524288, 512, 2, **h200).variant == "cluster"
    assert launch_shape(524289, 512, 4, **h200).variant == "online"
    assert launch_shape(262144, 512, 2, inputs=2, **h200).variant == "cluster"  # backward: half the bf16
    assert launch_shape(262145, 512, 2, inputs=2, **h200).variant == "online"
    few = launch_shape(131072, 8, 2, **h200)
    assert few.variant == "cluster" and few.cluster == 16  # 8 rows x 16 CTAs: the whole GPU works
    assert launch_shape(1 << 20, 4, 4, **h200).cluster == 16  # online spreads too
    with pytest.raises(ValueError, match="at most"):
        launch_shape(4096, 64, 4, H200, "warp")


def test_memory_and_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    cfg = build.Config("fwd", "float32", "bfloat16", group=32, rows=4, k=2)  # a config no other test uses
    calls = []
    real = build._nvrtc
    monkeypatch.setattr(build, "_nvrtc", lambda *a: calls.append(a) or real(*a))

    results = []
    threads = [threading.Thread(target=lambda: results.append(build.compile_kernel(cfg, "sm_90a"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len({r.binary for r in results}) == 1  # four threads, one compile
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".cubin", ".log"]
    build._memory.clear()  # a new process: the disk cache answers, NVRTC is not called
    again = build.compile_kernel(cfg, "sm_90a")
    assert len(calls) == 1 and again.binary == results[0].binary


def test_two_processes_compile_at_once(tmp_path, monkeypatch):
    code = (
        "from fastsoftmax.kernels.cuda import build; "
        "c = build.compile_kernel(build.Config('bwd', 'float16', 'float32', 'bfloat16', group=64, k=4), 'sm_90a'); "
        "print(len(c.binary))"
    )
    env = {**os.environ, "FASTSOFTMAX_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-c", code]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    sizes = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs) and sizes[0] == sizes[1]
    (cubin,) = tmp_path.glob("*.cubin")
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    assert str(len(disk_cache.load(cubin.name))) == sizes[0] and not list(tmp_path.glob(".tmp-*"))


def test_compile_error_carries_the_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "source", lambda: b"this is not CUDA;\n")
    with pytest.raises(build.CompileError, match="error") as e:
        build.compile_kernel(build.Config("fwd", "float32", "float32"), "sm_90a")
    assert "softmax.cu" in str(e.value)


def test_compiles_leave_python_shared_bytes_alone(tmp_path):
    """Regression: NVRTC's log, cubin and PTX were read into ``b" " * size``, which for an empty log (size 1)
    is CPython's shared one-byte object b" " itself: NVRTC wrote its terminating NUL into it, and every space
    print() wrote afterwards came out as a NUL byte (seen on the H200: "RES\x000.000243"). Every compile path
    (cubin and PTX of softmax.cu, a program whose log is empty) runs in a fresh process, which then checks
    b" " and prints spaces."""
    code = (
        "from fastsoftmax.kernels.cuda import build\n"
        "cfg = build.Config('fwd', 'float32', 'float16', group=16, rows=8)\n"
        "build.compile_kernel(cfg, 'sm_90a'); build.compile_kernel(cfg, 'sm_90a', output='ptx')\n"
        "empty = build._nvrtc(b'__global__ void k() {}', ['--gpu-architecture=sm_90a'], 'cubin', 'k')\n"
        "assert empty.log == '' and empty.binary[:4] == b'\\x7fELF', (empty.log, empty.binary[:4])\n"
        "build._nvrtc(b'__global__ void k() {}', ['--gpu-architecture=sm_90a'], 'ptx', 'k')\n"
        "print('RES', ' '.encode()[0], 'ok')\n"
    )
    env = {**os.environ, "FASTSOFTMAX_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-2000:]
    assert out.stdout.strip() == b"RES 32 ok", out.stdout


def test_every_variant_is_named():
    assert set(VARIANTS) == set(heuristics.CUDA_PATHS)


def test_clear_errors_before_launch():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="CUDA tensors only"):
        fs.softmax(x, backend="cuda")
    with pytest.raises(RuntimeError, match="float16, bfloat16 and float32"):
        fs.softmax(x.double(), backend="cuda")
    with pytest.raises(ValueError, match="unknown path"):
        with heuristics.force(path="warps"):
            pass


def test_info_records_fast_math():
    k = fs.info()["kernels"]["cuda.softmax"]
    assert k["fast_math"] is False and k["fast_exp"] is True and "__expf" in k["exp"]
    assert fs.info()["nvrtc"] == ".".join(map(str, build.nvrtc_version()))


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize(
    "dtype,n,rows,clusters",  # (forward's, backward's): y and dy staged, twice the bytes in a larger budget
    [
        ("bfloat16", 65536, 4096, (2, 4)),
        ("float32", 131072, 8, (16, 16)),
        ("float16", 513, 4096, (1, 1)),
        ("float32", 50257, 8192, (4, 4)),
        ("bfloat16", 37984, 16384, (2, 2)),
        ("bfloat16", 131072, 64, (8, 16)),
    ],
)
def test_staged_compiles_with_its_facts(cache, dtype, n, rows, clusters, backward):
    """The staged variant: bulk copy engine loads into shared memory by pieces, each completed on its own
    mbarrier (the backward's y and dy on the same one); few registers (several CTAs per SM), no spills;
    16-byte shared loads and global stores; the cluster exchange when it has one."""
    shape, cfg, ptx, facts = compiled("staged", dtype, n, rows, backward)
    want = clusters[backward]
    assert (shape.variant, shape.cluster) == ("staged", want) and cfg.staged and cfg.defines()["STAGED"] == 1
    assert set(barriers(ptx).values()) == {BARRIERS["staged"]}, barriers(ptx)
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait.parity" in ptx and "fence.mbarrier_init" in ptx and "mbarrier.inval" in ptx
    assert re.search(r"ld\.shared\.v4\.[ubf]32", ptx) and re.search(r"st\.global\.v4\.[ubf]32", ptx)
    if not backward:  # exp2((x - m)*log2 e - log2 s) by ex2.approx.ftz; 16-bit: packed max and conversions
        assert "ex2.approx.ftz.f32" in ptx
        if dtype != "float32":
            t = "bf16" if dtype == "bfloat16" else "f16"
            assert f"max.NaN.{t}x2" in ptx and f"cvt.rn.{t}x2.f32" in ptx
    assert ("barrier.cluster.arrive" in ptx) == (want > 1)
    if want > 1:  # partials pushed into every CTA (st.async on its mbarrier), none read remotely
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes" in ptx and "ld.shared::cluster" not in ptx
        assert "barrier.cluster.arrive.relaxed" in ptx
    if facts["registers"]:  # CI's NVRTC logs ptxas -v (the H200 image's does not)
        assert 0 < facts["registers"] <= 64 and facts["spill_stores"] == facts["stack_bytes"] == 0, facts
    assert (
        softmax_cuda.stage_bytes(shape, n, 4 if dtype == "float32" else 2, 2 if backward else 1)
        <= softmax_cuda.STAGE_MAX
    )
    with pytest.raises(ValueError, match="sm_90"):
        launch_shape(n, rows, 4, A100, "staged")


def test_staged_spread_rule():
    """The staged variant's cluster: the smallest holding the row in the pass's budget, then, for few rows,
    grown while rows x CTAs < SMs (a vector at least per thread after the doubling) or < SPREAD_CTAS_PER_SM x
    SMs with slices of at least STAGE_SPREAD_MIN bytes; 16 CTAs at most. (H200: 132 SMs.)"""
    ls = functools.partial(launch_shape, facts=H200, variant="staged")
    assert ls(131072, 4096, 2).cluster == 4  # 256 KiB in 64 KiB slices; many rows: no spread
    assert ls(131072, 64, 2).cluster == 8  # 64 x 4 < 4 x 132, slices of 32 KiB at 8, 16 KiB at 16: 8
    assert ls(131072, 64, 4).cluster == 16 and ls(131072, 64, 2, inputs=2).cluster == 16  # 32 KiB slices at 16
    assert ls(262144, 128, 2).cluster == 8  # 128 x 8 >= 4 x 132
    assert ls(131072, 8, 2).cluster == 16  # 8 x 8 < 132: spread past 32 KiB slices
    assert ls(2048, 8, 2).cluster == 1  # 256 vectors: fewer than one per thread of 2 CTAs
    assert ls(4096, 8, 2).cluster == 2
    assert ls(786432, 1, 4).cluster == softmax_cuda.STAGE_CLUSTER_MAX == 16
    with pytest.raises(ValueError, match="holds at most 786432"):
        ls(786436, 1, 4)


@pytest.mark.parametrize("caps", [{}, {"k_max": 2, "group_max": 128}], ids=["default", "capped"])
@pytest.mark.parametrize("inputs", [1, 2], ids=["fwd", "bwd"])
@pytest.mark.parametrize("elsize", [2, 4])
def test_launch_shapes_hold_the_row(elsize, inputs, caps):
    """Every shape launch_shape returns holds the whole row (on-chip variants) in a legal launch: a CTA of
    at most 1024 threads, a cluster of at most 16, at most 8 vectors per thread (4 for a 16-bit backward);
    a variant that cannot hold N raises instead."""
    vec = 16 // elsize
    k_max = min(caps.get("k_max", 8), 8 if inputs == 1 or elsize == 4 else 4)
    for n in sorted(
        {
            1,
            2,
            7,
            8,
            9,
            33,
            255,
            256,
            257,
            513,
            1000,
            1024,
            2049,
            4097,
            12289,
            16384,
            16385,
            32768,
            50257,
            65536,
            131072,
            262144,
            262145,
            524288,
            524289,
            1 << 20,
        }
    ):
        for rows in (1, 8, 64, 4096):
            shape = launch_shape(n, rows, elsize, H200, inputs=inputs, **caps)
            assert shape.variant in VARIANTS
            for variant in VARIANTS:
                try:
                    s = launch_shape(n, rows, elsize, H200, variant, inputs, **caps)
                except ValueError:
                    assert variant in ("warp", "block", "cluster", "staged"), (variant, n)
                    staged_cap = softmax_cuda.STAGE_CLUSTER_MAX * softmax_cuda.STAGE_MAX
                    assert variant != "staged" or inputs * -(-n // vec) * 16 > staged_cap
                    continue
                assert s.variant == variant and 1 <= s.group * s.rows <= 1024 and 1 <= s.cluster <= 16
                if variant in ("warp", "block", "cluster"):
                    assert s.k <= k_max and s.group * s.cluster * s.k * vec >= n, (variant, n, rows, s)
                if variant in ("block", "cluster"):
                    assert s.group <= caps.get("group_max", 512)
                if variant == "cluster":
                    assert s.cluster >= 2
                if variant == "staged":
                    assert softmax_cuda.stage_bytes(s, n, elsize, inputs) <= softmax_cuda.STAGE_MAX
                    assert softmax_cuda.stage_bytes(s, n, elsize, inputs) * s.cluster >= inputs * n * elsize


def test_min_ctas_override_caps_registers():
    """heuristics.force(min_ctas=...) reaches the compile (the occupancy experiments of dev/bench_cuda.py)."""

    shape = launch_shape(4096, 4096, 2, H200, "block")
    x = torch.empty(1, dtype=torch.bfloat16)
    default = kernels._config("fwd", shape, x, x)
    with heuristics.force(min_ctas=16):
        capped = kernels._config("fwd", shape, x, x)
    assert "MIN_CTAS_SET" not in default.defines() and capped.defines()["MIN_CTAS_SET"] == 16
    regs = [registers(c) for c in (default, capped)]
    assert regs[1] <= 65536 // (16 * shape.group) < regs[0]
    with pytest.raises(ValueError, match="min_ctas"):
        with heuristics.force(min_ctas=0):
            pass
