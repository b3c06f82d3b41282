"""Other GPUs, drivers and installs than the H200 the tables were measured on: the table lookup by
architecture (an unlisted GPU of the same architecture reads the nearest table; others the rules), the CUDA
launch rules evaluated for parts we do not have (sm_80, sm_100, sm_120: every launch within that part's
limits, and the kernels compile for it), the version check between NVRTC and the driver, and the CUDA
backend absent (its `[cu13]` extra not installed): `auto` runs the Triton kernels and says so. The GPU
tests at the end run the emulated cases on the H200."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import assert_close, random_logits

import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.bench import tuning as sweep
from fastsoftmax.core.reference import compare_grad
from fastsoftmax.heuristics import device as gpu
from fastsoftmax.heuristics import softmax_cuda, softmax_triton, tables
from fastsoftmax.kernels.cuda import backend as cuda_backend

H200 = gpu.INTERPRETER
# Parts we have no access to, from their published device properties (SMs, compute capability, shared
# memory a block may opt in to, shared memory per SM): what device.of would read on them.
PARTS = {
    "A100": gpu.Facts("NVIDIA A100-SXM4-80GB", 108, 80, 166912, 167936),
    "A10": gpu.Facts("NVIDIA A10", 72, 86, 101376, 102400),
    "H100_PCIe": gpu.Facts("NVIDIA H100 PCIe", 114, 90, 232448, 233472),
    "GH200": gpu.Facts("NVIDIA GH200 480GB", 132, 90, 232448, 233472),
    "B200": gpu.Facts("NVIDIA B200", 148, 100, 232448, 233472),
    "RTX5090": gpu.Facts("NVIDIA GeForce RTX 5090", 170, 120, 101376, 102400),
}
LENGTHS = [1, 7, 33, 257, 513, 1024, 2049, 4097, 12289, 16385, 32768, 50257, 65536, 131072, 262145, 524289, 1 << 20]


def test_cluster_limits_follow_the_architecture():
    assert [gpu.cluster_limit(cc) for cc in (80, 86, 89, 90, 100, 103, 110, 120, 121)] == [1, 1, 1, 16, 16, 16, 8, 8, 8]
    assert not PARTS["A100"].cluster and PARTS["RTX5090"].cluster_max == 8 and H200.cluster_max == 16
    assert gpu.with_cc(80).cluster_max == 1 and gpu.with_cc(80).arch == "sm_80"


def test_table_lookup_by_architecture_not_name():
    """The H200's table is read by any GPU with its facts (a GH200, an H200 NVL) whatever its name, by an
    unlisted sm_90 GPU as the nearest table, and by no other architecture."""
    stem, doc, match = tables.lookup(H200)
    assert (stem, match) == ("nvidia_h200", "exact") and doc["arch"] == tables.arch(H200)
    assert tables.lookup(PARTS["GH200"])[1:] == (doc, "exact")
    assert tables.lookup(gpu.Facts("NVIDIA H200 NVL", 132, 90, 232448, 233472))[2] == "exact"
    assert tables.lookup(PARTS["H100_PCIe"]) == ("nvidia_h200", doc, "nearest")
    for part in ("A100", "A10", "B200", "RTX5090"):
        assert tables.lookup(PARTS[part]) == (None, None, "none"), part
    assert tables.for_device(PARTS["H100_PCIe"]) is doc and tables.for_device(PARTS["A100"]) is None


def test_nearest_table_is_the_closest_of_its_architecture():
    def table(sms, smem, cc=90):
        arch = {"cc": cc, "sm_count": sms, "smem_per_block": smem, "cluster_max": gpu.cluster_limit(cc)}
        return tables.validate({"device": f"g{sms}", "date": "d", "arch": arch, "entries": []})

    docs = [("big", table(132, 232448)), ("small", table(78, 232448)), ("ampere", table(80, 166912, cc=80))]
    pick = tables.lookup(gpu.Facts("x", 84, 90, 232448, 233472), docs)
    assert pick[0] == "small" and pick[2] == "nearest"  # 84 SMs: 78 is nearer than 132
    assert tables.lookup(gpu.Facts("x", 120, 90, 232448, 233472), docs)[0] == "big"
    assert tables.lookup(gpu.Facts("x", 80, 80, 166912, 167936), docs)[2] == "exact"
    assert tables.lookup(gpu.Facts("x", 80, 86, 101376, 102400), docs)[2] == "none"  # sm_86 is not sm_80
    with pytest.raises(ValueError, match="arch"):
        tables.validate({"device": "x", "date": "d", "arch": {"cc": 90}, "entries": []})


def _check_cuda_shape(part, s, n, elsize, inputs):
    """A launch the part can make: at most 1024 threads a CTA, a cluster within its limit (1 without
    clusters), a staged CTA's shared memory within what a block may opt in to, 16-byte vectors holding the
    row on the on-chip variants."""
    assert 1 <= s.group * s.rows <= 1024, s
    assert 1 <= s.cluster <= part.cluster_max, (part.name, s)
    if s.variant == "staged":
        smem = softmax_cuda.stage_bytes(s, n, elsize, inputs) + softmax_cuda.STAGE_STATIC
        assert smem <= part.smem_per_block, (part.name, n, s, smem)
    if s.variant in ("warp", "block", "cluster"):
        assert s.group * s.cluster * s.k * (16 // elsize) >= n, (part.name, n, s)


@pytest.mark.parametrize("name", sorted(PARTS))
def test_cuda_launch_rules_fit_each_part(name):
    """What the CUDA rules launch on each part, chosen (auto) or forced, for every length, rows class, dtype
    size and pass: within the part's limits, or refused with a ValueError before any launch."""
    part = PARTS[name]
    for elsize in (2, 4):
        for inputs in (1, 2):
            for n in LENGTHS:
                for rows in (1, 8, 64, 4096):
                    s = softmax_cuda.launch_shape(n, rows, elsize, part, inputs=inputs)
                    assert s.variant in softmax_cuda.VARIANTS
                    assert part.cluster or s.variant not in ("cluster", "staged"), (name, n, s)
                    _check_cuda_shape(part, s, n, elsize, inputs)
                    for variant in softmax_cuda.VARIANTS:
                        try:
                            s = softmax_cuda.launch_shape(n, rows, elsize, part, variant, inputs)
                        except ValueError as e:
                            assert variant != "online" and variant != "three_pass", (name, variant, n, e)
                            if variant in ("cluster", "staged") and not part.cluster:
                                assert "clusters" in str(e)
                            continue
                        _check_cuda_shape(part, s, n, elsize, inputs)


