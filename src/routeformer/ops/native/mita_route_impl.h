/* Template (included once per floating type, not a macro: compiler errors, warnings and debuggers
 * point at these lines): mita_route_<SUFFIX>, MiTA's routed step, with its per-query helpers (see
 * mita_kernels.c).
 * mita_kernels.c defines, before each #include, and undefines after:
 *   SUFFIX f32 or f64: the exported and helper names' suffix
 *   T_     float or double
 *   EXP_   expf or exp
 * Names are built with RF_CAT (common.h): RF_CAT(name_, SUFFIX) is name_f32 or name_f64. */
#if !defined(SUFFIX) || !defined(T_) || !defined(EXP_)
#error "mita_route_impl.h is a template: mita_kernels.c defines SUFFIX, T_, EXP_ before including it"
#endif

/* One query: the scores against the expert's keys, the joint softmax with the shared logits,
 * and the output row. `scores` holds E + K entries. always_inline: called with constant sizes
 * below, so the loops over K, d, e unroll into fixed vector code. */
static inline __attribute__((always_inline)) void RF_CAT(mita_query_, SUFFIX)(
    const T_ *query, const T_ *shared, const T_ *landmark_values, const uint8_t *landmark_ok,
    const T_ *keys_t, const T_ *values, const uint8_t *key_ok, int64_t experts, int64_t width,
    int64_t dim, int64_t value_dim, T_ scale, T_ *scores, T_ *out) {
    T_ *routed = scores + experts;
    for (int64_t k = 0; k < width; k++) routed[k] = 0;
    for (int64_t c = 0; c < dim; c++) {
        const T_ *line = keys_t + c * width;
        T_ qc = query[c];
        for (int64_t k = 0; k < width; k++) routed[k] += qc * line[k];
    }
    T_ top = -INFINITY;
    for (int64_t k = 0; k < width; k++) {
        routed[k] = key_ok && !key_ok[k] ? -INFINITY : routed[k] * scale;
        top = routed[k] > top ? routed[k] : top;
    }
    int64_t shared_count = shared ? experts : 0;
    for (int64_t i = 0; i < shared_count; i++) {
        scores[i] = landmark_ok && !landmark_ok[i] ? -INFINITY : shared[i];
        top = scores[i] > top ? scores[i] : top;
    }
    for (int64_t u = 0; u < value_dim; u++) out[u] = 0;
    if (top == -INFINITY) return; /* no allowed key: zeros */
    T_ total = 0;
    for (int64_t i = 0; i < shared_count; i++) {
        T_ w = EXP_(scores[i] - top);
        total += w;
        const T_ *row = landmark_values + i * value_dim;
        for (int64_t u = 0; u < value_dim; u++) out[u] += w * row[u];
    }
    for (int64_t k = 0; k < width; k++) {
        T_ w = EXP_(routed[k] - top);
        total += w;
        const T_ *row = values + k * value_dim;
        for (int64_t u = 0; u < value_dim; u++) out[u] += w * row[u];
    }
    T_ inverse = 1 / total;
    for (int64_t u = 0; u < value_dim; u++) out[u] *= inverse;
}

void RF_CAT(mita_route_, SUFFIX)(const T_ *q, const T_ *shared_logits, const T_ *landmark_values,
                         const uint8_t *landmark_ok, const T_ *keys_t, const T_ *values,
                         const uint8_t *key_ok, const int64_t *assignment, int64_t groups,
                         int64_t length, int64_t experts, int64_t width, int64_t dim,
                         int64_t value_dim, double scale, T_ *out, int64_t *counts, int threads) {
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int64_t g = 0; g < groups; g++) {
        const int64_t *chosen = assignment + g * length;
        int64_t *count = counts + g * experts;
        int64_t *order = malloc(sizeof(int64_t) * (length + experts + 1));
        int64_t *start = order + length;
        T_ *scores = malloc(sizeof(T_) * (experts + width));
        memset(count, 0, sizeof(int64_t) * experts);
        for (int64_t n = 0; n < length; n++) {
            if (chosen[n] >= 0) count[chosen[n]]++;
            else memset(out + (g * length + n) * value_dim, 0, sizeof(T_) * value_dim);
        }
        start[0] = 0;
        for (int64_t j = 0; j < experts; j++) start[j + 1] = start[j] + count[j];
        for (int64_t n = 0; n < length; n++)
            if (chosen[n] >= 0) order[start[chosen[n]]++] = n;
        const T_ *group_values = landmark_values ? landmark_values + g * experts * value_dim : 0;
        const uint8_t *group_ok = landmark_ok ? landmark_ok + g * experts : 0;
        int64_t first = 0;
        for (int64_t j = 0; j < experts; j++) {
            const T_ *expert_keys = keys_t + (g * experts + j) * dim * width;
            const T_ *expert_values = values + (g * experts + j) * width * value_dim;
            const uint8_t *expert_ok = key_ok ? key_ok + (g * experts + j) * width : 0;
            int64_t slot = first;
            if (MITA_FAST && sizeof(T_) == 4 && shared_logits && experts == 64 && width == 64 &&
                dim == 64 && value_dim == 64) {
                int64_t tile_rows[TILE];
                for (; slot < first + count[j]; slot += TILE) {
                    int tile = (int)(first + count[j] - slot < TILE ? first + count[j] - slot : TILE);
                    for (int t = 0; t < tile; t++) tile_rows[t] = g * length + order[slot + t];
                    mita_tile_64((const float *)q, tile_rows, tile, (const float *)shared_logits,
                                 (const float *)group_values, group_ok, (const float *)expert_keys,
                                 (const float *)expert_values, expert_ok, (float)scale, (float *)out);
                }
            }
            for (; slot < first + count[j]; slot++) {
                int64_t n = order[slot], row = g * length + n;
                const T_ *shared = shared_logits ? shared_logits + row * experts : 0;
                if (experts == 64 && width == 64 && dim == 64 && value_dim == 64)
                    RF_CAT(mita_query_, SUFFIX)(q + row * dim, shared, group_values, group_ok, expert_keys,
                                        expert_values, expert_ok, 64, 64, 64, 64, (T_)scale,
                                        scores, out + row * value_dim);
                else
                    RF_CAT(mita_query_, SUFFIX)(q + row * dim, shared, group_values, group_ok, expert_keys,
                                        expert_values, expert_ok, experts, width, dim, value_dim,
                                        (T_)scale, scores, out + row * value_dim);
            }
            first += count[j];
        }
        free(scores);
        free(order);
    }
}
