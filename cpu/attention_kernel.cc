// One ISA variant of the CPU flash-attention kernel. CMake compiles this file
// once per variant with -DJAX_SDPA_CPU_ISA=<namespace> and matching -march
// flags; everything here has internal linkage or lives in that namespace, and
// no std template is instantiated, so a wide-ISA copy of an inline function can
// never be what a narrower caller links to.
//
// Layout of the work (docs/ffi_contract.md has the semantics):
// - A "row" of a (batch b, kv head hk) pair is (query i, head g of the group),
//   numbered r = i * G + g, so a query tile holds all heads of a GQA group that
//   share the kv head (decode with Lq = 1 still fills the tile).
// - Scores are computed transposed, S^T[key][row] = K · Q^T, so the softmax
//   statistics of a query are a vector lane and every step of the online
//   softmax is a plain vector op; the product with V is O^T += V^T · P^T.
// - Every product goes through one register-blocked micro-kernel
//   C[MR x NR*W] += A[MR x K] · B[K x NR*W] with A read by broadcast (any
//   strides, so K and V rows are used in place for float32) and B/C rows of
//   contiguous vectors in scratch padded to a multiple of W.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu/attention_kernel.h"

#ifndef JAX_SDPA_CPU_ISA
#error "compile with -DJAX_SDPA_CPU_ISA=<variant namespace>"
#endif

namespace jax_sdpa {
namespace cpu {
namespace JAX_SDPA_CPU_ISA {
namespace {

// ---- vectors ------------------------------------------------------------------
#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MR = 6, NR = 4;  // 24 zmm accumulators + 4 B vectors + 1 broadcast
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int MR = 6, NR = 2;  // 12 + 2 + 1 of 16 ymm
#else
constexpr int W = 4;
constexpr int MR = 6, NR = 2;  // 12 + 2 + 1 of 16 xmm/NEON registers (of 32 on NEON)
#endif
constexpr int64_t kBq = 64;  // rows (queries x group heads) per tile
constexpr int64_t kBk = 64;  // keys per block
constexpr int64_t kSplitKeys = 512;  // fewest key rows worth a task of their own (split keys)
constexpr int64_t kGroupHeads = 16;  // most kv heads one forward task walks together

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

// x - 0 folds to x (x + 0 would not: -0.0 + 0 = +0.0), leaving one broadcast.
inline vf splat(float x) { return x - vf{}; }
inline vf loadv(const float* p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, vf v) { memcpy(p, &v, sizeof v); }
// W row elements as float32 vectors: float32 as they are, bfloat16 (its bits, uint16_t)
// widened in registers (exact: a bf16 is the top half of a float32).
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
inline vf load_elems(const float* p) { return loadv(p); }
inline vf load_elems(const uint16_t* p) {
  vh h;
  memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
inline vf select(vi m, vf a, vf b) { return (vf)((m & (vi)a) | (~m & (vi)b)); }
// a > b ? a : b (NaN b stays, NaN a gives b): what MAXPS computes, one instruction.
#if defined(__AVX512F__)
inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__)
inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
#else
inline vf vmax(vf a, vf b) { return select(a > b, a, b); }
#endif
// a < b ? a : b: MINPS.
#if defined(__AVX512F__)
inline vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
#elif defined(__AVX__)
inline vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
#else
inline vf vmin(vf a, vf b) { return select(a < b, a, b); }
#endif
// min(x, 0) that keeps NaN (x > 0 is false for NaN).
inline vf clamp_nonpositive(vf x) { return select(x > splat(0.0f), splat(0.0f), x); }

// exp on [-87, 88] (Cody-Waite reduction + degree-6 polynomial, ~1 ulp);
// below -87 (including -inf) it returns exactly 0: masked scores vanish.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  vi under = x < lo;
  x = vmax(lo, vmin(hi, x));  // NaN stays NaN
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x * splat(1.44269504088896341f) + magic;
  vf n = t - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  vf y = p * r * r + r + splat(1.0f);
  vi e = ((vi)t - (vi)magic + 127) << 23;  // 2^n
  y = y * (vf)e;
  return select(under, splat(0.0f), y);
}

// 1 / q for q >= 1: the hardware's reciprocal estimate (AVX-512: 14 bits, AVX: 12) and one
// Newton step (~1 ulp), where a division would cost as much as the rest of vtanh together.
inline vf vrecip(vf q) {
#if defined(__AVX512F__)
  vf r = (vf)_mm512_rcp14_ps((__m512)q);
#elif defined(__AVX__)
  vf r = (vf)_mm256_rcp_ps((__m256)q);
#else
  return splat(1.0f) / q;
#endif
#if defined(__AVX__)
  return r * (splat(2.0f) - q * r);
#endif
}

// tanh: x * P(x^2) / Q(x^2) on x clamped to [-9, 9] (tanh(9) rounds to 1), a rational
// least-squares fit of relative error (8e-8 in exact arithmetic, ~4e-7 evaluated in float32).
// No exp and no division (vrecip): the soft-capped path stays close to the plain one. NaN
// stays NaN.
inline vf vtanh(vf x) {
  x = select(x > splat(9.0f), splat(9.0f), x);
  x = select(x < splat(-9.0f), splat(-9.0f), x);
  const vf y = x * x;
  vf p = splat(1.89672167e-11f);
  p = p * y + splat(-1.30800461e-08f);
  p = p * y + splat(9.37335348e-06f);
  p = p * y + splat(2.93278860e-03f);
  p = p * y + splat(1.29305589e-01f);
  p = p * y + splat(9.99999964e-01f);
  vf q = splat(2.29738435e-04f);
  q = q * y + splat(2.38128389e-02f);
  q = q * y + splat(4.62638578e-01f);
  q = q * y + splat(1.0f);
  return x * p * vrecip(q);
}

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t abs64(int64_t a) { return a < 0 ? -a : a; }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---- dtype conversion ---------------------------------------------------------
inline float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float f16_to_f32(uint16_t h) {
  // Exponent/mantissa moved into float position and rebiased by 2^112; this
  // also turns f16 subnormals into the right float. Inf/NaN set exponent 255.
  uint32_t em = h & 0x7fffu;
  uint32_t bits = f32_to_bits(bits_to_f32(em << 13) * 0x1p112f);
  if (em >= 0x7c00u) bits = (em << 13) | 0x7f800000u;
  return bits_to_f32(bits | ((uint32_t)(h & 0x8000u) << 16));
}
inline uint16_t f32_to_f16(float f) {  // round to nearest even
  uint32_t x = f32_to_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u);
  if (x >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (x < 0x38800000u) {  // below 2^-14: f16 subnormal; 0.5f's ulp is 2^-24
    float a = bits_to_f32(x) + 0.5f;
    return sign | (uint16_t)(f32_to_bits(a) - 0x3f000000u);
  }
  uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent by -112, round half to even
  return sign | (uint16_t)(x >> 13);
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t x = f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

// n elements of src (at element offset idx) to float.
void load_row(const void* src, DType t, int64_t idx, int64_t n, float* dst) {
  if (t == DType::kF32) {
    memcpy(dst, static_cast<const float*>(src) + idx, n * sizeof(float));
  } else if (t == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src) + idx;
    for (int64_t x = 0; x < n; ++x) dst[x] = bits_to_f32((uint32_t)s[x] << 16);
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + idx;
    for (int64_t x = 0; x < n; ++x) dst[x] = f16_to_f32(s[x]);
  }
}
inline float load_one(const void* src, DType t, int64_t idx) {
  float f;
  load_row(src, t, idx, 1, &f);
  return f;
}
// n floats (times mul) to dst at element offset idx, rounded once.
void store_row(void* dst, DType t, int64_t idx, const float* src, float mul, int64_t n) {
  if (t == DType::kF32) {
    float* d = static_cast<float*>(dst) + idx;
    for (int64_t x = 0; x < n; ++x) d[x] = src[x] * mul;
  } else if (t == DType::kBF16) {
    uint16_t* d = static_cast<uint16_t*>(dst) + idx;
    for (int64_t x = 0; x < n; ++x) d[x] = f32_to_bf16(src[x] * mul);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + idx;
    for (int64_t x = 0; x < n; ++x) d[x] = f32_to_f16(src[x] * mul);
  }
}
void store_zeros(void* dst, DType t, int64_t idx, int64_t n) {
  if (n <= 0) return;  // an empty buffer may have no address
  size_t es = t == DType::kF32 ? 4 : 2;
  memset(static_cast<char*>(dst) + idx * es, 0, n * es);
}

// ---- the micro-kernel ---------------------------------------------------------
// C[r][x] (+)= sum_k A[r * rs + k * ks] * B[k * ldb + x], r < M_, x < N_ * W.
template <int M_, int N_>
void micro(int64_t K, const float* __restrict A, int64_t rs, int64_t ks,
           const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
           bool accumulate) {
  vf acc[M_][N_];
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) acc[r][x] = accumulate ? loadv(C + r * ldc + x * W) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[N_];
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) b[x] = loadv(B + k * ldb + x * W);
    const float* a = A + k * ks;
#pragma GCC unroll 8
    for (int r = 0; r < M_; ++r) {
      vf av = splat(a[r * rs]);
#pragma GCC unroll 8
      for (int x = 0; x < N_; ++x) acc[r][x] += av * b[x];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) storev(C + r * ldc + x * W, acc[r][x]);
}

using MicroFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                         int64_t, bool);
constexpr int nr_clamp(int x) { return x < NR ? x : NR; }
#define JAX_SDPA_MICRO_ROW(m) \
  {micro<m, nr_clamp(1)>, micro<m, nr_clamp(2)>, micro<m, nr_clamp(3)>, micro<m, nr_clamp(4)>}
static_assert(MR == 6 && NR <= 4, "micro-kernel table below is written for MR = 6, NR <= 4");
const MicroFn kMicro[6][4] = {JAX_SDPA_MICRO_ROW(1), JAX_SDPA_MICRO_ROW(2), JAX_SDPA_MICRO_ROW(3),
                              JAX_SDPA_MICRO_ROW(4), JAX_SDPA_MICRO_ROW(5), JAX_SDPA_MICRO_ROW(6)};
#undef JAX_SDPA_MICRO_ROW

// C[M x N] (+)= A[M x K] · B[K x N]; N a multiple of W. A by broadcast with
// strides (rs, ks); B and C row-major with leading dims ldb, ldc.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rs, int64_t ks, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += NR * W) {
    int nv = (int)min64((N - n0) / W, NR);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      int mr = (int)min64(M - m0, MR);
      kMicro[mr - 1][nv - 1](K, A + m0 * rs, rs, ks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                             accumulate);
    }
  }
}

// ---- bfloat16 products (AVX512-BF16) ---------------------------------------------
// VDPBF16PS adds the two products of a pair of bfloat16s to each float32 lane, exactly
// rounded products (bf16 * bf16 fits a float32), so a bf16 GEMM takes half the instructions
// of the float32 one and needs no conversion of K and V to float32. The bfloat16 forward's
// two products run here: S^T = K · Q^T with pairs along d (K rows as they are in memory,
// Q^T packed [D/2][np] pairs), and O^T += V^T · P^T with pairs along keys (V packed
// [keys/2][Dv] pairs, P rounded to bf16 [keys/2][np] pairs; the softmax sums use P unrounded,
// as GPU flash kernels do). The backward's S^T and dP^T = V · dO^T (pairs along d, products of
// inputs) run here too; its dV, dK, dQ would need P and dS rounded and stay float32. The
// instruction treats bf16 subnormals as 0.
#if defined(__AVX512BF16__)
// Whether this call's forward products take the bf16 GEMM (non-narrow tiles).
inline bool bf16_products(const SdpaParams& p) { return p.dtype == DType::kBF16; }

