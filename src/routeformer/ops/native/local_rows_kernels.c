/* Row passes of the sliding-window kernels (local_kernels.c, local_backward_kernels.c): the softmax
 * of one row of scores and its backward, and the float32 / bfloat16 conversions of whole arrays.
 * A row pass costs O(window) per query beside the O(window · d) products, so one call per row is
 * cheap; e^x is computed on 16 lanes here (AVX-512), 8 (AVX2 + FMA) or by expf (plain C), inlined
 * into the row loops.
 */
#include <stdlib.h>
#include <string.h>
#include "common.h"

#include "local_kernels.h" /* MR: zero rows after an array, read by the row tiles */

#if defined(__AVX512F__)
static inline __mmask16 lanes_below(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* e^x on 16 lanes for x <= 0 (Cephes' degree-6 polynomial on x − n·ln 2, relative error ~1e-7);
 * exactly 0 below −87, so −inf (a masked key) weighs exactly nothing. */
static inline __m512 exp16(__m512 x) {
    __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(kept, exp_from_minus87_512(x));
}
#endif


/* Element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array. */
static inline float element(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}
static inline void set_element(void *x, int64_t i, float value, int bf16) {
    if (bf16) ((uint16_t *)x)[i] = float_to_bf16(value);
    else ((float *)x)[i] = value;
}

/* `count` rows [count x d] of x (float32, or bfloat16 when bf16 != 0) -> float32 `rows`: factor·x,
 * zero where `bias` (the same rows' entries, or NULL) is −inf. */
void local_widen_rows(const void *x, int bf16, int64_t count, int64_t dim, float factor, const float *bias,
                      float *rows) {
    for (int64_t i = 0; i < count; i++) {
        float *row = rows + i * dim;
        if (bias && bias[i] < 0) memset(row, 0, sizeof(float) * dim); /* 0·NaN would stay NaN */
        else if (bf16) for (int64_t c = 0; c < dim; c++) row[c] = bf16_to_float(((const uint16_t *)x)[i * dim + c]) * factor;
        else for (int64_t c = 0; c < dim; c++) row[c] = ((const float *)x)[i * dim + c] * factor;
    }
}

/* rows [T x d] of x -> float32 `rows` (local_widen_rows, and MR zero rows after the last; skipped
 * if NULL) and, if `columns` is not NULL, its transpose [d x ld]. */
void local_widen(const void *x, int bf16, int64_t length, int64_t dim, float factor, const float *bias,
                 float *rows, float *columns, int64_t ld) {
    if (rows) {
        local_widen_rows(x, bf16, length, dim, factor, bias, rows);
        memset(rows + length * dim, 0, sizeof(float) * MR * dim);
    }
    if (!columns) return;
    /* The transpose in blocks of 16 rows: each column segment written is one cache line, and the
     * 16 rows read stay in L1 (a row at a time wrote d scattered lines per row). */
    for (int64_t i0 = 0; i0 < length; i0 += 16) {
        int64_t n = length - i0 < 16 ? length - i0 : 16;
        for (int64_t c = 0; c < dim; c++)
            for (int64_t r = 0; r < n; r++) {
                int64_t i = i0 + r;
                float value = rows ? rows[i * dim + c] : element(x, i * dim + c, bf16) * factor;
                columns[c * ld + i] = (bias && bias[i] < 0) ? 0.0f : value;
            }
    }
}

/* 0 for a real key, −inf for a masked one (NULL without a mask). */
float *local_key_bias(const uint8_t *valid, int64_t length) {
    if (!valid) return NULL;
    float *bias = malloc(sizeof(float) * length);
    for (int64_t j = 0; j < length; j++) bias[j] = valid[j] ? 0.0f : -INFINITY;
    return bias;
}

#if defined(__AVX512F__)
/* One row of forward scores s[a, b) (·scale + bias) -> probabilities, zero elsewhere in [0, n); returns the
 * log-sum-exp (+inf: no key) and sets *inverse = 1 / Σ (0: no key). */
float local_softmax_row(float *s, float scale, const float *bias, int64_t a, int64_t b, int64_t n,
                        float *inverse) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = a; j < b; j += 16) {
        __mmask16 m = lanes_below(b - j);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(scale));
        if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + j));
        _mm512_mask_storeu_ps(s + j, m, x);
        best = _mm512_mask_max_ps(best, m, best, x);
    }
    float top = _mm512_reduce_max_ps(best);
    memset(s, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    if (top == -INFINITY) {
        memset(s + a, 0, sizeof(float) * (b - a));
        *inverse = 0.0f;
        return INFINITY;
    }
    __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
    for (int64_t j = a; j < b; j += 16) {
        __mmask16 m = lanes_below(b - j);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), shift));
        e = _mm512_maskz_mov_ps(m, e);
        _mm512_mask_storeu_ps(s + j, m, e);
        total = _mm512_add_ps(total, e);
    }
    float sum = _mm512_reduce_add_ps(total);
    *inverse = 1.0f / sum;
    return top + logf(sum);
}

