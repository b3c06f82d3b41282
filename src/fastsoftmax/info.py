"""fs.info(): versions, which backends can run here, how each kernel family computes, the replay's launch
mechanism and the disk cache. Queries the device when called, never at import."""

from __future__ import annotations

import platform

import torch

from . import cache
from .heuristics import CUDA_PATHS, PATHS
from .heuristics import lm_head as lm_head_rules
from .kernels import replay as replay_mod
from .kernels.cuda import backend as cuda_backend
from .kernels.triton import backend as triton_backend

# How each kernel family computes (what a user comparing numerics needs).
KERNEL_FAMILIES = {
    "triton.softmax_fwd": {
        "paths": list(PATHS),
        "exp": "exp2((x - max) * log2(e)): ex2.approx.ftz.f32 on NVIDIA GPUs (results below 2^-126 flushed to 0), fp32",
        "log": "log2(s) * ln(2): lg2.approx.f32, once per row",
        "division": "one IEEE reciprocal per row (div.rn.f32), then a multiply per element",
        "accumulation": "fp32",
        "build_flags": "Triton defaults (no fast-math flag; exp/log are the approximate units above)",
    },
    "triton.softmax_bwd": {
        "paths": list(PATHS),
        "exp": "log_softmax only: exp2(y * log2(e)), ex2.approx.ftz.f32",
        "division": "none",
        "accumulation": "fp32 (sum(y*dy) or sum(dy) per row)",
        "build_flags": "Triton defaults (no fast-math flag)",
    },
    "cuda.softmax": {
        "paths": list(CUDA_PATHS),
        "exp": "__expf (ex2.approx.f32 of x*log2(e)), fp32; the online and staged forwards: ex2.approx.ftz.f32 "
        "(results below 2^-126 flushed to 0), outputs exp2(fma(x - max, log2(e), -log2(sum)))",
        "log": "logf and log2f (IEEE), once per row",
        "division": "warp, block, cluster: one IEEE division 1/sum per row, then a multiply per element; online "
        "and staged: none (log2(sum) in the exponent)",
        "accumulation": "fp32",
        "build_flags": "NVRTC --std=c++17, no -use_fast_math (fast_math: False); compiled to a cubin for the GPU",
        "fast_math": False,
        "fast_exp": True,
    },
    "triton.cross_entropy": {
        "kernels": ["ce_fwd", "ce_finish", "ce_bwd"],
        "exp": "exp2((z - max) * log2(e)): ex2.approx.ftz.f32; softcap tanh from exp(-2|u|) (a series below 0.125)",
        "log": "log2(s) * ln(2): lg2.approx.f32, once per row",
        "accumulation": "fp32; the reduction over rows in one program, in a fixed order (deterministic)",
        "build_flags": "Triton defaults (no fast-math flag)",
    },
    "triton.shard": {
        "kernels": ["shard_stats", "shard_apply"],
        "use": "fastsoftmax.distributed: a rank's slice of the classes (statistics, then outputs or dlogits)",
        "exp": "exp2(((z - max) - log(sum)) * log2(e)): ex2.approx.ftz.f32",
        "accumulation": "fp32; ranks' (max, sum of exp(z - max)) merged in torch ops (fp32, fp64 for fp64)",
        "build_flags": "Triton defaults (no fast-math flag)",
    },
    "lm_head": {
        "designs": [*lm_head_rules.DESIGNS, lm_head_rules.SLICED, lm_head_rules.FUSED],
        "kernels": ["scale_by", "lse_gemm", "lse_merge", "dlogits_gemm"],
        "gemms": "cuBLAS (torch.mm / addmm into a reused buffer of logits), logits in x's dtype",
        "accumulation": "dW in the weight's dtype, cuBLAS beta = 1 (one rounding per row chunk, or per row group "
        "in lce_sliced); lce_sliced's dx summed over the vocabulary slices in fp32 by cuBLAS (out_dtype), "
        "rounded once; db in fp32",
    },
    "torch": {
        "exp": "torch.exp in fp32 (fp64 for fp64)",
        "division": "true division per element",
        "accumulation": "fp32 (fp64 for fp64)",
        "build_flags": "PyTorch's own build",
    },
}


def _nvrtc_version() -> str | None:
    if cuda_backend.import_error():
        return None
    from .kernels.cuda.build import nvrtc_version

    try:
        return ".".join(map(str, nvrtc_version()))
    except Exception:  # the bindings import but libnvrtc is missing
        return None


def _driver_version() -> str | None:
    v = torch._C._cuda_getDriverVersion() if hasattr(torch._C, "_cuda_getDriverVersion") else 0
    return f"{v // 1000}.{v % 1000 // 10}" if v else None


def _auto(cuda: bool) -> dict:
    """What backend='auto' runs on each GPU here: the tuning table it reads (and how it matched the GPU's
    architecture), and whether its CUDA entries can run."""
    from .heuristics import device, tables

    if not cuda:
        return {"cpu": "torch's own kernels, with the library's conventions (the torch backend's native path)"}
    out = {}
    for i in range(torch.cuda.device_count()):
        facts = device.of(i)
        stem, _, match = tables.lookup(facts)
        off = cuda_backend.off()
        out[f"cuda:{i}"] = {
            "arch": tables.arch(facts),
            "table": stem,
            "match": match,
            "runs": (
                "the Triton kernels with their rules (no table for this architecture)"
                if stem is None
                else f"the table's choices{'' if not off else '; its CUDA entries run the Triton kernels: ' + off}"
            ),
        }
    return out


def info() -> dict:
    """Versions, which backends can run here, and how each kernel family computes. Queries the device
    when called, never at import."""
    from .version import __version__

    triton_version = None
    if not triton_backend.import_error():
        import triton

        triton_version = triton.__version__
    cuda = torch.cuda.is_available()
    interp = triton_backend.interpreted()
    return {
        "fastsoftmax": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "triton_interpreter": interp,
        "backends": {
            "triton": {
                "cuda": bool(cuda and triton_version and not interp),
                "cpu": bool(triton_version and interp),
            },
            "cuda": {
                "cuda": bool(cuda and not cuda_backend.off()),
                "cpu": False,
                "off": (cuda_backend.off() if cuda else "no CUDA device") or None,
            },
            "torch": {"cuda": cuda, "cpu": True},
        },
        "nvrtc": _nvrtc_version(),
        "cuda_driver": _driver_version() if cuda else None,
        "auto": _auto(cuda),
        "kernels": KERNEL_FAMILIES,
        "replay": replay(),
        "cache": {"directory": str(cache.root()) if cache.root() else None, "refused": cache.problems()},
    }


def replay() -> str:
    """How kernels are launched here, and whether eager calls seen before are replayed (kernels/replay.py)."""
    from .kernels.launch import describe

    how = describe()
    return how if replay_mod.ENABLED else f"{how}; the replay is off (FASTSOFTMAX_REPLAY=0)"
