"""The CUDA backend's launcher: picks a variant of softmax.cu for a problem, compiles it (build.py),
loads the cubin into the current CUDA context once per device (cuda.bindings.driver), and launches it on
torch's current stream through libcuda's own entry points (launch.py: ctypes, the cheaper call).

Variants (forward and backward share them; `heuristics.force(path=...)` picks one for tests):
  three_pass  the seed kernel: one 256-thread CTA per row, shared-memory tree max, barrier, tree sum,
              barrier, write; scalar accesses; reads the row three times (backward: twice). Any N, any
              strides. Reference only: `auto` never picks it.
  warp        a warp or sub-warp (8, 16, 32 threads) per row, several rows per 128-thread CTA, the row in
              registers: one read. Short rows.
  block       a CTA (64-512 threads) per row, the row in registers: one read.
  cluster     sm_90: a row across 2-16 CTAs of a thread-block cluster, each holding its slice in
              registers; one (max, sum) pair (backward: (sum a, sum f)) per CTA exchanged through
              distributed shared memory: one read, up to 65536 16-byte vectors per row (262144 fp32,
              524288 bf16 elements; the backward holds half as many 16-bit vectors per thread, so
              262144 bf16). Also spreads few rows over many SMs.
  online      any length: the same CTA (or cluster) sweeps the row twice, the first pass keeping a
              running max and rescaled sum: two reads.
  staged      sm_90, unit-stride rows: the row across a cluster of 1-16 CTAs of 256 threads, each CTA's slice
              (backward: of y and of dy, which must share y's dtype and alignment) copied into shared memory
              by the bulk-copy engine (cp.async.bulk) instead of registers: one read, few registers, several
              CTAs per SM (STAGE_BYTES each) so that one CTA's loads overlap another's reduction and stores;
              each CTA pushes its partial into every CTA of the cluster (st.async on an mbarrier).
              Rows up to 16 x STAGE_MAX bytes (backward: half).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
import warnings
from dataclasses import dataclass

import torch

from .. import fastpath, heuristics
from ..errors import BackendFailed
from ..layout import alloc, plan_layout
from . import build, launch

VARIANTS = ("three_pass", "warp", "block", "cluster", "online", "staged")

K_MAX_FWD = 8  # 16-byte vectors a thread holds (128 bytes, as the Triton rowblock table found best)
WARP_CTA = 128  # threads of a CTA of warp (or sub-warp) rows
BLOCK_MAX = 512  # threads of a CTA holding one row (8 * 512 vectors: 16384 fp32 / 32768 bf16 elements)
CLUSTER_MAX = 16  # CTAs per row (16 is a non-portable cluster size: allowed on H100/H200)
STREAM_GROUP = 512
K_PREF_16BIT_FWD = 4  # vectors per thread the warp and block variants prefer for 16-bit forward rows
STAGE_GROUP = 256  # threads of a staged CTA
# Slice of a row a staged CTA holds in shared memory, at most, before the cluster grows: forward (x) and
# backward (y's and dy's slices together). Swept on the H200 with clusters of up to 16 CTAs (2026-11-30,
# dev/bench_staged.py fwd bwd budgets c16, dev/logs/2026-11-30e-h200-bench-staged-budgets-c16.txt), budgets of
# 48-192 KiB: the forward best at 64 KiB (fp32 1024x131072 4,004 vs 3,356 at 128 KiB, bf16 512x262144 3,823 vs
# 2,663; equal or better than 100 KiB on every shape; 48 KiB lost bf16 8192x50257, 3,461 vs 4,000), the
# backward at 100 KiB (bf16 1024x131072 4,148 vs 3,706 at 192 KiB, bf16 512x262144 4,051 vs 3,586, fp32
# 1024x131072 4,251 vs 4,056; within 0.7% of 192 KiB where that won, 16384x37984).
STAGE_BYTES = 65536
STAGE_BYTES_BWD = 102400
# Few rows: past the budget, a row's cluster keeps growing while the GPU has fewer than SPREAD_CTAS_PER_SM CTAs
# per SM and the slices stay at least STAGE_SPREAD_MIN bytes (or, below one CTA per SM, while every thread keeps
# a vector at least): more, smaller CTAs spread a single wave's work more evenly (H200, 2026-11-30,
# dev/logs/2026-11-30e-h200-bench-few-groups.txt: fwd bf16 64x131072 1,883 at 8 CTAs per row vs 1,708 at 4,
# fp32 64x131072 2,641 at 16 vs 2,436 at 8; bwd bf16 64x131072 2,247 at 16 vs 2,185 at 8; below 32 KiB
# slices lost: fwd bf16 64x131072 1,579 at 16).
SPREAD_CTAS_PER_SM = 4
STAGE_SPREAD_MIN = 32768
# CTAs per row of the staged variant: up to 16, a non-portable cluster size (allowed on H100/H200). At 16 (not
# at 8) compute-sanitizer synccheck reports "Barrier error detected. Missing wait" on the mbarriers of CTAs of
# rank 8 and 9 and then the kernel faults; dev/cluster16_probe.cu shows it is the tool: a kernel whose CTAs
# each only initialise, arrive on and wait on their own mbarrier faults under synccheck at 16 (141 of 144
# outputs wrong) and runs right without it, and softmax.cu's push exchange alone gives the same three reports
# on the same blocks (H200, 2026-11-30, dev/logs/2026-11-30e-h200-cluster16-probe.txt). dev/sanitize_cuda.py
# caps the staged cluster at 8 under synccheck; memcheck and racecheck run it at 16.
STAGE_CLUSTER_MAX = 16
# A staged slice at most (dynamic shared memory: an H200 SM has 228 KiB; softmax.cu's MAX_PIECES pieces of
# 16 KiB)
STAGE_MAX = 196608

_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class Shape:
    variant: str
    group: int  # threads per row in one CTA
    rows: int  # rows per CTA
    cluster: int  # CTAs per row
    k: int  # vectors per thread held in registers (0: streaming)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def launch_shape(
    n: int, n_rows: int, elsize: int, sm_count: int, cc: int, variant: str | None = None, inputs: int = 1,
    k_max: int | None = None, group_max: int | None = None,
) -> Shape:  # fmt: skip
    """The variant and launch shape for n_rows rows of n elements of elsize bytes on a GPU of sm_count SMs
    and compute capability cc (major * 10 + minor); ``variant`` forces one. ``inputs``: 2 for the backward
    (y and dy held), which holds half as many 16-bit vectors per thread (ptxas spills at 8). ``k_max`` and
    ``group_max`` lower the vectors per thread and the threads per row in a CTA (tuning experiments:
    heuristics.force(k_max=..., group_max=...))."""
    vec = 16 // elsize
    k_max = min(k_max or K_MAX_FWD, K_MAX_FWD if inputs == 1 or elsize == 4 else K_MAX_FWD // 2)
    block_max = max(64, min(group_max or BLOCK_MAX, BLOCK_MAX))
    nvec = -(-n // vec)  # 16-byte vectors a row spans, at most (head and tail are scalars)
    if variant is None:
        if nvec <= 32 * k_max:
            variant = "warp"
        elif nvec <= block_max * k_max and (n_rows >= sm_count or cc < 90):
            variant = "block"
        elif cc >= 90 and nvec <= block_max * k_max * CLUSTER_MAX:
            variant = "cluster"
        else:
            variant = "online"
    if variant == "three_pass":
        return Shape(variant, 256, 1, 1, 0)
    # 16-bit forward rows on one CTA: the group grows first so that a thread holds 4 vectors where it can
    # (measured on the H200: 1.22-1.29x over 8 vectors per thread, which needs 128 registers)
    k_pref = min(k_max, K_PREF_16BIT_FWD) if inputs == 1 and elsize == 2 else k_max
    if variant == "warp":
        group = _clamp(_pow2(-(-nvec // k_pref)), 8, 32)
        k = _pow2(-(-nvec // group))
        if k > k_max:
            raise ValueError(f"the warp variant holds at most {32 * k_max * vec} elements per row, got N={n}")
        return Shape(variant, group, WARP_CTA // group, 1, k)
    if variant == "block":
        group = _clamp(_pow2(-(-nvec // k_pref)), 64, block_max)
        k = _pow2(-(-nvec // group))
        if k > k_max:
            raise ValueError(f"the block variant holds at most {block_max * k_max * vec} elements per row, got N={n}")
        return Shape(variant, group, 1, 1, k)
    if variant == "cluster" and cc < 90:
        raise ValueError(f"the cluster variant needs sm_90 or newer (this GPU: sm_{cc})")
    if variant == "cluster":
        group = _clamp(_pow2(-(-nvec // k_max)), 64, block_max)
        cluster = _pow2(-(-nvec // (group * k_max)))
        while cluster < CLUSTER_MAX and n_rows * cluster < sm_count and nvec >= 2 * group * cluster:
            cluster *= 2  # few rows: spread each over more SMs
        cluster = _clamp(cluster, 2, CLUSTER_MAX)
        k = _pow2(-(-nvec // (group * cluster)))
        if k > k_max:
            cap = block_max * k_max * CLUSTER_MAX * vec
            raise ValueError(f"the cluster variant holds at most {cap} elements per row, got N={n}")
        return Shape(variant, group, 1, cluster, k)
    if variant == "staged":
        if cc < 90:
            raise ValueError(f"the staged variant needs sm_90 or newer (this GPU: sm_{cc})")
        cluster, budget = 1, STAGE_BYTES if inputs == 1 else STAGE_BYTES_BWD
        while cluster < STAGE_CLUSTER_MAX and _slice_bytes(nvec, cluster, inputs) > budget:
            cluster *= 2
        while cluster < STAGE_CLUSTER_MAX and (  # few rows: spread each over more SMs (see SPREAD_CTAS_PER_SM)
            (n_rows * cluster < sm_count and nvec >= 2 * STAGE_GROUP * cluster)
            or (n_rows * cluster < SPREAD_CTAS_PER_SM * sm_count
                and _slice_bytes(nvec, 2 * cluster, inputs) >= STAGE_SPREAD_MIN)
        ):  # fmt: skip
            cluster *= 2
        if _slice_bytes(nvec, cluster, inputs) > STAGE_MAX:
            cap = STAGE_CLUSTER_MAX * STAGE_MAX // (elsize * inputs)
            raise ValueError(f"the staged variant holds at most {cap} elements per row, got N={n}")
        return Shape(variant, STAGE_GROUP, 1, cluster, 1)
    if variant == "online":
        cluster = 1
        if cc >= 90:
            while cluster < CLUSTER_MAX and n_rows * cluster < sm_count and nvec >= 2 * STREAM_GROUP * cluster:
                cluster *= 2
        return Shape(variant, STREAM_GROUP, 1, cluster, 0)
    raise ValueError(f"unknown CUDA variant {variant!r}; valid: {', '.join(VARIANTS)}")


def config_for(
    variant: str | None, dtype: str, n: int, *, backward: bool = False, n_rows: int = 4096, cc: int = 90,
    sm_count: int = 132, out_dtype: str | None = None,
) -> tuple[Shape, build.Config]:  # fmt: skip
    """The launch shape and compile configuration the launcher would use for a contiguous (n_rows, n)
    tensor of ``dtype`` (a torch dtype name) on a GPU like this (default: an H200): for ``fastsoftmax asm``
    and the compile snapshot tests, which need no GPU."""
    elsize = 4 if dtype == "float32" else 2
    shape = launch_shape(n, n_rows, elsize, sm_count, cc, variant, 2 if backward else 1)
    kind = ("bwd" if backward else "fwd") + ("3" if shape.variant == "three_pass" else "")
    cfg = build.Config(
        kind=kind, in_t=dtype, out_t=out_dtype or dtype, d_t=dtype if backward else "float32",
        group=shape.group, rows=shape.rows, cluster=shape.cluster, k=max(shape.k, 1), stream=shape.variant == "online",
        staged=shape.variant == "staged",
    )  # fmt: skip
    return shape, cfg


def _slice_bytes(nvec: int, cluster: int, inputs: int) -> int:
    """Shared memory of a staged CTA: its slice of a row of nvec 16-byte vectors, of each of ``inputs``
    tensors (an upper bound: the head scalars before x's 16-byte boundary are not staged)."""
    return inputs * -(-nvec // cluster) * 16


def stage_bytes(shape: Shape, n: int, elsize: int, inputs: int = 1) -> int:
    """Dynamic shared memory of a launch: a staged CTA's slice (_slice_bytes), else 0."""
    return _slice_bytes(-(-n // (16 // elsize)), shape.cluster, inputs) if shape.variant == "staged" else 0


class _Params(ctypes.Structure):
    """softmax.cu's struct Params, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("y", ctypes.c_void_p), ("d", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("rows", ctypes.c_int64), ("n_i", ctypes.c_int64),
        *[(f, ctypes.c_int64) for f in ("sxb", "sxi", "sxn", "syb", "syi", "syn", "sdb", "sdi", "sdn", "slb", "sli")],
        ("n", ctypes.c_int32), ("log", ctypes.c_int32),
    ]  # fmt: skip


def driver():
    from cuda.bindings import driver as cu

    return cu


def _ok(result, what: str):
    """Unpack a cuda.bindings result tuple, raising with the driver's error name and text."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {_error(err)}")
    return rest[0] if len(rest) == 1 else rest


@functools.cache
def _device_facts(index: int) -> tuple[int, int, str]:
    """(sm_count, cc, arch) of a device, read once."""
    p = torch.cuda.get_device_properties(index)
    cc = p.major * 10 + p.minor
    return p.multi_processor_count, cc, f"sm_{cc}a" if cc >= 90 else f"sm_{cc}"


_functions: dict = {}
_modules: dict = {}  # (cfg, index): the loaded cubin, which holds both forward entry points
_lock = threading.Lock()


def function(cfg: build.Config, index: int, log: bool = False):
    """The loaded kernel of ``cfg`` on device ``index`` (compiled and loaded once), for softmax or
    log_softmax (``cfg.entry_for(log)``: the forwards and backwards have an entry point each). Raises
    errors.BackendFailed, naming the cause, when it cannot be compiled, loaded or set up."""
    key = (cfg, index, log)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        fn = _functions.get(key)
        if fn is None:
            try:
                with _capture_relaxed():
                    fn = _load_function(cfg, index, log)
            except BackendFailed:
                raise
            except Exception as e:  # NVRTC, the driver or the bindings: the cause, for the caller and fs.info()
                raise BackendFailed(f"the CUDA backend cannot prepare {cfg.entry_for(log)} ({cfg}): {e}") from e
            _functions[key] = fn
    return fn


def _load_function(cfg: build.Config, index: int, log: bool):
    cu = driver()
    _ok(cu.cuInit(0), "cuInit")
    launch.ensure_context(index)
    module = _modules.get((cfg, index))
    if module is None:
        arch = _device_facts(index)[2]
        compiled = build.compile_kernel(cfg, arch)
        err, module = cu.cuModuleLoadData(compiled.binary)
        if int(err) != 0 and compiled.from_disk:  # a cached cubin this driver rejects: compile it again
            warnings.warn(f"fastsoftmax: the cached cubin {compiled.key} did not load ({_error(err)}); recompiling",
                          RuntimeWarning, stacklevel=4)  # fmt: skip
            compiled = build.compile_kernel(cfg, arch, fresh=True)
            err, module = cu.cuModuleLoadData(compiled.binary)
        if int(err) != 0:
            raise BackendFailed(f"the driver cannot load the cubin of {cfg} ({_error(err)}); NVRTC "
                                f"{'.'.join(map(str, build.nvrtc_version()))} compiled it for {arch}")  # fmt: skip
        _modules[cfg, index] = module
    fn = _ok(cu.cuModuleGetFunction(module, cfg.entry_for(log).encode()), "cuModuleGetFunction")
    if cfg.cluster > 8:
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        _ok(cu.cuFuncSetAttribute(fn, attr, 1), "cuFuncSetAttribute(non-portable cluster size)")
    if cfg.staged:
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ok(cu.cuFuncSetAttribute(fn, attr, STAGE_MAX), "cuFuncSetAttribute(dynamic shared memory)")
    return fn


def _error(err) -> str:
    cu = driver()
    name, text = cu.cuGetErrorName(err)[1], cu.cuGetErrorString(err)[1]
    name = name.decode() if isinstance(name, bytes) else name
    text = text.decode() if isinstance(text, bytes) else text
    return f"{name}: {text}"


@contextlib.contextmanager
def _capture_relaxed():
    """Loading a module while a CUDA graph is being captured (the first call of a problem inside
    torch.cuda.graph) is a call the default 'global' capture mode forbids: this thread takes the 'relaxed'
    mode for the load, then its own mode back."""
    if not torch.cuda.is_current_stream_capturing():
        yield
        return
    cu = driver()
    mode = _ok(cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
               "cuThreadExchangeStreamCaptureMode")  # fmt: skip
    try:
        yield
    finally:
        cu.cuThreadExchangeStreamCaptureMode(mode)


def function_attributes(cfg: build.Config, index: int) -> dict:
    """What the driver says about the loaded kernel: registers per thread and local memory per thread
    (spills and stack; 0 means none), the larger of the two entry points (fwd, bwd), as ptxas.facts
    reads a log. Tests use it where NVRTC's log lacks the ptxas -v lines."""
    cu = driver()
    a = cu.CUfunction_attribute
    fns = [function(cfg, index, log) for log in ((False, True) if cfg.kind in ("fwd", "bwd") else (False,))]
    get = lambda attr: max(_ok(cu.cuFuncGetAttribute(attr, fn), "cuFuncGetAttribute") for fn in fns)  # noqa: E731
    return {"registers": get(a.CU_FUNC_ATTRIBUTE_NUM_REGS), "local_bytes": get(a.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)}


def _launch(fn, grid: int, block: int, cluster: int, params: _Params, stream: int, smem: int, index: int):
    launch.launch_once(int(fn), grid, block, cluster, params, stream, smem, index)
    if fastpath.recording() is not None:  # recorded once launched: a failed launch is never replayed
        fastpath.cuda_launched(fn, grid, block, cluster, params, smem)


def _plan(x: torch.Tensor, lay, inputs: int, hint: str | None = None, dy: torch.Tensor | None = None):
    """(launch shape, device index): heuristics.force's path, else the tuning table's ``hint`` when it holds
    this row, else launch_shape's own choice. ``dy``: the backward's, which the staged variant stages as it
    stages x (y)."""
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sms, cc, _ = _device_facts(index)
    forced = heuristics.forced() or {}
    variant = forced.get("path")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"the CUDA backend has no path {variant!r}; its variants: {', '.join(VARIANTS)}")
    n_rows = lay.B * lay.I
    caps = {k: forced[k] for k in ("k_max", "group_max") if k in forced}
    unstageable = _unstageable(x, lay, dy)
    if variant == "staged" and unstageable:
        raise ValueError(unstageable)
    if hint == "staged" and unstageable:
        hint = None
    if variant is None and hint in VARIANTS:
        try:
            return launch_shape(lay.N, n_rows, x.element_size(), sms, cc, hint, inputs, **caps), index
        except ValueError:
            pass  # the hinted variant does not hold this row: the default choice
    return launch_shape(lay.N, n_rows, x.element_size(), sms, cc, variant, inputs, **caps), index


def _unstageable(x: torch.Tensor, lay, dy: torch.Tensor | None) -> str | None:
    """Why the staged variant cannot take this problem (bulk copies move 16-byte-aligned unit-stride bytes),
    or None."""
    if lay.sx[1] != 1 and lay.N != 1:  # (a row of one element has no stride)
        return "the staged variant reads rows of unit stride (this one is strided)"
    if dy is not None and not (dy.dtype == x.dtype and (dy.data_ptr() - x.data_ptr()) % 16 == 0):
        # dy is staged as y is: the same element size, and its body 16-byte aligned where y's is
        return "the staged backward needs dy in y's dtype and 16-byte alignment relative to y"
    return None


def _config(kind: str, shape: Shape, x, out, d=None) -> build.Config:
    three = shape.variant == "three_pass"
    min_ctas = (heuristics.forced() or {}).get("min_ctas", 0)
    return build.Config(
        kind=kind + ("3" if three else ""), in_t=_DTYPE[x.dtype], out_t=_DTYPE[out.dtype],
        d_t=_DTYPE[d.dtype] if d is not None else "float32",
        group=shape.group, rows=shape.rows, cluster=shape.cluster, k=max(shape.k, 1),
        stream=shape.variant == "online", staged=shape.variant == "staged", min_ctas=min_ctas,
    )  # fmt: skip


def _record(shape: Shape, x: torch.Tensor, lay, copied: bool):
    vec = 16 // x.element_size() if lay.sx[1] == 1 and shape.variant != "three_pass" else 1
    plan = heuristics.Plan(
        "cuda", shape.variant, block_n=shape.group * shape.cluster * shape.k * vec, rows=shape.rows,
        num_warps=max(1, shape.group * shape.rows // 32), vec=vec, copied=copied, splits=shape.cluster,
    )  # fmt: skip
    heuristics.record(plan)


def _grid(shape: Shape, n_rows: int) -> int:
    if shape.variant == "three_pass":
        return n_rows
    return -(-n_rows // shape.rows) * shape.cluster


def forward(x: torch.Tensor, y: torch.Tensor, dim: int, log: bool, want_lse: bool, path: str | None = None):
    """Write softmax (log_softmax) of x along dim into y; returns the fp32 logsumexp per row or None."""
    xk, lay = plan_layout(x, y, dim)
    shape, index = _plan(xk, lay, 1, path)
    lse = None
    if want_lse:
        lse = alloc(x, torch.float32, x.shape[:dim] + x.shape[dim + 1 :], lay.stat_strides)
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    params = _Params(
        xk.data_ptr(), y.data_ptr(), None, lse.data_ptr() if lse is not None else None,
        lay.B * lay.I, lay.I, sxb, sxi, sxn, syb, syi, syn, 0, 0, 0, lay.I, 1, lay.N, int(log),
    )  # fmt: skip
    cfg = _config("fwd", shape, xk, y)
    fn = function(cfg, index, log)
    _record(shape, xk, lay, lay.copied)
    smem = stage_bytes(shape, lay.N, xk.element_size())
    _launch(fn, _grid(shape, lay.B * lay.I), shape.group * shape.rows, shape.cluster, params, _stream(y), smem, index)
    return lse


def backward(dy: torch.Tensor, y: torch.Tensor, dx: torch.Tensor, dim: int, log: bool, path: str | None = None):
    """Write the gradient of softmax (log_softmax) along dim into dx, from y and dy."""
    copied = False
    if dy.stride() != y.stride():
        d = torch.empty_like(y, dtype=dy.dtype).copy_(dy)  # y's strides when y is dense
        if d.stride() != y.stride():
            y, d = y.contiguous(), dy.contiguous()
        dy, copied = d, True
    yk, lay = plan_layout(y, dx, dim)
    if lay.copied:
        dy = dy.contiguous()
    shape, index = _plan(yk, lay, 2, path, dy)
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    params = _Params(
        yk.data_ptr(), dx.data_ptr(), dy.data_ptr(), None,
        lay.B * lay.I, lay.I, sxb, sxi, sxn, syb, syi, syn, sxb, sxi, sxn, lay.I, 1, lay.N, int(log),
    )  # fmt: skip
    cfg = _config("bwd", shape, yk, dx, dy)
    fn = function(cfg, index, log)
    _record(shape, yk, lay, copied or lay.copied)
    smem = stage_bytes(shape, lay.N, yk.element_size(), 2)
    _launch(fn, _grid(shape, lay.B * lay.I), shape.group * shape.rows, shape.cluster, params, _stream(dx), smem,
            index)  # fmt: skip


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream
