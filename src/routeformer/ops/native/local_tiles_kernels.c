/* The register-tiled matrix products of local_kernels.c (sliding-window attention).
 *
 * local_gemm: C[rows x n] (+)= A[rows x depth] · B[depth x n] in float32, A read through a row
 * stride and a step stride (so a transposed A needs no copy), B row-major.
 * local_gemm_pairs: the same with bfloat16 operands taken in pairs along the depth axis — A's
 * 32-bit words hold (a[r, 2p], a[r, 2p+1]), B's (b[2p, j], b[2p+1, j]) — multiplied by the AVX-512
 * BF16 instruction vdpbf16ps into float32 sums (exact products, float32 additions).
 * Both compute MR rows (A must be readable for all of them) and store the first `rows`.
 * local_gemm at each instruction-set level (ROUTEFORMER_ISA, ops/native/build.py): AVX-512 tiles of
 * MR x 64, AVX2 + FMA tiles of MR x 16, else plain C loops; the pair products need AVX-512 BF16
 * (without it the kernels widen bf16 to float32 and use local_gemm, and these are abort() stubs).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "common.h"        /* <immintrin.h> where the target has AVX2 */
#include "local_kernels.h" /* MR, and the declarations these definitions must match */
#if defined(__AVX512F__)
#include <immintrin.h>
#define NR 64


static inline __mmask16 lanes_below(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
}

/* C[r, 0 : 16·lanes] (+)= Σ_k A[r·a_row + k·a_step] · B[k·ldb + :] for r < MR, storing rows < rows;
 * the last lane's columns are limited by `tail`. A must be readable for all MR rows. Always inlined
 * with a constant `lanes`, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void gemm_tile(
        int64_t depth, const float *a, int64_t a_row, int64_t a_step, const float *b, int64_t ldb,
        float *c, int64_t ldc, int64_t rows, const int lanes, __mmask16 tail, int accumulate) {
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; k++, a += a_step, b += ldb) {
        __m512 x[4];
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++)
            x[l] = l == lanes - 1 ? _mm512_maskz_loadu_ps(tail, b + 16 * l) : _mm512_loadu_ps(b + 16 * l);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            __m512 s = _mm512_set1_ps(a[r * a_row]);
#pragma GCC unroll 4
            for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_fmadd_ps(s, x[l], acc[r][l]);
        }
    }
    for (int r = 0; r < MR && r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) {
            __mmask16 m = l == lanes - 1 ? tail : (__mmask16)0xffff;
            float *at = c + r * ldc + 16 * l;
            __m512 value = accumulate ? _mm512_add_ps(acc[r][l], _mm512_maskz_loadu_ps(m, at)) : acc[r][l];
            _mm512_mask_storeu_ps(at, m, value);
        }
}

/* TILE(..., lanes, tail, accumulate) with `lanes` (1-4, a variable) turned into a constant, so each
 * always-inlined tile keeps its accumulators in registers. (The tiles' zeroing and store loops stay
 * written out in each: moved into shared always-inline helpers taking acc[MR][4], both local
 * kernels ran 2x slower at T = 8192: the accumulators went to memory.) */
#define FOR_CONSTANT_LANES(TILE, lanes, depth, a, a_row, a_step, b, ldb, c, ldc, rows, tail, accumulate) \
    switch (lanes) {                                                                              \
        case 4: TILE(depth, a, a_row, a_step, b, ldb, c, ldc, rows, 4, tail, accumulate); break;  \
        case 3: TILE(depth, a, a_row, a_step, b, ldb, c, ldc, rows, 3, tail, accumulate); break;  \
        case 2: TILE(depth, a, a_row, a_step, b, ldb, c, ldc, rows, 2, tail, accumulate); break;  \
        default: TILE(depth, a, a_row, a_step, b, ldb, c, ldc, rows, 1, tail, accumulate); break; \
    }

