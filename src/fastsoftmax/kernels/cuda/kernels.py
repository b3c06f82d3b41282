"""The CUDA backend's launcher: picks a variant of softmax.cu for a problem (heuristics/softmax_cuda.py's
rules), compiles it (build.py), loads the cubin into the current CUDA context once per device
(cuda.bindings.driver), and launches it on torch's current stream through launch.py, the one launch
mechanism of both backends (a prepared launch.Launch, made by fastlaunch.c's cuLaunchKernel(Ex)).

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

Launch rules and their constants (STAGE_BYTES, STAGE_MAX, ...): heuristics/softmax_cuda.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings

import torch

from ... import heuristics
from ...core import dtypes
from ...core.errors import BackendFailed
from ...core.layout import alloc, plan_layout
from ...heuristics import device
from ...heuristics import softmax_cuda as rules
from .. import launch
from . import build


def config_for(
    variant: str | None,
    dtype: str,
    n: int,
    *,
    backward: bool = False,
    n_rows: int = 4096,
    facts: device.Facts = device.INTERPRETER,
    out_dtype: str | None = None,
) -> tuple[rules.CudaShape, build.Config]:
    """The launch shape and compile configuration the launcher would use for a contiguous (n_rows, n)
    tensor of ``dtype`` (a torch dtype name) on the GPU ``facts`` describes (default: an H200's): for
    ``fastsoftmax asm`` and the compile snapshot tests, which need no GPU."""
    elsize = 4 if dtype == "float32" else 2
    shape = rules.launch_shape(n, n_rows, elsize, facts, variant, 2 if backward else 1)
    kind = ("bwd" if backward else "fwd") + ("3" if shape.variant == "three_pass" else "")
    cfg = build.Config(
        kind=kind,
        in_t=dtype,
        out_t=out_dtype or dtype,
        d_t=dtype if backward else "float32",
        group=shape.group,
        rows=shape.rows,
        cluster=shape.cluster,
        k=max(shape.k, 1),
        online=shape.variant == "online",
        staged=shape.variant == "staged",
    )
    return shape, cfg


class _Params(ctypes.Structure):
    """softmax.cu's struct Params, field for field."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("n_i", ctypes.c_int64),
        *[(f, ctypes.c_int64) for f in ("sxb", "sxi", "sxn", "syb", "syi", "syn", "sdb", "sdi", "sdn", "slb", "sli")],
        ("n", ctypes.c_int32),
        ("log", ctypes.c_int32),
    ]


def driver():
    from cuda.bindings import driver as cu

    return cu


def _ok(result, what: str):
    """Unpack a cuda.bindings result tuple, raising with the driver's error name and text."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {_error(err)}")
    return rest[0] if len(rest) == 1 else rest


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
        arch = device.of(index).arch
        compiled = build.compile_kernel(cfg, arch)
        err, module = cu.cuModuleLoadData(compiled.binary)
        if int(err) != 0 and compiled.from_disk:  # a cached cubin this driver rejects: compile it again
            warnings.warn(
                f"fastsoftmax: the cached cubin {compiled.key} did not load ({_error(err)}); recompiling",
                RuntimeWarning,
                stacklevel=4,
            )
            compiled = build.compile_kernel(cfg, arch, fresh=True)
            err, module = cu.cuModuleLoadData(compiled.binary)
        if int(err) != 0:
            raise BackendFailed(
                f"the driver cannot load the cubin of {cfg} ({_error(err)}); NVRTC "
                f"{'.'.join(map(str, build.nvrtc_version()))} compiled it for {arch}"
            )
        _modules[cfg, index] = module
    fn = _ok(cu.cuModuleGetFunction(module, cfg.entry_for(log).encode()), "cuModuleGetFunction")
    if cfg.cluster > 8:
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        _ok(cu.cuFuncSetAttribute(fn, attr, 1), "cuFuncSetAttribute(non-portable cluster size)")
    if cfg.staged:
        attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        limit = rules.stage_max(device.of(index))
        _ok(cu.cuFuncSetAttribute(fn, attr, limit), "cuFuncSetAttribute(dynamic shared memory)")
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
    mode = _ok(
        cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED),
        "cuThreadExchangeStreamCaptureMode",
    )
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
    """Launch ``fn`` with its one by-value parameter ``params`` through launch.Launch (prepared once per
    function, shape and non-address fields: the struct's x, y, d and lse are the call's address slots),
    making device ``index``'s context current first if this thread has none; recorded for the replay."""
    raw = bytes(params)
    lo, hi = _Params.x.offset, _Params.lse.offset + 8  # the addresses: x, y, d, lse, one after another
    key = ("cuda", int(fn), grid, block, cluster, smem, raw[:lo] + raw[hi:])

    def make():
        slots = [[(0, getattr(_Params, f).offset)] for f in ("x", "y", "d", "lse")]
        return launch.Launch(int(fn), (grid, 1, 1), block, smem, cluster, [(_Params, params)], slots)

    ln = launch.cached(key, make)
    what = "the CUDA backend's " + ("launch" if cluster == 1 else f"cluster launch ({cluster} CTAs per cluster)")
    addresses = (params.x or 0, params.y or 0, params.d or 0, params.lse or 0)
    if code := ln.call(stream, *addresses):  # (the launch itself, from this frame)
        launch.retry(ln, code, stream, addresses, index, what)
    launch.recorded(ln, addresses)


