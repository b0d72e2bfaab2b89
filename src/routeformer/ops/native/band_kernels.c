/* Banded softmax attention, a block of queries at a time (forward only).
 *
 * Per query m of (batch, head) row bh, at key position p (positions[b, m], or m itself when
 * positions is NULL), over its own horizon of H keys ending at p:
 *   out[m] = Σ_{δ < H} softmax_δ(q[m]·k[p − δ]·scale + δ·log_decay[m]) v[p − δ]
 * H = 0 (a padding slot) returns zeros. This is the final pass of causal expanding attention and,
 * with log_decay = 0 and H = min(window, p + 1), sliding-window attention at selected rows (the
 * local expert of hard-routed `meta`).
 *
 * Why blocked: one query at a time (expanding_kernels.c) reads each key once per query, with a
 * horizontal sum per dot product: ~40 cycles per (query, key) pair here. A block of BQ queries with
 * neighbouring positions scores the union of their bands in register tiles of BQ queries x BV keys
 * (one key-vector load feeds BQ multiply-adds), from a copy of the keys in tiles of BV, each tile
 * transposed (as in topk_kernels.c). Scores outside a query's own band are computed and dropped.
 * Layouts: q [BH, M, d], log_decay and horizon [BH, M], positions [B, M] (B = BH / heads),
 * contiguous; k [B, H, T, d] and v [B, H, T, e] with any strides but a contiguous last axis,
 * given by layout = {k's batch, head and token strides, then v's}. Positions ascending within a
 * row keep the bands of a block close (any order is correct).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BQ 6
#define BV 16
#define GROUPS ((BQ + 2) / 3) /* groups of three queries per block */
#define VALUE_CHUNK 64 /* keys per pass of the value sums: 16 KB of values at e = 64 */

/* tile[a][c] = Σ_d query[a·dim + d] · keys_at[d·BV + c] for the BQ queries of a block. */
#define DEFINE_BAND_TILE(T_)                                                                       \
static inline void band_tile_##T_(const T_ *query, int64_t dim, const T_ *keys_at, T_ tile[BQ][BV]) { \
    for (int a = 0; a < BQ; a++)                                                                   \
        for (int c = 0; c < BV; c++) tile[a][c] = 0;                                               \
    for (int64_t d = 0; d < dim; d++)                                                              \
        for (int a = 0; a < BQ; a++)                                                               \
            for (int c = 0; c < BV; c++) tile[a][c] += query[a * dim + d] * keys_at[d * BV + c];   \
}

DEFINE_BAND_TILE(double)
#if defined(__AVX512F__)
/* result_r[u0 : u0 + 16·lanes] += Σ_i w_r[i] · value[i·stride + u0 : …]: 3 x lanes accumulators
 * of 16 lanes, always inlined with a constant `lanes` (registers, not stack). */
static inline __attribute__((always_inline)) void band_rows3_lanes(
        const float *w[3], const float *value, int64_t stride, int64_t n, int lanes, float *result[3]) {
    __m512 acc[3][4];
#pragma GCC unroll 4
    for (int c = 0; c < lanes; c++) acc[0][c] = acc[1][c] = acc[2][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i++, value += stride) {
        __m512 p0 = _mm512_set1_ps(w[0][i]), p1 = _mm512_set1_ps(w[1][i]), p2 = _mm512_set1_ps(w[2][i]);
#pragma GCC unroll 4
        for (int c = 0; c < lanes; c++) {
            __m512 x = _mm512_loadu_ps(value + 16 * c);
            acc[0][c] = _mm512_fmadd_ps(p0, x, acc[0][c]);
            acc[1][c] = _mm512_fmadd_ps(p1, x, acc[1][c]);
            acc[2][c] = _mm512_fmadd_ps(p2, x, acc[2][c]);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < lanes; c++)
        for (int r = 0; r < 3; r++)
            _mm512_storeu_ps(result[r] + 16 * c, _mm512_add_ps(_mm512_loadu_ps(result[r] + 16 * c), acc[r][c]));
}

/* weighted_rows3_float (common.h) with 16-lane vectors: e = 64 in one pass over the values (the
 * AVX2 version makes two passes of 32 columns, loading every value row and weight twice). */
static inline void band_rows3_float(const float *w[3], const float *value, int64_t stride, int64_t n,
                                    int64_t value_dim, float *result[3]) {
    if (value_dim % 16) {
        weighted_rows3_float(w, value, stride, n, value_dim, result);
        return;
    }
    for (int64_t u0 = 0; u0 < value_dim; u0 += 64) {
        float *at[3] = {result[0] + u0, result[1] + u0, result[2] + u0};
        switch (value_dim - u0 >= 64 ? 4 : (int)(value_dim - u0) / 16) {
            case 4: band_rows3_lanes(w, value + u0, stride, n, 4, at); break;
            case 3: band_rows3_lanes(w, value + u0, stride, n, 3, at); break;
            case 2: band_rows3_lanes(w, value + u0, stride, n, 2, at); break;
            default: band_rows3_lanes(w, value + u0, stride, n, 1, at); break;
        }
    }
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
/* AVX2: the BQ x 16 scores in 12 accumulators (the generic loops keep the tile in memory). */
static inline void band_tile_float(const float *query, int64_t dim, const float *keys_at,
                                   float tile[BQ][BV]) {
    __m256 low[BQ], high[BQ];
#pragma GCC unroll 8
    for (int a = 0; a < BQ; a++) low[a] = high[a] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m256 key_low = _mm256_loadu_ps(keys_at + d * BV), key_high = _mm256_loadu_ps(keys_at + d * BV + 8);
#pragma GCC unroll 8
        for (int a = 0; a < BQ; a++) {
            __m256 q = _mm256_broadcast_ss(query + a * dim + d);
            low[a] = _mm256_fmadd_ps(q, key_low, low[a]);
            high[a] = _mm256_fmadd_ps(q, key_high, high[a]);
        }
    }
#pragma GCC unroll 8
    for (int a = 0; a < BQ; a++) {
        _mm256_storeu_ps(tile[a], low[a]);
        _mm256_storeu_ps(tile[a] + 8, high[a]);
    }
}
#else
DEFINE_BAND_TILE(float)
#endif
#if !defined(__AVX512F__)
static inline void band_rows3_float(const float *w[3], const float *value, int64_t stride, int64_t n,
                                    int64_t value_dim, float *result[3]) {
    weighted_rows3_float(w, value, stride, n, value_dim, result);
}
#endif
static inline void band_rows3_double(const double *w[3], const double *value, int64_t stride, int64_t n,
                                     int64_t value_dim, double *result[3]) {
    weighted_rows3_double(w, value, stride, n, value_dim, result);
}

#define SUFFIX f32
#define T_ float
#include "band_impl.h"
#undef SUFFIX
#undef T_
#define SUFFIX f64
#define T_ double
#include "band_impl.h"
#undef SUFFIX
#undef T_
