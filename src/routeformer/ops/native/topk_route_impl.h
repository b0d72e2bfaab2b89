/* Template (included once per floating type, not a macro: compiler errors, warnings and debuggers
 * point at these lines): NAME (route_topk_f32 or route_topk_f64), the routing selection, and its
 * per-block helper NAME_block (see topk_kernels.c).
 * topk_kernels.c defines, before each #include, and undefines after:
 *   NAME   route_topk_f32 or route_topk_f64: the exported name
 *   T_     float or double
 * Names are built with RF_CAT (common.h): RF_CAT(NAME, _block) is route_topk_f32_block. */
#if !defined(NAME) || !defined(T_)
#error "topk_route_impl.h is a template: topk_kernels.c defines NAME, T_ before including it"
#endif

/* One block of queries [i0, i0 + nq) of routing row bh; rkt holds `stride` >= keys keys (whole
 * tiles, zero-padded). */
static void RF_CAT(NAME, _block)(const T_ *rq, const T_ *rkt, const uint8_t *mask, int64_t keys,
                         int64_t stride, int64_t dim, int64_t slots, int causal,
                         int64_t local_window, int64_t global_tokens, int newest_first,
                         int64_t i0, int64_t nq,
                         int64_t *index, uint8_t *valid, T_ *buffer_scores, int64_t *buffer_keys,
                         int64_t buffer) {
    T_ query[QB][64];
    int64_t count[QB], cap[QB]; /* candidates held, routed slots (slots minus forced keys) */
    int64_t forced[QB];
    int64_t end = causal ? i0 + nq : keys; /* keys this block can read */
    for (int64_t a = 0; a < QB; a++)
        for (int64_t d = 0; d < dim; d++) query[a][d] = a < nq ? rq[(i0 + a) * dim + d] : 0;
    for (int64_t a = 0; a < nq; a++) {
        int64_t i = i0 + a, taken = 0;
        int64_t *row_index = index + i * slots;
        /* Forced keys (window, global) that are eligible take their slots first. */
        int64_t first = local_window > 0 ? (i - local_window + 1 > 0 ? i - local_window + 1 : 0) : i + 1;
        for (int64_t j = 0; j < global_tokens && j < keys && taken < slots; j++)
            if ((!causal || j <= i) && (!mask || mask[j]) && !(j <= i && j >= first))
                row_index[taken++] = j;
        for (int64_t j = first; j <= i && j < keys && taken < slots; j++)
            if (!mask || mask[j]) row_index[taken++] = j;
        forced[a] = taken;
        cap[a] = slots - taken;
        count[a] = 0;
    }
    T_ threshold[QB]; /* a key is a candidate of query a only with a score above it */
    int simple = !mask && local_window == 0 && global_tokens == 0; /* every hit is a candidate */
    for (int64_t a = 0; a < QB; a++)
        threshold[a] = a < nq && cap[a] > 0 ? -INFINITY : INFINITY;
    int64_t tiles = (end + V - 1) / V;
    /* Software prefetch, ROUTE_PREFETCH_TILES tiles ahead in scan order, when the row's keys exceed
     * ROUTE_PREFETCH_ABOVE bytes: a decoding step (ops/topk/decode.py) scans every cached routing
     * key once for one query, and at 32k-64k keys they are not in the cache: there the prefetch
     * roughly halved a step's scan on a 2-core CPU (one query, 4 routing rows x 17 dims). Rows of at most 1 MB (16k keys x 16 dims: every
     * block of the parallel pass at T <= 16k) are scanned as before. */
    int prefetch = tiles * V * dim * (int64_t)sizeof(T_) > ROUTE_PREFETCH_ABOVE;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t j0 = (newest_first ? tiles - 1 - t : t) * V;
        if (prefetch && t + ROUTE_PREFETCH_TILES < tiles)
            prefetch_row(rkt + (newest_first ? tiles - 1 - t - ROUTE_PREFETCH_TILES : t + ROUTE_PREFETCH_TILES)
                               * V * dim, dim * V * (int64_t)sizeof(T_));
        T_ tile[QB][V];
        uint32_t hits[QB]; /* bit c: tile[a][c] beats threshold[a] (or ties it, newest_first) */
        RF_CAT(score_tile_, T_)(query, rkt + j0 * dim, dim, threshold, newest_first, tile, hits);
        for (int64_t a = 0; a < nq; a++) {
            uint32_t bits = hits[a];
            if (!bits) continue;
            T_ *buffer_score = buffer_scores + a * buffer;
            int64_t *buffer_key = buffer_keys + a * buffer, i = i0 + a;
            /* Keys past the sequence or (causal) after query i: clear their bits. */
            int64_t last = causal && i < keys - 1 ? i : keys - 1;
            if (last < j0 + V - 1)
                bits &= last < j0 ? 0u : (uint32_t)((1ull << (last - j0 + 1)) - 1);
            if (simple) {
                count[a] = RF_CAT(append_hits_, T_)(buffer_score, buffer_key, count[a], tile[a], bits, j0);
            } else {
                for (; bits; bits &= bits - 1) {
                    int64_t j = j0 + __builtin_ctz(bits);
                    if ((mask && !mask[j]) || is_forced(i, j, local_window, global_tokens)) continue;
                    buffer_score[count[a]] = tile[a][j - j0];
                    buffer_key[count[a]++] = j;
                }
            }
            /* The buffer keeps V spare entries beyond 4·slots, so a tile never overflows it. */
            if (count[a] >= buffer - V) {
                threshold[a] = RF_CAT(KEEP_BEST_, T_)(buffer_score, buffer_key, count[a], cap[a]);
                count[a] = cap[a];
            }
        }
    }
    for (int64_t a = 0; a < nq; a++) {
        int64_t i = i0 + a, filled = forced[a];
        int64_t *row_index = index + i * slots, *buffer_key = buffer_keys + a * buffer;
        uint8_t *row_valid = valid + i * slots;
        if (count[a] > cap[a])
            RF_CAT(KEEP_BEST_, T_)(buffer_scores + a * buffer, buffer_key, count[a], cap[a]);
        for (int64_t e = 0; e < count[a] && e < cap[a]; e++) row_index[filled++] = buffer_key[e];
        for (int64_t e = 0; e < filled; e++) row_valid[e] = 1;
        for (int64_t e = filled; e < slots; e++) { row_index[e] = 0; row_valid[e] = 0; }
    }
}

