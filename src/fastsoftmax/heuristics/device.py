"""The GPU facts the launch rules and table lookups are derived from, read from the device once per device
(never at import). No launch shape rule holds a GPU model's numbers: each takes them from here. (The LM-head
loss's time model, heuristics/lm_head.layout, holds the H200's measured GEMM and HBM rates.)

CPU tensors (Triton's interpreter) plan as for INTERPRETER's facts, an H200's (the GPU the tables were
measured on), so that interpreted tests exercise the shapes that GPU runs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


def cluster_limit(cc: int) -> int:
    """CTAs a thread-block cluster may hold on compute capability cc: none before sm_90; 16 (a non-portable
    size, opted in per kernel) on the data-centre parts of sm_9x and sm_10x; the portable 8 elsewhere
    (sm_11x, sm_12x)."""
    if cc < 90:
        return 1
    return 16 if cc // 10 in (9, 10) else 8


@dataclass(frozen=True)
class Facts:
    name: str
    sm_count: int
    cc: int  # compute capability, major * 10 + minor
    smem_per_block: int  # bytes of shared memory a block may opt in to (static + dynamic)
    smem_per_sm: int = 0  # bytes of shared memory an SM has for its resident blocks; 0: smem_per_block
    regs_per_sm: int = 65536  # 32-bit registers of an SM (every sm_80+ part: 64 Ki, also a block's cap)
    cluster_max: int = 0  # CTAs per thread-block cluster at most (1: no clusters); 0: cluster_limit(cc)

    def __post_init__(self):
        if not self.cluster_max:
            object.__setattr__(self, "cluster_max", cluster_limit(self.cc))
        if not self.smem_per_sm:
            object.__setattr__(self, "smem_per_sm", self.smem_per_block)

    @property
    def cluster(self) -> bool:
        """Thread-block clusters (sm_90 and newer)."""
        return self.cluster_max > 1

    @property
    def arch(self) -> str:
        """The compile target: sm_90a where the architecture has arch-specific features, else sm_XY."""
        return f"sm_{self.cc}a" if self.cc >= 90 else f"sm_{self.cc}"


INTERPRETER = Facts("NVIDIA H200", 132, 90, 232448, 233472)


def with_cc(cc: int) -> Facts:
    """INTERPRETER's facts for compute capability cc (its cluster limit too): what `fastsoftmax asm --arch`
    compiles for without that GPU."""
    return Facts(INTERPRETER.name, INTERPRETER.sm_count, cc, INTERPRETER.smem_per_block, INTERPRETER.smem_per_sm)


@functools.cache
def of(index: int) -> Facts:
    """The facts of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    cc = p.major * 10 + p.minor
    # (torch before 2.5 has neither shared-memory property: the 48 KiB every GPU gives a block without opt-in)
    smem = getattr(p, "shared_memory_per_block_optin", 0) or 49152
    per_sm = getattr(p, "shared_memory_per_multiprocessor", 0) or smem
    regs = getattr(p, "regs_per_multiprocessor", 0) or 65536
    return Facts(p.name, p.multi_processor_count, cc, smem, per_sm, regs)


def index_of(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def of_tensor(t: torch.Tensor) -> Facts:
    """The facts of t's GPU; INTERPRETER's for a tensor that is not on a GPU."""
    return of(index_of(t)) if t.is_cuda else INTERPRETER


def selected(t: torch.Tensor):
    """A context making t's GPU the current device for a launch when it is not already (kernels launch on
    the current device)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