// C[r][x] (+)= sum_k dot2(A[r * rs + k * ks], B[k * ldb + x]), r < M_, x < N_ * W: A and B
// hold pairs of bf16 as 32-bit words.
template <int M_, int N_>
void micro_bf16(int64_t K2, const uint32_t* __restrict A, int64_t rs, int64_t ks,
                const uint32_t* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                bool accumulate) {
  __m512 acc[M_][N_];
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x)
      acc[r][x] = accumulate ? _mm512_loadu_ps(C + r * ldc + x * W) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[N_];
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) b[x] = (__m512bh)_mm512_loadu_si512(B + k * ldb + x * W);
    const uint32_t* a = A + k * ks;
#pragma GCC unroll 8
    for (int r = 0; r < M_; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * rs]);
#pragma GCC unroll 8
      for (int x = 0; x < N_; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], av, b[x]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) _mm512_storeu_ps(C + r * ldc + x * W, acc[r][x]);
}

using MicroBf16Fn = void (*)(int64_t, const uint32_t*, int64_t, int64_t, const uint32_t*,
                             int64_t, float*, int64_t, bool);
#define JAX_SDPA_MICRO_ROW(m)                                                 \
  {micro_bf16<m, nr_clamp(1)>, micro_bf16<m, nr_clamp(2)>, micro_bf16<m, nr_clamp(3)>, \
   micro_bf16<m, nr_clamp(4)>}
const MicroBf16Fn kMicroBf16[6][4] = {JAX_SDPA_MICRO_ROW(1), JAX_SDPA_MICRO_ROW(2),
                                      JAX_SDPA_MICRO_ROW(3), JAX_SDPA_MICRO_ROW(4),
                                      JAX_SDPA_MICRO_ROW(5), JAX_SDPA_MICRO_ROW(6)};
#undef JAX_SDPA_MICRO_ROW

// gemm over K2 pairs: C[M x N] (+)= A[M x 2*K2] · B[2*K2 x N], N a multiple of W.
void gemm_bf16(int64_t M, int64_t N, int64_t K2, const uint32_t* A, int64_t rs, int64_t ks,
               const uint32_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += NR * W) {
    int nv = (int)min64((N - n0) / W, NR);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      int mr = (int)min64(M - m0, MR);
      kMicroBf16[mr - 1][nv - 1](K2, A + m0 * rs, rs, ks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                                 accumulate);
    }
  }
}

// Pp[q][c] = (bf16(P[2q][c]), bf16(P[2q+1][c])) for q < ceil(jn / 2), the pair of an odd
// last key zero; P is float32 [jn][np].
void pack_p_pairs(const float* P, int64_t jn, int64_t np, uint32_t* Pp) {
  const __m512i lanes = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const float* lo = P + 2 * q * np;
    const float* hi = 2 * q + 1 < jn ? lo + np : nullptr;
    for (int64_t c0 = 0; c0 < np; c0 += W) {
      const __m512 a = _mm512_loadu_ps(lo + c0);
      const __m512 b = hi ? _mm512_loadu_ps(hi + c0) : _mm512_setzero_ps();
      const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in words 0..15, b above
      _mm512_storeu_si512(Pp + q * np + c0, _mm512_permutexvar_epi16(lanes, ab));
    }
  }
}
// Qp[q][c] = the bf16 pair (Qt[2q][c], Qt[2q+1][c]) of float32 Qt [D][np] that holds bf16
// values (truncation is exact), the pair of an odd last d zero.
void pack_q_pairs(const float* Qt, int64_t D, int64_t np, uint32_t* Qp) {
  for (int64_t q = 0; 2 * q < D; ++q)
    for (int64_t c = 0; c < np; ++c) {
      const uint32_t lo = f32_to_bits(Qt[2 * q * np + c]) >> 16;
      const uint32_t hi = 2 * q + 1 < D ? f32_to_bits(Qt[(2 * q + 1) * np + c]) >> 16 : 0u;
      Qp[q * np + c] = lo | hi << 16;
    }
}

// A bf16 row of n as (n + 1) / 2 pairs, an odd n's last pair zero-padded; null: zeros.
void pack_row_pairs(const uint16_t* row, int64_t n, uint32_t* dst) {
  if (!row) {
    memset(dst, 0, (n + 1) / 2 * sizeof(uint32_t));
    return;
  }
  memcpy(dst, row, n / 2 * sizeof(uint32_t));
  if (n % 2) dst[n / 2] = row[n - 1];
}

// A block's keys as bf16 pairs: Kp[j][D2] pairs along d, Vp[q][Dv] pairs along keys (V rows
// 2q, 2q+1; an odd block's last partner zero). Hidden keys (null rows) are zero: their P is 0.
void pack_kv_pairs(const uint16_t* const* krow, const uint16_t* const* vrow, int64_t jn,
                   int64_t D, int64_t Dv, uint32_t* Kp, uint32_t* Vp) {
  for (int64_t j = 0; j < jn; ++j) pack_row_pairs(krow[j], D, Kp + j * ((D + 1) / 2));
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const uint16_t* a = vrow[2 * q];
    const uint16_t* b = 2 * q + 1 < jn ? vrow[2 * q + 1] : nullptr;
    uint32_t* vd = Vp + q * Dv;
    if (a && b) {
      for (int64_t d = 0; d < Dv; ++d) vd[d] = (uint32_t)a[d] | (uint32_t)b[d] << 16;
    } else if (a || b) {
      const uint16_t* x = a ? a : b;
      const int sh = a ? 0 : 16;
      for (int64_t d = 0; d < Dv; ++d) vd[d] = (uint32_t)x[d] << sh;
    } else {
      memset(vd, 0, Dv * sizeof(uint32_t));
    }
  }
}
#endif  // __AVX512BF16__

// ---- scratch --------------------------------------------------------------------
// One aligned block per participant, carved into float arrays.
struct Arena {
  char* base = nullptr;
  size_t per = 0;  // bytes per participant
};
inline size_t floats_bytes(int64_t n) { return (size_t)round_up(n * 4, 64); }
bool arena_alloc(Arena* a, size_t per, int participants) {
  a->per = (size_t)round_up((int64_t)per, 64);
  a->base = static_cast<char*>(aligned_alloc(64, a->per * participants));
  return a->base != nullptr;
}
struct Carver {
  char* p;
  float* floats(int64_t n) {
    float* r = reinterpret_cast<float*>(p);
    p += floats_bytes(n);
    return r;
  }
  int32_t* i32(int64_t n) {
    int32_t* r = reinterpret_cast<int32_t*>(p);
    p += (size_t)round_up(n * 4, 64);
    return r;
  }
  int64_t* ints(int64_t n) {
    int64_t* r = reinterpret_cast<int64_t*>(p);
    p += (size_t)round_up(n * 8, 64);
    return r;
  }
};

// ---- packed sequences -------------------------------------------------------------
// The [lo, hi] range of the kv segment ids of every aligned block of kBk keys of every
// batch row, computed once per call: a (query tile, key block) pair whose ranges do not
// overlap has no visible pair and is skipped (exact for sorted packing, conservative else).
struct SegBlocks {
  const int32_t* q_ids = nullptr;   // null: no segment ids
  const int32_t* kv_ids = nullptr;
  int32_t* lo = nullptr;            // [B][nblk]
  int32_t* hi = nullptr;
  int64_t nblk = 0;
};

bool seg_blocks_build(const SdpaParams& p, SegBlocks* s) {
  if (!p.q_segment_ids) return true;
  s->q_ids = p.q_segment_ids;
  s->kv_ids = p.kv_segment_ids;
  s->nblk = (p.len_kv + kBk - 1) / kBk;
  const int64_t n = max64(1, p.batch * s->nblk);
  s->lo = static_cast<int32_t*>(malloc(2 * n * sizeof(int32_t)));
  if (!s->lo) return false;
  s->hi = s->lo + n;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t blk = 0; blk < s->nblk; ++blk) {
      const int32_t* ids = p.kv_segment_ids + b * p.len_kv;
      int32_t lo = INT32_MAX, hi = INT32_MIN;
      for (int64_t j = blk * kBk; j < min64(p.len_kv, (blk + 1) * kBk); ++j) {
        lo = ids[j] < lo ? ids[j] : lo;
        hi = ids[j] > hi ? ids[j] : hi;
      }
      s->lo[b * s->nblk + blk] = lo;
      s->hi[b * s->nblk + blk] = hi;
    }
  return true;
}

// What keys [j0, j0 + jn) of row b need against a tile of query ids in [qlo, qhi].
enum class SegCover { kNone, kAll, kPartial };
SegCover seg_cover(const SegBlocks& s, int64_t b, int64_t j0, int64_t jn, int32_t qlo,
                   int32_t qhi) {
  if (!s.q_ids) return SegCover::kAll;
  if (jn <= 0 || qlo > qhi) return SegCover::kNone;
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  for (int64_t blk = j0 / kBk; blk <= (j0 + jn - 1) / kBk; ++blk) {
    lo = s.lo[b * s.nblk + blk] < lo ? s.lo[b * s.nblk + blk] : lo;
    hi = s.hi[b * s.nblk + blk] > hi ? s.hi[b * s.nblk + blk] : hi;
  }
  if (hi < qlo || lo > qhi) return SegCover::kNone;
  return lo == hi && qlo == qhi ? SegCover::kAll : SegCover::kPartial;
}

// ---- a query tile ---------------------------------------------------------------
struct Tile {
  int64_t b, hk, r0, n, np;  // rows r0 .. r0+n of (b, hk); np = n rounded up to W
  int64_t qlen, kvlen;
  int64_t *col_i, *col_h, *kf, *kl;  // per row: query, head, visible band [kf, kl)
  int64_t KF, KL;                    // union of the bands
  int64_t maxKF, minKL;              // a key block inside [maxKF, minKL) needs no band mask
  int32_t* qseg;                     // per row (np of them): its query's segment id
  int32_t qlo, qhi;                  // their range over rows that see a key (lo > hi: none)
};

void setup_tile(const SdpaParams& p, Tile* t) {
  const int64_t G = p.group();
  t->qlen = clamp_length(p.q_lengths, t->b, p.len_q);
  t->kvlen = clamp_length(p.kv_lengths, t->b, p.len_kv);
  const int64_t off = diagonal_offset(p.bottom_right, t->qlen, t->kvlen);
  t->np = round_up(t->n, W);
  t->KF = INT64_MAX;
  t->KL = 0;
  t->maxKF = 0;
  t->minKL = INT64_MAX;
  t->qlo = INT32_MAX;
  t->qhi = INT32_MIN;
  for (int64_t c = 0; c < t->n; ++c) {
    int64_t r = t->r0 + c, i = r / G;
    t->col_i[c] = i;
    t->col_h[c] = t->hk * G + r % G;
    int64_t f = 0, l = 0;
    if (i < t->qlen) {
      KeyRange kr = band_keys(i, off, p.window_left, p.window_right, t->kvlen);
      f = kr.first;
      l = kr.last;
    }
    t->kf[c] = f;
    t->kl[c] = l;
    if (l > f) {
      t->KF = min64(t->KF, f);
      t->KL = max64(t->KL, l);
    }
    t->maxKF = max64(t->maxKF, f);
    t->minKL = min64(t->minKL, l);
    if (p.q_segment_ids) {
      const int32_t id = p.q_segment_ids[t->b * p.len_q + i];
      t->qseg[c] = id;
      if (l > f) {
        t->qlo = id < t->qlo ? id : t->qlo;
        t->qhi = id > t->qhi ? id : t->qhi;
      }
    }
  }
  if (p.q_segment_ids)
    for (int64_t c = t->n; c < t->np; ++c) t->qseg[c] = t->n ? t->qseg[0] : 0;
  if (t->KL == 0) t->KF = 0;
}

