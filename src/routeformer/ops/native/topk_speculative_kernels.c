/* Top-k routing selection for float32 and bfloat16 routing vectors: the same selection
 * as route_topk_f32 in topk_kernels.c (same scores, bit for bit, same tie rule), found with far
 * less work. Loaded by routeformer/ops/native/__init__.py; wrapped by ops/native/topk.py.
 *
 * Why: profiled at T=16384 (r=16, K=64, causal), route_topk_f32 spends ~15% of its time on the
 * score tiles and the rest on candidates: a query starts with no threshold, appends all of its
 * first 256 keys and then every key above a threshold that lags the true K-th best (674 appends
 * and 2.7 quickselect flushes per query). Two changes:
 *
 * 1. A speculative, verified threshold. Routing scores of one row grow smoothly with the number of
 *    keys, so a query's K-th best score is well predicted by |q| times the ratio (K-th best / |q|)
 *    of the block just routed, minus an adaptive slack. A key is a candidate iff its score is
 *    >= the guess. Exactness is kept by verification: if at least `cap` keys score >= the guess,
 *    every key of the true top `cap` does too, so all of them were collected; otherwise (rare) the
 *    query is routed again from scratch without a guess. The slack is tuned per block from the
 *    candidate counts (too many: shrink; a failure: grow), so speed depends on the data but the
 *    result never does.
 *    Threads take rows (B·R) whole, or, below MIN_TASKS rows, runs of a row's blocks fixed by the
 *    shape; each is routed from its first block by one thread, so the result, slot order included,
 *    is also the same on any number of threads.
 * 2. A bfloat16 prefilter with exact rescoring. Tiles are scored with AVX-512 BF16 pair dot
 *    products (_mm512_dpbf16_ps, ~1.5x the fp32 FMA rate measured here) on bf16 copies; a key
 *    passes if approx > threshold - margin, where margin bounds |approx - exact| (below), so the
 *    prefilter never drops a key the exact test keeps. Candidates are rescored exactly (fp32
 *    FMA chain over d in order, as route_topk_f32's tiles compute it) at each flush.
 *
 * Margin: with u = 2^-8 (bf16 rounding), |q~_d k~_d - q_d k_d| <= (2u + u^2)|q_d k_d|; the fp32
 * sums add <= 2·r·2^-24·Σ|q_d k_d| (r <= 64); Σ|q_d k_d| <= B = min(|q|·kmax, Σ_d |q_d|·max_j |k_jd|). So
 * |approx - exact| < 2^-6·B (a factor ~2 to spare, covering the norms' own rounding), plus
 * 2^-100·(1 + |q| + kmax) for the instruction's flushing of subnormal inputs and products. Rows
 * with non-finite or huge values (|q|, kmax >= 2^60) skip the prefilter (every key is rescored).
 *
 * 3. An exact fallback. A block is crowded when it appends more than EXACT_ABOVE x slots
 *    candidates a query and more than 1 / EXACT_SHARE of the keys it scanned; a task (a row, or a
 *    run of its blocks) with EXACT_AFTER crowded speculating blocks in a row is routed on from there by route_topk_f32's
 *    own fp32 tile scan (exact scores, forward, a key kept only if it beats the K-th best). Such
 *    rows have routing scores crowded within the bf16 margin of the K-th best: repeated vectors
 *    (a position-blind router's first layer reads only the token; 15 distinct routing keys at
 *    vocabulary 16) or near-repeats. Every crowded key passed the prefilter and was rescored; the
 *    exact scan drops a key that only ties the K-th best (ties go to the lower index, and the scan
 *    is forward). Measured on compare --long's T = 4096 recall model, one thread
 *    (scripts/blind_router_costs.py): route_topk on its first layer ~1070 ms before,
 *    ~70 ms after. One crowded block is a guess that lagged a change of scale (the slack then
 *    adapts); random vectors do not switch (tests/ops/test_topk_speculative.py).
 *
 * Layouts: rq [BR, T, r], rk [BR, S, r] row-major, float32 or bfloat16 (`bf16` = 1); key_mask
 * [B, S] (1 = real) or NULL; index [BR, T, slots] int64, valid [BR, T, slots] uint8; forced keys
 * first in a row, as route_topk_f32. Batch of row bh: bh / heads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

float route_topk_keep_best_f32(float *score, int64_t *key, int64_t n, int64_t m); /* topk_kernels.c */
void route_topk_f32_exact_block(const float *rq, const float *rkt, const uint8_t *mask, int64_t keys,
                                int64_t dim, int64_t slots, int causal, int64_t local_window,
                                int64_t global_tokens, int64_t i0, int64_t nq, int64_t *index, uint8_t *valid,
                                float *buffer_scores, int64_t *buffer_keys); /* topk_kernels.c */

