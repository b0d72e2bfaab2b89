/* Template (included once per floating type, not a macro: compiler errors, warnings and debuggers
 * point at these lines): linear_rows_<SUFFIX>, linear_rows_features_<SUFFIX> and
 * linear_rows_backward_<SUFFIX> with their helpers (see linear_rows_kernels.c).
 * linear_rows_kernels.c defines, before each #include, and undefines after:
 *   SUFFIX f32 or f64: the exported and helper names' suffix
 *   T_     float or double
 * Names are built with RF_CAT (common.h): RF_CAT(name_, SUFFIX) is name_f32 or name_f64. */
#if !defined(SUFFIX) || !defined(T_)
#error "linear_rows_impl.h is a template: linear_rows_kernels.c defines SUFFIX, T_ before including it"
#endif

/* state[c][:] += a[c] · x[:] for every c < d (a rank-one update of a [d, e] matrix). */
static inline void RF_CAT(rank_one_, SUFFIX)(T_ *state, const T_ *a, const T_ *x, int64_t dim,
                                     int64_t value_dim) {
    for (int64_t c = 0; c < dim; c++) {
        T_ *line = state + c * value_dim, scale = a[c];
        for (int64_t u = 0; u < value_dim; u++) line[u] += scale * x[u];
    }
}

/* y[:] = aᵀ state (a [d], state [d, e]). */
static inline void RF_CAT(read_state_, SUFFIX)(const T_ *state, const T_ *a, int64_t dim,
                                       int64_t value_dim, T_ *y) {
    memset(y, 0, sizeof(T_) * value_dim);
    for (int64_t c = 0; c < dim; c++) {
        const T_ *line = state + c * value_dim;
        T_ scale = a[c];
        for (int64_t u = 0; u < value_dim; u++) y[u] += scale * line[u];
    }
}

/* One (batch, head) row's inputs: its keys and values (token strides layout[2], layout[5]) and
 * its batch row's positions and valid flags. */
typedef struct { const T_ *keys, *values; const int64_t *where; const uint8_t *real; } RF_CAT(row_, SUFFIX);
static inline RF_CAT(row_, SUFFIX) RF_CAT(row_inputs_, SUFFIX)(const T_ *phi_k, const T_ *v, const int64_t *layout,
                                               const int64_t *positions, const uint8_t *valid,
                                               int64_t bh, int64_t heads, int64_t queries) {
    RF_CAT(row_, SUFFIX) row = {phi_k + (bh / heads) * layout[0] + (bh % heads) * layout[1],
                        v + (bh / heads) * layout[3] + (bh % heads) * layout[4],
                        positions + (bh / heads) * queries, valid + (bh / heads) * queries};
    return row;
}

/* Key j into the running state: S += phi_k[j] v[j]ᵀ, z += phi_k[j]. */
static inline void RF_CAT(add_key_, SUFFIX)(T_ *state, T_ *norm, RF_CAT(row_, SUFFIX) row, const int64_t *layout,
                                    int64_t j, int64_t dim, int64_t value_dim) {
    const T_ *key = row.keys + j * layout[2];
    RF_CAT(rank_one_, SUFFIX)(state, key, row.values + j * layout[5], dim, value_dim);
    for (int64_t c = 0; c < dim; c++) norm[c] += key[c];
}

/* Up to three valid rows of one chunk [j0, j0 + n) (slots list[0..count)): out = (phi_qᵀ S +
 * Σ_{j0 <= j <= p} (phi_q · phi_k[j]) v[j]) / (phi_q · z + Σ phi_q · phi_k[j] + eps), S and z the
 * state before the chunk; key_block [d, LINEAR_CHUNK] holds the chunk's keys transposed. */
