/* The backward of local_kernels.c's sliding-window attention (see there for the layout): per tile of
 * BQ queries, the scores S and P = exp(S·scale − lse) again, dP = dO Vᵀ, dS = P ∘ (dP − D) with
 * D_i = dO_i · O_i, dQ = scale · dS K; then per block of MR keys dV += Pᵀ dO and dK += dSᵀ (scale·Q)
 * over only the tile's queries whose bands hold those keys (Pᵀ and dSᵀ read in place through the
 * tile's step stride). bf16 storage with an even d: S, dP and dQ as bf16 pair products.
 */
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "local_kernels.h"
#define BQ 96 /* query tile: dK, dV take up-to-BQ-deep products per key block */


static inline float element(const void *x, int64_t i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* What the backward of one row bh reads: in float32, or (`pairs`: bf16 storage with an even d) as
 * bf16 pair layouts for every product (dO also in float32, for D = dO · O). */
typedef struct {
    int pairs;
    float *qs, *kr, *kt, *vt, *go;                   /* float32: scale·q, k, kᵀ, vᵀ, dO */
    uint16_t *q2, *go2;                              /* pairs: raw q and dO rows, MR zero rows after */
    uint32_t *kt2, *vt2, *k2;                        /* pairs: kᵀ, vᵀ over d; k rows paired over keys */
    uint32_t *q2r, *go2r;                            /* pairs: q, dO rows paired over queries */
} Operands;

static void prepare(Operands *x, const void *q, const void *k, const void *v, const void *grad_out,
                    const float *bias, int bf16, int64_t length, int64_t dim, float scale, int64_t ld) {
    size_t rows_size = sizeof(float) * (length + MR) * dim, half = (size_t)dim / 2;
    memset(x, 0, sizeof *x);
#if defined(__AVX512BF16__)
    x->pairs = bf16 && dim % 2 == 0;
#endif
    x->go = malloc(rows_size);
    local_widen(grad_out, bf16, length, dim, 1.0f, NULL, x->go, NULL, 0); /* also for D = dO · O */
    if (!x->pairs) {
        x->qs = malloc(rows_size);
        local_widen(q, bf16, length, dim, scale, NULL, x->qs, NULL, 0);
        x->kr = malloc(rows_size);
        x->kt = malloc(sizeof(float) * dim * ld);
        x->vt = malloc(sizeof(float) * dim * ld);
        local_widen(k, bf16, length, dim, 1.0f, bias, x->kr, x->kt, ld);
        local_widen(v, bf16, length, dim, 1.0f, bias, NULL, x->vt, ld);
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
    x->q2r = malloc(sizeof(uint32_t) * ((length + 1) / 2 + MR) * dim);
    x->go2r = malloc(sizeof(uint32_t) * ((length + 1) / 2 + MR) * dim);
    local_pairs_of_rows(q, length, dim, NULL, x->q2r);
    local_pairs_of_rows(grad_out, length, dim, NULL, x->go2r);
}

static void release(Operands *x) {
    free(x->qs); free(x->go); free(x->kr); free(x->kt); free(x->vt);
    free(x->q2); free(x->go2); free(x->kt2); free(x->vt2); free(x->k2); free(x->q2r); free(x->go2r);
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
    /* Pairs: P and dS of the tile with query rows paired, for dV = Pᵀ dO and dK = dSᵀ q. */
    uint32_t *p2 = calloc((size_t)(BQ / 2 + MR) * span, sizeof(uint32_t));
    uint32_t *ds2 = calloc((size_t)(BQ / 2 + MR) * span, sizeof(uint32_t));
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
                local_gemm(rows, n, dim, x.qs + i0 * dim, dim, 1, x.kt + lo, ld, s_at, span, 0);
                local_gemm(rows, n, dim, x.go + i0 * dim, dim, 1, x.vt + lo, ld, dp_at, span, 0);
            }
            for (int64_t r = 0; r < rows; r++) {
                int64_t i = i0 + r, a = max64(0, i - before) - key0, b = min64(length, i + after + 1) - key0;
                local_backward_row(p + (rb + r) * span, ds + (rb + r) * span, score_scale, bias ? bias + key0 : NULL,
                             a, b, key1 - key0 + MR, lse[i], row_dot[i]);
            }
            if (x.pairs) {
                for (int64_t r = 0; r < rows; r++) local_narrow_row(dp_at + r * span, n, narrow + r * (span / 2));
                local_gemm_pairs(rows, dim, (n + 1) / 2, narrow, span / 2, x.k2 + (lo / 2) * dim, dim, o, dim);
            } else {
                local_gemm(rows, dim, n, dp_at, span, 1, x.kr + lo * dim, dim, o, dim, 0);
            }
            for (int64_t r = 0; r < rows; r++)
                local_store(o + r * dim, dim, scale, bf16, (char *)grad_q + (i0 + r) * dim * (bf16 ? 2 : 4));
        }
        int64_t width = key1 - key0 + MR;
        if (x.pairs) {
            if (queries % 2) { /* the last pair's second row: no query */
                memset(p + queries * span, 0, sizeof(float) * width);
                memset(ds + queries * span, 0, sizeof(float) * width);
            }
            for (int64_t m = 0; 2 * m < queries; m++) {
                local_pair_rows(p + 2 * m * span, p + (2 * m + 1) * span, width, p2 + m * span);
                local_pair_rows(ds + 2 * m * span, ds + (2 * m + 1) * span, width, ds2 + m * span);
            }
        }
        for (int64_t j0 = key0; j0 < key1; j0 += MR) {
            int64_t keys = min64(MR, key1 - j0);
            int64_t first = max64(t0, j0 - after) & align, last = min64(t0 + queries, j0 + keys + before);
            if (last <= first) continue;
            if (x.pairs) { /* t0 and first are even: pair m of the tile is queries t0 + 2m, t0 + 2m + 1 */
                int64_t at = ((first - t0) / 2) * span + (j0 - key0), depth = (last - first + 1) / 2;
                local_gemm_pairs_strided(keys, dim, depth, p2 + at, 1, span, x.go2r + (first / 2) * dim, dim,
                                         dv + j0 * dim, dim, 1);
                local_gemm_pairs_strided(keys, dim, depth, ds2 + at, 1, span, x.q2r + (first / 2) * dim, dim,
                                         dk + j0 * dim, dim, 1);
                continue;
            }
            int64_t at = (first - t0) * span + (j0 - key0);
            local_gemm(keys, dim, last - first, p + at, 1, span, x.go + first * dim, dim, dv + j0 * dim, dim, 1);
            local_gemm(keys, dim, last - first, ds + at, 1, span, x.qs + first * dim, dim, dk + j0 * dim, dim, 1);
        }
    }
    local_store(dk, length * dim, x.pairs ? scale : 1.0f, bf16, grad_k); /* pairs: dSᵀ q, unscaled */
    local_store(dv, length * dim, 1.0f, bf16, grad_v);
    release(&x);
    free(dk); free(dv); free(p); free(ds); free(row_dot); free(o); free(narrow); free(p2); free(ds2);
}

/* The gradients of local_attend: grad_q, grad_k, grad_v [BH, T, d] in the storage dtype. */
void local_attend_backward(const void *q, const void *k, const void *v, const uint8_t *valid, const void *out,
                           const void *grad_out, const float *lse, int64_t rows_bh, int64_t heads,
                           int64_t length, int64_t dim, int64_t before, int64_t after, double scale, int bf16,
                           void *grad_q, void *grad_k, void *grad_v, int threads) {
    int64_t size = (bf16 ? 2 : 4) * length * dim;
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (int64_t bh = 0; bh < rows_bh; bh++) {
        float *bias = local_key_bias(valid ? valid + (bh / heads) * length : NULL, length);
        int64_t at = bh * size;
        backward_bh((const char *)q + at, (const char *)k + at, (const char *)v + at, (const char *)out + at,
                    (const char *)grad_out + at, lse + bh * length, bias, bf16, length, dim, before, after,
                    (float)scale, (char *)grad_q + at, (char *)grad_k + at, (char *)grad_v + at);
        free(bias);
    }
}
