/* Shared by the native kernels: row prefetching, the dot product, softmax exponentials and
 * weighted sums of rows. */
#ifndef ROUTEFORMER_NATIVE_COMMON_H
#define ROUTEFORMER_NATIVE_COMMON_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* Name pasting for the fp32/fp64 template headers (*_impl.h, included once per type): RF_CAT(dot_, T_)
 * is dot_float when T_ is float (the second level expands the arguments before pasting). */
#define RF_CAT_(a, b) a##b
#define RF_CAT(a, b) RF_CAT_(a, b)

/* Ask for a row of `bytes` some iterations ahead: gathered or walked-back key and value rows are
 * spread over megabytes, and waiting for each one stalls the loop. */
#define PREFETCH_AHEAD 8
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at);
}

/* x · y with eight partial sums, one vector register: a single running sum is a chain of
 * dependent adds the compiler may not reorder, and consecutive dots are independent, so their
 * chains overlap. (Thirty-two sums spilled to the stack: 3x slower.) */
#define DEFINE_DOT(T_)                                                                             \
static inline T_ dot_##T_(const T_ *x, const T_ *y, int64_t n) {                                   \
    T_ part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0;                                              \
    int64_t c = 0;                                                                                 \
    for (; c + 8 <= n; c += 8)                                                                     \
        for (int u = 0; u < 8; u++) part[u] += x[c + u] * y[c + u];                                \
    for (; c < n; c++) total += x[c] * y[c];                                                       \
    for (int u = 0; u < 8; u++) total += part[u];                                                  \
    return total;                                                                                  \
}
DEFINE_DOT(float)
DEFINE_DOT(double)

/* exp_sum: x[i] = exp(x[i] − shift) for i < n (every x[i] <= shift), returns Σ x[i];
 * affine_max: w[i] = s[i]·scale + i·slope, returns the largest; index_sum: Σ_i i·w[i];
 * weighted_rows_generic: result[:] += Σ_i w[i] · value[i·stride + :] over n rows of `value`
 * (weighted_rows3_*, below, does three weight rows per pass). */
#define DEFINE_BAND_HELPERS(T_, EXP)                                                               \
static inline T_ exp_sum_generic_##T_(T_ *x, int64_t n, T_ shift) {                                \
    T_ total = 0;                                                                                  \
    for (int64_t i = 0; i < n; i++) { x[i] = EXP(x[i] - shift); total += x[i]; }                   \
    return total;                                                                                  \
}                                                                                                  \
static inline T_ affine_max_generic_##T_(const T_ *s, int64_t n, T_ scale, T_ slope, T_ *w) {     \
    T_ top = -INFINITY;                                                                            \
    for (int64_t i = 0; i < n; i++) { w[i] = s[i] * scale + (T_)i * slope; top = w[i] > top ? w[i] : top; } \
    return top;                                                                                    \
}                                                                                                  \
static inline T_ index_sum_generic_##T_(const T_ *w, int64_t n) {                                  \
    T_ sum = 0;                                                                                    \
    for (int64_t i = 0; i < n; i++) sum += w[i] * (T_)i;                                           \
    return sum;                                                                                    \
}                                                                                                  \
static inline void weighted_rows_generic_##T_(const T_ *w, const T_ *value, int64_t stride, int64_t n, \
                                              int64_t value_dim, T_ *result) {                     \
    for (int64_t i = 0; i < n; i++, value += stride)                                               \
        for (int64_t u = 0; u < value_dim; u++) result[u] += w[i] * value[u];                      \
}

DEFINE_BAND_HELPERS(double, exp)
DEFINE_BAND_HELPERS(float, expf)

#if defined(__AVX2__) && defined(__FMA__)
/* exp on 8 lanes for x in [-87, 0]: x = n·ln 2 + r, |r| <= ln 2 / 2, e^r by the degree-6
 * minimax polynomial of the Cephes library (relative error ~1e-7, as expf), times 2^n built in
 * the exponent bits. Softmax weights below e^-87 are clamped there: < 1e-37 of the largest. */
