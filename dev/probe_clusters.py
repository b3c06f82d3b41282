"""How many clusters of each size the GPU can hold at once, for the forward and backward cluster kernels at
512 threads per CTA (cuOccupancyMaxActiveClusters): 0 means that cluster size cannot launch."""

import torch

from fastsoftmax.cuda import build, kernels


def main():
    cu = kernels.driver()
    torch.zeros(1, device="cuda")
    for kind, dtype in (("fwd", "bfloat16"), ("bwd", "float32")):
        for cluster in (2, 4, 8, 16):
            cfg = build.Config(kind, dtype, dtype, dtype, group=512, cluster=cluster, k=8)
            fn = kernels.function(cfg, torch.cuda.current_device())
            lc = cu.CUlaunchConfig()
            lc.gridDimX, lc.gridDimY, lc.gridDimZ = cluster * 64, 1, 1
            lc.blockDimX, lc.blockDimY, lc.blockDimZ = 512, 1, 1
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            lc.attrs, lc.numAttrs = [attr], 1
            n = kernels._ok(cu.cuOccupancyMaxActiveClusters(fn, lc), "cuOccupancyMaxActiveClusters")
            regs = build.ptxas_facts(build.compile_kernel(cfg, "sm_90a").log)["registers"]
            print(
                f"{kind} {dtype} cluster {cluster:2} x 512 threads, {regs} regs: {n} clusters at once "
                f"({n * cluster} CTAs)"
            )


if __name__ == "__main__":
    main()
