// fastsoftmax CUDA kernels, compiled at run time by NVRTC (fastsoftmax/cuda/build.py) to a cubin for the
// GPU's exact architecture. No headers: conversions, the NaN-propagating max and the cluster operations
// are inline PTX, so the same source compiles in CI with nothing but the NVRTC wheel.
//
// Configuration, from -D options (one compile per distinct set):
//   FS_KIND   1 on-chip / streaming forward, 2 backward, 3 three-pass forward (the seed), 4 three-pass backward
//   IN_T      element type of x (forward) or y (backward): 0 fp32, 1 bf16, 2 fp16
//   OUT_T     element type of the output (y or dx)
//   D_T       element type of dy (backward)
//   GROUP     threads of one CTA that share a row; ROWS rows per CTA (GROUP * ROWS threads, ROWS > 1 only
//             when GROUP <= 32: a warp or sub-warp per row)
//   CLUSTER   CTAs of a thread-block cluster that share a row (sm_90); 1 = no cluster
//   K         16-byte vectors of the row each thread holds in registers (ONLINE 0)
//   ONLINE    1: loop over the row twice instead of holding it (any length)
//   STAGED    1 (sm_90, unit-stride rows): each CTA's slice of the row body (backward: of y and of dy, dy in
//             y's element size) is copied into shared memory by the bulk-copy engine (cp.async.bulk, an
//             mbarrier per 16 KiB piece), reduced and written from there: one read, a few registers per
//             thread, so several CTAs per SM overlap one's loads with another's reduction and stores; a
//             cluster's CTAs push their partials into each other (st.async, see reduce).
//             Dynamic shared memory: the slice's bytes (backward: twice).
//
// Entry points: fs_fwd / fs_fwd_log (FS_KIND 1: softmax / log_softmax, p.log unused), fs_bwd / fs_bwd_log
// (FS_KIND 2, likewise), fs_fwd3 and fs_bwd3 (these read p.log).
//
// Semantics (as every fastsoftmax backend): the row max is subtracted before exp; a row that is all -inf
// gives zeros (softmax) / -inf (log_softmax) and logsumexp -inf; NaN anywhere in a row, or +inf, gives NaN
// across the row; the backward gives dx = 0 on fully masked rows (sum f == 0) whatever dy holds.
// exp in the forward is ex2.approx.ftz.f32 of x*log2(e) (fexp: as __expf, with results below 2^-126 flushed
// to 0, one instruction instead of __expf's four); outputs are exp2((x - max)*log2(e) - log2(sum)), one
// fused multiply-add from x - max (exact); the backward's exp (log_softmax: exp(y)) is __expf; no
// -use_fast_math.
//
// Row geometry: row r = (b, i) starts at b*sxb + i*sxi elements; element j of it at j*sxn. With sxn == 1
// the row is cut into h scalar head elements (up to x's first 16-byte boundary), nv vectors of VEC
// elements, and t < VEC scalar tail elements; other tensors (y, dy) use 16-byte accesses for the same
// vectors when their own addresses allow it, scalar accesses otherwise. Nothing outside a row is touched.
//
// Measurements: bench/results/sweeps/staged_exchange.json, cuda_registers.json, staged_piece_size.json.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef long long i64;

#define NEG_INF __int_as_float(0xff800000)

struct Params {
    const char* x;  // forward: x; backward: y
    char* y;        // forward: y; backward: dx
    const char* d;  // backward: dy
    float* lse;     // forward: per-row logsumexp, or null
    i64 rows, n_i;  // rows = n_b * n_i, row r = (r / n_i, r % n_i)
    i64 sxb, sxi, sxn, syb, syi, syn, sdb, sdi, sdn, slb, sli;  // element strides
    int n;          // row length
    int log;        // log_softmax
};

template <int T> struct Ty { enum { SZ = T == 0 ? 4 : 2 }; };

constexpr int VEC = 16 / Ty<IN_T>::SZ;  // elements per vector: one 16-byte access of x

// exp(x) as ex2.approx.ftz.f32 of x*log2(e): results below 2^-126 (and subnormal inputs) flushed to 0.
constexpr float LOG2E = 1.4426950408889634f;
__device__ __forceinline__ float fexp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ float fexp(float x) { return fexp2(x * LOG2E); }

__device__ __forceinline__ float maxnan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Per 16-bit half of two words of two 16-bit elements (T 1: bf16, 2: fp16): the max, NaN if either is NaN.
template <int T> __device__ __forceinline__ u32 maxnan2(u32 a, u32 b) {
    u32 r;
    if (T == 1) asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    else asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

template <int T> __device__ __forceinline__ float to_float(u32 bits) {
    if (T == 0) return __uint_as_float(bits);
    if (T == 1) return __uint_as_float(bits << 16);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)bits));
    return f;
}

