/* Peak of the dot-product instructions the int4 kernel is built on, one core: AVX512-BF16 vdpbf16ps
 * (32 bf16 multiply-adds each) and AVX512-VNNI vpdpbusd (64 int8 multiply-adds each), 12 independent
 * accumulators so latency hides behind throughput; best of 5 runs.
 *   cc -O2 -mavx512f -mavx512bf16 -mavx512vnni benchmarks/dot_peak.c -o /tmp/dot_peak && /tmp/dot_peak
 * docs/decisions/int4-matmul.md compares the kernel's marginal verify row against it. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ACC 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    __m512 acc[ACC];
    __m512i iacc[ACC];
    for (int k = 0; k < ACC; k++) {
        acc[k] = _mm512_setzero_ps();
        iacc[k] = _mm512_setzero_si512();
    }
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512i ia = _mm512_set1_epi8(1), ib = _mm512_set1_epi8(2);
    const long n = 200000000;
    double best = 1e9, besti = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        double t = now();
        for (long i = 0; i < n / ACC; i++)
            for (int k = 0; k < ACC; k++) acc[k] = _mm512_dpbf16_ps(acc[k], a, b);
        t = now() - t;
        if (t < best) best = t;
        t = now();
        for (long i = 0; i < n / ACC; i++)
            for (int k = 0; k < ACC; k++) iacc[k] = _mm512_dpbusd_epi32(iacc[k], ia, ib);
        t = now() - t;
        if (t < besti) besti = t;
    }
    float sum = 0;
    int isum = 0;
    for (int k = 0; k < ACC; k++) {  /* use the results so the loops are kept */
        sum += _mm512_reduce_add_ps(acc[k]);
        isum += _mm512_reduce_add_epi32(iacc[k]);
    }
    printf("vdpbf16ps: %.2f G instr/s (%.1f GMAC/s); vpdpbusd: %.2f G instr/s (%.1f GMAC/s) [%g %d]\n",
           n / best / 1e9, n / best / 1e9 * 32, n / besti / 1e9, n / besti / 1e9 * 64, sum, isum);
    return 0;
}
