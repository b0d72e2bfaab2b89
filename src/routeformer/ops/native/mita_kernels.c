/* Fused CPU kernel for bidirectional MiTA with one routed expert per query (R = 1), forward only
 * (ops/native/mita.py wraps it; ops/mita/experts.py: fused_single_route is its PyTorch twin).
 *
 * Why: the PyTorch path sorts the queries by expert, gathers them into runs, runs one SDPA call per
 * (group, expert) over [shared pairs; expert keys] and scatters the outputs back: about 10 passes
 * over [N, d] tensors and B·H·E kernel calls for ~4·N·(E + K)·d useful flops. Here one pass per
 * (batch, head) group reads each query in place, attends to its expert's K keys and the E shared
 * pairs under one softmax and writes its output row in place. The queries are visited expert by
 * expert (a counting sort per group), so an expert's keys and values stay in cache while its
 * queries run.
 *
 * Semantics, per group g and query n with expert j = assignment[g, n] (j < 0: no routed slot,
 * the row is left zero, as the PyTorch twin leaves it):
 *   s_i = shared_logits[g, n, i]                 (i < E, landmark_ok[g, i]; absent if shared is NULL)
 *   r_k = scale · q[g, n] · keys[g, j, :, k]     (k < K, key_ok[g, j, k])
 *   out[g, n] = (Σ_i exp(s_i − m) V̂[g, i] + Σ_k exp(r_k − m) v[g, j, k]) / Σ exp(· − m)
 * with m the maximum of the allowed logits; no allowed logit gives zeros.
 * Layouts (contiguous): q [G, N, d]; shared_logits [G, N, E] (already scaled, the routing logits);
 * landmark_values [G, E, e]; landmark_ok [G, E] or NULL; keys_t [G, E, d, K] (transposed: the K
 * scores of one query are K-wide vector FMAs); values [G, E, K, e]; key_ok [G, E, K] or NULL;
 * assignment [G, N]. counts [G, E] receives the queries per expert. Threads split the groups.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define MITA_FAST 1
#define TILE 4 /* queries per tile: 4 x 4 zmm score accumulators, the expert's rows loaded once */

static inline __m512 exp_nonpositive_512(__m512 x) {
    __m256 low = exp_nonpositive_ps(_mm512_castps512_ps256(x));
    __m256 high = exp_nonpositive_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)),
                                               _mm256_castps_pd(high), 1));
}

/* E = K = d = e = 64, float: `count` (<= TILE) queries of one expert. Scores by broadcast FMAs
 * over the transposed keys (each key row loaded once per tile), the softmax on 16-lane vectors,
 * the output by broadcast FMAs over the 128 value rows (each loaded once per tile). */
