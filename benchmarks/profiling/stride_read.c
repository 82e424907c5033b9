// Read bandwidth over 512 MiB on T threads (each its own half, third, ... of the buffer), in
// order or in the orders a CPU decode walks a slot-major cache [keys][heads][R bytes]: what a
// decode can hope for on this machine (docs/cpu.md). prefetcht1 `dist` bytes (in order) or
// keys (walks) ahead; 0: the hardware prefetchers alone.
//   gcc -O2 -march=native -pthread -o /tmp/stride_read benchmarks/profiling/stride_read.c
//   /tmp/stride_read T 0 0                    in order
//   /tmp/stride_read T 1 2048                 in order, prefetching 2 KiB ahead
//   /tmp/stride_read T 2 64 256 2048          one head's 256-byte rows (bf16 D128) of 8 heads,
//                                             every key of a head before the next head
//   /tmp/stride_read T 3 32 256 2048 32       the kernel's walk: blocks of 32 keys, each head's
//                                             rows of a block in turn, that head's rows of the
//                                             next block prefetched as they are read
//   /tmp/stride_read T 4 32 256 2048          keys two at a time, every head's rows of the two
//                                             (the cache in address order), 32 keys ahead
// Prints one line of JSON.
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define VZERO _mm512_setzero_ps
#define VADD _mm512_add_ps
#define VLOAD _mm512_load_ps
#define VFIRST(v) _mm512_cvtss_f32(v)
#define ISA "avx512"
#elif defined(__AVX__)
typedef __m256 vec;
#define VZERO _mm256_setzero_ps
#define VADD _mm256_add_ps
#define VLOAD _mm256_load_ps
#define VFIRST(v) _mm256_cvtss_f32(v)
#define ISA "avx"
#else
#error "needs AVX or AVX-512"
#endif

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int mode;
static long dist, R = 256, S = 2048, blk = 32;

typedef struct {
  const char* a;
  size_t bytes;
  float sum;
} Part;

static inline vec read_row(vec acc, const char* p, long bytes) {
  for (long x = 0; x < bytes; x += (long)sizeof(vec)) acc = VADD(acc, VLOAD((const float*)(p + x)));
  return acc;
}
static inline void prefetch_row(const char* p, long bytes) {
  for (long x = 0; x < bytes; x += 64) _mm_prefetch(p + x, _MM_HINT_T1);
}

static void* read_part(void* arg) {
  Part* part = arg;
  const char* a = part->a;
  const size_t n = part->bytes, keys = n / S;
  const long heads = S / R;
  vec acc = VZERO();
  if (mode < 2) {
    for (size_t i = 0; i < n; i += 64) {
      if (mode == 1 && i + dist < n) _mm_prefetch(a + i + dist, _MM_HINT_T1);
      acc = read_row(acc, a + i, 64);
    }
  } else if (mode == 2 || mode == 3) {  // mode 2: one block of every key
    const size_t block = mode == 2 ? keys : (size_t)blk;
    for (size_t j0 = 0; j0 < keys; j0 += block)
      for (long h = 0; h < heads; h++)
        for (size_t j = j0; j < j0 + block && j < keys; j++) {
          const char* p = a + j * S + h * R;
          if (dist && j + dist < keys) prefetch_row(p + dist * S, R);
          acc = read_row(acc, p, R);
        }
  } else {
    for (size_t j = 0; j + 2 <= keys; j += 2) {
      if (dist && j + dist + 2 <= keys) prefetch_row(a + (j + dist) * S, 2 * S);
      for (long h = 0; h < heads; h++) {
        acc = read_row(acc, a + j * S + h * R, R);
        acc = read_row(acc, a + (j + 1) * S + h * R, R);
      }
    }
  }
  part->sum = VFIRST(acc);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s threads mode dist [row_bytes stride_bytes [block_keys]]\n",
            argv[0]);
    return 2;
  }
  const int threads = atoi(argv[1]);
  mode = atoi(argv[2]);
  dist = atol(argv[3]);
  if (argc > 4) R = atol(argv[4]);
  if (argc > 5) S = atol(argv[5]);
  if (argc > 6) blk = atol(argv[6]);
  if (threads < 1 || threads > 64 || mode < 0 || mode > 4 || R <= 0 || R % 64 || S < R ||
      S % R || blk < 1) {
    fprintf(stderr, "threads 1-64, mode 0-4, row bytes a multiple of 64 dividing the stride\n");
    return 2;
  }
  const size_t n = (size_t)512 << 20, part_bytes = n / threads / S * S;
  char* a = aligned_alloc(4096, n);
  memset(a, 1, n);
  double best = 1e9;
  float sum = 0;
  for (int rep = 0; rep < 7; rep++) {
    Part parts[64];
    pthread_t tid[64];
    const double t0 = now();
    for (int t = 0; t < threads; t++) {
      parts[t] = (Part){a + t * part_bytes, part_bytes, 0};
      pthread_create(&tid[t], NULL, read_part, &parts[t]);
    }
    for (int t = 0; t < threads; t++) {
      pthread_join(tid[t], NULL);
      sum += parts[t].sum;
    }
    const double t = now() - t0;
    if (t < best) best = t;
  }
  printf("{\"isa\": \"%s\", \"threads\": %d, \"mode\": %d, \"dist\": %ld, \"row_bytes\": %ld, "
         "\"stride_bytes\": %ld, \"block_keys\": %ld, \"GB/s\": %.1f, \"checksum\": %g}\n",
         ISA, threads, mode, dist, R, S, blk, part_bytes * threads / best / 1e9, sum);
  free(a);
  return 0;
}
