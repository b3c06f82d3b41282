"""Run as a script (by test_snapshot.py, in its own process without TRITON_INTERPRET): compile every
forward variant the heuristics table can produce for sm_90a (and sm_80) and print facts as JSON."""

import json
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

from fastsoftmax.heuristics import softmax_triton
from fastsoftmax.kernels.triton.compile import compile_forward, ptxas_report  # noqa: E402


def facts(path, dtype, n, arch, log=False, backward=False, mask=0, causal=False):
    out = []
    n_rows = 8 if path == "split" else 1 << 20
    kernels = compile_forward(
        path,
        dtype,
        n,
        log=log,
        arch=arch,
        n_rows=n_rows,
        backward=backward,
        mask=mask,
        causal=causal,
        scaled=bool(mask or causal),
    )
    for k in kernels:
        ptx = k.asm["ptx"]
        rep = ptxas_report(ptx, "sm_90a" if arch == 90 else f"sm_{arch}")
        out.append(
            {
                "path": path,
                "kernel": k.name,
                "dtype": dtype,
                "n": n,
                "arch": arch,
                "log": log,
                "mask": mask,
                "causal": causal,
                "num_warps": k.metadata.num_warps,
                "backward": backward,
                "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
                "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
                "ex2": sorted(set(re.findall(r"ex2\.approx[.\w]*", ptx))),
                "div_rn": "div.rn.f32" in ptx,
                **{k: v for k, v in rep.items() if k != "log"},
            }
        )
    return out


def main():
    out = []
    rowblock_ns = [2**k for k in range(0, 15, 2) if 2**k <= softmax_triton.ROWBLOCK_MAX_N] + [7, 40, 513, 12289]
    rowblock_ns.append(softmax_triton.ROWBLOCK_MAX_N)
    for dtype in ("bfloat16", "float16", "float32"):
        for n in rowblock_ns:
            out += facts("rowblock", dtype, n, 90)
        for n in (50257, 65536, 151936):
            out += facts("online", dtype, n, 90)
            out += facts("split", dtype, n, 90)
        out += facts("rowblock", dtype, 4096, 90, log=True)
        out += facts("online", dtype, 32000, 90, log=True)
        out += facts("split", dtype, 131072, 90, log=True)
        out += facts("rowblock", dtype, 1024, 80)
        out += facts("online", dtype, 50257, 80)
        out += facts("split", dtype, 50257, 80)
        long_n = softmax_triton.BWD_LONG_N
        for n in (256, 513, 4096, long_n, long_n + 1, 20481, 32000, softmax_triton.ROWBLOCK_MAX_N):
            for log in (False, True):
                out += facts("rowblock", dtype, n, 90, log=log, backward=True)
        for path in ("online", "split"):
            out += facts(path, dtype, 50257, 90, backward=True)
            out += facts(path, dtype, 65536, 90, log=True, backward=True)
            out += facts(path, dtype, 50257, 80, backward=True)
        out += facts("rowblock", dtype, 1024, 80, backward=True)
        # masked, scaled, causal (attention scores): bool and additive masks, forward and backward
        for mask in (1, 2):
            for n in (2048, 513):
                out += facts("rowblock", dtype, n, 90, mask=mask, causal=True)
                out += facts("rowblock", dtype, n, 90, mask=mask, causal=True, log=True, backward=True)
            out += facts("online", dtype, 32000, 90, mask=mask)
            out += facts("split", dtype, 65536, 90, mask=mask, causal=True)
            out += facts("split", dtype, 65536, 90, mask=mask, causal=True, backward=True)
    json.dump(out, sys.stdout)


