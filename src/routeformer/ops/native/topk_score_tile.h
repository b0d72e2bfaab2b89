/* The float32 score tile of the routing kernels: QB queries x V = 16 keys, scored in registers with
 * AVX-512 or AVX2 + FMA (each score the FMA chain over d in order from 0), then compared with each
 * query's threshold. Included by topk_kernels.c (route_topk_f32, which keeps the scores: `tile`) and
 * topk_speculative_kernels.c (its exact prefilter, which stores each query's scores where that query
 * keeps its hit tiles: score_tile_float_into, one row pointer a query). The includer defines QB and V (16) first; without AVX-512 or
 * AVX2 + FMA nothing is defined here (topk_kernels.c's DEFINE_TILE(float) serves). */
#if !defined(QB) || !defined(V) || V != 16
#error "topk_score_tile.h: define QB and V (16) before including it"
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
/* One register per query: six accumulators, one key load per six multiply-adds, and the
 * comparison straight into a mask (the generic loops spill the tile to the stack). */
static inline void score_tile_float_into(float query[QB][64], const float *keys_at,
                                         int64_t dim, const float *threshold, int inclusive,
                                         float *const *rows, uint32_t hits[QB]) {
    __m512 acc[QB];
#pragma GCC unroll 8
    for (int a = 0; a < QB; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m512 key = _mm512_loadu_ps(keys_at + d * V);
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) acc[a] = _mm512_fmadd_ps(_mm512_set1_ps(query[a][d]), key, acc[a]);
    }
#pragma GCC unroll 8
    for (int a = 0; a < QB; a++) {
        if (rows) _mm512_storeu_ps(rows[a], acc[a]);
        __m512 bound = _mm512_set1_ps(threshold[a]);
        hits[a] = inclusive ? _mm512_cmp_ps_mask(acc[a], bound, _CMP_GE_OQ)
                            : _mm512_cmp_ps_mask(acc[a], bound, _CMP_GT_OQ);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* AVX2: each query's V = 16 scores in two 8-wide registers (12 accumulators of the 16 at QB = 6). */
static inline void score_tile_float_into(float query[QB][64], const float *keys_at,
                                         int64_t dim, const float *threshold, int inclusive,
                                         float *const *rows, uint32_t hits[QB]) {
    __m256 low[QB], high[QB];
#pragma GCC unroll 8
    for (int a = 0; a < QB; a++) low[a] = high[a] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d++) {
        __m256 key_low = _mm256_loadu_ps(keys_at + d * V);
        __m256 key_high = _mm256_loadu_ps(keys_at + d * V + 8);
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) {
            __m256 q = _mm256_broadcast_ss(&query[a][d]);
            low[a] = _mm256_fmadd_ps(q, key_low, low[a]);
            high[a] = _mm256_fmadd_ps(q, key_high, high[a]);
        }
    }
#pragma GCC unroll 8
    for (int a = 0; a < QB; a++) {
        if (rows) {
            _mm256_storeu_ps(rows[a], low[a]);
            _mm256_storeu_ps(rows[a] + 8, high[a]);
        }
        __m256 bound = _mm256_set1_ps(threshold[a]);
        __m256 low_hits = inclusive ? _mm256_cmp_ps(low[a], bound, _CMP_GE_OQ)
                                    : _mm256_cmp_ps(low[a], bound, _CMP_GT_OQ);
        __m256 high_hits = inclusive ? _mm256_cmp_ps(high[a], bound, _CMP_GE_OQ)
                                     : _mm256_cmp_ps(high[a], bound, _CMP_GT_OQ);
        hits[a] = (uint32_t)_mm256_movemask_ps(low_hits) | (uint32_t)_mm256_movemask_ps(high_hits) << 8;
    }
}
#endif
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The same into a contiguous tile [QB][V] (NULL: no scores stored). */
static inline void score_tile_float(float query[QB][64], const float *keys_at, int64_t dim,
                                    const float *threshold, int inclusive, float (*tile)[V], uint32_t hits[QB]) {
    float *rows[QB];
    for (int a = 0; a < QB; a++) rows[a] = tile ? tile[a] : NULL;
    score_tile_float_into(query, keys_at, dim, threshold, inclusive, tile ? rows : NULL, hits);
}
#define HAVE_SCORE_TILE_FLOAT 1
#endif
