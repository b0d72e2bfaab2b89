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
 * Layouts: q [BH, M, d], k [BH, T, d], v [BH, T, e], log_decay and horizon [BH, M], positions
 * [B, M] (B = BH / heads), all contiguous; positions ascending within a row keep the bands of a
 * block close (any order is correct).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BQ 6
#define BV 16

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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2: the BQ x 16 scores in 12 accumulators (the generic loops keep the tile in memory). */
static inline void band_tile_float(const float *query, int64_t dim, const float *keys_at, float tile[BQ][BV]) {
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

/* x[i] = exp(x[i] − shift) for i < n (every x[i] <= shift), returns Σ x[i]; and
 * result[:] = Σ_i w[i] · value[i·e + :] over n rows of `value`. */
#define DEFINE_BAND_HELPERS(T_, EXP)                                                               \
static inline T_ exp_sum_generic_##T_(T_ *x, int64_t n, T_ shift) {                                \
    T_ total = 0;                                                                                  \
    for (int64_t i = 0; i < n; i++) { x[i] = EXP(x[i] - shift); total += x[i]; }                   \
    return total;                                                                                  \
}                                                                                                  \
static inline void weighted_rows_generic_##T_(const T_ *w, const T_ *value, int64_t n,            \
                                              int64_t value_dim, T_ *result) {                     \
    for (int64_t i = 0; i < n; i++, value += value_dim)                                            \
        for (int64_t u = 0; u < value_dim; u++) result[u] += w[i] * value[u];                      \
}

DEFINE_BAND_HELPERS(double, exp)
DEFINE_BAND_HELPERS(float, expf)

#if defined(__AVX2__) && defined(__FMA__)
/* exp on 8 lanes for x in [-87, 0]: x = n·ln 2 + r, |r| <= ln 2 / 2, e^r by the degree-6
 * minimax polynomial of the Cephes library (relative error ~1e-7, as expf), times 2^n built in
 * the exponent bits. Softmax weights below e^-87 are clamped there: < 1e-37 of the largest. */
static inline __m256 exp_nonpositive_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

static inline float exp_sum_float(float *x, int64_t n, float shift) {
    __m256 total = _mm256_setzero_ps(), offset = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_nonpositive_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), offset));
        _mm256_storeu_ps(x + i, e);
        total = _mm256_add_ps(total, e);
    }
    float lanes[8], sum = 0;
    _mm256_storeu_ps(lanes, total);
    for (int c = 0; c < 8; c++) sum += lanes[c];
    return sum + exp_sum_generic_float(x + i, n - i, shift);
}

/* 32 output columns at a time in four registers (the generic loop loads and stores the result
 * row for every value row). */
static inline void weighted_rows_float(const float *w, const float *value, int64_t n, int64_t value_dim,
                                       float *result) {
    if (value_dim % 8) { weighted_rows_generic_float(w, value, n, value_dim, result); return; }
    for (int64_t u0 = 0; u0 < value_dim; u0 += 32) {
        int lanes = value_dim - u0 >= 32 ? 4 : (int)(value_dim - u0) / 8;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        const float *row = value + u0;
        for (int64_t i = 0; i < n; i++, row += value_dim) {
            __m256 p = _mm256_broadcast_ss(w + i);
            for (int c = 0; c < lanes; c++) acc[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + 8 * c), acc[c]);
        }
        for (int c = 0; c < lanes; c++)
            _mm256_storeu_ps(result + u0 + 8 * c, _mm256_add_ps(_mm256_loadu_ps(result + u0 + 8 * c), acc[c]));
    }
}
#else
static inline float exp_sum_float(float *x, int64_t n, float shift) { return exp_sum_generic_float(x, n, shift); }
static inline void weighted_rows_float(const float *w, const float *value, int64_t n, int64_t value_dim,
                                       float *result) {
    weighted_rows_generic_float(w, value, n, value_dim, result);
}
#endif
static inline double exp_sum_double(double *x, int64_t n, double shift) {
    return exp_sum_generic_double(x, n, shift);
}
static inline void weighted_rows_double(const double *w, const double *value, int64_t n, int64_t value_dim,
                                        double *result) {
    weighted_rows_generic_double(w, value, n, value_dim, result);
}

