#include "cuda/cudnn/cudnn_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cmath>

namespace jax_sdpa::cudnn_kernels {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b < 1) b = 1;
  return static_cast<int>(b > 65535 * 8 ? 65535 * 8 : b);  // grid-stride loops cover the rest
}

__device__ __forceinline__ float load_as_float(const void* base, int64_t idx, MaskKind kind,
                                               DType dtype) {
  if (kind == MaskKind::kBool)
    return static_cast<const unsigned char*>(base)[idx] ? 0.0f : -INFINITY;
  switch (dtype) {
    case DType::kF32: return static_cast<const float*>(base)[idx];
    case DType::kF16: return __half2float(static_cast<const __half*>(base)[idx]);
    default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[idx]);
  }
}

__device__ __forceinline__ void store_from_float(void* base, int64_t idx, float v, DType dtype) {
  switch (dtype) {
    case DType::kF32: static_cast<float*>(base)[idx] = v; break;
    case DType::kF16: static_cast<__half*>(base)[idx] = __float2half_rn(v); break;
    default: static_cast<__nv_bfloat16*>(base)[idx] = __float2bfloat16_rn(v); break;
  }
}

// Writes `n` zero elements of `esize` bytes at base + offset (elements).
__device__ __forceinline__ void zero_elements(void* base, int64_t offset, int64_t n, size_t esize) {
  if (esize == 4) {
    float* x = static_cast<float*>(base) + offset;
    for (int64_t d = 0; d < n; ++d) x[d] = 0.0f;
  } else {
    unsigned short* x = static_cast<unsigned short*>(base) + offset;
    for (int64_t d = 0; d < n; ++d) x[d] = 0;
  }
}

__global__ void prepare_lengths_kernel(const int32_t* q_len, const int32_t* kv_len,
                                       int64_t batch, int64_t len_q, int64_t len_kv,
                                       int32_t* q_out, int32_t* kv_out) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < batch;
       b += int64_t(gridDim.x) * blockDim.x) {
    q_out[b] = static_cast<int32_t>(clamp_length(q_len, b, len_q));
    kv_out[b] = static_cast<int32_t>(clamp_length(kv_len, b, len_kv));
  }
}

__global__ void mask_to_bias_kernel(SdpaParams p, int64_t mask_b, int64_t mask_h, void* bias,
                                    DType out_dtype) {
  const int64_t lq = p.len_q, lk = p.len_kv;
  const int64_t n = mask_b * mask_h * lq * lk;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < n;
       o += int64_t(gridDim.x) * blockDim.x) {
    int64_t j = o % lk, r = o / lk;
    int64_t i = r % lq;
    r /= lq;
    int64_t h = r % mask_h, b = r / mask_h;
    int64_t src = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] +
                  j * p.mask_stride[3];
    store_from_float(bias, o, load_as_float(p.mask, src, p.mask_kind, p.mask_dtype), out_dtype);
  }
}

__global__ void fix_forward_rows_kernel(SdpaParams p, void* out, float* lse) {
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  const size_t esize = p.dtype == DType::kF32 ? 4 : 2;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = r % p.len_q;
    const int64_t h = (r / p.len_q) % p.heads_q;
    const int64_t b = r / (p.len_q * p.heads_q);
    const int64_t qlen = clamp_length(p.q_lengths, b, p.len_q);
    const int64_t kvlen = clamp_length(p.kv_lengths, b, p.len_kv);
    float value = -INFINITY;
    if (i < qlen) {
      const int64_t offset = diagonal_offset(p.bottom_right, qlen, kvlen);
      const KeyRange keys = band_keys(i, offset, p.window_left, p.window_right, kvlen);
      const float l = lse != nullptr ? lse[r] : -INFINITY;  // none: no key (Lk == 0)
      // A NaN lse (a visible NaN logit) is kept with cuDNN's row: the contract's NaN row.
      const bool has_keys = keys.last > keys.first && (l != l || (l > -1e30f && l < INFINITY));
      if (has_keys) continue;
      if (p.sinks != nullptr) value = p.sinks[b * p.sinks_batch_stride + h];
    }
    if (lse != nullptr) lse[r] = value;
    zero_elements(out, b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2], p.head_dim_v,
                  esize);
  }
}

__global__ void stats_for_backward_kernel(const float* lse, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float l = lse[i];
    out[i] = l == -INFINITY ? FLT_MAX : l;  // -inf -> FLT_MAX (P = 0); NaN stays: NaN gradients
  }
}

__global__ void zero_rows_kernel(const int32_t* lengths, int64_t batch, int64_t heads,
                                 int64_t len, int64_t dim, int64_t s0, int64_t s1, int64_t s2,
                                 size_t esize, void* x) {
  const int64_t rows = batch * heads * len;
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < rows;
       r += int64_t(gridDim.x) * blockDim.x) {
    const int64_t l = r % len;
    const int64_t h = (r / len) % heads;
    const int64_t b = r / (len * heads);
    if (l < clamp_length(lengths, b, len)) continue;
    zero_elements(x, b * s0 + h * s1 + l * s2, dim, esize);
  }
}

