/* keep_best_float_split: keep_best_float (topk_kernels.c) by a threshold split, the flush of the
 * routing selection's candidate buffers. Same contract: reorder so that the m largest scores come
 * first (unordered; among equal scores the lower keys), return the m-th largest.
 *
 * The scalar quickselect moves a score and an int64 key per element per pass (a three-way swap).
 * Here the m-th largest value is found first by a quickselect on copies of the scores alone (a
 * `split_pass` writes the scores above and below a pivot to two buffers), and one `move_pass` then
 * moves the scores >= it, with their keys, to the front. Only when the threshold's value is tied
 * beyond the m-th place does the scalar select order the (short) front by key. NaN compares false
 * both ways. The passes here are plain C (AVX2 and the portable level, ARM included);
 * topk_select_avx512.h gives AVX-512 ones to the same driver. */

typedef void (*split_pass)(const float *from, int64_t length, float pivot, float *high_out, float *low_out,
                           int64_t *high, int64_t *low);
typedef int64_t (*move_pass)(float *score, int64_t *key, int64_t n, float threshold);

/* Branch-free: every element is written to both buffers, whose ends advance by the comparisons. */
static void split_scalar(const float *from, int64_t length, float pivot, float *high_out, float *low_out,
                         int64_t *high, int64_t *low) {
    int64_t h = 0, l = 0;
    for (int64_t e = 0; e < length; e++) {
        float v = from[e];
        high_out[h] = v;
        low_out[l] = v;
        h += v > pivot;
        l += v < pivot;
    }
    *high = h;
    *low = l;
}

/* In place: element e is read before anything is written at kept <= e. */
static int64_t move_scalar(float *score, int64_t *key, int64_t n, float threshold) {
    int64_t kept = 0;
    for (int64_t e = 0; e < n; e++) {
        float s = score[e];
        int64_t k = key[e];
        score[kept] = s;
        key[kept] = k;
        kept += s >= threshold;
    }
    return kept;
}

/* The count-th largest of x[0..n) (1 <= count <= n), in the scratch arrays a, b, c of n + 16
 * floats each (x is not modified). */
static inline float kth_largest_by(split_pass split, const float *x, int64_t n, int64_t count, float *a,
                                   float *b, float *c) {
    const float *from = x;
    int64_t length = n;
    for (;;) {
        float p = from[0], q = from[length / 2], r = from[length - 1];
        float pivot = p < q ? (q < r ? q : (p < r ? r : p)) : (p < r ? p : (q < r ? r : q));
        int64_t high, low;
        split(from, length, pivot, b, c, &high, &low);
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

static inline float keep_best_float_by(split_pass split, move_pass move, float *score, int64_t *key, int64_t n,
                                       int64_t m) {
    if (m <= 0) return INFINITY;
    if (m >= n) {
        float least = INFINITY;
        for (int64_t e = 0; e < n; e++) least = score[e] < least ? score[e] : least;
        return least;
    }
    float scratch[3][4 * MAX_SLOTS + 32];
    if (n > 4 * MAX_SLOTS + 16) return keep_best_float(score, key, n, m); /* larger than any buffer */
    float threshold = kth_largest_by(split, score, n, m, scratch[0], scratch[1], scratch[2]);
    int64_t kept = move(score, key, n, threshold);
    if (kept > m) return keep_best_float(score, key, kept, m); /* the threshold tied past the m-th */
    return threshold;
}

__attribute__((unused)) static float keep_best_float_split(float *score, int64_t *key, int64_t n, int64_t m) {
    return keep_best_float_by(split_scalar, move_scalar, score, key, n, m);
}
