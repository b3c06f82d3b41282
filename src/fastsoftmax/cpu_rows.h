// The CPU's row kernels: softmax, log_softmax, cross-entropy's loss and its gradient along rows in
// memory, for fp32 and bf16, in fp32 registers, each output rounded once. Vectors of GCC's vector extension
// (16 floats where the build targets AVX-512, 8 for AVX2, else 4: SSE2 or NEON), so the compiler's flags pick
// the ISA: torch_build.py passes the one torch's own CPU kernels run with on this machine.
// Why not torch's kernels: its exp costs 1.4-1.7 ns an element on the 2-core EPYC of CI, this one 0.6-0.8
// (tests/test_cpu_rows.py holds its error; bench/results/cpu_torch.json the speed), and its bf16
// log_softmax rounds x - max before subtracting log(sum) (errors past 70x the bf16 tolerance). The backward
// is about torch's speed, but its callers then hold their tensors by reference across the GIL release
// (torch's kernels copy their handles: fastlaunch_torch.cpp's NoGil) and its masked rows need no second pass.
// Traffic: softmax and log_softmax read a row twice (max, then exps; fp32 softmax keeps its exps in y, bf16
// in a per-thread fp32 row) and write it once; the loss reads a row twice (three times with smoothing) and
// writes nothing per element; its gradient reads it twice and writes it once; the backward of softmax and
// log_softmax reads y and dy twice (the row's sum, then dx) and writes dx once.
// NaN conventions, those of torch's kernels (callers find the rows starting with NaN and fix them): a row
// whose max is not finite (fully masked, or holding +inf; NaN is skipped by the max) is NaN throughout, and
// a NaN element makes the row's sum, hence the whole row, NaN.
#ifndef FASTSOFTMAX_CPU_ROWS_H
#define FASTSOFTMAX_CPU_ROWS_H

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rows {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));  // (bit arithmetic: unsigned, so it wraps)
typedef uint16_t vh __attribute__((vector_size(W * 2)));

struct bf16 {  // bf16's bits (at::BFloat16's layout)
    uint16_t bits;
};

inline vf splat(float a) { return vf{} + a; }
template <class To, class From>
inline To bits_as(From v) {  // the same bits as another type (of the same size)
    static_assert(sizeof(To) == sizeof(From));
    To t;
    memcpy(&t, &v, sizeof t);
    return t;
}
inline vf select(vi mask, vf a, vf b) { return bits_as<vf>((mask & bits_as<vi>(a)) | (~mask & bits_as<vi>(b))); }

inline float widen(float v) { return v; }
inline float widen(bf16 v) { return bits_as<float>(uint32_t(v.bits) << 16); }
inline void narrow(float* p, float v) { *p = v; }
inline void narrow(bf16* p, float v) {  // round to nearest even; NaN stays NaN (quiet)
    const uint32_t u = bits_as<uint32_t>(v);
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    p->bits = nan ? uint16_t((u >> 16) | 0x40) : uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

inline vf load(const float* p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
inline vf load(const bf16* p) {
#if defined(__AVX512F__)  // (one widening load: GCC splits the generic conversion in halves)
    // (the all-lanes mask: GCC 12 warns of the unmasked form's undefined vector)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return bits_as<vf>(bits_as<vu>(_mm512_maskz_cvtepu16_epi32(0xFFFF, h)) << 16);
#elif defined(__AVX2__)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return bits_as<vf>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    vh h;
    memcpy(&h, p, sizeof h);
    return bits_as<vf>(__builtin_convertvector(h, vu) << 16);
#endif
}
inline void store(float* p, vf v) { memcpy(p, &v, sizeof v); }
inline vu bf16_bits(vf v) {  // narrow()'s rounding, lane by lane: each lane's bf16 bits, below 2^16
    const vu u = bits_as<vu>(v), hi = u >> 16;
    return bits_as<vu>(select(v != v, bits_as<vf>(hi | 0x40u), bits_as<vf>((u + ((hi & 1u) + 0x7FFFu)) >> 16)));
}
inline void store(bf16* p, vf v) {
    const vu r = bf16_bits(v);
#if defined(__AVX512F__)  // (each lane below 2^16: a truncating narrow, one instruction)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits_as<__m512i>(r)));
#elif defined(__AVX2__)  // (a saturating pack, in-lane, then the halves in order)
    const __m256i packed = _mm256_packus_epi32(bits_as<__m256i>(r), bits_as<__m256i>(r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8)));
#else
    const vh h = __builtin_convertvector(r, vh);
    memcpy(p, &h, sizeof h);
#endif
}
// two vectors at p: for bf16, one pack of both (store's rounding) under AVX2 and AVX-512
inline void store2(float* p, vf a, vf b) { store(p, a), store(p + W, b); }
inline void store2(bf16* p, vf a, vf b) {
#if defined(__AVX512F__)  // (the pack works within 128-bit lanes: the 64-bit pieces put back in order)
    const __m512i packed = _mm512_packus_epi32(bits_as<__m512i>(bf16_bits(a)), bits_as<__m512i>(bf16_bits(b)));
    const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi64(order, packed));
#elif defined(__AVX2__)
    const __m256i packed = _mm256_packus_epi32(bits_as<__m256i>(bf16_bits(a)), bits_as<__m256i>(bf16_bits(b)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, 0xD8));
#else
    store(p, a), store(p + W, b);
#endif
}
// the k < W elements at p, the rest of the vector ``fill``
template <class T>
inline vf load_part(const T* p, long k, float fill) {
    vf v = splat(fill);
    for (long i = 0; i < k; ++i) v[i] = widen(p[i]);
    return v;
}
template <class T>
inline void store_part(T* p, vf v, long k) {
    for (long i = 0; i < k; ++i) narrow(p + i, v[i]);
}

