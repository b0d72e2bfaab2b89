/* Shared by the native kernels: row prefetching and the dot product. */
#ifndef ROUTEFORMER_NATIVE_COMMON_H
#define ROUTEFORMER_NATIVE_COMMON_H

#include <stdint.h>

/* Ask for a row of `bytes` some iterations ahead: gathered or walked-back key and value rows are
 * spread over megabytes, and waiting for each one stalls the loop. */
#define PREFETCH_AHEAD 8
static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch((const char *)row + at);
}

/* x · y with eight partial sums, one vector register: a single running sum is a chain of
 * dependent adds the compiler may not reorder, and consecutive dots are independent, so their
 * chains overlap. (Thirty-two sums spilled to the stack: 3x slower.) */
#define DEFINE_DOT(T_)                                                                             \
static inline T_ dot_##T_(const T_ *x, const T_ *y, int64_t n) {                                   \
    T_ part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0;                                              \
    int64_t c = 0;                                                                                 \
    for (; c + 8 <= n; c += 8)                                                                     \
        for (int u = 0; u < 8; u++) part[u] += x[c + u] * y[c + u];                                \
    for (; c < n; c++) total += x[c] * y[c];                                                       \
    for (int u = 0; u < 8; u++) total += part[u];                                                  \
    return total;                                                                                  \
}
DEFINE_DOT(float)
DEFINE_DOT(double)

#endif
