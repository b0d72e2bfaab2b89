/* Template (included once per floating type): mita_causal_forward_<SUFFIX> and
 * mita_causal_backward_<SUFFIX>, causal MiTA's query side for training (see mita_train_kernels.c).
 * mita_train_kernels.c defines, before each #include, and undefines after:
 *   SUFFIX f32 or f64: the exported and helper names' suffix
 *   T_     float or double
 *   EXP_, LOG_  expf/logf or exp/log
 * Names are built with RF_CAT (common.h): RF_CAT(name_, SUFFIX) is name_f32 or name_f64. */
#if !defined(SUFFIX) || !defined(T_) || !defined(EXP_) || !defined(LOG_)
#error "mita_train_impl.h is a template: mita_train_kernels.c defines SUFFIX, T_, EXP_, LOG_ first"
#endif

/* MT_LANES values of T_ as one GCC/clang vector (unaligned, may alias T_). */
typedef T_ RF_CAT(mt_vec_, SUFFIX) __attribute__((vector_size(MT_LANES * sizeof(T_)), aligned(sizeof(T_)),
                                                  may_alias));
#define MT_VEC RF_CAT(mt_vec_, SUFFIX)

/* Σ_x w[x] · lines[x·stride + (0 .. MT_LANES)]: four independent FMA chains (one chain would wait
 * on each FMA's latency). */
static inline __attribute__((always_inline)) MT_VEC RF_CAT(mt_column_, SUFFIX)(
    const T_ *restrict w, const T_ *restrict lines, int64_t stride, int64_t count) {
    MT_VEC a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t x = 0;
    for (; x + 4 <= count; x += 4) {
        a0 += w[x] * *(const MT_VEC *)(lines + x * stride);
        a1 += w[x + 1] * *(const MT_VEC *)(lines + (x + 1) * stride);
        a2 += w[x + 2] * *(const MT_VEC *)(lines + (x + 2) * stride);
        a3 += w[x + 3] * *(const MT_VEC *)(lines + (x + 3) * stride);
    }
    for (; x < count; x++) a0 += w[x] * *(const MT_VEC *)(lines + x * stride);
    return (a0 + a1) + (a2 + a3);
}

/* s[j] = scale · query · key_j for j < padded (a multiple of MT_LANES) keys of a segment stored
 * transposed (key_j's component x at keys_t[x·stride + j]; the caller's layout has MT_LANES spare
 * columns, so the last chunk reads allocated memory): broadcast FMAs over whole vectors of keys,
 * no horizontal sums, no scalar tail. Entries from n on are set to −inf, as are keys with
 * ok[j] == 0. */
static inline __attribute__((always_inline)) void RF_CAT(mt_scores_, SUFFIX)(
    const T_ *restrict query, const T_ *restrict keys_t, int64_t stride, int64_t n, int64_t dim,
    T_ scale, const uint8_t *restrict ok, T_ *restrict s) {
    int64_t padded = MT_PADDED(n);
    for (int64_t j = 0; j < padded; j += MT_LANES)
        *(MT_VEC *)(s + j) = RF_CAT(mt_column_, SUFFIX)(query, keys_t + j, stride, dim) * scale;
    for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
    if (ok)
        for (int64_t j = 0; j < n; j++) s[j] = ok[j] ? s[j] : -INFINITY;
}

/* d[j] = Σ_x g[x] · rows_t[x·stride + j] for the padded count of j (the values' transposed copy). */
static inline __attribute__((always_inline)) void RF_CAT(mt_dots_, SUFFIX)(
    const T_ *restrict g, const T_ *restrict rows_t, int64_t stride, int64_t n, int64_t width,
    T_ *restrict d) {
    int64_t padded = MT_PADDED(n);
    for (int64_t j = 0; j < padded; j += MT_LANES)
        *(MT_VEC *)(d + j) = RF_CAT(mt_column_, SUFFIX)(g, rows_t + j, stride, width);
}

