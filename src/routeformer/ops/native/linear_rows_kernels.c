/* Fused CPU kernels for causal linear attention evaluated at selected query rows (the hard-routed
 * linear expert of `meta`, ops/routed_rows.py: linear_attention_rows).
 *
 * Why: the PyTorch path packs the rows by chunk, builds chunk states and prefix sums and runs
 * small batched products, ~20 passes of bookkeeping for ~2·T·d·e useful multiply-adds. Here one
 * sweep per (batch, head) row carries the running state and reads it at each selected row. The
 * forward takes the keys LINEAR_CHUNK at a time (the state is loaded and stored once per chunk,
 * not per key); the backward, one key at a time.
 *
 * Semantics, per (batch, head) row, features already applied (phi = elu + 1, padded keys zeroed):
 *   S_i = Σ_{j <= i} phi_k[j] v[j]ᵀ [d, e],   z_i = Σ_{j <= i} phi_k[j] [d]
 *   out[m] = phi_q[m]ᵀ S_p / (phi_q[m] · z_p + eps),   p = positions[b, m]
 * for the valid slots m (ascending positions); invalid slots return zeros.
 * Backward, with den = phi_q·z + eps, g_num = g / den, g_den = −(g · out) / den:
 *   d phi_q[m] = S_p g_num + z_p g_den                        (a forward sweep)
 *   R_j = Σ_{m: p_m >= j} phi_q[m] g_numᵀ,  r_j = Σ phi_q[m] g_den
 *   d phi_k[j] = R_j v[j] + r_j,   d v[j] = R_jᵀ phi_k[j]     (a backward sweep)
 * Layouts: phi_q [BH, M, d] contiguous; phi_k [B, H, T, d] and v [B, H, T, e] with any strides
 * but a contiguous last axis (the strided head views of a projection are read in place), given by
 * layout = {phi_k's batch, head and token strides, then v's}; positions and valid [B, M]; threads
 * split the (batch, head) rows, each with its own d×e state.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define LINEAR_CHUNK 32 /* keys per chunk of the forward sweep (a multiple of 8: AVX2 lanes) */

/* y = phi(x) = elu(x) + 1 = exp(min(x, 0)) + max(x, 0) for n contiguous values (linear_rows_features
 * applies the feature map itself: the PyTorch elu + 1 on the strided head views of the keys cost
 * about twice the sweep). exp(0) is exactly 1 on the vector path, so x > 0 gives x + 1 as elu does. */
static inline void features_float(const float *x, int64_t n, float *y) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; i + 8 <= n; i += 8) {
        __m256 value = _mm256_loadu_ps(x + i), zero = _mm256_setzero_ps();
        __m256 e = exp_nonpositive_ps(_mm256_min_ps(value, zero));
        _mm256_storeu_ps(y + i, _mm256_add_ps(e, _mm256_max_ps(value, zero)));
    }
#endif
    for (; i < n; i++) y[i] = x[i] > 0 ? x[i] + 1 : expf(x[i]);
}

static inline void features_double(const double *x, int64_t n, double *y) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0 ? x[i] + 1 : exp(x[i]);
}

