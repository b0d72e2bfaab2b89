/* Causal MiTA's query side for training, forward and backward, float32/float64
 * (ops/native/mita_train.py wraps them; the PyTorch twin is ops/mita/op.py's `_causal` parts:
 * local_causal_part + the shared window + routed_parts, merged by merge_partials).
 *
 * Why: the PyTorch path computes three partial softmaxes (own block, shared window, routed
 * expert), each through the blocked online softmax with its log-sum-exp, packs the routed queries
 * by expert (padding included) and merges the parts: a dozen passes over [N, d]-sized and
 * [N, 64]-sized temporaries per call, forward and backward, for ~4·N·(b + M + K)·d useful flops.
 * Here one pass per (batch, head) group reads each query in place, scores it against its own
 * block's earlier keys, its window's landmarks and its routed expert's keys under one softmax,
 * and writes its output row and lse; the backward recomputes the weights from the lse
 * (FlashAttention's backward) and accumulates every gradient in place.
 *
 * Semantics, per group g and query n in block c = n / b (b = block):
 *   local:   keys c·b .. n of k, v                                     (exact causal, own block)
 *   shared:  landmarks lo .. c − 1 (lo = max(0, c − window)), keys L, values V̂  (if `shared`)
 *   routed:  expert j = assignment[n] (j < 0: none): keys expert_keys[j], values expert_values[j],
 *            key_ok[j][i] == 0 excludes key i (key_ok may be NULL: every key)
 *   out[n] = Σ exp(s − m) value / Σ exp(s − m), s = scale · q[n] · key; lse[n] = m + log Σ exp(s − m).
 * The input must be unpadded (the op calls this only then): every query reads at least itself.
 * Layouts (contiguous, per group): q, k [N, d]; k_t [d, N]; v [N, e]; v_t [e, N]; landmark [E, d];
 * landmark_t [d, E]; landmark_values [E, e]; landmark_values_t [e, E]; expert_keys [E, K, d];
 * expert_keys_t [E, d, K]; expert_values [E, K, e]; expert_values_t [E, e, K]; key_ok [E, K];
 * assignment [N]; each transposed layout's last axis is followed by MT_LANES spare (zero)
 * columns: k_t [d, N + 16] and so on (the strides passed are those padded lengths). The transposed copies make every score a broadcast FMA over keys, every
 * gradient of a key or value row an FMA over its row. Threads split the groups (a group writes
 * only its own slices of the gradients: no races).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Keys are scored MT_LANES at a time (one 16-lane vector of floats); every transposed layout has
 * MT_LANES spare columns after its last key (zeros), so a segment's last vector stays in bounds. */
#define MT_LANES 16
#define MT_PADDED(n) (((n) + MT_LANES - 1) / MT_LANES * MT_LANES)

#define SUFFIX f32
#define T_ float
#define EXP_ expf
#define LOG_ logf
#include "mita_train_impl.h"
#undef SUFFIX
#undef T_
#undef EXP_
#undef LOG_
#define SUFFIX f64
#define T_ double
#define EXP_ exp
#define LOG_ log
#include "mita_train_impl.h"
#undef SUFFIX
#undef T_
#undef EXP_
#undef LOG_
