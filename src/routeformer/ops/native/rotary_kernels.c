/* Rotary position embedding in one pass (ops/rotary.py: apply_rotary).
 *
 * Why: the PyTorch version is six elementwise passes (a negated half, a concatenation, two
 * products, a sum and a copy of the strided head view), and routed query rows (hard-routed `meta`)
 * first gather their angles. Here each output row is written once, reading the half-width angle
 * tables at its position.
 *
 * Semantics, half = d / 2, p = rows ? rows[b, m] : m, c = cos[b, p, i], s = sign · sin[b, p, i]:
 *   out[b, h, m, i]        = x[i] c − x[i + half] s          (i < half)
 *   out[b, h, m, i + half] = x[i + half] c + x[i] s
 * sign = −1 rotates back: the rotation's transpose, i.e. its backward.
 * Layouts: x [B, H, M, d] with strides layout = {batch, head, row} and a contiguous last axis (a
 * head view of a projection is read in place); cos, sin [B, T, half] contiguous (T the table's
 * length, every p < T); rows [B, M] or NULL; out [B, H, M, d] contiguous.
 */
#include <stdint.h>

#define DEFINE_ROTARY(SUFFIX, T_)                                                                  \
void rotary_##SUFFIX(const T_ *x, const int64_t *layout, const T_ *cos_table,                      \
                     const T_ *sin_table, const int64_t *rows, int64_t batch, int64_t heads,       \
                     int64_t count, int64_t length, int64_t dim, double sign, T_ *out,             \
                     int threads) {                                                                \
    const int64_t half = dim / 2;                                                                  \
    const T_ flip = (T_)sign;                                                                      \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t bm = 0; bm < batch * count; bm++) {                                               \
        const int64_t b = bm / count, m = bm % count, p = rows ? rows[bm] : m;                     \
        const T_ *restrict c = cos_table + (b * length + p) * half;                                \
        const T_ *restrict s = sin_table + (b * length + p) * half;                                \
        for (int64_t h = 0; h < heads; h++) {                                                      \
            const T_ *restrict in = x + b * layout[0] + h * layout[1] + m * layout[2];             \
            T_ *restrict o = out + ((b * heads + h) * count + m) * dim;                            \
            for (int64_t i = 0; i < half; i++) {                                                   \
                const T_ low = in[i], high = in[i + half], sine = flip * s[i];                     \
                o[i] = low * c[i] - high * sine;                                                   \
                o[i + half] = high * c[i] + low * sine;                                            \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

DEFINE_ROTARY(f32, float)
DEFINE_ROTARY(f64, double)
