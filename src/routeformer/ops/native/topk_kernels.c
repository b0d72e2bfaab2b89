/* Fused CPU kernels for top-k routed attention (ADSR): routing selection and the gathered
 * attention, forward and backward. Loaded by routeformer/ops/native/__init__.py (compiled once per machine with
 * the system C compiler, called through ctypes); the PyTorch code in topk_routing.py and
 * gathered.py is the reference they are tested against, and the fallback.
 *
 * Why: in eager PyTorch the routing scores of one block of queries are written to memory, then
 * read again by amax, topk (~5 ns per value on this CPU) and gathers. Here each block of QB
 * queries scores V keys at a time in registers and keeps, per query, a buffer of candidates that
 * beat a running threshold (the m-th best score seen at the last flush); a vectorised test drops
 * a tile unless some score beats it, which after the first few hundred keys is rare. Nothing of
 * size T x S exists, no score is stored, and the memory traffic is the keys, once per block.
 *
 * Layouts (all contiguous, row-major): rq [BR, T, r]; rkt [BR, stride / V, r, V]: the keys in
 * tiles of V, each tile transposed (r rows of V keys) and contiguous, zero-padded to stride = S
 * rounded up to V. (A plain [r, S] transpose puts a tile's r rows 4·S bytes apart, all in one L1
 * set: measured 2x slower.) key_mask [B, S] (1 = real key) or NULL; outputs
 * index [BR, T, slots] (int64) and valid [BR, T, slots] (uint8). Batch of row bh: bh / R.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* A tile of QB queries x V keys is scored in registers: each key vector load feeds QB
 * multiply-adds. 6 x 16 was the fastest measured on AVX-512 (AMD EPYC): 42-46 G multiply-adds/s
 * per core against 12 for 8 x 16, which runs out of registers. */
#define QB 6
#define V 16
#define MAX_SLOTS 1024

/* Candidate buffer of one query: every eligible key scoring above `threshold` is appended; when
 * the buffer is full, a quickselect keeps its m best and raises the threshold to the m-th best
 * score. Keys dropped on the way had m better ones, so the m best overall stay in the buffer. This
 * costs a store per candidate; a min-heap (an exact threshold, half the candidates, but a sift
 * per candidate) was measured 10-15% slower end to end, and so were a sampled-pivot flush that
 * skips the exact select and a ping-pong select on scores alone.
 * Ties: among equal scores the lower key index wins (the rule of route_topk's PyTorch path and
 * reference, so all three select the same set). Keys are scanned in increasing index by default,
 * so a later key whose score only equals the threshold loses to the one holding it: the strict `>`
 * test is exact; inside a flush, only the pivot class that straddles the m-th place needs ordering
 * by key (every other split separates strictly), so the tie rule costs nothing on rows without
 * ties. `newest_first` scans the tiles in decreasing index instead, for routers whose scores grow
 * with the key position (the topk layer's recency term): the newest keys then set a high threshold
 * at the first flush, where an oldest-first scan meets a better key in nearly every tile and
 * appends and flushes all the way. A later (lower) key that equals the threshold must then win, so
 * that scan tests `>=` (ties go through the flush's key order); on rows whose scores all tie it
 * appends every key, which is why it is an option and not the default. */
#define DEFINE_SELECT(T_)                                                                          \
/* Reorder the n candidates of equal score so that the m lowest keys come first (quickselect on   \
 * the key, branchless partition as below). */                                                    \
static void lowest_keys_##T_(T_ *score, int64_t *key, int64_t n, int64_t m) {                      \
    int64_t lo = 0, hi = n;                                                                        \
    while (hi - lo > 1) {                                                                          \
        int64_t x = key[lo], y = key[lo + (hi - lo) / 2], z = key[hi - 1];                         \
        int64_t pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));     \
        int64_t split = lo; /* [lo, split): keys < pivot (keys are distinct) */                    \
        for (int64_t e = lo; e < hi; e++) {                                                        \
            T_ s = score[e]; int64_t k = key[e];                                                   \
            score[e] = score[split]; key[e] = key[split];                                          \
            score[split] = s; key[split] = k;                                                      \
            split += k < pivot;                                                                    \
        }                                                                                          \
        if (m <= split) { hi = split; continue; }                                                  \
        for (int64_t e = split; e < hi; e++) /* the pivot to place split: [lo, split] done */      \
            if (key[e] == pivot) {                                                                 \
                T_ s = score[e]; score[e] = score[split]; key[e] = key[split];                     \
                score[split] = s; key[split] = pivot;                                              \
                break;                                                                             \
            }                                                                                      \
        if (m == split + 1) return;                                                                \
        lo = split + 1;                                                                            \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Reorder so that the m largest scores come first (unordered; among equal scores the lower keys);\
 * returns the m-th largest. Quickselect with a branchless partition: the comparisons are          \
 * unpredictable, and a mispredicted branch per element cost more than the select itself. */      \