static inline __m256 exp_nonpositive_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline float horizontal_sum_ps(__m256 x) {
    float lanes[8], sum = 0;
    _mm256_storeu_ps(lanes, x);
    for (int c = 0; c < 8; c++) sum += lanes[c];
    return sum;
}

static inline float exp_sum_float(float *x, int64_t n, float shift) {
    __m256 total = _mm256_setzero_ps(), offset = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_nonpositive_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), offset));
        _mm256_storeu_ps(x + i, e);
        total = _mm256_add_ps(total, e);
    }
    return horizontal_sum_ps(total) + exp_sum_generic_float(x + i, n - i, shift);
}

/* w[i] = s[i]·scale + i·slope for i < n; returns max_i w[i]. */
static inline float affine_max_float(const float *s, int64_t n, float scale, float slope, float *w) {
    __m256 best = _mm256_set1_ps(-INFINITY), step = _mm256_set1_ps(8.0f * slope);
    __m256 ramp = _mm256_mul_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(slope));
    __m256 factor = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8, ramp = _mm256_add_ps(ramp, step)) {
        __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(s + i), factor, ramp);
        _mm256_storeu_ps(w + i, x);
        best = _mm256_max_ps(best, x);
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, best);
    for (int c = 0; c < 8; c++) top = lanes[c] > top ? lanes[c] : top;
    for (; i < n; i++) { w[i] = s[i] * scale + (float)i * slope; top = w[i] > top ? w[i] : top; }
    return top;
}

/* Σ_i i·w[i]. */
static inline float index_sum_float(const float *w, int64_t n) {
    __m256 total = _mm256_setzero_ps(), index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8, index = _mm256_add_ps(index, _mm256_set1_ps(8.0f)))
        total = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), index, total);
    float sum = horizontal_sum_ps(total);
    for (; i < n; i++) sum += w[i] * (float)i;
    return sum;
}

/* result_r[u0 : u0 + 8·lanes] += Σ_i w_r[i] · value[i·stride + u0 : …]: 3 x lanes accumulators.
 * Always inlined with a constant `lanes`, so the accumulators stay in registers (with a runtime
 * count of lanes they lived on the stack: a load and a store per multiply-add, ~4x slower). */