#define DEFINE_LINEAR_ROWS(SUFFIX, T_)                                                             \
/* state[c][:] += a[c] · x[:] for every c < d (a rank-one update of a [d, e] matrix). */         \
static inline void rank_one_##SUFFIX(T_ *state, const T_ *a, const T_ *x, int64_t dim,            \
                                     int64_t value_dim) {                                          \
    for (int64_t c = 0; c < dim; c++) {                                                            \
        T_ *line = state + c * value_dim, scale = a[c];                                            \
        for (int64_t u = 0; u < value_dim; u++) line[u] += scale * x[u];                           \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* y[:] = aᵀ state (a [d], state [d, e]). */                                                       \
static inline void read_state_##SUFFIX(const T_ *state, const T_ *a, int64_t dim,                 \
                                       int64_t value_dim, T_ *y) {                                 \
    memset(y, 0, sizeof(T_) * value_dim);                                                          \
    for (int64_t c = 0; c < dim; c++) {                                                            \
        const T_ *line = state + c * value_dim;                                                    \
        T_ scale = a[c];                                                                           \
        for (int64_t u = 0; u < value_dim; u++) y[u] += scale * line[u];                           \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* One (batch, head) row's inputs: its keys and values (token strides layout[2], layout[5]) and   \
 * its batch row's positions and valid flags. */                                                  \
typedef struct { const T_ *keys, *values; const int64_t *where; const uint8_t *real; } row_##SUFFIX; \
static inline row_##SUFFIX row_inputs_##SUFFIX(const T_ *phi_k, const T_ *v, const int64_t *layout, \
                                               const int64_t *positions, const uint8_t *valid,     \
                                               int64_t bh, int64_t heads, int64_t queries) {       \
    row_##SUFFIX row = {phi_k + (bh / heads) * layout[0] + (bh % heads) * layout[1],               \
                        v + (bh / heads) * layout[3] + (bh % heads) * layout[4],                   \
                        positions + (bh / heads) * queries, valid + (bh / heads) * queries};       \
    return row;                                                                                    \
}                                                                                                  \
                                                                                                   \
/* Key j into the running state: S += phi_k[j] v[j]ᵀ, z += phi_k[j]. */                           \
static inline void add_key_##SUFFIX(T_ *state, T_ *norm, row_##SUFFIX row, const int64_t *layout,  \
                                    int64_t j, int64_t dim, int64_t value_dim) {                   \
    const T_ *key = row.keys + j * layout[2];                                                      \
    rank_one_##SUFFIX(state, key, row.values + j * layout[5], dim, value_dim);                     \
    for (int64_t c = 0; c < dim; c++) norm[c] += key[c];                                           \
}                                                                                                  \
                                                                                                   \
/* Up to three valid rows of one chunk [j0, j0 + n) (slots list[0..count)): out = (phi_qᵀ S +    \
 * Σ_{j0 <= j <= p} (phi_q · phi_k[j]) v[j]) / (phi_q · z + Σ phi_q · phi_k[j] + eps), S and z the  \
 * state before the chunk; key_block [d, LINEAR_CHUNK] holds the chunk's keys transposed. */      \