// St[jn x np] holds q·k for keys j0.. of the tile; applies scale, the soft cap, the mask,
// the band and (seg == kPartial) the segment ids (-inf = invisible). Padding columns
// (c >= n) are left alone where masks apply. With a soft cap, dcap (when given) receives
// its derivative 1 - tanh^2 per score (backward).
void scale_and_mask(const SdpaParams& p, const Tile& t, int64_t j0, int64_t jn, float* St,
                    SegCover seg, float* dcap) {
  const int64_t np = t.np;
  if (p.logits_soft_cap > 0) {
    const vf pre = splat((float)(p.scale / p.logits_soft_cap));
    const vf cap = splat((float)p.logits_soft_cap);
    for (int64_t x = 0; x < jn * np; x += W) {
      vf th = vtanh(loadv(St + x) * pre);
      storev(St + x, cap * th);
      if (dcap) storev(dcap + x, splat(1.0f) - th * th);
    }
  } else {
    const vf sc = splat((float)p.scale);
    for (int64_t x = 0; x < jn * np; x += W) storev(St + x, loadv(St + x) * sc);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t* ms = p.mask_stride;
    for (int64_t c = 0; c < t.n; ++c) {
      if (t.kl[c] <= t.kf[c]) continue;  // invisible anyway
      int64_t base = t.b * ms[0] + t.col_h[c] * ms[1] + t.col_i[c] * ms[2] + j0 * ms[3];
      if (p.mask_kind == MaskKind::kBool) {
        const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base;
        for (int64_t j = 0; j < jn; ++j)
          if (!m[j * ms[3]]) St[j * np + c] = -INFINITY;
      } else if (p.mask_dtype == DType::kF32) {
        const float* m = static_cast<const float*>(p.mask) + base;
        for (int64_t j = 0; j < jn; ++j) St[j * np + c] += m[j * ms[3]];
      } else {
        for (int64_t j = 0; j < jn; ++j)
          St[j * np + c] += load_one(p.mask, p.mask_dtype, base + j * ms[3]);
      }
    }
  }
  if (j0 < t.maxKF || j0 + jn > t.minKL) {
    for (int64_t c = 0; c < t.n; ++c) {
      int64_t lo = min64(max64(t.kf[c] - j0, 0), jn), hi = min64(max64(t.kl[c] - j0, 0), jn);
      if (hi < lo) hi = lo;
      for (int64_t j = 0; j < lo; ++j) St[j * np + c] = -INFINITY;
      for (int64_t j = hi; j < jn; ++j) St[j * np + c] = -INFINITY;
    }
  }
  if (seg == SegCover::kPartial) {  // selected, not added: a NaN score of another segment goes
    const int32_t* kv = p.kv_segment_ids + t.b * p.len_kv + j0;
    const vf hidden = splat(-INFINITY);
    for (int64_t j = 0; j < jn; ++j) {
      vi id;
      for (int x = 0; x < W; ++x) id[x] = kv[j];
      for (int64_t c0 = 0; c0 < np; c0 += W) {
        vi qs;
        memcpy(&qs, t.qseg + c0, sizeof qs);
        storev(St + j * np + c0, select(qs == id, loadv(St + j * np + c0), hidden));
      }
    }
  }
}

// Qt[d][c] = X row of column c (zero for padding / invalid rows); also returns
// the row-major copy in Xr[c][dp] when asked (backward).
void pack_rows(const SdpaParams& p, const Tile& t, const void* X, const int64_t stride[3],
               int64_t dim, float* Xt, float* Xr, int64_t dp, float* tmp) {
  const int64_t np = t.np;
  for (int64_t c = 0; c < np; ++c) {
    bool live = c < t.n && t.col_i[c] < t.qlen;
    if (live) {
      load_row(X, p.dtype, t.b * stride[0] + t.col_h[c] * stride[1] + t.col_i[c] * stride[2], dim,
               tmp);
    } else {
      memset(tmp, 0, dim * sizeof(float));
    }
    for (int64_t d = 0; d < dim; ++d) Xt[d * np + c] = tmp[d];
    if (Xr) {
      memcpy(Xr + c * dp, tmp, dim * sizeof(float));
      memset(Xr + c * dp + dim, 0, (dp - dim) * sizeof(float));
    }
  }
}

// ---- where a block's keys live --------------------------------------------------
// Keys j .. j+n of a block whose K and V rows sit at constant strides from element
// offsets k and v of the K / V buffers; k < 0: a paged key whose page index is out of
// range (invisible, never read).
struct KeyRun {
  int64_t j, n, k, v;
};

// The runs of keys [j0, j0 + jn) of (b, hk): one for a contiguous cache, one per page
// touched for a paged one. Returns how many (at most jn).
int64_t key_runs(const SdpaParams& p, int64_t b, int64_t hk, int64_t j0, int64_t jn,
                 KeyRun* runs) {
  if (!p.paged()) {
    runs[0] = {0, jn, b * p.k_stride[0] + hk * p.k_stride[1] + j0 * p.k_stride[2],
               b * p.v_stride[0] + hk * p.v_stride[1] + j0 * p.v_stride[2]};
    return 1;
  }
  int64_t nr = 0;
  for (int64_t j = 0; j < jn;) {
    const PagedRow pr =
        paged_key_row(p.page_indices, p.pages_per_seq, p.page_size, p.num_pages, b, j0 + j);
    const int64_t n = min64(jn - j, p.page_size - pr.slot);
    if (pr.page < 0) {
      runs[nr++] = {j, n, -1, -1};
    } else {
      runs[nr++] = {j, n, pr.page * p.k_stride[0] + hk * p.k_stride[1] + pr.slot * p.k_stride[2],
                    pr.page * p.v_stride[0] + hk * p.v_stride[1] + pr.slot * p.v_stride[2]};
    }
    j += n;
  }
  return nr;
}

// ---- narrow tiles (decode) ---------------------------------------------------------
// A tile of at most kNarrow rows (decode: the heads of one GQA group) wastes most of the
// transposed micro-kernel's vector lanes and is bound by its broadcast loads. Here K and V
// rows are loaded as vectors instead: scores are dot products (W of them reduced at once by
// transpose_sum), O rows accumulate V rows scaled by broadcast probabilities. Rows are
// padded to a power of two NP2 <= W; keys go KJ = W / NP2 at a time.
constexpr int64_t kNarrow = W < 8 ? W : 8;

// lanes x of a, b: (x & h) ? a[x] + a[x + h] ... folded so the result holds a's pair sums
// where bit h of the lane is clear and b's where it is set.
template <int H>
__attribute__((always_inline)) inline vf fold(vf a, vf b) {
#if defined(__clang__)
  // clang has no two-source __builtin_shuffle with a mask vector: the same lanes, one by one
  // (GCC builds, the release ones, take the shuffle below)
  vf r;
  for (int x = 0; x < W; ++x) {
    const int lo = (x & H) ? W + x - H : x, hi = (x & H) ? W + x : x + H;
    r[x] = (lo < W ? a[lo] : b[lo - W]) + (hi < W ? a[hi] : b[hi - W]);
  }
  return r;
#else
  vi lo, hi;
  for (int x = 0; x < W; ++x) {
    lo[x] = (x & H) ? W + x - H : x;
    hi[x] = (x & H) ? W + x : x + H;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
#endif
}
template <int H>
__attribute__((always_inline)) inline void fold_level(vf* v, int n) {
  for (int i = 0; i < n / 2; ++i) v[i] = fold<H>(v[2 * i], v[2 * i + 1]);
}
constexpr int bitrev(int x) {
  int r = 0;
  for (int b = 1; b < W; b <<= 1) r = r * 2 + ((x & b) ? 1 : 0);
  return r;
}
// Lane x of the result is the sum of the lanes of v[x], x < W (v is overwritten). Always
// inlined: a call would keep the callers' accumulators in memory, stored every step.
__attribute__((always_inline)) inline vf transpose_sum(vf* v) {
  vf s[W];
#pragma GCC unroll 16
  for (int x = 0; x < W; ++x) s[x] = v[bitrev(x)];
  if constexpr (W >= 16) fold_level<8>(s, 16);
  if constexpr (W >= 8) fold_level<4>(s, 8);
  fold_level<2>(s, 4);
  fold_level<1>(s, 2);
  return s[0];
}

// St[j][c] = K row j · Q row c for j < jn, c < NP2 (columns NP2.. of St are left alone);
// kr[j] null: a hidden key, its row is 0 here.
// Software prefetch for decode, which reads every K and V row once: K rows kAheadRows ahead
// of the scores' loads, past the block's end into the next block's rows (next: kBk
// pointers, null for none or hidden, of kbytes each), and each V row into L2 as its K row is
// scored, for the values pass. The scores read KJ rows interleaved, which the hardware
// prefetcher does not follow from memory (half the bandwidth without this).
constexpr int64_t kAheadRows = 16;
struct NextRows {
  const char* const* k;
  int64_t kbytes;
};
inline void prefetch_row(const void* row, int64_t bytes, bool to_l1) {
  const char* r = static_cast<const char*>(row);
  if (to_l1)
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(r + x, 0, 3);
  else
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(r + x, 0, 2);
}

// T: the rows' element type (float, or uint16_t for bfloat16 bits read in place).
// vr: V rows to prefetch into L2 (null: none).
template <int NP2, typename T>
void narrow_scores(int64_t D, const void* const* kr, int64_t jn, const float* Qr, int64_t Dp,
                   const float* zero_row, float* St, int64_t np, const NextRows& nx,
                   const void* const* vr, int64_t vbytes) {
  constexpr int KJ = W / NP2;
  const T* zero = reinterpret_cast<const T*>(zero_row);  // all-zero bits: 0 in either type
  for (int64_t j0 = 0; j0 < jn; j0 += KJ) {
    const T* rows[KJ];
#pragma GCC unroll 16
    for (int u = 0; u < KJ; ++u)
      rows[u] = (j0 + u < jn && kr[j0 + u]) ? static_cast<const T*>(kr[j0 + u]) : zero;
    for (int64_t i = j0 + kAheadRows; i < j0 + kAheadRows + KJ; ++i) {
      if (i < jn) {
        if (kr[i]) prefetch_row(kr[i], D * (int64_t)sizeof(T), false);
      } else if (i - jn < kBk && nx.k[i - jn]) {
        prefetch_row(nx.k[i - jn], nx.kbytes, false);
      }
    }
    if (vr)
      for (int64_t u = j0; u < min64(jn, j0 + KJ); ++u)
        if (vr[u]) prefetch_row(vr[u], vbytes, false);
    vf acc[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) acc[s] = vf{};
    for (int64_t d = 0; d < D; d += W) {
      vf kv[KJ];
#pragma GCC unroll 16
      for (int u = 0; u < KJ; ++u) kv[u] = load_elems(rows[u] + d);
#pragma GCC unroll 8
      for (int c = 0; c < NP2; ++c) {
        const vf qv = loadv(Qr + c * Dp + d);
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) acc[u * NP2 + c] += kv[u] * qv;
      }
    }
    // transpose_sum overwrites its array: a copy, so that acc stays in registers in the loop
    // (handing acc itself kept it in memory, stored every step).
    vf sums[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) sums[s] = acc[s];
    float lanes[W];
    storev(lanes, transpose_sum(sums));
    for (int u = 0; u < KJ && j0 + u < jn; ++u)
      memcpy(St + (j0 + u) * np, lanes + u * NP2, NP2 * sizeof(float));
  }
}