static inline __attribute__((always_inline)) void weighted_rows3_lanes(
        const float *w[3], const float *value, int64_t stride, int64_t n, int lanes, float *result[3]) {
    __m256 acc[3][4];
#pragma GCC unroll 4
    for (int c = 0; c < lanes; c++) acc[0][c] = acc[1][c] = acc[2][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i++, value += stride) {
        __m256 p0 = _mm256_broadcast_ss(w[0] + i), p1 = _mm256_broadcast_ss(w[1] + i);
        __m256 p2 = _mm256_broadcast_ss(w[2] + i);
#pragma GCC unroll 4
        for (int c = 0; c < lanes; c++) {
            __m256 x = _mm256_loadu_ps(value + 8 * c);
            acc[0][c] = _mm256_fmadd_ps(p0, x, acc[0][c]);
            acc[1][c] = _mm256_fmadd_ps(p1, x, acc[1][c]);
            acc[2][c] = _mm256_fmadd_ps(p2, x, acc[2][c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < lanes; c++)
        for (int r = 0; r < 3; r++)
            _mm256_storeu_ps(result[r] + 8 * c, _mm256_add_ps(_mm256_loadu_ps(result[r] + 8 * c), acc[r][c]));
}

/* result_r[:] += Σ_i w_r[i] · value[i·stride + :] for three weight rows at once: each value row is
 * loaded once for three queries (the one-query loop streams a band of values per query, which
 * leaves the pass bound by cache bandwidth). 32 columns at a time: 12 accumulators. */
static inline void weighted_rows3_float(const float *w[3], const float *value, int64_t stride, int64_t n,
                                        int64_t value_dim, float *result[3]) {
    if (value_dim % 8) {
        for (int r = 0; r < 3; r++) weighted_rows_generic_float(w[r], value, stride, n, value_dim, result[r]);
        return;
    }
    for (int64_t u0 = 0; u0 < value_dim; u0 += 32) {
        float *at[3] = {result[0] + u0, result[1] + u0, result[2] + u0};
        switch (value_dim - u0 >= 32 ? 4 : (int)(value_dim - u0) / 8) {
            case 4: weighted_rows3_lanes(w, value + u0, stride, n, 4, at); break;
            case 3: weighted_rows3_lanes(w, value + u0, stride, n, 3, at); break;
            case 2: weighted_rows3_lanes(w, value + u0, stride, n, 2, at); break;
            default: weighted_rows3_lanes(w, value + u0, stride, n, 1, at); break;
        }
    }
}
#else
static inline void weighted_rows3_float(const float *w[3], const float *value, int64_t stride, int64_t n,
                                        int64_t value_dim, float *result[3]) {
    for (int r = 0; r < 3; r++) weighted_rows_generic_float(w[r], value, stride, n, value_dim, result[r]);
}
static inline float affine_max_float(const float *s, int64_t n, float scale, float slope, float *w) {
    return affine_max_generic_float(s, n, scale, slope, w);
}
static inline float index_sum_float(const float *w, int64_t n) { return index_sum_generic_float(w, n); }
static inline float exp_sum_float(float *x, int64_t n, float shift) {
    return exp_sum_generic_float(x, n, shift);
}
#endif
static inline double exp_sum_double(double *x, int64_t n, double shift) {
    return exp_sum_generic_double(x, n, shift);
}
static inline double affine_max_double(const double *s, int64_t n, double scale, double slope, double *w) {
    return affine_max_generic_double(s, n, scale, slope, w);
}
static inline double index_sum_double(const double *w, int64_t n) { return index_sum_generic_double(w, n); }
static inline void weighted_rows3_double(const double *w[3], const double *value, int64_t stride, int64_t n,
                                         int64_t value_dim, double *result[3]) {
    for (int r = 0; r < 3; r++) weighted_rows_generic_double(w[r], value, stride, n, value_dim, result[r]);
}

/* bfloat16 storage, float32 arithmetic. A bf16 value is the top half of the float32 with the same
 * sign, exponent and leading 7 mantissa bits, so widening is a shift; narrowing rounds to nearest
 * even (what torch's .to(torch.bfloat16) does) and keeps NaNs NaN. Kernels that take bf16 load it
 * with these, accumulate in float32 and narrow only what they store. */
static inline float bf16_to_float(uint16_t x) {
    union { uint32_t bits; float value; } u = {.bits = (uint32_t)x << 16};
    return u.value;
}
static inline uint16_t float_to_bf16(float x) {
    union { float value; uint32_t bits; } u = {.value = x};
    if ((u.bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.bits >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((u.bits + 0x7fffu + ((u.bits >> 16) & 1u)) >> 16);
}
#if defined(__AVX512F__)
/* The first `n` of 16 lanes (all of them for n >= 16, none for n <= 0). */
static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}
/* 16 bf16 -> 16 float32 lanes. */
static inline __m512 load_bf16_ps(const uint16_t *x) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* 16 float32 lanes -> 16 bf16, rounded to nearest even in integer arithmetic. (The AVX-512 BF16
 * instruction vcvtneps2bf16 flushes subnormal inputs to zero, unlike torch: measured on this CPU,
 * tests/ops/test_bf16_conversions.py.) */
static inline void store_bf16_ps(uint16_t *y, __m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256((__m256i *)y, _mm512_cvtepi32_epi16(rounded));
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
/* 8 bf16 -> 8 float32 lanes (the AVX2 twin of load_bf16_ps). */
static inline __m256 load_bf16_ps8(const uint16_t *x) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Lane s of the result holds the sum of the lanes of v[s] (8 dot products' partial sums at once). */
static inline __m256 reduce8(const __m256 v[8]) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* 128-bit halves: slots 0-3, 4-7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Lanes [0, n) of 8 set, n clamped to [0, 8] (an AVX2 maskload / maskstore mask). */
static inline __m256i first_lanes8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)(n < 8 ? (n < 0 ? 0 : n) : 8)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The largest of 8 lanes (the local row softmax, the fp32 and bf16 routed-attention forwards). */
static inline float max8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* Σ weight[e] over the valid slots e < slots, on 8 lanes (one running scalar sum is a chain of 64
 * dependent adds a query): the forwards' softmax denominator. */
static inline float valid_weight_sum(const float *weight, const uint8_t *row_valid, int64_t slots) {
    __m256 lanes = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 8 <= slots; e += 8) {
        __m256i ok = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row_valid + e)));
        __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(ok, _mm256_setzero_si256()));
        lanes = _mm256_add_ps(lanes, _mm256_and_ps(keep, _mm256_loadu_ps(weight + e)));
    }
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float total = _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
    for (; e < slots; e++) total += row_valid[e] ? weight[e] : 0.0f;
    return total;
}