/* The largest of s[0 .. padded) (padded a multiple of MT_LANES): lane-wise maxima, then across. */
static inline __attribute__((always_inline)) T_ RF_CAT(mt_max_, SUFFIX)(const T_ *restrict s, int64_t padded) {
    T_ lane[MT_LANES];
    for (int u = 0; u < MT_LANES; u++) lane[u] = -INFINITY;
    for (int64_t i = 0; i < padded; i += MT_LANES)
        for (int u = 0; u < MT_LANES; u++) lane[u] = s[i + u] > lane[u] ? s[i + u] : lane[u];
    T_ top = -INFINITY;
    for (int u = 0; u < MT_LANES; u++) top = lane[u] > top ? lane[u] : top;
    return top;
}

/* acc[:] += Σ_j p[j] · rows[j, :] over n rows of width `width` (a vector of acc held in a register
 * over all the rows where width is a multiple of MT_LANES). */
static inline __attribute__((always_inline)) void RF_CAT(mt_rows_, SUFFIX)(
    const T_ *restrict p, const T_ *restrict rows, int64_t n, int64_t width, T_ *restrict acc) {
    if (width % MT_LANES == 0) {
        for (int64_t x = 0; x < width; x += MT_LANES) {
            MT_VEC s0 = *(const MT_VEC *)(acc + x), s1 = {0}, s2 = {0}, s3 = {0};
            int64_t j = 0;
            for (; j + 4 <= n; j += 4) {  /* four independent FMA chains */
                s0 += p[j] * *(const MT_VEC *)(rows + j * width + x);
                s1 += p[j + 1] * *(const MT_VEC *)(rows + (j + 1) * width + x);
                s2 += p[j + 2] * *(const MT_VEC *)(rows + (j + 2) * width + x);
                s3 += p[j + 3] * *(const MT_VEC *)(rows + (j + 3) * width + x);
            }
            for (; j < n; j++) s0 += p[j] * *(const MT_VEC *)(rows + j * width + x);
            *(MT_VEC *)(acc + x) = (s0 + s1) + (s2 + s3);
        }
        return;
    }
    for (int64_t j = 0; j < n; j++) {
        T_ w = p[j];
        if (w == 0) continue;
        const T_ *row = rows + j * width;
        for (int64_t x = 0; x < width; x++) acc[x] += w * row[x];
    }
}

/* acc[:] += Σ_{i = first}^{count − 1} w[i·stride] · rows[i, :] (a column of a block's weights
 * against the block's query or output-gradient rows; acc held in registers). */
static inline __attribute__((always_inline)) void RF_CAT(mt_columns_, SUFFIX)(
    const T_ *restrict w, int64_t stride, int64_t first, int64_t count, const T_ *restrict rows,
    int64_t width, T_ *restrict acc) {
    if (width % MT_LANES == 0) {
        for (int64_t x = 0; x < width; x += MT_LANES) {
            MT_VEC s0 = *(const MT_VEC *)(acc + x), s1 = {0};
            int64_t i = first;
            for (; i + 2 <= count; i += 2) {
                s0 += w[i * stride] * *(const MT_VEC *)(rows + i * width + x);
                s1 += w[(i + 1) * stride] * *(const MT_VEC *)(rows + (i + 1) * width + x);
            }
            for (; i < count; i++) s0 += w[i * stride] * *(const MT_VEC *)(rows + i * width + x);
            *(MT_VEC *)(acc + x) = s0 + s1;
        }
        return;
    }
    for (int64_t i = first; i < count; i++) {
        T_ weight = w[i * stride];
        for (int64_t x = 0; x < width; x++) acc[x] += weight * rows[i * width + x];
    }
}

/* The backward of one segment: p = exp(s − lse) (s recomputed), dp_j = dO · v_j (transposed
 * values), ds_j = p_j (dp_j − D); dq += scale Σ ds_j k_j, dk_j += scale ds_j q, dv_j += p_j dO. */
