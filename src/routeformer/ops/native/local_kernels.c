/* Sliding-window (local) attention, flash-style: forward and backward, float32 or bfloat16 storage,
 * float32 arithmetic (wrapped by ops/native/local.py; the PyTorch twin is ops/local.py).
 *
 * Query i of (batch, head) row bh reads the keys j with i − before <= j <= i + after (causal:
 * before = window − 1, after = 0; non-causal: both = window), clipped to [0, T), and not masked
 * out by the key-padding mask `valid` [B, T] (bytes, or NULL).
 *
 * Forward, per block of MR = 6 queries: the scores of the keys the block's bands cover (window + 5
 * keys, the exact band give or take five) by a register-tiled product S = (scale·Q) Kᵀ, an exact
 * softmax per row (the whole band fits in a buffer, so no online rescaling is needed), then O = P V.
 * The log-sum-exp of every row is returned for the backward (+inf for a row with no key).
 * Backward, per tile of BQ queries: S and P = exp(S − lse) again, dP = dO Vᵀ, dS = P ∘ (dP − D)
 * with D_i = dO_i · O_i, dQ = scale · dS K; then per block of MR keys, dV += Pᵀ dO and
 * dK += dSᵀ (scale·Q) over only the tile's queries whose bands hold those keys.
 *
 * The register tile (gemm_tile) is C[MR x 64] (+)= A[MR x depth] · B[depth x 64]: 24 accumulators,
 * four B vectors per step and one broadcast per row. A is read through a row stride and a step
 * stride, so Pᵀ and dSᵀ need no transposed copies; Kᵀ and Vᵀ are copied once per row bh.
 * Keys masked out are zeroed in the float32 copies (a padded row may hold NaN: 0·NaN would leak).
 */
#include <stdlib.h>
#include <string.h>
#include "common.h"

#if defined(__AVX512F__)
#define MR 6
#define BQ 96 /* backward query tile: dK, dV take BQ-deep products per key block */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* e^x on 16 lanes for x <= 0 (Cephes' degree-6 polynomial on x − n·ln 2, relative error ~1e-7);
 * exactly 0 below −87, so −inf (a masked key) weighs exactly nothing. */
static inline __m512 exp16(__m512 x) {
    __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
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
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(bits));
}

