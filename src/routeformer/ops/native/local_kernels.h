/* Shared by the local (sliding-window) kernels: local_kernels.c (forward) and
 * local_backward_kernels.c call the register tiles of local_tiles_kernels.c and the row passes of
 * local_rows_kernels.c through these declarations (one place, so a signature cannot drift). */
#ifndef ROUTEFORMER_LOCAL_KERNELS_H
#define ROUTEFORMER_LOCAL_KERNELS_H

#include <stdint.h>

#define MR 6 /* rows of the register tile (local_tiles_kernels.c) */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* local_tiles_kernels.c: the register-tiled products and the bf16 pair layouts. */
void local_gemm(int64_t rows, int64_t n, int64_t depth, const float *a, int64_t a_row, int64_t a_step,
                const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate);
void local_gemm_pairs(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                      const uint32_t *b, int64_t ldb, float *c, int64_t ldc);
void local_pairs_transposed(const uint16_t *x, int64_t length, int64_t dim, const float *bias,
                            uint32_t *out, int64_t ld);
void local_pairs_of_rows(const uint16_t *x, int64_t length, int64_t dim, const float *bias, uint32_t *out);
void local_narrow_row(const float *x, int64_t n, uint32_t *y);
void local_gemm_pairs_strided(int64_t rows, int64_t n, int64_t depth, const uint32_t *a, int64_t a_row,
                              int64_t a_step, const uint32_t *b, int64_t ldb, float *c, int64_t ldc,
                              int accumulate);
void local_pair_rows(const float *x0, const float *x1, int64_t n, uint32_t *y);
/* local_rows_kernels.c: row passes (softmax, its backward, conversions). */
void local_widen_rows(const void *x, int bf16, int64_t count, int64_t dim, float factor, const float *bias,
                      float *rows);
void local_widen(const void *x, int bf16, int64_t length, int64_t dim, float factor, const float *bias,
                 float *rows, float *columns, int64_t ld);
float *local_key_bias(const uint8_t *valid, int64_t length);
float local_softmax_row(float *s, float scale, const float *bias, int64_t a, int64_t b, int64_t n,
                        float *inverse);
void local_backward_row(float *s, float *dp, float scale, const float *bias, int64_t a, int64_t b,
                        int64_t n, float lse, float row_dot);
void local_store(const float *x, int64_t count, float factor, int bf16, void *out);

#endif