static T_ keep_best_##T_(T_ *score, int64_t *key, int64_t n, int64_t m) {                          \
    int64_t lo = 0, hi = n; /* the m-th largest lies in [lo, hi) */                                \
    while (hi - lo > 1) {                                                                          \
        int64_t mid = lo + (hi - lo) / 2;                                                          \
        T_ x = score[lo], y = score[mid], z = score[hi - 1];                                       \
        T_ pivot = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));          \
        int64_t split = lo; /* [lo, split): scores > pivot */                                      \
        for (int64_t e = lo; e < hi; e++) {                                                        \
            T_ s = score[e]; int64_t k = key[e];                                                   \
            score[e] = score[split]; key[e] = key[split];                                          \
            score[split] = s; key[split] = k;                                                      \
            split += s > pivot;                                                                    \
        }                                                                                          \
        if (m <= split) { hi = split; continue; }                                                  \
        int64_t equal = split; /* then [split, equal): scores == pivot */                         \
        for (int64_t e = split; e < hi; e++) {                                                     \
            T_ s = score[e]; int64_t k = key[e];                                                   \
            score[e] = score[equal]; key[e] = key[equal];                                          \
            score[equal] = s; key[equal] = k;                                                      \
            equal += s == pivot;                                                                   \
        }                                                                                          \
        if (m <= equal) { /* the m-th largest equals the pivot: the lower keys of the tie stay */  \
            if (m < equal) lowest_keys_##T_(score + split, key + split, equal - split, m - split); \
            break;                                                                                 \
        }                                                                                          \
        lo = equal;                                                                                \
    }                                                                                              \
    T_ least = score[0];                                                                           \
    for (int64_t e = 1; e < m; e++) least = score[e] < least ? score[e] : least;                   \
    return least;                                                                                  \
}

DEFINE_SELECT(float)
DEFINE_SELECT(double)
#if defined(__AVX2__)
#include "topk_compress_avx2.h" /* compress_lanes8: the permutation that packs an 8-bit mask's lanes */
int32_t route_compress_lut[256][8];

/* Filled when the library loads (before any thread can read it). */
__attribute__((constructor)) static void init_compress_lut(void) {
    for (int mask = 0; mask < 256; mask++) {
        int filled = 0;
        for (int lane = 0; lane < 8; lane++)
            if (mask & (1 << lane)) route_compress_lut[mask][filled++] = lane;
        for (; filled < 8; filled++) route_compress_lut[mask][filled] = 0;
    }
}
#endif
#include "topk_select_split.h" /* keep_best_float_split: a threshold split, in plain C */
#if defined(__AVX512F__)
#include "topk_select_avx512.h" /* keep_best_float_vector: the same split on 16 lanes */
#define KEEP_BEST_float keep_best_float_vector
#elif defined(__AVX2__)
#include "topk_select_avx2.h" /* keep_best_float_avx2: the same split on 8 lanes */
#define KEEP_BEST_float keep_best_float_avx2
#else
#define KEEP_BEST_float keep_best_float_split
#endif
#define KEEP_BEST_double keep_best_double

/* The flush, shared with the speculative routing kernel (topk_speculative_kernels.c). */
float route_topk_keep_best_f32(float *score, int64_t *key, int64_t n, int64_t m) {
    return KEEP_BEST_float(score, key, n, m);
}

static inline int is_forced(int64_t i, int64_t j, int64_t local_window, int64_t global_tokens) {
    return (j <= i && j > i - local_window) || j < global_tokens;
}

/* Scores of the QB queries against the V keys of one tile (keys_at[d * V + c]) into tile, and per
 * query the bitmask of scores above its threshold (or equal to it, when `inclusive`). */