template <int T> __device__ __forceinline__ u32 from_float(float f) {
    if (T == 0) return __float_as_uint(f);
    u16 h;
    if (T == 1) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats as one 32-bit word of two 16-bit elements (lo first), one conversion instruction.
template <int T> __device__ __forceinline__ u32 from_float2(float lo, float hi) {
    u32 w;
    if (T == 1) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

// A vector of VEC elements of type T as raw 32-bit words (2, 4 or 8 of them).
template <int T> struct Raw { u32 w[VEC * Ty<T>::SZ / 4]; };

template <int T> __device__ __forceinline__ float elem(const Raw<T>& r, int j) {
    if (Ty<T>::SZ == 4) return to_float<T>(r.w[j]);
    return to_float<T>((j & 1) ? (r.w[j >> 1] >> 16) : (r.w[j >> 1] & 0xffffu));
}

// Load VEC elements at p: wide accesses when `wide` (unit stride, aligned), else one by one at `stride` bytes.
template <int T> __device__ __forceinline__ void load(Raw<T>& r, const char* p, bool wide, i64 stride) {
    constexpr int BYTES = VEC * Ty<T>::SZ;
    if (wide) {
        if (BYTES == 8) {
            uint2 q = *reinterpret_cast<const uint2*>(p);
            r.w[0] = q.x; r.w[1] = q.y;
        } else {
#pragma unroll
            for (int k = 0; k < BYTES / 16; ++k) {
                uint4 q = reinterpret_cast<const uint4*>(p)[k];
                r.w[4 * k] = q.x; r.w[4 * k + 1] = q.y; r.w[4 * k + 2] = q.z; r.w[4 * k + 3] = q.w;
            }
        }
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (Ty<T>::SZ == 4) {
                r.w[j] = *reinterpret_cast<const u32*>(p + j * stride);
            } else {
                u32 h = *reinterpret_cast<const u16*>(p + j * stride);
                r.w[j >> 1] = (j & 1) ? (r.w[j >> 1] | (h << 16)) : h;
            }
        }
    }
}

template <int T> __device__ __forceinline__ void store(char* p, const float (&f)[VEC], bool wide, i64 stride) {
    constexpr int BYTES = VEC * Ty<T>::SZ;
    if (wide) {
        Raw<T> r;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (Ty<T>::SZ == 4) r.w[j] = from_float<T>(f[j]);
            else if (j & 1) r.w[j >> 1] = from_float2<T>(f[j - 1], f[j]);
        }
        if (BYTES == 8) {
            *reinterpret_cast<uint2*>(p) = make_uint2(r.w[0], r.w[1]);
        } else {
#pragma unroll
            for (int k = 0; k < BYTES / 16; ++k)
                reinterpret_cast<uint4*>(p)[k] = make_uint4(r.w[4 * k], r.w[4 * k + 1], r.w[4 * k + 2], r.w[4 * k + 3]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            u32 b = from_float<T>(f[j]);
            if (Ty<T>::SZ == 4) *reinterpret_cast<u32*>(p + j * stride) = b;
            else *reinterpret_cast<u16*>(p + j * stride) = (u16)b;
        }
    }
}

template <int T> __device__ __forceinline__ float load1(const char* p) {
    return to_float<T>(Ty<T>::SZ == 4 ? *reinterpret_cast<const u32*>(p) : *reinterpret_cast<const u16*>(p));
}

template <int T> __device__ __forceinline__ void store1(char* p, float f) {
    u32 b = from_float<T>(f);
    if (Ty<T>::SZ == 4) *reinterpret_cast<u32*>(p) = b;
    else *reinterpret_cast<u16*>(p) = (u16)b;
}

// Whether a vector access of T at p (and every VEC elements after it) can be one wide access.
template <int T> __device__ __forceinline__ bool wide_ok(const char* p, i64 stride_elems) {
    constexpr int BYTES = VEC * Ty<T>::SZ;
    return stride_elems == 1 && (reinterpret_cast<u64>(p) % (BYTES < 16 ? BYTES : 16)) == 0;
}

// ---- row geometry ----------------------------------------------------------------------------------

__device__ __forceinline__ void row_of(const Params& p, i64 row, i64& b, i64& i) {
    if (p.n_i == 1) { b = row; i = 0; }
    else { b = row / p.n_i; i = row - b * p.n_i; }
}

struct Row {
    const char* x;  // row start of x (forward) / y (backward)
    char* y;
    const char* d;
    int h, nv, t;              // head scalars, body vectors, tail scalars
    i64 xs, ys, ds;            // bytes between elements
    i64 vx, vy, vd;            // bytes between vectors
    const char *xb, *db;       // body starts (after the head)
    char* yb;
    bool xwide, ywide, dwide;  // whether each tensor's body takes 16-byte (vector-wide) accesses
};

template <int TX, int TY, int TD>
__device__ __forceinline__ Row row_geometry(const Params& p, i64 row) {
    Row R;
    i64 b, i;
    row_of(p, row, b, i);
    R.x = p.x + (b * p.sxb + i * p.sxi) * Ty<TX>::SZ;
    R.y = p.y + (b * p.syb + i * p.syi) * Ty<TY>::SZ;
    R.d = p.d ? p.d + (b * p.sdb + i * p.sdi) * Ty<TD>::SZ : nullptr;
    int h = 0;
    if (p.sxn == 1) {
        h = (int)(((16 - (reinterpret_cast<u64>(R.x) & 15)) & 15) / Ty<TX>::SZ);
        if (h > p.n) h = p.n;
    }
    R.h = h;
    R.nv = (p.n - h) / VEC;
    R.t = p.n - h - R.nv * VEC;
    R.xs = p.sxn * Ty<TX>::SZ;
    R.ys = p.syn * Ty<TY>::SZ;
    R.ds = p.sdn * Ty<TD>::SZ;
    R.vx = VEC * R.xs;
    R.vy = VEC * R.ys;
    R.vd = VEC * R.ds;
    R.xb = R.x + h * R.xs;
    R.yb = R.y + h * R.ys;
    R.db = R.d ? R.d + h * R.ds : nullptr;
    R.xwide = p.sxn == 1;  // h took x to its 16-byte boundary
    R.ywide = wide_ok<TY>(R.yb, p.syn);
    R.dwide = R.d && wide_ok<TD>(R.db, p.sdn);
    return R;
}

// Store body vectors v0, v0 + step, ... (N of them, those below nv) of this row: element j of vector k is
// value(k, j), written in the output type with 16-byte stores where the output allows.
template <int N, class F> __device__ __forceinline__ void write_body(const Row& R, int v0, int step, F value) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
        int v = v0 + k * step;
        if (v < R.nv) {
            float f[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) f[j] = value(k, j);
            store<OUT_T>(R.yb + v * R.vy, f, R.ywide, R.ys);
        }
    }
}

// ---- reductions -------------------------------------------------------------------------------------

// (max, sum of exp(x - max)) pairs, merged; NaN and +inf poison the sum, all -inf stays (-inf, 0).
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
    float mx = maxnan(m, m2);
    float base = mx == NEG_INF ? 0.f : mx;
    s = s * __expf(m - base) + s2 * __expf(m2 - base);
    m = mx;
}

struct Pair { float a, b; };