/* Two prefilters, chosen by the instruction set the library is built for:
 * - AVX-512 BF16: the bf16 pair dot products of 2. above, with their margin.
 * - AVX2 + FMA, and AVX-512 without BF16 (16-lane tiles): the exact fp32 scores, from the fp32 key
 *   tiles, by route_topk_f32's own FMA chain (fmaf over d in order from 0: bit for bit
 *   exact_score). The margin is then 0 and the test `>=` (a key equal to the threshold may win its
 *   tie by key order at the flush); what these builds gain is 1. and 3.: at T = 16384 (r = 16,
 *   K = 64, causal, ROUTEFORMER_ISA=avx2, one thread) route_topk_f32 took 1.33 s, this 0.56 s.
 *   Each query's tile scores are stored where that query keeps its next hit tile (the entry is kept
 *   only if the tile hit), so its candidates are listed with their exact scores and never rescored,
 *   and a listing keeps only keys still >= the query's bound; a tile no query hit records nothing.
 *   Against the bitmaps and rescoring this replaced, same call on an AMD EPYC (AVX2), the two
 *   builds alternating in one process, medians of 7: 742 -> 583 ms on one thread, 363 -> 290 ms on
 *   two (the same selection).
 * The portable C level keeps route_topk_f32 (without FMA hardware its tiles round the product and
 * the sum apart, which fmaf here would not match bit for bit). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define WIDE 1     /* 16-lane tiles, mask registers and compress stores */
#else
#define WIDE 0
#endif
#if WIDE && defined(__AVX512BF16__)
#define PREFILTER_BF16 1
#define QB 8       /* queries per tile (accumulators); 6 and 12 measured within noise of 8 (loaded machine) */
#elif WIDE || (defined(__AVX2__) && defined(__FMA__))
#define PREFILTER_BF16 0
#define QB 6       /* queries per tile: route_topk_f32's (AVX2: 2 x 6 ymm accumulators, 2 keys, 1 broadcast) */
#endif
#define PREFILTER_EXACT (!PREFILTER_BF16)

#if defined(QB)
#include <immintrin.h>

#define V 16       /* keys per tile: one AVX-512 register (two AVX2 registers) of fp32 lanes */
#define MAX_DIM 64
#if !PREFILTER_BF16
#include "topk_score_tile.h" /* score_tile_float: the exact prefilter's tile */
#include "topk_compress_avx2.h" /* compress_store_ps8: listing a hit tile's keys without a branch a key */
#endif

static int64_t refuted_total; /* queries routed again since the library was loaded (tests read it) */
static int64_t exact_total;   /* tasks (rows or runs of blocks) switched to the exact scan (tests read it) */
#define EXACT_ABOVE 4         /* a block is crowded (see 3.) above EXACT_ABOVE x slots candidates a query */
#define EXACT_SHARE 8         /* ... and above 1 / EXACT_SHARE of the keys it scanned */
#define EXACT_AFTER 8         /* crowded blocks in a row after which the row switches */
#define MIN_TASKS 16          /* fewer rows than this are routed in runs of blocks, >= this many tasks */

int64_t route_topk_spec_available(void) { return 1; }
int64_t route_topk_spec_exact(void) { return !PREFILTER_BF16; } /* exact prefilter: no margin */
int64_t route_topk_spec_refuted(void) { return refuted_total; }
int64_t route_topk_spec_exact_rows(void) { return exact_total; }
int64_t route_topk_spec_query_tile(void) { return QB; }

/* One routing row, prepared once per call: exact fp32 rows and bf16 pairs [tiles, pairs, V]
 * (pair p of key c: dims 2p (low half) and 2p + 1, as _mm512_dpbf16_ps pairs them). */
typedef struct {
    const float *keys, *queries;           /* [S, r] fp32 keys (NULL when bf16), [T, r] fp32 queries */
    const uint16_t *keys_bf16;             /* [S, r] bf16 keys as stored (NULL when fp32) */
    const uint32_t *key_pairs, *query_pairs; /* [tiles, pairs, V], [T, pairs] */
    const float *key_tiles;                /* [tiles, r, V] fp32 keys, zero-padded: route_topk_f32's layout */
    float key_norm;                        /* max |k| (rounded up), +inf when unguarded */
    float key_max[MAX_DIM];                /* per dim: max over keys of |k_d| (rounded up) */
    int64_t num_keys, dim, pairs;
} Row;

/* A row's speculation state: ratio = min over the last block of (K-th best) / |q|. */
typedef struct { float ratio, slack; int crowded, exact; } Guess;

static inline float exact_score(const float *q, const float *k, int64_t dim) {
    float s = 0.0f; /* the lane order of route_topk_f32's tiles: bitwise the same score */
    for (int64_t d = 0; d < dim; d++) s = fmaf(q[d], k[d], s);
    return s;
}

static inline uint32_t pack_pair(uint16_t low, uint16_t high) { return (uint32_t)high << 16 | low; }

static inline int64_t is_forced(int64_t i, int64_t j, int64_t local_window, int64_t global_tokens) {
    return (j <= i && j > i - local_window) || j < global_tokens;
}

#if PREFILTER_BF16
/* Append keys j0 + c for the set bits c: compress in a register, store 16 (the buffer keeps V
 * spare entries), advance by the popcount. No branch per key. */
