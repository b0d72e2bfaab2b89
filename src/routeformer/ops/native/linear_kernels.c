/* Causal linear attention (ops/linear/op.py: linear_attention, causal=True), forward and backward, one
 * sweep over chunks of `block` tokens per (batch, head) row with the d×e state as a running sum.
 *
 * Semantics, phi(x) = elu(x) + 1 (x + 1 for x > 0, else exp x), padded keys' phi_k and v zeroed:
 *   A = phi_q phi_kᵀ ∘ tril,  den_i = Σ_j A_ij + phi_q_i·z + eps,  out_i = (A v + phi_q S)_i / den_i
 * where S = Σ phi_k vᵀ [d, e] and z = Σ phi_k [d] run over the chunks before the query's own.
 * Backward, with dn = g / den and dg = −(g·out) / den (per row), P = (dn vᵀ + dg 1ᵀ) ∘ tril:
 *   d phi_q = P phi_k + dn Sᵀ + dg zᵀ,  d phi_k = Pᵀ phi_q + v Rᵀ + r,  d v = Aᵀ dn + phi_k R
 * with R = Σ phi_q dnᵀ [d, e], r = Σ dg phi_q over the chunks after the key's own; then
 * dq = d phi_q · phi'(q), dk = d phi_k · phi'(k) · mask, phi'(x) = 1 for x > 0, else exp x.
 * The backward is one sweep, last chunk first: the forward saves the state (S, z) before each
 * chunk (`states`, O((T/block)·d·e), the only thing kept besides out and den), and A and P are
 * recomputed per chunk rather than saved (they would be O(T·block)). A first version recomputed
 * S in a second sweep instead: ~25% slower (P twice, one more product per chunk, inputs read twice).
 * Scratch per thread: O(block·(d + e + block) + d·e), all in L2.
 *
 * Storage: fp32 or bf16 (`bf16` = 1) inputs, fp32 accumulation everywhere, outputs in the input's
 * storage. For bf16 inputs on a CPU with AVX-512 BF16 the d×e state products (phi_q S, S += phi_kᵀ v,
 * dn Sᵀ, v Rᵀ, phi_k R) take bf16 operands (linear_bf16_kernels.c: twice the products per
 * instruction; measured 1.23x forward / 1.12x backward on bf16, loaded machine); the chunk-local
 * products stay fp32 (their operands are fresh fp32 features and scores). q, k, v: any batch/head/token strides with a contiguous last axis
 * (layout = q's, k's, v's strides of B, H, T in elements); out, grad_out, dq, dk, dv contiguous
 * [B, H, T, ·]; den fp32 [B, H, T] (includes eps); mask uint8 [B, T] (1 = real key) or NULL;
 * states fp32 [B, H, N, ep + 1, dp] (N chunks, ep / dp: e / d rounded up to 16; the padding entries
 * are never written nor read into a stored result).
 * Threads split the (batch, head) rows. Chunk buffers are padded to 16 columns (zeros there).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define TRI_FULL 0
#define TRI_LOWER 1
#define TRI_UPPER 2
void rf_linear_gemm(int64_t m, int64_t n, int64_t k, const float *a, int64_t ars, int64_t acs,
                    const float *b, int64_t ldb, float *c, int64_t ldc, int accumulate, int produce,
                    int consume);
void rf_linear_load_rows(const void *src, int64_t stride, int bf16, int64_t rows, int64_t width,
                         int64_t padded, int features, const uint8_t *keep, float *dst, float *dst_t,
                         int64_t ldt);
void rf_linear_store_rows(const float *grad, int64_t padded, int64_t rows, int64_t width, const void *slope_src,
                          int64_t stride, int bf16, const uint8_t *keep, void *dst);
int64_t rf_linear_has_dpbf16(void);
void rf_linear_to_bf16(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint16_t *dst,
                       int64_t ld_dst);
void rf_linear_to_bf16_pairs(const float *src, int64_t ld_src, int64_t rows, int64_t cols, uint32_t *dst,
                             int64_t ld_dst);
void rf_linear_gemm_bf16(int64_t m, int64_t n, int64_t k, const uint16_t *a, int64_t lda, const uint32_t *b,
                         int64_t ldb, float *c, int64_t ldc);
void rf_linear_mask_triangle(float *m, int64_t ld, int64_t rows, int64_t cols, int upper, const float *add);

static inline int64_t round16(int64_t x) { return (x + 15) & ~(int64_t)15; }

/* One (batch, head) row: where its inputs start and the sizes every sweep needs. */
typedef struct {
    const char *q, *k, *v;
    int64_t q_stride, k_stride, v_stride; /* token strides, elements */
    const uint8_t *keep;                  /* mask row or NULL */
    int64_t length, dim, value_dim, block, dp, ep, size;
    int bf16, dpbf16; /* bf16 storage; and the d×e state products in bf16 (linear_bf16_kernels.c) */
} head_t;