static inline void RF_CAT(chunk_rows_, SUFFIX)(const T_ *phi_q, const T_ *state, const T_ *norm,
                                       const T_ *key_block, const T_ *values, int64_t value_stride,
                                       const int64_t *where, const int64_t *list, int count,
                                       int64_t bh, int64_t queries, int64_t j0, int64_t dim,
                                       int64_t value_dim, double eps, T_ *out, T_ *discard,
                                       T_ scores[3][LINEAR_CHUNK]) {
    const T_ *weights[3];
    T_ *results[3];
    int64_t reach = 0;
    for (int r = 0; r < 3; r++) {
        int64_t slot = bh * queries + list[r < count ? r : 0];
        weights[r] = phi_q + list[r < count ? r : 0] * dim; /* phi_q: this (batch, head)'s rows */
        results[r] = r < count ? out + slot * value_dim : discard;
        memset(results[r], 0, sizeof(T_) * value_dim);
        memset(scores[r], 0, sizeof(T_) * LINEAR_CHUNK);
    }
    RF_CAT(weighted_rows3_, T_)(weights, state, value_dim, dim, value_dim, results); /* phi_qᵀ S */
    T_ *score_rows[3] = {scores[0], scores[1], scores[2]};
    RF_CAT(weighted_rows3_, T_)(weights, key_block, LINEAR_CHUNK, dim, LINEAR_CHUNK, score_rows);
    T_ denominator[3];
    for (int r = 0; r < 3; r++) {
        int64_t last = where[list[r < count ? r : 0]] - j0; /* the row's own key, in the chunk */
        for (int64_t i = last + 1; i < LINEAR_CHUNK; i++) scores[r][i] = 0;
        denominator[r] = RF_CAT(dot_, T_)(weights[r], norm, dim) + (T_)eps;
        for (int64_t i = 0; i <= last; i++) denominator[r] += scores[r][i];
        reach = last + 1 > reach ? last + 1 : reach;
        weights[r] = scores[r];
    }
    RF_CAT(weighted_rows3_, T_)(weights, values + j0 * value_stride, value_stride, reach, value_dim, results);
    for (int r = 0; r < count; r++) {
        T_ inverse = (T_)1 / denominator[r];
        for (int64_t u = 0; u < value_dim; u++) results[r][u] *= inverse;
    }
}

/* out [BH, M, e]: one sweep over the keys up to the last valid row, LINEAR_CHUNK keys at a time:
 * the rows in a chunk read the state before it plus their part of the chunk, then the chunk
 * joins the state as three state rows per pass over its values (weighted_rows3), where adding
 * one key at a time loads and stores the whole d x e state per key. */