// Or[c][d0 .. d0 + DVC*W) = alpha[c] * Or[c][..] + sum_j P[j][c] * V row j, c0 <= c < c0 + RP.
template <int RP, int DVC, typename T>
void narrow_values(int64_t c0, int64_t d0, const void* const* vr, int64_t jn, const float* P,
                   int64_t np, const float* alpha, float* Or, int64_t ldo) {
  vf acc[RP][DVC];
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u)
      acc[c][u] = loadv(Or + (c0 + c) * ldo + d0 + u * W) * splat(alpha[c0 + c]);
  for (int64_t j = 0; j < jn; ++j) {
    if (!vr[j]) continue;  // hidden: P = 0 and never read
    vf vv[DVC];
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u) vv[u] = load_elems(static_cast<const T*>(vr[j]) + d0 + u * W);
#pragma GCC unroll 8
    for (int c = 0; c < RP; ++c) {
      const vf pc = splat(P[j * np + c0 + c]);
#pragma GCC unroll 16
      for (int u = 0; u < DVC; ++u) acc[c][u] += pc * vv[u];
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u) storev(Or + (c0 + c) * ldo + d0 + u * W, acc[c][u]);
}

// Accumulators the values kernel keeps in registers (half the vector registers).
constexpr int kValueAccs = W >= 16 ? 16 : 8;
// Rows a pass takes: as many of np2 as kValueAccs / DVC accumulators allow (at least 1).
constexpr int rows_per_pass(int np2, int dvc) {
  return np2 * dvc <= kValueAccs ? np2 : (kValueAccs / dvc < 1 ? 1 : kValueAccs / dvc);
}

// Columns d0 .. d0 + DVC*W of every row c < NP2, rows_per_pass of them a pass.
template <int NP2, int DVC, typename T>
void narrow_values_rows(int64_t d0, const void* const* vr, int64_t jn, const float* P,
                        int64_t np, const float* alpha, float* Or, int64_t ldo) {
  constexpr int RP = rows_per_pass(NP2, DVC);
  for (int64_t c0 = 0; c0 < NP2; c0 += RP)
    narrow_values<RP, DVC, T>(c0, d0, vr, jn, P, np, alpha, Or, ldo);
}

// O rows += P . V, in column chunks of up to kValueAccs vectors. Each pass reads its chunk
// of every V row in key order, so at D <= kValueAccs * W whole rows in order: passes over
// the block's rows a few vectors each defeat the hardware prefetcher when V comes from
// memory (decode), about 2.7x slower reads.
template <int NP2, typename T>
void narrow_values_all(int64_t Dv, const void* const* vr, int64_t jn, const float* P,
                       int64_t np, const float* alpha, float* Or, int64_t ldo) {
  int64_t d0 = 0;
  for (; d0 + kValueAccs * W <= Dv; d0 += kValueAccs * W)
    narrow_values_rows<NP2, kValueAccs, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  if constexpr (kValueAccs > 8)
    for (; d0 + 8 * W <= Dv; d0 += 8 * W)
      narrow_values_rows<NP2, 8, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  for (; d0 + 4 * W <= Dv; d0 += 4 * W) narrow_values_rows<NP2, 4, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  for (; d0 < Dv; d0 += W) narrow_values_rows<NP2, 1, T>(d0, vr, jn, P, np, alpha, Or, ldo);
}

int np2_for(int64_t n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }

template <typename T>
void narrow_scores_np2(int np2, int64_t D, const void* const* kr, int64_t jn, const float* Qr,
                       int64_t Dp, const float* zero_row, float* St, int64_t np,
                       const NextRows& nx, const void* const* vr, int64_t vbytes) {
  switch (np2) {
    case 1: return narrow_scores<1, T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
    case 2: return narrow_scores<2, T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
    case 4: return narrow_scores<(W >= 4 ? 4 : 1), T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
    default: return narrow_scores<(W >= 8 ? 8 : 1), T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
  }
}
// bf16: the rows are bfloat16 bits read in place, else float32.
void narrow_scores_any(bool bf16, int np2, int64_t D, const void* const* kr, int64_t jn,
                       const float* Qr, int64_t Dp, const float* zero_row, float* St,
                       int64_t np, const NextRows& nx, const void* const* vr, int64_t vbytes) {
  if (bf16) return narrow_scores_np2<uint16_t>(np2, D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
  narrow_scores_np2<float>(np2, D, kr, jn, Qr, Dp, zero_row, St, np, nx, vr, vbytes);
}
template <typename T>
void narrow_values_np2(int np2, int64_t Dv, const void* const* vr, int64_t jn, const float* P,
                       int64_t np, const float* alpha, float* Or, int64_t ldo) {
  switch (np2) {
    case 1: return narrow_values_all<1, T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    case 2: return narrow_values_all<2, T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    case 4: return narrow_values_all<(W >= 4 ? 4 : 1), T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    default: return narrow_values_all<(W >= 8 ? 8 : 1), T>(Dv, vr, jn, P, np, alpha, Or, ldo);
  }
}
void narrow_values_any(bool bf16, int np2, int64_t Dv, const void* const* vr, int64_t jn,
                       const float* P, int64_t np, const float* alpha, float* Or, int64_t ldo) {
  if (bf16) return narrow_values_np2<uint16_t>(np2, Dv, vr, jn, P, np, alpha, Or, ldo);
  narrow_values_np2<float>(np2, Dv, vr, jn, P, np, alpha, Or, ldo);
}

#if defined(__AVX512BF16__)
// bfloat16 narrow tiles on CPUs with AVX512-BF16: both products by VDPBF16PS, half the
// instructions of widening each element (the float32 FMAs of the widened rows left decode
// compute-bound at about half the read bandwidth). Scores pair K and Q along d: Qb holds the
// tile's query rows as bf16 pairs (exact: they are bf16 values), rows of ldq words
// zero-padded to a multiple of 32 elements. The values pass pairs keys: two V rows
// interleaved per 128-bit lane (a fixed column order, undone where O is loaded and stored)
// times their probabilities rounded to bf16, after the online softmax summed them unrounded.
constexpr int64_t kBf16Vec = 2 * W;  // bf16 elements in a vector

template <int NP2>
void narrow_scores_bf16(int64_t D, const void* const* kr, int64_t jn, const uint32_t* Qb,
                        int64_t ldq, const float* zero_row, float* St, int64_t np,
                        const NextRows& nx, const void* const* vr, int64_t vbytes) {
  constexpr int KJ = W / NP2;
  const uint16_t* zero = reinterpret_cast<const uint16_t*>(zero_row);
  const int64_t full = D / kBf16Vec * kBf16Vec;
  const __mmask32 half = (__mmask32)((1ull << (D - full)) - 1);  // a last partial vector
  for (int64_t j0 = 0; j0 < jn; j0 += KJ) {
    const uint16_t* rows[KJ];
#pragma GCC unroll 16
    for (int u = 0; u < KJ; ++u)
      rows[u] = (j0 + u < jn && kr[j0 + u]) ? static_cast<const uint16_t*>(kr[j0 + u]) : zero;
    for (int64_t i = j0 + kAheadRows; i < j0 + kAheadRows + KJ; ++i) {
      if (i < jn) {
        if (kr[i]) prefetch_row(kr[i], D * 2, false);
      } else if (i - jn < kBk && nx.k[i - jn]) {
        prefetch_row(nx.k[i - jn], nx.kbytes, false);
      }
    }
    if (vr)
      for (int64_t u = j0; u < min64(jn, j0 + KJ); ++u)
        if (vr[u]) prefetch_row(vr[u], vbytes, false);
    __m512 acc[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) acc[s] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += kBf16Vec) {
      __m512bh kv[KJ];
      if (d < full) {
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(rows[u] + d);
      } else {
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) kv[u] = (__m512bh)_mm512_maskz_loadu_epi16(half, rows[u] + d);
      }
#pragma GCC unroll 8
      for (int c = 0; c < NP2; ++c) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(Qb + c * ldq + d / 2);
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u)
          acc[u * NP2 + c] = _mm512_dpbf16_ps(acc[u * NP2 + c], kv[u], qv);
      }
    }
    vf sums[W];  // as in narrow_scores
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) sums[s] = (vf)acc[s];
    float lanes[W];
    storev(lanes, transpose_sum(sums));
    for (int u = 0; u < KJ && j0 + u < jn; ++u)
      memcpy(St + (j0 + u) * np, lanes + u * NP2, NP2 * sizeof(float));
  }
}

// Or[c][d0 .. d0 + DVC * kBf16Vec) = alpha[c] * Or[c][..] + sum_j P[j][c] * V row j for
// c0 <= c < c0 + RP, keys in pairs (Pp[q][c]: the bf16 pair of keys 2q, 2q + 1). Half: one
// chunk of W columns (the last of a Dv that is an odd multiple of W).
template <int RP, int DVC, bool Half>
void narrow_values_bf16(int64_t c0, int64_t d0, const void* const* vr, int64_t jn,
                        const uint32_t* Pp, int64_t np, const float* alpha, float* Or,
                        int64_t ldo, const uint16_t* zero) {
  // unpacklo / unpackhi of two rows hold columns 0-3, 8-11, 16-19, 24-27 / 4-7, 12-15, ...
  const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i from_lo_hi_0 =  // natural columns 0-15 from (lo, hi)
      _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i from_lo_hi_1 =  // natural columns 16-31
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __mmask32 cols = Half ? 0xFFFFu : 0xFFFFFFFFu;
  __m512 acc[RP][DVC][2];
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c) {
    const __m512 a = _mm512_set1_ps(alpha[c0 + c]);
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      const float* o = Or + (c0 + c) * ldo + d0 + u * kBf16Vec;
      const __m512 n0 = _mm512_loadu_ps(o);
      const __m512 n1 = Half ? _mm512_setzero_ps() : _mm512_loadu_ps(o + W);
      acc[c][u][0] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_lo, n1), a);
      acc[c][u][1] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_hi, n1), a);
    }
  }
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const void* ra = vr[2 * q];
    const void* rb = 2 * q + 1 < jn ? vr[2 * q + 1] : nullptr;
    if (!ra && !rb) continue;  // hidden: P = 0 and never read
    const uint16_t* va = ra ? static_cast<const uint16_t*>(ra) : zero;
    const uint16_t* vb = rb ? static_cast<const uint16_t*>(rb) : zero;
    __m512bh pc[RP];
#pragma GCC unroll 8
    for (int c = 0; c < RP; ++c) pc[c] = (__m512bh)_mm512_set1_epi32((int)Pp[q * np + c0 + c]);
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      const __m512i a = _mm512_maskz_loadu_epi16(cols, va + d0 + u * kBf16Vec);
      const __m512i b = _mm512_maskz_loadu_epi16(cols, vb + d0 + u * kBf16Vec);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int c = 0; c < RP; ++c) {
        acc[c][u][0] = _mm512_dpbf16_ps(acc[c][u][0], lo, pc[c]);
        acc[c][u][1] = _mm512_dpbf16_ps(acc[c][u][1], hi, pc[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      float* o = Or + (c0 + c) * ldo + d0 + u * kBf16Vec;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[c][u][0], from_lo_hi_0, acc[c][u][1]));
      if (!Half)
        _mm512_storeu_ps(o + W, _mm512_permutex2var_ps(acc[c][u][0], from_lo_hi_1, acc[c][u][1]));
    }
}

// Columns d0 .. of every row c < NP2 for DVC chunks, as many rows a pass as kValueAccs
// accumulators (two a chunk) allow.
template <int NP2, int DVC, bool Half>
void narrow_values_bf16_rows(int64_t d0, const void* const* vr, int64_t jn, const uint32_t* Pp,
                             int64_t np, const float* alpha, float* Or, int64_t ldo,
                             const uint16_t* zero) {
  constexpr int RP = rows_per_pass(NP2, 2 * DVC);
  for (int64_t c0 = 0; c0 < NP2; c0 += RP)
    narrow_values_bf16<RP, DVC, Half>(c0, d0, vr, jn, Pp, np, alpha, Or, ldo, zero);
}