static inline int64_t append_keys(int64_t *key, int64_t count, uint32_t bits, int64_t j0) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i picked = _mm512_maskz_compress_epi32((__mmask16)bits, lanes);
    __m512i base = _mm512_set1_epi64(j0);
    _mm512_storeu_si512(key + count, _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(picked)), base));
    _mm512_storeu_si512(key + count + 8,
                        _mm512_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(picked, 1)), base));
    return count + __builtin_popcount(bits);
}
#endif

/* A key value of the row as fp32: bf16 keys are read as stored and widened (exactly). */
static inline float key_at(const Row *row, int64_t j, int64_t d) {
    return row->keys_bf16 ? bf16_to_float(row->keys_bf16[j * row->dim + d]) : row->keys[j * row->dim + d];
}

/* score[e] = the exact score of candidate key[e], e in [from, count): 8 candidates at a time, so
 * that 8 independent chains overlap (one at a time, each of the r dependent multiply-adds waits
 * for the last; measured: a 16-lane gather per dim was slower still). Each chain is exact_score's:
 * fmaf over d in order from 0, on the fp32 (or exactly widened bf16) values. (The exact prefilter
 * has its tiles' scores, kept with the hit tiles: it never rescores.) */
static void rescore(const Row *row, const float *query, float *score, const int64_t *key, int64_t from,
                    int64_t count) {
    int64_t e = from, dim = row->dim, bytes = dim * (row->keys_bf16 ? 2 : 4);
    const char *base = row->keys_bf16 ? (const char *)row->keys_bf16 : (const char *)row->keys;
    for (int64_t ahead = from; ahead < from + 8 && ahead < count; ahead++) prefetch_row(base + key[ahead] * bytes, bytes);
    for (; e + 8 <= count; e += 8) {
        float acc[8];
        /* the candidates are scattered over the row's keys: ask for the next 8 while these run */
        for (int64_t ahead = e + 8; ahead < e + 16 && ahead < count; ahead++)
            prefetch_row(base + key[ahead] * bytes, bytes);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) acc[c] = 0.0f;
        for (int64_t d = 0; d < dim; d++) {
            float q = query[d];
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) acc[c] = fmaf(q, key_at(row, key[e + c], d), acc[c]);
        }
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) score[e + c] = acc[c];
    }
    for (; e < count; e++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < dim; d++) acc = fmaf(query[d], key_at(row, key[e], d), acc);
        score[e] = acc;
    }
}

/* Rescore candidates [from, *count) exactly, keep the `cap` best (ties: lower key) and set *count
 * to how many are kept; returns the cap-th best exact score (-inf when fewer than cap). */
static float flush(const Row *row, const float *query, float *score, int64_t *key, int64_t from,
                   int64_t *count_at, int64_t cap) {
    int64_t count = *count_at, kept = from;
    if (!PREFILTER_EXACT) rescore(row, query, score, key, from, count); /* exact: listed with their scores */
    for (int64_t e = from; e < count; e++) { /* NaN and -inf never beat route_topk_f32's threshold */
        float s = score[e];
        score[kept] = s; key[kept] = key[e]; kept += s > -INFINITY;
    }
    count = kept;
    *count_at = count < cap ? count : cap;
    if (count > cap) return route_topk_keep_best_f32(score, key, count, cap);
    float least = INFINITY;
    for (int64_t e = 0; e < count; e++) least = score[e] < least ? score[e] : least;
    return count == cap ? least : -INFINITY;
}

/* A block's outputs and per-thread scratch: per query, `buffer` candidate scores and keys, and
 * the hits not yet listed: (bf16) a bitmap of `tiles` hit masks (bit c of tile t: key t·V + c), or
 * (exact) `entries` hit-tile entries, each a tile's V scores and t << 16 | its hit mask. */
typedef struct {
    int64_t *index; uint8_t *valid; float *scores; int64_t *keys; int64_t buffer; uint16_t *bits; int64_t tiles;
    float *tile_scores; int64_t *hit_tiles; int64_t entries;
} Out;

#if PREFILTER_BF16
/* Append the keys of the hit masks bits[from..to] to key[count..]; returns the new count. 32
 * tiles' masks are tested at once: only tiles with hits cost a step. */
static int64_t list_hits(const uint16_t *bits, int64_t from, int64_t to, int64_t *key, int64_t count) {
    for (int64_t t = from; t <= to; t += 32) {
        __mmask32 inside = to - t >= 31 ? 0xFFFFFFFFu : (__mmask32)((1u << (to - t + 1)) - 1);
        __m512i masks = _mm512_maskz_loadu_epi16(inside, bits + t);
        for (uint32_t nonzero = _mm512_test_epi16_mask(masks, masks); nonzero; nonzero &= nonzero - 1) {
            int64_t u = t + __builtin_ctz(nonzero);
            count = append_keys(key, count, bits[u], u * V);
        }
    }
    return count;
}
#else
/* Append the keys of query a's `used` hit tiles to key[count..], with the exact scores the tiles
 * computed: the keys that passed then (the entry's low 16 bits) and still score >= low, the query's
 * bound now (a key below it cannot be selected); returns the new count. Each 8-key half is packed
 * by a compress permutation and stored whole (V spare entries: see the buffer below): no branch per
 * key (a hit tile mostly holds one key, and a loop over its bits mispredicted its exit). */