inline bool any_lane(vi m) {  // whether a lane of the comparison m is true
#if defined(__AVX512F__)
    return _mm512_movepi32_mask(bits_as<__m512i>(m)) != 0;
#elif defined(__AVX2__)
    return _mm256_movemask_ps(bits_as<__m256>(m)) != 0;
#else
    uint64_t w[W / 2], a = 0;
    memcpy(w, &m, sizeof m);
    for (int i = 0; i < W / 2; ++i) a |= w[i];
    return a != 0;
#endif
}

// exp(d) for d <= 0 (the rows' x - max): Cephes' expf polynomial on d - n ln2, scaled by 2^n; 0 below
// -87.3 (and for -inf), NaN for NaN. Within 2 ulp of exp (tests/test_cpu_rows.py).
[[gnu::always_inline]] inline vf exp_nonpositive(vf d) {  // (inlined: its constants stay in registers)
    const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer, held in the low bits
    const vf t = d * splat(1.44269504088896341f) + magic;
    const vf n = t - magic;
    vf r = d - n * splat(0.693359375f);
    r = r - n * splat(-2.12194440e-4f);
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const vu scale = (bits_as<vu>(t) - 0x4B400000u + 127u) << 23;  // 2^n (t's bits: 0x4B400000 + n)
    return select(d < splat(-87.33654f), splat(0.0f), p * bits_as<vf>(scale));
}

// exp(d) for the lanes exp_nonpositive leaves: above 0, exp(d / 2) squared (d / 2 capped at 50, so that the
// square overflows to inf where exp does); below -87.34, exp(d + 25 ln 2) * 2^-25, subnormal as exp's (0 below
// -103.98); else exp_nonpositive's.
[[gnu::noinline]] inline vf exp_outside(vf d) {
    const vf h = d * splat(0.5f);
    const vf half = exp_nonpositive(select(h > splat(50.0f), splat(50.0f), h));
    const vf tiny = exp_nonpositive(d + splat(17.32867951399863f)) * splat(2.98023223876953125e-8f);
    return select(d > splat(0.0f), half * half, select(d < splat(-87.33654f), tiny, exp_nonpositive(d)));
}

// exp(d) for any d: within 4 ulp where exp is normal; subnormal below -87.34 as exp's (to 4e-6 relative), 0
// exactly where it is (log_softmax's backward: a row is fully masked where every exp of y is 0 in fp32, as
// torch's reference has it; its y are <= 0, but for a caller's own values)
[[gnu::always_inline]] inline vf exp_any(vf d) {
    if (any_lane((d > splat(0.0f)) | (d < splat(-87.33654f)))) return exp_outside(d);
    return exp_nonpositive(d);
}

inline float lanes_max(vf v) {
    float m = v[0];
    for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
    return m;
}
inline float lanes_sum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += v[i];
    return s;
}