/* One backward row: s[a, b) holds the scores, dp[a, b) the products dO_i · v_j. Both become, in
 * place, P = exp(s + bias − lse) and dS = P ∘ (dP − D), and are zeroed elsewhere in [0, n). */
void local_backward_row(float *s, float *dp, float scale, const float *bias, int64_t a, int64_t b,
                        int64_t n, float lse, float row_dot) {
    memset(s, 0, sizeof(float) * a);
    memset(dp, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    memset(dp + b, 0, sizeof(float) * (n - b));
    __m512 shift = _mm512_set1_ps(lse), dot = _mm512_set1_ps(row_dot), factor = _mm512_set1_ps(scale);
    for (int64_t j = a; j < b; j += 16) {
        __mmask16 m = lanes_below(b - j);
        __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), factor, shift);
        if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + j));
        __m512 p = exp16(x); /* lse = +inf (no key): x = −inf, p = 0 */
        __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_maskz_loadu_ps(m, dp + j), dot));
        _mm512_mask_storeu_ps(s + j, m, p);
        _mm512_mask_storeu_ps(dp + j, m, ds);
    }
}

/* out[i] = factor · x[i] for i < count, stored as float32 or (bf16) bfloat16 rounded to nearest even. */
void local_store(const float *x, int64_t count, float factor, int bf16, void *out) {
    __m512 f = _mm512_set1_ps(factor);
    int64_t i = 0;
    if (bf16)
        for (; i + 16 <= count; i += 16) store_bf16_ps((uint16_t *)out + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
    else
        for (; i + 16 <= count; i += 16) _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
    for (; i < count; i++) set_element(out, i, x[i] * factor, bf16);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (+FMA): the same row passes on 8 lanes (common.h's exp_nonpositive_ps), the tail of a row
 * through masked loads and stores (common.h's first_lanes8). */

/* e^x on 8 lanes for x <= 0, exactly 0 below −87 (as exp16). */
static inline __m256 exp8(__m256 x) {
    __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(kept, exp_nonpositive_ps(x));
}

float local_softmax_row(float *s, float scale, const float *bias, int64_t a, int64_t b, int64_t n,
                        float *inverse) {
    __m256 best = _mm256_set1_ps(-INFINITY), factor = _mm256_set1_ps(scale);
    for (int64_t j = a; j < b; j += 8) {
        __m256i m = first_lanes8(b - j);
        __m256 x = _mm256_mul_ps(_mm256_maskload_ps(s + j, m), factor);
        if (bias) x = _mm256_add_ps(x, _mm256_maskload_ps(bias + j, m));
        _mm256_maskstore_ps(s + j, m, x);
        best = _mm256_max_ps(best, _mm256_blendv_ps(best, x, _mm256_castsi256_ps(m)));
    }
    float top = max8(best);
    memset(s, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    if (top == -INFINITY) {
        memset(s + a, 0, sizeof(float) * (b - a));
        *inverse = 0.0f;
        return INFINITY;
    }
    __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
    for (int64_t j = a; j < b; j += 8) {
        __m256i m = first_lanes8(b - j);
        __m256 e = _mm256_and_ps(_mm256_castsi256_ps(m), exp8(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), shift)));
        _mm256_maskstore_ps(s + j, m, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = horizontal_sum_ps(total);
    *inverse = 1.0f / sum;
    return top + logf(sum);
}

void local_backward_row(float *s, float *dp, float scale, const float *bias, int64_t a, int64_t b,
                        int64_t n, float lse, float row_dot) {
    memset(s, 0, sizeof(float) * a);
    memset(dp, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    memset(dp + b, 0, sizeof(float) * (n - b));
    __m256 shift = _mm256_set1_ps(lse), dot = _mm256_set1_ps(row_dot), factor = _mm256_set1_ps(scale);
    for (int64_t j = a; j < b; j += 8) {
        __m256i m = first_lanes8(b - j);
        __m256 x = _mm256_fmsub_ps(_mm256_maskload_ps(s + j, m), factor, shift);
        if (bias) x = _mm256_add_ps(x, _mm256_maskload_ps(bias + j, m));
        __m256 p = exp8(x); /* lse = +inf (no key): x = −inf, p = 0 */
        __m256 ds = _mm256_mul_ps(p, _mm256_sub_ps(_mm256_maskload_ps(dp + j, m), dot));
        _mm256_maskstore_ps(s + j, m, p);
        _mm256_maskstore_ps(dp + j, m, ds);
    }
}
#else
/* Plain C (any CPU): the row passes as scalar loops with expf (exactly 0 below −87, as exp16). */
static inline float exp_clamped(float x) { return x >= -87.0f ? expf(x) : 0.0f; }

float local_softmax_row(float *s, float scale, const float *bias, int64_t a, int64_t b, int64_t n,
                        float *inverse) {
    float top = -INFINITY;
    for (int64_t j = a; j < b; j++) {
        float x = s[j] * scale + (bias ? bias[j] : 0.0f);
        s[j] = x;
        top = x > top ? x : top;
    }
    memset(s, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    if (top == -INFINITY) {
        memset(s + a, 0, sizeof(float) * (b - a));
        *inverse = 0.0f;
        return INFINITY;
    }
    float sum = 0.0f;
    for (int64_t j = a; j < b; j++) {
        s[j] = exp_clamped(s[j] - top);
        sum += s[j];
    }
    *inverse = 1.0f / sum;
    return top + logf(sum);
}

void local_backward_row(float *s, float *dp, float scale, const float *bias, int64_t a, int64_t b,
                        int64_t n, float lse, float row_dot) {
    memset(s, 0, sizeof(float) * a);
    memset(dp, 0, sizeof(float) * a);
    memset(s + b, 0, sizeof(float) * (n - b));
    memset(dp + b, 0, sizeof(float) * (n - b));
    for (int64_t j = a; j < b; j++) {
        float x = s[j] * scale - lse + (bias ? bias[j] : 0.0f);
        float p = exp_clamped(x); /* lse = +inf (no key): x = −inf, p = 0 */
        dp[j] = p * (dp[j] - row_dot);
        s[j] = p;
    }
}
#endif

#if !defined(__AVX512F__)
/* out[i] = factor · x[i] for i < count, float32 or bfloat16 (rounded to nearest even): two plain loops
 * the compiler vectorises (AVX2 or the generic target). */
void local_store(const float *x, int64_t count, float factor, int bf16, void *out) {
    if (bf16) {
        uint16_t *y = out;
        for (int64_t i = 0; i < count; i++) y[i] = float_to_bf16(x[i] * factor);
    } else {
        float *y = out;
        for (int64_t i = 0; i < count; i++) y[i] = x[i] * factor;
    }
}
#endif
