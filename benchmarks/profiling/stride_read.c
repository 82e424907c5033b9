// One thread's read bandwidth over 512 MiB, in order or walking one head of a slot-major
// cache (rows of R bytes, one every S bytes, all rows of a head before the next head), with
// prefetcht1 `dist` bytes (in order) or rows (walk) ahead. What a CPU decode can hope for on
// this machine (docs/cpu.md):
//   gcc -O2 -mavx512f -o /tmp/stride_read benchmarks/profiling/stride_read.c
//   /tmp/stride_read 0 0            in order
//   /tmp/stride_read 1 2048         in order, prefetching 2 KiB ahead
//   /tmp/stride_read 2 64 256 2048  one head's 256-byte rows (bf16 D128) of 8 heads, 64 rows ahead
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s mode dist [row_bytes stride_bytes]\n", argv[0]);
    return 2;
  }
  const size_t n = (size_t)512 << 20;
  char* a = aligned_alloc(4096, n);
  memset(a, 1, n);
  const int mode = atoi(argv[1]);
  const long dist = atol(argv[2]);
  const long R = argc > 3 ? atol(argv[3]) : 256, S = argc > 4 ? atol(argv[4]) : 2048;
  if (mode == 2 && (R <= 0 || R % 64 || S < R || S % R)) {
    fprintf(stderr, "row bytes: a multiple of 64 dividing the stride\n");
    return 2;
  }
  double best = 1e9;
  __m512 acc = _mm512_setzero_ps();
  for (int rep = 0; rep < 5; rep++) {
    const double t0 = now();
    if (mode < 2) {
      for (size_t i = 0; i < n; i += 64) {
        if (mode == 1 && i + dist < n) _mm_prefetch(a + i + dist, _MM_HINT_T1);
        acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(a + i)));
      }
    } else {
      const long heads = S / R;
      const size_t rows = n / S;
      for (long h = 0; h < heads; h++)
        for (size_t r = 0; r < rows; r++) {
          const char* p = a + r * S + h * R;
          if (dist && r + dist < rows)
            for (long x = 0; x < R; x += 64) _mm_prefetch(p + dist * S + x, _MM_HINT_T1);
          for (long x = 0; x < R; x += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(p + x)));
        }
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  float f[16];
  _mm512_storeu_ps(f, acc);
  printf("mode %d dist %ld row %ld stride %ld: %.1f GB/s (checksum %g)\n", mode, dist, R, S,
         n / best / 1e9, f[0]);
  free(a);
  return 0;
}