static inline void chunk_rows_##SUFFIX(const T_ *phi_q, const T_ *state, const T_ *norm,          \
                                       const T_ *key_block, const T_ *values, int64_t value_stride, \
                                       const int64_t *where, const int64_t *list, int count,       \
                                       int64_t bh, int64_t queries, int64_t j0, int64_t dim,       \
                                       int64_t value_dim, double eps, T_ *out, T_ *discard,       \
                                       T_ scores[3][LINEAR_CHUNK]) {                               \
    const T_ *weights[3];                                                                          \
    T_ *results[3];                                                                                \
    int64_t reach = 0;                                                                             \
    for (int r = 0; r < 3; r++) {                                                                  \
        int64_t slot = bh * queries + list[r < count ? r : 0];                                     \
        weights[r] = phi_q + list[r < count ? r : 0] * dim; /* phi_q: this (batch, head)'s rows */ \
        results[r] = r < count ? out + slot * value_dim : discard;                                 \
        memset(results[r], 0, sizeof(T_) * value_dim);                                             \
        memset(scores[r], 0, sizeof(T_) * LINEAR_CHUNK);                                           \
    }                                                                                              \
    weighted_rows3_##T_(weights, state, value_dim, dim, value_dim, results); /* phi_qᵀ S */       \
    T_ *score_rows[3] = {scores[0], scores[1], scores[2]};                                        \
    weighted_rows3_##T_(weights, key_block, LINEAR_CHUNK, dim, LINEAR_CHUNK, score_rows);           \
    T_ denominator[3];                                                                             \
    for (int r = 0; r < 3; r++) {                                                                  \
        int64_t last = where[list[r < count ? r : 0]] - j0; /* the row's own key, in the chunk */ \
        for (int64_t i = last + 1; i < LINEAR_CHUNK; i++) scores[r][i] = 0;                       \
        denominator[r] = dot_##T_(weights[r], norm, dim) + (T_)eps;                                \
        for (int64_t i = 0; i <= last; i++) denominator[r] += scores[r][i];                        \
        reach = last + 1 > reach ? last + 1 : reach;                                               \
        weights[r] = scores[r];                                                                    \
    }                                                                                              \
    weighted_rows3_##T_(weights, values + j0 * value_stride, value_stride, reach, value_dim, results); \
    for (int r = 0; r < count; r++) {                                                              \
        T_ inverse = (T_)1 / denominator[r];                                                       \
        for (int64_t u = 0; u < value_dim; u++) results[r][u] *= inverse;                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* out [BH, M, e]: one sweep over the keys up to the last valid row, LINEAR_CHUNK keys at a time:  \
 * the rows in a chunk read the state before it plus their part of the chunk, then the chunk       \
 * joins the state as three state rows per pass over its values (weighted_rows3), where adding     \
 * one key at a time loads and stores the whole d x e state per key. */                            \
static void linear_rows_sweep_##SUFFIX(const T_ *phi_q, const T_ *phi_k, const T_ *v,              \
                          const int64_t *layout, const int64_t *positions, const uint8_t *valid,   \
                          int64_t rows, int64_t queries, int64_t heads,                            \
                          int64_t length, int64_t dim, int64_t value_dim, double eps, T_ *out,     \
                          int threads, int features) {                                             \
    _Pragma("omp parallel num_threads(threads)")                                                   \
    {                                                                                              \
        T_ *state = malloc(sizeof(T_) * dim * value_dim), *norm = malloc(sizeof(T_) * dim);        \
        T_ *key_block = malloc(sizeof(T_) * dim * LINEAR_CHUNK);                                  \
        T_ *discard = malloc(sizeof(T_) * value_dim); /* the missing rows' results */               \
        int64_t *list = malloc(sizeof(int64_t) * LINEAR_CHUNK);                                    \
        T_ scores[3][LINEAR_CHUNK];                                                                \
        /* features: phi of this row's queries, and of one key at a time before its transpose. */ \
        T_ *query_features = features ? malloc(sizeof(T_) * queries * dim) : NULL;                \
        T_ *key_features = malloc(sizeof(T_) * dim);                                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t bh = 0; bh < rows; bh++) {                                                    \
            row_##SUFFIX row = row_inputs_##SUFFIX(phi_k, v, layout, positions, valid, bh, heads,  \
                                                   queries);                                       \
            const T_ *phi_rows = phi_q + bh * queries * dim;                                       \
            if (features) {                                                                        \
                features_##T_(phi_rows, queries * dim, query_features);                            \
                phi_rows = query_features;                                                         \
            }                                                                                      \
            memset(state, 0, sizeof(T_) * dim * value_dim);                                        \
            memset(norm, 0, sizeof(T_) * dim);                                                     \
            int64_t m = 0;                                                                         \
            for (int64_t j0 = 0; j0 < length && m < queries; j0 += LINEAR_CHUNK) {                 \
                int64_t n = length - j0 < LINEAR_CHUNK ? length - j0 : LINEAR_CHUNK;               \
                if (features) {                                                                    \
                    for (int64_t i = 0; i < LINEAR_CHUNK; i++) {                                   \
                        if (i < n) features_##T_(row.keys + (j0 + i) * layout[2], dim, key_features); \
                        for (int64_t c = 0; c < dim; c++)                                          \
                            key_block[c * LINEAR_CHUNK + i] = i < n ? key_features[c] : 0;         \
                    }                                                                              \
                } else {                                                                           \
                    for (int64_t c = 0; c < dim; c++)                                              \
                        for (int64_t i = 0; i < LINEAR_CHUNK; i++)                                 \
                            key_block[c * LINEAR_CHUNK + i] = i < n ? row.keys[(j0 + i) * layout[2] + c] : 0; \
                }                                                                                  \
                int count = 0;                                                                     \
                for (; m < queries && (!row.real[m] || row.where[m] < j0 + n); m++) {              \
                    if (row.real[m]) { list[count++] = m; continue; }                              \
                    memset(out + (bh * queries + m) * value_dim, 0, sizeof(T_) * value_dim);       \
                }                                                                                  \
                for (int at = 0; at < count; at += 3)                                              \
                    chunk_rows_##SUFFIX(phi_rows, state, norm, key_block, row.values, layout[5],   \
                                        row.where, list + at, count - at < 3 ? count - at : 3, bh, \
                                        queries, j0, dim, value_dim, eps, out, discard, scores);   \
                if (m == queries) break; /* no row reads the state past this chunk */              \
                for (int64_t c = 0; c < dim; c += 3) { /* S[c] += Σ_i phi_k[j0 + i][c] v[j0 + i] */ \
                    const T_ *weights[3];                                                          \
                    T_ *results[3];                                                                \
                    for (int r = 0; r < 3; r++) {                                                  \
                        weights[r] = key_block + (c + r < dim ? c + r : c) * LINEAR_CHUNK;         \
                        results[r] = c + r < dim ? state + (c + r) * value_dim : discard;          \
                    }                                                                              \
                    weighted_rows3_##T_(weights, row.values + j0 * layout[5], layout[5], n,        \
                                        value_dim, results);                                       \
                    for (int r = 0; r < 3 && c + r < dim; r++)                                     \
                        for (int64_t i = 0; i < n; i++) norm[c + r] += weights[r][i];              \
                }                                                                                  \
            }                                                                                      \
            for (; m < queries; m++) /* positions past the end: cannot happen for valid rows */  \
                memset(out + (bh * queries + m) * value_dim, 0, sizeof(T_) * value_dim);           \
        }                                                                                          \
        free(state);                                                                               \
        free(norm);                                                                                \
        free(key_block);                                                                           \
        free(discard);                                                                             \
        free(list);                                                                                \
        free(query_features);                                                                      \
        free(key_features);                                                                        \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