def test_staged_budgets_follow_shared_memory():
    """On the H200 the measured budgets; on a part with 100 KiB of shared memory per SM, budgets that still
    let 3 forward (2 backward) CTAs share an SM, and a slice cap within a block's opt-in."""
    assert softmax_cuda.stage_budget(H200, 1) == softmax_cuda.STAGE_BYTES
    assert softmax_cuda.stage_budget(H200, 2) == softmax_cuda.STAGE_BYTES_BWD
    assert softmax_cuda.stage_max(H200) == softmax_cuda.STAGE_MAX
    small = PARTS["RTX5090"]
    for inputs, ctas in ((1, 3), (2, 2)):
        budget = softmax_cuda.stage_budget(small, inputs)
        assert 0 < budget and ctas * (budget + softmax_cuda.STAGE_STATIC) <= small.smem_per_sm
    assert softmax_cuda.stage_max(small) + softmax_cuda.STAGE_STATIC <= small.smem_per_block


def test_triton_rules_fit_each_part():
    """The Triton rules read only the SM count: warps within a CTA, splits within their cap, and the split
    path's programs filling that part's SMs."""
    for part in PARTS.values():
        for n in LENGTHS:
            for rows in (1, 8, 4096):
                for elsize, inputs in ((2, 1), (4, 2)):
                    s = softmax_triton.launch_shape(n, rows, elsize, False, part.sm_count, inputs=inputs)
                    assert 1 <= s.num_warps <= 32 and 1 <= s.splits <= softmax_triton.MAX_SPLITS
                    if s.path == "split":
                        assert rows * s.splits >= min(
                            softmax_triton.SPLIT_PROGRAMS_PER_SM * part.sm_count, -(-n // s.block_n)
                        )


def _nvrtc_available():
    try:
        from cuda.bindings import nvrtc  # noqa: F401

        from fastsoftmax.kernels.cuda.build import nvrtc_version

        nvrtc_version()
    except Exception as e:
        return str(e)
    return None


@pytest.mark.skipif(_nvrtc_available() is not None, reason="needs NVRTC (the cu13 extra, part of the test extra)")
@pytest.mark.parametrize("name", ["A100", "RTX5090", "B200"])
def test_cuda_kernels_compile_for_each_part(name, tmp_path, monkeypatch):
    """The launches the rules make on each part compile for its architecture, with registers a CTA of that
    size can have (ptxas -v, where NVRTC logs it)."""
    from fastsoftmax.kernels.cuda import build
    from fastsoftmax.kernels.cuda.kernels import config_for

    monkeypatch.setenv("FASTSOFTMAX_CACHE_DIR", str(tmp_path))
    part = PARTS[name]
    cases = [("bfloat16", 513, 4096), ("float32", 8192, 4096), ("bfloat16", 65536, 64), ("float32", 1 << 20, 4)]
    if part.cluster:
        cases += [("bfloat16", 131072, 8)]
    seen = set()
    for dtype, n, rows in cases:
        for backward in (False, True):
            for variant in (None, "staged") if part.cluster else (None,):
                try:
                    shape, cfg = config_for(variant, dtype, n, backward=backward, n_rows=rows, facts=part)
                except ValueError:  # a forced staged launch that cannot hold the row here (checked above)
                    assert variant == "staged"
                    continue
                if cfg in seen:
                    continue
                seen.add(cfg)
                ptx = build.compile_kernel(cfg, part.arch, "ptx").binary.decode()
                assert f".target {part.arch}" in ptx
                log = build.compile_kernel(cfg, part.arch).log
                regs = build.ptxas_facts(log)["registers"]
                threads = shape.group * shape.rows
                assert regs or torch.cuda.is_available(), log  # (the H200 image's NVRTC logs no ptxas -v lines)
                assert regs * threads <= part.regs_per_sm, (cfg, regs)
    assert any(c.staged for c in seen) == part.cluster


def test_tuning_lists_the_cuda_variants(monkeypatch):
    """Regression: candidates() shadowed its `device` argument with the heuristics module, so `bench --tune`
    on a GPU timed no CUDA variant and a re-tuned table could never name one."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gpu, "of", lambda index: H200)
    monkeypatch.setattr(cuda_backend, "off", lambda: None)
    names = [f"{b}/{p}" for b, p in sweep.candidates(50257, 8, 2, "fwd", "cuda")]
    assert {"cuda/cluster", "cuda/online", "cuda/staged", "triton/split"} <= set(names), names
    assert all(b == "triton" for b, _ in sweep.candidates(50257, 8, 2, "fwd", "cpu"))


def test_version_check_before_any_module(monkeypatch):
    """NVRTC of a newer CUDA major than the driver: the CUDA backend is off with what to install; a newer
    NVRTC minor of the same major is fine (minor-version compatibility)."""
    monkeypatch.setattr(cuda_backend, "import_error", lambda: None)
    cases = {
        ((12, 8), (13, 0)): "fastsoftmax[cu12]",
        ((13, 0), (13, 2)): None,
        ((13, 1), (12, 9)): None,
        ((13, 0), None): "NVRTC's library does not load",
        (None, (13, 0)): "cuDriverGetVersion",
    }
    for (drv, rtc), want in cases.items():
        monkeypatch.setattr(cuda_backend, "versions", lambda d=drv, r=rtc: (d, r))
        cuda_backend.version_problem.cache_clear()
        got = cuda_backend.version_problem()
        assert (got is None) if want is None else (want in got), (drv, rtc, got)
    cuda_backend.version_problem.cache_clear()
    monkeypatch.undo()
    cuda_backend.version_problem.cache_clear()


BLOCKED = """
import sys
sys.modules["cuda.bindings"] = None  # what a machine without the cu13 / cu12 extra has
import json, torch
import fastsoftmax as fs
from fastsoftmax import heuristics
from fastsoftmax.kernels.cuda import backend as cuda_backend
out = {"import_error": cuda_backend.import_error(), "off": cuda_backend.off(), "info": fs.info()["backends"]["cuda"]}
if torch.cuda.is_available():
    x = torch.randn(8, 50257, device="cuda", dtype=torch.bfloat16)  # the H200 table: the CUDA backend (staged)
    with heuristics.recording() as plans:
        y = fs.softmax(x, -1)
    ref = torch.softmax(x.double(), -1)
    out["plans"] = [p.backend for p in plans]
    out["err"] = (y.double() - ref).abs().max().item()
    out["auto"] = fs.info()["auto"]
    try:
        fs.softmax(x, -1, backend="cuda")
    except RuntimeError as e:
        out["forced"] = str(e)
print(json.dumps(out))
"""


def test_cuda_backend_absent(device):
    """Without the CUDA backend's packages: it is off with what to install, fs.info() says so, `auto` runs
    the Triton kernels (on a GPU: correct, on a shape whose table entry is the CUDA backend's), and
    backend='cuda' raises the reason."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "fastsoftmax[cu13]" in out["import_error"] and out["off"] == out["import_error"]
    assert out["info"]["cuda"] is False
    if device == "cuda":
        facts = gpu.of(torch.cuda.current_device())
        table = tables.for_device(facts)
        pick = tables.choose(table, "fwd", "bfloat16", 50257, 8, facts.sm_count)
        assert pick is None or pick[0] == "cuda", pick  # (the case is meant to be one the table routes to CUDA)
        assert out["plans"] == ["triton"] and out["err"] < 2e-3, out
        assert "fastsoftmax[cu13]" in out["info"]["off"] and "Triton" in out["auto"]["cuda:0"]["runs"], out
        assert "fastsoftmax[cu13]" in out["forced"]


# ---- on a GPU: the emulated cases --------------------------------------------------------------------

EMULATED = [  # facts device.of is made to return on this GPU (the launches must still fit the real one)
    ("unknown_sm90", gpu.Facts("NVIDIA H100 PCIe (emulated)", 114, 90, 232448, 233472), "nearest"),
    ("no_table", gpu.Facts("NVIDIA H200 (emulated: an architecture without a table)", 132, 91, 232448, 233472), "none"),
]
GPU_SHAPES = [(4096, 513), (256, 2048), (64, 8192), (8, 50257), (512, 32768), (4, 131072)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name,facts,match", EMULATED, ids=[e[0] for e in EMULATED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_emulated_gpu_every_path_correct(name, facts, match, dtype, monkeypatch):
    """On the H200 posing as another GPU: `auto` follows the table lookup (the nearest table's choices, or
    the Triton rules without one), and every call is correct, forward and backward, against the float64
    oracle."""
    monkeypatch.setattr(gpu, "of", lambda index: facts)
    assert tables.lookup(facts)[2] == match
    table = tables.for_device(facts)
    for m, n in GPU_SHAPES:
        x = random_logits((m, n), dtype, torch.Generator().manual_seed(n)).cuda().requires_grad_()
        dy = torch.randn(m, n, generator=torch.Generator().manual_seed(m)).to(x)
        with heuristics.recording() as plans, heuristics.force(poison=True):
            y = fs.softmax(x, -1)
            (dx,) = torch.autograd.grad(y, x, dy)
        assert_close(y, x, -1, False)
        err, problem = compare_grad(dx, dy, y, -1, False)
        assert problem is None, (name, m, n, problem)
        pick = tables.choose(table, "fwd", str(dtype).removeprefix("torch."), n, m, facts.sm_count)
        want = pick[0] if pick and not (pick[0] == "cuda" and cuda_backend.off()) else "triton"
        assert plans[0].backend == want, (name, m, n, plans[0], pick)
        if want == "cuda":
            assert plans[0].path == pick[1]