/* Floats of one saved state [Sᵀ (ep × dp); zᵀ (1 × dp)] (see `states` in the header). */
static inline int64_t state_floats(const head_t *x) { return (x->ep + 1) * x->dp; }

static head_t head_at(const void *q, const void *k, const void *v, const int64_t *layout, const uint8_t *mask,
                      int64_t bh, int64_t heads, int64_t length, int64_t dim, int64_t value_dim, int64_t block,
                      int bf16) {
    int64_t b = bh / heads, h = bh % heads, size = bf16 ? 2 : 4;
    head_t row = {(const char *)q + (b * layout[0] + h * layout[1]) * size,
                  (const char *)k + (b * layout[3] + h * layout[4]) * size,
                  (const char *)v + (b * layout[6] + h * layout[7]) * size,
                  layout[2], layout[5], layout[8], mask == NULL ? NULL : mask + b * length,
                  length, dim, value_dim, block, round16(dim), round16(value_dim), size, bf16,
                  bf16 && rf_linear_has_dpbf16()};
    return row;
}

/* Scratch of one thread, zeroed (padding rows and columns must read as 0). */
typedef struct {
    float *phq, *phk, *phk_t, *val, *val_t, *dn, *dg, *a, *p, *gq, *gv, *s, *s_t, *z, *r;
    uint16_t *q16, *kt16;    /* bf16 copies of a row operand [c, max(dp, ep)] and of phi_kᵀ [dp, c] */
    uint32_t *vpair, *spair; /* bf16 pairs of v [c / 2, ep] and S [dp / 2, ep] */
} scratch_t;

#define SCRATCH_SLOTS 19
static float *scratch_alloc(const head_t *x, scratch_t *w) {
    int64_t c = round16(x->block), dp = x->dp, ep = x->ep;
    int64_t sizes[SCRATCH_SLOTS] = {c * dp, c * dp, dp * c, c * ep, ep * c, c * ep, c, c * c, c * c, c * dp,
                                    c * ep, dp * ep, ep * dp, dp, dp, c * (dp > ep ? dp : ep) / 2, dp * c / 2,
                                    c * ep / 2, dp * ep / 2};
    int64_t total = 0;
    for (int i = 0; i < SCRATCH_SLOTS; i++) total += round16(sizes[i]);
    float *base = aligned_alloc(64, (size_t)total * sizeof(float));
    if (base == NULL) return NULL;
    memset(base, 0, (size_t)total * sizeof(float));
    float **slots[15] = {&w->phq, &w->phk, &w->phk_t, &w->val, &w->val_t, &w->dn, &w->dg, &w->a, &w->p,
                         &w->gq, &w->gv, &w->s, &w->s_t, &w->z, &w->r};
    float *at = base;
    for (int i = 0; i < 15; i++) { *slots[i] = at; at += round16(sizes[i]); }
    w->q16 = (uint16_t *)at, at += round16(sizes[15]);
    w->kt16 = (uint16_t *)at, at += round16(sizes[16]);
    w->vpair = (uint32_t *)at, at += round16(sizes[17]);
    w->spair = (uint32_t *)at;
    return base;
}

/* x · y and Σ x over n entries, n a multiple of 16 (the padded chunk rows). 16 partial sums: a
 * single running sum is a chain the compiler may not reorder (these were ~20% of the forward). */
static inline float dot(const float *x, const float *y, int64_t n) {
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; u += 16) total = _mm512_fmadd_ps(_mm512_loadu_ps(x + u), _mm512_loadu_ps(y + u), total);
    return _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (int64_t u = 0; u < n; u += 16) {
        low = _mm256_fmadd_ps(_mm256_loadu_ps(x + u), _mm256_loadu_ps(y + u), low);
        high = _mm256_fmadd_ps(_mm256_loadu_ps(x + u + 8), _mm256_loadu_ps(y + u + 8), high);
    }
    return horizontal_sum_ps(_mm256_add_ps(low, high));
#else
    float total = 0;
    for (int64_t u = 0; u < n; u++) total += x[u] * y[u];
    return total;