void linear_rows_##SUFFIX(const T_ *phi_q, const T_ *phi_k, const T_ *v, const int64_t *layout,   \
                          const int64_t *positions, const uint8_t *valid, int64_t rows,           \
                          int64_t queries, int64_t heads,                                          \
                          int64_t length, int64_t dim, int64_t value_dim, double eps, T_ *out,     \
                          int threads) {                                                           \
    linear_rows_sweep_##SUFFIX(phi_q, phi_k, v, layout, positions, valid, rows, queries, heads,   \
                               length, dim, value_dim, eps, out, threads, 0);                      \
}                                                                                                  \
                                                                                                   \
/* The same forward from raw q and k: phi = elu + 1 applied in the sweep (inference; the autograd \
 * path applies phi in PyTorch so that it differentiates it). */                                   \
void linear_rows_features_##SUFFIX(const T_ *q, const T_ *k, const T_ *v, const int64_t *layout,  \
                                   const int64_t *positions, const uint8_t *valid, int64_t rows,  \
                                   int64_t queries, int64_t heads,                                 \
                                   int64_t length, int64_t dim, int64_t value_dim, double eps,     \
                                   T_ *out, int threads) {                                         \
    linear_rows_sweep_##SUFFIX(q, k, v, layout, positions, valid, rows, queries, heads,            \
                               length, dim, value_dim, eps, out, threads, 1);                      \
}                                                                                                  \
                                                                                                   \
/* grad_phi_q [BH, M, d], grad_phi_k [BH, T, d], grad_v [BH, T, e] are written in full;             \
 * scratch [BH, M, e + 1] holds g_num and g_den between the two sweeps. */                         \