int64_t NAME(const T_ *rq, const T_ *rkt, const uint8_t *key_mask, int64_t rows, int64_t heads,
             int64_t length, int64_t keys, int64_t stride, int64_t dim, int64_t slots, int causal,
             int64_t local_window, int64_t global_tokens, int newest_first, int64_t *index,
             uint8_t *valid, int threads) {
    int64_t blocks = (length + QB - 1) / QB, scored = 0;
    _Pragma("omp parallel num_threads(threads) reduction(+:scored)")
    {
        /* Per query: 4 slots of candidates (a flush every >= 3·slots candidates). */
        int64_t buffer = 4 * slots + V;
        T_ *buffer_scores = malloc(sizeof(T_) * QB * buffer);
        int64_t *buffer_keys = malloc(sizeof(int64_t) * QB * buffer);
        _Pragma("omp for schedule(dynamic, 4)")
        for (int64_t task = 0; task < rows * blocks; task++) {
            int64_t bh = task / blocks, i0 = (task % blocks) * QB;
            int64_t nq = length - i0 < QB ? length - i0 : QB;
            const uint8_t *mask = key_mask ? key_mask + (bh / heads) * keys : NULL;
            RF_CAT(NAME, _block)(rq + bh * length * dim, rkt + bh * dim * stride, mask, keys, stride, dim,
                         slots, causal, local_window, global_tokens, newest_first, i0, nq,
                         index + bh * length * slots, valid + bh * length * slots,
                         buffer_scores, buffer_keys, buffer);
            /* Executed products: all QB rows of the tile, keys up to a whole tile. */
            scored += QB * (causal ? (i0 + nq + V - 1) / V * V : stride);
        }
        free(buffer_scores);
        free(buffer_keys);
    }
    return scored;
}