template <bool MS> __device__ __forceinline__ void combine(Pair& u, Pair v) {
    if (MS) merge(u.a, u.b, v.a, v.b);
    else { u.a += v.a; u.b += v.b; }
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r = 0;
    if (CLUSTER > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// An mbarrier at shared address bar expecting one arrival, its initialisation visible cluster-wide.
__device__ __forceinline__ void mbar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrive on `bar` expecting `bytes` of asynchronous copies (bulk copies, st.async) to complete on it.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Wait for phase 0 of the mbarrier at shared address bar to complete.
__device__ __forceinline__ void mbar_wait(u32 bar) {
    u32 done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred P;\n\tmbarrier.try_wait.parity.shared::cta.b64 P, [%1], 0;\n\t"
                     "selp.u32 %0, 1, 0, P;\n\t}" : "=r"(done) : "r"(bar) : "memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ float cluster_load(const float* local, u32 rank) {
    u32 remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// How CTAs of a cluster exchange their partials: pushed (the staged variant: PUSH) as below; otherwise (the
// variants holding the row in registers, at 64 registers per thread: the push's few more live registers
// spilled 8 bytes at cluster fp32 262144) each CTA reads the others' through distributed shared memory
// between two cluster barriers, the second keeping every CTA until the others have read it. (Pushing beat
// reading by up to 1.24x on the staged kernels.)
#define PUSH (CLUSTER > 1 && STAGED)

#if CLUSTER > 1
// The push exchange of per-CTA partials (reduce): each CTA pushes its pair into parts[its rank] of every
// CTA of the cluster with st.async, completing 8 bytes on that CTA's mbarrier, and waits on its own for all
// CLUSTER pairs. The one cluster barrier this needs (every CTA's mbarrier initialised before any CTA writes
// to it) is arrived at by cluster_begin, at kernel start, and waited on in reduce, by when every CTA has long
// arrived; no CTA waits at the end for others to finish reading it (all writes into a CTA complete on its
// mbarrier before it passes its wait). One exchange per kernel: phase 0 only.
struct Exchange { Pair parts[CLUSTER]; unsigned long long bar; };
__shared__ __align__(8) Exchange xch;
#endif

// Every kernel body's first step (every thread of the CTA): arm the push exchange.
__device__ __forceinline__ void cluster_begin() {
#if PUSH
    if (threadIdx.x == 0) {  // (mbar_init with the arrival before the fence: the order the H200 runs had)
        const u32 bar = smem_addr(&xch.bar);
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
        mbar_expect(bar, CLUSTER * 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

// A pair reduced over the lanes of a warp whose xor offsets are below W (every such lane ends with the
// same bits: the merges are commutative, so the butterfly is symmetric).
template <bool MS, int W> __device__ __forceinline__ Pair butterfly(Pair v) {
#pragma unroll
    for (int off = W / 2; off > 0; off /= 2) {
        Pair o = {__shfl_xor_sync(0xffffffffu, v.a, off), __shfl_xor_sync(0xffffffffu, v.b, off)};
        combine<MS>(v, o);
    }
    return v;
}

// Lane 0's pair, in every lane of the warp.
__device__ __forceinline__ Pair from_lane0(Pair v) {
    return {__shfl_sync(0xffffffffu, v.a, 0), __shfl_sync(0xffffffffu, v.b, 0)};
}

// Reduce a pair over the GROUP threads of a row in this CTA, then over the CLUSTER CTAs of the row. Every
// thread of the row ends with the same bits. Past a warp, each warp merges the per-warp partials by a
// butterfly over lanes (lane w reading warp w's partial) instead of each thread merging them one by one,
// and in a cluster lane r reads CTA r's partial through distributed shared memory (per CTA, a few remote
// loads per warp, not two per rank per thread); lane 0's result is then every lane's (the lanes past the
// partials merged copies). Called once per kernel, by every thread of the CTA.
template <bool MS> __device__ __forceinline__ Pair reduce(Pair v) {
    static_assert(CLUSTER == 1 || GROUP > 32, "a cluster shares rows of one CTA each");
    v = butterfly<MS, GROUP < 32 ? GROUP : 32>(v);
    if constexpr (GROUP > 32) {  // one row per CTA
        constexpr int NW = GROUP / 32;
        __shared__ Pair warps[NW > 0 ? NW : 1];  // (declared, not used, when GROUP <= 32)
        const int lane = threadIdx.x % 32;
        if (lane == 0) warps[threadIdx.x / 32] = v;
        __syncthreads();
        v = from_lane0(butterfly<MS, NW>(warps[lane < NW ? lane : 0]));  // lanes past NW merged no full set
#if CLUSTER > 1 && !PUSH
        if (threadIdx.x == 0) xch.parts[0] = v;
        cluster_sync();  // every CTA's partial is written and visible cluster-wide
        if (lane < CLUSTER) v = {cluster_load(&xch.parts[0].a, lane), cluster_load(&xch.parts[0].b, lane)};
        v = from_lane0(butterfly<MS, CLUSTER < 32 ? CLUSTER : 32>(v));
        cluster_sync();  // no CTA leaves (its shared memory) while another still reads it
#elif PUSH
        asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // every CTA's xch.bar is initialised
        if (threadIdx.x < CLUSTER) {  // thread r sends this CTA's pair to CTA r
            const u32 mine = smem_addr(&xch.parts[cluster_rank()]), own_bar = smem_addr(&xch.bar);
            u32 dst, bar;
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(mine), "r"(threadIdx.x));
            asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(bar) : "r"(own_bar), "r"(threadIdx.x));
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
                         ::"r"(dst), "f"(v.a), "f"(v.b), "r"(bar) : "memory");
        }
        mbar_wait(smem_addr(&xch.bar));  // all CLUSTER pairs are here
        if (lane < CLUSTER) v = xch.parts[lane];
        v = from_lane0(butterfly<MS, CLUSTER < 32 ? CLUSTER : 32>(v));
#endif
    }
    return v;
}

// This thread's place: g of G threads sharing its row (across the cluster), and the row (clamped to a real
// one when the CTA's last row slots are empty: such threads compute and store nothing, since every thread
// must reach the barriers).
struct Thread { int g, G; i64 row; bool row_ok; };

__device__ __forceinline__ Thread thread_of(const Params& p) {
    cluster_begin();
    Thread t;
    t.G = GROUP * CLUSTER;
    t.g = cluster_rank() * GROUP + threadIdx.x % GROUP;
    t.row = (i64)(blockIdx.x / CLUSTER) * ROWS + threadIdx.x / GROUP;
    t.row_ok = t.row < p.rows;
    if (!t.row_ok) t.row = p.rows - 1;
    return t;
}

// Raw words of VEC elements that all read as -inf (pad = true) or +0 (pad = false) in type T: padding
// that every reduction ignores (max: -inf; sum of exp: exp(-inf) = 0; backward: a = f = 0).
template <int T> __device__ __forceinline__ void fill(Raw<T>& r, bool neg_inf) {
    const u32 bits = !neg_inf ? 0u : T == 0 ? 0xff800000u : T == 1 ? 0xff80ff80u : 0xfc00fc00u;
#pragma unroll
    for (int w = 0; w < VEC * Ty<T>::SZ / 4; ++w) r.w[w] = bits;
}

// Load vector v of the body when v < nv, else padding: every load of a batch is issued before any is used.
template <int T> __device__ __forceinline__ void load_or_pad(Raw<T>& r, int v, int nv, const char* base, i64 vstride,
                                                             bool wide, i64 stride, bool neg_inf) {
    if (v < nv) load<T>(r, base + v * vstride, wide, stride);
    else fill<T>(r, neg_inf);
}

// Load body vectors v0, v0 + step, ... (N of them) of x (or y) / of dy, padding past the body; every load of
// the batch is issued before any is used.
template <int N> __device__ __forceinline__ void load_body(Raw<IN_T> (&r)[N], const Row& R, int v0, int step,
                                                           bool neg_inf) {
#pragma unroll
    for (int k = 0; k < N; ++k) load_or_pad<IN_T>(r[k], v0 + k * step, R.nv, R.xb, R.vx, R.xwide, R.xs, neg_inf);
}

template <int N> __device__ __forceinline__ void load_dy(Raw<D_T> (&r)[N], const Row& R, int v0, int step) {
#pragma unroll
    for (int k = 0; k < N; ++k) load_or_pad<D_T>(r[k], v0 + k * step, R.nv, R.db, R.vd, R.dwide, R.ds, false);
}

// The backward's batch: body vectors v0, v0 + step, ... of y (padded with ypad's identity) and of dy (0).
template <int N> __device__ __forceinline__ void load_y_dy(Raw<IN_T> (&ry)[N], Raw<D_T> (&rd)[N], const Row& R,
                                                           int v0, int step, bool ypad) {
    load_body<N>(ry, R, v0, step, ypad);
    load_dy<N>(rd, R, v0, step);
}

#if FS_KIND == 1 || FS_KIND == 2
// CTAs per SM ptxas must leave room for, from a register budget per thread: 64 for the fp32 forward and the
// streaming forward (1.2-1.7x faster than 128, no spills), else 128 (16-bit rows held on chip need them);
// or, for tuning experiments, the MIN_CTAS_SET the launcher was given.
#if defined(MIN_CTAS_SET) && MIN_CTAS_SET > 0
constexpr int MIN_CTAS = MIN_CTAS_SET;
#else
// (The one exception, checked by compiling every variant: a lone 512-thread CTA holding 8 fp32 vectors per
// thread, which ptxas spills 8 bytes for at 64.)
constexpr bool LONE_FULL_CTA = !ONLINE && CLUSTER == 1 && GROUP * ROWS == 512 && K == 8;
constexpr int REG_BUDGET = STAGED || (FS_KIND == 1 && (ONLINE || (K * VEC <= 32 && !LONE_FULL_CTA))) ? 64 : 128;
constexpr int CTAS_FOR_BUDGET = 65536 / (GROUP * ROWS * REG_BUDGET);
constexpr int MIN_CTAS = CTAS_FOR_BUDGET < 1 ? 1 : CTAS_FOR_BUDGET > 16 ? 16 : CTAS_FOR_BUDGET;
#endif
#endif
#if ONLINE
constexpr int BATCH = 4;  // vectors per thread in flight per step of the streaming loops
#endif

#if STAGED
extern __shared__ __align__(128) unsigned char stage[];  // this CTA's slice of the row body (backward: y, dy)

// The slice arrives in 16 KiB pieces, each completing its own mbarrier (4-16 KiB measured alike; the largest
// needs the fewest barriers).
constexpr int PIECE_VECS = 1024;
constexpr int MAX_PIECES = 12;  // a slice of at most 192 KiB (heuristics/softmax_cuda.py's STAGE_MAX)

// Copy `bytes` (a multiple of 16) from global src (16-byte aligned) into shared memory at dst with the
// bulk-copy engine, completing them on `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const char* src, u32 bytes, u32 bar) {
    u64 g;
    asm("cvta.to.global.u64 %0, %1;" : "=l"(g) : "l"(reinterpret_cast<u64>(src)));
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(g), "r"(bytes), "r"(bar) : "memory");
}

// This CTA's part of a row body staged: its slice [v0, v0 + cnt) of the body vectors, in pieces of
// PIECE_VECS vectors, each with its own mbarrier (bars: MAX_PIECES of them in shared memory).
struct Slice { int v0, cnt, per, pieces; u32 bar0, dst; };

__device__ __forceinline__ Slice slice_of(const Row& R, const u64* bars) {
    Slice S;
    S.per = (R.nv + CLUSTER - 1) / CLUSTER;
    const int lo = (int)cluster_rank() * S.per;
    S.v0 = lo < R.nv ? lo : R.nv;
    S.cnt = R.nv - S.v0 < S.per ? R.nv - S.v0 : S.per;
    S.pieces = (S.cnt + PIECE_VECS - 1) / PIECE_VECS;
    S.bar0 = smem_addr(bars);
    S.dst = smem_addr(stage);
    return S;
}

// Thread 0 initialises the slice's barriers and issues its copies: x (y) at the slice's start and, when
// given, dy right after (16 * per bytes on); the CTA waits for neither here.
__device__ __forceinline__ void stage_slice(const Slice& S, const char* xb, const char* db) {
    if (threadIdx.x == 0) {
        for (int k = 0; k < S.pieces; ++k) mbar_init(S.bar0 + 8 * k);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 0; k < S.pieces; ++k) {
            const int a = k * PIECE_VECS, len = (S.cnt - a < PIECE_VECS ? S.cnt - a : PIECE_VECS);
            mbar_expect(S.bar0 + 8 * k, (db ? 32 : 16) * len);
            bulk_copy(S.dst + 16 * a, xb + (i64)(S.v0 + a) * 16, 16 * len, S.bar0 + 8 * k);
            if (db) bulk_copy(S.dst + 16 * (S.per + a), db + (i64)(S.v0 + a) * 16, 16 * len, S.bar0 + 8 * k);
        }
    }
}

