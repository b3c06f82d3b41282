"""Snapshot facts of the compiled Triton kernels, without a GPU: every variant the heuristics table can
produce compiles for sm_90a and sm_80, moves data with 16-byte vector instructions (scalar code only for
the edges of rows that are not 16-byte aligned), uses ex2.approx, and spills nothing (ptxas -v) but where
heuristics/softmax_triton.py takes a measured spill (the backward rowblock whose tile's body is past BWD_LONG_N).

The kernels are compiled in a separate process (tests/compile_facts.py): the interpreter tests in this
process need TRITON_INTERPRET=1, under which Triton hands out interpreted functions that cannot compile."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import fastsoftmax as fs
from fastsoftmax.heuristics import softmax_triton


def _compile_facts(*args):
    # No GPU and a fresh Triton cache: the facts come from compiling here, never from kernels that an
    # earlier GPU test cached, and are the same on a GPU machine as in CI.
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_CACHE_DIR=cache)
        script = Path(__file__).with_name("compile_facts.py")
        out = subprocess.run(
            [sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=1800
        )
    if out.returncode != 0:
        pytest.fail(f"compile_facts.py failed (exit {out.returncode}):\n{out.stderr[-6000:]}", pytrace=False)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def facts():
    return _compile_facts()


def test_cross_entropy_kernels():
    """The cross-entropy kernels at their launch shapes compile for sm_90a with no spills; aligned rows
    (V = 32000, 151936) are read, and dlogits written, with 16-byte accesses; odd V (50257: rows not 16-byte
    aligned) falls back to narrower ones (no edge split there yet: 53-62% of copy forward on the H200). The
    one-program forward (8 rows of 4096) too."""
    ce = _compile_facts("ce")
    assert {(f["kernel"], f["dtype"], f["v"]) for f in ce} == {
        (k, d, v) for k in ("ce_fwd", "ce_bwd") for d in ("bfloat16", "float32") for v in (32000, 50257, 151936)
    } | {("ce_fwd_one", d, 4096) for d in ("bfloat16", "float32")}
    for f in ce:
        assert f["registers"] > 0 and not (f["spill_stores"] or f["spill_loads"] or f["stack_bytes"]), f
        if f["v"] % 16 == 0:
            assert "ld.global.v4.b32" in f["loads"], f
            if f["kernel"] == "ce_bwd":
                assert "st.global.v4.b32" in f["stores"], f
        else:
            assert "ld.global.v4.b32" not in f["loads"], f


def test_lm_head_fused_kernels():
    """The LM-head loss's fused GEMMs (lce_fused: lse_gemm, dlogits_gemm) at heuristics/lm_head.fused_shape's
    tiles compile for sm_90a with no spills, with and without every option's epilogue code; their 16-bit
    GEMMs run on warpgroup MMA (wgmma, bf16 in, fp32 sums), fp32's on FMA units (full precision)."""
    facts = _compile_facts("lm_head")
    assert {(f["kernel"], f["dtype"], f["options"]) for f in facts} == {
        (k, d, o) for k in ("lse_gemm", "dlogits_gemm") for d in ("bfloat16", "float32") for o in (False, True)
    }
    for f in facts:
        assert f["registers"] > 0 and not (f["spill_stores"] or f["spill_loads"] or f["stack_bytes"]), f
        if f["dtype"] == "bfloat16":
            assert f["mma"] == [f"wgmma.mma_async.sync.aligned.m64n{f['bn']}k16.f32.bf16.bf16"], f
        else:
            assert not f["mma"], f


def test_shard_kernels():
    """The tensor-parallel slice's kernels (triton/shard.py) at their launch shapes compile for sm_90a with no
    spills and no reordering reshape on multi-row tiles; aligned slices (64128, 128000 classes) are read,
    and dlogits / softmax written, with 16-byte accesses."""
    facts = _compile_facts("shard")
    assert len(facts) == 18 and {(f["kernel"], f["mode"]) for f in facts} == {
        ("shard_stats", None),
        ("shard_apply", 2),
        ("shard_apply", 0),
    }
    for f in facts:
        assert f["registers"] > 0 and not (f["spill_stores"] or f["spill_loads"] or f["stack_bytes"]), f
        assert not (f["reorders"] and f["rows"] > 1), f
        if f["v"] % 16 == 0:
            assert "ld.global.v4.b32" in f["loads"], f
            if f["kernel"] == "shard_apply":
                assert "st.global.v4.b32" in f["stores"], f


def test_loop_row_sums_are_never_reordered():
    """No looping kernel (online, split; forward and backward) holds a reshape that may reorder elements on
    a tile of several rows: Triton 3.6 (the H200 image's) rewrote the backward's per-chunk row sums into
    thread-local partial sums that way, and on 64-row tiles at 1 warp mixed rows (wrong gradients).
    Multi-row tiles now sum chunks element-wise and reduce once after the loop. Triton 3.8
    (CI's) rewrites neither form, so this test guards the H200's Triton (the GPU run compiles with it)."""
    facts = _compile_facts("loops")
    assert len(facts) == 80 and {f["kernel"] for f in facts} == {
        "softmax_fwd_online",
        "softmax_fwd_split_stats",
        "softmax_bwd_online",
        "softmax_bwd_split_sums",
    }
    bad = [f for f in facts if f["reorders"] and f["rows"] > 1]  # within one row a reorder cannot mix rows
    assert not bad, bad