static inline __mmask16 lanes_below(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* The register-tiled products, in local_tiles_kernels.c (MR rows there too). */
void local_gemm(int64_t rows, int64_t n, int64_t depth, const float *a, int64_t a_row, int64_t a_step,
                const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate);
void local_gemm_pairs(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                      const uint32_t *b, int64_t ldb, float *c, int64_t ldc);
void local_pairs_transposed(const uint16_t *x, int64_t length, int64_t dim, const float *bias,
                            uint32_t *out, int64_t ld);
void local_pairs_of_rows(const uint16_t *x, int64_t length, int64_t dim, const float *bias, uint32_t *out);
void local_narrow_row(const float *x, int64_t n, uint32_t *y);
#define gemm local_gemm

/* Element i of a float32 (bf16 == 0) or bfloat16 (bf16 == 1) array. */
static inline float element(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}
static inline void set_element(void *x, int64_t i, float value, int bf16) {
    if (bf16) ((uint16_t *)x)[i] = float_to_bf16(value);
    else ((float *)x)[i] = value;
}

/* rows [T x d] of x -> float32 `rows` (factor·x; zero where `bias` is −inf, and MR zero rows after
 * the last; skipped if NULL) and, if `columns` is not NULL, its transpose [d x ld]. */
static void widen(const void *x, int bf16, int64_t length, int64_t dim, float factor, const float *bias,
                  float *rows, float *columns, int64_t ld) {
    for (int64_t i = 0; i < length; i++) {
        int keep = !(bias && bias[i] < 0); /* a product with 0 would keep a NaN */
        for (int64_t c = 0; c < dim; c++) {
            float value = keep ? element(x, i * dim + c, bf16) * factor : 0.0f;
            if (rows) rows[i * dim + c] = value;
            if (columns) columns[c * ld + i] = value;
        }
    }
    if (rows) memset(rows + length * dim, 0, sizeof(float) * MR * dim);
}

/* 0 for a real key, −inf for a masked one (NULL without a mask). */
static float *key_bias(const uint8_t *valid, int64_t length) {
    if (!valid) return NULL;
    float *bias = malloc(sizeof(float) * length);
    for (int64_t j = 0; j < length; j++) bias[j] = valid[j] ? 0.0f : -INFINITY;
    return bias;
}

/* One row of forward scores s[a, b) (·scale + bias) -> probabilities, zero elsewhere in [0, n); returns the
 * log-sum-exp (+inf: no key) and sets *inverse = 1 / Σ (0: no key). */
static float softmax_row(float *s, float scale, const float *bias, int64_t a, int64_t b, int64_t n,
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

static void forward_row(const void *q, const void *k, const void *v, const float *bias, int bf16,
                        int64_t length, int64_t dim, int64_t before, int64_t after, float scale,
                        void *out, float *lse) {
    int64_t ld = length + 16, span = min64(length, before + after + MR) + 16;
    float *qs = malloc(sizeof(float) * (length + MR) * dim), *kt = malloc(sizeof(float) * dim * ld);
    float *vr = malloc(sizeof(float) * (length + MR) * dim);
    float *s = calloc((size_t)MR * span, sizeof(float)), *o = malloc(sizeof(float) * MR * dim);
    widen(q, bf16, length, dim, scale, NULL, qs, NULL, 0);
    widen(k, bf16, length, dim, 1.0f, bias, NULL, kt, ld);
    widen(v, bf16, length, dim, 1.0f, bias, vr, NULL, 0);
    for (int64_t i0 = 0; i0 < length; i0 += MR) {
        int64_t rows = min64(MR, length - i0);
        int64_t lo = max64(0, i0 - before), hi = min64(length, i0 + rows + after), n = hi - lo;
        gemm(rows, n, dim, qs + i0 * dim, dim, 1, kt + lo, ld, s, span, 0);
        float inverse[MR];
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = i0 + r, a = max64(0, i - before) - lo, b = min64(length, i + after + 1) - lo;
            lse[i] = softmax_row(s + r * span, 1.0f, bias ? bias + lo : NULL, a, b, n, &inverse[r]);
        }
        gemm(rows, dim, n, s, span, 1, vr + lo * dim, dim, o, dim, 0);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < dim; c++) set_element(out, (i0 + r) * dim + c, o[r * dim + c] * inverse[r], bf16);
    }
    free(qs); free(kt); free(vr); free(s); free(o);
}

#if defined(__AVX512BF16__)
/* forward_row for bf16 storage and an even d: q·k and p·v as bf16 pair products (vdpbf16ps, float32
 * sums; the weights p are rounded to bf16 for p·v, as FlashAttention does on GPUs). Keys are taken
 * from an even position, so key pairs line up with the packed value pairs. */
