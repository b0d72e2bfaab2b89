/* routed_attention_f32 and routed_attention_backward_f32 on AVX-512: sixteen slots at a time.
 * Included by topk_kernels.c where __AVX512F__ is defined (the portable macros serve the other
 * levels and float64); same signatures, layouts and results as DEFINE_ATTEND and
 * DEFINE_ATTEND_BACKWARD there, within float32 rounding (the sums are ordered differently).
 *
 * Why: a routed row reads K gathered keys of a short head dim (d = 32 in compare's model). The
 * portable kernel forms one dot product per slot and reduces its lanes to a scalar each time, and
 * at d = 32 that reduction costs as much as the multiply-adds. Here sixteen slots' partial sums
 * stay in sixteen registers and one transposing add tree (reduce16) turns them into a vector of
 * sixteen logits, so the exp, the masking and the softmax gradient run on whole vectors too. */

/* Lane s of the result holds the sum of the lanes of v[s]. Four rounds of shuffles and adds halve
 * the number of vectors; the lanes come out in the order 4·(s mod 4) + s / 4, which the final
 * permutation undoes. */
static inline __m512 reduce16(const __m512 v[16]) {
    __m512 w[8], x[4], r[2];
    for (int i = 0; i < 8; i++)  /* 256-bit halves: v[2i] low, v[2i+1] high */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* 128-bit lane m: slot 4i + m */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        r[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], 0x88), _mm512_shuffle_ps(r[0], r[1], 0xDD));
    static const int32_t order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    return _mm512_permutexvar_ps(_mm512_loadu_si512(order), sums);
}

/* dots[s] = x · rows[s] over n columns, s < 16. */
static inline __m512 dots16(const float *x, const float *const rows[16], int64_t n) {
    __m512 acc[16];
    for (int s = 0; s < 16; s++) acc[s] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 m = first_lanes(n - c);
        __m512 xv = _mm512_maskz_loadu_ps(m, x + c);
        for (int s = 0; s < 16; s++)
            acc[s] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, rows[s] + c), acc[s]);
    }
    return reduce16(acc);
}

/* The rows of slots e0 .. e0 + 15 in `base` (stride `width`; slots past `slots` or invalid read
 * row 0, which exists) and the lanes of the valid ones. */
static inline __mmask16 slot_rows(const float *base, int64_t width, const int64_t *row_index,
                                  const uint8_t *row_valid, int64_t e0, int64_t slots,
                                  const float *rows[16]) {
    __mmask16 valid = 0;
    for (int s = 0; s < 16; s++) {
        int64_t e = e0 + s;
        int ok = e < slots && row_valid[e];
        rows[s] = base + (ok ? row_index[e] : 0) * width;
        valid |= (__mmask16)(ok << s);
    }
    return valid;
}

static inline void prefetch_slots(const float *base, int64_t width, const int64_t *row_index,
                                  int64_t from, int64_t slots) {
    for (int64_t e = from; e < from + 16 && e < slots; e++)
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
        float logits[MAX_SLOTS + 16];
        __mmask16 lanes[MAX_SLOTS / 16 + 1];
        __m512 best_lanes = _mm512_set1_ps(-INFINITY), scaled = _mm512_set1_ps((float)scale);
        const float *rows[16];
        for (int64_t e0 = 0, chunk = 0; e0 < slots; e0 += 16, chunk++) {
            prefetch_slots(key_base, dim, row_index, e0 + 16, slots);
            lanes[chunk] = slot_rows(key_base, dim, row_index, row_valid, e0, slots, rows);
            __m512 logit = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), lanes[chunk],
                                              _mm512_mul_ps(dots16(query, rows, dim), scaled));
            _mm512_storeu_ps(logits + e0, logit);
            best_lanes = _mm512_max_ps(best_lanes, logit);
        }
        float best = _mm512_reduce_max_ps(best_lanes);
        float *restrict result = out + row * value_dim;
        if (best == -INFINITY) {
            for (int64_t c = 0; c < value_dim; c++) result[c] = 0;
            lse[row] = -INFINITY;
            continue;
        }
        /* weights exp(logit − best), 0 on invalid slots and on the lanes past `slots` */
        __m512 total_lanes = _mm512_setzero_ps(), shift = _mm512_set1_ps(best);
        for (int64_t e0 = 0, chunk = 0; e0 < slots; e0 += 16, chunk++) {
            __m512 weight = _mm512_maskz_mov_ps(
                lanes[chunk], exp_from_minus87_512(_mm512_sub_ps(_mm512_loadu_ps(logits + e0), shift)));
            _mm512_storeu_ps(logits + e0, weight);
            total_lanes = _mm512_add_ps(total_lanes, weight);
        }
        float total = _mm512_reduce_add_ps(total_lanes);
        __m512 inverse = _mm512_set1_ps(1.0f / total);
        for (int64_t c0 = 0; c0 < value_dim; c0 += 64) {  /* 64 output columns in 4 registers */
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            __mmask16 m[4];
            for (int u = 0; u < 4; u++) m[u] = c0 + 16 * u < value_dim ? first_lanes(value_dim - c0 - 16 * u) : 0;
            for (int64_t e = 0; e < slots; e++) {
                if (e + PREFETCH_AHEAD < slots && c0 == 0)
                    prefetch_row(value_base + row_index[e + PREFETCH_AHEAD] * value_dim,
                                 value_dim * (int64_t)sizeof(float));
                if (!row_valid[e]) continue;
                __m512 weight = _mm512_set1_ps(logits[e]);
                const float *value = value_base + row_index[e] * value_dim + c0;
                for (int u = 0; u < 4; u++)
                    if (m[u]) acc[u] = _mm512_fmadd_ps(weight, _mm512_maskz_loadu_ps(m[u], value + 16 * u), acc[u]);
            }
            for (int u = 0; u < 4; u++)
                if (m[u]) _mm512_mask_storeu_ps(result + c0 + 16 * u, m[u], _mm512_mul_ps(acc[u], inverse));
        }
        lse[row] = best + logf(total);
    }
}