/* C[rows x n] (+)= A[rows x depth] · B[depth x n], rows <= MR, in tiles of 64 columns. */
void local_gemm(int64_t rows, int64_t n, int64_t depth, const float *a, int64_t a_row, int64_t a_step,
                 const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int64_t j = 0; j < n; j += NR) {
        int64_t width = min64(NR, n - j);
        int lanes = (int)((width + 15) / 16);
        __mmask16 tail = lanes_below(width - 16 * (lanes - 1));
        FOR_CONSTANT_LANES(gemm_tile, lanes, depth, a, a_row, a_step, b + j, ldb, c + j, ldc, rows, tail,
                           accumulate);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 (+FMA): the same product in tiles of MR x 16 columns, 12 accumulators of 8 lanes (16 ymm
 * registers: 12 sums, two rows of B, one broadcast of A). */
#define NR2 16

static inline __attribute__((always_inline)) void gemm_tile8(
        int64_t depth, const float *a, int64_t a_row, int64_t a_step, const float *b, int64_t ldb,
        float *c, int64_t ldc, int64_t rows, const int lanes, __m256i tail, int accumulate) {
    __m256 acc[MR][2];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 2
        for (int l = 0; l < lanes; l++) acc[r][l] = _mm256_setzero_ps();
    for (int64_t k = 0; k < depth; k++, a += a_step, b += ldb) {
        __m256 x[2];
#pragma GCC unroll 2
        for (int l = 0; l < lanes; l++)
            x[l] = l == lanes - 1 ? _mm256_maskload_ps(b + 8 * l, tail) : _mm256_loadu_ps(b + 8 * l);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            __m256 s = _mm256_broadcast_ss(a + r * a_row);
#pragma GCC unroll 2
            for (int l = 0; l < lanes; l++) acc[r][l] = _mm256_fmadd_ps(s, x[l], acc[r][l]);
        }
    }
    for (int r = 0; r < MR && r < rows; r++)
#pragma GCC unroll 2
        for (int l = 0; l < lanes; l++) {
            __m256i m = l == lanes - 1 ? tail : _mm256_set1_epi32(-1);
            float *at = c + r * ldc + 8 * l;
            __m256 value = accumulate ? _mm256_add_ps(acc[r][l], _mm256_maskload_ps(at, m)) : acc[r][l];
            _mm256_maskstore_ps(at, m, value);
        }
}

/* C[rows x n] (+)= A[rows x depth] · B[depth x n], rows <= MR, in tiles of 16 columns. */
void local_gemm(int64_t rows, int64_t n, int64_t depth, const float *a, int64_t a_row, int64_t a_step,
                const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    for (int64_t j = 0; j < n; j += NR2) {
        int64_t width = min64(NR2, n - j);
        if (width > 8)
            gemm_tile8(depth, a, a_row, a_step, b + j, ldb, c + j, ldc, rows, 2, first_lanes8(width - 8),
                       accumulate);
        else
            gemm_tile8(depth, a, a_row, a_step, b + j, ldb, c + j, ldc, rows, 1, first_lanes8(width),
                       accumulate);
    }
}
#else
/* Plain C (any CPU): C's rows stay in L1 while B's rows stream past once per MR rows of A (each B
 * row is read once for all the rows of the block); the inner loop over columns is one the compiler
 * vectorises for its target (SSE2 on baseline x86-64, NEON on arm64). */
static void six_rows(int64_t n, const float *restrict x, float s0, float s1, float s2, float s3, float s4,
                     float s5, float *restrict c0, float *restrict c1, float *restrict c2, float *restrict c3,
                     float *restrict c4, float *restrict c5) {
    for (int64_t j = 0; j < n; j++) {
        const float v = x[j];
        c0[j] += s0 * v; c1[j] += s1 * v; c2[j] += s2 * v;
        c3[j] += s3 * v; c4[j] += s4 * v; c5[j] += s5 * v;
    }
}