static void mita_tile_64(const float *q, const int64_t *rows, int count, const float *shared_logits,
                         const float *landmark_values, const uint8_t *landmark_ok, const float *keys_t,
                         const float *values, const uint8_t *key_ok, float scale, float *out) {
    float weights[TILE][128] __attribute__((aligned(64)));
    __m512 acc[TILE][4];
    for (int t = 0; t < TILE; t++)
        for (int l = 0; l < 4; l++) acc[t][l] = _mm512_setzero_ps();
    const float *query[TILE];
    for (int t = 0; t < TILE; t++) query[t] = q + rows[t < count ? t : 0] * 64;
    for (int c = 0; c < 64; c++) {
        __m512 line[4];
        for (int l = 0; l < 4; l++) line[l] = _mm512_loadu_ps(keys_t + c * 64 + 16 * l);
        for (int t = 0; t < TILE; t++) {
            __m512 qc = _mm512_set1_ps(query[t][c]);
            for (int l = 0; l < 4; l++) acc[t][l] = _mm512_fmadd_ps(qc, line[l], acc[t][l]);
        }
    }
    __m512 factor = _mm512_set1_ps(scale);
    float inverse[TILE];
    for (int t = 0; t < count; t++) {
        float *w = weights[t];
        const float *logits = shared_logits + rows[t] * 64;
        for (int l = 0; l < 4; l++) {
            _mm512_store_ps(w + 16 * l, _mm512_loadu_ps(logits + 16 * l));
            _mm512_store_ps(w + 64 + 16 * l, _mm512_mul_ps(acc[t][l], factor));
        }
        if (landmark_ok || key_ok)
            for (int i = 0; i < 128; i++)
                if (i < 64 ? (landmark_ok && !landmark_ok[i]) : (key_ok && !key_ok[i - 64])) w[i] = -INFINITY;
        __m512 best = _mm512_load_ps(w);
        for (int l = 1; l < 8; l++) best = _mm512_max_ps(best, _mm512_load_ps(w + 16 * l));
        float top = _mm512_reduce_max_ps(best);
        if (top == -INFINITY) { inverse[t] = 0; memset(w, 0, sizeof(float) * 128); continue; }
        __m512 shift = _mm512_set1_ps(top), total = _mm512_setzero_ps();
        for (int l = 0; l < 8; l++) {
            __m512 e = exp_nonpositive_512(_mm512_sub_ps(_mm512_load_ps(w + 16 * l), shift));
            _mm512_store_ps(w + 16 * l, e);
            total = _mm512_add_ps(total, e);
        }
        if (landmark_ok || key_ok) { /* an excluded pair weighs exactly 0 (the clamp leaves e^-87) */
            float sum = 0;
            for (int i = 0; i < 128; i++) {
                if (i < 64 ? (landmark_ok && !landmark_ok[i]) : (key_ok && !key_ok[i - 64])) w[i] = 0;
                sum += w[i];
            }
            inverse[t] = 1.0f / sum;
        } else {
            inverse[t] = 1.0f / _mm512_reduce_add_ps(total);
        }
    }
    for (int t = count; t < TILE; t++) { inverse[t] = 0; memset(weights[t], 0, sizeof(float) * 128); }
    for (int t = 0; t < TILE; t++)
        for (int l = 0; l < 4; l++) acc[t][l] = _mm512_setzero_ps();
    for (int i = 0; i < 128; i++) {
        const float *row = i < 64 ? landmark_values + i * 64 : values + (i - 64) * 64;
        __m512 line[4];
        for (int l = 0; l < 4; l++) line[l] = _mm512_loadu_ps(row + 16 * l);
        for (int t = 0; t < TILE; t++) {
            __m512 w = _mm512_set1_ps(weights[t][i]);
            for (int l = 0; l < 4; l++) acc[t][l] = _mm512_fmadd_ps(w, line[l], acc[t][l]);
        }
    }
    for (int t = 0; t < count; t++) {
        __m512 norm = _mm512_set1_ps(inverse[t]);
        for (int l = 0; l < 4; l++)
            _mm512_storeu_ps(out + rows[t] * 64 + 16 * l, _mm512_mul_ps(acc[t][l], norm));
    }
}
#else
#define MITA_FAST 0
#define TILE 4
static void mita_tile_64(const float *q, const int64_t *rows, int count, const float *shared_logits,
                         const float *landmark_values, const uint8_t *landmark_ok, const float *keys_t,
                         const float *values, const uint8_t *key_ok, float scale, float *out) {
    (void)q, (void)rows, (void)count, (void)shared_logits, (void)landmark_values, (void)landmark_ok;
    (void)keys_t, (void)values, (void)key_ok, (void)scale, (void)out; /* never called: MITA_FAST is 0 */
}
#endif


#define SUFFIX f32
#define T_ float
#define EXP_ expf
#include "mita_route_impl.h"
#undef SUFFIX
#undef T_
#undef EXP_
#define SUFFIX f64
#define T_ double
#define EXP_ exp
#include "mita_route_impl.h"
#undef SUFFIX
#undef T_
#undef EXP_

/* Streaming top-K of the landmark scores (ops/mita/landmarks.py: _every_key_forward), so that the
 * [E, N] score matrix never has to exist for a row-wise top-K.
 *
 * Why: the landmark stage computes its scores a block of keys at a time, transposed ([S, E]: the
 * fast product shape); a row-wise torch top-K needs all N scores of a landmark at once, i.e. an
 * [E, N] buffer filled by a transposing copy. Here each landmark keeps a min-heap of its K best
 * (value, key index) pairs across the blocks; a score enters only when it beats the heap's root,
 * which after the first few hundred keys is rare, so most of the work is one vector compare per
 * 16 landmarks and key.
 *
 * mita_topk_update: block [G, S, E] (scores of keys offset .. offset + S − 1); heap_values and
 * heap_index [G, E, K], heap_size [G, E] (zero before the first block). mita_topk_finish sorts each
 * heap by descending value (ties: lower key index first), as torch.topk orders its result.
 */
/* Whether any score of a key beats its landmark's threshold (a heap not yet full has threshold
 * −inf, which every score but −inf beats): most keys beat none once the heaps are full, and 16
 * landmarks are checked per vector compare. */
static inline int mita_any_above_f32(const float *line, const float *threshold, int64_t experts) {
    int64_t j = 0;
#if defined(__AVX512F__)
    for (; j + 16 <= experts; j += 16)
        if (_mm512_cmp_ps_mask(_mm512_loadu_ps(line + j), _mm512_loadu_ps(threshold + j), _CMP_GT_OQ))
            return 1;
#endif
    for (; j < experts; j++)
        if (line[j] > threshold[j]) return 1;
    return 0;
}

static inline int mita_any_above_f64(const double *line, const double *threshold, int64_t experts) {
    for (int64_t j = 0; j < experts; j++)
        if (line[j] > threshold[j]) return 1;
    return 0;
}

