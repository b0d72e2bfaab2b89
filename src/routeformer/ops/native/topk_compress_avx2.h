/* AVX2 has no compress instruction: the lanes of an 8-bit mask, packed to the front, are looked up
 * in route_compress_lut (entry m: the indices of m's set bits in order, then zeros) and applied with
 * a permutation. Shared by the routing kernels of topk_kernels.c (appending a tile's hits, the
 * selection's split and move passes) and topk_speculative_kernels.c (listing hit tiles); the table
 * is defined, and filled when the library loads, in topk_kernels.c. Included where __AVX2__ is
 * defined (AVX-512 builds use it too where they have no 16-lane pass of their own). */
#ifndef ROUTEFORMER_TOPK_COMPRESS_AVX2_H
#define ROUTEFORMER_TOPK_COMPRESS_AVX2_H
#include <immintrin.h>
#include <stdint.h>

extern int32_t route_compress_lut[256][8];

/* The permutation that packs the lanes of `mask` (8 bits) to the front. */
static inline __m256i compress_lanes8(uint32_t mask) {
    return _mm256_loadu_si256((const __m256i *)route_compress_lut[mask & 0xFF]);
}

/* Store the lanes of x in `mask` packed to `to` (all 8 lanes are written: the caller has room). */
static inline void compress_store_ps8(float *to, __m256 x, uint32_t mask) {
    _mm256_storeu_ps(to, _mm256_permutevar8x32_ps(x, compress_lanes8(mask)));
}

/* Store base + (the lane indices of mask's set bits), as int64, packed to `to` (8 entries written). */
static inline void compress_store_index8(int64_t *to, __m256i lanes, int64_t base) {
    __m256i offset = _mm256_set1_epi64x(base);
    _mm256_storeu_si256((__m256i *)to, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(lanes)), offset));
    _mm256_storeu_si256((__m256i *)(to + 4),
                        _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(lanes, 1)), offset));
}
#endif
