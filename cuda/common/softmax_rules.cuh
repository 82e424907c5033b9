// The contract's score and row rules (docs/ffi_contract.md) that every CUDA attention kernel
// (flash forward / backward, decode) applies, in one place: the online softmax's rescaling
// step, when a softmax row is empty, how outputs are selected rather than multiplied, logit
// soft-capping, segment ids and the segment-range test behind block skipping.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/mma_helpers.cuh"
#include "ffi/sdpa_params.h"

// The contract features a kernel argument struct carries, appended after a family's own
// fields (so the layout of the fields before them, and the kernels that never read these,
// stay as they were): segment ids [B, Lq] / [B, Lk] (both null without), the soft cap
// (0: off) and paged K/V (pages null without; SdpaParams' page fields; k/v strides are then
// (page, head, slot)).
#define JAX_SDPA_KERNEL_FEATURE_FIELDS \
  const int32_t* qseg;                 \
  const int32_t* kvseg;                \
  float soft_cap;                      \
  const int32_t* pages;                \
  int pages_per_seq, page_size, num_pages;

namespace jax_sdpa {
namespace cuda_common {

// The feature fields of `a` from the call (host side).
template <typename Args>
inline void set_feature_fields(const SdpaParams& p, Args* a) {
  a->qseg = p.q_segment_ids;
  a->kvseg = p.kv_segment_ids;
  a->soft_cap = static_cast<float>(p.logits_soft_cap > 0 ? p.logits_soft_cap : 0.0);
  a->pages = p.page_indices;
  a->pages_per_seq = static_cast<int>(p.pages_per_seq);
  a->page_size = static_cast<int>(p.page_size > 0 ? p.page_size : 1);
  a->num_pages = static_cast<int>(p.num_pages);
}

// Paged K/V: a page-table entry as a physical page, or -1 when it is outside
// [0, num_pages): that page's keys are invisible and never read.
__device__ __forceinline__ int checked_page(int entry, int num_pages) {
  return entry >= 0 && entry < num_pages ? entry : -1;
}

// The physical page holding key j of a batch row (its page-table row `table`), or -1 as
// checked_page says. (ffi/sdpa_params.h: paged_key_row.)
__device__ __forceinline__ int physical_page(const int32_t* table, int page_size, int num_pages,
                                             int j) {
  return checked_page(table[j / page_size], num_pages);
}

// A softmax row is empty (out 0, lse -inf) only when its sum is exactly 0: a NaN sum (a
// visible NaN score) is not empty, so the NaN reaches out and lse.
__device__ __forceinline__ bool softmax_row_empty(float sum) { return sum == 0.f; }

// An output element of a row: selected, never `acc * 0`, so that an empty row (or a query
// past its length) is 0 even where its accumulator met a NaN value through P = 0.
__device__ __forceinline__ float row_output(float acc, float inv_sum, bool empty) {
  return empty ? 0.f : acc * inv_sum;
}

// 1 / sum of a finished softmax row (0 for an empty row, whose outputs are selected to 0).
__device__ __forceinline__ float row_inverse_sum(float sum, bool empty) {
  return empty ? 0.f : 1.f / sum;
}

// The lse (natural log) of a finished row from its running maximum m2 and sum in base 2
// (scores scaled by log2(e)); -inf for an empty row.
__device__ __forceinline__ float row_lse_base2(float m2, float sum, bool empty) {
  return empty ? -INFINITY : (m2 + log2f(sum)) * 0.6931471805599453f;
}

// The sum of x over the 4 lanes of a quad (lane / 4 equal): the threads that hold one row of
// an mma.sync accumulator.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}

// The max of x over the 4 lanes of a quad (the sum is quad_sum).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The exponentials a kernel's online softmax runs on: base 2 (scores scaled by log2(e)) or
// base e, each accurate (exp2f, expf) or fast (ex2.approx, __expf).
enum class SoftmaxExp { kExp2, kFastExp2, kExp, kFastExp };
template <SoftmaxExp kExpKind>
__device__ __forceinline__ float softmax_exp(float x) {
  if constexpr (kExpKind == SoftmaxExp::kExp2) return exp2f(x);
  else if constexpr (kExpKind == SoftmaxExp::kFastExp2) return fast_exp2(x);
  else if constexpr (kExpKind == SoftmaxExp::kExp) return expf(x);
  else return __expf(x);
}

// The online softmax's step of one row, once its new running max m_new (the old one and the
// step's scores, over the row's threads) is known: sets mu, the offset this step's
// exponentials exp(s - mu) use (m_new, or 0 while it is -inf, so that masked scores give 0,
// not NaN), sets m_run = m_new and returns exp(m_old - mu), the factor that rescales the
// row's sum and output.
template <SoftmaxExp kExpKind>
__device__ __forceinline__ float online_rescale(float& m_run, float m_new, float& mu) {
  mu = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = softmax_exp<kExpKind>(m_run - mu);
  m_run = m_new;
  return alpha;
}

// The backward's exponent of a recomputed probability, P = 2^d (or e^d), d = logit - lse in
// the same units. A probability is at most 1, so d <= 0; but d carries the rounding of the
// forward's lse round trip and of the recompute, a few ulps of |lse|, which at fp32 logits
// near 1e31 is far more than 1: 2^(+huge) = inf (NaN gradients) or 2^(-huge) = 0 for the
// row's winning key. So an exponent within kRecomputeUlps ulps of |lse| below 0, or above
// it, is 0 (P = 1). At ordinary logits the band is ~1e-5 around the top and changes
// nothing measurable. A NaN stays NaN (a comparison, never fminf).
constexpr float kRecomputeUlps = 32.f;
__device__ __forceinline__ float recomputed_exponent(float d, float lse) {
  return d > -(kRecomputeUlps * 1.1920929e-7f) * fabsf(lse) ? 0.f : d;
}

// Soft-capped scaled logit: cap * tanh(x / cap) (cap > 0), x = scale * q.k.
__device__ __forceinline__ float soft_capped(float x, float cap) {
  return cap * tanhf(x * (1.f / cap));
}

// Segment ids: may query i of row b see key j? (true without segment ids)
__device__ __forceinline__ bool same_segment_ids(const int32_t* qseg, const int32_t* kvseg,
                                                 int b, int Lq, int Lk, int i, int j) {
  return qseg == nullptr ||
         qseg[static_cast<int64_t>(b) * Lq + i] == kvseg[static_cast<int64_t>(b) * Lk + j];
}

// [lo, hi] of ids[first, last) for one warp (every lane gets the result; {INT_MAX, INT_MIN}
// when the range is empty). Callers compute it in every warp of a block from the same
// memory, so the block-skipping decision built on it is uniform across the block.
struct IdRange {
  int lo, hi;
};
__device__ __forceinline__ IdRange warp_id_range(const int32_t* ids, int first, int last) {
  int lo = 0x7fffffff, hi = static_cast<int>(0x80000000u);
  for (int x = first + static_cast<int>(threadIdx.x % 32); x < last; x += 32) {
    const int v = ids[x];
    lo = min(lo, v);
    hi = max(hi, v);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, off));
  }
  return {lo, hi};
}

// Whether query rows [q_first, q_last) and keys [k_first, k_last) of batch row b can share a
// segment (conservative: the [min, max] ranges overlap; exact for sorted packing). True
// without segment ids. Warp-collective (all 32 lanes must call it).
__device__ __forceinline__ bool segments_may_meet(const int32_t* qseg, const int32_t* kvseg,
                                                  int b, int Lq, int Lk, int q_first,
                                                  int q_last, int k_first, int k_last) {
  if (qseg == nullptr) return true;
  const IdRange qr = warp_id_range(qseg + static_cast<int64_t>(b) * Lq, q_first, q_last);
  const IdRange kr = warp_id_range(kvseg + static_cast<int64_t>(b) * Lk, k_first, k_last);
  return qr.lo <= kr.hi && kr.lo <= qr.hi;
}

}  // namespace cuda_common
}  // namespace jax_sdpa
