// Tensor-core and shared-memory instruction wrappers shared by the flash and decode kernels: tf32
// conversion, mma.sync shapes, ldmatrix, ex2, 4-byte cp.async. One definition each; the
// kernels' inline-asm forms are kept exactly (ldmatrix with and without a memory clobber).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace jax_sdpa {
namespace cuda_common {

// fp32 -> tf32, round to nearest (bits of a float with the low 13 mantissa bits zero).
__device__ __forceinline__ uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float round_tf32(float x) { return __uint_as_float(to_tf32(x)); }

// d += a * b, m16n8k8, tf32 inputs, f32 accumulation.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4],
                                         const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 3xTF32 step: d += a_lo * b_hi + a_hi * b_lo + a_hi * b_hi. The three products go into a
// fresh tensor-core accumulator that is then added to d with fp32 adds (round to nearest):
// the tensor cores' own accumulation truncates, and chained through d over a long sum
// (the backward's dK / dV over 1000+ query rows) that bias alone was 2e-5 relative.
__device__ __forceinline__ void mma_tf32x3(float (&d)[4], const uint32_t (&ah)[4],
                                           const uint32_t (&al)[4], const uint32_t (&bh)[2],
                                           const uint32_t (&bl)[2]) {
  float t[4] = {0.f, 0.f, 0.f, 0.f};
  mma_tf32(t, al, bh);
  mma_tf32(t, ah, bl);
  mma_tf32(t, ah, bh);
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += t[i];
}

// d += a * b, m16n8k16, f16 / bf16 inputs, f32 accumulation. kVolatile: the flash kernels
// keep the asm volatile (ordered as written); the decode kernels let the compiler schedule it.
#define JAX_SDPA_MMA16816(ty)                                                        \
  "mma.sync.aligned.m16n8k16.row.col.f32." ty "." ty ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
  "{%8,%9}, {%0,%1,%2,%3};\n"
#define JAX_SDPA_MMA16816_OPERANDS                                  \
  : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                   \
  : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1)
template <typename T, bool kVolatile = true>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "16-bit types");
  if constexpr (std::is_same_v<T, __half>) {
    if constexpr (kVolatile) asm volatile(JAX_SDPA_MMA16816("f16") JAX_SDPA_MMA16816_OPERANDS);
    else asm(JAX_SDPA_MMA16816("f16") JAX_SDPA_MMA16816_OPERANDS);
  } else {
    if constexpr (kVolatile) asm volatile(JAX_SDPA_MMA16816("bf16") JAX_SDPA_MMA16816_OPERANDS);
    else asm(JAX_SDPA_MMA16816("bf16") JAX_SDPA_MMA16816_OPERANDS);
  }
}
#undef JAX_SDPA_MMA16816_OPERANDS
#undef JAX_SDPA_MMA16816

// ldmatrix.x4 (b16): lanes 8i..8i+7 give the row addresses of 8x8 matrix i; register i of
// lane (g = lane / 4, t = lane % 4) gets row g, elements 2t and 2t + 1 of matrix i (read as
// 32-bit pairs: an 8-row x 4-float tile, exactly a tf32 fragment piece). .trans: rows 2t
// and 2t + 1 at column g. Ordered by volatile alone (the kernels that use these place them
// between barriers); the _ordered forms add a memory clobber.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
// Same, from a shared-window address, with a memory clobber.
__device__ __forceinline__ void ldmatrix_x4_ordered(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans_ordered(uint32_t (&r)[4], uint32_t s) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s)
               : "memory");
}

// 2^x on the SFU (flush-to-zero; 2^-inf = 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 4-byte global -> shared copy; pred == false zero-fills and reads nothing.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem),
               "r"(pred ? 4 : 0)
               : "memory");
}

}  // namespace cuda_common
}  // namespace jax_sdpa
