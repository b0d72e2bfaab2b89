/* Template (included once per floating type, not a macro: compiler errors, warnings and debuggers
 * point at these lines): band_attend_<SUFFIX>: the query-blocked banded softmax pass (see
 * band_kernels.c).
 * band_kernels.c defines, before each #include, and undefines after:
 *   SUFFIX f32 or f64: the exported name's suffix
 *   T_     float or double
 * Names are built with RF_CAT (common.h): RF_CAT(name_, SUFFIX) is name_f32 or name_f64. */
#if !defined(SUFFIX) || !defined(T_)
#error "band_impl.h is a template: band_kernels.c defines SUFFIX, T_ before including it"
#endif
void RF_CAT(band_attend_, SUFFIX)(const T_ *q, const T_ *k, const T_ *v, const int64_t *layout,
                          const T_ *log_decay, const int64_t *horizon, const int64_t *positions,
                          int64_t rows,
                          int64_t queries, int64_t heads, int64_t length, int64_t dim,
                          int64_t value_dim, double scale, T_ *out, int threads) {
    const int64_t tiles = (length + BV - 1) / BV, blocks = (queries + BQ - 1) / BQ;
    T_ *key_tiles = malloc(sizeof(T_) * rows * tiles * dim * BV);
    _Pragma("omp parallel for num_threads(threads) schedule(static)")
    for (int64_t item = 0; item < rows * tiles; item++) {
        int64_t bh = item / tiles, first = (item % tiles) * BV;
        T_ *tile = key_tiles + item * dim * BV;
        for (int c = 0; c < BV; c++) {
            const T_ *key = first + c < length
                ? k + (bh / heads) * layout[0] + (bh % heads) * layout[1] + (first + c) * layout[2]
                : NULL;
            for (int64_t d = 0; d < dim; d++) tile[d * BV + c] = key ? key[d] : 0;
        }
    }
    _Pragma("omp parallel num_threads(threads)")
    {
        T_ *scores = malloc(sizeof(T_) * BQ * (tiles * BV + BV));
        T_ *block = malloc(sizeof(T_) * BQ * dim), *discard = malloc(sizeof(T_) * value_dim);
        T_ tile[BQ][BV];
        _Pragma("omp for schedule(dynamic, 4)")
        for (int64_t item = 0; item < rows * blocks; item++) {
            int64_t bh = item / blocks, m0 = (item % blocks) * BQ;
            int64_t count = queries - m0 < BQ ? queries - m0 : BQ;
            int64_t at[BQ], band[BQ], lo = INT64_MAX, hi = -1;
            for (int a = 0; a < BQ; a++) {
                band[a] = 0;
                memset(block + a * dim, 0, sizeof(T_) * dim);
                if (a >= count) continue;
                int64_t m = m0 + a, row = bh * queries + m;
                at[a] = positions ? positions[(bh / heads) * queries + m] : m;
                band[a] = horizon[row];
                memset(out + row * value_dim, 0, sizeof(T_) * value_dim);
                if (band[a] <= 0) { band[a] = 0; continue; }
                memcpy(block + a * dim, q + row * dim, sizeof(T_) * dim);
                lo = at[a] - band[a] + 1 < lo ? at[a] - band[a] + 1 : lo;
                hi = at[a] > hi ? at[a] : hi;
            }
            if (hi < 0) continue;
            int64_t t0 = lo / BV, t1 = hi / BV, span = (t1 - t0 + 1) * BV, base = t0 * BV;
            for (int64_t t = t0; t <= t1; t++) {
                RF_CAT(band_tile_, T_)(block, dim, key_tiles + (bh * tiles + t) * dim * BV, tile);
                for (int a = 0; a < BQ; a++)
                    memcpy(scores + a * span + (t - t0) * BV, tile[a], sizeof(T_) * BV);
            }
            /* Per query: softmax over its own band (δ = p − j, so the slope is −log_decay up to
             * a constant the softmax ignores), normalised, zero elsewhere in the block's range. */
            for (int a = 0; a < BQ; a++) {
                T_ *s = scores + a * span - base;
                if (!band[a]) { for (int64_t j = lo; j <= hi; j++) s[j] = 0; continue; }
                int64_t first = at[a] - band[a] + 1;
                T_ decay = log_decay[bh * queries + m0 + a];
                T_ best = RF_CAT(affine_max_, T_)(s + first, band[a], (T_)scale, -decay, s + first);
                T_ inverse = (T_)1 / RF_CAT(exp_sum_, T_)(s + first, band[a], best);
                for (int64_t j = first; j <= at[a]; j++) s[j] *= inverse;
                for (int64_t j = lo; j < first; j++) s[j] = 0;
                for (int64_t j = at[a] + 1; j <= hi; j++) s[j] = 0;
            }
            /* Three queries per pass over the values of their common range, VALUE_CHUNK keys at
             * a time for every query of the block: a long band (full-attention rows) would
             * otherwise stream its values from memory once per three queries and 32 columns.
             * The results accumulate across chunks (zeroed above). A missing third query repeats
             * the first into `discard`. */
            const T_ *values = v + (bh / heads) * layout[3] + (bh % heads) * layout[4];
            const T_ *weights[GROUPS][3];
            T_ *results[GROUPS][3];
            int64_t from[GROUPS], to[GROUPS];
            for (int g = 0; g < GROUPS; g++) {
                from[g] = INT64_MAX, to[g] = -1;
                for (int r = 0; r < 3; r++) {
                    int a = 3 * g + r < count ? 3 * g + r : 3 * g;
                    weights[g][r] = scores + a * span - base;
                    results[g][r] = 3 * g + r < count ? out + (bh * queries + m0 + a) * value_dim
                                                      : discard;
                    if (a >= count || !band[a]) continue;
                    from[g] = at[a] - band[a] + 1 < from[g] ? at[a] - band[a] + 1 : from[g];
                    to[g] = at[a] > to[g] ? at[a] : to[g];
                }
            }
            for (int64_t k0 = lo; k0 <= hi; k0 += VALUE_CHUNK) {
                int64_t k1 = k0 + VALUE_CHUNK - 1 < hi ? k0 + VALUE_CHUNK - 1 : hi;
                for (int g = 0; g < GROUPS; g++) {
                    int64_t first = from[g] > k0 ? from[g] : k0, last = to[g] < k1 ? to[g] : k1;
                    if (last < first) continue;
                    const T_ *chunk[3] = {weights[g][0] + first, weights[g][1] + first,
                                          weights[g][2] + first};
                    RF_CAT(band_rows3_, T_)(chunk, values + first * layout[5], layout[5],
                                        last - first + 1, value_dim, results[g]);
                }
            }
        }
        free(scores);
        free(block);
        free(discard);
    }
    free(key_tiles);
}