def test_every_variant_compiles(facts):
    kinds = {(f["kernel"], f["arch"]) for f in facts}
    names = ["softmax_fwd_rowblock", "softmax_fwd_online", "softmax_fwd_split_stats", "softmax_fwd_split_write"]
    names += ["softmax_bwd_rowblock", "softmax_bwd_online", "softmax_bwd_split_sums", "softmax_bwd_split_write"]
    assert kinds == {(k, a) for k in names for a in (90, 80)}
    assert all(f["registers"] > 0 for f in facts)


def test_no_spills(facts):
    """No kernel spills, except the backward rowblock on rows longer than softmax_triton.BWD_LONG_N, which the table
    takes knowingly (1.3-1.45x the spill-free online path; heuristics/softmax_triton.py): its spills stay small."""

    def known(f):  # (the body a tile holds: compile.py's rows are aligned, 16-byte vectors)
        body = softmax_triton.row_body(f["n"], 16 // {"float32": 4}.get(f["dtype"], 2))
        return f["backward"] and f["path"] == "rowblock" and body > softmax_triton.BWD_LONG_N

    bad = [f for f in facts if (f["spill_stores"] or f["spill_loads"] or f["stack_bytes"]) and not known(f)]
    assert not bad, [(f["path"], f["dtype"], f["n"], f["spill_stores"]) for f in bad]
    long_bwd = [f for f in facts if known(f)]
    assert long_bwd and all(f["num_warps"] == softmax_triton.BWD_LONG_WARPS for f in long_bwd)
    # Spills seen: 36-80 bytes (softmax), up to 168 (fp32 log_softmax); at odd N (20481, the edge code) with
    # the register cap (softmax_triton.max_registers) up to 216 (Triton 3.6) and 364 (Triton 3.8, fp32
    # log_softmax). Without the cap Triton 3.6 fell to 32 registers and 1,520 bytes of spills for fp32
    # softmax there (3-5x slower): the bound is what catches that.
    assert all(f["spill_stores"] <= 512 and f["spill_loads"] <= 512 for f in long_bwd), long_bwd
    capped = [f for f in long_bwd if f["n"] % 16]
    assert capped and all(f["registers"] >= 128 for f in capped), capped


def test_aligned_rows_use_only_16_byte_accesses(facts):
    for f in facts:
        if f["n"] % 16 == 0 and f["n"] > 1:
            # split_write also reads the per-segment (max, sum) workspace with 4-byte loads
            workspace = f["kernel"] in ("softmax_fwd_split_write", "softmax_bwd_split_write")
            allowed = {"ld.global.v4.b32"} | ({"ld.global.b32"} if workspace else set())
            assert "ld.global.v4.b32" in f["loads"] and set(f["loads"]) <= allowed, (f["kernel"], f["n"], f["loads"])
            if f["kernel"] not in ("softmax_fwd_split_stats", "softmax_bwd_split_sums"):
                assert f["stores"] == ["st.global.v4.b32"], (f["path"], f["dtype"], f["n"], f["stores"])


def test_odd_rows_use_16_byte_body_and_scalar_edges(facts):
    for f in facts:
        if f["n"] % 16 and f["n"] >= 4 * (16 // (4 if f["dtype"] == "float32" else 2)):
            scalar = "ld.global.b16" if f["dtype"] != "float32" else "ld.global.b32"
            assert "ld.global.v4.b32" in f["loads"] and scalar in f["loads"], (f["dtype"], f["n"], f["loads"])
            if f["kernel"] not in ("softmax_fwd_split_stats", "softmax_bwd_split_sums"):  # (max, sum) per segment
                assert "st.global.v4.b32" in f["stores"], (f["dtype"], f["n"], f["stores"])


def test_masked_variants_compile_and_read_the_mask_wide(facts):
    """The masked kernels (mask, scale and causal in the load step / the dx pass) compile on every path with
    no spills; on aligned rows the mask too is read with 16-byte loads only."""
    masked = [f for f in facts if f["mask"]]
    assert {f["kernel"] for f in masked} >= {
        "softmax_fwd_rowblock",
        "softmax_fwd_online",
        "softmax_fwd_split_write",
        "softmax_bwd_rowblock",
        "softmax_bwd_split_write",
    }
    for f in masked:
        if f["n"] % 16 == 0 and f["kernel"] not in ("softmax_fwd_split_write", "softmax_bwd_split_write"):
            assert set(f["loads"]) == {"ld.global.v4.b32"}, (f["kernel"], f["mask"], f["loads"])


def test_math_units(facts):
    # exp is ex2.approx.ftz.f32 (results below 2^-126 flushed to 0), as fs.info() says (softmax's backward has
    # no exp)
    exp = fs.info()["kernels"]["triton.softmax_fwd"]["exp"]
    assert all(f["ex2"] == ["ex2.approx.ftz.f32"] for f in facts if "_fwd_" in f["kernel"] or f["log"])
    assert "ex2.approx.ftz.f32" in exp and "2^-126" in exp
    # one IEEE reciprocal per row, in every forward kernel that writes softmax
    writers = ("softmax_fwd_rowblock", "softmax_fwd_online", "softmax_fwd_split_write")
    assert all(f["div_rn"] for f in facts if not f["log"] and f["kernel"] in writers)
