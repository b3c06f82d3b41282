"""The `fastsoftmax` command.

fastsoftmax check   every kernel path against the float64 oracle on representative shapes and
                    special-value rows; a table; exit status 1 on any failure. Without a GPU the Triton
                    kernels run in Triton's interpreter on small shapes (said in the first line).
fastsoftmax asm     the compiled code of a kernel variant (Triton or CUDA), without a GPU.
fastsoftmax bench   GB/s of fastsoftmax and its peers on the shape suite (a GPU; --device cpu: smoke run).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# (label, shape, dim, forced overrides): rowblock and online on aligned, odd and prime rows, a
# non-contiguous layout, and the torch path. GPU shapes are large enough to use many programs per SM.
GPU_CASES = [
    ("rowblock", (4096, 1024), -1, {"path": "rowblock"}),
    ("rowblock", (2048, 513), -1, {"path": "rowblock"}),
    ("rowblock", (256, 16384), -1, {"path": "rowblock"}),
    ("rowblock", (1024, 2048), 0, {"path": "rowblock"}),
    ("online", (64, 50257), -1, {"path": "online"}),
    ("online", (16, 131072), -1, {"path": "online"}),
    ("online", (2, 1 << 20), -1, {"path": "online"}),
    ("online", (512, 4096), 0, {"path": "online"}),
    ("split", (8, 131072), -1, {"path": "split"}),
    ("split", (4, 50257), -1, {"path": "split"}),
]
# The CUDA C backend's variants (GPU only), each forced.
CUDA_CASES = [
    ("three_pass", (2048, 513), -1, {"path": "three_pass"}),
    ("warp", (4096, 1000), -1, {"path": "warp"}),
    ("block", (1024, 12289), -1, {"path": "block"}),
    ("cluster", (16, 131072), -1, {"path": "cluster"}),
    ("online", (4, 1 << 20), -1, {"path": "online"}),
    ("warp", (1024, 2048), 0, {"path": "warp"}),
    ("staged", (64, 65536), -1, {"path": "staged"}),
]
CPU_CASES = [
    ("rowblock", (16, 1024), -1, {"path": "rowblock"}),
    ("rowblock", (16, 513), -1, {"path": "rowblock"}),
    ("rowblock", (40, 24), 0, {"path": "rowblock"}),
    ("online", (4, 2053), -1, {"path": "online", "block_n": 512}),
    ("online", (8, 1000), -1, {"path": "online", "block_n": 256}),
    ("online", (200, 40), 0, {"path": "online", "block_n": 16}),
    ("split", (4, 2053), -1, {"path": "split", "block_n": 512}),
]


def check(args) -> int:
    gpu = _gpu()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before fastsoftmax first imports its kernels
    import torch

    import fastsoftmax as fs
    from fastsoftmax import heuristics
    from fastsoftmax.core.dtypes import KERNEL
    from fastsoftmax.core.reference import compare, compare_grad, random_logits, special_rows

    info = fs.info()
    where = (
        f"GPU {info['cuda_devices'][0]}: Triton kernels compiled"
        if gpu
        else "no GPU: the Triton kernels run in Triton's interpreter, on small shapes"
    )
    print(f"fastsoftmax check — {where}")
    fam = info["kernels"]["triton.softmax_fwd"]
    print(f"  fastsoftmax {info['fastsoftmax']}, torch {info['torch']}, triton {info['triton']}")
    print(f"  exp: {fam['exp']}; division: {fam['division']}; flags: {fam['build_flags']}")
    device = "cuda" if gpu else "cpu"
    cases = [(*c, "triton") for c in (GPU_CASES if gpu else CPU_CASES)]
    cases += [("reference", shape, dim, None, "torch") for (_, shape, dim, _, _) in cases[:2]]
    if gpu and info["backends"]["cuda"]["cuda"]:
        cuda = info["kernels"]["cuda.softmax"]
        print(f"  CUDA backend: NVRTC {info['nvrtc']}; exp: {cuda['exp']}; flags: {cuda['build_flags']}")
        cases += [(*c, "cuda") for c in CUDA_CASES]
    elif gpu:
        print(f"  CUDA backend: off, not checked ({info['backends']['cuda']['off']})")
    dtypes = list(reversed(KERNEL))
    rows, failed = [], 0
    gen = torch.Generator().manual_seed(0)
    t0 = time.time()
    for _label, shape, dim, force, backend in cases:
        for dtype in dtypes:
            n = shape[dim]
            x = random_logits(shape, dtype, gen)
            if dim in (-1, len(shape) - 1):
                x[: min(9, shape[0])] = special_rows(n, dtype, gen)[: shape[0]]
            x = x.to(device)
            dy = torch.randn(shape, generator=gen).to(dtype).to(device)
            for log in (False, True):
                name = "log_softmax" if log else "softmax"
                with heuristics.force(poison=True, **(force or {})):
                    y = (fs.log_softmax if log else fs.softmax)(x, dim, backend=backend)
                    fwd = heuristics.last_plan(), compare(y, x, dim, log)
                    dx = (fs.log_softmax_backward if log else fs.softmax_backward)(dy, y, dim, backend=backend)
                    bwd = heuristics.last_plan(), compare_grad(dx, dy, y, dim, log)
                for op, (plan, (err, problem)) in ((name, fwd), (name + "_bwd", bwd)):
                    ok = problem is None and (force is None or plan.path == force["path"])
                    failed += not ok
                    dt = str(dtype).replace("torch.", "")
                    rows.append((f"{plan.backend}/{plan.path}", dt, f"{shape} dim={dim}", op, err, ok, problem))
    loss_rows = _loss_rows(device, dtypes, gen)
    rows += loss_rows
    failed += sum(not r[5] for r in loss_rows)
    print(f"\n{'path':18} {'dtype':9} {'shape':22} {'op':16} {'err/tol':>9}  result")
    for ran, dt, shp, name, err, ok, problem in rows:
        print(f"{ran:18} {dt:9} {shp:22} {name:16} {err:9.3f}  {'pass' if ok else 'FAIL: ' + str(problem)}")
    print(
        f"\n{len(rows) - failed}/{len(rows)} passed in {time.time() - t0:.1f} s; err/tol is the worst error as a "
        "fraction of the tolerance (fastsoftmax.core.reference.TOLERANCE), <= 1 passes"
    )
    for dt in sorted({r[1] for r in rows}):
        print(f"  worst err/tol, {dt}: {max(r[4] for r in rows if r[1] == dt):.3f}")
    return 1 if failed else 0


# The loss kernels' cases, (N, d, V): cross-entropy with every option on logits, and the LM-head loss in its
# four designs (heuristics.LCE_DESIGNS) over several chunks (an odd V)
LOSS_CASE = {"cuda": (4096, 256, 50257), "cpu": (24, 16, 1031)}


def _loss_rows(device: str, dtypes, gen) -> list:
    """Rows for check(): the loss kernels (backend="triton", poisoned outputs) against float64 torch ops. Each
    value and gradient must be within twice the error of the same loss in torch ops (logits in the dtype,
    the loss in fp32) plus the dtype's tolerance, per element (err/tol <= 1 passes); the path must be the
    one forced."""
    import torch
    import torch.nn.functional as F

    import fastsoftmax as fs
    from fastsoftmax import heuristics
    from fastsoftmax.core.reference import TOLERANCE

    n, d, v = LOSS_CASE[device]
    opts = {"label_smoothing": 0.1, "softcap": 30.0, "z_loss": 1e-3}

    def torch_loss(z, t, cw, wide):
        z = opts["softcap"] * torch.tanh(z.to(wide) / opts["softcap"])
        ce = F.cross_entropy(z, t, weight=cw.to(wide), label_smoothing=opts["label_smoothing"])
        keep = t != -100
        return ce + opts["z_loss"] * torch.logsumexp(z, -1)[keep].square().sum() / keep.sum()

    def score(got, ref, base, dtype):
        rtol, atol = TOLERANCE[dtype]
        tol = atol + rtol * ref.abs() + 2 * (base.double() - ref).abs().max()
        err = ((got.double() - ref).abs() / tol).max().item()
        return err, None if err <= 1 else f"error {err:.2f}x the tolerance"

    rows = []
    for dtype in dtypes:
        x = (torch.randn(n, d, generator=gen) * 2).to(dtype).to(device)
        w = (torch.randn(v, d, generator=gen) * d**-0.5).to(dtype).to(device)
        t = torch.randint(0, v, (n,), generator=gen)
        t[::7] = -100
        t, cw = t.to(device), (torch.rand(v, generator=gen) + 0.5).to(device)
        dt, shape = str(dtype).replace("torch.", ""), f"({n}, {d}, {v})"
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        ref = torch_loss(F.linear(x64, w64), t, cw, torch.float64)
        r_dx, r_dw = torch.autograd.grad(ref, (x64, w64))
        xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
        base = torch_loss(F.linear(xb, wb), t, cw, torch.float32)
        b_dx, b_dw = torch.autograd.grad(base, (xb, wb))
        # cross-entropy on the logits (in the dtype), its gradient to the logits
        logits = F.linear(x, w).detach()
        l64 = logits.double().requires_grad_()
        ref_l = torch_loss(l64, t, cw, torch.float64)
        (r_dl,) = torch.autograd.grad(ref_l, l64)
        lb = logits.clone().requires_grad_()
        base_l = torch_loss(lb, t, cw, torch.float32)
        (b_dl,) = torch.autograd.grad(base_l, lb)
        lg = logits.clone().requires_grad_()
        with heuristics.force(poison=True):
            loss = fs.cross_entropy(lg, t, class_weight=cw, backend="triton", **opts)
            plan = heuristics.last_plan()
            (dl,) = torch.autograd.grad(loss, lg)
        for op, got, r, b in (("cross_entropy", loss, ref_l, base_l), ("cross_entropy_bwd", dl, r_dl, b_dl)):
            err, problem = score(got, r.detach(), b.detach(), dtype)
            ok = problem is None and plan.backend == "triton"
            rows.append((f"{plan.backend}/{plan.path}", dt, shape, op, err, ok, problem))
        # the LM-head loss, each design over several chunks
        for design in heuristics.LCE_DESIGNS:
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            with heuristics.force(path=design, poison=True):
                loss = fs.linear_cross_entropy(
                    xs, ws, t, class_weight=cw, memory=(n // 3) * v * x.element_size(), backend="triton", **opts
                )
                plan = heuristics.last_plan()
                dx, dw = torch.autograd.grad(loss, (xs, ws))
            for op, got, r, b in (("lce", loss, ref, base), ("lce_dx", dx, r_dx, b_dx), ("lce_dw", dw, r_dw, b_dw)):
                err, problem = score(got, r.detach(), b.detach(), dtype)
                ok = problem is None and plan.path == design and plan.splits > 1
                rows.append((f"{plan.backend}/{plan.path}", dt, shape, op, err, ok, problem))
    return rows


def asm(args) -> int:
    if args.backend == "cuda":
        return _asm_cuda(args)
    args.variant = args.variant or "rowblock"
    if args.variant not in ("rowblock", "online", "split"):
        print(f"fastsoftmax asm: the Triton backend has no variant {args.variant!r}", file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real JIT functions
    from fastsoftmax.kernels.triton.compile import compile_forward, ptxas_report

    arch = int(args.arch.removeprefix("sm_").rstrip("a"))
    kernels = compile_forward(args.variant, args.dtype, args.n, log=args.log, arch=arch, n_rows=args.rows,
                              backward=args.backward)  # fmt: skip
    for k in kernels:
        code = k.asm[args.stage]
        print(f"// kernel {k.name}")
        print(code if isinstance(code, str) else code.hex())
        if args.stage == "ptx":
            rep = ptxas_report(code, args.arch)
            print(
                f"// ptxas: {rep['registers']} registers, {rep['spill_stores']} B spill stores, "
                f"{rep['spill_loads']} B spill loads, {rep['stack_bytes']} B stack"
            )
    return 0


def _asm_cuda(args) -> int:
    from fastsoftmax.heuristics import device
    from fastsoftmax.heuristics.softmax_cuda import VARIANTS
    from fastsoftmax.info import KERNEL_FAMILIES
    from fastsoftmax.kernels.cuda import build
    from fastsoftmax.kernels.cuda.kernels import config_for

    if args.variant not in (None, *VARIANTS):
        print(f"fastsoftmax asm: the CUDA backend's variants are {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if args.stage != "ptx":
        print("fastsoftmax asm: the CUDA backend shows --stage ptx (NVRTC has no Triton IR)", file=sys.stderr)
        return 2
    cc = int(args.arch.removeprefix("sm_").rstrip("a"))
    try:
        facts = device.with_cc(cc)
        shape, cfg = config_for(args.variant, args.dtype, args.n, backward=args.backward, n_rows=args.rows, facts=facts)
    except ValueError as e:
        print(f"fastsoftmax asm: {e}", file=sys.stderr)
        return 2
    ptx = build.compile_kernel(cfg, args.arch, "ptx").binary.decode()
    facts = build.ptxas_facts(build.compile_kernel(cfg, args.arch).log)
    nvrtc = ".".join(map(str, build.nvrtc_version()))
    print(f"// kernel {cfg.entry}: {shape}; NVRTC {nvrtc} {' '.join(build.OPTIONS)}")
    print(f"// exp: {KERNEL_FAMILIES['cuda.softmax']['exp']}; -use_fast_math: {'on' if build.FAST_MATH else 'off'}")
    print(ptx)
    print(
        f"// ptxas: {facts['registers']} registers, {facts['spill_stores']} B spill stores, "
        f"{facts['spill_loads']} B spill loads, {facts['stack_bytes']} B stack"
    )
    return 0


class _Usage(Exception):
    """A bad argument found past argparse (a shape list): main() reports it as argparse does, exit status 2."""


def _sizes(text: str, sep: str, form: str, arg: str, also: str = "") -> tuple:
    """``text`` as positive integers joined by ``sep``, as many as ``form`` names ('MxN', 'NxdxV', 'B,H,S');
    else a usage error naming ``arg`` and what was expected."""
    got = text.lower().split(sep)
    if len(got) != form.count(sep) + 1 or not all(v.isdigit() and int(v) > 0 for v in got):
        raise _Usage(f"argument {arg}: {text!r} is not {form} (positive integers){also}")
    return tuple(int(v) for v in got)


def _shapes(text: str, form: str, named: dict) -> list:
    """A --shapes list: a name in ``named`` (its shapes), or comma-separated sizes in ``form``."""
    if text in named:
        return list(named[text])
    return [_sizes(part, "x", form, "--shapes", f", nor {' or '.join(named)}") for part in text.split(",")]


CPU_ATTENTION = (2, 2, 64)  # bench --masked's scores on --device cpu (a smoke run), unless --attention


def _positive(text: str, least: int = 1) -> int:
    value = int(text)  # (argparse reports a ValueError as an invalid value)
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def _spread(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _names(valid: tuple) -> Callable[[str], str]:
    """An argparse type: a comma list of names from ``valid``, kept as given."""

    def names(text: str) -> str:
        if bad := [n for n in text.split(",") if n not in valid]:
            raise argparse.ArgumentTypeError(f"unknown {bad}; valid: {', '.join(valid)}")
        return text

    return names


def _arch(text: str) -> str:
    if not re.fullmatch(r"sm_[0-9]+a?", text):
        raise argparse.ArgumentTypeError(f"expected sm_<compute capability>[a], e.g. sm_90a, got {text!r}")
    return text


def _known(impls: list, valid: tuple, what: str) -> bool:
    """Whether every name in ``impls`` is in ``valid``; prints the refusal otherwise."""
    if bad := [i for i in impls if i not in valid]:
        print(f"fastsoftmax bench{what}: unknown implementations {bad}; valid: {', '.join(valid)}", file=sys.stderr)
    return not bad


def bench(args) -> int:
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the Triton kernels in the interpreter (before their import)
    import torch

    from fastsoftmax import bench as b

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("fastsoftmax bench: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if args.lce:
        from fastsoftmax.bench import lce

        impls = args.impls.split(",") if args.impls else list(lce.LCE_IMPLS)
        if not _known(impls, lce.LCE_IMPLS, " --lce"):
            return 2
        path = args.json or ("bench/results/h200_lce.json" if device == "cuda" else None)
        memory = lce.MEMORY if args.lce_memory is None else args.lce_memory
        spread = lce.SPREAD if args.lce_spread is None else args.lce_spread
        shapes = _shapes(args.shapes, "NxdxV", {"suite": lce.LCE_SUITE if device == "cuda" else lce.CPU_SHAPES})
        lce.run_lce(shapes, impls, device, memory, path, spread=spread)
        return 0
    if args.ce:
        impls = args.impls.split(",") if args.impls else list(b.CE_IMPLS)
        if not _known(impls, b.CE_IMPLS, " --ce"):
            return 2
        shapes = _shapes(args.shapes, "MxN", {"suite": b.CE_SUITE})
        b.write_json(b.run_ce(shapes, args.dtypes.split(","), impls, device, graph=args.graph == "always"), args.json)
        return 0
    if args.masked:
        impls = args.impls.split(",") if args.impls else list(b.MASKED_IMPLS)
        if not _known(impls, b.MASKED_IMPLS, " --masked"):
            return 2
        if args.shapes != "suite":
            raise _Usage("argument --shapes: --masked takes its scores' shape from --attention B,H,S")
        shape = b.ATTENTION if device == "cuda" else CPU_ATTENTION
        shape = _sizes(args.attention, ",", "B,H,S", "--attention") if args.attention else shape
        b.write_json(b.run_masked(args.dtypes.split(","), args.passes.split(","), impls, device, shape), args.json)
        return 0
    impls = args.impls.split(",") if args.impls else list(b.IMPLS)
    if not _known(impls, b.IMPLS, ""):
        return 2
    jobs = b.default_jobs(device) if args.jobs is None else args.jobs
    if args.tune:
        from fastsoftmax.heuristics import device as gpu

        sms = (gpu.of(torch.cuda.current_device()) if device == "cuda" else gpu.INTERPRETER).sm_count
        shapes = _shapes(args.shapes, "MxN", {"suite": b.tune_shapes(sms)})
        doc = b.tune(shapes, args.dtypes.split(","), args.passes.split(","), device, jobs=jobs)
        if not doc["entries"]:
            print(
                "fastsoftmax bench --tune: no candidate ran on any problem (reasons above); nothing written",
                file=sys.stderr,
            )
            return 1
        b.write_json(doc, args.tune)
        print(f"wrote {len(doc['entries'])} entries to {args.tune}")
        return 0
    shapes = _shapes(args.shapes, "MxN", {"suite": b.SUITE, "quick": b.QUICK})
    doc = b.run(shapes, args.dtypes.split(","), args.passes.split(","), impls, device, args.graph, jobs=jobs)
    b.write_json(doc, args.json)
    if args.plot:
        b.plot(doc, args.plot)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fastsoftmax", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="every kernel path against the float64 oracle").set_defaults(fn=check)
    a = sub.add_parser("asm", help="compiled code of a kernel variant (no GPU needed)")
    a.add_argument("--backend", default="triton", choices=["triton", "cuda"])
    a.add_argument(
        "--variant",
        default=None,
        help="triton: rowblock|online|split (default rowblock); "
        "cuda: three_pass|warp|block|cluster|online|staged (default: the CUDA backend's own rule, without the "
        "tuning table)",
    )
    a.add_argument("--rows", type=_positive, default=4096, help="rows of the (rows, n) problem the launch is for")
    a.add_argument("--backward", action="store_true", help="the backward kernel")
    a.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    a.add_argument("--n", type=_positive, default=4096)
    a.add_argument("--arch", type=_arch, default="sm_90a")
    a.add_argument("--stage", default="ptx", choices=["ttir", "ttgir", "llir", "ptx"])
    a.add_argument("--log", action="store_true", help="log_softmax instead of softmax")
    a.set_defaults(fn=asm)
    b = sub.add_parser("bench", help="GB/s against torch, torch.compile, Liger and QuACK (GPU)")
    b.add_argument(
        "--shapes",
        default="suite",
        help="suite (fastsoftmax.bench.suite's SUITE: 2^27-element grids, real vocabularies, few long rows, "
        "1x4096), quick, or MxN,MxN,... (--lce: NxdxV,...)",
    )
    b.add_argument("--dtypes", type=_names(("float16", "bfloat16", "float32")), default="bfloat16,float32")
    b.add_argument("--passes", type=_names(("fwd", "bwd")), default="fwd,bwd")
    b.add_argument("--impls", default=None, help="comma list; default all (peers that cannot import: unsupported)")
    b.add_argument(
        "--graph",
        default="auto",
        choices=["auto", "always", "never"],
        help="CUDA-graph timing too: auto = shapes under 2^24 elements (--ce: only always)",
    )
    b.add_argument("--json", default=None, help="write every record to this JSON file")
    b.add_argument("--plot", default=None, help="write GB/s against N to this PNG (needs matplotlib)")
    b.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness")
    b.add_argument(
        "--tune",
        default=None,
        metavar="PATH",
        help="measure every backend/path per problem and "
        "write the table backend='auto' reads (src/fastsoftmax/heuristics/tables/<gpu>.json); shapes: the tuning "
        "grid unless --shapes is given",
    )
    b.add_argument(
        "--jobs",
        type=lambda text: _positive(text, 0),
        default=None,
        help="processes that fill the compile caches before timing "
        "(timing itself runs in one process); default: CPU cores - 2, at most 12, on a GPU; 0: none",
    )
    b.add_argument(
        "--masked",
        action="store_true",
        help="attention scores instead of the shape suite: softmax(scale * x + mask) with a padding mask, causal, both",
    )
    b.add_argument(
        "--ce",
        action="store_true",
        help="cross-entropy over vocabularies (shapes: its own suite "
        "unless --shapes MxV,...) against torch, torch.compile, Liger and QuACK",
    )
    b.add_argument(
        "--lce",
        action="store_true",
        help="the LM-head loss, linear + cross-entropy fwd+bwd (dx, dW), against the 3 GEMMs alone, torch, "
        "torch.compile, F.linear + fs.cross_entropy, Liger, CCE and QuACK: ms, peak memory, errors against fp32 "
        "(shapes: its own suite unless --shapes NxdxV,...; bf16, fp32 on --device cpu; --json default "
        "bench/results/h200_lce.json on a GPU)",
    )
    b.add_argument(
        "--lce-memory",
        type=_positive,
        default=None,
        metavar="BYTES",
        help="--lce: the memory= budget of the fastsoftmax_mem and fastsoftmax_skip runs (default: what keeps "
        "their peak at 1.045x CCE's, measured just before on the same shape)",
    )
    b.add_argument(
        "--lce-spread",
        type=_spread,
        default=None,
        metavar="S",
        help="--lce: the logits' standard deviation (W's scale; default fastsoftmax.bench.lce.SPREAD, 1); record "
        "it in a file of its own",
    )
    b.add_argument(
        "--attention", default=None, metavar="B,H,S", help="--masked scores shape (default 8,16,2048; cpu: 2,2,64)"
    )
    b.set_defaults(fn=bench)
    args = p.parse_args(argv)
    try:
        return args.fn(args)
    except _Usage as e:
        sub.choices[args.cmd].error(str(e))