#define DEFINE_TILE(T_)                                                                            \
static inline void score_tile_##T_(T_ query[QB][64], const T_ *keys_at,                           \
                                   int64_t dim, const T_ *threshold, int inclusive,                \
                                   T_ tile[QB][V], uint32_t hits[QB]) {                            \
    for (int a = 0; a < QB; a++)                                                                   \
        for (int c = 0; c < V; c++) tile[a][c] = 0;                                                \
    for (int64_t d = 0; d < dim; d++) {                                                            \
        const T_ *key_row = keys_at + d * V;                                                  \
        for (int a = 0; a < QB; a++)                                                               \
            for (int c = 0; c < V; c++) tile[a][c] += query[a][d] * key_row[c];                    \
    }                                                                                              \
    for (int a = 0; a < QB; a++) {                                                                 \
        uint32_t bits = 0;                                                                         \
        for (int c = 0; c < V; c++)                                                                \
            bits |= (uint32_t)(inclusive ? tile[a][c] >= threshold[a] : tile[a][c] > threshold[a]) << c; \
        hits[a] = bits;                                                                            \
    }                                                                                              \
}

DEFINE_TILE(double)
#include "topk_score_tile.h" /* score_tile_float: AVX-512 or AVX2 + FMA */
#if !defined(HAVE_SCORE_TILE_FLOAT)
DEFINE_TILE(float)
#endif

/* Append the scores tile_row[c] and keys j0 + c of the set bits c of `bits` to a candidate
 * buffer holding `count`; returns the new count. The buffer must have V free entries. */
#define DEFINE_APPEND(T_)                                                                          \
static inline int64_t append_hits_##T_(T_ *score, int64_t *key, int64_t count, const T_ *tile_row, \
                                       uint32_t bits, int64_t j0) {                                \
    for (; bits; bits &= bits - 1) {                                                               \
        int c = __builtin_ctz(bits);                                                               \
        score[count] = tile_row[c];                                                                \
        key[count++] = j0 + c;                                                                     \
    }                                                                                              \
    return count;                                                                                  \
}

DEFINE_APPEND(double)
#if defined(__AVX2__)
/* AVX2: each 8-key half of the tile is compressed with a permutation looked up by its 8-bit mask
 * (topk_compress_avx2.h) and stored whole (the unused tail is overwritten later): no branch per
 * key, where the loop above mispredicts on every unpredictable bit. */
static inline int64_t append_hits_float(float *score, int64_t *key, int64_t count,
                                        const float *tile_row, uint32_t bits, int64_t j0) {
    for (int half = 0; half < 2; half++) {
        uint32_t mask = (bits >> (8 * half)) & 0xFF;
        if (!mask) continue;
        compress_store_ps8(score + count, _mm256_loadu_ps(tile_row + 8 * half), mask);
        compress_store_index8(key + count, compress_lanes8(mask), j0 + 8 * half);
        count += __builtin_popcount(mask);
    }
    return count;
}
#else
DEFINE_APPEND(float)
#endif

#define ROUTE_PREFETCH_TILES 16 /* see topk_route_impl.h */
#define ROUTE_PREFETCH_ABOVE (1 << 20)
#define NAME route_topk_f32
#define T_ float
#include "topk_route_impl.h"
#undef NAME
#undef T_
#define NAME route_topk_f64
#define T_ double
#include "topk_route_impl.h"
#undef NAME
#undef T_

/* Largest slot count (per-row logits of the attention kernel) and routing dim (query tile). */
int64_t route_topk_max_slots(void) { return MAX_SLOTS; }
int64_t route_topk_max_dim(void) { return 64; }

/* out[bh, t] = softmax over valid slots of (q · k[index]) * scale, applied to v[index]; lse the
 * log-sum-exp of the valid logits (-inf for a row with none, whose output is zeros).
 * q [BH, T, d], k [BH, S, d], v [BH, S, e]; index/valid of row (b, h) start at
 * b * index_batch_stride + h * index_head_stride (the head stride is 0 when all heads share one
 * routing), each row of K slots contiguous. */
