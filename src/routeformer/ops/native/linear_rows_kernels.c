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

#define SUFFIX f32
#define T_ float
#include "linear_rows_impl.h"
#undef SUFFIX
#undef T_
#define SUFFIX f64
#define T_ double
#include "linear_rows_impl.h"
#undef SUFFIX
#undef T_