static inline __attribute__((always_inline)) void RF_CAT(mt_segment_backward_, SUFFIX)(
    const T_ *restrict query, const T_ *restrict grad_out, const T_ *restrict keys, const T_ *restrict keys_t,
    int64_t key_stride, const T_ *restrict values_t, int64_t value_stride, const uint8_t *restrict ok,
    int64_t n, int64_t dim, int64_t value_dim, T_ scale, T_ lse, T_ delta, T_ *restrict s,
    T_ *restrict dp, T_ *restrict grad_q, T_ *restrict grad_keys, T_ *restrict grad_values) {
    /* grad_keys == NULL: leave p in s and ds in dp for the caller's block-wise accumulation. */
    if (n == 0) return;
    RF_CAT(mt_scores_, SUFFIX)(query, keys_t, key_stride, n, dim, scale, ok, s);
    RF_CAT(mt_dots_, SUFFIX)(grad_out, values_t, value_stride, n, value_dim, dp);
    RF_CAT(exp_sum_, T_)(s, MT_PADDED(n), lse);  /* s <= lse: the vectorised exp of common.h */
    if (ok)  /* an excluded key weighs exactly 0 (the vectorised exp clamps at e^-87) */
        for (int64_t j = 0; j < n; j++) s[j] = ok[j] ? s[j] : 0;
    for (int64_t j = 0; j < n; j++) dp[j] = s[j] * (dp[j] - delta) * scale;
    RF_CAT(mt_rows_, SUFFIX)(dp, keys, n, dim, grad_q);  /* dq += Σ_j ds_j k_j */
    if (!grad_keys) return;
    for (int64_t j = 0; j < n; j++) {
        T_ p = s[j], ds = dp[j];
        if (p == 0) continue;
        T_ *grad_key = grad_keys + j * dim, *grad_value = grad_values + j * value_dim;
        for (int64_t x = 0; x < dim; x++) grad_key[x] += ds * query[x];
        for (int64_t x = 0; x < value_dim; x++) grad_value[x] += p * grad_out[x];
    }
}

/* One group (batch, head): every query's output and lse (forward). always_inline: called with
 * constant dims below, so the loops over d and e unroll into fixed vector code. */
static inline __attribute__((always_inline)) void RF_CAT(mt_group_forward_, SUFFIX)(
    const T_ *q, const T_ *k_t, const T_ *v, const T_ *landmark_t, const T_ *landmark_values,
    const T_ *expert_keys_t, const T_ *expert_values, const uint8_t *key_ok, const int64_t *assignment,
    int64_t length, int64_t experts, int64_t width, int64_t dim, int64_t value_dim, int64_t block,
    int64_t window, int64_t shared, T_ scale, T_ *scores, T_ *out, T_ *lse) {
    for (int64_t n = 0; n < length; n++) {
        int64_t c = n / block, base = c * block, local = n - base + 1;
        int64_t lo = c - window < 0 ? 0 : c - window, hi = c < experts ? c : experts;
        int64_t count_shared = shared && hi > lo ? hi - lo : 0;
        int64_t j = assignment[n], count_routed = j >= 0 ? width : 0;
        const T_ *query = q + n * dim;
        T_ *s_local = scores, *s_shared = scores + MT_PADDED(local), *s_routed = s_shared + MT_PADDED(count_shared);
        RF_CAT(mt_scores_, SUFFIX)(query, k_t + base, length + MT_LANES, local, dim, scale, 0, s_local);
        if (count_shared)
            RF_CAT(mt_scores_, SUFFIX)(query, landmark_t + lo, experts + MT_LANES, count_shared, dim, scale, 0,
                                       s_shared);
        if (count_routed)
            RF_CAT(mt_scores_, SUFFIX)(query, expert_keys_t + j * dim * (width + MT_LANES), width + MT_LANES, width, dim, scale,
                                       key_ok ? key_ok + j * width : 0, s_routed);
        int64_t total_count = MT_PADDED(local) + MT_PADDED(count_shared) + MT_PADDED(count_routed);
        T_ top = RF_CAT(mt_max_, SUFFIX)(scores, total_count);
        T_ total = RF_CAT(exp_sum_, T_)(scores, total_count, top);
        if (count_routed && key_ok) {  /* an excluded key weighs exactly 0 (the exp clamps at e^-87) */
            const uint8_t *ok = key_ok + j * width;
            for (int64_t i = 0; i < width; i++)
                if (!ok[i]) { total -= s_routed[i]; s_routed[i] = 0; }
        }
        T_ *row = out + n * value_dim;
        for (int64_t x = 0; x < value_dim; x++) row[x] = 0;
        RF_CAT(mt_rows_, SUFFIX)(s_local, v + base * value_dim, local, value_dim, row);
        if (count_shared)
            RF_CAT(mt_rows_, SUFFIX)(s_shared, landmark_values + lo * value_dim, count_shared, value_dim, row);
        if (count_routed)
            RF_CAT(mt_rows_, SUFFIX)(s_routed, expert_values + j * width * value_dim, width, value_dim, row);
        T_ inverse = 1 / total;  /* total >= 1: the query's own key is always read */
        for (int64_t x = 0; x < value_dim; x++) row[x] *= inverse;
        lse[n] = top + LOG_(total);
    }
}