#define DEFINE_ATTEND(NAME, T_, LOG)                                                          \
void NAME(const T_ *q, const T_ *k, const T_ *v, const int64_t *index, const uint8_t *valid,      \
          int64_t batch, int64_t heads, int64_t length, int64_t keys, int64_t dim,                 \
          int64_t value_dim, int64_t slots, int64_t index_batch_stride,                            \
          int64_t index_head_stride, double scale, T_ *out, T_ *lse, int threads) {               \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                              \
    for (int64_t row = 0; row < batch * heads * length; row++) {                                  \
        int64_t bh = row / length, t = row % length;                                               \
        int64_t b = bh / heads, h = bh % heads;                                                    \
        int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;              \
        const int64_t *row_index = index + offset;                                                 \
        const uint8_t *row_valid = valid + offset;                                                 \
        const T_ *query = q + row * dim;                                                           \
        const T_ *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;         \
        T_ logits[MAX_SLOTS];                                                                           \
        T_ best = -INFINITY;                                                                       \
        for (int64_t e = 0; e < slots; e++) {                                                      \
            if (e + PREFETCH_AHEAD < slots)                                                        \
                prefetch_row(key_base + row_index[e + PREFETCH_AHEAD] * dim, dim * sizeof(T_));    \
            if (!row_valid[e]) { logits[e] = -INFINITY; continue; }                               \
            const T_ *key = key_base + row_index[e] * dim;                                         \
            T_ dot = dot_##T_(query, key, dim);                                                    \
            logits[e] = dot * (T_)scale;                                                           \
            if (logits[e] > best) best = logits[e];                                                \
        }                                                                                          \
        T_ *restrict result = out + row * value_dim;                                               \
        for (int64_t c = 0; c < value_dim; c++) result[c] = 0;                                     \
        if (best == -INFINITY) { lse[row] = -INFINITY; continue; }                                 \
        /* the weights exp(logit − best) on vector lanes; invalid slots then get 0 */              \
        for (int64_t e = 0; e < slots; e++) if (!row_valid[e]) logits[e] = best;                   \
        exp_sum_##T_(logits, slots, best);                                                         \
        T_ total = 0;                                                                              \
        for (int64_t e = 0; e < slots; e++) {                                                      \
            if (e + PREFETCH_AHEAD < slots)                                                        \
                prefetch_row(value_base + row_index[e + PREFETCH_AHEAD] * value_dim,               \
                             value_dim * sizeof(T_));                                              \
            if (!row_valid[e]) continue;                                                           \
            T_ weight = logits[e];                                                                 \
            total += weight;                                                                       \
            const T_ *restrict value = value_base + row_index[e] * value_dim;                      \
            for (int64_t c = 0; c < value_dim; c++) result[c] += weight * value[c];                \
        }                                                                                          \
        for (int64_t c = 0; c < value_dim; c++) result[c] /= total;                                \
        lse[row] = best + LOG(total);                                                              \
    }                                                                                              \
}

#if defined(__AVX512F__)
#include "topk_attend_avx512.h" /* the float32 pair on sixteen slots at a time */
#elif defined(__AVX2__) && defined(__FMA__)
#include "topk_attend_avx2.h" /* the float32 pair on eight slots at a time */
#else
DEFINE_ATTEND(routed_attention_f32, float, logf)
#endif
DEFINE_ATTEND(routed_attention_f64, double, log)

/* Keys per scoring tile: the routing keys must be zero-padded to a multiple of it. */
/* Queries [i0, i0 + nq) of one routing row by the tiled fp32 scan (forward), in blocks of QB:
 * the speculative kernel's exact fallback (topk_speculative_kernels.c). rq [T, r]; rkt the row's
 * keys in this file's tile layout (whole tiles of V keys, zero-padded); index, valid the row's
 * [T, slots] outputs; buffer_scores, buffer_keys hold QB x (4·slots + V) entries. */
void route_topk_f32_exact_block(const float *rq, const float *rkt, const uint8_t *mask, int64_t keys,
                                int64_t dim, int64_t slots, int causal, int64_t local_window,
                                int64_t global_tokens, int64_t i0, int64_t nq, int64_t *index, uint8_t *valid,
                                float *buffer_scores, int64_t *buffer_keys) {
    int64_t stride = (keys + V - 1) / V * V;
    for (int64_t start = i0; start < i0 + nq; start += QB)
        route_topk_f32_block(rq, rkt, mask, keys, stride, dim, slots, causal, local_window, global_tokens, 0,
                             start, i0 + nq - start < QB ? i0 + nq - start : QB, index, valid, buffer_scores,
                             buffer_keys, 4 * slots + V);
}

int64_t route_topk_chunk(void) { return V; }
/* Queries per scoring tile. */
int64_t route_topk_query_tile(void) { return QB; }

/* The backward of routed_attention (same layouts): grad_q [BH, T, d]; grad_k [BH, S, d] and
 * grad_v [BH, S, e] must be zero on entry. Rows are recomputed from lse (no stored
 * probabilities): p = exp(q·k·scale − lse), dv += p·dout, ds = p·(dout·v − dout·out)·scale,
 * dq = Σ ds·k, dk += ds·q. Threads split the (batch, head) rows, so each key and value gradient
 * row has one writer and no atomics are needed. */
