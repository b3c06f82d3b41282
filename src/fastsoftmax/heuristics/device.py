"""The GPU facts the launch rules are derived from, read from the device once per device (never at import).

CPU tensors (Triton's interpreter) plan as for INTERPRETER's facts, those of an H200, so that interpreted
tests exercise the same shapes the GPU runs.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Facts:
    name: str
    sm_count: int
    cc: int  # compute capability, major * 10 + minor
    smem_per_block: int  # bytes of shared memory a block may opt in to
    cluster: bool  # thread-block clusters (sm_90 and newer)

    @property
    def arch(self) -> str:
        """The compile target: sm_90a where the architecture has arch-specific features, else sm_XY."""
        return f"sm_{self.cc}a" if self.cc >= 90 else f"sm_{self.cc}"


INTERPRETER = Facts("NVIDIA H200", 132, 90, 232448, True)


@functools.cache
def of(index: int) -> Facts:
    """The facts of CUDA device ``index``."""
    p = torch.cuda.get_device_properties(index)
    cc = p.major * 10 + p.minor
    smem = getattr(p, "shared_memory_per_block_optin", 0) or 49152
    return Facts(p.name, p.multi_processor_count, cc, smem, cc >= 90)


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
