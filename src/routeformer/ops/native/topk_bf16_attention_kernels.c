/* routed_attention forward and backward reading bfloat16 q, k, v (and out, grad_out) as stored,
 * with float32 arithmetic: the same computation as routed_attention_f32 / _backward_f32 in
 * topk_kernels.c on the widened values. Loaded by routeformer/ops/native/__init__.py; wrapped by
 * ops/native/topk.py, which falls back to widening for head dims above MAX_DIM.
 *
 * Why: widening q, k, v to fp32 copies at the op boundary (and the gradients back) made bf16
 * slower than fp32 (0.66x forward at T=16384, loaded machine); here the gathered rows are half
 * the bytes and no copy is made. The output is narrowed to bf16 (round to nearest even, as torch),
 * lse stays fp32; key and value gradients accumulate in fp32 buffers the caller narrows.
 *
 * Layouts as routed_attention_f32: q [BH, T, d], k [BH, S, d], v [BH, S, e]; index/valid of row
 * (b, h) at b * index_batch_stride + h * index_head_stride, each row's K slots contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define MAX_DIM 512
#define MAX_SLOTS 1024

int64_t routed_attention_bf16_max_dim(void) { return MAX_DIM; }

/* x (fp32) · y (bf16), fp32 accumulation. */
static inline float dot_mixed(const float *x, const uint16_t *y, int64_t n) {
    int64_t c = 0;
    float total = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; c + 16 <= n; c += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + c), load_bf16_ps(y + c), acc);
    total = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps();
    for (; c + 8 <= n; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + c), load_bf16_ps8(y + c), acc);
    total = horizontal_sum_ps(acc);
#endif
    for (; c < n; c++) total += x[c] * bf16_to_float(y[c]);
    return total;
}

/* y (fp32) += w · x (bf16). */
static inline void add_scaled_bf16(float *y, float w, const uint16_t *x, int64_t n) {
    int64_t c = 0;
#if defined(__AVX512F__)
    __m512 weight = _mm512_set1_ps(w);
    for (; c + 16 <= n; c += 16)
        _mm512_storeu_ps(y + c, _mm512_fmadd_ps(weight, load_bf16_ps(x + c), _mm512_loadu_ps(y + c)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 weight = _mm256_set1_ps(w);
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(y + c, _mm256_fmadd_ps(weight, load_bf16_ps8(x + c), _mm256_loadu_ps(y + c)));
#endif
    for (; c < n; c++) y[c] += w * bf16_to_float(x[c]);
}

/* y (fp32) += w · x (fp32). */
static inline void add_scaled(float *y, float w, const float *x, int64_t n) {
    for (int64_t c = 0; c < n; c++) y[c] += w * x[c];
}

static inline void widen_row(float *y, const uint16_t *x, int64_t n) {
    for (int64_t c = 0; c < n; c++) y[c] = bf16_to_float(x[c]);
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define EIGHT_SLOTS 1
#else
#define EIGHT_SLOTS 0
#endif
#if EIGHT_SLOTS
/* Lane s: x · rows[s] (bf16), s < 8: eight slots' dot products in eight registers and one
 * horizontal-add tree, as routed_attention_f32's AVX2 forward does (one slot at a time, each short
 * dot is a chain of dependent adds and a horizontal sum: 0.80x of fp32's forward at T = 16384). */
static inline __m256 dots8_bf16(const float *x, const uint16_t *const rows[8], int64_t n) {
    __m256 acc[8];
    for (int s = 0; s < 8; s++) acc[s] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        for (int s = 0; s < 8; s++) acc[s] = _mm256_fmadd_ps(xv, load_bf16_ps8(rows[s] + c), acc[s]);
    }
    __m256 dots = reduce8(acc);
    if (c < n) {
        float tail[8] = {0};
        for (int s = 0; s < 8; s++)
            for (int64_t r = c; r < n; r++) tail[s] += x[r] * bf16_to_float(rows[s][r]);
        dots = _mm256_add_ps(dots, _mm256_loadu_ps(tail));
    }
    return dots;
}

/* logits[e] = q · k_index[e] · scale for the valid slots, -inf for the others; returns their max. */
static inline float slot_logits(const float *query, const uint16_t *key_base, const int64_t *row_index,
                                const uint8_t *row_valid, int64_t dim, int64_t slots, float scale, float *logits) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (int64_t e0 = 0; e0 < slots; e0 += 8) {
        const uint16_t *rows[8];
        int32_t ok[8];
        for (int s = 0; s < 8; s++) {
            int64_t e = e0 + s;
            ok[s] = e < slots && row_valid[e] ? -1 : 0;
            rows[s] = key_base + (ok[s] ? row_index[e] : 0) * dim;
        }
        for (int64_t e = e0 + 8; e < e0 + 16 && e < slots; e++) prefetch_row(key_base + row_index[e] * dim, dim * 2);
        __m256 logit = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                        _mm256_mul_ps(dots8_bf16(query, rows, dim), _mm256_set1_ps(scale)),
                                        _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)ok)));
        _mm256_storeu_ps(logits + e0, logit);
        best = _mm256_max_ps(best, logit);
    }
    return max8(best);
}
#endif