// Every thread is past its waits: thread 0 invalidates the barriers.
__device__ __forceinline__ void release_slice(const Slice& S) {
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 0; k < S.pieces; ++k) asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(S.bar0 + 8 * k) : "memory");
    }
}

// The 16 bytes of vector v of the staged slices (dy's vector v is vector per + v), one shared-memory load.
template <int T> __device__ __forceinline__ void staged_raw(Raw<T>& r, int v) {
    static_assert(sizeof(Raw<T>) == 16, "staged vectors are 16 bytes of every staged tensor");
    const uint4 q = reinterpret_cast<const uint4*>(stage)[v];
    r.w[0] = q.x; r.w[1] = q.y; r.w[2] = q.z; r.w[3] = q.w;
}
#endif

#if FS_KIND == 1
// ---- forward: on chip (ONLINE 0: one read) or streaming (ONLINE 1: two reads) ----------------------

// The row's output scale from its (max, sum): out_value(x) is exp(x - m) / s or (x - m) - log s, with no
// per-element test. A row all -inf (m = -inf, s = 0) takes m = 0, log2 s = log s = 0: its elements, all
// -inf, give exp2(-inf) = 0 and -inf. NaN or +inf in the row: s is NaN, so is every output.
struct Out { float m, l2s, logs; };
__device__ __forceinline__ Out out_scale(float m, float s) {
    if (m == NEG_INF) return {0.f, 0.f, 0.f};
    return {m, log2f(s), logf(s)};
}
__device__ __forceinline__ float out_value(float x, const Out& o, int log) {
    return log ? (x - o.m) - o.logs : fexp2(fmaf(x - o.m, LOG2E, -o.l2s));
}