/* a[c] += w · x[c] for c < n. */
static inline void axpy16(float *restrict a, float w, const float *restrict x, int64_t n) {
    __m512 wv = _mm512_set1_ps(w);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 m = first_lanes(n - c);
        _mm512_mask_storeu_ps(a + c, m, _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + c),
                                                         _mm512_maskz_loadu_ps(m, a + c)));
    }
}

/* The backward's updates when dim and value_dim are at most 64: the query, dout and the query's
 * gradient stay in registers (four each), so only the gathered key rows and the key and value
 * gradients touch memory. */
static inline void update_rows_64(const int64_t *row_index, const uint8_t *row_valid, int64_t slots,
                                  const float *prob, const float *dlogit, const float *query,
                                  const float *dout, const float *key_base, int64_t dim, int64_t value_dim,
                                  float *grad_query, float *grad_key_base, float *grad_value_base) {
    __mmask16 qm[4], vm[4];
    __m512 qv[4], ov[4], gq[4];
    for (int u = 0; u < 4; u++) {
        qm[u] = first_lanes(dim - 16 * u);
        vm[u] = first_lanes(value_dim - 16 * u);
        qv[u] = _mm512_maskz_loadu_ps(qm[u], query + 16 * u);
        ov[u] = _mm512_maskz_loadu_ps(vm[u], dout + 16 * u);
        gq[u] = _mm512_setzero_ps();
    }
    for (int64_t e = 0; e < slots; e++) {
        if (!row_valid[e]) continue;
        int64_t j = row_index[e];
        __m512 p = _mm512_set1_ps(prob[e]), ds = _mm512_set1_ps(dlogit[e]);
        const float *key = key_base + j * dim;
        float *grad_key = grad_key_base + j * dim, *grad_value = grad_value_base + j * value_dim;
        for (int u = 0; u < 4; u++) {
            if (qm[u]) {
                gq[u] = _mm512_fmadd_ps(ds, _mm512_maskz_loadu_ps(qm[u], key + 16 * u), gq[u]);
                _mm512_mask_storeu_ps(grad_key + 16 * u, qm[u],
                                      _mm512_fmadd_ps(ds, qv[u], _mm512_maskz_loadu_ps(qm[u], grad_key + 16 * u)));
            }
            if (vm[u])
                _mm512_mask_storeu_ps(grad_value + 16 * u, vm[u],
                                      _mm512_fmadd_ps(p, ov[u], _mm512_maskz_loadu_ps(vm[u], grad_value + 16 * u)));
        }
    }
    for (int u = 0; u < 4; u++)
        if (qm[u]) _mm512_mask_storeu_ps(grad_query + 16 * u, qm[u], gq[u]);
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
        float prob[MAX_SLOTS + 16], dlogit[MAX_SLOTS + 16];
        const float *rows[16];
        __m512 scaled = _mm512_set1_ps((float)scale);
        for (int64_t t = 0; t < length; t++) {
            int64_t row = bh * length + t;
            int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;
            const int64_t *row_index = index + offset;
            const uint8_t *row_valid = valid + offset;
            const float *restrict query = q + row * dim, *restrict dout = grad_out + row * value_dim;
            float *restrict grad_query = grad_q + row * dim;
            for (int64_t c = 0; c < dim; c++) grad_query[c] = 0;
            if (lse[row] == -INFINITY) continue; /* no valid slot: no gradient */
            __m512 delta = _mm512_set1_ps(dot_float(dout, out + row * value_dim, value_dim));
            __m512 row_lse = _mm512_set1_ps(lse[row]);
            /* p = exp(q·k·scale − lse) (<= 1), ds = p·(dout·v − dout·out)·scale; 0 where invalid */
            for (int64_t e0 = 0; e0 < slots; e0 += 16) {
                prefetch_slots(key_base, dim, row_index, e0 + 16, slots);
                prefetch_slots(value_base, value_dim, row_index, e0 + 16, slots);
                __mmask16 ok = slot_rows(key_base, dim, row_index, row_valid, e0, slots, rows);
                __m512 logit = _mm512_fmsub_ps(dots16(query, rows, dim), scaled, row_lse);
                __m512 p = _mm512_maskz_mov_ps(ok, exp_from_minus87_512(logit));
                slot_rows(value_base, value_dim, row_index, row_valid, e0, slots, rows);
                __m512 dv = _mm512_sub_ps(dots16(dout, rows, value_dim), delta);
                _mm512_storeu_ps(prob + e0, p);
                _mm512_storeu_ps(dlogit + e0, _mm512_mul_ps(_mm512_mul_ps(p, dv), scaled));
            }
            /* the updates: dq = Σ ds·k, dk += ds·q, dv += p·dout */
            if (dim <= 64 && value_dim <= 64) {
                update_rows_64(row_index, row_valid, slots, prob, dlogit, query, dout, key_base, dim, value_dim,
                               grad_query, grad_key_base, grad_value_base);
                continue;
            }
            for (int64_t e = 0; e < slots; e++) {
                if (!row_valid[e]) continue;
                int64_t j = row_index[e];
                axpy16(grad_value_base + j * value_dim, prob[e], dout, value_dim);
                axpy16(grad_query, dlogit[e], key_base + j * dim, dim);
                axpy16(grad_key_base + j * dim, dlogit[e], query, dim);
            }
        }
    }
}
