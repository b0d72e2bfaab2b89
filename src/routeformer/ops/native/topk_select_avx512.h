/* keep_best_float_vector: the threshold split of topk_select_split.h with AVX-512 passes, sixteen
 * scores at a time (compare into a mask, compress, store). Included by topk_kernels.c, after
 * topk_select_split.h, where __AVX512F__ is defined.
 *
 * Why: the scalar quickselect moves a score and an int64 key per element per pass, with a
 * branchless swap: ~8 cycles an element, and a routing row flushes a few hundred candidates (at
 * T = 1024, K = 64 the flushes were most of route_topk's time). */

static void split_avx512(const float *from, int64_t length, float pivot, float *high_out, float *low_out,
                         int64_t *high, int64_t *low) {
    __m512 bound = _mm512_set1_ps(pivot);
    int64_t h = 0, l = 0;
    for (int64_t e = 0; e < length; e += 16) {
        __mmask16 lanes = first_lanes(length - e);
        __m512 v = _mm512_maskz_loadu_ps(lanes, from + e);
        __mmask16 gt = _mm512_mask_cmp_ps_mask(lanes, v, bound, _CMP_GT_OQ);
        __mmask16 lt = _mm512_mask_cmp_ps_mask(lanes, v, bound, _CMP_LT_OQ);
        _mm512_storeu_ps(high_out + h, _mm512_maskz_compress_ps(gt, v));
        _mm512_storeu_ps(low_out + l, _mm512_maskz_compress_ps(lt, v));
        h += __builtin_popcount(gt);
        l += __builtin_popcount(lt);
    }
    *high = h;
    *low = l;
}

/* The scores >= threshold, with their keys, to the front (in place: a chunk is read before
 * anything is written over it, and writes never pass the chunk just read). */
static int64_t move_avx512(float *score, int64_t *key, int64_t n, float threshold) {
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
    return kept;
}

static float keep_best_float_vector(float *score, int64_t *key, int64_t n, int64_t m) {
    return keep_best_float_by(split_avx512, move_avx512, score, key, n, m);
}
