"""Launch rules of the CUDA C softmax variants (cuda/softmax.cu; cuda/kernels.py launches them): which
variant takes a row, its threads per row, rows per CTA, CTAs per cluster and vectors per thread.

Variants: three_pass (the seed kernel, reference only), warp, block, cluster (sm_90), online, staged (sm_90);
cuda/kernels.py's docstring says what each does.

Measurements: bench/results/sweeps/triton_rowblock.json, cuda_registers.json, staged_cta_size.json,
staged_slice_budget.json, staged_few_rows.json, staged_cluster16_synccheck.json.
"""

from __future__ import annotations

from dataclasses import dataclass

from .device import Facts

VARIANTS = ("three_pass", "warp", "block", "cluster", "online", "staged")

K_MAX_FWD = 8  # 16-byte vectors a thread holds: 128 bytes of row, the rowblock optimum
WARP_CTA = 128  # threads of a CTA of warp (or sub-warp) rows
BLOCK_MAX = 512  # threads of a CTA holding one row (8 * 512 vectors: 16384 fp32 / 32768 bf16 elements)
# CTAs per row of the cluster variants: the GPU's cluster limit (device.cluster_limit; 16 on H100/H200)
STREAM_GROUP = 512
# 16-bit forward rows prefer 4 vectors per thread (warp and block variants): 8 need 128 registers and ran
# ~1.25x slower
K_PREF_16BIT_FWD = 4
STAGE_GROUP = 256  # threads of a staged CTA: 512 and 1024 were slower on nearly every shape swept
# Slice a staged CTA holds before its cluster grows (backward: y and dy together): small enough for
# 2-3 CTAs per SM, so one CTA's copy overlaps another's math; larger slices leave one.
STAGE_BYTES = 65536  # forward: 128 KiB and more lost up to 30%, 48 KiB lost 13% at N = 50257
STAGE_BYTES_BWD = 102400  # backward: 192 KiB lost 11% at 131072, 48-64 KiB lost 4% at 37984
# Few rows: a row's cluster keeps growing while rows x CTAs < SPREAD_CTAS_PER_SM x SMs and slices
# stay >= STAGE_SPREAD_MIN bytes (below one CTA per SM, while every thread keeps a vector at least): more,
# smaller CTAs spread one wave; smaller slices lost.
SPREAD_CTAS_PER_SM = 4
STAGE_SPREAD_MIN = 32768
# Up to 16 CTAs per row where the GPU allows it (device.cluster_limit). synccheck faults 16-CTA clusters
# that use mbarriers (the tool's fault, docs/investigations.md): dev/sanitize_cuda.py runs it capped at 8;
# memcheck and racecheck run it at 16.
STAGE_CLUSTER_MAX = 16
# A staged slice at most: softmax.cu's MAX_PIECES pieces of 16 KiB, and within what a block may opt in to
# less STAGE_STATIC for the kernel's static shared memory (mbarriers, the exchange; under 1 KiB)
STAGE_MAX = 196608
STAGE_STATIC = 2048


@dataclass(frozen=True)
class CudaShape:
    variant: str
    group: int  # threads per row in one CTA
    rows: int  # rows per CTA
    cluster: int  # CTAs per row
    k: int  # vectors per thread held in registers (0: streaming)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _clamp(v: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, v))


def stage_max(facts: Facts) -> int:
    """The largest staged slice on this GPU (dynamic shared memory of one CTA)."""
    return min(STAGE_MAX, facts.smem_per_block - STAGE_STATIC)