// the row's max, NaN skipped (-inf for a row of -inf and NaN); two vectors at a time (a compare and a
// blend wait for the last one: two chains in flight)
template <class T>
inline float row_max(const T* x, long n) {
    vf m0 = splat(-INFINITY), m1 = m0;
    long i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        const vf a = load(x + i), b = load(x + i + W);
        m0 = select(a > m0, a, m0);
        m1 = select(b > m1, b, m1);
    }
    for (; i < n; i += W) {
        const vf a = i + W <= n ? load(x + i) : load_part(x + i, n - i, -INFINITY);
        m0 = select(a > m0, a, m0);
    }
    m0 = select(m1 > m0, m1, m0);
    return lanes_max(m0);
}

// the row's sum, four vectors at a time (each add waits for the last one)
template <class T>
inline float row_sum(const T* x, long n) {
    vf s0 = splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
    long i = 0;
    for (; i + 4 * W <= n; i += 4 * W) {
        s0 += load(x + i);
        s1 += load(x + i + W);
        s2 += load(x + i + 2 * W);
        s3 += load(x + i + 3 * W);
    }
    for (; i + W <= n; i += W) s0 += load(x + i);
    if (i < n) s0 += load_part(x + i, n - i, 0.0f);
    return lanes_sum((s0 + s1) + (s2 + s3));
}

// sum of exp(x - m) over the row; where e is given, each exp stored there (fp32)
template <class T>
inline float row_exp_sum(const T* x, long n, float m, float* e) {
    const vf mv = splat(m);
    vf s = splat(0.0f), s1 = s;
    long i = 0;
    for (; i + 2 * W <= n; i += 2 * W) {
        const vf a = exp_nonpositive(load(x + i) - mv), b = exp_nonpositive(load(x + i + W) - mv);
        if (e) store(e + i, a), store(e + i + W, b);
        s += a;
        s1 += b;
    }
    s += s1;
    for (; i + W <= n; i += W) {
        const vf v = exp_nonpositive(load(x + i) - mv);
        if (e) store(e + i, v);
        s += v;
    }
    if (i < n) {
        const vf v = exp_nonpositive(load_part(x + i, n - i, -INFINITY) - mv);
        if (e) store_part(e + i, v, n - i);
        s += v;
    }
    return lanes_sum(s);
}

template <class T>
inline void fill_nan(T* y, long n) {
    for (long i = 0; i < n; ++i) narrow(y + i, NAN);
}

template <class T>
inline void fill_zero(T* y, long n) {
    std::memset(static_cast<void*>(y), 0, sizeof(T) * n);  // (+0.0 in fp32 and bf16 alike)
}

inline std::vector<float>& scratch(long n) {  // a per-thread fp32 row (bf16 softmax's exps)
    thread_local std::vector<float> row;
    if (long(row.size()) < n) row.resize(n);
    return row;
}

// softmax (log: log_softmax) of the row x (n elements) into y
template <class T>
void softmax_row(const T* x, T* y, long n, bool log) {
    const float m = row_max(x, n);
    if (!std::isfinite(m)) return fill_nan(y, n);
    if (log) {
        const vf shift = splat(m), ls = splat(std::log(row_exp_sum(x, n, m, nullptr)));
        long i = 0;
        for (; i + W <= n; i += W) store(y + i, (load(x + i) - shift) - ls);
        if (i < n) store_part(y + i, (load_part(x + i, n - i, 0.0f) - shift) - ls, n - i);
        return;
    }
    float* e = sizeof(T) == 4 ? reinterpret_cast<float*>(y) : scratch(n).data();
    const vf inv = splat(1.0f / row_exp_sum(x, n, m, e));
    long i = 0;
    for (; i + W <= n; i += W) store(y + i, load(e + i) * inv);
    if (i < n) store_part(y + i, load_part(e + i, n - i, 0.0f) * inv, n - i);
}

// cross-entropy's loss of the row x for class t (in [0, n)), with label smoothing eps:
// (1 - eps) * (lse - x[t]) + eps * (lse - mean(x)); NaN where the row's max is not finite
template <class T>
float cross_entropy_row(const T* x, long n, long t, float eps) {
    const float m = row_max(x, n);
    if (!std::isfinite(m)) return NAN;
    const float lse = m + std::log(row_exp_sum(x, n, m, nullptr));
    const float nll = lse - widen(x[t]);
    if (eps == 0.0f) return nll;
    return (1.0f - eps) * nll + eps * (lse - row_sum(x, n) / float(n));
}

