/* keep_best_float_split: keep_best_float (topk_kernels.c) for builds without AVX-512 (AVX2 and
 * the portable level, ARM included): the same split as topk_select_avx512.h in plain C. Same
 * contract: reorder so that the m largest scores come first (unordered; among equal scores the
 * lower keys), return the m-th largest.
 *
 * The scalar quickselect moves a score and an int64 key per element per pass (a three-way swap).
 * Here the m-th largest value is found first by a quickselect on copies of the scores alone —
 * each element written, branch-free, to both the "greater" and the "lower" buffer, whose ends
 * advance by the comparisons — and one pass then moves the scores >= it, with their keys, to the
 * front. Only when the threshold's value is tied beyond the m-th place does the scalar select
 * order the (short) front by key. NaN compares false both ways, as in the AVX-512 version. */

/* The count-th largest of x[0..n) (1 <= count <= n), in the scratch arrays a, b, c of n floats
 * each (x is not modified). */
static float kth_largest_split(const float *x, int64_t n, int64_t count, float *a, float *b, float *c) {
    const float *from = x;
    int64_t length = n;
    for (;;) {
        float p = from[0], q = from[length / 2], r = from[length - 1];
        float pivot = p < q ? (q < r ? q : (p < r ? r : p)) : (p < r ? p : (q < r ? r : q));
        int64_t high = 0, low = 0;
        for (int64_t e = 0; e < length; e++) {
            float v = from[e];
            b[high] = v;
            c[low] = v;
            high += v > pivot;
            low += v < pivot;
        }
        int64_t equal = length - high - low; /* >= 1 (the pivot), or all of them if it is NaN */
        if (count <= high) {
            float *next = b; b = a; a = next;
            from = a;
            length = high;
        } else if (count <= high + equal) {
            return pivot;
        } else {
            count -= high + equal;
            float *next = c; c = a; a = next;
            from = a;
            length = low;
        }
    }
}

static float keep_best_float_split(float *score, int64_t *key, int64_t n, int64_t m) {
    if (m <= 0) return INFINITY;
    if (m >= n) {
        float least = INFINITY;
        for (int64_t e = 0; e < n; e++) least = score[e] < least ? score[e] : least;
        return least;
    }
    float scratch[3][4 * MAX_SLOTS + 32];
    if (n > 4 * MAX_SLOTS + 32) return keep_best_float(score, key, n, m); /* larger than any buffer */
    float threshold = kth_largest_split(score, n, m, scratch[0], scratch[1], scratch[2]);
    int64_t kept = 0; /* in place: element e is read before anything is written at kept <= e */
    for (int64_t e = 0; e < n; e++) {
        float s = score[e];
        int64_t k = key[e];
        score[kept] = s;
        key[kept] = k;
        kept += s >= threshold;
    }
    if (kept > m) return keep_best_float(score, key, kept, m); /* the threshold tied past the m-th */
    return threshold;
}