void local_gemm(int64_t rows, int64_t n, int64_t depth, const float *a, int64_t a_row, int64_t a_step,
                const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate) {
    if (!accumulate)
        for (int64_t r = 0; r < rows; r++) memset(c + r * ldc, 0, sizeof(float) * n);
    if (rows == MR) {
        for (int64_t k = 0; k < depth; k++) {
            const float *at = a + k * a_step;
            six_rows(n, b + k * ldb, at[0], at[a_row], at[2 * a_row], at[3 * a_row], at[4 * a_row],
                     at[5 * a_row], c, c + ldc, c + 2 * ldc, c + 3 * ldc, c + 4 * ldc, c + 5 * ldc);
        }
        return;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *restrict row = c + r * ldc;
        const float *at = a + r * a_row;
        for (int64_t k = 0; k < depth; k++) {
            const float s = at[k * a_step], *restrict x = b + k * ldb;
            for (int64_t j = 0; j < n; j++) row[j] += s * x[j];
        }
    }
}
#endif

#if defined(__AVX512BF16__)
/* As gemm_tile with bf16 pairs: one vdpbf16ps adds two products per lane. */
static inline __attribute__((always_inline)) void pairs_tile(
        int64_t depth, const uint32_t *a, int64_t a_row, int64_t a_step, const uint32_t *b, int64_t ldb,
        float *c, int64_t ldc, int64_t rows, const int lanes, __mmask16 tail, int accumulate) {
    __m512 acc[MR][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_setzero_ps();
    for (int64_t k = 0; k < depth; k++, a += a_step, b += ldb) {
        __m512i x[4];
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++)
            x[l] = l == lanes - 1 ? _mm512_maskz_loadu_epi32(tail, b + 16 * l) : _mm512_loadu_si512(b + 16 * l);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            __m512i s = _mm512_set1_epi32((int)a[r * a_row]);
#pragma GCC unroll 4
            for (int l = 0; l < lanes; l++) acc[r][l] = _mm512_dpbf16_ps(acc[r][l], (__m512bh)s, (__m512bh)x[l]);
        }
    }
    for (int r = 0; r < MR && r < rows; r++)
#pragma GCC unroll 4
        for (int l = 0; l < lanes; l++) {
            __mmask16 m = l == lanes - 1 ? tail : (__mmask16)0xffff;
            float *at = c + r * ldc + 16 * l;
            __m512 value = accumulate ? _mm512_add_ps(acc[r][l], _mm512_maskz_loadu_ps(m, at)) : acc[r][l];
            _mm512_mask_storeu_ps(at, m, value);
        }
}

/* C[rows x n] (+)= A · B over `depth` pairs; A's word for (row r, pair k) is a[r·a_row + k·a_step]. */
void local_gemm_pairs_strided(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                              int64_t a_step, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                              int accumulate) {
    for (int64_t j = 0; j < n; j += NR) {
        int64_t width = min64(NR, n - j);
        int lanes = (int)((width + 15) / 16);
        __mmask16 tail = lanes_below(width - 16 * (lanes - 1));
        FOR_CONSTANT_LANES(pairs_tile, lanes, depth, a, a_row, a_step, b + j, ldb, c + j, ldc, rows, tail,
                           accumulate);
    }
}

/* C[rows x n] = A · B, A's pairs contiguous along its rows. */
void local_gemm_pairs(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                      const uint32_t *b, int64_t ldb, float *c, int64_t ldc) {
    local_gemm_pairs_strided(rows, n, depth, a, a_row, 1, b, ldb, c, ldc, 0);
}

/* 32-bit word p of bf16 row `row` (two bf16 values; memcpy: the row may be only 2-byte aligned). */
static inline uint32_t pair_at(const uint16_t *row, int64_t p) {
    uint32_t word;
    memcpy(&word, row + 2 * p, sizeof word);
    return word;
}

/* x [T x d] bf16 (d even) -> out[p·ld + j] = (x[j, 2p], x[j, 2p+1]): B of a product over d (scores
 * q·k, or dO·v). Masked keys (bias −inf) give zeros. */