/* The backward a block of queries at a time (block <= MT_BLOCKED): the queries of block c share
 * their own block's keys and their window's landmarks, so their weights p and score gradients ds
 * are kept for the whole block ([b, ·] scratch) and each key's (landmark's) gradient is summed
 * over the block's queries in registers and written once, instead of read-modified-written once
 * per query. The routed expert's keys (one expert per query) are updated per query. */
static inline __attribute__((always_inline)) void RF_CAT(mt_group_backward_, SUFFIX)(
    const T_ *q, const T_ *k, const T_ *k_t, const T_ *v_t, const T_ *landmark, const T_ *landmark_t,
    const T_ *landmark_values_t, const T_ *expert_keys, const T_ *expert_keys_t, const T_ *expert_values_t,
    const uint8_t *key_ok, const int64_t *assignment, const T_ *out, const T_ *lse, const T_ *grad_out,
    int64_t length, int64_t experts, int64_t width, int64_t dim, int64_t value_dim, int64_t block,
    int64_t window, int64_t shared, T_ scale, T_ *scores, T_ *dp, T_ *block_scratch, T_ *grad_q, T_ *grad_k,
    T_ *grad_v, T_ *grad_landmark, T_ *grad_landmark_values, T_ *grad_expert_keys, T_ *grad_expert_values) {
    int64_t local_stride = MT_PADDED(block), shared_stride = MT_PADDED(window);
    T_ *p_local = block_scratch, *ds_local = p_local + block * local_stride;
    T_ *p_shared = ds_local + block * local_stride, *ds_shared = p_shared + block * shared_stride;
    for (int64_t base = 0; base < length; base += block) {
        int64_t c = base / block, rows = length - base < block ? length - base : block;
        int64_t lo = c - window < 0 ? 0 : c - window, hi = c < experts ? c : experts;
        int64_t count_shared = shared && hi > lo ? hi - lo : 0;
        int64_t blocked = block_scratch != 0;
        for (int64_t i = 0; i < rows; i++) {
            int64_t n = base + i, local = i + 1;
            int64_t j = assignment[n], count_routed = j >= 0 ? width : 0;
            const T_ *query = q + n * dim, *gradient = grad_out + n * value_dim, *output = out + n * value_dim;
            T_ delta = 0;
            for (int64_t x = 0; x < value_dim; x++) delta += gradient[x] * output[x];
            T_ *gq = grad_q + n * dim;
            RF_CAT(mt_segment_backward_, SUFFIX)(
                query, gradient, k + base * dim, k_t + base, length + MT_LANES, v_t + base, length + MT_LANES, 0,
                local, dim, value_dim, scale, lse[n], delta, blocked ? p_local + i * local_stride : scores,
                blocked ? ds_local + i * local_stride : dp, gq, blocked ? 0 : grad_k + base * dim,
                grad_v + base * value_dim);
            if (count_shared)
                RF_CAT(mt_segment_backward_, SUFFIX)(
                    query, gradient, landmark + lo * dim, landmark_t + lo, experts + MT_LANES,
                    landmark_values_t + lo, experts + MT_LANES, 0, count_shared, dim, value_dim, scale, lse[n],
                    delta, blocked ? p_shared + i * shared_stride : scores,
                    blocked ? ds_shared + i * shared_stride : dp, gq, blocked ? 0 : grad_landmark + lo * dim,
                    grad_landmark_values + lo * value_dim);
            if (count_routed)
                RF_CAT(mt_segment_backward_, SUFFIX)(
                    query, gradient, expert_keys + j * width * dim, expert_keys_t + j * dim * (width + MT_LANES),
                    width + MT_LANES, expert_values_t + j * value_dim * (width + MT_LANES), width + MT_LANES,
                    key_ok ? key_ok + j * width : 0, width, dim, value_dim, scale, lse[n], delta, scores, dp, gq,
                    grad_expert_keys + j * width * dim, grad_expert_values + j * width * value_dim);
        }
        if (!blocked) continue;
        /* key j of the block is read by the block's queries i >= j */
        const T_ *block_q = q + base * dim, *block_g = grad_out + base * value_dim;
        for (int64_t j = 0; j < rows; j++) {
            RF_CAT(mt_columns_, SUFFIX)(ds_local + j, local_stride, j, rows, block_q, dim,
                                        grad_k + (base + j) * dim);
            RF_CAT(mt_columns_, SUFFIX)(p_local + j, local_stride, j, rows, block_g, value_dim,
                                        grad_v + (base + j) * value_dim);
        }
        for (int64_t m = 0; m < count_shared; m++) {  /* every query of the block reads the window */
            RF_CAT(mt_columns_, SUFFIX)(ds_shared + m, shared_stride, 0, rows, block_q, dim,
                                        grad_landmark + (lo + m) * dim);
            RF_CAT(mt_columns_, SUFFIX)(p_shared + m, shared_stride, 0, rows, block_g, value_dim,
                                        grad_landmark_values + (lo + m) * value_dim);
        }
    }
}