static void forward_row_pairs(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *bias,
                              int64_t length, int64_t dim, int64_t before, int64_t after, float scale,
                              uint16_t *out, float *lse) {
    int64_t ld = length + 16, span = min64(length, before + after + MR) + 32, half = dim / 2;
    uint16_t *qr = calloc((size_t)(length + MR) * dim, sizeof(uint16_t));
    uint32_t *kt = malloc(sizeof(uint32_t) * half * ld), *vp = malloc(sizeof(uint32_t) * ((length + 1) / 2 + MR) * dim);
    uint32_t *p = calloc((size_t)MR * span, sizeof(uint32_t));
    float *s = calloc((size_t)MR * span, sizeof(float)), *o = malloc(sizeof(float) * MR * dim);
    memcpy(qr, q, sizeof(uint16_t) * length * dim);
    local_pairs_transposed(k, length, dim, bias, kt, ld);
    local_pairs_of_rows(v, length, dim, bias, vp);
    for (int64_t i0 = 0; i0 < length; i0 += MR) {
        int64_t rows = min64(MR, length - i0);
        int64_t lo = max64(0, i0 - before) & ~(int64_t)1, hi = min64(length, i0 + rows + after), n = hi - lo;
        local_gemm_pairs(rows, n, half, (const uint32_t *)(qr + i0 * dim), half, kt + lo, ld, s, span);
        float inverse[MR];
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = i0 + r, a = max64(0, i - before) - lo, b = min64(length, i + after + 1) - lo;
            lse[i] = softmax_row(s + r * span, scale, bias ? bias + lo : NULL, a, b, n, &inverse[r]);
            local_narrow_row(s + r * span, n, p + r * (span / 2));
        }
        local_gemm_pairs(rows, dim, (n + 1) / 2, p, span / 2, vp + (lo / 2) * dim, dim, o, dim);
        for (int64_t r = 0; r < rows; r++) {
            int64_t c = 0;
            for (; c + 16 <= dim; c += 16)
                store_bf16_ps(out + (i0 + r) * dim + c,
                              _mm512_mul_ps(_mm512_loadu_ps(o + r * dim + c), _mm512_set1_ps(inverse[r])));
            for (; c < dim; c++) out[(i0 + r) * dim + c] = float_to_bf16(o[r * dim + c] * inverse[r]);
        }
    }
    free(qr); free(kt); free(vp); free(p); free(s); free(o);
}
#endif

/* q, k, v, out [BH, T, d] (contiguous; float32, or bfloat16 when bf16 != 0), valid [B, T] or NULL,
 * lse [BH, T] float32. */
void local_attend(const void *q, const void *k, const void *v, const uint8_t *valid, int64_t rows_bh,
                  int64_t heads, int64_t length, int64_t dim, int64_t before, int64_t after, double scale,
                  int bf16, void *out, float *lse, int threads) {
    int64_t size = (bf16 ? 2 : 4) * length * dim;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t bh = 0; bh < rows_bh; bh++) {
        float *bias = key_bias(valid ? valid + (bh / heads) * length : NULL, length);
#if defined(__AVX512BF16__)
        if (bf16 && dim % 2 == 0)
            forward_row_pairs((const uint16_t *)((const char *)q + bh * size),
                              (const uint16_t *)((const char *)k + bh * size),
                              (const uint16_t *)((const char *)v + bh * size), bias, length, dim, before,
                              after, (float)scale, (uint16_t *)((char *)out + bh * size), lse + bh * length);
        else
#endif
        forward_row((const char *)q + bh * size, (const char *)k + bh * size, (const char *)v + bh * size,
                    bias, bf16, length, dim, before, after, (float)scale, (char *)out + bh * size,
                    lse + bh * length);
        free(bias);
    }
}

/* One backward row: s[a, b) holds the scores, dp[a, b) the products dO_i · v_j. Both become, in
 * place, P = exp(s + bias − lse) and dS = P ∘ (dP − D), and are zeroed elsewhere in [0, n). */