static int64_t list_hit_tiles(const Out *out, int64_t a, int64_t used, float low, int64_t *key, float *score,
                              int64_t count) {
    const float *scores = out->tile_scores + a * out->entries * V;
    const int64_t *entries = out->hit_tiles + a * out->entries;
    __m256 bound = _mm256_set1_ps(low);
    for (int64_t u = 0; u < used; u++) {
        int64_t first_key = (entries[u] >> 16) * V;
        uint32_t passed = (uint32_t)entries[u];
        for (int half = 0; half < 2; half++) {
            __m256 tile = _mm256_loadu_ps(scores + u * V + 8 * half);
            uint32_t left = (passed >> (8 * half)) & (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(tile, bound, _CMP_GE_OQ));
            compress_store_ps8(score + count, tile, left);
            compress_store_index8(key + count, compress_lanes8(left), first_key + 8 * half);
            count += __builtin_popcount(left);
        }
    }
    return count;
}
#endif /* PREFILTER_BF16 */

/* List query a's hits since its last listing into its candidates: bf16, those of tiles first to
 * last in its bitmap (to be rescored); exact, its `used` hit tiles (scores included). */
static inline int64_t list_pending(const Out *out, int64_t a, int64_t first, int64_t last, int64_t used,
                                   float low, int64_t count) {
#if PREFILTER_BF16
    (void)used, (void)low;
    return list_hits(out->bits + a * out->tiles, first, last, out->keys + a * out->buffer, count);
#else
    (void)first, (void)last;
    return list_hit_tiles(out, a, used, low, out->keys + a * out->buffer, out->scores + a * out->buffer, count);
#endif
}

/* Query a's buffer is full: keep its cap best, verify its guess (refuted: stop the query, it is
 * routed again) and raise its prefilter bound to the new threshold. */
static void flush_full(const Row *row, Out *out, int64_t a, int64_t i, int64_t cap, float margin,
                       uint32_t *force_all, float *low, float *spec, int64_t *count, int64_t *rescored,
                       int64_t *appended, int *failed) {
    appended[a] += count[a] - rescored[a];
    float best = flush(row, row->queries + i * row->dim, out->scores + a * out->buffer,
                       out->keys + a * out->buffer, rescored[a], &count[a], cap);
    rescored[a] = count[a];
    if (spec[a] == -INFINITY || best >= spec[a]) spec[a] = -INFINITY; /* verified: cap keys >= it */
    else { failed[a] = 1; low[a] = INFINITY; force_all[a] = 0; count[a] = rescored[a] = 0; return; }
    if (!force_all[a]) low[a] = best - margin;
}

/* (exact) When a query flushes: after `limit` hit tiles held, aiming at about 4 x slots candidates a
 * flush (a speculating query's hit tiles mostly hold a key or two, so up to `entries` = 4 x slots of
 * them; a query without a bound yet takes every key of every tile: slots / 4 of them). The tile
 * loop compares each query's held tiles with the least limit of the block (one bound in a register:
 * a per-query one cost 3 %), and a query flushes when it holds its own. */
static inline int64_t first_limit(int64_t slots, int64_t entries) {
    int64_t limit = slots / 4;
    return limit < 1 ? 1 : limit < entries ? limit : entries;
}
static inline int64_t adapt_limit(int64_t held, int64_t listed, int64_t slots, int64_t entries) {
    int64_t limit = held * 4 * slots / (listed > 0 ? listed : 1);
    int64_t least = first_limit(slots, entries);
    return limit < least ? least : limit < entries ? limit : entries;
}

static inline int64_t least_limit(const int64_t *limit, int64_t nq, int64_t entries) {
    int64_t least = entries;
    for (int64_t a = 0; a < nq; a++) least = limit[a] < least ? limit[a] : least;
    return least;
}

/* Route queries [i0, i0 + nq) of one row. guess: speculate when ratio is a number. Per query:
 * kth[a] its cap-th best (-inf when it has fewer), appended[a] its candidate count, failed[a]
 * when the speculation was refuted (its output rows are then not written). Returns products. */