/* Scores per query: each segment rounded up to whole vectors. */
#ifndef MT_BLOCKED
#define MT_BLOCKED 256 /* the largest block whose [b, b + M] weights the backward keeps per block */
#endif
#define MT_SCRATCH (MT_PADDED(block) + MT_PADDED(window) + MT_PADDED(width) + MT_LANES)

/* Dispatch on (d, e) so that the common head sizes run with constant loop bounds. */
#define MT_DIMS(CALL)                                                                              \
    if (dim == 32 && value_dim == 32) { CALL(32, 32); }                                            \
    else if (dim == 64 && value_dim == 64) { CALL(64, 64); }                                       \
    else if (dim == 16 && value_dim == 16) { CALL(16, 16); }                                       \
    else { CALL(dim, value_dim); }

void RF_CAT(mita_causal_forward_, SUFFIX)(
    const T_ *q, const T_ *k_t, const T_ *v, const T_ *landmark_t, const T_ *landmark_values,
    const T_ *expert_keys_t, const T_ *expert_values, const uint8_t *key_ok, const int64_t *assignment,
    int64_t groups, int64_t length, int64_t experts, int64_t width, int64_t dim, int64_t value_dim,
    int64_t block, int64_t window, int64_t shared, double scale, T_ *out, T_ *lse, int threads) {
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int64_t g = 0; g < groups; g++) {
        T_ *scores = malloc(sizeof(T_) * MT_SCRATCH);
        const T_ *gq = q + g * length * dim, *gk_t = k_t + g * dim * (length + MT_LANES);
        const T_ *gv = v + g * length * value_dim;
        const T_ *gl_t = landmark_t + g * dim * (experts + MT_LANES), *glv = landmark_values + g * experts * value_dim;
        const T_ *gek_t = expert_keys_t + g * experts * dim * (width + MT_LANES);
        const T_ *gev = expert_values + g * experts * width * value_dim;
        const uint8_t *gok = key_ok ? key_ok + g * experts * width : 0;
        const int64_t *ga = assignment + g * length;
        T_ *gout = out + g * length * value_dim, *glse = lse + g * length;
#define MT_FORWARD(D, E)                                                                           \
        RF_CAT(mt_group_forward_, SUFFIX)(gq, gk_t, gv, gl_t, glv, gek_t, gev, gok, ga, length, experts, \
                                          width, D, E, block, window, shared, (T_)scale, scores, gout, glse)
        MT_DIMS(MT_FORWARD)
#undef MT_FORWARD
        free(scores);
    }
}

