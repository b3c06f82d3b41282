"""The numbers `ptxas -v` prints about a kernel, for both backends' compile snapshots and `asm`."""

from __future__ import annotations

import re


def facts(log: str) -> dict:
    """Registers, spill bytes and stack frame from ptxas -v lines (0 where a line is absent); the largest
    over the kernels of the log (a CUDA forward module holds two entry points)."""

    def num(pattern):
        return max((int(v) for v in re.findall(pattern, log)), default=0)

    return {
        "registers": num(r"Used (\d+) registers"),
        "stack_bytes": num(r"(\d+) bytes stack frame"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
    }
