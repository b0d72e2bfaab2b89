/* Chunk input and output for the causal linear attention kernels (linear_kernels.c): rows of q, k,
 * v, out, grad_out from fp32 or bf16 storage into padded fp32 chunk buffers (with the feature map
 * phi = elu + 1 applied on the way in, 16 lanes at a time), gradients back out (times phi'), and
 * the causal triangle of a chunk's score block. Exported (rf_linear_*) for linear_kernels.c.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

static inline float feature(float x) { return x > 0 ? x + 1.0f : expf(x); }
static inline float feature_slope(float x) { return x > 0 ? 1.0f : expf(x); }

#if defined(__AVX512F__)
/* exp on 16 lanes for x <= 0 (clamped at -87): the Cephes polynomial of common.h's 8-lane version. */
static inline __m512 exp_nonpositive_512(__m512 x) {
    /* clamped to [-87, 0] in this order: a NaN lane becomes -87 (min/max return their second operand) */
    return exp_from_minus87_512(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_setzero_ps()));
}

/* 16 values of a row from fp32 or bf16 storage; lanes past `count` read as 0. */
static inline __m512 load16(const void *src, int64_t at, int bf16, __mmask16 keep) {
    if (bf16) {
        __m256i half = _mm256_maskz_loadu_epi16(keep, (const uint16_t *)src + at);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    return _mm512_maskz_loadu_ps(keep, (const float *)src + at);
}

static inline __mmask16 lanes_left(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/* The 8-lane (AVX2) twins of the loops below: 8 values of a row from fp32 or bf16 storage, phi and
 * phi' on 8 lanes (exp clamped at -87 as the 16-lane version; a NaN lane reads as -87 there too). */
static inline __m256 load8(const void *src, int64_t at, int bf16) {
    return bf16 ? load_bf16_ps8((const uint16_t *)src + at) : _mm256_loadu_ps((const float *)src + at);
}
static inline __m256 exp_of_nonpositive_part(__m256 x) {
    return exp_nonpositive_ps(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_setzero_ps()));
}
static inline __m256 feature8(__m256 x) {
    __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_blendv_ps(exp_of_nonpositive_part(x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)), positive);
}
static inline __m256 feature_slope8(__m256 x) {
    __m256 positive = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ);
    return _mm256_blendv_ps(exp_of_nonpositive_part(x), _mm256_set1_ps(1.0f), positive);
}
#endif

/* dst[i, :width] = x (or phi(x) when `features`) for `rows` rows of src (row stride in elements),
 * zeros in dst[i, width:padded] and in the rows whose keep[i] is 0; also dst_t[:, i] = dst[i, :]
 * when dst_t is given (row length ldt). */
void rf_linear_load_rows(const void *src, int64_t stride, int bf16, int64_t rows, int64_t width,
                      int64_t padded, int features, const uint8_t *keep, float *dst, float *dst_t,
                      int64_t ldt) {
    size_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < rows; i++) {
        const char *line = (const char *)src + (size_t)(i * stride) * size;
        float *out = dst + i * padded;
        int real = keep == NULL || keep[i];
#if defined(__AVX512F__)
        for (int64_t u = 0; u < padded; u += 16) {
            __mmask16 live = real ? lanes_left(width - u) : 0;
            __m512 x = load16(line, u, bf16, live);
            if (features) {
                __m512 grown = _mm512_add_ps(x, _mm512_set1_ps(1.0f));
                x = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ),
                                         exp_nonpositive_512(x), grown);
                x = _mm512_maskz_mov_ps(live, x);
            }
            _mm512_storeu_ps(out + u, x);
        }
#else
        int64_t u = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; real && u + 8 <= width; u += 8) {
            __m256 x = load8(line, u, bf16);
            if (features) x = feature8(x);
            _mm256_storeu_ps(out + u, x);
        }