#define DEFINE_BAND(SUFFIX, T_)                                                               \
void band_attend_##SUFFIX(const T_ *q, const T_ *k, const T_ *v, const T_ *log_decay,             \
                          const int64_t *horizon, const int64_t *positions, int64_t rows,          \
                          int64_t queries, int64_t heads, int64_t length, int64_t dim,             \
                          int64_t value_dim, double scale, T_ *out, int threads) {                 \
    const int64_t tiles = (length + BV - 1) / BV, blocks = (queries + BQ - 1) / BQ;                \
    T_ *key_tiles = malloc(sizeof(T_) * rows * tiles * dim * BV);                                  \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t item = 0; item < rows * tiles; item++) {                                          \
        int64_t bh = item / tiles, first = (item % tiles) * BV;                                    \
        T_ *tile = key_tiles + item * dim * BV;                                                    \
        for (int c = 0; c < BV; c++) {                                                             \
            const T_ *key = first + c < length ? k + (bh * length + first + c) * dim : NULL;       \
            for (int64_t d = 0; d < dim; d++) tile[d * BV + c] = key ? key[d] : 0;                 \
        }                                                                                          \
    }                                                                                              \
    _Pragma("omp parallel num_threads(threads)")                                                   \
    {                                                                                              \
        T_ *scores = malloc(sizeof(T_) * BQ * (tiles * BV + BV));                                  \
        T_ *block = malloc(sizeof(T_) * BQ * dim);                                                 \
        T_ tile[BQ][BV];                                                                           \
        _Pragma("omp for schedule(dynamic, 4)")                                                    \
        for (int64_t item = 0; item < rows * blocks; item++) {                                     \
            int64_t bh = item / blocks, m0 = (item % blocks) * BQ;                                 \
            int64_t count = queries - m0 < BQ ? queries - m0 : BQ;                                 \
            int64_t at[BQ], band[BQ], lo = INT64_MAX, hi = -1;                                     \
            for (int a = 0; a < BQ; a++) {                                                         \
                band[a] = 0;                                                                       \
                memset(block + a * dim, 0, sizeof(T_) * dim);                                      \
                if (a >= count) continue;                                                          \
                int64_t m = m0 + a, row = bh * queries + m;                                        \
                at[a] = positions ? positions[(bh / heads) * queries + m] : m;                     \
                band[a] = horizon[row];                                                            \
                memset(out + row * value_dim, 0, sizeof(T_) * value_dim);                          \
                if (band[a] <= 0) { band[a] = 0; continue; }                                       \
                memcpy(block + a * dim, q + row * dim, sizeof(T_) * dim);                          \
                lo = at[a] - band[a] + 1 < lo ? at[a] - band[a] + 1 : lo;                          \
                hi = at[a] > hi ? at[a] : hi;                                                      \
            }                                                                                      \
            if (hi < 0) continue;                                                                  \
            int64_t t0 = lo / BV, t1 = hi / BV, span = (t1 - t0 + 1) * BV, base = t0 * BV;         \
            for (int64_t t = t0; t <= t1; t++) {                                                   \
                band_tile_##T_(block, dim, key_tiles + (bh * tiles + t) * dim * BV, tile);         \
                for (int a = 0; a < BQ; a++)                                                       \
                    memcpy(scores + a * span + (t - t0) * BV, tile[a], sizeof(T_) * BV);           \
            }                                                                                      \
            for (int a = 0; a < count; a++) {                                                      \
                if (!band[a]) continue;                                                            \
                int64_t row = bh * queries + m0 + a, first = at[a] - band[a] + 1;                  \
                T_ *s = scores + a * span - base, decay = log_decay[row], best = -INFINITY;        \
                for (int64_t j = first; j <= at[a]; j++) {                                         \
                    s[j] = s[j] * (T_)scale + (T_)(at[a] - j) * decay;                             \
                    best = s[j] > best ? s[j] : best;                                              \
                }                                                                                  \
                T_ total = exp_sum_##T_(s + first, band[a], best), inverse = (T_)1 / total;        \
                for (int64_t j = first; j <= at[a]; j++) s[j] *= inverse;                          \
                weighted_rows_##T_(s + first, v + (bh * length + first) * value_dim, band[a],     \
                                   value_dim, out + row * value_dim);                              \
            }                                                                                      \
        }                                                                                          \
        free(scores);                                                                              \
        free(block);                                                                               \
    }                                                                                              \
    free(key_tiles);                                                                               \
}

DEFINE_BAND(f32, float)
DEFINE_BAND(f64, double)
