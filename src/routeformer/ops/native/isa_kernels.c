/* What instruction set the library was compiled for (ROUTEFORMER_ISA, ops/native/build.py): the
 * preprocessor's answer, which is what every kernel file's #if chose. `routeformer doctor` reports it.
 * 3: AVX-512 (F), 2: AVX2 with FMA, 1: plain C (the compiler vectorises it for its target). */
#include <stdint.h>

int64_t rf_isa_level(void) {
#if defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 1;
#endif
}

/* 1 where the AVX-512 BF16 pair products (vdpbf16ps) are compiled in, else 0: bf16 is then widened to
 * float32 inside the kernels. */
int64_t rf_isa_has_bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