def stage_budget(facts: Facts, inputs: int) -> int:
    """The slice a staged CTA holds before its cluster grows: STAGE_BYTES (forward) or STAGE_BYTES_BWD,
    lowered on a GPU with less shared memory so that 3 (forward) or 2 (backward) CTAs still share an SM."""
    if inputs == 1:
        return min(STAGE_BYTES, facts.smem_per_sm // 3 - STAGE_STATIC)
    return min(STAGE_BYTES_BWD, facts.smem_per_sm // 2 - STAGE_STATIC)


def launch_shape(
    n: int,
    n_rows: int,
    elsize: int,
    facts: Facts,
    variant: str | None = None,
    inputs: int = 1,
    k_max: int | None = None,
    group_max: int | None = None,
) -> CudaShape:
    """The variant and launch shape for n_rows rows of n elements of elsize bytes on the GPU ``facts``
    describes (SMs, compute capability, cluster limit, shared memory); ``variant`` forces one. ``inputs``: 2
    for the backward (y and dy held), which holds half as many 16-bit vectors per thread (ptxas spills at
    8). ``k_max`` and ``group_max`` lower the vectors per thread and the threads per row in a CTA (tuning
    experiments: heuristics.force(k_max=..., group_max=...))."""
    vec = 16 // elsize
    k_max = min(k_max or K_MAX_FWD, K_MAX_FWD if inputs == 1 or elsize == 4 else K_MAX_FWD // 2)
    block_max = max(64, min(group_max or BLOCK_MAX, BLOCK_MAX))
    nvec = -(-n // vec)  # 16-byte vectors a row spans, at most (head and tail are scalars)
    sm_count, cc, cmax = facts.sm_count, facts.cc, facts.cluster_max
    if variant is None:
        if nvec <= 32 * k_max:
            variant = "warp"
        elif nvec <= block_max * k_max and (n_rows >= sm_count or cmax < 2):
            variant = "block"
        elif cmax >= 2 and nvec <= block_max * k_max * cmax:
            variant = "cluster"
        else:
            variant = "online"
    if variant == "three_pass":
        return CudaShape(variant, 256, 1, 1, 0)
    # 16-bit forward rows on one CTA: the group grows first so that a thread holds 4 vectors where it can
    # (4 vectors fit 64 registers; 8 need 128, fewer CTAs per SM: 1.22-1.29x slower)
    k_pref = min(k_max, K_PREF_16BIT_FWD) if inputs == 1 and elsize == 2 else k_max
    if variant == "warp":
        group = _clamp(_pow2(-(-nvec // k_pref)), 8, 32)
        k = _pow2(-(-nvec // group))
        if k > k_max:
            raise ValueError(f"the warp variant holds at most {32 * k_max * vec} elements per row, got N={n}")
        return CudaShape(variant, group, WARP_CTA // group, 1, k)
    if variant == "block":
        group = _clamp(_pow2(-(-nvec // k_pref)), 64, block_max)
        k = _pow2(-(-nvec // group))
        if k > k_max:
            raise ValueError(f"the block variant holds at most {block_max * k_max * vec} elements per row, got N={n}")
        return CudaShape(variant, group, 1, 1, k)
    if variant == "cluster" and cmax < 2:
        raise ValueError(f"the cluster variant needs thread-block clusters: sm_90 or newer (this GPU: sm_{cc})")
    if variant == "cluster":
        group = _clamp(_pow2(-(-nvec // k_max)), 64, block_max)
        cluster = _pow2(-(-nvec // (group * k_max)))
        while cluster < cmax and n_rows * cluster < sm_count and nvec >= 2 * group * cluster:
            cluster *= 2  # few rows: spread each over more SMs
        cluster = _clamp(cluster, 2, cmax)
        k = _pow2(-(-nvec // (group * cluster)))
        if k > k_max:
            cap = block_max * k_max * cmax * vec
            raise ValueError(f"the cluster variant holds at most {cap} elements per row, got N={n}")
        return CudaShape(variant, group, 1, cluster, k)
    if variant == "staged":
        if cmax < 2:
            raise ValueError(f"the staged variant needs thread-block clusters: sm_90 or newer (this GPU: sm_{cc})")
        cluster, budget, top = 1, stage_budget(facts, inputs), min(STAGE_CLUSTER_MAX, cmax)
        while cluster < top and slice_bytes(nvec, cluster, inputs) > budget:
            cluster *= 2
        while cluster < top and (  # few rows: spread each over more SMs (see SPREAD_CTAS_PER_SM)
            (n_rows * cluster < sm_count and nvec >= 2 * STAGE_GROUP * cluster)
            or (
                n_rows * cluster < SPREAD_CTAS_PER_SM * sm_count
                and slice_bytes(nvec, 2 * cluster, inputs) >= STAGE_SPREAD_MIN
            )
        ):
            cluster *= 2
        if slice_bytes(nvec, cluster, inputs) > stage_max(facts):
            cap = top * stage_max(facts) // (elsize * inputs)
            raise ValueError(f"the staged variant holds at most {cap} elements per row, got N={n}")
        return CudaShape(variant, STAGE_GROUP, 1, cluster, 1)
    if variant == "online":
        cluster = 1
        if cmax >= 2:
            while cluster < cmax and n_rows * cluster < sm_count and nvec >= 2 * STREAM_GROUP * cluster:
                cluster *= 2
        return CudaShape(variant, STREAM_GROUP, 1, cluster, 0)
    raise ValueError(f"unknown CUDA variant {variant!r}; valid: {', '.join(VARIANTS)}")


def slice_bytes(nvec: int, cluster: int, inputs: int) -> int:
    """Shared memory of a staged CTA: its slice of a row of nvec 16-byte vectors, of each of ``inputs``
    tensors (an upper bound: the head scalars before x's 16-byte boundary are not staged)."""
    return inputs * -(-nvec // cluster) * 16


def stage_bytes(shape: CudaShape, n: int, elsize: int, inputs: int = 1) -> int:
    """Dynamic shared memory of a launch: a staged CTA's slice (slice_bytes), else 0."""
    return slice_bytes(-(-n // (16 // elsize)), shape.cluster, inputs) if shape.variant == "staged" else 0