// O rows += P . V, up to kValueAccs / 2 chunks a pass (as the float32 kernel: each pass
// reads its columns of every V row in key order, whole rows up to Dv = 256).
template <int NP2>
void narrow_values_bf16_all(int64_t Dv, const void* const* vr, int64_t jn, const uint32_t* Pp,
                            int64_t np, const float* alpha, float* Or, int64_t ldo,
                            const uint16_t* zero) {
  constexpr int kChunks = kValueAccs / 2;
  int64_t d0 = 0;
  for (; d0 + kBf16Vec <= Dv;) {
    const int64_t n = min64(kChunks, (Dv - d0) / kBf16Vec);
    switch (n) {
#define JAX_SDPA_BF16_VALUES_CASE(k) \
  case k: narrow_values_bf16_rows<NP2, k, false>(d0, vr, jn, Pp, np, alpha, Or, ldo, zero); break;
      JAX_SDPA_BF16_VALUES_CASE(1) JAX_SDPA_BF16_VALUES_CASE(2) JAX_SDPA_BF16_VALUES_CASE(3)
      JAX_SDPA_BF16_VALUES_CASE(4) JAX_SDPA_BF16_VALUES_CASE(5) JAX_SDPA_BF16_VALUES_CASE(6)
      JAX_SDPA_BF16_VALUES_CASE(7) default: JAX_SDPA_BF16_VALUES_CASE(8)
#undef JAX_SDPA_BF16_VALUES_CASE
    }
    d0 += n * kBf16Vec;
  }
  if (d0 < Dv) narrow_values_bf16_rows<NP2, 1, true>(d0, vr, jn, Pp, np, alpha, Or, ldo, zero);
}

void narrow_scores_bf16_np2(int np2, int64_t D, const void* const* kr, int64_t jn,
                            const uint32_t* Qb, int64_t ldq, const float* zero_row, float* St,
                            int64_t np, const NextRows& nx, const void* const* vr,
                            int64_t vbytes) {
  switch (np2) {
    case 1: return narrow_scores_bf16<1>(D, kr, jn, Qb, ldq, zero_row, St, np, nx, vr, vbytes);
    case 2: return narrow_scores_bf16<2>(D, kr, jn, Qb, ldq, zero_row, St, np, nx, vr, vbytes);
    case 4: return narrow_scores_bf16<4>(D, kr, jn, Qb, ldq, zero_row, St, np, nx, vr, vbytes);
    default: return narrow_scores_bf16<8>(D, kr, jn, Qb, ldq, zero_row, St, np, nx, vr, vbytes);
  }
}
void narrow_values_bf16_np2(int np2, int64_t Dv, const void* const* vr, int64_t jn,
                            const uint32_t* Pp, int64_t np, const float* alpha, float* Or,
                            int64_t ldo, const uint16_t* zero) {
  switch (np2) {
    case 1: return narrow_values_bf16_all<1>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    case 2: return narrow_values_bf16_all<2>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    case 4: return narrow_values_bf16_all<4>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    default: return narrow_values_bf16_all<8>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
  }
}

// Qb[c][w] = the bf16 pair (Qr[c][2w], Qr[c][2w + 1]) of the float32 rows Qr [np2][D] that
// hold bf16 values (truncation is exact), rows of ldq words zero-padded.
void pack_q_rows_bf16(const float* Qr, int64_t D, int np2, uint32_t* Qb, int64_t ldq) {
  for (int c = 0; c < np2; ++c)
    for (int64_t w = 0; w < ldq; ++w) {
      const uint32_t lo = 2 * w < D ? f32_to_bits(Qr[c * D + 2 * w]) >> 16 : 0u;
      const uint32_t hi = 2 * w + 1 < D ? f32_to_bits(Qr[c * D + 2 * w + 1]) >> 16 : 0u;
      Qb[c * ldq + w] = lo | hi << 16;
    }
}
#endif  // __AVX512BF16__
// Words of a bf16 pair row of the narrow bf16 products (D rounded up to whole vectors).
inline int64_t narrow_pair_words(int64_t D) { return round_up(D, 2 * W) / 2; }

// 16-bit K and V rows of a block's runs converted to float32 rows j of Kf / Vf (zeros
// for hidden runs: never read).
void load_block_rows(const SdpaParams& p, const SdpaFwdBuffers& buf, const KeyRun* runs,
                     int64_t nruns, float* Kf, float* Vf) {
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  for (int64_t r = 0; r < nruns; ++r)
    for (int64_t j = 0; j < runs[r].n; ++j) {
      float* kd = Kf + (runs[r].j + j) * D;
      float* vd = Vf + (runs[r].j + j) * Dv;
      if (runs[r].k < 0) {
        memset(kd, 0, D * sizeof(float));
        memset(vd, 0, Dv * sizeof(float));
      } else {
        load_row(buf.k, p.dtype, runs[r].k + j * p.k_stride[2], D, kd);
        load_row(buf.v, p.dtype, runs[r].v + j * p.v_stride[2], Dv, vd);
      }
    }
}

// ---- forward ----------------------------------------------------------------------
struct FwdCtx {
  const SdpaParams* p;
  const SdpaFwdBuffers* buf;
  Arena arena;
  SegBlocks segs;
  int64_t tiles;  // per (b, hk)
  int64_t group_heads = 1;  // kv heads a task walks together (fwd_task)
  // Split keys: a tile's key blocks are cut into nsplit shares, one task each, when there
  // are too few tiles to keep every thread busy (decode). Each share leaves its softmax
  // state in part; the share that finishes last (done[tile] counts them) merges them.
  int64_t nsplit = 1;
  int64_t part_floats = 0;  // per share: m, l (kBq each), O (kBq * Dv)
  float* part = nullptr;
  int64_t* done = nullptr;
};

// The softmax state of one tile: row maxima m, sums l, unnormalized O (narrow: rows of Dv,
// else transposed [Dv][np]).
void merge_shares(const FwdCtx& ctx, int64_t tile_id, const Tile& t, bool narrow, float* m,
                  float* l, float* O) {
  const int64_t Dv = ctx.p->head_dim_v, np = t.np, ns = ctx.nsplit;
  const float* base = ctx.part + tile_id * ns * ctx.part_floats;
  for (int64_t c = 0; c < t.n; ++c) {
    float M = -INFINITY;
    bool nan = false;
    for (int64_t s = 0; s < ns; ++s) {
      const float ms = base[s * ctx.part_floats + c];
      nan |= ms != ms;
      M = ms > M ? ms : M;
    }
    if (nan) M = NAN;
    const float mu = M == -INFINITY ? 0.0f : M;
    float lsum = 0.0f;
    for (int64_t d = 0; d < Dv; ++d) O[narrow ? c * Dv + d : d * np + c] = 0.0f;
    for (int64_t s = 0; s < ns; ++s) {
      const float* sh = base + s * ctx.part_floats;
      const float f = expf(sh[c] - mu);  // 0 for a share that saw nothing
      if (f == 0.0f) continue;
      lsum += sh[kBq + c] * f;
      const float* Os = sh + 2 * kBq;
      for (int64_t d = 0; d < Dv; ++d) {
        const int64_t x = narrow ? c * Dv + d : d * np + c;
        O[x] += Os[x] * f;
      }
    }
    m[c] = M;
    l[c] = nan ? NAN : lsum;
  }
}

// A tile's softmax state: its rows, maxima m, sums l, the last block's rescale alpha and its
// unnormalized O (narrow: rows of Dv in Or, queries in Qr; else transposed [Dv][np] in the
// task's Ot, queries in its Qt), and the keys [ka, kb) of its share.
struct TileState {
  Tile t;
  bool narrow;
  int np2;
  float *Qr, *Or, *Ot, *m, *l, *alpha;
  uint32_t* Qb;  // narrow bf16 tiles on AVX512-BF16: Qr as bf16 pairs (narrow_pair_words)
  int64_t ka, kb;
  float* O() const { return narrow ? Or : Ot; }
};
size_t tile_state_bytes(int64_t D, int64_t Dv) {
  return 4 * (size_t)round_up(kBq * 8, 64) + (size_t)round_up(kBq * 4, 64) +
         floats_bytes(W * D) + floats_bytes(W * Dv) + 3 * floats_bytes(kBq) +
         floats_bytes(W * narrow_pair_words(D));
}

// What a task reuses for every block of every tile it runs.
struct BlockScratch {
  KeyRun* runs;
  float *Qt, *St, *Ot, *Kf, *Vf, *zero_row, *tmp;
  const void** kr;  // narrow tiles: each key's K / V row (float32 or bf16 in place, or
  const void** vr;  // converted float32 in Kf / Vf; null: hidden)
  const char** next_k;  // narrow tiles: the K rows of the next block (NextRows)
  uint32_t *Qp, *Kp, *Vp, *Pp;  // bf16 pairs (bf16_products)
};
inline int64_t pair_words(int64_t D) { return (D + 1) / 2; }
size_t block_scratch_bytes(int64_t D, int64_t Dv) {
  return (size_t)round_up(4 * kBk * 8, 64) + floats_bytes(max64(D, Dv)) +
         3 * (size_t)round_up(kBk * 8, 64) +
         floats_bytes(D * kBq) + floats_bytes(kBk * kBq) + floats_bytes(Dv * kBq) +
         floats_bytes(kBk * D) + floats_bytes(kBk * Dv) + floats_bytes(max64(D, Dv)) +
         floats_bytes(pair_words(D) * kBq) + floats_bytes(kBk * pair_words(D)) +
         floats_bytes(kBk / 2 * Dv) + floats_bytes(kBk / 2 * kBq);
}
BlockScratch carve_block_scratch(Carver& cv, int64_t D, int64_t Dv) {
  BlockScratch sc;
  sc.runs = reinterpret_cast<KeyRun*>(cv.ints(4 * kBk));
  sc.Qt = cv.floats(D * kBq);
  sc.St = cv.floats(kBk * kBq);
  sc.Ot = cv.floats(Dv * kBq);
  sc.Kf = cv.floats(kBk * D);
  sc.Vf = cv.floats(kBk * Dv);
  sc.zero_row = cv.floats(max64(D, Dv));  // a K or V row of zeros, float32 or bf16
  sc.tmp = cv.floats(max64(D, Dv));
  sc.kr = reinterpret_cast<const void**>(cv.ints(kBk));
  sc.vr = reinterpret_cast<const void**>(cv.ints(kBk));
  sc.next_k = reinterpret_cast<const char**>(cv.ints(kBk));
  sc.Qp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(D) * kBq));
  sc.Kp = reinterpret_cast<uint32_t*>(cv.floats(kBk * pair_words(D)));
  sc.Vp = reinterpret_cast<uint32_t*>(cv.floats(kBk / 2 * Dv));
  sc.Pp = reinterpret_cast<uint32_t*>(cv.floats(kBk / 2 * kBq));
  return sc;
}

