/* Fused CPU kernels for causal expanding attention (ops/expanding/op.py), one query at a time.
 *
 * Why: the PyTorch fast path runs each mean-field step as ~ten elementwise passes over a band of
 * block rows, rounded up to 64-key rings and to the block's largest horizon. Per query, the work
 * the paper counts — scores of the keys inside the horizon, reused across steps, one softmax per
 * step — fits in a loop over a buffer of at most T scores, with no band and no padding.
 *
 * Semantics (the reference, expanding_attention_reference, causal, no key padding): per query i,
 * with context i + 1,
 *   for t in 0 .. max_iters - 1 while active:
 *     H = clamp(ceil(log(tol) / log1p(-min(q_t, 1 - 1e-7))), 1, i + 1),  q_t = a / (a + b)
 *     stop = (t > 0 and H <= previous) or H >= i + 1 or t == max_iters - 1
 *     if not stop: a += 1, b += E_p[δ] with p = softmax over δ < H of s_δ·scale + δ·log(b / (a + b))
 *     previous = H, active = not stop
 * The final horizon H and the counts (steps, Σ E[δ]) come back; the final pass (band_attend_* in
 * band_kernels.c, and its backward here) runs with log_decay computed in PyTorch from the
 * learnable α, β.
 * Layouts: q, k [BH, T, d], v [BH, T, e], alpha/beta per head [H], contiguous.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#define SUFFIX f32
#define T_ float
#define LOG logf
#define LOG1P log1pf
#define CEIL ceilf
#include "expanding_impl.h"
#undef SUFFIX
#undef T_
#undef LOG
#undef LOG1P
#undef CEIL
#define SUFFIX f64
#define T_ double
#define LOG log
#define LOG1P log1p
#define CEIL ceil
#include "expanding_impl.h"
#undef SUFFIX
#undef T_
#undef LOG
#undef LOG1P
#undef CEIL