void routed_attention_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *index,
                           const uint8_t *valid, int64_t batch, int64_t heads, int64_t length, int64_t keys,
                           int64_t dim, int64_t value_dim, int64_t slots, int64_t index_batch_stride,
                           int64_t index_head_stride, double scale, uint16_t *out, float *lse, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t row = 0; row < batch * heads * length; row++) {
        int64_t bh = row / length, t = row % length, b = bh / heads, h = bh % heads;
        int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;
        const int64_t *row_index = index + offset;
        const uint8_t *row_valid = valid + offset;
        const uint16_t *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;
        float query[MAX_DIM], result[MAX_DIM], logits[MAX_SLOTS + 8], best = -INFINITY, total = 0;
        widen_row(query, q + row * dim, dim);
#if EIGHT_SLOTS
        best = slot_logits(query, key_base, row_index, row_valid, dim, slots, (float)scale, logits);
        if (best > -INFINITY) { /* weights exp(logit - best) in place, on vector lanes (invalid: skipped) */
            for (int64_t e = 0; e < slots; e++) if (!row_valid[e]) logits[e] = best;
            exp_sum_float(logits, slots, best);
        }
#else
        for (int64_t e = 0; e < slots; e++) {
            if (e + PREFETCH_AHEAD < slots) prefetch_row(key_base + row_index[e + PREFETCH_AHEAD] * dim, dim * 2);
            if (!row_valid[e]) { logits[e] = -INFINITY; continue; }
            logits[e] = dot_mixed(query, key_base + row_index[e] * dim, dim) * (float)scale;
            if (logits[e] > best) best = logits[e];
        }
#endif
        memset(result, 0, sizeof(float) * (size_t)value_dim);
        if (best > -INFINITY) {
#if EIGHT_SLOTS
            weighted_rows_sum(result, value_base, 1, value_dim, row_index, row_valid, logits, slots);
            total = valid_weight_sum(logits, row_valid, slots);
#else
            for (int64_t e = 0; e < slots; e++) {
                if (e + PREFETCH_AHEAD < slots)
                    prefetch_row(value_base + row_index[e + PREFETCH_AHEAD] * value_dim, value_dim * 2);
                if (!row_valid[e]) continue;
                float weight = expf(logits[e] - best);
                total += weight;
                add_scaled_bf16(result, weight, value_base + row_index[e] * value_dim, value_dim);
            }
#endif
            for (int64_t c = 0; c < value_dim; c++) result[c] /= total;
        }
        for (int64_t c = 0; c < value_dim; c++) out[row * value_dim + c] = float_to_bf16(result[c]);
        lse[row] = best > -INFINITY ? best + logf(total) : -INFINITY;
    }
}

/* The backward (as routed_attention_backward_f32): grad_q [BH, T, d] fp32; grad_k [BH, S, d] and
 * grad_v [BH, S, e] fp32, zero on entry. Threads split the (batch, head) rows: one writer per
 * key and value gradient row. */
void routed_attention_backward_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *index,
                                    const uint8_t *valid, const uint16_t *out, const float *lse,
                                    const uint16_t *grad_out, int64_t batch, int64_t heads, int64_t length,
                                    int64_t keys, int64_t dim, int64_t value_dim, int64_t slots,
                                    int64_t index_batch_stride, int64_t index_head_stride, double scale,
                                    float *grad_q, float *grad_k, float *grad_v, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        int64_t b = bh / heads, h = bh % heads;
        const uint16_t *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;
        float *grad_key_base = grad_k + bh * keys * dim, *grad_value_base = grad_v + bh * keys * value_dim;
        float query[MAX_DIM], dout[MAX_DIM], slot_ds[MAX_SLOTS];
        for (int64_t t = 0; t < length; t++) {
            int64_t row = bh * length + t;
            int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;
            float *grad_query = grad_q + row * dim;
            memset(grad_query, 0, sizeof(float) * (size_t)dim);
            if (lse[row] == -INFINITY) continue; /* no valid slot: no gradient */
            widen_row(query, q + row * dim, dim);
            widen_row(dout, grad_out + row * value_dim, value_dim);
            float delta = dot_mixed(dout, out + row * value_dim, value_dim);
            for (int64_t e = 0; e < slots; e++) {
                if (e + PREFETCH_AHEAD < slots) {
                    int64_t ahead = index[offset + e + PREFETCH_AHEAD];
                    prefetch_row(key_base + ahead * dim, dim * 2);
                    prefetch_row(value_base + ahead * value_dim, value_dim * 2);
                    prefetch_row(grad_key_base + ahead * dim, dim * (int64_t)sizeof(float));
                    prefetch_row(grad_value_base + ahead * value_dim, value_dim * (int64_t)sizeof(float));
                }
                if (!valid[offset + e]) continue; /* (its slot_ds is never read) */
                int64_t j = index[offset + e];
                const uint16_t *key = key_base + j * dim, *value = value_base + j * value_dim;
                float p = expf(dot_mixed(query, key, dim) * (float)scale - lse[row]);
                float ds = p * (dot_mixed(dout, value, value_dim) - delta) * (float)scale;
                add_scaled(grad_value_base + j * value_dim, p, dout, value_dim);
#if EIGHT_SLOTS
                slot_ds[e] = ds;
#else
                add_scaled_bf16(grad_query, ds, key, dim);
#endif
                add_scaled(grad_key_base + j * dim, ds, query, dim);
            }
#if EIGHT_SLOTS /* dq = Σ ds·k in registers across the slots (in memory, each slot waits on the last's store) */
            weighted_rows_sum(grad_query, key_base, 1, dim, index + offset, valid + offset, slot_ds, slots);
#endif
        }
    }
}