// Fold VEC elements of each of N vectors into the running (max, sum of exp(x - max)).
template <int N> __device__ __forceinline__ void fold(float& m, float& s, const Raw<IN_T> (&r)[N]) {
    float mv = m;
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) mv = maxnan(mv, elem<IN_T>(r[k], j));
    const float base = mv == NEG_INF ? 0.f : mv;  // all -inf so far: exp(-inf - 0) = 0, never NaN
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc += fexp(elem<IN_T>(r[k], j) - base);
    s = s * fexp(m - base) + acc;
    m = mv;
}

// This thread's head and tail scalars of x's row (-inf where it has none).
__device__ __forceinline__ void load_edges(const Thread& T, const Row& R, float& hv, float& tv) {
    hv = T.g < R.h ? load1<IN_T>(R.x + T.g * R.xs) : NEG_INF;
    tv = T.g < R.t ? load1<IN_T>(R.xb + ((i64)R.nv * VEC + T.g) * R.xs) : NEG_INF;
}

// The running (max, sum of exp(x - max)) started from this thread's head and tail scalars (-inf where none).
__device__ __forceinline__ void edge_start(float hv, float tv, float& m, float& s) {
    m = maxnan(hv, tv);
    const float base = m == NEG_INF ? 0.f : m;  // all -inf: exp(-inf - 0) = 0, never NaN
    s = fexp(hv - base) + fexp(tv - base);
}

// The row's logsumexp, when asked for, by the row's first thread.
__device__ __forceinline__ void write_lse(const Params& p, const Thread& T, float m, float logs) {
    if (p.lse && T.g == 0) {
        i64 b, i;
        row_of(p, T.row, b, i);
        p.lse[b * p.slb + i * p.sli] = m == NEG_INF ? NEG_INF : m + logs;
    }
}

#if STAGED
// Vector v of the slice as one value, reduced as a tree (a short chain in the caller's loop): its max (MAX),
// or its sum of exp(x - base).
template <bool MAX> __device__ __forceinline__ float staged_reduce(int v, float base) {
    Raw<IN_T> r;
    staged_raw<IN_T>(r, v);
    float e[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) e[j] = MAX ? elem<IN_T>(r, j) : fexp(elem<IN_T>(r, j) - base);
#pragma unroll
    for (int w = VEC / 2; w > 0; w /= 2)
#pragma unroll
        for (int j = 0; j < w; ++j) e[j] = MAX ? maxnan(e[j], e[j + w]) : e[j + w] + e[j];
    return e[0];
}

// The max of m and of slice vectors a + threadIdx.x, + GROUP, ... below b. 16-bit elements: two at a time by
// max.NaN on packed pairs (exact; NaN if any is NaN), unpacked once at the end.
__device__ __forceinline__ float staged_max(int a, int b, float m) {
    if (Ty<IN_T>::SZ == 4) {
#pragma unroll 4
        for (int v = a + threadIdx.x; v < b; v += GROUP) m = maxnan(m, staged_reduce<true>(v, 0.f));
        return m;
    }
    u32 m2 = IN_T == 1 ? 0xff80ff80u : 0xfc00fc00u;  // -inf, -inf
#pragma unroll 4
    for (int v = a + threadIdx.x; v < b; v += GROUP) {
        Raw<IN_T> r;
        staged_raw<IN_T>(r, v);
        m2 = maxnan2<IN_T>(m2, maxnan2<IN_T>(maxnan2<IN_T>(r.w[0], r.w[1]), maxnan2<IN_T>(r.w[2], r.w[3])));
    }
    return maxnan(m, maxnan(to_float<IN_T>(m2 & 0xffffu), to_float<IN_T>(m2 >> 16)));
}