// dst = src with rows l >= len zeroed, in units T: a 16-byte vector where the layout
// allows, else one element (strides and units_per_row are in units T).
template <typename T>
__global__ void copy_zeroing_rows_kernel(const int32_t* lengths, int64_t batch, int64_t heads,
                                         int64_t len, int64_t units_per_row, int64_t s0,
                                         int64_t s1, int64_t s2, const T* src, T* dst) {
  const int64_t n = batch * heads * len * units_per_row;
  for (int64_t u = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; u < n;
       u += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = u % units_per_row;
    const int64_t r = u / units_per_row;
    const int64_t l = r % len;
    const int64_t h = (r / len) % heads;
    const int64_t b = r / (len * heads);
    const int64_t at = b * s0 + h * s1 + l * s2 + c;
    dst[at] = l < clamp_length(lengths, b, len) ? src[at] : T{};
  }
}

}  // namespace

cudaError_t prepare_lengths(const int32_t* q_len, const int32_t* kv_len, int64_t batch,
                            int64_t len_q, int64_t len_kv, int32_t* q_out, int32_t* kv_out,
                            cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  prepare_lengths_kernel<<<blocks_for(batch), kThreads, 0, stream>>>(q_len, kv_len, batch, len_q,
                                                                     len_kv, q_out, kv_out);
  return cudaGetLastError();
}

cudaError_t mask_to_bias(const SdpaParams& p, int64_t mask_b, int64_t mask_h, void* bias,
                         DType out_dtype, cudaStream_t stream) {
  const int64_t n = mask_b * mask_h * p.len_q * p.len_kv;
  if (n <= 0) return cudaSuccess;
  mask_to_bias_kernel<<<blocks_for(n), kThreads, 0, stream>>>(p, mask_b, mask_h, bias, out_dtype);
  return cudaGetLastError();
}

cudaError_t fix_forward_rows(const SdpaParams& p, void* out, float* lse, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows <= 0) return cudaSuccess;
  fix_forward_rows_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(p, out, lse);
  return cudaGetLastError();
}

cudaError_t stats_for_backward(const float* lse, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  stats_for_backward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(lse, n, out);
  return cudaGetLastError();
}

cudaError_t zero_rows_past_length(const SdpaParams& p, bool len_is_q, void* x, int64_t heads,
                                  int64_t len, int64_t dim, const int64_t stride[3],
                                  cudaStream_t stream) {
  const int32_t* lengths = len_is_q ? p.q_lengths : p.kv_lengths;
  const int64_t rows = p.batch * heads * len;
  if (lengths == nullptr || rows <= 0) return cudaSuccess;
  const size_t es = static_cast<size_t>(dtype_bytes(p.dtype));
  zero_rows_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(
      lengths, p.batch, heads, len, dim, stride[0], stride[1], stride[2], es, x);
  return cudaGetLastError();
}

int64_t strided_extent(int64_t batch, int64_t heads, int64_t len, int64_t dim,
                       const int64_t stride[3]) {
  if (batch <= 0 || heads <= 0 || len <= 0 || dim <= 0) return 0;
  return (batch - 1) * stride[0] + (heads - 1) * stride[1] + (len - 1) * stride[2] + dim;
}

cudaError_t copy_zeroing_rows_past_length(const SdpaParams& p, bool len_is_q, const void* src,
                                          void* dst, int64_t heads, int64_t len, int64_t dim,
                                          const int64_t stride[3], cudaStream_t stream) {
  const int32_t* lengths = len_is_q ? p.q_lengths : p.kv_lengths;
  const size_t es = static_cast<size_t>(dtype_bytes(p.dtype));
  const int64_t rows = p.batch * heads * len;
  if (rows <= 0 || dim <= 0) return cudaSuccess;
  // 16-byte units when every row start and the row length are 16-byte multiples.
  const int64_t per = static_cast<int64_t>(16 / es);
  const bool vec = dim % per == 0 && stride[0] % per == 0 && stride[1] % per == 0 &&
                   stride[2] % per == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (vec) {
    copy_zeroing_rows_kernel<uint4><<<blocks_for(rows * (dim / per)), kThreads, 0, stream>>>(
        lengths, p.batch, heads, len, dim / per, stride[0] / per, stride[1] / per,
        stride[2] / per, static_cast<const uint4*>(src), static_cast<uint4*>(dst));
  } else if (es == 4) {
    copy_zeroing_rows_kernel<float><<<blocks_for(rows * dim), kThreads, 0, stream>>>(
        lengths, p.batch, heads, len, dim, stride[0], stride[1], stride[2],
        static_cast<const float*>(src), static_cast<float*>(dst));
  } else {
    copy_zeroing_rows_kernel<unsigned short><<<blocks_for(rows * dim), kThreads, 0, stream>>>(
        lengths, p.batch, heads, len, dim, stride[0], stride[1], stride[2],
        static_cast<const unsigned short*>(src), static_cast<unsigned short*>(dst));
  }
  return cudaGetLastError();
}

}  // namespace jax_sdpa::cudnn_kernels