/* result[c] = Σ_e weight[e] · row_e[c] over the valid slots e < slots, row_e the row row_index[e] of
 * `base` (width columns, fp32 or, when bf16, bf16 widened exactly). The routed-attention kernels'
 * P·V (forward) and dq = Σ ds·k (backward): 64 columns at a time stay in eight registers across
 * the slots (summed in memory, every slot's column waited on the last slot's store: at T = 16384,
 * d = 64, on an AMD EPYC, the fp32 forward with a local index ran 56 ms, mostly that chain). Per
 * column the sum runs over e in order with one multiply-add each, as before. */
static inline void weighted_rows_sum(float *result, const void *base, int bf16, int64_t width,
                                     const int64_t *row_index, const uint8_t *row_valid, const float *weight,
                                     int64_t slots) {
    const int64_t element = bf16 ? 2 : 4, vectors = width / 8;
    for (int64_t first = 0; first < vectors; first += 8) {
        int64_t n = vectors - first < 8 ? vectors - first : 8; /* registers in use */
        __m256 acc[8];
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++) acc[s] = _mm256_setzero_ps();
        for (int64_t e = 0; e < slots; e++) {
            if (first == 0 && e + PREFETCH_AHEAD < slots)
                prefetch_row((const char *)base + row_index[e + PREFETCH_AHEAD] * width * element, width * element);
            if (!row_valid[e]) continue;
            __m256 w = _mm256_set1_ps(weight[e]);
            const char *row = (const char *)base + (row_index[e] * width + first * 8) * element;
#define WEIGHTED_ROW_LANES(s)                                                                               \
    acc[s] = _mm256_fmadd_ps(w, bf16 ? load_bf16_ps8((const uint16_t *)row + 8 * (s))                     \
                                     : _mm256_loadu_ps((const float *)row + 8 * (s)), acc[s])
            if (n == 8) { /* the usual case: no test per register */
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) WEIGHTED_ROW_LANES(s);
            } else {
#pragma GCC unroll 8
                for (int s = 0; s < 8; s++) if (s < n) WEIGHTED_ROW_LANES(s);
            }
#undef WEIGHTED_ROW_LANES
        }
#pragma GCC unroll 8
        for (int s = 0; s < 8; s++)
            if (s < n) _mm256_storeu_ps(result + (first + s) * 8, acc[s]);
    }
    for (int64_t c = vectors * 8; c < width; c++) { /* the last width % 8 columns */
        float sum = 0;
        for (int64_t e = 0; e < slots; e++) {
            if (!row_valid[e]) continue;
            float x = bf16 ? bf16_to_float(((const uint16_t *)base)[row_index[e] * width + c])
                           : ((const float *)base)[row_index[e] * width + c];
            sum = fmaf(weight[e], x, sum);
        }
        result[c] = sum;
    }
}
#endif

#if defined(__AVX512F__)
/* e^x on 16 lanes for x >= -87 (below, the lanes compute e^-87; callers clamp or mask them): the
 * Cephes polynomial of exp_nonpositive_ps, on 16 lanes (the local and linear kernels). */
static inline __m512 exp_from_minus87_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i scale = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(scale));
}
#endif

#endif