void linear_rows_backward_##SUFFIX(const T_ *phi_q, const T_ *phi_k, const T_ *v,                 \
                                   const int64_t *layout, const int64_t *positions,                \
                                   const uint8_t *valid, const T_ *out,                            \
                                   const T_ *grad_out, int64_t rows, int64_t queries,              \
                                   int64_t heads, int64_t length, int64_t dim, int64_t value_dim,  \
                                   double eps, T_ *grad_phi_q, T_ *grad_phi_k, T_ *grad_v,         \
                                   T_ *scratch, int threads) {                                     \
    _Pragma("omp parallel num_threads(threads)")                                                   \
    {                                                                                              \
        T_ *state = malloc(sizeof(T_) * dim * value_dim), *norm = malloc(sizeof(T_) * dim);        \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t bh = 0; bh < rows; bh++) {                                                    \
            row_##SUFFIX row = row_inputs_##SUFFIX(phi_k, v, layout, positions, valid, bh, heads,  \
                                                   queries);                                       \
            const int64_t *where = row.where;                                                      \
            const uint8_t *real = row.real;                                                        \
            T_ *parts = scratch + bh * queries * (value_dim + 1);                                  \
            memset(state, 0, sizeof(T_) * dim * value_dim);                                       \
            memset(norm, 0, sizeof(T_) * dim);                                                     \
            memset(grad_phi_q + bh * queries * dim, 0, sizeof(T_) * queries * dim);                \
            memset(parts, 0, sizeof(T_) * queries * (value_dim + 1));                              \
            int64_t m = 0;                                                                         \
            /* Forward sweep: g_num, g_den and d phi_q from the state at each row. */             \
            for (int64_t j = 0; j < length && m < queries; j++) {                                  \
                add_key_##SUFFIX(state, norm, row, layout, j, dim, value_dim);                     \
                for (; m < queries && (!real[m] || where[m] <= j); m++) {                          \
                    if (!real[m]) continue;                                                        \
                    int64_t slot = bh * queries + m;                                               \
                    const T_ *query = phi_q + slot * dim, *g = grad_out + slot * value_dim;        \
                    T_ inverse = (T_)1 / (dot_##T_(query, norm, dim) + (T_)eps);               \
                    T_ *g_num = parts + m * (value_dim + 1);                                       \
                    for (int64_t u = 0; u < value_dim; u++) g_num[u] = g[u] * inverse;             \
                    T_ g_den = -dot_##T_(g, out + slot * value_dim, value_dim) * inverse;      \
                    g_num[value_dim] = g_den;                                                      \
                    T_ *grad_query = grad_phi_q + slot * dim;                                      \
                    for (int64_t c = 0; c < dim; c++)                                              \
                        grad_query[c] = dot_##T_(state + c * value_dim, g_num, value_dim)      \
                                        + norm[c] * g_den;                                         \
                }                                                                                  \
            }                                                                                      \
            /* Backward sweep: R (in state) and r (in norm) over the rows at or after key j. */  \
            memset(state, 0, sizeof(T_) * dim * value_dim);                                       \
            memset(norm, 0, sizeof(T_) * dim);                                                     \
            m = queries - 1;                                                                       \
            for (int64_t j = length - 1; j >= 0; j--) {                                            \
                for (; m >= 0 && (!real[m] || where[m] >= j); m--) {                               \
                    if (!real[m]) continue;                                                        \
                    const T_ *query = phi_q + (bh * queries + m) * dim;                            \
                    const T_ *g_num = parts + m * (value_dim + 1);                                 \
                    rank_one_##SUFFIX(state, query, g_num, dim, value_dim);                        \
                    for (int64_t c = 0; c < dim; c++) norm[c] += query[c] * g_num[value_dim];      \
                }                                                                                  \
                const T_ *key = row.keys + j * layout[2];                                          \
                T_ *grad_key = grad_phi_k + (bh * length + j) * dim;                               \
                for (int64_t c = 0; c < dim; c++)                                                  \
                    grad_key[c] = dot_##T_(state + c * value_dim, row.values + j * layout[5],  \
                                               value_dim) + norm[c];                               \
                read_state_##SUFFIX(state, key, dim, value_dim, grad_v + (bh * length + j) * value_dim); \
            }                                                                                      \
        }                                                                                          \
        free(state);                                                                               \
        free(norm);                                                                                \
    }                                                                                              \
}

DEFINE_LINEAR_ROWS(f32, float)
DEFINE_LINEAR_ROWS(f64, double)