static void RF_CAT(linear_rows_sweep_, SUFFIX)(const T_ *phi_q, const T_ *phi_k, const T_ *v,
                          const int64_t *layout, const int64_t *positions, const uint8_t *valid,
                          int64_t rows, int64_t queries, int64_t heads,
                          int64_t length, int64_t dim, int64_t value_dim, double eps, T_ *out,
                          int threads, int features) {
    _Pragma("omp parallel num_threads(threads)")
    {
        T_ *state = malloc(sizeof(T_) * dim * value_dim), *norm = malloc(sizeof(T_) * dim);
        T_ *key_block = malloc(sizeof(T_) * dim * LINEAR_CHUNK);
        T_ *discard = malloc(sizeof(T_) * value_dim); /* the missing rows' results */
        int64_t *list = malloc(sizeof(int64_t) * LINEAR_CHUNK);
        T_ scores[3][LINEAR_CHUNK];
        /* features: phi of this row's queries, and of one key at a time before its transpose. */
        T_ *query_features = features ? malloc(sizeof(T_) * queries * dim) : NULL;
        T_ *key_features = malloc(sizeof(T_) * dim);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t bh = 0; bh < rows; bh++) {
            RF_CAT(row_, SUFFIX) row = RF_CAT(row_inputs_, SUFFIX)(phi_k, v, layout, positions, valid, bh, heads,
                                                   queries);
            const T_ *phi_rows = phi_q + bh * queries * dim;
            if (features) {
                RF_CAT(features_, T_)(phi_rows, queries * dim, query_features);
                phi_rows = query_features;
            }
            memset(state, 0, sizeof(T_) * dim * value_dim);
            memset(norm, 0, sizeof(T_) * dim);
            int64_t m = 0;
            for (int64_t j0 = 0; j0 < length && m < queries; j0 += LINEAR_CHUNK) {
                int64_t n = length - j0 < LINEAR_CHUNK ? length - j0 : LINEAR_CHUNK;
                if (features) {
                    for (int64_t i = 0; i < LINEAR_CHUNK; i++) {
                        if (i < n) RF_CAT(features_, T_)(row.keys + (j0 + i) * layout[2], dim, key_features);
                        for (int64_t c = 0; c < dim; c++)
                            key_block[c * LINEAR_CHUNK + i] = i < n ? key_features[c] : 0;
                    }
                } else {
                    for (int64_t c = 0; c < dim; c++)
                        for (int64_t i = 0; i < LINEAR_CHUNK; i++)
                            key_block[c * LINEAR_CHUNK + i] = i < n ? row.keys[(j0 + i) * layout[2] + c] : 0;
                }
                int count = 0;
                for (; m < queries && (!row.real[m] || row.where[m] < j0 + n); m++) {
                    if (row.real[m]) { list[count++] = m; continue; }
                    memset(out + (bh * queries + m) * value_dim, 0, sizeof(T_) * value_dim);
                }
                for (int at = 0; at < count; at += 3)
                    RF_CAT(chunk_rows_, SUFFIX)(phi_rows, state, norm, key_block, row.values, layout[5],
                                        row.where, list + at, count - at < 3 ? count - at : 3, bh,
                                        queries, j0, dim, value_dim, eps, out, discard, scores);
                if (m == queries) break; /* no row reads the state past this chunk */
                for (int64_t c = 0; c < dim; c += 3) { /* S[c] += Σ_i phi_k[j0 + i][c] v[j0 + i] */
                    const T_ *weights[3];
                    T_ *results[3];
                    for (int r = 0; r < 3; r++) {
                        weights[r] = key_block + (c + r < dim ? c + r : c) * LINEAR_CHUNK;
                        results[r] = c + r < dim ? state + (c + r) * value_dim : discard;
                    }
                    RF_CAT(weighted_rows3_, T_)(weights, row.values + j0 * layout[5], layout[5], n,
                                        value_dim, results);
                    for (int r = 0; r < 3 && c + r < dim; r++)
                        for (int64_t i = 0; i < n; i++) norm[c + r] += weights[r][i];
                }
            }
            for (; m < queries; m++) /* positions past the end: cannot happen for valid rows */
                memset(out + (bh * queries + m) * value_dim, 0, sizeof(T_) * value_dim);
        }
        free(state);
        free(norm);
        free(key_block);
        free(discard);
        free(list);
        free(query_features);
        free(key_features);
    }
}

void RF_CAT(linear_rows_, SUFFIX)(const T_ *phi_q, const T_ *phi_k, const T_ *v, const int64_t *layout,
                          const int64_t *positions, const uint8_t *valid, int64_t rows,
                          int64_t queries, int64_t heads,
                          int64_t length, int64_t dim, int64_t value_dim, double eps, T_ *out,
                          int threads) {
    RF_CAT(linear_rows_sweep_, SUFFIX)(phi_q, phi_k, v, layout, positions, valid, rows, queries, heads,
                               length, dim, value_dim, eps, out, threads, 0);
}

/* The same forward from raw q and k: phi = elu + 1 applied in the sweep (inference; the autograd
 * path applies phi in PyTorch so that it differentiates it). */
void RF_CAT(linear_rows_features_, SUFFIX)(const T_ *q, const T_ *k, const T_ *v, const int64_t *layout,
                                   const int64_t *positions, const uint8_t *valid, int64_t rows,
                                   int64_t queries, int64_t heads,
                                   int64_t length, int64_t dim, int64_t value_dim, double eps,
                                   T_ *out, int threads) {
    RF_CAT(linear_rows_sweep_, SUFFIX)(q, k, v, layout, positions, valid, rows, queries, heads,
                               length, dim, value_dim, eps, out, threads, 1);
}

/* grad_phi_q [BH, M, d], grad_phi_k [BH, T, d], grad_v [BH, T, e] are written in full;
 * scratch [BH, M, e + 1] holds g_num and g_den between the two sweeps. */