def _plan(x: torch.Tensor, lay, inputs: int, hint: str | None = None, dy: torch.Tensor | None = None):
    """(launch shape, device index): heuristics.force's path, else the tuning table's ``hint`` when it holds
    this row, else launch_shape's own choice. ``dy``: the backward's, which the staged variant stages as it
    stages x (y)."""
    index = device.index_of(x)
    facts = device.of(index)
    forced = heuristics.forced() or {}
    variant = forced.get("path")
    if variant is not None and variant not in rules.VARIANTS:
        raise ValueError(f"the CUDA backend has no path {variant!r}; its variants: {', '.join(rules.VARIANTS)}")
    n_rows = lay.B * lay.I
    caps = {k: forced[k] for k in ("k_max", "group_max") if k in forced}
    unstageable = _unstageable(x, lay, dy)
    if variant == "staged" and unstageable:
        raise ValueError(unstageable)
    if hint == "staged" and unstageable:
        hint = None
    if variant is None and hint in rules.VARIANTS:
        try:
            return rules.launch_shape(lay.N, n_rows, x.element_size(), facts, hint, inputs, **caps), index
        except ValueError:
            pass  # the hinted variant does not hold this row: the default choice
    return rules.launch_shape(lay.N, n_rows, x.element_size(), facts, variant, inputs, **caps), index


def _unstageable(x: torch.Tensor, lay, dy: torch.Tensor | None) -> str | None:
    """Why the staged variant cannot take this problem (bulk copies move 16-byte-aligned unit-stride bytes),
    or None."""
    if lay.sx[1] != 1 and lay.N != 1:  # (a row of one element has no stride)
        return "the staged variant reads rows of unit stride (this one is strided)"
    if dy is not None and not (dy.dtype == x.dtype and (dy.data_ptr() - x.data_ptr()) % 16 == 0):
        # dy is staged as y is: the same element size, and its body 16-byte aligned where y's is
        return "the staged backward needs dy in y's dtype and 16-byte alignment relative to y"
    return None


def _config(kind: str, shape: rules.CudaShape, x, out, d=None) -> build.Config:
    three = shape.variant == "three_pass"
    min_ctas = (heuristics.forced() or {}).get("min_ctas", 0)
    return build.Config(
        kind=kind + ("3" if three else ""),
        in_t=dtypes.NAME[x.dtype],
        out_t=dtypes.NAME[out.dtype],
        d_t=dtypes.NAME[d.dtype] if d is not None else "float32",
        group=shape.group,
        rows=shape.rows,
        cluster=shape.cluster,
        k=max(shape.k, 1),
        online=shape.variant == "online",
        staged=shape.variant == "staged",
        min_ctas=min_ctas,
    )


def _record(shape: rules.CudaShape, x: torch.Tensor, lay, copied: bool):
    vec = 16 // x.element_size() if lay.sx[1] == 1 and shape.variant != "three_pass" else 1
    plan = heuristics.Plan(
        "cuda",
        shape.variant,
        block_n=shape.group * shape.cluster * shape.k * vec,
        rows=shape.rows,
        num_warps=max(1, shape.group * shape.rows // 32),
        vec=vec,
        copied=copied,
        splits=shape.cluster,
    )
    heuristics.record(plan)


def _grid(shape: rules.CudaShape, n_rows: int) -> int:
    if shape.variant == "three_pass":
        return n_rows
    return -(-n_rows // shape.rows) * shape.cluster


def forward(x: torch.Tensor, dim: int, out_dtype, log: bool, want_lse: bool, path: str | None = None, spec=None):
    """(softmax (log_softmax) of x along dim in out_dtype, laid out as torch.empty_like(x); the fp32
    logsumexp per row or None). ``spec``: unused (dispatch keeps masks off this backend)."""
    y = alloc(x, out_dtype)
    with device.selected(x):
        xk, lay = plan_layout(x, y, dim)
        shape, index = _plan(xk, lay, 1, path)
        lse = None
        if want_lse:
            lse = alloc(x, torch.float32, x.shape[:dim] + x.shape[dim + 1 :], lay.stat_strides)
        (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
        lse_p = lse.data_ptr() if lse is not None else None
        params = _Params(xk.data_ptr(), y.data_ptr(), None, lse_p, lay.B * lay.I, lay.I, sxb, sxi, sxn, syb, syi,
                         syn, 0, 0, 0, lay.I, 1, lay.N, int(log))  # fmt: skip
        fn = function(_config("fwd", shape, xk, y), index, log)
        _record(shape, xk, lay, lay.copied)
        smem = rules.stage_bytes(shape, lay.N, xk.element_size())
        grid, block = _grid(shape, lay.B * lay.I), shape.group * shape.rows
        _launch(fn, grid, block, shape.cluster, params, launch.raw_stream()(index), smem, index)
    return y, lse


def backward(dy: torch.Tensor, y: torch.Tensor, dim: int, out_dtype, log: bool, path: str | None = None, spec=None):
    """The gradient of softmax (log_softmax) along dim in out_dtype, laid out as torch.empty_like(y), from y
    and dy. ``spec``: unused (dispatch keeps masks off this backend)."""
    dx = alloc(y, out_dtype)
    with device.selected(y):
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
        params = _Params(yk.data_ptr(), dx.data_ptr(), dy.data_ptr(), None, lay.B * lay.I, lay.I, sxb, sxi, sxn,
                         syb, syi, syn, sxb, sxi, sxn, lay.I, 1, lay.N, int(log))  # fmt: skip
        fn = function(_config("bwd", shape, yk, dx, dy), index, log)
        _record(shape, yk, lay, copied or lay.copied)
        smem = rules.stage_bytes(shape, lay.N, yk.element_size(), 2)
        grid, block = _grid(shape, lay.B * lay.I), shape.group * shape.rows
        _launch(fn, grid, block, shape.cluster, params, launch.raw_stream()(index), smem, index)
    return dx
