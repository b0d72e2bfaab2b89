/* Sliding-window (local) attention, flash-style: forward and backward, float32 or bfloat16 storage,
 * float32 arithmetic (wrapped by ops/native/local.py; the PyTorch twin is ops/local/op.py).
 *
 * Query i of (batch, head) row bh reads the keys j with i − before <= j <= i + after (causal:
 * before = window − 1, after = 0; non-causal: both = window), clipped to [0, T), and not masked
 * out by the key-padding mask `valid` [B, T] (bytes, or NULL).
 *
 * Forward (this file), per block of MR = 6 queries: the scores of the keys the block's bands cover
 * (window + 5 keys: the exact band give or take five) by a register-tiled product S = Q Kᵀ · scale,
 * an exact softmax per row (the whole band fits in a buffer, so no online rescaling is needed),
 * then O = P V. The log-sum-exp of every row is returned for the backward (+inf: a row with no key).
 * bf16 storage with an even d: q·k and p·v as bf16 pair products (vdpbf16ps) with float32 sums.
 * The backward is local_backward_kernels.c; the register tiles (C[MR x 64] (+)= A · B, 24
 * accumulators) and the bf16 pair layouts local_tiles_kernels.c; the row passes (softmax, its
 * backward, conversions) local_rows_kernels.c. Kᵀ (and Vᵀ for the backward) are copied once per
 * row bh in float32 or as bf16 pairs; keys masked out are zeroed in these copies (a padded row may
 * hold NaN, and 0·NaN would leak into real rows).
 * Every instruction-set level builds it: the products (local_gemm) and row passes have AVX-512, AVX2 +
 * FMA and plain C paths; without AVX-512 BF16, bf16 storage is widened to float32 in the kernel.
 */
#include <stdlib.h>
#include <string.h>
#include "common.h"
#include "local_kernels.h"

/* The forward of one (batch, head) row bh, float32 products (float32 or bfloat16 storage). float32
 * q and (without a mask) v are read in place: only kᵀ is always copied, the scale is applied to the
 * scores, and the last partial block of queries reads a zero-padded copy of its rows. bf16 q is
 * widened a block of MR rows at a time, and bf16 (or masked) v rows as the blocks first reach them,
 * so each widened row is read back while it is in cache (widening the whole row first wrote and
 * re-read 2 x T x d float32 values a row: bf16 ran at 0.95x fp32's speed on an AVX2 CPU). */
static void forward_row(const void *q, const void *k, const void *v, const float *bias, int bf16,
                        int64_t length, int64_t dim, int64_t before, int64_t after, float scale,
                        void *out, float *lse) {
    int64_t ld = length + 16, span = min64(length, before + after + MR) + 16, element = bf16 ? 2 : 4;
    int in_place = !bf16, values_in_place = !bf16 && !bias;
    float *qs = calloc((size_t)MR * dim, sizeof(float));
    float *kt = malloc(sizeof(float) * dim * ld);
    float *vr = values_in_place ? NULL : malloc(sizeof(float) * length * dim);
    float *s = calloc((size_t)MR * span, sizeof(float)), *o = malloc(sizeof(float) * MR * dim);
    local_widen(k, bf16, length, dim, 1.0f, bias, NULL, kt, ld);
    const float *values = values_in_place ? (const float *)v : vr;
    int64_t widened = 0; /* rows of vr filled */
    for (int64_t i0 = 0; i0 < length; i0 += MR) {
        int64_t rows = min64(MR, length - i0);
        int64_t lo = max64(0, i0 - before), hi = min64(length, i0 + rows + after), n = hi - lo;
        const float *queries = qs; /* the tile reads MR rows: a partial block's others are zeros */
        if (in_place && rows == MR) queries = (const float *)q + i0 * dim;
        else if (in_place) memcpy(qs, (const float *)q + i0 * dim, sizeof(float) * rows * dim);
        else {
            local_widen_rows((const char *)q + i0 * dim * element, bf16, rows, dim, 1.0f, NULL, qs);
            memset(qs + rows * dim, 0, sizeof(float) * (MR - rows) * dim);
        }
        local_gemm(rows, n, dim, queries, dim, 1, kt + lo, ld, s, span, 0);
        float inverse[MR];
        for (int64_t r = 0; r < rows; r++) {
            int64_t i = i0 + r, a = max64(0, i - before) - lo, b = min64(length, i + after + 1) - lo;
            lse[i] = local_softmax_row(s + r * span, scale, bias ? bias + lo : NULL, a, b, n, &inverse[r]);
        }
        if (vr && widened < hi) { /* the product reads value rows [lo, hi) */
            local_widen_rows((const char *)v + widened * dim * element, bf16, hi - widened, dim, 1.0f,
                             bias ? bias + widened : NULL, vr + widened * dim);
            widened = hi;
        }
        local_gemm(rows, dim, n, s, span, 1, values + lo * dim, dim, o, dim, 0);
        for (int64_t r = 0; r < rows; r++)
            local_store(o + r * dim, dim, inverse[r], bf16, (char *)out + (i0 + r) * dim * element);
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
            lse[i] = local_softmax_row(s + r * span, scale, bias ? bias + lo : NULL, a, b, n, &inverse[r]);
            local_narrow_row(s + r * span, n, p + r * (span / 2));
        }
        local_gemm_pairs(rows, dim, (n + 1) / 2, p, span / 2, vp + (lo / 2) * dim, dim, o, dim);
        for (int64_t r = 0; r < rows; r++) local_store(o + r * dim, dim, inverse[r], 1, out + (i0 + r) * dim);
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
        float *bias = local_key_bias(valid ? valid + (bh / heads) * length : NULL, length);
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

/* 1: the kernel is built (at every instruction-set level since local_gemm and the row passes have
 * AVX2 and plain C paths; kept so the wrapper can still ask). */
int local_attend_available(void) { return 1; }