// cross-entropy's gradient along the row x for class t (in [0, n)) and the row's factor g (the upstream
// gradient, over the kept rows for a mean): dx = g * softmax(x) - g at t, in fp32, rounded once
template <class T>
void cross_entropy_backward_row(const T* x, T* dx, long n, long t, float g) {
    const float m = row_max(x, n);
    if (!std::isfinite(m)) return fill_nan(dx, n);
    float* e = sizeof(T) == 4 ? reinterpret_cast<float*>(dx) : scratch(n).data();
    const float scale = g / row_exp_sum(x, n, m, e);
    const float at_t = e[t] * scale - g;
    const vf sv = splat(scale);
    long i = 0;
    for (; i + W <= n; i += W) store(dx + i, load(e + i) * sv);
    if (i < n) store_part(dx + i, load_part(e + i, n - i, 0.0f) * sv, n - i);
    narrow(dx + t, at_t);
}

// softmax's backward of the row (log: log_softmax's) from its output y and the upstream gradient dy, into dx:
// dx = y * (dy - sum(y * dy)), log: dx = dy - exp(y) * sum(dy), in fp32, rounded once; 0 on a fully masked
// row (softmax: y all 0; log_softmax: every exp of y 0 in fp32, that is every y below -103.98) whatever dy
// holds, as on every backend. Four sums in flight (each add waits for the last one).
template <class T>
void softmax_backward_row(const T* dy, const T* y, T* dx, long n, bool log) {
    float s;
    long i = 0;
    if (log) {
        s = row_sum(dy, n);
    } else {
        vf s0 = splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
        for (; i + 4 * W <= n; i += 4 * W) {
            s0 += load(y + i) * load(dy + i);
            s1 += load(y + i + W) * load(dy + i + W);
            s2 += load(y + i + 2 * W) * load(dy + i + 2 * W);
            s3 += load(y + i + 3 * W) * load(dy + i + 3 * W);
        }
        for (; i + W <= n; i += W) s0 += load(y + i) * load(dy + i);
        if (i < n) s0 += load_part(y + i, n - i, 0.0f) * load_part(dy + i, n - i, 0.0f);
        s = lanes_sum((s0 + s1) + (s2 + s3));
    }
    const vf sv = splat(s);
    i = 0;
    if (log) {  // (masked: every exp 0; NaN != 0)
        vi nonzero = vi{};
        for (; i + 2 * W <= n; i += 2 * W) {
            const vf e0 = exp_any(load(y + i)), e1 = exp_any(load(y + i + W));
            nonzero |= (e0 != splat(0.0f)) | (e1 != splat(0.0f));
            store2(dx + i, load(dy + i) - e0 * sv, load(dy + i + W) - e1 * sv);
        }
        for (; i + W <= n; i += W) {
            const vf e = exp_any(load(y + i));
            nonzero |= e != splat(0.0f);
            store(dx + i, load(dy + i) - e * sv);
        }
        if (i < n) {
            const vf e = exp_any(load_part(y + i, n - i, -INFINITY));
            nonzero |= e != splat(0.0f);
            store_part(dx + i, load_part(dy + i, n - i, 0.0f) - e * sv, n - i);
        }
        if (!any_lane(nonzero)) fill_zero(dx, n);
        return;
    }
    if (!std::isfinite(s)) {  // (y all 0 gives 0 below, unless dy holds inf or NaN: then s is not finite)
        bool masked = true;
        for (long k = 0; k < n && masked; ++k) masked = widen(y[k]) == 0.0f;
        if (masked) return fill_zero(dx, n);
    }
    for (; i + 2 * W <= n; i += 2 * W)
        store2(dx + i, load(y + i) * (load(dy + i) - sv), load(y + i + W) * (load(dy + i + W) - sv));
    for (; i + W <= n; i += W) store(dx + i, load(y + i) * (load(dy + i) - sv));
    if (i < n) store_part(dx + i, load_part(y + i, n - i, 0.0f) * (load_part(dy + i, n - i, 0.0f) - sv), n - i);
}

}  // namespace rows

#endif