template <bool LOG> __device__ __forceinline__ void fwd_body(const Params& p) {
    __shared__ __align__(8) u64 bars[MAX_PIECES];
    const Thread T = thread_of(p);
    const Row R = row_geometry<IN_T, OUT_T, IN_T>(p, T.row);  // unit stride: R.vx == 16
    const Slice S = slice_of(R, bars);
    stage_slice(S, R.xb, nullptr);
    float hv, tv, mt, s;
    load_edges(T, R, hv, tv);
    edge_start(hv, tv, mt, s);
    // Piece by piece as each arrives (the reduction overlaps the rest of the copy): the piece's max, then
    // its sum of exp(x - max) merged into (mt, s).
    for (int k = 0; k < S.pieces; ++k) {
        const int a = k * PIECE_VECS, b = (S.cnt - a < PIECE_VECS ? S.cnt : a + PIECE_VECS);
        mbar_wait(S.bar0 + 8 * k);
        const float mk = staged_max(a, b, mt);
        const float base = mk == NEG_INF ? 0.f : mk;  // all -inf so far: exp(-inf - 0) = 0, never NaN
        float acc = 0.f;
#pragma unroll 4
        for (int v = a + threadIdx.x; v < b; v += GROUP) acc += staged_reduce<false>(v, base);
        s = s * fexp(mt - base) + acc;
        mt = mk;
    }
    release_slice(S);
    const Pair ms = reduce<true>({mt, s});
    const float m = ms.a;
    const Out o = out_scale(m, ms.b);
    if (!T.row_ok) return;
    write_lse(p, T, m, o.logs);
    if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, out_value(hv, o, LOG));
    if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, out_value(tv, o, LOG));
#pragma unroll 4
    for (int v = threadIdx.x; v < S.cnt; v += GROUP) {
        Raw<IN_T> r;
        staged_raw<IN_T>(r, v);
        float f[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) f[j] = out_value(elem<IN_T>(r, j), o, LOG);
        store<OUT_T>(R.yb + (i64)(S.v0 + v) * R.vy, f, R.ywide, R.ys);
    }
}
#elif ONLINE
template <bool LOG> __device__ __forceinline__ void fwd_body(const Params& p) {
    const Thread T = thread_of(p);
    const Row R = row_geometry<IN_T, OUT_T, IN_T>(p, T.row);
    float hv, tv, m, s;
    load_edges(T, R, hv, tv);
    edge_start(hv, tv, m, s);
    for (int v0 = T.g; v0 < R.nv; v0 += BATCH * T.G) {
        Raw<IN_T> r[BATCH];
        load_body<BATCH>(r, R, v0, T.G, true);
        fold<BATCH>(m, s, r);
    }
    Pair ms = reduce<true>({m, s});
    m = ms.a;
    const Out o = out_scale(m, ms.b);
    if (!T.row_ok) return;
    write_lse(p, T, m, o.logs);
    if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, out_value(hv, o, LOG));
    if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, out_value(tv, o, LOG));
    for (int v0 = T.g; v0 < R.nv; v0 += BATCH * T.G) {
        Raw<IN_T> r2[BATCH];
        load_body<BATCH>(r2, R, v0, T.G, true);
        write_body<BATCH>(R, v0, T.G, [&](int k, int j) { return out_value(elem<IN_T>(r2[k], j), o, LOG); });
    }
}
#else
// The row held on chip (one read), exp computed once per element for softmax: each thread subtracts its own
// max mt, holds e = exp(x - mt) as floats, and after the row reduction gives (M, S) writes e * c with
// c = exp(mt - M) / S. Special rows: M = -inf (all -inf): c = 0, zeros; NaN or +inf anywhere: S is NaN,
// so c and every output are NaN, also on threads whose own values were all -inf (0 * NaN).
// log_softmax holds x and writes (x - M) - log S.
template <bool LOG> __device__ __forceinline__ void fwd_body(const Params& p) {
    const Thread T = thread_of(p);
    const Row R = row_geometry<IN_T, OUT_T, IN_T>(p, T.row);
    float hv, tv;
    load_edges(T, R, hv, tv);
    float v[K][VEC];  // the thread's body values as floats (padding: -inf)
    {
        Raw<IN_T> r[K];
        load_body<K>(r, R, T.g, T.G, true);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = elem<IN_T>(r[k], j);
    }
    float mt = maxnan(hv, tv);
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) mt = maxnan(mt, v[k][j]);
    const float base = mt == NEG_INF ? 0.f : mt;  // all -inf here: exp(-inf - 0) = 0, never NaN
    float s;
    if (LOG) {
        s = __expf(hv - base) + __expf(tv - base);
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int j = 0; j < VEC; ++j) s += __expf(v[k][j] - base);
    } else {
        hv = __expf(hv - base);
        tv = __expf(tv - base);
        s = hv + tv;
#pragma unroll
        for (int k = 0; k < K; ++k)
#pragma unroll
            for (int j = 0; j < VEC; ++j) { v[k][j] = __expf(v[k][j] - base); s += v[k][j]; }
    }
    const Pair ms = reduce<true>({mt, s});
    const float m = ms.a;
    if (!T.row_ok) return;
    write_lse(p, T, m, logf(ms.b));
    if (LOG) {
        const Out o = out_scale(m, ms.b);
        if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, out_value(hv, o, 1));
        if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, out_value(tv, o, 1));
        write_body<K>(R, T.g, T.G, [&](int k, int j) { return out_value(v[k][j], o, 1); });
    } else {
        const float c = m == NEG_INF ? 0.f : (mt == NEG_INF ? 0.f : __expf(mt - m)) * (1.0f / ms.b);
        if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, hv * c);
        if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, tv * c);
        write_body<K>(R, T.g, T.G, [&](int k, int j) { return v[k][j] * c; });
    }
}