static int64_t route_block(const Row *row, const uint8_t *mask, int64_t slots, int causal,
                           int64_t local_window, int64_t global_tokens, int64_t i0, int64_t nq,
                           float ratio, float slack, Out *out, float *kth, int64_t *appended, int *failed) {
    int64_t count[QB], rescored[QB], cap[QB], forced[QB], dim = row->dim, keys = row->num_keys;
    int64_t pending[QB];    /* hits recorded and not yet listed, found (bf16) in the bitmap from */
    int64_t first_tile[QB]; /* first_tile on, or (exact) in the first `used` hit-tile entries */
    int64_t used[QB];
    int64_t limit[QB];      /* (exact) hit tiles held before a flush: see adapt_limit */
    float low[QB], spec[QB], margin[QB];
    uint32_t force_all[QB];
#if PREFILTER_BF16
    uint32_t query_pair[QB][MAX_DIM / 2];
#else
    float query_row[QB][MAX_DIM];
#endif
    for (int64_t a = 0; a < QB; a++) {
        low[a] = INFINITY; force_all[a] = 0; count[a] = rescored[a] = 0; cap[a] = 0; failed[a] = 0;
        spec[a] = -INFINITY; margin[a] = INFINITY; kth[a] = -INFINITY; appended[a] = 0; forced[a] = 0;
        pending[a] = first_tile[a] = used[a] = 0;
        limit[a] = out->entries;
#if PREFILTER_BF16
        for (int64_t p = 0; p < row->pairs; p++) query_pair[a][p] = a < nq ? row->query_pairs[(i0 + a) * row->pairs + p] : 0;
#else
        for (int64_t d = 0; d < dim; d++) query_row[a][d] = a < nq ? row->queries[(i0 + a) * dim + d] : 0;
#endif
        if (a >= nq) continue;
        int64_t i = i0 + a, taken = 0, *row_index = out->index + i * slots;
        int64_t first = local_window > 0 ? (i - local_window + 1 > 0 ? i - local_window + 1 : 0) : i + 1;
        for (int64_t j = 0; j < global_tokens && j < keys && taken < slots; j++)
            if ((!causal || j <= i) && (!mask || mask[j]) && !(j <= i && j >= first)) row_index[taken++] = j;
        for (int64_t j = first; j <= i && j < keys && taken < slots; j++)
            if (!mask || mask[j]) row_index[taken++] = j;
        forced[a] = taken;
        cap[a] = slots - taken;
        const float *query = row->queries + i * dim;
        float norm = sqrtf(exact_score(query, query, dim)) * (1.0f + 0x1p-20f);
        if (norm != norm) continue; /* a NaN query scores NaN: no routed key, as route_topk_f32 */
        int guarded = norm < 0x1p60f && row->key_norm < 0x1p60f;
#if PREFILTER_BF16
        /* Σ_d |q_d k_d| <= min(|q|·kmax, Σ_d |q_d|·max_j |k_jd|): the second is far tighter when one
         * dim dominates the key norms (a position feature: the layer's recency routing, where the
         * first made every key pass the prefilter and ran 2.8x slower than the plain kernel). */
        double per_dim = 0;
        for (int64_t d = 0; d < dim; d++) per_dim += fabs((double)query[d]) * row->key_max[d];
        float bound = fminf(norm * row->key_norm, (float)(per_dim * (1 + 0x1p-20)));
        margin[a] = guarded ? 0x1p-6f * bound + 0x1p-100f * (1.0f + norm + row->key_norm) : INFINITY;
        force_all[a] = guarded || slots == forced[a] ? 0 : 0xFFFFu; /* unguarded: approx may be inf or NaN */
#else
        margin[a] = 0; /* exact scores: nothing to widen, and no row needs every key forced in */
#endif
        /* Speculate only where the guess can hold: enough eligible keys beyond the forced ones. */
        int64_t eligible = causal ? i + 1 : keys;
        spec[a] = (ratio == ratio && guarded && eligible - taken >= 2 * cap[a]) ? norm * (ratio - slack) : -INFINITY;
        if (cap[a] > 0) low[a] = guarded ? spec[a] - margin[a] : -INFINITY;
        limit[a] = low[a] == -INFINITY ? first_limit(slots, out->entries) : out->entries;
    }
    int simple = !mask && local_window == 0 && global_tokens == 0;
    int64_t end = causal ? i0 + nq : keys;
    int64_t held_limit = least_limit(limit, nq, out->entries); /* the per-tile test's one bound */
    for (int64_t j0 = 0; j0 < end; j0 += V) {
        uint32_t hits[QB], any = 0; /* bit c of hits[a]: key j0 + c passes query a's prefilter */
#if PREFILTER_BF16
        const uint32_t *tile = row->key_pairs + (j0 / V) * row->pairs * V;
        __m512 acc[QB];
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) acc[a] = _mm512_setzero_ps();
        for (int64_t p = 0; p < row->pairs; p++) {
            __m512bh key = (__m512bh)_mm512_loadu_si512(tile + p * V);
#pragma GCC unroll 8
            for (int a = 0; a < QB; a++)
                acc[a] = _mm512_dpbf16_ps(acc[a], (__m512bh)_mm512_set1_epi32((int)query_pair[a][p]), key);
        }
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) {
            hits[a] = _mm512_cmp_ps_mask(acc[a], _mm512_set1_ps(low[a]), _CMP_GT_OQ) | force_all[a];
            any |= hits[a];
        }