def _sm90_facts(kernel, sig: dict, consts: dict, div16: list, warps: int, options: dict | None = None):
    """(facts, the compiled kernel) of kernel compiled for sm_90a with this signature, these constexprs,
    16-divisible arguments and compile options: its global loads and stores, and ptxas -v's registers,
    stack and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    src = ASTSource(
        fn=kernel,
        signature=sig,
        constexprs={(names.index(k),): c for k, c in consts.items() if k in names},
        attrs={(names.index(k),): [["tt.divisibility", 16]] for k in div16},
    )
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **(options or {})})
    ptx = k.asm["ptx"]
    rep = ptxas_report(ptx, "sm_90a")
    facts = {
        "loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "stores": sorted(set(re.findall(r"st\.global[.\w]*", ptx))),
        **{k: v for k, v in rep.items() if k != "log"},
    }
    return facts, k


def _signature(kernel, consts: dict, data: tuple, data_ty: str, t_ty: str, floats: tuple, ints: dict):
    """(signature, 16-divisible arguments) of a loss kernel: constexprs, pointers (t_ptr of t_ty, the data
    pointers of data_ty, the rest fp32), fp32 scalars named in floats, i32 for the rest; pointers and the
    ints that are multiples of 16 divisible by 16."""
    names = kernel.arg_names

    def arg(k):
        if k in consts:
            return "constexpr"
        if k.endswith("_ptr"):
            return f"*{t_ty}" if k in ("t_ptr", "idx_ptr") else f"*{data_ty}" if k in data else "*fp32"
        return "fp32" if k in floats else "i32"

    div16 = [k for k in names if k.endswith("_ptr") or (k in ints and ints[k] % 16 == 0)]
    return {k: arg(k) for k in names}, div16


def ce_facts():
    """The cross-entropy kernels at the launch shapes loss.py takes (triton/cross_entropy.py's shape), for
    aligned and odd vocabularies, and the one-program forward of 8 rows of 4096, sm_90a."""
    from fastsoftmax.heuristics import cross_entropy as ce_rules
    from fastsoftmax.kernels.triton import cross_entropy as ce

    ty = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    out = []
    for dtype in ("bfloat16", "float32"):
        for v, m in ((32000, 0), (50257, 0), (151936, 0), (4096, 8)):  # (m 8: the one-program forward)
            for backward in (False, True) if not m else (False,):
                rows, block, warps, _ = ce_rules.launch_shape(v, 4 if dtype == "float32" else 2, backward, m)
                kernel = ce.ce_bwd if backward else ce.ce_fwd
                ptrs = {
                    "x_ptr": ty[dtype],
                    "t_ptr": "i64",
                    "loss_ptr": "fp32",
                    "lse_ptr": "fp64",  # (the stats: fp64, forward() allocates them)
                    "g_ptr": "fp32",
                    "dx_ptr": ty[dtype],
                    "w_ptr": "fp32",
                    "wsum_ptr": "fp32",
                    "z_ptr": "fp32",
                    "cnt_ptr": "fp64",
                    "run_ptr": "fp32",
                    "part_ptr": "fp32",
                    "idx_ptr": "i64",
                }
                # fs.cross_entropy with smoothing, no class weights, softcap or z-loss
                consts = {"ROWS": rows, "BLOCK_N": block, "SMOOTH": True, "MEAN": True}
                consts |= {"WEIGHT": False, "SOFTCAP": False, "ZLOSS": False, "PICKED": False}
                ints = {"v": v, "nc": v, "sx": v, "sdx": v, "span": block * ce_rules.BWD_SEGMENT_CHUNKS}
                if not backward:  # ce_fwd over whole rows; finishing as one program where m is given, with
                    # the targets' device assertion, compiled in debug mode, as it is launched on CUDA
                    consts |= {"FIRST": True, "LAST": True, "PART": False, "FINISH": bool(m), "CHECK": bool(m)}
                    consts |= {"REDUCTION": 2 if m else 0, "ZOUT": True, "STATS": True}
                names = kernel.arg_names
                sig = {
                    k: "constexpr"
                    if k in consts
                    else f"*{ptrs[k]}"
                    if k in ptrs
                    else "fp32"
                    if k in ("smoothing", "cap", "zl")
                    else "i32"
                    for k in names
                }
                div16 = [k for k in names if k in ptrs or (k in ints and ints[k] % 16 == 0)]
                name = kernel.__name__ + ("_one" if m else "")
                row = dict(kernel=name, dtype=dtype, v=v, block_n=block, num_warps=warps)
                debug = {"debug": True, "sanitize_overflow": False} if m else None
                out.append(row | _sm90_facts(kernel, sig, consts, div16, warps, debug)[0])
    json.dump(out, sys.stdout)


def shard_facts():
    """triton/shard.py's kernels (the tensor-parallel slice's statistics and outputs) at the cross-entropy
    launch shapes shard_merge.py takes, for slices of 128256 and 256000 classes split in two and an odd
    slice, sm_90a: shard_stats with smoothing and softcap, shard_apply's dlogits (mode 2) and softmax (0)."""

    from fastsoftmax.heuristics import cross_entropy as ce_rules
    from fastsoftmax.kernels.triton import shard

    ty = {"bfloat16": "bf16", "float32": "fp32"}
    data = {"x_ptr", "d_ptr", "out_ptr"}  # (the slice's dtype; t_ptr int32; the rest fp32)
    out = []
    for dtype in ("bfloat16", "float32"):
        for v in (64128, 128000, 25129):
            for kernel, mode in ((shard.shard_stats, None), (shard.shard_apply, 2), (shard.shard_apply, 0)):
                rows, block, warps, _ = ce_rules.launch_shape(v, 4 if dtype == "float32" else 2, mode == 2)
                consts = {"ROWS": rows, "BLOCK_N": block, "SMOOTH": True, "WEIGHT": False, "SOFTCAP": True}
                consts |= {"DOT": False, "LOGDOT": False, "MODE": mode}
                ints = {"v": v, "sx": v, "sd": v, "so": v}
                sig, div16 = _signature(kernel, consts, data, ty[dtype], "i32", ("cap",), ints)
                facts, compiled = _sm90_facts(kernel, sig, consts, div16, warps)
                row = dict(kernel=kernel.__name__, mode=mode, dtype=dtype, v=v, rows=rows)
                out.append(row | facts | {"reorders": compiled.asm["ttgir"].count("allow_reorder")})
    json.dump(out, sys.stdout)


