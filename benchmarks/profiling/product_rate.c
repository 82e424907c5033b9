// One thread's issue rate of 512-bit VFMADD231PS and VDPBF16PS, alone and mixed: what a
// bfloat16 multiply-add costs against a float32 one on this CPU (docs/cpu.md). 12
// independent accumulator chains, so the rate is throughput, not latency:
//   gcc -O2 -march=sapphirerapids -o /tmp/product_rate benchmarks/profiling/product_rate.c
//   /tmp/product_rate
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { kChains = 12 };
static const long kSteps = 100000000 / kChains;

int main(void) {
  __m512 dp[kChains], fm[kChains];
  for (int i = 0; i < kChains; ++i) dp[i] = fm[i] = _mm512_set1_ps(i * 1e-3f);
  const __m512 b = _mm512_set1_ps(0.5f), c = _mm512_set1_ps(1.0f);  // chains stay finite
  const __m512bh one = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  // fmas: float32 FMAs issued beside each VDPBF16PS (-1: FMAs alone).
  for (int fmas = -1; fmas <= 2; ++fmas) {
    const double t0 = now();
    for (long n = 0; n < kSteps; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) {
        if (fmas >= 0) dp[i] = _mm512_dpbf16_ps(dp[i], one, one);
        if (fmas < 0 || fmas >= 1) fm[i] = _mm512_fmadd_ps(fm[i], b, c);
        if (fmas >= 2) fm[i] = _mm512_fmadd_ps(fm[i], c, b);
      }
    }
    const double ns = (now() - t0) / ((double)kSteps * kChains) * 1e9;
    if (fmas < 0)
      printf("VFMADD231PS alone: %.3f ns each\n", ns);
    else
      printf("VDPBF16PS with %d FMA(s) beside it: %.3f ns a step\n", fmas, ns);
  }
  float sink = 0;
  for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(dp[i] + fm[i]);
  printf("(%g)\n", sink);
  return 0;
}