#else
        /* route_topk_f32's own tile (topk_score_tile.h): exact fp32 scores, `>=` the bound. */
        float *into[QB]; /* each query's next hit-tile entry: kept only if the tile hits */
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) into[a] = out->tile_scores + (a * out->entries + used[a]) * V;
        score_tile_float_into(query_row, row->key_tiles + (j0 / V) * dim * V, dim, low, 1, into, hits);
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) any |= hits[a];
#endif
        if ((!simple || (causal && j0 + V > i0) || j0 + V > keys) && any) /* keys some query may not take */
            for (int64_t a = 0; a < nq; a++) {
                uint32_t bits = hits[a];
                int64_t i = i0 + a, last = causal && i < keys - 1 ? i : keys - 1; /* eligible keys end */
                if (last < j0 + V - 1) bits &= last < j0 ? 0u : (uint32_t)((1ull << (last - j0 + 1)) - 1);
                if (!simple)
                    for (uint32_t left = bits; left; left &= left - 1) {
                        int64_t j = j0 + __builtin_ctz(left);
                        if ((mask && !mask[j]) || is_forced(i, j, local_window, global_tokens)) bits &= ~(1u << (j - j0));
                    }
                hits[a] = bits;
            }
        /* Record the hits (bf16: in each query's bitmap; exact: by keeping the tile's entry) and
         * count them; keys are listed only at a flush. Whether a query, or any query, hits a tile
         * is a coin toss (a third of the tiles at T = 16384 have no hit): no branch on it here or
         * above (the edge test is read first), since a mispredicted one is resolved only when the
         * tile's multiply-adds are done and throws away the next tile's. A tile no query hit
         * keeps no entry (used[a] does not advance). */
        int64_t t = j0 / V;
        int full = 0;
#pragma GCC unroll 8
        for (int a = 0; a < QB; a++) {
#if PREFILTER_EXACT
            /* the tile's scores are in entry used[a]: kept (used advances) only when the tile hit;
             * a flush after limit[a] <= entries held (their keys, at most V an entry, fit the buffer) */
            out->hit_tiles[a * out->entries + used[a]] = t << 16 | hits[a];
            used[a] += hits[a] != 0;
            full |= used[a] >= held_limit;
#else
            out->bits[a * out->tiles + t] = (uint16_t)hits[a];
            pending[a] += __builtin_popcount(hits[a]);
            full |= count[a] + pending[a] >= out->buffer - 3 * V;
#endif
        }
        if (!full) continue;
        for (int64_t a = 0; a < nq; a++)
            if (PREFILTER_EXACT ? used[a] >= limit[a] : count[a] + pending[a] >= out->buffer - 3 * V) {
                int64_t before = count[a], held = used[a];
                count[a] = list_pending(out, a, first_tile[a], t, used[a], low[a], count[a]);
                limit[a] = adapt_limit(held, count[a] - before, slots, out->entries);
                pending[a] = used[a] = 0;
                first_tile[a] = t + 1;
                flush_full(row, out, a, i0 + a, cap[a], margin[a], force_all, low, spec, count, rescored, appended,
                           failed);
                if (failed[a]) limit[a] = out->entries; /* it holds no more tiles: not the block's bound */
            }
        held_limit = least_limit(limit, nq, out->entries);
    }
    int64_t last_tile = (end + V - 1) / V - 1;
    for (int64_t a = 0; a < nq; a++) {
        int64_t i = i0 + a, *key = out->keys + a * out->buffer;
        if (failed[a]) continue;
        count[a] = list_pending(out, a, first_tile[a], last_tile, used[a], low[a], count[a]);
        appended[a] += count[a] - rescored[a];
        kth[a] = flush(row, row->queries + i * dim, out->scores + a * out->buffer, key, rescored[a], &count[a], cap[a]);
        if (spec[a] > -INFINITY && !(count[a] == cap[a] && kth[a] >= spec[a])) { failed[a] = 1; continue; }
        int64_t *row_index = out->index + i * slots, filled = forced[a];
        uint8_t *row_valid = out->valid + i * slots;
        for (int64_t e = 0; e < count[a]; e++) row_index[filled++] = key[e];
        for (int64_t e = 0; e < filled; e++) row_valid[e] = 1;
        for (int64_t e = filled; e < slots; e++) { row_index[e] = 0; row_valid[e] = 0; }
    }
    return QB * ((end + V - 1) / V * V);
}

/* Pack one row: fp32 queries (widened when bf16; keys are read as stored), bf16 pairs of keys
 * (zero-padded tiles) and of queries, the guard's max key norm. */
