"""Does a cubin from a newer NVRTC load on this driver? `cubin_compat.py make DIR` (on a machine with the
newer NVRTC, no GPU needed) compiles the kernels two problems use into DIR; `cubin_compat.py run DIR` (on
the GPU) loads exactly those cubins, never compiling, runs the problems and checks them."""

import os
import sys

PROBLEMS = [("warp", "float32", (4096, 1000)), ("cluster", "bfloat16", (64, 65536))]


def main():
    mode, cache = sys.argv[1], os.path.abspath(sys.argv[2])
    os.environ["FASTSOFTMAX_CACHE_DIR"] = cache
    from fastsoftmax.cuda import build

    if mode == "make":
        from fastsoftmax.cuda.kernels import config_for

        for variant, dtype, (m, n) in PROBLEMS:
            for backward in (False, True):
                _, cfg = config_for(variant, dtype, n, n_rows=m, backward=backward)
                build.compile_kernel(cfg, "sm_90a")
        print(f"NVRTC {build.nvrtc_version()}: wrote {sorted(os.listdir(cache))}")
        return
    import torch

    import fastsoftmax as fs
    from fastsoftmax import heuristics
    from fastsoftmax.reference import compare

    made = tuple(int(v) for v in open(os.path.join(cache, "NVRTC")).read().split("."))
    print(f"driver {torch.cuda.get_device_name()}; local NVRTC {build.nvrtc_version()}; cubins from NVRTC {made}")
    build.nvrtc_version = lambda: made  # the cache keys the carried cubins were written under

    def no_compile(*a):
        raise RuntimeError("cache miss: would compile here instead of loading the carried cubin")

    build._nvrtc = no_compile
    for variant, dtype, shape in PROBLEMS:
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
        with heuristics.force(path=variant):
            y = fs.softmax(x, backend="cuda")
            dx = fs.softmax_backward(torch.randn_like(y), y, backend="cuda")
        err, problem = compare(y, x, -1, False)
        assert problem is None and not dx.isnan().any(), problem
        print(f"{variant} {dtype} {shape}: loaded and ran the NVRTC {made} cubin, err/tol {err:.3f}")


if __name__ == "__main__":
    main()