void RF_CAT(linear_rows_backward_, SUFFIX)(const T_ *phi_q, const T_ *phi_k, const T_ *v,
                                   const int64_t *layout, const int64_t *positions,
                                   const uint8_t *valid, const T_ *out,
                                   const T_ *grad_out, int64_t rows, int64_t queries,
                                   int64_t heads, int64_t length, int64_t dim, int64_t value_dim,
                                   double eps, T_ *grad_phi_q, T_ *grad_phi_k, T_ *grad_v,
                                   T_ *scratch, int threads) {
    _Pragma("omp parallel num_threads(threads)")
    {
        T_ *state = malloc(sizeof(T_) * dim * value_dim), *norm = malloc(sizeof(T_) * dim);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t bh = 0; bh < rows; bh++) {
            RF_CAT(row_, SUFFIX) row = RF_CAT(row_inputs_, SUFFIX)(phi_k, v, layout, positions, valid, bh, heads,
                                                   queries);
            const int64_t *where = row.where;
            const uint8_t *real = row.real;
            T_ *parts = scratch + bh * queries * (value_dim + 1);
            memset(state, 0, sizeof(T_) * dim * value_dim);
            memset(norm, 0, sizeof(T_) * dim);
            memset(grad_phi_q + bh * queries * dim, 0, sizeof(T_) * queries * dim);
            memset(parts, 0, sizeof(T_) * queries * (value_dim + 1));
            int64_t m = 0;
            /* Forward sweep: g_num, g_den and d phi_q from the state at each row. */
            for (int64_t j = 0; j < length && m < queries; j++) {
                RF_CAT(add_key_, SUFFIX)(state, norm, row, layout, j, dim, value_dim);
                for (; m < queries && (!real[m] || where[m] <= j); m++) {
                    if (!real[m]) continue;
                    int64_t slot = bh * queries + m;
                    const T_ *query = phi_q + slot * dim, *g = grad_out + slot * value_dim;
                    T_ inverse = (T_)1 / (RF_CAT(dot_, T_)(query, norm, dim) + (T_)eps);
                    T_ *g_num = parts + m * (value_dim + 1);
                    for (int64_t u = 0; u < value_dim; u++) g_num[u] = g[u] * inverse;
                    T_ g_den = -RF_CAT(dot_, T_)(g, out + slot * value_dim, value_dim) * inverse;
                    g_num[value_dim] = g_den;
                    T_ *grad_query = grad_phi_q + slot * dim;
                    for (int64_t c = 0; c < dim; c++)
                        grad_query[c] = RF_CAT(dot_, T_)(state + c * value_dim, g_num, value_dim)
                                        + norm[c] * g_den;
                }
            }
            /* Backward sweep: R (in state) and r (in norm) over the rows at or after key j. */
            memset(state, 0, sizeof(T_) * dim * value_dim);
            memset(norm, 0, sizeof(T_) * dim);
            m = queries - 1;
            for (int64_t j = length - 1; j >= 0; j--) {
                for (; m >= 0 && (!real[m] || where[m] >= j); m--) {
                    if (!real[m]) continue;
                    const T_ *query = phi_q + (bh * queries + m) * dim;
                    const T_ *g_num = parts + m * (value_dim + 1);
                    RF_CAT(rank_one_, SUFFIX)(state, query, g_num, dim, value_dim);
                    for (int64_t c = 0; c < dim; c++) norm[c] += query[c] * g_num[value_dim];
                }
                const T_ *key = row.keys + j * layout[2];
                T_ *grad_key = grad_phi_k + (bh * length + j) * dim;
                for (int64_t c = 0; c < dim; c++)
                    grad_key[c] = RF_CAT(dot_, T_)(state + c * value_dim, row.values + j * layout[5],
                                               value_dim) + norm[c];
                RF_CAT(read_state_, SUFFIX)(state, key, dim, value_dim, grad_v + (bh * length + j) * value_dim);
            }
        }
        free(state);
        free(norm);
    }
}