static void prepare_row(const void *rq, const void *rk, int bf16, int64_t length, int64_t keys, int64_t dim,
                        float *wide_q, uint32_t *key_pairs, float *key_tiles, uint32_t *query_pairs, Row *row) {
    int64_t pairs = PREFILTER_BF16 ? (dim + 1) / 2 : 0; /* the exact prefilter reads key_tiles only */
    const uint16_t *half_q = rq, *half_k = rk;
    const float *qf = bf16 ? wide_q : rq, *kf = bf16 ? NULL : rk;
    for (int pass = 0; pass < 2 && pairs; pass++) {
        int64_t n = pass ? keys : length;
        const uint16_t *half = pass ? half_k : half_q;
        const float *full = pass ? kf : qf;
        for (int64_t t = 0; t < n; t++)
            for (int64_t p = 0; p < pairs; p++) {
                int64_t d = 2 * p;
                uint16_t low, high = 0;
                if (bf16) {
                    low = half[t * dim + d];
                    if (d + 1 < dim) high = half[t * dim + d + 1];
                } else {
                    low = float_to_bf16(full[t * dim + d]);
                    if (d + 1 < dim) high = float_to_bf16(full[t * dim + d + 1]);
                }
                uint32_t pair = pack_pair(low, high);
                if (pass) key_pairs[(t / V) * pairs * V + p * V + t % V] = pair;
                else query_pairs[t * pairs + p] = pair;
            }
    }
    if (bf16)
        for (int64_t e = 0; e < length * dim; e++) wide_q[e] = bf16_to_float(half_q[e]);
    *row = (Row){.keys = kf, .queries = qf, .keys_bf16 = bf16 ? half_k : NULL, .key_pairs = key_pairs,
                 .key_tiles = key_tiles, .query_pairs = query_pairs, .num_keys = keys, .dim = dim, .pairs = pairs};
    for (int64_t t = 0; t < keys; t++)
        for (int64_t d = 0; d < dim; d++) key_tiles[(t / V) * dim * V + d * V + t % V] = key_at(row, t, d);
    double largest = 0;
    for (int64_t t = 0; t < keys; t++) {
        double sum = 0;
        for (int64_t d = 0; d < dim; d++) sum += (double)key_at(row, t, d) * key_at(row, t, d);
        largest = sum > largest || sum != sum ? sum : largest; /* NaN sticks */
    }
    float norm = (float)(sqrt(largest) * (1 + 0x1p-20));
    row->key_norm = norm < 0x1p60f ? norm : INFINITY;
    for (int64_t d = 0; d < dim; d++) {
        float top = 0;
        for (int64_t t = 0; t < keys; t++) top = fmaxf(top, fabsf(key_at(row, t, d)));
        row->key_max[d] = top * (1 + 0x1p-20f);
    }
}

/* The next guess from a routed block: ratio = min (K-th best / |q|) over the block's queries that
 * kept their guess or had none; slack shrinks while candidates run above 2.5 x cap, grows by half
 * below 1.25 x cap and doubles on a refuted guess (whose query is routed again). */
static void update_guess(Guess *guess, const Row *row, int64_t i0, int64_t nq, const float *kth,
                         const int64_t *appended, const int *failed, int64_t slots) {
    float ratio = NAN;
    int64_t total = 0, refuted = 0;
    for (int64_t a = 0; a < nq; a++) {
        const float *query = row->queries + (i0 + a) * row->dim;
        float norm = sqrtf(exact_score(query, query, row->dim));
        refuted += failed[a];
        total += appended[a];
        if (!failed[a] && norm > 0 && isfinite(kth[a])) {
            float r = kth[a] / norm;
            ratio = ratio == ratio && ratio < r ? ratio : r;
        }
    }
    if (guess->ratio == guess->ratio) {
        if (refuted) guess->slack = 2 * guess->slack + 0x1p-10f * row->key_norm;
        else if (total > 5 * nq * slots / 2) guess->slack *= 0.75f;
        else if (total < 5 * nq * slots / 4) guess->slack *= 1.5f;
    }
    guess->ratio = ratio;
}

