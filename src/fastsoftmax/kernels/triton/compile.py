"""Compile a Triton kernel variant for a GPU target without a GPU (for `fastsoftmax asm` and the snapshot
tests): the same kernels and constexprs the launcher uses, specialised as the JIT would specialise a
contiguous row-major tensor (16-byte-aligned pointers, unit element stride)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ...core import dtypes
from ...core.layout import Layout
from ...heuristics import device, softmax_triton
from . import softmax_bwd, softmax_fwd
from .launch import vector_plan

_TY = {dtypes.NAME[d]: t for d, t in dtypes.TRITON.items()}
_SIZE = {dtypes.NAME[d]: dtypes.SIZE[d] for d in dtypes.KERNEL}


def compile_forward(
    path: str,
    dtype: str,
    n: int,
    *,
    log: bool = False,
    out_dtype: str | None = None,
    arch: int = 90,
    n_rows: int = 1 << 20,
    backward: bool = False,
    mask: int = 0,
    causal: bool = False,
    scaled: bool = False,
    sm_count: int | None = None,
) -> list:
    """The compiled kernels of a forward (or, with ``backward``, backward) path: one, or two for split;
    ``.asm`` holds ttir, ttgir, llir, ptx, cubin. For a contiguous (n_rows, n) tensor of ``dtype``,
    specialised as the launcher and the JIT would specialise it. Backward: x_ptr is y, y_ptr is dx.
    ``mask`` (1 bool, 2 additive in ``dtype``), ``causal``, ``scaled``: the masked variants, for a padding mask
    (rows, 1, n) read along rows of 8 (strides n, 0; unit column stride). ``sm_count``: the GPU's SMs, which
    the split path's segments depend on (default: INTERPRETER's)."""
    sms = device.INTERPRETER.sm_count if sm_count is None else sm_count
    lay = Layout(n_rows, 1, n, (n, 1, 0), (n, 1, 0), (1,), False)
    vec, edges, y_vec, _ = vector_plan(_SIZE[dtype], 0, 0, lay)  # torch allocations are aligned
    inputs = 2 if backward else 1
    shape = softmax_triton.launch_shape(n, n_rows, _SIZE[dtype], False, sms, path, inputs, vec)
    chunks_per_split = triton.cdiv(triton.cdiv(n, shape.block_n), shape.splits)
    ints = dict(
        n_b=n_rows,
        n=n,
        n_i=1,
        tiles_i=1,
        sxb=n,
        sxi=0,
        syb=n,
        syi=0,
        x_mis=0,
        chunks_per_split=chunks_per_split,
        n_splits=shape.splits,
        mb0=0,
        mb1=0,
        mb2=n if mask else 0,
        mb3=0,
        c_off=0,
        md2=n_rows // 8 if mask or causal else 1,
        md3=8 if mask or causal else 1,
    )
    consts = dict(
        sxn=1 if n > 1 else 0,
        syn=1 if n > 1 else 0,
        ROWS=shape.rows,
        BLOCK_N=shape.block_n,
        VEC=vec,
        INNER=False,
        EDGES=edges,
        Y_VEC=y_vec,
        IDX64=False,
        LOG=log,
        WRITE_LSE=False,
        SPLITS=1 << max(0, (shape.splits - 1).bit_length()),
        md1=1,
        MASK=mask,
        CAUSAL=causal,
        SCALED=scaled,
        msn=1 if mask else 0,
    )
    if not (mask or causal):
        consts.update(md2=1, md3=1)
        del ints["md2"], ints["md3"]
    ptrs = {
        "x_ptr": _TY[dtype],
        "y_ptr": _TY[out_dtype or dtype],
        "lse_ptr": "fp32",
        "ws_ptr": "fp32",
        "m_ptr": "u8" if mask == 1 else _TY[dtype],
    }
    if backward:
        ptrs.update(y_ptr=_TY[dtype], dy_ptr=_TY[dtype], dx_ptr=_TY[out_dtype or dtype])
    kernels = (softmax_bwd if backward else softmax_fwd).KERNELS[path]
    out = []
    for kernel in kernels if isinstance(kernels, tuple) else (kernels,):
        names = kernel.arg_names
        sig = {
            k: ("constexpr" if k in consts else f"*{ptrs[k]}" if k in ptrs else "fp32" if k == "scale" else "i32")
            for k in names
        }
        # The JIT marks 16-byte-aligned pointers and integers divisible by 16 (torch allocations are aligned).
        div16 = [k for k in names if k in ptrs or (k in ints and ints[k] % 16 == 0)]
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in div16}
        cons = {(names.index(k),): v for k, v in consts.items() if k in names}
        src = ASTSource(fn=kernel, signature=sig, constexprs=cons, attrs=attrs)
        options = {"num_warps": shape.num_warps}
        if cap := softmax_triton.max_registers(shape, inputs):
            options["maxnreg"] = cap  # as the launcher asks (softmax_bwd.backward)
        out.append(triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options))
    return out


def ptxas_report(ptx: str, arch: str = "sm_90a") -> dict:
    """Registers, spill bytes and stack frame of PTX, from ``ptxas -v``: the ptxas Triton itself uses (its
    wheel's, or TRITON_PTXAS_PATH, which torch.compile may set), whose version decided the PTX ISA."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    from ...ptxas import facts

    ptxas = get_ptxas(int(re.sub(r"\D", "", arch))).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True
        )
        if run.returncode != 0:
            raise RuntimeError(f"{ptxas} failed (exit {run.returncode}) on {arch}:\n{run.stderr[-3000:]}")
        out = run.stderr
    return {**facts(out), "log": out}