void local_pairs_transposed(const uint16_t *x, int64_t length, int64_t dim, const float *bias,
                            uint32_t *out, int64_t ld) {
    for (int64_t j0 = 0; j0 < length; j0 += 16) { /* blocks of 16 keys: see local_widen */
        int64_t n = length - j0 < 16 ? length - j0 : 16;
        for (int64_t p = 0; p < dim / 2; p++)
            for (int64_t r = 0; r < n; r++) {
                int64_t j = j0 + r;
                out[p * ld + j] = (bias && bias[j] < 0) ? 0 : pair_at(x + j * dim, p);
            }
    }
}

/* x [T x d] bf16 -> out[m·d + u] = (x[2m, u], x[2m+1, u]) for m < ceil(T / 2) + MR (zero past T):
 * B of a product over keys (p·v). Masked keys give zeros. */
void local_pairs_of_rows(const uint16_t *x, int64_t length, int64_t dim, const float *bias, uint32_t *out) {
    int64_t pairs = (length + 1) / 2 + MR;
    for (int64_t m = 0; m < pairs; m++)
        for (int64_t u = 0; u < dim; u++) {
            uint32_t word = 0;
            for (int half = 0; half < 2; half++) {
                int64_t j = 2 * m + half;
                if (j < length && !(bias && bias[j] < 0)) word |= (uint32_t)x[j * dim + u] << (16 * half);
            }
            out[m * dim + u] = word;
        }
}

/* float32 x[0, n) -> bf16 y[0, n rounded up to 32) (zeros past n), round to nearest even: the
 * softmax weights as A of a product over keys. */
void local_narrow_row(const float *x, int64_t n, uint32_t *y) {
    for (int64_t j = 0; j < n; j += 32, y += 16) {
        __m512 low = _mm512_maskz_loadu_ps(lanes_below(n - j), x + j);
        __m512 high = _mm512_maskz_loadu_ps(n - j > 16 ? lanes_below(n - j - 16) : 0, x + j + 16);
        _mm512_storeu_si512(y, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}
/* y[j] = (bf16 x0[j], bf16 x1[j]) for j < n: two rows of weights paired for a product over rows. */
void local_pair_rows(const float *x0, const float *x1, int64_t n, uint32_t *y) {
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 m = lanes_below(n - j);
        __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x0 + j)));
        __m512i high = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x1 + j)));
        _mm512_mask_storeu_epi32(y + j, m, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
    }
}
int local_pairs_available(void) { return 1; }
#else
/* Without AVX-512 BF16 the kernels never take the pair path; these stubs only keep every symbol the
 * other local_*_kernels.c files name defined, whatever the optimiser removes. */
void local_gemm_pairs_strided(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                              int64_t a_step, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                              int accumulate) {
    (void)rows; (void)n; (void)depth; (void)a; (void)a_row; (void)a_step; (void)b; (void)ldb; (void)c;
    (void)ldc; (void)accumulate;
    abort();
}
void local_gemm_pairs(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                      const uint32_t *b, int64_t ldb, float *c, int64_t ldc) {
    local_gemm_pairs_strided(rows, n, depth, a, a_row, 1, b, ldb, c, ldc, 0);
}
void local_pairs_transposed(const uint16_t *x, int64_t length, int64_t dim, const float *bias,
                            uint32_t *out, int64_t ld) {
    (void)x; (void)length; (void)dim; (void)bias; (void)out; (void)ld;
    abort();
}
void local_pairs_of_rows(const uint16_t *x, int64_t length, int64_t dim, const float *bias, uint32_t *out) {
    (void)x; (void)length; (void)dim; (void)bias; (void)out;
    abort();
}
void local_narrow_row(const float *x, int64_t n, uint32_t *y) { (void)x; (void)n; (void)y; abort(); }
void local_pair_rows(const float *x0, const float *x1, int64_t n, uint32_t *y) {
    (void)x0; (void)x1; (void)n; (void)y;
    abort();
}
int local_pairs_available(void) { return 0; }
#endif
