/* keep_best_float_avx2: the threshold split of topk_select_split.h with AVX2 passes, eight scores
 * at a time (compare, movemask, a compress permutation from topk_compress_avx2.h, store). Included
 * by topk_kernels.c, after topk_select_split.h, where __AVX2__ (and not __AVX512F__) is defined.
 * Same contract and the same result as keep_best_float_split: both passes keep the order of the
 * elements they keep.
 *
 * Why: on an AMD EPYC (AVX2), the speculative routing's flushes spent ~10 % of route_topk's time
 * in the scalar passes (T = 16384, K = 64: ~120 candidates a query). */

static void split_avx2(const float *from, int64_t length, float pivot, float *high_out, float *low_out,
                       int64_t *high, int64_t *low) {
    __m256 bound = _mm256_set1_ps(pivot);
    int64_t h = 0, l = 0;
    for (int64_t e = 0; e < length; e += 8) {
        __m256i lanes = first_lanes8(length - e);
        __m256 v = _mm256_maskload_ps(from + e, lanes); /* no read past the end */
        uint32_t inside = (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(lanes));
        uint32_t gt = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, bound, _CMP_GT_OQ)) & inside;
        uint32_t lt = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, bound, _CMP_LT_OQ)) & inside;
        compress_store_ps8(high_out + h, v, gt); /* the scratch has n + 16 entries */
        compress_store_ps8(low_out + l, v, lt);
        h += __builtin_popcount(gt);
        l += __builtin_popcount(lt);
    }
    *high = h;
    *low = l;
}

/* The dword permutation that packs the int64 lanes of a 4-bit mask: lane pairs (2L, 2L + 1). */
static inline __m256i compress_pairs4(uint32_t mask) {
    __m256i lane = _mm256_cvtepu32_epi64(_mm256_castsi256_si128(compress_lanes8(mask & 0xF)));
    __m256i even = _mm256_slli_epi64(lane, 1);
    return _mm256_or_si256(even, _mm256_slli_epi64(_mm256_add_epi64(even, _mm256_set1_epi64x(1)), 32));
}

/* The first n of 4 int64 lanes as a maskload / maskstore mask (n <= 0: none, n >= 4: all). */
static inline __m256i first_lanes4_epi64(int64_t n) {
    return _mm256_cmpgt_epi64(_mm256_set1_epi64x(n), _mm256_setr_epi64x(0, 1, 2, 3));
}

/* The scores >= threshold, with their keys, to the front, in place: chunk [e, e + 8) is read before
 * anything is written over it, and a whole chunk's writes end at kept + 7 <= e + 7; the last
 * (partial) chunk stores only the lanes it keeps (the buffer may end there). */
static int64_t move_avx2(float *score, int64_t *key, int64_t n, float threshold) {
    __m256 bound = _mm256_set1_ps(threshold);
    int64_t kept = 0;
    for (int64_t e = 0; e < n; e += 8) {
        int64_t left = n - e;
        __m256i lanes = first_lanes8(left);
        __m256 v = _mm256_maskload_ps(score + e, lanes);
        __m256i keys_low = _mm256_maskload_epi64((const long long *)(key + e), first_lanes4_epi64(left));
        __m256i keys_high = _mm256_maskload_epi64((const long long *)(key + e + 4), first_lanes4_epi64(left - 4));
        uint32_t keep = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, bound, _CMP_GE_OQ)) &
                        (uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(lanes));
        int low_count = __builtin_popcount(keep & 0xF), total = __builtin_popcount(keep);
        __m256 packed = _mm256_permutevar8x32_ps(v, compress_lanes8(keep));
        __m256i packed_low = _mm256_permutevar8x32_epi32(keys_low, compress_pairs4(keep));
        __m256i packed_high = _mm256_permutevar8x32_epi32(keys_high, compress_pairs4(keep >> 4));
        if (left >= 8) {
            _mm256_storeu_ps(score + kept, packed);
            _mm256_storeu_si256((__m256i *)(key + kept), packed_low);
            _mm256_storeu_si256((__m256i *)(key + kept + low_count), packed_high);
        } else {
            _mm256_maskstore_ps(score + kept, first_lanes8(total), packed);
            _mm256_maskstore_epi64((long long *)(key + kept), first_lanes4_epi64(low_count), packed_low);
            _mm256_maskstore_epi64((long long *)(key + kept + low_count), first_lanes4_epi64(total - low_count),
                                   packed_high);
        }
        kept += total;
    }
    return kept;
}

static float keep_best_float_avx2(float *score, int64_t *key, int64_t n, int64_t m) {
    return keep_best_float_by(split_avx2, move_avx2, score, key, n, m);
}