#endif
}

static inline float sum(const float *x, int64_t n) {
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (int64_t u = 0; u < n; u += 16) total = _mm512_add_ps(_mm512_loadu_ps(x + u), total);
    return _mm512_reduce_add_ps(total);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    for (int64_t u = 0; u < n; u += 16) {
        low = _mm256_add_ps(_mm256_loadu_ps(x + u), low);
        high = _mm256_add_ps(_mm256_loadu_ps(x + u + 8), high);
    }
    return horizontal_sum_ps(_mm256_add_ps(low, high));
#else
    float total = 0;
    for (int64_t u = 0; u < n; u++) total += x[u];
    return total;
#endif
}

/* dst[u, a] = src[a, u] for a < rows, u < cols (src rows of ld_src, dst rows of ld_dst). */
static void transpose(const float *src, int64_t ld_src, int64_t rows, int64_t cols, float *dst, int64_t ld_dst) {
    for (int64_t a = 0; a < rows; a++)
        for (int64_t u = 0; u < cols; u++) dst[u * ld_dst + a] = src[a * ld_src + u];
}

/* states (or NULL): per chunk n, the state before it as [Sᵀ (ep × dp); zᵀ (1 × dp)], for the backward. */
static void forward_head(const head_t *x, scratch_t *w, float eps, char *out, float *den, float *states) {
    int64_t c = round16(x->block), dp = x->dp, ep = x->ep;
    for (int64_t t0 = 0; t0 < x->length; t0 += x->block) {
        if (states != NULL) {
            float *saved = states + (t0 / x->block) * state_floats(x);
            transpose(w->s, ep, x->dim, x->value_dim, saved, dp);
            memcpy(saved + ep * dp, w->z, sizeof(float) * dp);
        }
        int64_t rows = x->length - t0 < x->block ? x->length - t0 : x->block, cols = round16(rows);
        const uint8_t *keep = x->keep == NULL ? NULL : x->keep + t0;
        if (rows < c) memset(w->phk_t, 0, sizeof(float) * dp * c);
        rf_linear_load_rows(x->q + t0 * x->q_stride * x->size, x->q_stride, x->bf16, rows, x->dim, dp, 1, NULL,
                            w->phq, NULL, 0);
        rf_linear_load_rows(x->k + t0 * x->k_stride * x->size, x->k_stride, x->bf16, rows, x->dim, dp, 1, keep,
                            w->phk, w->phk_t, c);
        rf_linear_load_rows(x->v + t0 * x->v_stride * x->size, x->v_stride, x->bf16, rows, x->value_dim, ep, 0,
                            keep, w->val, NULL, 0);
        /* A = phi_q phi_kᵀ ∘ tril; numerator = A v + phi_q S */
        rf_linear_gemm(rows, cols, dp, w->phq, dp, 1, w->phk_t, c, w->a, c, 0, TRI_LOWER, TRI_FULL);
        rf_linear_mask_triangle(w->a, c, rows, cols, 0, NULL);
        rf_linear_gemm(rows, ep, rows, w->a, c, 1, w->val, ep, w->gv, ep, 0, TRI_FULL, TRI_LOWER);
        if (x->dpbf16) {
            rf_linear_to_bf16(w->phq, dp, rows, dp, w->q16, dp);
            rf_linear_to_bf16_pairs(w->s, ep, dp, ep, w->spair, ep);
            rf_linear_gemm_bf16(rows, ep, dp, w->q16, dp, w->spair, ep, w->gv, ep);
        } else {
            rf_linear_gemm(rows, ep, dp, w->phq, dp, 1, w->s, ep, w->gv, ep, 1, TRI_FULL, TRI_FULL);
        }
        for (int64_t i = 0; i < rows; i++) {
            float total = dot(w->phq + i * dp, w->z, dp) + sum(w->a + i * c, cols) + eps; /* A is masked */
            den[t0 + i] = total;
            float scale = 1.0f / total;
            for (int64_t u = 0; u < ep; u++) w->gv[i * ep + u] *= scale;
        }
        rf_linear_store_rows(w->gv, ep, rows, x->value_dim, NULL, 0, x->bf16, NULL,
                             out + t0 * x->value_dim * x->size);
        /* S += phi_kᵀ v, z += Σ phi_k */
        if (x->dpbf16) { /* an odd last row pairs with phi_kᵀ's zeroed tail column and a zero v row */
            rf_linear_to_bf16(w->phk_t, c, x->dim, c, w->kt16, c);
            rf_linear_to_bf16_pairs(w->val, ep, rows, ep, w->vpair, ep);
            rf_linear_gemm_bf16(x->dim, ep, (rows + 1) & ~(int64_t)1, w->kt16, c, w->vpair, ep, w->s, ep);
        } else {
            rf_linear_gemm(x->dim, ep, rows, w->phk_t, c, 1, w->val, ep, w->s, ep, 1, TRI_FULL, TRI_FULL);
        }
        for (int64_t u = 0; u < x->dim; u++) w->z[u] += sum(w->phk_t + u * c, cols); /* zeros past rows */
    }
}