void RF_CAT(mita_causal_backward_, SUFFIX)(
    const T_ *q, const T_ *k, const T_ *k_t, const T_ *v_t, const T_ *landmark, const T_ *landmark_t,
    const T_ *landmark_values_t, const T_ *expert_keys, const T_ *expert_keys_t, const T_ *expert_values_t,
    const uint8_t *key_ok, const int64_t *assignment, const T_ *out, const T_ *lse, const T_ *grad_out,
    int64_t groups, int64_t length, int64_t experts, int64_t width, int64_t dim, int64_t value_dim,
    int64_t block, int64_t window, int64_t shared, double scale, T_ *grad_q, T_ *grad_k, T_ *grad_v,
    T_ *grad_landmark, T_ *grad_landmark_values, T_ *grad_expert_keys, T_ *grad_expert_values,
    int threads) {
    /* Every gradient is zero-filled by the caller; a group writes only its own slices. */
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")
    for (int64_t g = 0; g < groups; g++) {
        T_ *scores = malloc(sizeof(T_) * 2 * MT_SCRATCH);
        T_ *dp = scores + MT_SCRATCH;
        /* the block-wise pass's [b, ·] weights and score gradients (large blocks: per query) */
        T_ *block_scratch = block <= MT_BLOCKED
            ? malloc(sizeof(T_) * 2 * block * (MT_PADDED(block) + MT_PADDED(window))) : 0;
        int64_t nd = length * dim, ne = length * value_dim, ed = experts * dim, ee = experts * value_dim;
        int64_t ekd = experts * width * dim, eke = experts * width * value_dim;
        /* the transposed copies' group sizes (MT_LANES spare columns each) */
        int64_t nd_t = (length + MT_LANES) * dim, ne_t = (length + MT_LANES) * value_dim;
        int64_t ed_t = (experts + MT_LANES) * dim, ee_t = (experts + MT_LANES) * value_dim;
        int64_t ekd_t = experts * (width + MT_LANES) * dim, eke_t = experts * (width + MT_LANES) * value_dim;
        const uint8_t *gok = key_ok ? key_ok + g * experts * width : 0;
#define MT_BACKWARD(D, E)                                                                          \
        RF_CAT(mt_group_backward_, SUFFIX)(                                                        \
            q + g * nd, k + g * nd, k_t + g * nd_t, v_t + g * ne_t, landmark + g * ed,           \
            landmark_t + g * ed_t, landmark_values_t + g * ee_t, expert_keys + g * ekd,              \
            expert_keys_t + g * ekd_t, expert_values_t + g * eke_t, gok, assignment + g * length, out + g * ne, lse + g * length,  \
            grad_out + g * ne, length, experts, width, D, E, block, window, shared, (T_)scale, scores, dp, \
            block_scratch,                                                                         \
            grad_q + g * nd, grad_k + g * nd, grad_v + g * ne, grad_landmark + g * ed,             \
            grad_landmark_values + g * ee, grad_expert_keys + g * ekd, grad_expert_values + g * eke)
        MT_DIMS(MT_BACKWARD)
#undef MT_BACKWARD
        free(block_scratch);
        free(scores);
    }
}

#undef MT_DIMS
#undef MT_VEC
