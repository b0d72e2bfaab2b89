/* Causal top-k routing when the routing keys repeat: the keys of a row fall into U groups of equal
 * vectors (a position-blind router's first layer reads only the token), so a query's routed set
 * is whole groups in descending score and, in the group (or tie class of groups) where it stops,
 * the lowest-index members. Per query: U scores and a walk down the groups, instead of S scores.
 * The grouping itself is found in Python (ops/topk/repeated.py), which calls this through
 * ops/native/topk.py.
 *
 * Same selection as route_topk_f32 (topk_kernels.c): scores are the fmaf chain over d in order
 * (exact_score in topk_speculative_kernels.c: bit for bit the kernels' scores), ties go to the
 * lower key index — within a group by the member order, across groups of equal score by merging
 * their members by index. Forced keys first in a row (the first `global_tokens` keys, then the
 * window [i - w + 1, i]), as route_topk_f32 writes them.
 *
 * Layouts (N = batch x routing heads rows; batch of row n: n / heads):
 *   rq [N, T, r] fp32 queries; groups [N, U, r] fp32 group vectors (padding groups: count 0);
 *   members [N, S] the routable keys (real, >= global_tokens) sorted by (group, key), then padding;
 *   starts [N, U + 1] each group's first position in members (starts[U]: routable total);
 *   key_group [N, S] each key's group, U where not routable; key_mask [B, S] (1 = real) or NULL;
 *   index [N, T, slots] int64, valid [N, T, slots] uint8 (invalid slots: key 0).
 * Returns the number of routing scores computed (N · T · U), -1 on a bad argument. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 256 /* queries a task: counts are set by binary search at its start, then advanced */

static inline float group_score(const float *q, const float *g, int64_t dim) {
    float s = 0.0f;
    for (int64_t d = 0; d < dim; d++) s = fmaf(q[d], g[d], s);
    return s;
}

/* Members of group g with key <= last (its members ascend). */
static int64_t eligible_at(const int64_t *members, const int64_t *starts, int64_t g, int64_t last) {
    int64_t lo = starts[g], hi = starts[g + 1];
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (members[mid] <= last) lo = mid + 1;
        else hi = mid;
    }
    return lo - starts[g];
}

/* Write the `want` lowest keys of the tie class `class_groups` (each group's first held[g] members)
 * into out; returns want. A merge by repeated minimum: tie classes are small. */
static int64_t merge_lowest(const int64_t *members, const int64_t *starts, const int64_t *held,
                            const int64_t *class_groups, int64_t size, int64_t *cursor, int64_t want,
                            int64_t *out) {
    for (int64_t c = 0; c < size; c++) cursor[c] = 0;
    for (int64_t w = 0; w < want; w++) {
        int64_t best = -1, best_key = INT64_MAX;
        for (int64_t c = 0; c < size; c++) {
            int64_t g = class_groups[c];
            if (cursor[c] < held[g] && members[starts[g] + cursor[c]] < best_key) {
                best = c; best_key = members[starts[g] + cursor[c]];
            }
        }
        out[w] = best_key;
        cursor[best]++;
    }
    return want;
}

int64_t route_topk_groups(const float *rq, const float *groups, const int64_t *members, const int64_t *starts,
                          const int64_t *key_group, const uint8_t *key_mask, int64_t rows, int64_t heads,
                          int64_t length, int64_t count, int64_t dim, int64_t slots, int64_t local_window,
                          int64_t global_tokens, int64_t *index, uint8_t *valid, int threads) {
    if (rows < 0 || length < 1 || count < 1 || dim < 1 || slots < 1 || local_window < 0 || global_tokens < 0)
        return -1;
    int64_t blocks = (length + BLOCK - 1) / BLOCK;
    _Pragma("omp parallel num_threads(threads)")
    {
        int64_t *held = malloc(sizeof(int64_t) * (size_t)count * 4);
        int64_t *class_groups = held + count, *cursor = held + 2 * count;
        uint8_t *used = (uint8_t *)(held + 3 * count);
        float *score = malloc(sizeof(float) * (size_t)count);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t task = 0; task < rows * blocks; task++) {
            int64_t n = task / blocks, i0 = (task % blocks) * BLOCK, i1 = i0 + BLOCK < length ? i0 + BLOCK : length;
            const int64_t *row_members = members + n * length, *row_starts = starts + n * (count + 1);
            const int64_t *row_group = key_group + n * length;
            const uint8_t *mask = key_mask ? key_mask + (n / heads) * length : NULL;
            for (int64_t g = 0; g < count; g++) held[g] = eligible_at(row_members, row_starts, g, i0 - 1 - local_window);
            for (int64_t i = i0; i < i1; i++) {
                int64_t x = i - local_window; /* the key that leaves the window: now routable */
                if (x >= 0 && row_group[x] < count) held[row_group[x]]++;
                int64_t *out = index + (n * length + i) * slots, filled = 0;
                uint8_t *out_valid = valid + (n * length + i) * slots;
                int64_t first = i - local_window + 1 > 0 ? i - local_window + 1 : 0;
                for (int64_t j = 0; j < global_tokens && j < first && filled < slots; j++)
                    if (!mask || mask[j]) out[filled++] = j;
                for (int64_t j = first; j <= i && filled < slots; j++)
                    if (!mask || mask[j]) out[filled++] = j;
                const float *q = rq + (n * length + i) * dim;
                for (int64_t g = 0; g < count; g++) {
                    used[g] = held[g] == 0;
                    score[g] = used[g] ? -INFINITY : group_score(q, groups + (n * count + g) * dim, dim);
                }
                while (filled < slots) { /* the best remaining tie class */
                    float best = -INFINITY;
                    int64_t size = 0, total = 0;
                    for (int64_t g = 0; g < count; g++)
                        if (!used[g] && (size == 0 || score[g] > best)) { best = score[g]; size = 1; }
                        else if (!used[g] && score[g] == best) size++;
                    if (size == 0) break;
                    size = 0;
                    for (int64_t g = 0; g < count; g++)
                        if (!used[g] && score[g] == best) { class_groups[size++] = g; total += held[g]; used[g] = 1; }
                    int64_t room = slots - filled;
                    if (total <= room) {
                        for (int64_t c = 0; c < size; c++) {
                            int64_t g = class_groups[c];
                            for (int64_t m = 0; m < held[g]; m++) out[filled++] = row_members[row_starts[g] + m];
                        }
                    } else if (size == 1) {
                        int64_t g = class_groups[0];
                        for (int64_t m = 0; m < room; m++) out[filled++] = row_members[row_starts[g] + m];
                    } else {
                        filled += merge_lowest(row_members, row_starts, held, class_groups, size, cursor, room,
                                               out + filled);
                    }
                }
                for (int64_t e = 0; e < filled; e++) out_valid[e] = 1;
                for (int64_t e = filled; e < slots; e++) { out[e] = 0; out_valid[e] = 0; }
            }
        }
        free(held);
        free(score);
    }
    return rows * length * count;
}