#define DEFINE_MITA_TOPK(SUFFIX, T_)                                                               \
static void sift_down_##SUFFIX(T_ *value, int64_t *index, int64_t size, int64_t at) {              \
    for (;;) {                                                                                     \
        int64_t child = 2 * at + 1, low = at;                                                      \
        if (child < size && value[child] < value[low]) low = child;                                \
        if (child + 1 < size && value[child + 1] < value[low]) low = child + 1;                    \
        if (low == at) return;                                                                     \
        T_ v = value[at]; value[at] = value[low]; value[low] = v;                                  \
        int64_t i = index[at]; index[at] = index[low]; index[low] = i;                             \
        at = low;                                                                                  \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
static void push_##SUFFIX(T_ *value, int64_t *index, int64_t *size, int64_t width, T_ x, int64_t key) { \
    if (*size < width) { /* not full: append and sift up */                                        \
        int64_t at = (*size)++;                                                                    \
        value[at] = x, index[at] = key;                                                            \
        while (at > 0 && value[(at - 1) / 2] > value[at]) {                                        \
            int64_t up = (at - 1) / 2;                                                             \
            T_ v = value[at]; value[at] = value[up]; value[up] = v;                                \
            int64_t i = index[at]; index[at] = index[up]; index[up] = i;                           \
            at = up;                                                                               \
        }                                                                                          \
    } else if (x > value[0]) { /* replace the smallest kept */                                     \
        value[0] = x, index[0] = key;                                                              \
        sift_down_##SUFFIX(value, index, width, 0);                                                \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
void mita_topk_update_##SUFFIX(const T_ *block, int64_t groups, int64_t rows, int64_t experts,     \
                               int64_t offset, int64_t width, T_ *heap_values, int64_t *heap_index,\
                               int64_t *heap_size, int threads) {                                  \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
    for (int64_t g = 0; g < groups; g++) {                                                         \
        T_ *threshold = malloc(sizeof(T_) * experts);                                              \
        for (int64_t j = 0; j < experts; j++) {                                                    \
            int64_t slot = g * experts + j;                                                        \
            threshold[j] = heap_size[slot] < width ? -INFINITY : heap_values[slot * width];        \
        }                                                                                          \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T_ *line = block + (g * rows + r) * experts;                                     \
            if (!mita_any_above_##SUFFIX(line, threshold, experts)) continue;                      \
            for (int64_t j = 0; j < experts; j++) {                                                \
                if (!(line[j] > threshold[j]) && !(threshold[j] == -INFINITY)) continue;           \
                int64_t slot = g * experts + j;                                                    \
                T_ *value = heap_values + slot * width;                                            \
                int64_t *index = heap_index + slot * width;                                        \
                push_##SUFFIX(value, index, heap_size + slot, width, line[j], offset + r);         \
                threshold[j] = heap_size[slot] < width ? -INFINITY : value[0];                     \
            }                                                                                      \
        }                                                                                          \
        free(threshold);                                                                           \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
void mita_topk_finish_##SUFFIX(int64_t heaps, int64_t width, T_ *heap_values, int64_t *heap_index, \
                               const int64_t *heap_size) {                                         \
    for (int64_t h = 0; h < heaps; h++) { /* insertion sort: descending value, then index */      \
        T_ *value = heap_values + h * width;                                                       \
        int64_t *index = heap_index + h * width;                                                   \
        for (int64_t a = 1; a < heap_size[h]; a++) {                                               \
            T_ v = value[a];                                                                       \
            int64_t i = index[a], b = a - 1;                                                       \
            while (b >= 0 && (value[b] < v || (value[b] == v && index[b] > i))) {                  \
                value[b + 1] = value[b], index[b + 1] = index[b];                                  \
                b--;                                                                               \
            }                                                                                      \
            value[b + 1] = v, index[b + 1] = i;                                                    \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_MITA_TOPK(f32, float)
DEFINE_MITA_TOPK(f64, double)

/* Routing by the maximum logit (R = 1): index and value of the first maximum of each row of
 * x [rows, width]. Why: torch's max over a short last axis (64 landmarks) ran at ~4 ns per element
 * on this machine, as long as the routing GEMM that produced the logits; this is one pass. */
#define DEFINE_MITA_ARGMAX(SUFFIX, T_)                                                             \
void mita_argmax_##SUFFIX(const T_ *x, int64_t rows, int64_t width, T_ *best, int64_t *index,     \
                          int threads) {                                                           \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                              \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T_ *line = x + r * width;                                                            \
        T_ top = line[0];                                                                          \
        int64_t at = 0;                                                                            \
        for (int64_t i = 1; i < width; i++)                                                        \
            if (line[i] > top) top = line[i], at = i;                                              \
        best[r] = top, index[r] = at;                                                              \
    }                                                                                              \
}

DEFINE_MITA_ARGMAX(f32, float)
DEFINE_MITA_ARGMAX(f64, double)
