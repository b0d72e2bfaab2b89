/* routed_attention_f32 and routed_attention_backward_f32 on AVX2 + FMA: eight slots at a time.
 * Included by topk_kernels.c where __AVX2__ and __FMA__ are defined but __AVX512F__ is not (the
 * AVX-512 pair is topk_attend_avx512.h; the portable macros serve plain C and float64). Same
 * signatures, layouts and results as DEFINE_ATTEND and DEFINE_ATTEND_BACKWARD there, within float32
 * rounding. Why: as on AVX-512, the portable kernel reduces every short dot product (d = 32) to a
 * scalar; here eight slots' partial sums stay in eight registers and one horizontal-add tree
 * (reduce8) turns them into a vector of eight logits. */

/* reduce8 (lane s: the sum of v[s]), max8 and first_lanes8 are in common.h, shared with the bf16 forward. */

/* dots[s] = x · rows[s] over n columns, s < 8. */
static inline __m256 dots8(const float *x, const float *const rows[8], int64_t n) {
    __m256 acc[8];
    for (int s = 0; s < 8; s++) acc[s] = _mm256_setzero_ps();
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        for (int s = 0; s < 8; s++) acc[s] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(rows[s] + c), acc[s]);
    }
    if (c < n) {
        __m256i m = first_lanes8(n - c);
        __m256 xv = _mm256_maskload_ps(x + c, m);
        for (int s = 0; s < 8; s++) acc[s] = _mm256_fmadd_ps(xv, _mm256_maskload_ps(rows[s] + c, m), acc[s]);
    }
    return reduce8(acc);
}

/* The rows of slots e0 .. e0 + 7 in `base` (invalid slots and those past `slots` read row 0) and
 * the valid ones as an all-ones lane mask. */
static inline __m256 slot_rows8(const float *base, int64_t width, const int64_t *row_index,
                                const uint8_t *row_valid, int64_t e0, int64_t slots, const float *rows[8]) {
    int32_t ok[8];
    for (int s = 0; s < 8; s++) {
        int64_t e = e0 + s;
        ok[s] = e < slots && row_valid[e] ? -1 : 0;
        rows[s] = base + (ok[s] ? row_index[e] : 0) * width;
    }
    return _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)ok));
}

static inline void prefetch_slots8(const float *base, int64_t width, const int64_t *row_index, int64_t from,
                                   int64_t slots) {
    for (int64_t e = from; e < from + 8 && e < slots; e++)
        prefetch_row(base + row_index[e] * width, width * (int64_t)sizeof(float));
}

void routed_attention_f32(const float *q, const float *k, const float *v, const int64_t *index,
                          const uint8_t *valid, int64_t batch, int64_t heads, int64_t length,
                          int64_t keys, int64_t dim, int64_t value_dim, int64_t slots,
                          int64_t index_batch_stride, int64_t index_head_stride, double scale,
                          float *out, float *lse, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t row = 0; row < batch * heads * length; row++) {
        int64_t bh = row / length, t = row % length;
        int64_t b = bh / heads, h = bh % heads;
        int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;
        const int64_t *row_index = index + offset;
        const uint8_t *row_valid = valid + offset;
        const float *query = q + row * dim;
        const float *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;
        float logits[MAX_SLOTS + 8];
        const float *rows[8];
        __m256 best_lanes = _mm256_set1_ps(-INFINITY), scaled = _mm256_set1_ps((float)scale);
        for (int64_t e0 = 0; e0 < slots; e0 += 8) {
            prefetch_slots8(key_base, dim, row_index, e0 + 8, slots);
            __m256 ok = slot_rows8(key_base, dim, row_index, row_valid, e0, slots, rows);
            __m256 logit = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                            _mm256_mul_ps(dots8(query, rows, dim), scaled), ok);
            _mm256_storeu_ps(logits + e0, logit);
            best_lanes = _mm256_max_ps(best_lanes, logit);
        }
        float best = max8(best_lanes);
        float *restrict result = out + row * value_dim;
        if (best == -INFINITY) {
            for (int64_t c = 0; c < value_dim; c++) result[c] = 0;
            lse[row] = -INFINITY;
            continue;
        }
        /* weights exp(logit − best) on the valid slots (the others are skipped below) */
        for (int64_t e = 0; e < slots; e++) if (!row_valid[e]) logits[e] = best;
        exp_sum_float(logits, slots, best);
        weighted_rows_sum(result, value_base, 0, value_dim, row_index, row_valid, logits, slots);
        float total = valid_weight_sum(logits, row_valid, slots);
        for (int64_t c = 0; c < value_dim; c++) result[c] /= total;
        lse[row] = best + logf(total);
    }
}

