/* Template (included once per floating type, not a macro: compiler errors, warnings and debuggers
 * point at these lines): expanding_infer_<SUFFIX> and expanding_attend_backward_<SUFFIX> (see
 * expanding_kernels.c).
 * expanding_kernels.c defines, before each #include, and undefines after:
 *   SUFFIX f32 or f64: the exported names' suffix
 *   T_     float or double
 *   LOG    logf or log
 *   LOG1P  log1pf or log1p
 *   CEIL   ceilf or ceil
 * Names are built with RF_CAT (common.h): RF_CAT(name_, SUFFIX) is name_f32 or name_f64. */
#if !defined(SUFFIX) || !defined(T_) || !defined(LOG) || !defined(LOG1P) || !defined(CEIL)
#error "expanding_impl.h is a template: expanding_kernels.c defines SUFFIX, T_, LOG, LOG1P, CEIL before including it"
#endif
static inline int64_t RF_CAT(horizon_, SUFFIX)(T_ a, T_ b, T_ log_tol, int64_t context) {
    T_ q = a / (a + b);
    const T_ cap = (T_)(1.0 - 1e-7);
    T_ h = CEIL(log_tol / LOG1P(-(q < cap ? q : cap)));
    if (!(h >= 1)) h = 1;
    return h < (T_)context ? (int64_t)h : context;
}

/* logits[δ] = s[δ]·scale + δ·log_decay for δ < h, turned into unnormalised probabilities (the
 * helpers of common.h: 8 lanes at a time in fp32 with AVX2); returns their sum. */
static inline T_ RF_CAT(weights_, SUFFIX)(const T_ *s, int64_t h, T_ scale, T_ log_decay, T_ *w) {
    return RF_CAT(exp_sum_, T_)(w, h, RF_CAT(affine_max_, T_)(s, h, scale, log_decay, w));
}

/* The inference steps. Outputs per query: horizon, steps, distance_sum; counts[0] the q·k
 * products computed, counts[1] the softmax entries of the steps. */
void RF_CAT(expanding_infer_, SUFFIX)(const T_ *q, const T_ *k, const T_ *alpha, const T_ *beta,
                              int64_t rows, int64_t heads, int64_t length, int64_t dim, double tol,
                              int64_t max_iters, double scale, int64_t *horizon_out,
                              int64_t *steps_out, T_ *distance_out, int64_t *counts, int threads) {
    int64_t scored = 0, entries = 0;
    const T_ log_tol = (T_)log(tol);
    _Pragma("omp parallel num_threads(threads) reduction(+:scored, entries)")
    {
        T_ *s = malloc(sizeof(T_) * length), *w = malloc(sizeof(T_) * length);
        _Pragma("omp for schedule(dynamic, 16)")
        for (int64_t row = 0; row < rows * length; row++) {
            int64_t bh = row / length, i = row % length, context = i + 1;
            const T_ *query = q + row * dim, *key_base = k + bh * length * dim;
            const T_ alpha_start = alpha[bh % heads], beta_start = beta[bh % heads];
            T_ distance_sum = 0;
            int64_t steps = 0, previous = 0, computed = 0, h = 1;
            for (int64_t t = 0; t < max_iters; t++) {
                /* As the reference forms them: prior + counts, not running sums. */
                T_ a = alpha_start + (T_)steps, b = beta_start + distance_sum;
                h = RF_CAT(horizon_, SUFFIX)(a, b, log_tol, context);
                int stop = (t > 0 && h <= previous) || h >= context || t == max_iters - 1;
                previous = h;
                if (stop) break;
                for (; computed < h; computed++) { /* scores are kept for later steps */
                    if (computed + PREFETCH_AHEAD < context)
                        prefetch_row(key_base + (i - computed - PREFETCH_AHEAD) * dim, dim * sizeof(T_));
                    s[computed] = RF_CAT(dot_, T_)(query, key_base + (i - computed) * dim, dim);
                }
                T_ total = RF_CAT(weights_, SUFFIX)(s, h, (T_)scale, LOG(b) - LOG(a + b), w);
                T_ mean = RF_CAT(index_sum_, T_)(w, h);
                entries += h;
                distance_sum += mean / total;
                steps++;
            }
            scored += computed; /* the final pass scores its h keys again */
            horizon_out[row] = h;
            steps_out[row] = steps;
            distance_out[row] = distance_sum;
        }
        free(s);
        free(w);
    }
    counts[0] = scored;
    counts[1] = entries;
}

/* The final pass's backward (the forward is band_attend in band_kernels.c, query-blocked):
 * grad_q [BH, T, d], grad_log_decay [BH, T]; grad_k, grad_v zero on entry. Threads
 * split the (batch, head) rows, so every key and value gradient row has one writer. */
void RF_CAT(expanding_attend_backward_, SUFFIX)(const T_ *q, const T_ *k, const T_ *v, const T_ *log_decay,
                                        const int64_t *horizon, const T_ *out, const T_ *grad_out,
                                        int64_t rows, int64_t length, int64_t dim,
                                        int64_t value_dim, double scale, T_ *grad_q, T_ *grad_k,
                                        T_ *grad_v, T_ *grad_log_decay, int threads) {
    _Pragma("omp parallel num_threads(threads)")
    {
        T_ *s = malloc(sizeof(T_) * length), *w = malloc(sizeof(T_) * length);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t bh = 0; bh < rows; bh++) {
            const T_ *key_base = k + bh * length * dim, *value_base = v + bh * length * value_dim;
            T_ *grad_key_base = grad_k + bh * length * dim;
            T_ *grad_value_base = grad_v + bh * length * value_dim;
            for (int64_t i = 0; i < length; i++) {
                int64_t row = bh * length + i, h = horizon[row];
                const T_ *query = q + row * dim, *dout = grad_out + row * value_dim;
                for (int64_t d = 0; d < h; d++)
                    s[d] = RF_CAT(dot_, T_)(query, key_base + (i - d) * dim, dim);
                T_ total = RF_CAT(weights_, SUFFIX)(s, h, (T_)scale, log_decay[row], w);
                T_ delta = RF_CAT(dot_, T_)(dout, out + row * value_dim, value_dim);
                T_ *grad_query = grad_q + row * dim, grad_decay = 0;
                for (int64_t c = 0; c < dim; c++) grad_query[c] = 0;
                for (int64_t d = 0; d < h; d++) {
                    int64_t j = i - d;
                    T_ p = w[d] / total;
                    T_ ds = p * (RF_CAT(dot_, T_)(dout, value_base + j * value_dim, value_dim) - delta);
                    grad_decay += ds * (T_)d;
                    T_ *grad_value = grad_value_base + j * value_dim;
                    for (int64_t c = 0; c < value_dim; c++) grad_value[c] += p * dout[c];
                    T_ scaled = ds * (T_)scale;
                    const T_ *key = key_base + j * dim;
                    T_ *grad_key = grad_key_base + j * dim;
                    for (int64_t c = 0; c < dim; c++) grad_query[c] += scaled * key[c];
                    for (int64_t c = 0; c < dim; c++) grad_key[c] += scaled * query[c];
                }
                grad_log_decay[row] = grad_decay;
            }
        }
        free(s);
        free(w);
    }
}
