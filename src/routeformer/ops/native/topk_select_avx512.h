/* keep_best_float_vector: keep_best_float (topk_kernels.c) on AVX-512, the flush of the routing
 * selection's candidate buffers. Included by topk_kernels.c where __AVX512F__ is defined; same
 * contract: reorder so that the m largest scores come first (unordered; among equal scores the
 * lower keys), return the m-th largest.
 *
 * Why: the scalar quickselect moves a score and an int64 key per element per pass, with a
 * branchless swap: ~8 cycles an element, and a routing row flushes a few hundred candidates
 * (at T = 1024, K = 64 the flushes were most of route_topk's time). Here the m-th largest value is
 * found first by a quickselect on a copy of the scores alone, sixteen at a time (compare into a
 * mask, compress, store), and one pass then moves the scores >= it, with their keys, to the
 * front. Only when the threshold's value is tied beyond the m-th place does the scalar select
 * order the (short) front by key. */

/* The count-th largest of x[0..n) (1 <= count <= n), found in the scratch arrays a, b, c of n + 16
 * floats each (x is not modified). */
static float kth_largest_vector(const float *x, int64_t n, int64_t count, float *a, float *b, float *c) {
    const float *from = x;
    int64_t length = n;
    for (;;) {
        float p = from[0], q = from[length / 2], r = from[length - 1];
        float pivot = p < q ? (q < r ? q : (p < r ? r : p)) : (p < r ? p : (q < r ? r : q));
        __m512 bound = _mm512_set1_ps(pivot);
        int64_t high = 0, low = 0;
        for (int64_t e = 0; e < length; e += 16) {
            __mmask16 lanes = first_lanes(length - e);
            __m512 v = _mm512_maskz_loadu_ps(lanes, from + e);
            __mmask16 gt = _mm512_mask_cmp_ps_mask(lanes, v, bound, _CMP_GT_OQ);
            __mmask16 lt = _mm512_mask_cmp_ps_mask(lanes, v, bound, _CMP_LT_OQ);
            _mm512_storeu_ps(b + high, _mm512_maskz_compress_ps(gt, v));
            _mm512_storeu_ps(c + low, _mm512_maskz_compress_ps(lt, v));
            high += __builtin_popcount(gt);
            low += __builtin_popcount(lt);
        }
        int64_t equal = length - high - low; /* >= 1 (the pivot), or all of them if it is NaN */
        if (count <= high) {                 /* among the greater ones */
            float *next = b; b = a; a = next;
            from = a;
            length = high;
        } else if (count <= high + equal) {
            return pivot;
        } else {                             /* among the lower ones */
            count -= high + equal;
            float *next = c; c = a; a = next;
            from = a;
            length = low;
        }
    }
}

static float keep_best_float_vector(float *score, int64_t *key, int64_t n, int64_t m) {
    if (m <= 0) return INFINITY;
    if (m >= n) {
        float least = INFINITY;
        for (int64_t e = 0; e < n; e++) least = score[e] < least ? score[e] : least;
        return least;
    }
    float scratch[3][4 * MAX_SLOTS + 32];
    if (n > 4 * MAX_SLOTS + 16) return keep_best_float(score, key, n, m); /* larger than any buffer */
    float threshold = kth_largest_vector(score, n, m, scratch[0], scratch[1], scratch[2]);
    /* The scores >= threshold, with their keys, to the front (in place: a chunk is read before
     * anything is written over it, and writes never pass the chunk just read). */
    __m512 bound = _mm512_set1_ps(threshold);
    int64_t kept = 0;
    for (int64_t e = 0; e < n; e += 16) {
        __mmask16 lanes = first_lanes(n - e);
        __m512 v = _mm512_maskz_loadu_ps(lanes, score + e);
        __m512i keys_low = _mm512_maskz_loadu_epi64((__mmask8)lanes, key + e);
        __m512i keys_high = _mm512_maskz_loadu_epi64((__mmask8)(lanes >> 8), key + e + 8);
        __mmask16 keep = _mm512_mask_cmp_ps_mask(lanes, v, bound, _CMP_GE_OQ);
        int low_count = __builtin_popcount(keep & 0xFF), total = __builtin_popcount(keep);
        _mm512_mask_storeu_ps(score + kept, first_lanes(total), _mm512_maskz_compress_ps(keep, v));
        _mm512_mask_storeu_epi64(key + kept, (__mmask8)((1u << low_count) - 1u),
                                 _mm512_maskz_compress_epi64((__mmask8)keep, keys_low));
        _mm512_mask_storeu_epi64(key + kept + low_count, (__mmask8)((1u << (total - low_count)) - 1u),
                                 _mm512_maskz_compress_epi64((__mmask8)(keep >> 8), keys_high));
        kept += total;
    }
    /* More than m at or above the threshold: its value is tied past the m-th place, and the lower
     * keys of the tie must stay (the scalar select's rule, on the short front). */
    if (kept > m) return keep_best_float(score, key, kept, m);
    return threshold;
}
