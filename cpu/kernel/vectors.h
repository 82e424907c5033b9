// Vectors of W floats, exp / tanh / reciprocal, and the dtype conversions of rows.
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- vectors ------------------------------------------------------------------

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
// One VPMOVZXWD from memory and a shift on AVX2 / AVX-512: GCC lowers the generic conversion
// to two half-width VPMOVZXWDs, an extract or shift and an insert: five instructions a vector
// in bf16 decode's loops on CPUs without AVX512-BF16 (AVX2 AMD EPYC VM, bf16 decode from cache: B1
// H32/KV8 D128 Lk1024 0.41-0.42 -> 0.29-0.38 ms at the minimum of 400 calls,
// decode_bf16_widen_20261207.json).
inline vf load_elems(const uint16_t* p) {
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16);
#elif defined(__AVX2__)
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
#else
  vh h;
  memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
#endif
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

// e^x for x <= 0 (or NaN), as the softmax's terms e^(s - max) and the backward's
// e^(s - lse) are: 2^(x log2 e), reduced by rounding to the nearest integer n and a degree-6
// polynomial of the rest (relative error ~1e-7, fitted on [-0.5, 0.5]), then scaled by 2^n.
// Masked scores (-inf) give exactly 0, as every term below 2^-127 does (AVX-512: 2^-200);
// NaN stays NaN. About half the instructions of vexp, whose exact range reduction the
// softmax doesn't need: an argument's rounding costs a term e^d its relative |d| * 6e-8, at
// most 1.5e-8 of the row's largest.
inline vf exp2_reduced(vf r) {  // 2^r on [-0.5, 0.5]
  vf q = splat(1.539433578727767e-4f);
  q = q * r + splat(1.3388516381382942e-3f);
  q = q * r + splat(9.618211537599564e-3f);
  q = q * r + splat(5.550358444452286e-2f);
  q = q * r + splat(2.4022650718688965e-1f);
  q = q * r + splat(6.931471824645996e-1f);
  return q * r + splat(1.0f);
}
inline vf vexp_nonpositive(vf x) {
#if defined(__AVX512F__)
  __m512 t = _mm512_mul_ps((__m512)x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_max_ps(_mm512_set1_ps(-200.0f), t);  // MAXPS returns its NaN second operand
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return (vf)_mm512_scalef_ps((__m512)exp2_reduced((vf)t - (vf)n), n);  // 2^n: one instruction
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 t = _mm256_mul_ps((__m256)x, _mm256_set1_ps(1.44269504088896341f));
  // n = -127 makes the scale's exponent field 0: the scale, and the term, exactly 0
  t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);  // NaN second operand: NaN stays
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // 2^n built in the exponent field: n in [-127, 0], a NaN's garbage scale keeps its NaN
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return exp2_reduced((vf)t - (vf)n) * (vf)_mm256_castsi256_ps(e);
#else
  return vexp(x);
#endif
}

// e^(x - mu) for the online softmax (x <= mu, or NaN).
inline vf vexp_diff(vf x, vf mu) { return vexp_nonpositive(x - mu); }

// x as rounded where it was computed: no later operation fuses with the one that made it
// (the compilers contract a multiply and an add into an FMA, rounding once).
__attribute__((always_inline)) inline void keep_rounded(vf& x) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+v"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#endif
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
// store_row for output rows the call never reads again: float32 rows on 64-byte boundaries
// with whole vectors go out by non-temporal stores (no read for ownership of their lines; the
// same product src * mul). The caller calls stream_fence() before it publishes them.
void store_row_streamed(void* dst, DType t, int64_t idx, const float* src, float mul, int64_t n) {
#if defined(__AVX512F__)
  float* d = static_cast<float*>(dst) + idx;
  if (t == DType::kF32 && n % W == 0 && reinterpret_cast<uintptr_t>(d) % 64 == 0) {
    const __m512 m = _mm512_set1_ps(mul);
    for (int64_t x = 0; x < n; x += W)
      _mm512_stream_ps(d + x, _mm512_mul_ps(_mm512_loadu_ps(src + x), m));
    return;
  }
#endif
  store_row(dst, t, idx, src, mul, n);
}
// Non-temporal stores are weakly ordered: this orders them before a later release (the
// pool's completion count).
inline void stream_fence() {
#if defined(__AVX512F__)
  _mm_sfence();
#endif
}
void store_zeros(void* dst, DType t, int64_t idx, int64_t n) {
  if (n <= 0) return;  // an empty buffer may have no address
  const size_t es = dtype_bytes(t);
  memset(static_cast<char*>(dst) + idx * es, 0, n * es);
}