int64_t route_topk_spec(const void *rq, const void *rk, int bf16, const uint8_t *key_mask, int64_t rows,
                        int64_t heads, int64_t length, int64_t keys, int64_t dim, int64_t slots, int causal,
                        int64_t local_window, int64_t global_tokens, int64_t *index, uint8_t *valid, int threads) {
    if (dim > MAX_DIM || dim < 1) return -1;
    int64_t pairs = PREFILTER_BF16 ? (dim + 1) / 2 : 0, tiles = (keys + V - 1) / V, blocks = (length + QB - 1) / QB;
    int64_t parts = rows >= MIN_TASKS ? 1 : (MIN_TASKS + rows - 1) / rows; /* runs of blocks a row */
    if (parts > blocks) parts = blocks;
    int64_t per = (blocks + parts - 1) / parts; /* blocks a run */
    int64_t scored = 0;
    size_t element = bf16 ? 2 : 4;
    uint32_t *key_pairs = calloc((size_t)(rows * tiles * pairs * V) + 1, sizeof(uint32_t)); /* + 1: never NULL */
    float *key_tiles = calloc((size_t)(rows * tiles * dim * V), sizeof(float));
    uint32_t *query_pairs = malloc((size_t)(rows * length * pairs) * sizeof(uint32_t) + 1);
    float *wide_q = bf16 ? malloc((size_t)(rows * length * dim) * sizeof(float) + 1) : NULL;
    Row *row = malloc(sizeof(Row) * (size_t)rows);
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t bh = 0; bh < rows; bh++)
        prepare_row((const char *)rq + bh * length * dim * element, (const char *)rk + bh * keys * dim * element,
                    bf16, length, keys, dim, bf16 ? wide_q + bh * length * dim : NULL, key_pairs + bh * tiles * pairs * V,
                    key_tiles + bh * tiles * dim * V,
                    query_pairs + bh * length * pairs, &row[bh]);
    _Pragma("omp parallel num_threads(threads) reduction(+:scored)")
    {
        /* Per query (bf16): a flush at 4 slots of candidates (buffer - 3V), and spare entries: a
         * tile adds up to V - 1 beyond that, and listing a tile stores V keys. (exact): a flush after at
         * most 4 slots of hit tiles (adapt_limit), whose keys (at most V a tile, listed V at a time)
         * join the at most `slots` kept: no candidate count is tested per tile and query. */
        int64_t entries = 4 * slots, buffer = PREFILTER_EXACT ? slots + V * entries + V : 4 * slots + 3 * V;
        float *scores = malloc(sizeof(float) * QB * buffer);
        int64_t *buffer_keys = malloc(sizeof(int64_t) * QB * buffer);
        uint16_t *bits = PREFILTER_BF16 ? malloc(sizeof(uint16_t) * QB * (tiles + 1)) : NULL;
        float *tile_scores = PREFILTER_EXACT ? malloc(sizeof(float) * QB * entries * V) : NULL;
        int64_t *hit_tiles = PREFILTER_EXACT ? malloc(sizeof(int64_t) * QB * entries) : NULL;
        /* A task is a run of consecutive blocks of one row (the whole row when there are at least
         * MIN_TASKS rows), routed in order from a fresh guess. The runs depend on the shape alone, so
         * the guesses (and with them the flushes and the order of each query's slots) are the same
         * on any number of threads: blocks handed out as threads free up would continue other
         * blocks' guesses, listing the same keys in another order, which changes the attention's sums. */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < rows * parts; task++) {
            int64_t bh = task / parts, first = task % parts * per * QB, stop = first + per * QB;
            Guess guess = {.ratio = NAN, .slack = 0.25f * row[bh].key_norm, .crowded = 0, .exact = 0};
            const uint8_t *mask = key_mask ? key_mask + (bh / heads) * keys : NULL;
            Out out = {index + bh * length * slots, valid + bh * length * slots, scores, buffer_keys, buffer, bits,
                       tiles + 1, tile_scores, hit_tiles, entries};
            for (int64_t i0 = first; i0 < length && i0 < stop; i0 += QB) {
                int64_t nq = length - i0 < QB ? length - i0 : QB;
                if (guess.exact) { /* see 3.: the rest of this task's run by the exact scan */
                    route_topk_f32_exact_block(row[bh].queries, row[bh].key_tiles, mask, keys, dim, slots, causal,
                                               local_window, global_tokens, i0, nq, out.index, out.valid, scores,
                                               buffer_keys);
                    scored += QB * ((causal ? i0 + nq : keys) + V - 1) / V * V;
                    continue;
                }
                float kth[QB], kth_one[QB];
                int64_t appended[QB], appended_one[QB];
                int failed[QB], failed_one[QB];
                scored += route_block(&row[bh], mask, slots, causal, local_window, global_tokens, i0, nq,
                                      isfinite(guess.slack) ? guess.ratio : NAN, guess.slack, &out, kth, appended, failed);
                for (int64_t a = 0; a < nq; a++)
                    if (failed[a]) { /* the guess was too high: route this query again without one */
                        _Pragma("omp atomic")
                        refuted_total++;
                        scored += route_block(&row[bh], mask, slots, causal, local_window, global_tokens, i0 + a, 1,
                                              NAN, 0, &out, kth_one, appended_one, failed_one);
                    }
                if (guess.ratio == guess.ratio && isfinite(guess.slack)) { /* it speculated: is that paying? */
                    int64_t total = 0, eligible = 0;
                    for (int64_t a = 0; a < nq; a++) {
                        total += appended[a];
                        eligible += causal ? i0 + a + 1 : keys;
                    }
                    int crowded = total > EXACT_ABOVE * nq * slots && EXACT_SHARE * total > eligible;
                    guess.crowded = crowded ? guess.crowded + 1 : 0;
                    if (guess.crowded >= EXACT_AFTER) {
                        guess.exact = 1;
                        _Pragma("omp atomic")
                        exact_total++;
                    }
                }
                update_guess(&guess, &row[bh], i0, nq, kth, appended, failed, slots);
            }
        }
        free(scores);
        free(buffer_keys);
        free(bits);
        free(tile_scores);
        free(hit_tiles);
    }
    free(key_pairs); free(key_tiles); free(query_pairs); free(wide_q); free(row);
    return scored;
}

#else /* the portable level: ops/native/topk.py uses route_topk_f32 */
int64_t route_topk_spec_available(void) { return 0; }
int64_t route_topk_spec_exact(void) { return 0; }
int64_t route_topk_spec_refuted(void) { return 0; }
int64_t route_topk_spec_exact_rows(void) { return 0; }
int64_t route_topk_spec_query_tile(void) { return 1; }
int64_t route_topk_spec(const void *rq, const void *rk, int bf16, const uint8_t *key_mask, int64_t rows,
                        int64_t heads, int64_t length, int64_t keys, int64_t dim, int64_t slots, int causal,
                        int64_t local_window, int64_t global_tokens, int64_t *index, uint8_t *valid, int threads) {
    return -1;
}
#endif
