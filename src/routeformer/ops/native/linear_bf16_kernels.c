/* bf16 products for the causal linear attention kernels (linear_kernels.c) on CPUs with AVX-512 BF16:
 *
 *   c[m, n] += Σ_k a[m, k] · b[k, n]     a: bf16 rows (k pairs contiguous), b: bf16 k pairs interleaved
 *
 * with `_mm512_dpbf16_ps` (two bf16 products into each fp32 lane: twice the multiply-adds of an fp32
 * FMA per instruction). Used for the d×e state products of bf16 inputs (phi_q S and S += phi_kᵀ v),
 * where the fp32 state is rounded to bf16 per chunk for the product only: it keeps accumulating in
 * fp32. The operands are rounded to nearest even in integer arithmetic (as common.h's
 * store_bf16_ps; vcvtneps2bf16 would flush subnormals).
 *
 * Layouts: a [m, k] uint16 rows of lda (k even); b_pairs [k / 2, n] uint32, each the bf16 pair
 * (b[2p, n], b[2p + 1, n]) low half first (what the instruction multiplies against a's pair); c fp32
 * rows of ldc; n a multiple of 16.
 */
#include <stdint.h>

#include "common.h"

#define TILE_ROWS 6

/* Whether this build has the bf16 products (else linear_kernels.c keeps fp32 products). */
int64_t rf_linear_has_dpbf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__)
/* 16 fp32 lanes -> their bf16 bit patterns (rounded to nearest even) in the low 16 bits of each lane. */
static inline __m512i round_bf16_bits(__m512 x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
}

/* dst[i, :] = bf16(src[i, :]) for `rows` rows of `cols` (a multiple of 16) fp32 values. */
void rf_linear_to_bf16(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t *dst,
                       int64_t ld_dst) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t u = 0; u < cols; u += 16)
            _mm256_storeu_si256((__m256i *)(dst + i * ld_dst + u),
                                _mm512_cvtepi32_epi16(round_bf16_bits(_mm512_loadu_ps(src + i * ld_src + u))));
}

/* dst[p, :] = pairs (bf16(src[2p, :]), bf16(src[2p + 1, :])) for p < ceil(rows / 2); a missing odd
 * last row reads as 0. cols a multiple of 16. */
void rf_linear_to_bf16_pairs(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint32_t *dst,
                             int64_t ld_dst) {
    for (int64_t p = 0; 2 * p < rows; p++) {
        const float *even = src + 2 * p * ld_src, *odd = even + ld_src;
        for (int64_t u = 0; u < cols; u += 16) {
            __m512i low = round_bf16_bits(_mm512_loadu_ps(even + u));
            __m512i high = 2 * p + 1 < rows ? _mm512_slli_epi32(round_bf16_bits(_mm512_loadu_ps(odd + u)), 16)
                                            : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + p * ld_dst + u, _mm512_or_si512(low, high));
        }
    }
}

static inline __attribute__((always_inline)) void tile16(const int rows, const int lanes, int64_t pairs,
        const uint16_t *a, int64_t lda, const uint32_t *b, int64_t ldb, float *c, int64_t ldc) {
    __m512 acc[TILE_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_loadu_ps(c + r * ldc + 16 * l);
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh lane[4];
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) lane[l] = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16 * l);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            __builtin_memcpy(&pair, a + r * lda + 2 * p, sizeof pair);
            __m512bh scale = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
            for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_dpbf16_ps(acc[r][l], scale, lane[l]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) _mm512_storeu_ps(c + r * ldc + 16 * l, acc[r][l]);
}

#define TILE16_LANES(R)                                                                             \
    switch (lanes) {                                                                               \
    case 1: tile16(R, 1, pairs, a, lda, b, ldb, c, ldc); break;                                    \
    case 2: tile16(R, 2, pairs, a, lda, b, ldb, c, ldc); break;                                    \
    case 3: tile16(R, 3, pairs, a, lda, b, ldb, c, ldc); break;                                    \
    default: tile16(R, 4, pairs, a, lda, b, ldb, c, ldc); break;                                   \
    }

static void tile16_dispatch(int rows, int lanes, int64_t pairs, const uint16_t *a, int64_t lda,
                            const uint32_t *b, int64_t ldb, float *c, int64_t ldc) {
    switch (rows) {
    case 1: TILE16_LANES(1) break;
    case 2: TILE16_LANES(2) break;
    case 3: TILE16_LANES(3) break;
    case 4: TILE16_LANES(4) break;
    case 5: TILE16_LANES(5) break;
    default: TILE16_LANES(6) break;
    }
}

/* c[m, n] += a[m, :k] · b[:k, n] (k even; see the header comment for the layouts). */
void rf_linear_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda, const uint32_t *b,
                         int64_t ldb, float *c, int64_t ldc) {
    for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
        int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
        for (int64_t c0 = 0; c0 < n; c0 += 64) {
            int lanes = n - c0 >= 64 ? 4 : (int)((n - c0) / 16);
            tile16_dispatch(rows, lanes, k / 2, a + r0 * lda, lda, b + c0, ldb, c + r0 * ldc + c0, ldc);
        }
    }
}
#else
/* Never called without AVX-512 BF16 (rf_linear_has_dpbf16 says 0); defined so the library links. */
void rf_linear_to_bf16(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t *dst,
                       int64_t ld_dst) {
    (void)src; (void)ld_src; (void)rows; (void)cols; (void)dst; (void)ld_dst;
}
void rf_linear_to_bf16_pairs(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint32_t *dst,
                             int64_t ld_dst) {
    (void)src; (void)ld_src; (void)rows; (void)cols; (void)dst; (void)ld_dst;
}
void rf_linear_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda, const uint32_t *b,
                         int64_t ldb, float *c, int64_t ldc) {
    (void)m; (void)n; (void)k; (void)a; (void)lda; (void)b; (void)ldb; (void)c; (void)ldc;
}
#endif