#endif

// Two entry points, softmax and log_softmax (p.log is not read): one body each, so that ptxas allocates
// registers for one set of held values (a runtime branch between both bodies in one kernel spilled).
extern "C" __global__ void __launch_bounds__(GROUP * ROWS, MIN_CTAS) fs_fwd(const Params p) { fwd_body<false>(p); }
extern "C" __global__ void __launch_bounds__(GROUP * ROWS, MIN_CTAS) fs_fwd_log(const Params p) { fwd_body<true>(p); }
#endif

#if FS_KIND == 2
// ---- backward: dx = a - f * sum(a), a = y*dy, f = y (softmax) / a = dy, f = exp(y) (log_softmax) ------

template <bool LOG> __device__ __forceinline__ void terms(float y, float dy, float& a, float& f) {
    if (LOG) { a = dy; f = __expf(y); }
    else { a = y * dy; f = y; }
}

template <bool LOG> __device__ __forceinline__ float grad(float y, float dy, float s, float t) {
    float a, f;
    terms<LOG>(y, dy, a, f);
    return t == 0.f ? 0.f : a - f * s;
}

template <bool LOG, int N> __device__ __forceinline__ void sums(float& s, float& t, const Raw<IN_T> (&ry)[N],
                                                                const Raw<D_T> (&rd)[N]) {
#pragma unroll
    for (int k = 0; k < N; ++k)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            float a, f;
            terms<LOG>(elem<IN_T>(ry[k], j), elem<D_T>(rd[k], j), a, f);
            s += a;
            t += f;
        }
}

// This thread's head and tail scalars of y and dy (where it has none: y -inf for log_softmax, where
// f = exp(y) = 0, else 0; dy 0), and their terms as the start of the row sums (s, t).
template <bool LOG> __device__ __forceinline__ void load_edges_bwd(const Thread& T, const Row& R, float& hy, float& hd,
                                                                   float& ty, float& td, float& s, float& t) {
    hy = LOG ? NEG_INF : 0.f; hd = 0.f; ty = hy; td = 0.f;
    if (T.g < R.h) { hy = load1<IN_T>(R.x + T.g * R.xs); hd = load1<D_T>(R.d + T.g * R.ds); }
    if (T.g < R.t) {
        i64 j = (i64)R.nv * VEC + T.g;
        ty = load1<IN_T>(R.xb + j * R.xs); td = load1<D_T>(R.db + j * R.ds);
    }
    float a, f;
    s = 0.f; t = 0.f;
    terms<LOG>(hy, hd, a, f); s += a; t += f;
    terms<LOG>(ty, td, a, f); s += a; t += f;
}

#if STAGED
// y and dy staged (dy in y's element size and alignment, kernels.backward checks): the sums (s, t) piece by
// piece as the copies arrive, dx written from shared memory. One read of y and dy, one write of dx.
template <bool LOG> __device__ __forceinline__ void bwd_body(const Params& p) {
    static_assert(Ty<D_T>::SZ == Ty<IN_T>::SZ, "the staged backward stages dy in y's element size");
    __shared__ __align__(8) u64 bars[MAX_PIECES];
    const Thread T = thread_of(p);
    const Row R = row_geometry<IN_T, OUT_T, D_T>(p, T.row);
    const Slice S = slice_of(R, bars);
    stage_slice(S, R.xb, R.db);
    float hy, hd, ty, td, s, t;
    load_edges_bwd<LOG>(T, R, hy, hd, ty, td, s, t);
    for (int k = 0; k < S.pieces; ++k) {
        const int lo = k * PIECE_VECS, hi = (S.cnt - lo < PIECE_VECS ? S.cnt : lo + PIECE_VECS);
        mbar_wait(S.bar0 + 8 * k);
#pragma unroll 4
        for (int v = lo + threadIdx.x; v < hi; v += GROUP) {
            Raw<IN_T> ry;
            Raw<D_T> rd;
            staged_raw<IN_T>(ry, v);
            staged_raw<D_T>(rd, S.per + v);
            float sa[VEC], sf[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) terms<LOG>(elem<IN_T>(ry, j), elem<D_T>(rd, j), sa[j], sf[j]);
#pragma unroll
            for (int w = VEC / 2; w > 0; w /= 2)
#pragma unroll
                for (int j = 0; j < w; ++j) { sa[j] += sa[j + w]; sf[j] += sf[j + w]; }
            s += sa[0];
            t += sf[0];
        }
    }
    release_slice(S);
    const Pair st = reduce<false>({s, t});
    s = st.a; t = st.b;
    if (!T.row_ok) return;
    if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, grad<LOG>(hy, hd, s, t));
    if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, grad<LOG>(ty, td, s, t));
