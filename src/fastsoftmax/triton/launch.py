"""Launch preparation shared by every Triton kernel family: the heuristics table's shape (or the test
overrides), 16-byte vector plan, 32/64-bit index choice, grid, split segments.

The kernels all take the same leading arguments: an anchor input ``x`` (forward: x; backward: y) and an
output, rows (b, i) x N with strides from layout.py; see softmax_fwd._rows."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import fastpath, heuristics
from ..layout import Layout

_INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (triton.cdiv is a JIT function: ~6 us per call from Python)."""
    return -(-a // b)


def vector_plan(elsize: int, x_addr: int, y_addr: int, lay: Layout) -> tuple[int, bool, bool, int]:
    """(VEC, EDGES, Y_VEC, x_mis) for x and y at these addresses: 16-byte vectors along contiguous rows;
    the edge code when some row is not 16-byte aligned and rows are long enough (>= 4 vectors) to gain.
    x_mis: elements from the 16-byte boundary below x's first element to it.

    Without edges, the JIT's divisibility-by-16 specialisation of n and the strides proves alignment."""
    (sxb, sxn, sxi), (syb, _, syi), n = lay.sx, lay.sy, lay.N
    if sxn != 1 or n < 2:
        return 1, False, False, 0
    vec = 16 // elsize
    if x_addr % 16 == 0 and y_addr % 16 == 0 and not (n % 16 or sxb % 16 or sxi % 16 or syb % 16 or syi % 16):
        return vec, False, False, 0
    if n < 4 * vec:
        return 1, False, False, 0
    x_mis = (x_addr // elsize) % vec
    y_vec = y_addr % 16 == 0 and not x_mis and (sxb - syb) % vec == 0 and (sxi - syi) % vec == 0
    return vec, True, y_vec, x_mis


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(x: torch.Tensor) -> int:
    """SMs of x's GPU, read once per device; CPU tensors (the interpreter) plan as for an H200."""
    if not x.is_cuda:
        return 132
    return _sm_count(x.device.index if x.device.index is not None else torch.cuda.current_device())


def aligned_view(t: torch.Tensor, mis: int) -> torch.Tensor:
    """A view of t's storage starting ``mis`` elements before t: the 16-byte boundary the kernels address
    t from when its first element is not aligned."""
    return t.as_strided((1,), (1,), t.storage_offset() - mis) if mis else t


@dataclass(frozen=True)
class Launch:
    plan: heuristics.Plan
    x_arg: torch.Tensor  # the anchor input as passed to the kernel (aligned_view when x_mis)
    x_mis: int
    grid: tuple
    rows_args: tuple  # (B, N, I, tiles_i)
    strides: tuple  # (sxb, sxn, sxi, syb, syn, syi)
    flags: dict  # ROWS, BLOCK_N, VEC, INNER, EDGES, IDX64
    y_vec: bool
    chunks_per_split: int
    n_rows: int


def prepare(x: torch.Tensor, y: torch.Tensor, lay: Layout, inputs: int = 1, path: str | None = None) -> Launch:
    """Everything a launch needs for anchor x and output y in layout ``lay``; records the plan. ``path``:
    the tuning table's choice (heuristics.force overrides it). The plan is a pure function of the layout,
    the addresses modulo 16 and the overrides, and is cached on them (the host cost of a call matters)."""
    overrides = heuristics.forced() or {}
    if path is not None and "path" not in overrides:
        overrides = {**overrides, "path": path}
    x_mod = x.data_ptr() % 16
    st = x.untyped_storage().data_ptr() % 16 if x_mod else 0  # matters only for a misaligned x
    plan, x_mis, grid, rows_args, flags, y_vec, chunks = _plan(
        lay, x.element_size(), sm_count(x), inputs, tuple(sorted(overrides.items())), x_mod, y.data_ptr() % 16, st,
    )  # fmt: skip
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    return Launch(
        plan=heuristics.record(plan), x_arg=aligned_view(x, x_mis), x_mis=x_mis, grid=grid, rows_args=rows_args,
        strides=(sxb, sxn, sxi, syb, syn, syi), flags=flags, y_vec=y_vec, chunks_per_split=chunks,
        n_rows=lay.B * lay.I,
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _plan(lay: Layout, elsize: int, sms: int, inputs: int, overrides: tuple, x_mod: int, y_mod: int, st: int):
    overrides = dict(overrides)
    (sxb, sxn, sxi), (syb, syn, syi) = lay.sx, lay.sy
    n, inner, n_rows = lay.N, lay.I > 1, lay.B * lay.I
    rows_contiguous = (sxi == 1) if inner else (sxb == 1 and sxn != 1)
    if overrides.get("path", "rowblock") not in heuristics.PATHS:
        raise ValueError(
            f"the Triton backend has no path {overrides['path']!r}; its paths: {', '.join(heuristics.PATHS)}"
        )
    shape = heuristics.launch_shape(n, n_rows, elsize, rows_contiguous, sms, overrides.get("path"), inputs=inputs)
    path, block, rows, warps, splits = (overrides.get(k, v) for k, v in zip(shape._fields, shape, strict=True))
    if "block_n" in overrides and "splits" not in overrides:
        splits = heuristics.split_count(n, block, n_rows, sms, path)
    if path == "rowblock" and block < n:
        raise ValueError(f"rowblock needs block_n >= N; got block_n={block}, N={n}")

    vec, edges, y_vec, x_mis = vector_plan(elsize, x_mod, y_mod, lay)
    if x_mis and st:
        vec, edges, y_vec, x_mis = 1, False, False, 0  # the storage itself is unaligned: scalar code
    # Offsets within a program are 32-bit unless its rows and columns could reach 2^31 elements.
    row_stride = max(abs(sxi), abs(syi)) if inner else max(abs(sxb), abs(syb))
    idx64 = rows * row_stride + max(abs(sxn), abs(syn)) * (n + block) + 16 > _INT32_MAX
    tiles_i = _cdiv(lay.I, rows) if inner else 1
    grid = lay.B * tiles_i if inner else _cdiv(lay.B, rows)
    if grid > _INT32_MAX:
        raise ValueError(f"too many rows for one launch ({n_rows})")
    chunks_per_split = _cdiv(_cdiv(n, block), splits)
    splits = _cdiv(_cdiv(n, block), chunks_per_split)  # no empty segments
    plan = heuristics.Plan("triton", path, block, rows, warps, vec, edges, inner, lay.copied, splits)
    flags = dict(ROWS=rows, BLOCK_N=block, VEC=vec, INNER=inner, EDGES=edges, IDX64=idx64)
    grid = (grid, splits) if path == "split" else (grid,)
    return plan, x_mis, grid, (lay.B, n, lay.I, tiles_i), flags, y_vec, chunks_per_split


# ---- the launch itself -----------------------------------------------------------------------------------


def launch(kernel, grid: tuple, args: tuple, kwargs: dict):
    """kernel[grid](*args, **kwargs), recorded for fastpath's replay when a recording is on."""
    ck = kernel[grid](*args, **kwargs)
    if fastpath.recording() is not None:
        fastpath.triton_launched(ck, grid, args, kwargs, getattr(kernel, "arg_names", None))