// Sets up the tile of rows tile * kBq .. of (b, hk) for key share `share`: its rows, the sinks
// as a first softmax column, O = 0 and its packed queries.
void start_tile(const FwdCtx& ctx, int64_t b, int64_t hk, int64_t tile, int64_t share,
                Carver& cv, const BlockScratch& sc, TileState* st) {
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  Tile& t = st->t;
  t.b = b;
  t.hk = hk;
  t.r0 = tile * kBq;
  t.n = min64(kBq, p.len_q * p.group() - t.r0);
  t.col_i = cv.ints(kBq);
  t.col_h = cv.ints(kBq);
  t.kf = cv.ints(kBq);
  t.kl = cv.ints(kBq);
  t.qseg = cv.i32(kBq);
  st->Qr = cv.floats(W * D);
  st->Or = cv.floats(W * Dv);
  st->Ot = sc.Ot;
  st->m = cv.floats(kBq);
  st->l = cv.floats(kBq);
  st->alpha = cv.floats(kBq);
  st->Qb = reinterpret_cast<uint32_t*>(cv.floats(W * narrow_pair_words(D)));
  setup_tile(p, &t);
  // Decode-shaped tiles take the narrow kernels (whole vectors of K and V rows).
  st->narrow = t.n <= kNarrow && D % W == 0 && Dv % W == 0;
  st->np2 = np2_for(t.n);
  for (int64_t c = 0; c < t.np; ++c) {
    bool sink = share == 0 && p.sinks && c < t.n && t.col_i[c] < t.qlen;
    // A sink is one more softmax column with logit sinks[h] and no value.
    st->m[c] = sink ? p.sinks[t.b * p.sinks_batch_stride + t.col_h[c]] : -INFINITY;
    st->l[c] = sink ? 1.0f : 0.0f;
  }
  memset(st->O(), 0, Dv * (st->narrow ? st->np2 : t.np) * sizeof(float));
  // This share of the tile's key blocks.
  const int64_t nblk = t.KL > t.KF ? (t.KL - t.KF + kBk - 1) / kBk : 0;
  st->ka = t.KF + share * nblk / ctx.nsplit * kBk;
  st->kb = min64(t.KL, t.KF + (share + 1) * nblk / ctx.nsplit * kBk);
  if (st->kb > st->ka) {
    pack_rows(p, t, ctx.buf->q, p.q_stride, D, sc.Qt, st->narrow ? st->Qr : nullptr, D, sc.tmp);
#if defined(__AVX512BF16__)
    if (bf16_products(p) && !st->narrow) pack_q_pairs(sc.Qt, D, t.np, sc.Qp);
    if (bf16_products(p) && st->narrow)
      pack_q_rows_bf16(st->Qr, D, st->np2, st->Qb, narrow_pair_words(D));
#endif
  }
}

// Folds keys [j0, j0 + jn) into the tile's softmax state. Narrow tiles need the task's St
// zeroed once (its padding columns stay finite) and sc.zero_row = 0.
void tile_block(const FwdCtx& ctx, TileState& st, const BlockScratch& sc, int64_t j0,
                int64_t jn) {
  const SdpaParams& p = *ctx.p;
  const SdpaFwdBuffers& buf = *ctx.buf;
  const Tile& t = st.t;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, np = t.np;
  float* St = sc.St;
  const SegCover seg = seg_cover(ctx.segs, t.b, j0, jn, t.qlo, t.qhi);
  if (seg == SegCover::kNone) return;  // no query of the tile meets a key of the block
  const int64_t nruns = key_runs(p, t.b, t.hk, j0, jn, sc.runs);
  const KeyRun* runs = sc.runs;
  bool hidden_runs = false;
  for (int64_t r = 0; r < nruns; ++r) hidden_runs |= runs[r].k < 0;
  const bool f32 = p.dtype == DType::kF32;
  // S^T = K · Q^T, run by run with float32 K rows in place; 16-bit rows converted into
  // scratch (zeros for hidden runs) and used as one run.
  if (st.narrow) {
    // bfloat16 rows are widened in registers by the narrow kernels; float16 converted here.
    const bool bf16 = p.dtype == DType::kBF16;
    const bool in_place = f32 || bf16;
    const int64_t item = f32 ? 4 : 2;
    if (!in_place) load_block_rows(p, buf, runs, nruns, sc.Kf, sc.Vf);
    for (int64_t r = 0; r < nruns; ++r)
      for (int64_t j = 0; j < runs[r].n; ++j) {
        const int64_t jj = runs[r].j + j;
        if (runs[r].k < 0) {
          sc.kr[jj] = sc.vr[jj] = nullptr;
        } else if (in_place) {
          sc.kr[jj] = static_cast<const char*>(buf.k) + (runs[r].k + j * p.k_stride[2]) * item;
          sc.vr[jj] = static_cast<const char*>(buf.v) + (runs[r].v + j * p.v_stride[2]) * item;
        } else {
          sc.kr[jj] = sc.Kf + jj * D;
          sc.vr[jj] = sc.Vf + jj * Dv;
        }
      }
#if defined(__AVX512BF16__)
    if (bf16)
      narrow_scores_bf16_np2(st.np2, D, sc.kr, jn, st.Qb, narrow_pair_words(D), sc.zero_row, St,
                             np, NextRows{sc.next_k, D * item}, sc.vr, Dv * item);
    else
#endif
      narrow_scores_any(bf16, st.np2, D, sc.kr, jn, st.Qr, D, sc.zero_row, St, np,
                        NextRows{sc.next_k, D * item}, in_place ? sc.vr : nullptr, Dv * item);
  } else if (f32) {
    const float* kp = static_cast<const float*>(buf.k);
    for (int64_t r = 0; r < nruns; ++r) {
      if (runs[r].k < 0) continue;
      gemm(runs[r].n, np, D, kp + runs[r].k, p.k_stride[2], 1, sc.Qt, np, St + runs[r].j * np,
           np, false);
    }
#if defined(__AVX512BF16__)
  } else if (bf16_products(p)) {  // K and V rows as bf16 pairs, hidden ones zero
    const uint16_t *krow[kBk], *vrow[kBk];
    const uint16_t* kp = static_cast<const uint16_t*>(buf.k);
    const uint16_t* vp = static_cast<const uint16_t*>(buf.v);
    for (int64_t r = 0; r < nruns; ++r)
      for (int64_t j = 0; j < runs[r].n; ++j) {
        const bool hidden = runs[r].k < 0;
        krow[runs[r].j + j] = hidden ? nullptr : kp + runs[r].k + j * p.k_stride[2];
        vrow[runs[r].j + j] = hidden ? nullptr : vp + runs[r].v + j * p.v_stride[2];
      }
    pack_kv_pairs(krow, vrow, jn, D, Dv, sc.Kp, sc.Vp);
    gemm_bf16(jn, np, pair_words(D), sc.Kp, pair_words(D), 1, sc.Qp, np, St, np, false);
#endif
  } else {
    load_block_rows(p, buf, runs, nruns, sc.Kf, sc.Vf);
    gemm(jn, np, D, sc.Kf, D, 1, sc.Qt, np, St, np, false);
  }
  scale_and_mask(p, t, j0, jn, St, seg, nullptr);
  if (hidden_runs)
    for (int64_t r = 0; r < nruns; ++r)
      if (runs[r].k < 0)
        for (int64_t x = runs[r].j * np; x < (runs[r].j + runs[r].n) * np; ++x) St[x] = -INFINITY;
  float *m = st.m, *l = st.l, *alpha = st.alpha;
  // Block maxima, key by key in order for each query; all of the tile's vectors in one pass
  // (one vector at a time would wait on each max's latency).
  vf bmax[kBq / W];
  for (int64_t v = 0; v < np / W; ++v) bmax[v] = splat(-INFINITY);
  for (int64_t j = 0; j < jn; ++j)
    for (int64_t v = 0; v < np / W; ++v) bmax[v] = vmax(bmax[v], loadv(St + j * np + v * W));
  for (int64_t c0 = 0; c0 < np; c0 += W) {  // online softmax, W queries at a time
    vf mx = bmax[c0 / W];
    vf mo = loadv(m + c0);
    vf mn = vmax(mo, mx);
    vf mu = select(mn == splat(-INFINITY), splat(0.0f), mn);  // nothing yet: no shift
    vf al = vexp(mo - mu);
    vf sum = vf{};
    for (int64_t j = 0; j < jn; ++j) {
      vf e = vexp(loadv(St + j * np + c0) - mu);
      storev(St + j * np + c0, e);
      sum += e;
    }
    storev(l + c0, loadv(l + c0) * al + sum);
    storev(m + c0, mn);
    storev(alpha + c0, al);
  }
  if (st.narrow) {  // O = alpha * O + P · V
#if defined(__AVX512BF16__)
    if (bf16_products(p)) {
      pack_p_pairs(St, jn, np, sc.Pp);
      narrow_values_bf16_np2(st.np2, Dv, sc.vr, jn, sc.Pp, np, alpha, st.Or, Dv,
                             reinterpret_cast<const uint16_t*>(sc.zero_row));
      return;
    }
#endif
    narrow_values_any(p.dtype == DType::kBF16, st.np2, Dv, sc.vr, jn, St, np, alpha, st.Or, Dv);
    return;
  }
  float* Ot = st.Ot;
  for (int64_t d = 0; d < Dv; ++d)
    for (int64_t c0 = 0; c0 < np; c0 += W)
      storev(Ot + d * np + c0, loadv(Ot + d * np + c0) * loadv(alpha + c0));
  // O^T += V^T · P^T (hidden runs have P = 0 and are skipped: never read)
  if (f32) {
    const float* vp = static_cast<const float*>(buf.v);
    for (int64_t r = 0; r < nruns; ++r) {
      if (runs[r].k < 0) continue;
      gemm(Dv, np, runs[r].n, vp + runs[r].v, 1, p.v_stride[2], St + runs[r].j * np, np, Ot, np,
           true);
    }
#if defined(__AVX512BF16__)
  } else if (bf16_products(p)) {
    pack_p_pairs(St, jn, np, sc.Pp);
    gemm_bf16(Dv, np, pair_words(jn), sc.Vp, 1, Dv, sc.Pp, np, Ot, np, true);
#endif
  } else {
    gemm(Dv, np, jn, sc.Vf, 1, Dv, St, np, Ot, np, true);
  }
}

// Writes the tile's rows (out = O / l, lse = m + log l) once its last share is in. task: this
// share's task id, tile_task: the tile's (tile_task * nsplit + share = task).
void finish_tile(const FwdCtx& ctx, TileState& st, const BlockScratch& sc, int64_t task,
                 int64_t tile_task) {
  const SdpaParams& p = *ctx.p;
  const Tile& t = st.t;
  const int64_t Dv = p.head_dim_v;
  float *m = st.m, *l = st.l, *O = st.O(), *tmp = sc.tmp;
  const bool narrow = st.narrow;
  if (ctx.nsplit > 1) {  // leave this share's state; the last share of the tile merges
    float* mine = ctx.part + task * ctx.part_floats;
    memcpy(mine, m, t.n * sizeof(float));
    memcpy(mine + kBq, l, t.n * sizeof(float));
    memcpy(mine + 2 * kBq, O, Dv * (narrow ? st.np2 : t.np) * sizeof(float));
    if (__atomic_add_fetch(&ctx.done[tile_task], 1, __ATOMIC_ACQ_REL) != ctx.nsplit) return;
    merge_shares(ctx, tile_task, t, narrow, m, l, O);
  }
  // Nothing visible (l == 0) -> 0 and -inf. A NaN score made l NaN: the row is NaN (l > 0
  // would call it empty).
  for (int64_t c = 0; c < t.n; ++c) {
    const int64_t i = t.col_i[c], h = t.col_h[c];
    const int64_t oidx = t.b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
    float* lse = ctx.buf->lse + (t.b * p.heads_q + h) * p.len_q + i;
    const bool live = i < t.qlen && l[c] != 0.0f;
    *lse = live ? m[c] + logf(l[c]) : -INFINITY;
    if (live && t.KL > t.KF) {
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = narrow ? O[c * Dv + d] : O[d * t.np + c];
      store_row(ctx.buf->out, p.dtype, oidx, tmp, 1.0f / l[c], Dv);
    } else if (live) {  // a sink and no key: 0 (NaN with a NaN sink)
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = 0.0f;
      store_row(ctx.buf->out, p.dtype, oidx, tmp, 1.0f / l[c], Dv);
    } else {
      store_zeros(ctx.buf->out, p.dtype, oidx, Dv);
    }
  }
}