def lm_head_facts():
    """The LM-head loss's fused kernels (triton/lm_head.py: lse_gemm, dlogits_gemm) at
    heuristics/lm_head.fused_shape's launch shapes, bf16 and fp32, without and with every option's code
    (bias, smoothing with class weights, softcap, z-loss; the forward's skip tops, the backward's gathered
    rows), sm_90a: registers, spills and the warpgroup MMA instructions their GEMMs use."""
    from fastsoftmax.heuristics import lm_head as rules
    from fastsoftmax.kernels.triton import lm_head

    ty = {"bfloat16": "bf16", "float32": "fp32"}
    data = ("x_ptr", "w_ptr", "b_ptr", "dl_ptr")
    out = []
    for kernel in (lm_head.lse_gemm, lm_head.dlogits_gemm):
        for dtype in ("bfloat16", "float32"):
            for options in (False, True):
                shape = rules.fused_shape(8192, 128256, 4 if dtype == "float32" else 2, 4096 * options, 132)
                consts = {"BM": shape.bm, "BN": shape.bn, "BK": shape.bk, "BIAS": options, "SMOOTH": options}
                consts |= {"WEIGHT": options, "SOFTCAP": options, "TOPS": options, "WIDEN": False}
                consts |= {"MEAN": True, "ZLOSS": options, "PRECISION": "ieee" if dtype == "float32" else "tf32"}
                consts["PICKED"] = options  # (dlogits_gemm: a skip's gathered rows, read through their index)
                consts |= {"sxk": 1, "swk": 1}  # (unit strides: Triton specialises an int argument equal to 1)
                ints = {"d": 4096, "sxn": 4096, "swv": 4096, "sdl": 4096, "per": shape.per, "nc": 4096}
                floats = ("cap", "smoothing", "zl")
                sig, div16 = _signature(kernel, consts, data, ty[dtype], "i64", floats, ints)
                facts, compiled = _sm90_facts(kernel, sig, consts, div16, shape.warps, {"num_stages": shape.stages})
                row = dict(kernel=kernel.__name__, dtype=dtype, options=options, bm=shape.bm, bn=shape.bn)
                row |= dict(bk=shape.bk, warps=shape.warps, stages=shape.stages)
                row["mma"] = sorted(set(re.findall(r"wgmma\.mma_async[.\w]*", compiled.asm["ptx"])))
                out.append(row | facts)
    json.dump(out, sys.stdout)


def loop_facts():
    """The looping forward and backward kernels (online, split) at tiles of 1 and 64 rows, 1 and 8 warps,
    chunks of 16 to 4096: how many reshapes that may reorder elements (`allow_reorder`) each TTGIR holds.
    Triton 3.6 put one into a backward whose row sums were reduced inside the chunk loop, and on tiles where
    a thread holds several rows it mixed rows (wrong gradients on the H200)."""
    import itertools

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastsoftmax.kernels.triton import softmax_bwd, softmax_fwd

    base = dict(
        VEC=1,
        INNER=False,
        EDGES=False,
        Y_VEC=False,
        IDX64=False,
        MASK=0,
        CAUSAL=False,
        SCALED=False,
        WRITE_LSE=False,
        md1=1,
        md2=1,
        md3=1,
        msn=0,
        SPLITS=8,
    )
    kernels = [
        softmax_fwd.softmax_fwd_online,
        softmax_fwd.softmax_fwd_split_stats,
        softmax_bwd.softmax_bwd_online,
        softmax_bwd.softmax_bwd_split_sums,
    ]
    out = []
    for kernel, (rows, block, warps, log) in itertools.product(
        kernels, itertools.product((1, 64), (16, 64, 4096), (1, 8), (False, True))
    ):
        if rows * block > 65536:
            continue
        names = kernel.arg_names
        consts = {k: v for k, v in {**base, "ROWS": rows, "BLOCK_N": block, "LOG": log}.items() if k in names}
        sig = {
            k: "constexpr" if k in consts else "*fp32" if k.endswith("_ptr") else "fp32" if k == "scale" else "i32"
            for k in names
        }
        src = ASTSource(
            fn=kernel,
            signature=sig,
            constexprs={(names.index(k),): v for k, v in consts.items()},
            attrs={(names.index(k),): [["tt.divisibility", 16]] for k in names if k.endswith("_ptr")},
        )
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        out.append(
            {
                "kernel": kernel.__name__,
                "rows": rows,
                "block_n": block,
                "num_warps": warps,
                "log": log,
                "reorders": k.asm["ttgir"].count("allow_reorder"),
                "triton": triton.__version__,
            }
        )
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    steps = {"ce": ce_facts, "loops": loop_facts, "shard": shard_facts, "lm_head": lm_head_facts}
    steps.get(sys.argv[1] if sys.argv[1:] else "", main)()