void routed_attention_backward_f32(const float *q, const float *k, const float *v, const int64_t *index,
                                   const uint8_t *valid, const float *out, const float *lse,
                                   const float *grad_out, int64_t batch, int64_t heads, int64_t length,
                                   int64_t keys, int64_t dim, int64_t value_dim, int64_t slots,
                                   int64_t index_batch_stride, int64_t index_head_stride, double scale,
                                   float *grad_q, float *grad_k, float *grad_v, int threads) {
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        int64_t b = bh / heads, h = bh % heads;
        const float *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;
        float *grad_key_base = grad_k + bh * keys * dim, *grad_value_base = grad_v + bh * keys * value_dim;
        float prob[MAX_SLOTS + 8], dlogit[MAX_SLOTS + 8];
        const float *rows[8];
        __m256 scaled = _mm256_set1_ps((float)scale);
        for (int64_t t = 0; t < length; t++) {
            int64_t row = bh * length + t;
            int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;
            const int64_t *row_index = index + offset;
            const uint8_t *row_valid = valid + offset;
            const float *restrict query = q + row * dim, *restrict dout = grad_out + row * value_dim;
            float *restrict grad_query = grad_q + row * dim;
            for (int64_t c = 0; c < dim; c++) grad_query[c] = 0;
            if (lse[row] == -INFINITY) continue; /* no valid slot: no gradient */
            __m256 delta = _mm256_set1_ps(dot_float(dout, out + row * value_dim, value_dim));
            __m256 row_lse = _mm256_set1_ps(lse[row]);
            /* p = exp(q·k·scale − lse), ds = p·(dout·v − dout·out)·scale; 0 where invalid */
            for (int64_t e0 = 0; e0 < slots; e0 += 8) {
                prefetch_slots8(key_base, dim, row_index, e0 + 8, slots);
                prefetch_slots8(value_base, value_dim, row_index, e0 + 8, slots);
                /* the rows the updates below add to, scattered over the keys: asked for here, a
                 * pass ahead of their use (T = 16384, K = 64, d = 64, 4 heads on 2 threads, AMD
                 * EPYC AVX2: bwd 339 -> 261 ms, medians of 5 alternating; a query ahead: 281 ms) */
                prefetch_slots8(grad_key_base, dim, row_index, e0, slots);
                prefetch_slots8(grad_value_base, value_dim, row_index, e0, slots);
                __m256 ok = slot_rows8(key_base, dim, row_index, row_valid, e0, slots, rows);
                __m256 logit = _mm256_fmsub_ps(dots8(query, rows, dim), scaled, row_lse);
                __m256 p = _mm256_and_ps(ok, exp_nonpositive_ps(_mm256_min_ps(logit, _mm256_setzero_ps())));
                slot_rows8(value_base, value_dim, row_index, row_valid, e0, slots, rows);
                __m256 dv = _mm256_sub_ps(dots8(dout, rows, value_dim), delta);
                _mm256_storeu_ps(prob + e0, p);
                _mm256_storeu_ps(dlogit + e0, _mm256_mul_ps(_mm256_mul_ps(p, dv), scaled));
            }
            /* the updates: dq = Σ ds·k (in registers across the slots, as the forward's P·V),
             * dk += ds·q, dv += p·dout (distinct rows: no chain between slots) */
            weighted_rows_sum(grad_query, key_base, 0, dim, row_index, row_valid, dlogit, slots);
            for (int64_t e = 0; e < slots; e++) {
                if (!row_valid[e]) continue;
                int64_t j = row_index[e];
                float p = prob[e], ds = dlogit[e];
                float *restrict grad_value = grad_value_base + j * value_dim;
                float *restrict grad_key = grad_key_base + j * dim;
                for (int64_t c = 0; c < value_dim; c++) grad_value[c] += p * dout[c];
                for (int64_t c = 0; c < dim; c++) grad_key[c] += ds * query[c];
            }
        }
    }
}