#pragma unroll 4
    for (int v = threadIdx.x; v < S.cnt; v += GROUP) {
        Raw<IN_T> ry;
        Raw<D_T> rd;
        staged_raw<IN_T>(ry, v);
        staged_raw<D_T>(rd, S.per + v);
        float o[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) o[j] = grad<LOG>(elem<IN_T>(ry, j), elem<D_T>(rd, j), s, t);
        store<OUT_T>(R.yb + (i64)(S.v0 + v) * R.vy, o, R.ywide, R.ys);
    }
}
#else
template <bool LOG> __device__ __forceinline__ void bwd_body(const Params& p) {
    const Thread T = thread_of(p);
    const Row R = row_geometry<IN_T, OUT_T, D_T>(p, T.row);
    const bool ypad = LOG;  // padding y: -inf for log_softmax (f = exp(y) = 0), 0 for softmax; dy: 0
    float hy, hd, ty, td, s, t;
    load_edges_bwd<LOG>(T, R, hy, hd, ty, td, s, t);
#if ONLINE
    for (int v0 = T.g; v0 < R.nv; v0 += BATCH * T.G) {
        Raw<IN_T> ry[BATCH];
        Raw<D_T> rd[BATCH];
        load_y_dy<BATCH>(ry, rd, R, v0, T.G, ypad);
        sums<LOG, BATCH>(s, t, ry, rd);
    }
#else
    Raw<IN_T> ry[K];
    Raw<D_T> rd[K];
    load_y_dy<K>(ry, rd, R, T.g, T.G, ypad);
    sums<LOG, K>(s, t, ry, rd);
#endif
    Pair st = reduce<false>({s, t});
    s = st.a; t = st.b;
    if (!T.row_ok) return;
    if (T.g < R.h) store1<OUT_T>(R.y + T.g * R.ys, grad<LOG>(hy, hd, s, t));
    if (T.g < R.t) store1<OUT_T>(R.yb + ((i64)R.nv * VEC + T.g) * R.ys, grad<LOG>(ty, td, s, t));
#if ONLINE
    for (int v0 = T.g; v0 < R.nv; v0 += BATCH * T.G) {
        Raw<IN_T> ry2[BATCH];
        Raw<D_T> rd2[BATCH];
        load_y_dy<BATCH>(ry2, rd2, R, v0, T.G, ypad);
        write_body<BATCH>(R, v0, T.G, [&](int k, int j) {
            return grad<LOG>(elem<IN_T>(ry2[k], j), elem<D_T>(rd2[k], j), s, t);
        });
    }
#else
    write_body<K>(R, T.g, T.G, [&](int k, int j) { return grad<LOG>(elem<IN_T>(ry[k], j), elem<D_T>(rd[k], j), s, t); });
#endif
}
#endif  // STAGED

// Two entry points, softmax and log_softmax (p.log is not read): the per-element terms without a runtime
// branch (one kernel reading p.log kept a branch per element in the loops, ptxas did not unswitch them).
extern "C" __global__ void __launch_bounds__(GROUP * ROWS, MIN_CTAS) fs_bwd(const Params p) { bwd_body<false>(p); }
extern "C" __global__ void __launch_bounds__(GROUP * ROWS, MIN_CTAS) fs_bwd_log(const Params p) { bwd_body<true>(p); }
#endif

#if FS_KIND == 3
// ---- the seed kernel: three passes, one CTA of 256 threads per row, shared-memory tree reductions -----

extern "C" __global__ void __launch_bounds__(256) fs_fwd3(const Params p) {
    __shared__ float red[256];
    const int tid = threadIdx.x;
    const i64 row = blockIdx.x;
    i64 b, i;
    row_of(p, row, b, i);
    const char* x = p.x + (b * p.sxb + i * p.sxi) * Ty<IN_T>::SZ;
    char* y = p.y + (b * p.syb + i * p.syi) * Ty<OUT_T>::SZ;
    const i64 xs = p.sxn * Ty<IN_T>::SZ, ys = p.syn * Ty<OUT_T>::SZ;

    // pass 1: block max (NaN-propagating)
    float m = NEG_INF;
    for (int j = tid; j < p.n; j += 256) m = maxnan(m, load1<IN_T>(x + j * xs));
    red[tid] = m;
    __syncthreads();
    for (int s = 128; s > 0; s /= 2) {
        if (tid < s) red[tid] = maxnan(red[tid], red[tid + s]);
        __syncthreads();
    }
    m = red[0];
    __syncthreads();  // everyone has read the max before red is reused for the sum
    const float base = m == NEG_INF ? 0.f : m;  // an all -inf row: exp(-inf - 0) = 0, not NaN

    // pass 2: block sum of exp(x - max)
    float sum = 0.f;
    for (int j = tid; j < p.n; j += 256) sum += __expf(load1<IN_T>(x + j * xs) - base);
    red[tid] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s /= 2) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    sum = red[0];

    // pass 3: write
    const float inv = 1.0f / sum, logs = logf(sum);
    if (p.lse && tid == 0) p.lse[b * p.slb + i * p.sli] = m == NEG_INF ? NEG_INF : m + logs;
    for (int j = tid; j < p.n; j += 256) {
        float v = load1<IN_T>(x + j * xs), o;
        if (m == NEG_INF) o = p.log ? NEG_INF : 0.f;
        else o = p.log ? (v - m) - logs : __expf(v - m) * inv;
        store1<OUT_T>(y + j * ys, o);
    }
}
#endif

#if FS_KIND == 4
// ---- three-pass backward: sums of a and f by a shared-memory tree, then the write (y, dy read twice) ---

extern "C" __global__ void __launch_bounds__(256) fs_bwd3(const Params p) {
    __shared__ float red_a[256], red_f[256];
    const int tid = threadIdx.x;
    const i64 row = blockIdx.x;
    i64 b, i;
    row_of(p, row, b, i);
    const char* y = p.x + (b * p.sxb + i * p.sxi) * Ty<IN_T>::SZ;
    const char* d = p.d + (b * p.sdb + i * p.sdi) * Ty<D_T>::SZ;
    char* dx = p.y + (b * p.syb + i * p.syi) * Ty<OUT_T>::SZ;
    const i64 xs = p.sxn * Ty<IN_T>::SZ, ds = p.sdn * Ty<D_T>::SZ, ys = p.syn * Ty<OUT_T>::SZ;
    float sa = 0.f, sf = 0.f;
    for (int j = tid; j < p.n; j += 256) {
        float yv = load1<IN_T>(y + j * xs), dv = load1<D_T>(d + j * ds);
        sa += p.log ? dv : yv * dv;
        sf += p.log ? __expf(yv) : yv;
    }
    red_a[tid] = sa;
    red_f[tid] = sf;
    __syncthreads();
    for (int s = 128; s > 0; s /= 2) {
        if (tid < s) { red_a[tid] += red_a[tid + s]; red_f[tid] += red_f[tid + s]; }
        __syncthreads();
    }
    sa = red_a[0];
    sf = red_f[0];
    for (int j = tid; j < p.n; j += 256) {
        float yv = load1<IN_T>(y + j * xs), dv = load1<D_T>(d + j * ds);
        float a = p.log ? dv : yv * dv, f = p.log ? __expf(yv) : yv;
        store1<OUT_T>(dx + j * ys, sf == 0.f ? 0.f : a - f * sa);
    }
}
#endif
