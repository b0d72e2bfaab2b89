/* Small dense products for the causal linear attention kernels (linear_kernels.c).
 *
 *   c[m, n] (+)= Σ_k a(m, k) · b[k, n]      with a(m, k) = a[m·ars + k·acs]
 *
 * b and c are row-major with n a multiple of 16 (the callers pad their chunk buffers to 16
 * columns, with zeros), a is read one scalar at a time, so a transposed left operand costs nothing
 * (ars = 1, acs = the row length): the backward's Aᵀ·dn and Pᵀ·phi_q need no transposed copy.
 *
 * Why not torch / BLAS: the operands are 64×64 chunk blocks that live in L1/L2 for the whole chunk
 * step; a library call per block costs more than the block, and batching the blocks over chunks
 * (the PyTorch path) streams [N, C, C] tensors through memory.
 *
 * Triangles. `produce` limits the columns computed per block of rows to those a causal mask keeps
 * (LOWER: j <= i, UPPER: j >= i, rounded out to 16 columns); the caller then zeroes the rest of the
 * triangle. `consume` limits the contraction index the same way for a triangular left operand
 * (LOWER: k <= m, UPPER: k >= m). About 40% of a 64×64 chunk's products are skipped.
 */
#include <stdint.h>

#include "common.h"

#define TRI_FULL 0
#define TRI_LOWER 1
#define TRI_UPPER 2
#define TILE_ROWS 6 /* 6 rows × 4 lanes = 24 accumulators + 4 b lanes + 1 broadcast <= 32 zmm */

#if defined(__AVX512F__)
/* rows × (16·lanes) block of c. Always inlined with constant rows and lanes (see the dispatch), so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const int rows, const int lanes, int64_t k0,
        int64_t k1, const float *a, int64_t ars, int64_t acs, const float *b, int64_t ldb, float *c,
        int64_t ldc, int accumulate) {
    __m512 acc[TILE_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++)
            acc[r][l] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * l) : _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const float *row = b + k * ldb;
        __m512 lane[4];
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) lane[l] = _mm512_loadu_ps(row + 16 * l);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            __m512 scale = _mm512_set1_ps(a[r * ars + k * acs]);
#pragma GCC unroll 4
            for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_fmadd_ps(scale, lane[l], acc[r][l]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) _mm512_storeu_ps(c + r * ldc + 16 * l, acc[r][l]);
}

#define TILE_LANES(R)                                                                               \
    switch (lanes) {                                                                               \
    case 1: tile(R, 1, k0, k1, a, ars, acs, b, ldb, c, ldc, accumulate); break;                    \
    case 2: tile(R, 2, k0, k1, a, ars, acs, b, ldb, c, ldc, accumulate); break;                    \
    case 3: tile(R, 3, k0, k1, a, ars, acs, b, ldb, c, ldc, accumulate); break;                    \
    default: tile(R, 4, k0, k1, a, ars, acs, b, ldb, c, ldc, accumulate); break;                   \
    }

static void tile_dispatch(int rows, int lanes, int64_t k0, int64_t k1, const float *a, int64_t ars,
                          int64_t acs, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    switch (rows) {
    case 1: TILE_LANES(1) break;
    case 2: TILE_LANES(2) break;
    case 3: TILE_LANES(3) break;
    case 4: TILE_LANES(4) break;
    case 5: TILE_LANES(5) break;
    default: TILE_LANES(6) break;
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (16 ymm registers): the block as 16-column strips of rows × 2 lanes of 8 (12 accumulators, 2
 * b lanes and a broadcast), each strip as the AVX-512 tile's inner loop. */
static inline __attribute__((always_inline)) void strip(const int rows, int64_t k0, int64_t k1, const float *a,
        int64_t ars, int64_t acs, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    __m256 acc[TILE_ROWS][2];
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            acc[r][h] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8 * h) : _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k++) {
        const float *row = b + k * ldb;
        __m256 low = _mm256_loadu_ps(row), high = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 6
        for (int r = 0; r < rows; r++) {
            __m256 scale = _mm256_set1_ps(a[r * ars + k * acs]);
            acc[r][0] = _mm256_fmadd_ps(scale, low, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(scale, high, acc[r][1]);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(c + r * ldc + 8 * h, acc[r][h]);
}

static void tile_dispatch(int rows, int lanes, int64_t k0, int64_t k1, const float *a, int64_t ars,
                          int64_t acs, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int l = 0; l < lanes; l++) {
        const float *bl = b + 16 * l;
        float *cl = c + 16 * l;
        switch (rows) {
        case 1: strip(1, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        case 2: strip(2, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        case 3: strip(3, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        case 4: strip(4, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        case 5: strip(5, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        default: strip(6, k0, k1, a, ars, acs, bl, ldb, cl, ldc, accumulate); break;
        }
    }
}
#else
/* Portable fallback (no AVX-512, no AVX2): the same block, scalar; the compiler vectorises the n loop. */
static void tile_dispatch(int rows, int lanes, int64_t k0, int64_t k1, const float *a, int64_t ars,
                          int64_t acs, const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int r = 0; r < rows; r++) {
        float *out = c + r * ldc;
        if (!accumulate)
            for (int u = 0; u < 16 * lanes; u++) out[u] = 0;
        for (int64_t k = k0; k < k1; k++) {
            float scale = a[r * ars + k * acs];
            const float *row = b + k * ldb;
            for (int u = 0; u < 16 * lanes; u++) out[u] += scale * row[u];
        }
    }
}
#endif

/* See the header comment. Exported (not static) for linear_kernels.c; n must be a multiple of 16. */
void rf_linear_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t ars, int64_t acs,
                    const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int produce,
                    int consume) {
    for (int64_t r0 = 0; r0 < m; r0 += TILE_ROWS) {
        int rows = m - r0 < TILE_ROWS ? (int)(m - r0) : TILE_ROWS;
        int64_t n0 = 0, n1 = n, k0 = 0, k1 = k;
        if (produce == TRI_LOWER) {
            int64_t last = (r0 + rows + 15) & ~(int64_t)15;
            n1 = last < n ? last : n;
        } else if (produce == TRI_UPPER) {
            n0 = r0 & ~(int64_t)15;
        }
        if (consume == TRI_LOWER) k1 = r0 + rows < k ? r0 + rows : k;
        else if (consume == TRI_UPPER) k0 = r0;
        for (int64_t c0 = n0; c0 < n1; c0 += 64) {
            int lanes = n1 - c0 >= 64 ? 4 : (int)((n1 - c0) / 16);
            tile_dispatch(rows, lanes, k0, k1, a + r0 * ars, ars, acs, b + c0, ldb, c + r0 * ldc + c0, ldc,
                          accumulate);
        }
    }
}