// sc.next_k: the K rows of keys [j1, j1 + kBk) of the tile's kv head (null past its keys or
// where hidden).
void next_block_rows(const FwdCtx& ctx, const TileState& st, int64_t j1, const BlockScratch& sc) {
  const SdpaParams& p = *ctx.p;
  const char* kp = static_cast<const char*>(ctx.buf->k);
  const int64_t item = p.dtype == DType::kF32 ? 4 : 2;
  for (int64_t j = 0; j < kBk; ++j) sc.next_k[j] = nullptr;
  if (j1 >= st.kb) return;
  KeyRun runs[kBk];
  const int64_t nruns = key_runs(p, st.t.b, st.t.hk, j1, min64(kBk, st.kb - j1), runs);
  for (int64_t r = 0; r < nruns; ++r)
    if (runs[r].k >= 0)
      for (int64_t j = 0; j < runs[r].n; ++j)
        sc.next_k[runs[r].j + j] = kp + (runs[r].k + j * p.k_stride[2]) * item;
}

// A task is one key share of a group of tiles: the same rows of group_heads consecutive kv
// heads of one batch row (one head unless decode reads a slot-major cache, where the heads'
// rows share each key's memory: walking them together streams it in order instead of one
// strided head at a time), key block by key block.
void fwd_task(void* vctx, int64_t task, int participant) {
  const FwdCtx& ctx = *static_cast<const FwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Hk = p.heads_kv, gh = ctx.group_heads;
  const int64_t groups = (Hk + gh - 1) / gh;  // per batch row
  const int64_t BH = p.batch * Hk, BG = p.batch * groups;
  // Heaviest tiles (latest queries under a causal band) first.
  const int64_t share = task % ctx.nsplit, group_task = task / ctx.nsplit;
  const int64_t tile = ctx.tiles - 1 - group_task / BG, bg = group_task % BG;
  const int64_t b = bg / groups, hk0 = bg % groups * gh, nh = min64(gh, Hk - hk0);

  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  const BlockScratch sc = carve_block_scratch(cv, D, Dv);
  TileState states[kGroupHeads];
  bool narrow = false;
  int64_t ka = INT64_MAX, kb = 0;
  for (int64_t h = 0; h < nh; ++h) {
    start_tile(ctx, b, hk0 + h, tile, share, cv, sc, &states[h]);
    narrow |= states[h].narrow;
    ka = min64(ka, states[h].ka);
    kb = max64(kb, states[h].kb);
  }
  if (narrow) {
    memset(sc.zero_row, 0, max64(D, Dv) * sizeof(float));
    memset(sc.St, 0, kBk * states[0].t.np * sizeof(float));
  }
  for (int64_t j0 = ka; j0 < kb; j0 += kBk) {
    for (int64_t h = 0; h < nh; ++h) {
      TileState& st = states[h];
      if (j0 < st.ka || j0 >= st.kb) continue;
      if (st.narrow) next_block_rows(ctx, st, j0 + kBk, sc);
      tile_block(ctx, st, sc, j0, min64(kBk, st.kb - j0));
    }
  }
  const int64_t tile_base = (ctx.tiles - 1 - tile) * BH + b * Hk;
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t tile_task = tile_base + hk0 + h;
    finish_tile(ctx, states[h], sc, tile_task * ctx.nsplit + share, tile_task);
  }
}
// ---- backward ---------------------------------------------------------------------
struct BwdCtx {
  const SdpaParams* p;
  const SdpaBwdBuffers* buf;
  Arena arena;
  int64_t nchunk, chunk;  // key chunks per (b, hk) and their length
  float* dq_part;         // [nchunk][B][Hk][Lq * G][Dp] float32
  int64_t Dp, Dvp;
  SegBlocks segs;
};

void bwd_task(void* vctx, int64_t task, int participant) {
  const BwdCtx& ctx = *static_cast<const BwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const SdpaBwdBuffers& buf = *ctx.buf;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group(), Dp = ctx.Dp, Dvp = ctx.Dvp;
  const int64_t BH = p.batch * p.heads_kv;
  const int64_t ch = task / BH, bh = task % BH;
  const int64_t b = bh / p.heads_kv, hk = bh % p.heads_kv;
  const int64_t k0 = ch * ctx.chunk, k1 = min64(p.len_kv, k0 + ctx.chunk);
  if (k1 <= k0) return;
  const int64_t kvlen = clamp_length(p.kv_lengths, b, p.len_kv);
  const int64_t qlen = clamp_length(p.q_lengths, b, p.len_q);
  const int64_t k1e = min64(k1, kvlen);  // keys past kvlen get zero gradients
  const int64_t nk = k1 - k0;

  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  Tile t;
  t.b = b;
  t.hk = hk;
  t.col_i = cv.ints(kBq);
  t.col_h = cv.ints(kBq);
  t.kf = cv.ints(kBq);
  t.kl = cv.ints(kBq);
  t.qseg = cv.i32(kBq);
  float* Kc = cv.floats(ctx.chunk * Dp);
  float* Vc = cv.floats(ctx.chunk * Dvp);
  float* dKc = cv.floats(ctx.chunk * Dp);
  float* dVc = cv.floats(ctx.chunk * Dvp);
  float* Qt = cv.floats(D * kBq);
  float* Qr = cv.floats(kBq * Dp);
  float* dOt = cv.floats(Dv * kBq);
  float* dOr = cv.floats(kBq * Dvp);
  float* St = cv.floats(kBk * kBq);
  float* dPt = cv.floats(kBk * kBq);
  float* dcap = p.logits_soft_cap > 0 ? cv.floats(kBk * kBq) : nullptr;
  float* lse_use = cv.floats(kBq);
  float* delta = cv.floats(kBq);
  float* tmp = cv.floats(2 * max64(Dp, Dvp));
  // bf16 pairs along d of K, V (the chunk's) and Q, dO (the tile's) for S^T and dP^T: both
  // products of inputs, exact in float32 (bf16_products).
  uint32_t* Kpc = reinterpret_cast<uint32_t*>(cv.floats(ctx.chunk * pair_words(D)));
  uint32_t* Vpc = reinterpret_cast<uint32_t*>(cv.floats(ctx.chunk * pair_words(Dv)));
  uint32_t* Qp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(D) * kBq));
  uint32_t* dOp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(Dv) * kBq));

  const int64_t kbase = b * p.k_stride[0] + hk * p.k_stride[1];
  const int64_t vbase = b * p.v_stride[0] + hk * p.v_stride[1];
  memset(Kc, 0, nk * Dp * sizeof(float));
  memset(Vc, 0, nk * Dvp * sizeof(float));
  memset(dKc, 0, nk * Dp * sizeof(float));
  memset(dVc, 0, nk * Dvp * sizeof(float));
  for (int64_t j = k0; j < k1e; ++j) {
    load_row(buf.k, p.dtype, kbase + j * p.k_stride[2], D, Kc + (j - k0) * Dp);
    load_row(buf.v, p.dtype, vbase + j * p.v_stride[2], Dv, Vc + (j - k0) * Dvp);
  }
#if defined(__AVX512BF16__)
  const bool bf16 = bf16_products(p);
  if (bf16)
    for (int64_t j = k0; j < k1; ++j) {
      const bool live = j < k1e;
      pack_row_pairs(live ? static_cast<const uint16_t*>(buf.k) + kbase + j * p.k_stride[2]
                          : nullptr, D, Kpc + (j - k0) * pair_words(D));
      pack_row_pairs(live ? static_cast<const uint16_t*>(buf.v) + vbase + j * p.v_stride[2]
                          : nullptr, Dv, Vpc + (j - k0) * pair_words(Dv));
    }
#else
  (void)Kpc, (void)Vpc, (void)Qp, (void)dOp;
#endif
  float* dqp = ctx.dq_part + ((ch * p.batch + b) * p.heads_kv + hk) * (p.len_q * G) * Dp;

  const int64_t rows = qlen * G;
  for (int64_t r0 = 0; k1e > k0 && r0 < rows; r0 += kBq) {
    t.r0 = r0;
    t.n = min64(kBq, rows - r0);
    setup_tile(p, &t);
    const int64_t js = max64(t.KF, k0), je = min64(t.KL, k1e);
    if (je <= js) continue;
    if (seg_cover(ctx.segs, b, js, je - js, t.qlo, t.qhi) == SegCover::kNone) continue;
    const int64_t np = t.np;
    pack_rows(p, t, buf.q, p.q_stride, D, Qt, Qr, Dp, tmp);
    pack_rows(p, t, buf.dout, p.o_stride, Dv, dOt, dOr, Dvp, tmp);
#if defined(__AVX512BF16__)
    if (bf16) {
      pack_q_pairs(Qt, D, np, Qp);
      pack_q_pairs(dOt, Dv, np, dOp);
    }
#endif
    for (int64_t c = 0; c < np; ++c) {
      lse_use[c] = INFINITY;  // exp(s - inf) = 0: no probability for this column
      delta[c] = 0.0f;
      if (c >= t.n) continue;
      const int64_t i = t.col_i[c], h = t.col_h[c];
      float lv = buf.lse[(b * p.heads_q + h) * p.len_q + i];
      if (lv != -INFINITY) lse_use[c] = lv;  // NaN included: the row's gradients are NaN
      const int64_t oidx = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
      load_row(buf.out, p.dtype, oidx, Dv, tmp);
      float s = 0.0f;
      for (int64_t d = 0; d < Dv; ++d) s += tmp[d] * dOr[c * Dvp + d];
      delta[c] = s;
    }
    for (int64_t j0 = js; j0 < je; j0 += kBk) {
      const int64_t jn = min64(kBk, je - j0);
      const SegCover seg = seg_cover(ctx.segs, b, j0, jn, t.qlo, t.qhi);
      if (seg == SegCover::kNone) continue;
      const float* kb = Kc + (j0 - k0) * Dp;
      const float* vb = Vc + (j0 - k0) * Dvp;
#if defined(__AVX512BF16__)
      if (bf16) {
        gemm_bf16(jn, np, pair_words(D), Kpc + (j0 - k0) * pair_words(D), pair_words(D), 1, Qp,
                  np, St, np, false);
        scale_and_mask(p, t, j0, jn, St, seg, dcap);
        gemm_bf16(jn, np, pair_words(Dv), Vpc + (j0 - k0) * pair_words(Dv), pair_words(Dv), 1,
                  dOp, np, dPt, np, false);
      } else
#endif
      {
        gemm(jn, np, D, kb, Dp, 1, Qt, np, St, np, false);  // S^T
        scale_and_mask(p, t, j0, jn, St, seg, dcap);
        gemm(jn, np, Dv, vb, Dvp, 1, dOt, np, dPt, np, false);  // dP^T = V · dO^T
      }
      for (int64_t j = 0; j < jn; ++j)
        for (int64_t c0 = 0; c0 < np; c0 += W) {
          // P <= 1: the recomputed score can round above the forward's max near 1e30.
          vf pr = vexp(clamp_nonpositive(loadv(St + j * np + c0) - loadv(lse_use + c0)));
          storev(St + j * np + c0, pr);
          // dS (through the cap's derivative) selected where P = 0: a hidden key's dP or
          // cap derivative may be NaN, and 0 * NaN is NaN.
          vf ds = pr * (loadv(dPt + j * np + c0) - loadv(delta + c0));
          if (dcap) ds *= loadv(dcap + j * np + c0);
          storev(dPt + j * np + c0, select(pr == splat(0.0f), splat(0.0f), ds));
        }
      // dV += P^T · dO, dK += dS^T · Q, dQ += dS · K (scale applied at the end)
      gemm(jn, Dvp, np, St, np, 1, dOr, Dvp, dVc + (j0 - k0) * Dvp, Dvp, true);
      gemm(jn, Dp, np, dPt, np, 1, Qr, Dp, dKc + (j0 - k0) * Dp, Dp, true);
      gemm(t.n, Dp, jn, dPt, 1, np, kb, Dp, dqp + r0 * Dp, Dp, true);
    }
  }
  const float scale = (float)p.scale;
  for (int64_t j = k0; j < k1; ++j) {
    store_row(buf.dk, p.dtype, kbase + j * p.k_stride[2], dKc + (j - k0) * Dp, scale, D);
    store_row(buf.dv, p.dtype, vbase + j * p.v_stride[2], dVc + (j - k0) * Dvp, 1.0f, Dv);
  }
}