#define DEFINE_ATTEND_BACKWARD(NAME, T_, EXP)                                                      \
void NAME(const T_ *q, const T_ *k, const T_ *v, const int64_t *index, const uint8_t *valid,      \
          const T_ *out, const T_ *lse, const T_ *grad_out, int64_t batch, int64_t heads,          \
          int64_t length, int64_t keys, int64_t dim, int64_t value_dim, int64_t slots,             \
          int64_t index_batch_stride, int64_t index_head_stride, double scale, T_ *grad_q,         \
          T_ *grad_k, T_ *grad_v, int threads) {                                                   \
    _Pragma("omp parallel for num_threads(threads) schedule(dynamic, 1)")                          \
    for (int64_t bh = 0; bh < batch * heads; bh++) {                                               \
        int64_t b = bh / heads, h = bh % heads;                                                    \
        const T_ *key_base = k + bh * keys * dim, *value_base = v + bh * keys * value_dim;         \
        T_ *grad_key_base = grad_k + bh * keys * dim, *grad_value_base = grad_v + bh * keys * value_dim; \
        T_ prob[MAX_SLOTS], dlogit[MAX_SLOTS];                                                     \
        for (int64_t t = 0; t < length; t++) {                                                     \
            int64_t row = bh * length + t;                                                         \
            int64_t offset = b * index_batch_stride + h * index_head_stride + t * slots;          \
            const int64_t *row_index = index + offset;                                             \
            const uint8_t *row_valid = valid + offset;                                             \
            const T_ *restrict query = q + row * dim, *restrict dout = grad_out + row * value_dim; \
            T_ *restrict grad_query = grad_q + row * dim;                                          \
            for (int64_t c = 0; c < dim; c++) grad_query[c] = 0;                                   \
            if (lse[row] == -INFINITY) continue; /* no valid slot: no gradient */                 \
            T_ delta = dot_##T_(dout, out + row * value_dim, value_dim);                         \
            T_ row_lse = lse[row];                                                                 \
            /* Pass 1, loads only: every slot's logit and dout·v (independent dots overlap). */   \
            for (int64_t e = 0; e < slots; e++) {                                                  \
                if (e + PREFETCH_AHEAD < slots) {                                                  \
                    int64_t ahead = row_index[e + PREFETCH_AHEAD];                                 \
                    prefetch_row(key_base + ahead * dim, dim * sizeof(T_));                        \
                    prefetch_row(value_base + ahead * value_dim, value_dim * sizeof(T_));          \
                }                                                                                  \
                int64_t j = row_valid[e] ? row_index[e] : 0;                                       \
                prob[e] = dot_##T_(query, key_base + j * dim, dim) * (T_)scale - row_lse;          \
                dlogit[e] = dot_##T_(dout, value_base + j * value_dim, value_dim);                 \
            }                                                                                      \
            /* Pass 2: p = exp(logit − lse) on vector lanes (logit <= lse), then                   \
             * ds = p·(dout·v − delta)·scale; invalid slots get 0. */                              \
            exp_sum_##T_(prob, slots, (T_)0);                                                      \
            for (int64_t e = 0; e < slots; e++) {                                                  \
                T_ p = row_valid[e] ? prob[e] : (T_)0;                                             \
                prob[e] = p;                                                                       \
                dlogit[e] = p * (dlogit[e] - delta) * (T_)scale;                                   \
            }                                                                                      \
            /* Pass 3, the updates: dq = Σ ds·k, dk += ds·q, dv += p·dout. */                     \
            for (int64_t e = 0; e < slots; e++) {                                                  \
                if (!row_valid[e]) continue;                                                       \
                int64_t j = row_index[e];                                                          \
                const T_ *restrict key = key_base + j * dim;                                       \
                T_ p = prob[e], ds = dlogit[e];                                                    \
                T_ *restrict grad_value = grad_value_base + j * value_dim;                         \
                T_ *restrict grad_key = grad_key_base + j * dim;                                   \
                for (int64_t c = 0; c < value_dim; c++) grad_value[c] += p * dout[c];              \
                for (int64_t c = 0; c < dim; c++) grad_query[c] += ds * key[c];                    \
                for (int64_t c = 0; c < dim; c++) grad_key[c] += ds * query[c];                    \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
DEFINE_ATTEND_BACKWARD(routed_attention_backward_f32, float, expf)
#endif
DEFINE_ATTEND_BACKWARD(routed_attention_backward_f64, double, exp)