/* dn = g / den, dg = −(g·out) / den for a chunk's rows (g, out contiguous rows of e). */
static void load_output_grads(const head_t *x, scratch_t *w, const char *out, const char *grad_out,
                              const float *den, int64_t rows, float *dn_t, int64_t ldt) {
    int64_t ep = x->ep;
    rf_linear_load_rows(grad_out, x->value_dim, x->bf16, rows, x->value_dim, ep, 0, NULL, w->dn, dn_t, ldt);
    rf_linear_load_rows(out, x->value_dim, x->bf16, rows, x->value_dim, ep, 0, NULL, w->gv, NULL, 0);
    for (int64_t i = 0; i < rows; i++) {
        float scale = 1.0f / den[i];
        w->dg[i] = -dot(w->dn + i * ep, w->gv + i * ep, ep) * scale;
        for (int64_t u = 0; u < ep; u++) w->dn[i * ep + u] *= scale;
    }
}

/* c[rows, n] += a[rows, k] · state[k, n] (a: fp32 rows of k, state: fp32 rows of ld, k and n padded
 * to 16 with zeros): in bf16 products for bf16 inputs where the CPU has them, else fp32. */
static void state_product(const head_t *x, scratch_t *w, int64_t rows, int64_t n, int64_t k, const float *a,
                          const float *state, int64_t ld, float *c) {
    if (x->dpbf16) {
        rf_linear_to_bf16(a, k, rows, k, w->q16, k);
        rf_linear_to_bf16_pairs(state, ld, k, n, w->spair, n);
        rf_linear_gemm_bf16(rows, n, k, w->q16, k, w->spair, n, c, n);
    } else {
        rf_linear_gemm(rows, n, k, a, k, 1, state, ld, c, n, 1, TRI_FULL, TRI_FULL);
    }
}

/* The backward, one sweep from the last chunk to the first: dq with the saved forward state before
 * each chunk, dk and dv with R, r, the sums over the chunks after it. w->s holds R, w->s_t Rᵀ. */