static void backward_row(float *s, float *dp, float scale, const float *bias, int64_t a, int64_t b,
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

/* What the backward of one row bh reads, in float32 (and, `pairs`: bf16 storage with an even d,
 * the bf16 pair layouts for the products over d and dQ = dS K). */
typedef struct {
    int pairs;
    float *qs, *kr, *kt, *vt, *go;                   /* float32: scale·q, k, kᵀ, vᵀ, dO */
    uint16_t *q2, *go2;                              /* pairs: raw q and dO rows, MR zero rows after */
    uint32_t *kt2, *vt2, *k2;                        /* pairs: kᵀ, vᵀ over d; k rows paired over keys */
} Operands;

static void prepare(Operands *x, const void *q, const void *k, const void *v, const void *grad_out,
                    const float *bias, int bf16, int64_t length, int64_t dim, float scale, int64_t ld) {
    size_t rows_size = sizeof(float) * (length + MR) * dim, half = (size_t)dim / 2;
    memset(x, 0, sizeof *x);
#if defined(__AVX512BF16__)
    x->pairs = bf16 && dim % 2 == 0;
#endif
    x->qs = malloc(rows_size);
    x->go = malloc(rows_size);
    widen(q, bf16, length, dim, scale, NULL, x->qs, NULL, 0);
    widen(grad_out, bf16, length, dim, 1.0f, NULL, x->go, NULL, 0);
    if (!x->pairs) {
        x->kr = malloc(rows_size);
        x->kt = malloc(sizeof(float) * dim * ld);
        x->vt = malloc(sizeof(float) * dim * ld);
        widen(k, bf16, length, dim, 1.0f, bias, x->kr, x->kt, ld);
        widen(v, bf16, length, dim, 1.0f, bias, NULL, x->vt, ld);
        return;
    }
    x->q2 = calloc((size_t)(length + MR) * dim, sizeof(uint16_t));
    x->go2 = calloc((size_t)(length + MR) * dim, sizeof(uint16_t));
    memcpy(x->q2, q, sizeof(uint16_t) * length * dim);
    memcpy(x->go2, grad_out, sizeof(uint16_t) * length * dim);
    x->kt2 = malloc(sizeof(uint32_t) * half * ld);
    x->vt2 = malloc(sizeof(uint32_t) * half * ld);
    x->k2 = malloc(sizeof(uint32_t) * ((length + 1) / 2 + MR) * dim);
    local_pairs_transposed(k, length, dim, bias, x->kt2, ld);
    local_pairs_transposed(v, length, dim, bias, x->vt2, ld);
    local_pairs_of_rows(k, length, dim, bias, x->k2);
}

static void release(Operands *x) {
    free(x->qs); free(x->go); free(x->kr); free(x->kt); free(x->vt);
    free(x->q2); free(x->go2); free(x->kt2); free(x->vt2); free(x->k2);
}

static void backward_bh(const void *q, const void *k, const void *v, const void *out, const void *grad_out,
                        const float *lse, const float *bias, int bf16, int64_t length, int64_t dim,
                        int64_t before, int64_t after, float scale, void *grad_q, void *grad_k, void *grad_v) {
    int64_t ld = length + 16, span = min64(length, before + after + BQ) + MR + 32, half = dim / 2;
    Operands x;
    prepare(&x, q, k, v, grad_out, bias, bf16, length, dim, scale, ld);
    float *dk = calloc((size_t)(length + MR) * dim, sizeof(float));
    float *dv = calloc((size_t)(length + MR) * dim, sizeof(float));
    float *p = calloc((size_t)(BQ + MR) * span, sizeof(float)), *ds = calloc((size_t)(BQ + MR) * span, sizeof(float));
    float *row_dot = malloc(sizeof(float) * length), *o = malloc(sizeof(float) * MR * dim);
    uint32_t *narrow = calloc((size_t)MR * span, sizeof(uint32_t));
    for (int64_t i = 0; i < length; i++) {
        float sum = 0;
        for (int64_t c = 0; c < dim; c++) sum += x.go[i * dim + c] * element(out, i * dim + c, bf16);
        row_dot[i] = sum;
    }
    /* Pairs: the scores come from the raw q (scaled in backward_row), and key ranges start at an even
     * key so key pairs line up with k2. */
    float score_scale = x.pairs ? scale : 1.0f;
    int64_t align = x.pairs ? ~(int64_t)1 : ~(int64_t)0;
    for (int64_t t0 = 0; t0 < length; t0 += BQ) {
        int64_t queries = min64(BQ, length - t0);
        int64_t key0 = max64(0, t0 - before) & align, key1 = min64(length, t0 + queries + after);
        for (int64_t rb = 0; rb < queries; rb += MR) {
            int64_t i0 = t0 + rb, rows = min64(MR, queries - rb);
            int64_t lo = max64(0, i0 - before) & align, hi = min64(length, i0 + rows + after), n = hi - lo;
            float *s_at = p + rb * span + (lo - key0), *dp_at = ds + rb * span + (lo - key0);
            if (x.pairs) {
                local_gemm_pairs(rows, n, half, (const uint32_t *)(x.q2 + i0 * dim), half, x.kt2 + lo, ld, s_at, span);
                local_gemm_pairs(rows, n, half, (const uint32_t *)(x.go2 + i0 * dim), half, x.vt2 + lo, ld, dp_at, span);
            } else {
                gemm(rows, n, dim, x.qs + i0 * dim, dim, 1, x.kt + lo, ld, s_at, span, 0);
                gemm(rows, n, dim, x.go + i0 * dim, dim, 1, x.vt + lo, ld, dp_at, span, 0);
            }
            for (int64_t r = 0; r < rows; r++) {
                int64_t i = i0 + r, a = max64(0, i - before) - key0, b = min64(length, i + after + 1) - key0;
                backward_row(p + (rb + r) * span, ds + (rb + r) * span, score_scale, bias ? bias + key0 : NULL,
                             a, b, key1 - key0 + MR, lse[i], row_dot[i]);
            }
            if (x.pairs) {
                for (int64_t r = 0; r < rows; r++) local_narrow_row(dp_at + r * span, n, narrow + r * (span / 2));
                local_gemm_pairs(rows, dim, (n + 1) / 2, narrow, span / 2, x.k2 + (lo / 2) * dim, dim, o, dim);
            } else {
                gemm(rows, dim, n, dp_at, span, 1, x.kr + lo * dim, dim, o, dim, 0);
            }
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < dim; c++)
                    set_element(grad_q, (i0 + r) * dim + c, o[r * dim + c] * scale, bf16);
        }
        for (int64_t j0 = key0; j0 < key1; j0 += MR) {
            int64_t keys = min64(MR, key1 - j0);
            int64_t first = max64(t0, j0 - after), last = min64(t0 + queries, j0 + keys + before);
            if (last <= first) continue;
            int64_t at = (first - t0) * span + (j0 - key0);
            gemm(keys, dim, last - first, p + at, 1, span, x.go + first * dim, dim, dv + j0 * dim, dim, 1);
            gemm(keys, dim, last - first, ds + at, 1, span, x.qs + first * dim, dim, dk + j0 * dim, dim, 1);
        }
    }
    for (int64_t i = 0; i < length * dim; i++) {
        set_element(grad_k, i, dk[i], bf16);
        set_element(grad_v, i, dv[i], bf16);
    }
    release(&x);
    free(dk); free(dv); free(p); free(ds); free(row_dot); free(o); free(narrow);
}

/* The gradients of local_attend: grad_q, grad_k, grad_v [BH, T, d] in the storage dtype. */
void local_attend_backward(const void *q, const void *k, const void *v, const uint8_t *valid, const void *out,
                           const void *grad_out, const float *lse, int64_t rows_bh, int64_t heads,
                           int64_t length, int64_t dim, int64_t before, int64_t after, double scale, int bf16,
                           void *grad_q, void *grad_k, void *grad_v, int threads) {
    int64_t size = (bf16 ? 2 : 4) * length * dim;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t bh = 0; bh < rows_bh; bh++) {
        float *bias = key_bias(valid ? valid + (bh / heads) * length : NULL, length);
        int64_t at = bh * size;
        backward_bh((const char *)q + at, (const char *)k + at, (const char *)v + at, (const char *)out + at,
                    (const char *)grad_out + at, lse + bh * length, bias, bf16, length, dim, before, after,
                    (float)scale, (char *)grad_q + at, (char *)grad_k + at, (char *)grad_v + at);
        free(bias);
    }
}

int local_attend_available(void) { return 1; }
#else
/* Without AVX-512 the wrapper uses the PyTorch path. */
int local_attend_available(void) { return 0; }
#endif