#endif
        for (; u < padded; u++) {
            float x = 0;
            if (real && u < width) {
                x = bf16 ? bf16_to_float(((const uint16_t *)line)[u]) : ((const float *)line)[u];
                if (features) x = feature(x);
            }
            out[u] = x;
        }
#endif
        if (dst_t != NULL)
            for (int64_t u = 0; u < width; u++) dst_t[u * ldt + i] = out[u];
    }
}

#if defined(__AVX512F__)
/* 16 lanes -> bf16 (rounded as torch: common.h's store_bf16_ps) or fp32, only the `live` lanes. */
static inline void store16(void *dst, int64_t at, int bf16, __mmask16 live, __m512 x) {
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)dst + at, live, x);
        return;
    }
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16((uint16_t *)dst + at, live, _mm512_cvtepi32_epi16(rounded));
}
#endif

/* dst[i, :] = grad[i, :width] for `rows` rows (dst contiguous, rows of `width`, fp32 or bf16), times
 * phi'(x) of the raw input row x (row stride `stride`) when slope_src is given, zero where keep[i]
 * is 0. */
void rf_linear_store_rows(const float *grad, int64_t padded, int64_t rows, int64_t width, const void *slope_src,
                          int64_t stride, int bf16, const uint8_t *keep, void *dst) {
    size_t size = bf16 ? 2 : 4;
    for (int64_t i = 0; i < rows; i++) {
        const float *g = grad + i * padded;
        const char *raw = slope_src == NULL ? NULL : (const char *)slope_src + (size_t)(i * stride) * size;
        char *line = (char *)dst + (size_t)(i * width) * size;
        int real = keep == NULL || keep[i];
#if defined(__AVX512F__)
        for (int64_t u = 0; u < width; u += 16) {
            __mmask16 live = lanes_left(width - u);
            __m512 value = _mm512_loadu_ps(g + u);
            if (raw != NULL) {
                __m512 x = load16(raw, u, bf16, live);
                __mmask16 positive = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ);
                value = _mm512_mul_ps(value, _mm512_mask_blend_ps(positive, exp_nonpositive_512(x),
                                                                  _mm512_set1_ps(1.0f)));
            }
            if (!real) value = _mm512_setzero_ps();
            store16(line, u, bf16, live, value);
        }
#else
        int64_t u = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; real && u + 8 <= width; u += 8) {
            __m256 value = _mm256_loadu_ps(g + u);
            if (raw != NULL) value = _mm256_mul_ps(value, feature_slope8(load8(raw, u, bf16)));
            if (bf16) {
                float lanes[8];
                _mm256_storeu_ps(lanes, value);
                for (int c = 0; c < 8; c++) ((uint16_t *)line)[u + c] = float_to_bf16(lanes[c]);
            } else {
                _mm256_storeu_ps((float *)line + u, value);
            }
        }
#endif
        for (; u < width; u++) {
            float value = g[u];
            if (raw != NULL) {
                float x = bf16 ? bf16_to_float(((const uint16_t *)raw)[u]) : ((const float *)raw)[u];
                value *= feature_slope(x);
            }
            if (!real) value = 0;
            if (bf16) ((uint16_t *)line)[u] = float_to_bf16(value);
            else ((float *)line)[u] = value;
        }
#endif
    }
}

/* Zero m[i, j] for j beyond row i's triangle (LOWER: j > i, UPPER: j < i), j < cols; add `diag`
 * (a per-row constant, may be NULL) inside it. */
void rf_linear_mask_triangle(float *m, int64_t ld, int64_t rows, int64_t cols, int upper, const float *add) {
    for (int64_t i = 0; i < rows; i++) {
        float *line = m + i * ld;
        int64_t keep0 = upper ? i : 0, keep1 = upper ? cols : i + 1;
        for (int64_t j = 0; j < keep0; j++) line[j] = 0;
        for (int64_t j = keep1; j < cols; j++) line[j] = 0;
        if (add != NULL)
            for (int64_t j = keep0; j < keep1; j++) line[j] += add[i];
    }
}

