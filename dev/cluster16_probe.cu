// Is compute-sanitizer synccheck's "Missing wait" on 16-CTA clusters (ranks 8 and 9, softmax.cu's staged
// kernel) about our kernel or about the tool? Two trivially correct kernels, at 8 and 16 CTAs per cluster, 9
// clusters each: `local` (each CTA initialises an mbarrier, arrives on it and waits: no remote operation)
// and `push` (softmax.cu's exchange: each CTA's thread r sends 8 bytes into CTA r with st.async completing
// on CTA r's mbarrier; every CTA waits for CLUSTER pairs). Outputs are checked.
// Usage: nvcc -arch=sm_90a -o /tmp/probe dev/cluster16_probe.cu && compute-sanitizer --tool synccheck /tmp/probe
//        [PUSH(0|1) CLUSTER(8|16)]: that one only
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wait0(unsigned bar) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred P;\n\tmbarrier.try_wait.parity.shared::cta.b64 P, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, P;\n\t}" : "=r"(done) : "r"(bar) : "memory");
}

template <bool PUSH> __global__ void probe(float* out, int cluster) {
    __shared__ __align__(8) unsigned long long bar;
    __shared__ float2 parts[16];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const unsigned b = smem(&bar);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
        if (PUSH) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(cluster * 8) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
    if (!PUSH) {
        if (threadIdx.x == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(b) : "memory");
    } else if (threadIdx.x < (unsigned)cluster) {
        unsigned dst, rbar;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(smem(&parts[rank])), "r"(threadIdx.x));
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(b), "r"(threadIdx.x));
        asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                     ::"r"(dst), "f"((float)rank), "f"(1.f), "r"(rbar) : "memory");
    }
    wait0(b);
    if (threadIdx.x == 0) {
        float s = 0;
        if (PUSH) for (int r = 0; r < cluster; ++r) s += parts[r].x + parts[r].y;
        out[blockIdx.x] = PUSH ? s : (float)rank;
    }
}

int main(int argc, char** argv) {
    int bad = 0;
    for (int push = 0; push < 2; ++push) {
        for (int cluster = 8; cluster <= 16; cluster *= 2) {
            if (argc == 3 && (push != atoi(argv[1]) || cluster != atoi(argv[2]))) continue;  // one: PUSH CLUSTER
            const int grid = 9 * cluster;
            float* out;
            cudaMalloc(&out, grid * sizeof(float));
            cudaMemset(out, 0xff, grid * sizeof(float));
            void (*k)(float*, int) = push ? probe<true> : probe<false>;
            cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
            cudaLaunchConfig_t cfg = {};
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = cluster; attr.val.clusterDim.y = 1; attr.val.clusterDim.z = 1;
            cfg.gridDim = dim3(grid); cfg.blockDim = dim3(256); cfg.attrs = &attr; cfg.numAttrs = 1;
            cudaError_t e = cudaLaunchKernelEx(&cfg, k, out, cluster);
            cudaError_t s = cudaDeviceSynchronize();
            float h[144];
            cudaMemcpy(h, out, grid * sizeof(float), cudaMemcpyDeviceToHost);
            int wrong = 0;
            const float want_push = cluster * (cluster - 1) / 2.f + cluster;
            for (int i = 0; i < grid; ++i) wrong += h[i] != (push ? want_push : (float)(i % cluster));
            printf("%s cluster %d: launch %s, sync %s, wrong outputs %d\n", push ? "push" : "local", cluster,
                   cudaGetErrorString(e), cudaGetErrorString(s), wrong);
            bad += wrong + (e != cudaSuccess) + (s != cudaSuccess);
            cudaFree(out);
        }
    }
    return bad != 0;
}