// dq = scale * sum over key chunks, per (b, query head).
void dq_task(void* vctx, int64_t task, int participant) {
  const BwdCtx& ctx = *static_cast<const BwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, G = p.group(), Dp = ctx.Dp;
  const int64_t b = task / p.heads_q, h = task % p.heads_q, hk = h / G, g = h % G;
  const int64_t qlen = clamp_length(p.q_lengths, b, p.len_q);
  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  float* acc = cv.floats(Dp);
  const int64_t part = p.batch * p.heads_kv * p.len_q * G * Dp;
  for (int64_t i = 0; i < p.len_q; ++i) {
    const int64_t idx = b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2];
    if (i >= qlen) {
      store_zeros(ctx.buf->dq, p.dtype, idx, D);
      continue;
    }
    const float* src = ctx.dq_part + ((b * p.heads_kv + hk) * p.len_q * G + i * G + g) * Dp;
    memcpy(acc, src, D * sizeof(float));
    for (int64_t c = 1; c < ctx.nchunk; ++c)
      for (int64_t d = 0; d < D; ++d) acc[d] += src[c * part + d];
    store_row(ctx.buf->dq, p.dtype, idx, acc, (float)p.scale, D);
  }
}

// ---- head-major copies ------------------------------------------------------------
// Prefill from a slot-major cache ([B, L, H, D]): every tile would read each key's K and V
// rows strided over the other heads' (a page a row with many heads), and the micro-kernel's
// broadcast loads miss the TLB and the prefetcher (B1 H24 D64 L4096: 677 ms against 444
// head-major; H8 D64 L4096 10% slower). Copying K and V head-major once a call costs a pass
// over them.
struct HeadMajorCopy {
  const SdpaParams* p;
  const void* src[2];
  char* dst[2];
  int64_t item, dim[2];
  const int64_t* stride[2];
};
void head_major_task(void* vctx, int64_t task, int) {
  const HeadMajorCopy& c = *static_cast<const HeadMajorCopy*>(vctx);
  const SdpaParams& p = *c.p;
  const int64_t b = task / p.heads_kv, h = task % p.heads_kv;
  for (int x = 0; x < 2; ++x) {
    const char* src = static_cast<const char*>(c.src[x]);
    char* dst = c.dst[x] + (task * p.len_kv * c.dim[x]) * c.item;
    for (int64_t j = 0; j < p.len_kv; ++j)
      memcpy(dst + j * c.dim[x] * c.item,
             src + (b * c.stride[x][0] + h * c.stride[x][1] + j * c.stride[x][2]) * c.item,
             c.dim[x] * c.item);
  }
}
const char* forward_in_place(const SdpaParams& p, const SdpaFwdBuffers& buf, ThreadPool& pool) {
  const int64_t rows = p.len_q * p.group();
  if (p.batch == 0 || p.heads_q == 0 || rows == 0) return nullptr;
  FwdCtx ctx;
  ctx.p = &p;
  ctx.buf = &buf;
  ctx.tiles = (rows + kBq - 1) / kBq;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  // Decode (narrow tiles) from a slot-major cache: a task walks up to kGroupHeads kv heads
  // together, so each key's rows of all of them are read at once (one head at a time would
  // stride over them, a TLB entry and a prefetch stream per key).
  const bool narrow = rows <= kNarrow && D % W == 0 && Dv % W == 0;
  const bool slot_major = abs64(p.k_stride[1]) < abs64(p.k_stride[2]);
  ctx.group_heads = narrow && slot_major ? min64(p.heads_kv, kGroupHeads) : 1;
  const int parts = pool.participants();
  const size_t per = block_scratch_bytes(D, Dv) + ctx.group_heads * tile_state_bytes(D, Dv);
  if (!arena_alloc(&ctx.arena, per, parts)) return "jax_sdpa cpu: out of memory (forward scratch)";
  if (!seg_blocks_build(p, &ctx.segs)) {
    free(ctx.arena.base);
    return "jax_sdpa cpu: out of memory (segment ranges)";
  }
  const int64_t groups = (p.heads_kv + ctx.group_heads - 1) / ctx.group_heads;
  const int64_t group_tasks = p.batch * groups * ctx.tiles;
  if (parts > 1 && group_tasks < 4 * parts) {
    // A share holds at least kSplitKeys key rows (keys times the heads walked together).
    ctx.nsplit = max64(1, min64(min64((4 * parts + group_tasks - 1) / group_tasks,
                                      p.len_kv * ctx.group_heads / kSplitKeys), 16));
  }
  const int64_t tile_tasks = p.batch * p.heads_kv * ctx.tiles;
  if (ctx.nsplit > 1) {
    ctx.part_floats = 2 * kBq + kBq * Dv;
    ctx.part = static_cast<float*>(malloc(tile_tasks * ctx.nsplit * ctx.part_floats * 4));
    ctx.done = static_cast<int64_t*>(calloc(tile_tasks, sizeof(int64_t)));
    if (!ctx.part || !ctx.done) {
      free(ctx.part);
      free(ctx.done);
      ctx.part = nullptr;
      ctx.done = nullptr;
      ctx.nsplit = 1;  // no room for the shares: unsplit
    }
  }
  pool.parallel_for(group_tasks * ctx.nsplit, fwd_task, &ctx);
  free(ctx.arena.base);
  free(ctx.segs.lo);
  free(ctx.part);
  free(ctx.done);
  return nullptr;
}

}  // namespace

const char* forward(const SdpaParams& p, const SdpaFwdBuffers& buf, ThreadPool& pool) {
  const int64_t rows = p.len_q * p.group();
  const int64_t item = p.dtype == DType::kF32 ? 4 : 2;
  // Worth a pass over K and V when at least four tiles a head read every key (decode and
  // short calls read each key once: they read in place).
  const bool many_tiles = rows > 4 * kBq;
  const bool strided = abs64(p.k_stride[2]) != p.head_dim || abs64(p.v_stride[2]) != p.head_dim_v;
  if (!many_tiles || !strided || p.paged() || p.batch == 0 || p.heads_kv == 0 || p.len_kv == 0)
    return forward_in_place(p, buf, pool);
  const int64_t D = p.head_dim, Dv = p.head_dim_v, BH = p.batch * p.heads_kv;
  char* copy = static_cast<char*>(malloc((size_t)(BH * p.len_kv * (D + Dv) * item)));
  if (!copy) return forward_in_place(p, buf, pool);  // no room: strided reads
  HeadMajorCopy c{&p, {buf.k, buf.v}, {copy, copy + BH * p.len_kv * D * item}, item, {D, Dv},
                  {p.k_stride, p.v_stride}};
  pool.parallel_for(BH, head_major_task, &c);
  SdpaParams hm = p;
  const int64_t ks[3] = {p.heads_kv * p.len_kv * D, p.len_kv * D, D};
  const int64_t vs[3] = {p.heads_kv * p.len_kv * Dv, p.len_kv * Dv, Dv};
  memcpy(hm.k_stride, ks, sizeof ks);
  memcpy(hm.v_stride, vs, sizeof vs);
  SdpaFwdBuffers hb = buf;
  hb.k = c.dst[0];
  hb.v = c.dst[1];
  const char* err = forward_in_place(hm, hb, pool);
  free(copy);
  return err;
}

const char* backward(const SdpaParams& p, const SdpaBwdBuffers& buf, ThreadPool& pool) {
  if (p.batch == 0) return nullptr;
  if (p.heads_q == 0) {  // no query rows: dq is empty, dk and dv are 0
    const int64_t kv_rows = p.batch * p.heads_kv * p.len_kv;
    store_zeros(buf.dk, p.dtype, 0, kv_rows * p.head_dim);
    store_zeros(buf.dv, p.dtype, 0, kv_rows * p.head_dim_v);
    return nullptr;
  }
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group();
  BwdCtx ctx;
  ctx.p = &p;
  ctx.buf = &buf;
  ctx.Dp = round_up(D, W);
  ctx.Dvp = round_up(Dv, W);
  const int parts = pool.participants();
  // Split the keys of each (b, hk) only as far as needed to keep every thread
  // busy: each split costs a float32 copy of dq.
  const int64_t BH = p.batch * p.heads_kv;
  const int64_t nblocks = max64(1, (p.len_kv + kBk - 1) / kBk);
  int64_t nchunk = (2 * parts + BH - 1) / BH;
  nchunk = max64(1, min64(min64(nchunk, nblocks), 16));
  ctx.chunk = round_up(max64(1, (p.len_kv + nchunk - 1) / nchunk), kBk);
  ctx.nchunk = max64(1, (p.len_kv + ctx.chunk - 1) / ctx.chunk);
  const size_t part_floats = (size_t)(BH * p.len_q * G * ctx.Dp);
  ctx.dq_part = static_cast<float*>(calloc(ctx.nchunk * part_floats + 1, sizeof(float)));
  if (!ctx.dq_part) return "jax_sdpa cpu: out of memory (dq accumulator)";
  const int64_t Dp = ctx.Dp, Dvp = ctx.Dvp;
  size_t per = 4 * (size_t)round_up(kBq * 8, 64) + (size_t)round_up(kBq * 4, 64) +
               floats_bytes(kBk * kBq) + 2 * floats_bytes(ctx.chunk * Dp) +
               2 * floats_bytes(ctx.chunk * Dvp) + floats_bytes(D * kBq) +
               floats_bytes(kBq * Dp) + floats_bytes(Dv * kBq) + floats_bytes(kBq * Dvp) +
               2 * floats_bytes(kBk * kBq) + 2 * floats_bytes(kBq) +
               floats_bytes(2 * max64(Dp, Dvp)) + floats_bytes(ctx.chunk * pair_words(D)) +
               floats_bytes(ctx.chunk * pair_words(Dv)) + floats_bytes(pair_words(D) * kBq) +
               floats_bytes(pair_words(Dv) * kBq);
  if (!arena_alloc(&ctx.arena, per, parts)) {
    free(ctx.dq_part);
    return "jax_sdpa cpu: out of memory (backward scratch)";
  }
  if (!seg_blocks_build(p, &ctx.segs)) {
    free(ctx.arena.base);
    free(ctx.dq_part);
    return "jax_sdpa cpu: out of memory (segment ranges)";
  }
  pool.parallel_for(ctx.nchunk * BH, bwd_task, &ctx);
  pool.parallel_for(p.batch * p.heads_q, dq_task, &ctx);
  free(ctx.arena.base);
  free(ctx.dq_part);
  free(ctx.segs.lo);
  return nullptr;
}

}  // namespace JAX_SDPA_CPU_ISA
}  // namespace cpu
}  // namespace jax_sdpa