static void backward_head(const head_t *x, scratch_t *w, const char *out, const char *grad_out,
                          const float *den, const float *states, char *dq, char *dk, char *dv) {
    int64_t c = round16(x->block), dp = x->dp, ep = x->ep;
    int64_t chunks = (x->length + x->block - 1) / x->block;
    for (int64_t n = chunks - 1; n >= 0; n--) {
        int64_t t0 = n * x->block, rows = x->length - t0 < x->block ? x->length - t0 : x->block;
        int64_t cols = round16(rows);
        const uint8_t *keep = x->keep == NULL ? NULL : x->keep + t0;
        const float *saved = states + n * state_floats(x), *z = saved + ep * dp;
        const char *q = x->q + t0 * x->q_stride * x->size, *k = x->k + t0 * x->k_stride * x->size;
        rf_linear_load_rows(q, x->q_stride, x->bf16, rows, x->dim, dp, 1, NULL, w->phq, NULL, 0);
        rf_linear_load_rows(k, x->k_stride, x->bf16, rows, x->dim, dp, 1, keep, w->phk, w->phk_t, c);
        rf_linear_load_rows(x->v + t0 * x->v_stride * x->size, x->v_stride, x->bf16, rows, x->value_dim, ep, 0,
                            keep, w->val, w->val_t, c);
        load_output_grads(x, w, out + t0 * x->value_dim * x->size, grad_out + t0 * x->value_dim * x->size,
                          den + t0, rows, NULL, 0);
        rf_linear_gemm(rows, cols, dp, w->phq, dp, 1, w->phk_t, c, w->a, c, 0, TRI_LOWER, TRI_FULL);
        rf_linear_mask_triangle(w->a, c, rows, cols, 0, NULL);
        rf_linear_gemm(rows, cols, ep, w->dn, ep, 1, w->val_t, c, w->p, c, 0, TRI_LOWER, TRI_FULL);
        rf_linear_mask_triangle(w->p, c, rows, cols, 0, w->dg);
        /* d phi_q = P phi_k + dn Sᵀ + dg zᵀ */
        rf_linear_gemm(rows, dp, rows, w->p, c, 1, w->phk, dp, w->gq, dp, 0, TRI_FULL, TRI_LOWER);
        state_product(x, w, rows, dp, ep, w->dn, saved, dp, w->gq);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t u = 0; u < dp; u++) w->gq[i * dp + u] += w->dg[i] * z[u];
        rf_linear_store_rows(w->gq, dp, rows, x->dim, q, x->q_stride, x->bf16, NULL, dq + t0 * x->dim * x->size);
        /* d phi_k = Pᵀ phi_q + v Rᵀ + r */
        rf_linear_gemm(rows, dp, rows, w->p, 1, c, w->phq, dp, w->gq, dp, 0, TRI_FULL, TRI_UPPER);
        state_product(x, w, rows, dp, ep, w->val, w->s_t, dp, w->gq);
        for (int64_t j = 0; j < rows; j++)
            for (int64_t u = 0; u < dp; u++) w->gq[j * dp + u] += w->r[u];
        rf_linear_store_rows(w->gq, dp, rows, x->dim, k, x->k_stride, x->bf16, keep, dk + t0 * x->dim * x->size);
        /* d v = Aᵀ dn + phi_k R */
        rf_linear_gemm(rows, ep, rows, w->a, 1, c, w->dn, ep, w->gv, ep, 0, TRI_FULL, TRI_UPPER);
        state_product(x, w, rows, ep, dp, w->phk, w->s, ep, w->gv);
        rf_linear_store_rows(w->gv, ep, rows, x->value_dim, NULL, 0, x->bf16, keep, dv + t0 * x->value_dim * x->size);
        /* R += phi_qᵀ dn (Rᵀ by transposition), r += Σ dg phi_q */
        rf_linear_gemm(x->dim, ep, rows, w->phq, 1, dp, w->dn, ep, w->s, ep, 1, TRI_FULL, TRI_FULL);
        transpose(w->s, ep, x->dim, x->value_dim, w->s_t, dp);
        for (int64_t i = 0; i < rows; i++)
            for (int64_t u = 0; u < dp; u++) w->r[u] += w->dg[i] * w->phq[i * dp + u];
    }
}

/* Returns 0, or -1 when scratch could not be allocated (the caller raises). */
int64_t causal_linear_forward(const void *q, const void *k, const void *v, const int64_t *layout,
                              const uint8_t *mask, int64_t batch, int64_t heads, int64_t length, int64_t dim,
                              int64_t value_dim, int64_t block, double eps, int bf16, void *out, float *den,
                              float *states, int threads) {
    int64_t failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) reduction(| : failed)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        head_t x = head_at(q, k, v, layout, mask, bh, heads, length, dim, value_dim, block, bf16);
        scratch_t w;
        float *base = scratch_alloc(&x, &w);
        if (base == NULL) { failed = 1; continue; }
        int64_t per_head = (length + block - 1) / block * state_floats(&x);
        forward_head(&x, &w, (float)eps, (char *)out + bh * length * value_dim * x.size, den + bh * length,
                     states == NULL ? NULL : states + bh * per_head);
        free(base);
    }
    return failed ? -1 : 0;
}

int64_t causal_linear_backward(const void *q, const void *k, const void *v, const int64_t *layout,
                               const uint8_t *mask, const void *out, const float *den, const float *states,
                               const void *grad_out,
                               int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t value_dim,
                               int64_t block, int bf16, void *dq, void *dk, void *dv, int threads) {
    int64_t failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) reduction(| : failed)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
        head_t x = head_at(q, k, v, layout, mask, bh, heads, length, dim, value_dim, block, bf16);
        scratch_t w;
        float *base = scratch_alloc(&x, &w);
        if (base == NULL) { failed = 1; continue; }
        size_t values = (size_t)(bh * length * value_dim * x.size), keys = (size_t)(bh * length * dim * x.size);
        const char *o = (const char *)out + values, *g = (const char *)grad_out + values;
        int64_t per_head = (length + block - 1) / block * state_floats(&x);
        backward_head(&x, &w, o, g, den + bh * length, states + bh * per_head, (char *)dq + keys, (char *)dk + keys,
                      (char *)dv + values);
        free(base);
    }
    return failed ? -1 : 0;
}
