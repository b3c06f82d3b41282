"""The one dtype registry: what the public functions accept, what the kernels take, and each dtype's names
in the tables that key on it (tuning tables and softmax.cu's configurations by NAME, Triton signatures,
the distributed signature's codes)."""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what the public functions accept
KERNEL = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton and CUDA kernels take
LOW = (torch.float16, torch.bfloat16)  # what autocast's fp32 policy applies to
TARGETS = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)  # cross-entropy class indices

NAME = {d: str(d).removeprefix("torch.") for d in FLOATS}  # "float16", ...: the tables' key
BY_NAME = {v: k for k, v in NAME.items()}
TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}  # Triton signature types
SIZE = {d: d.itemsize for d in FLOATS}
CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}  # distributed's signature


def wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the library computes in for inputs of ``dtype`` (statistics, torch-op paths): float64 for
    float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


FLOAT_NAMES = ", ".join(NAME[d] for d in FLOATS[:-1]) + f" or {NAME[FLOATS[-1]]}"
KERNEL_NAMES = ", ".join(NAME[d] for d in KERNEL[:-1]) + f" and {NAME[KERNEL[-1]]}"
