// Small CUDA kernels around the cuDNN graphs: they make cuDNN's inputs safe
// (clamped lengths, masks as a dense additive bias) and its outputs match the
// kernel contract (padded / empty rows, backward stats). Host-callable,
// asynchronous on `stream`, return the launch error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ffi/sdpa_params.h"

namespace jax_sdpa::cudnn_kernels {

// q_out[b] = clamp(q_len[b], 0, Lq) (Lq when q_len is null); same for kv.
cudaError_t prepare_lengths(const int32_t* q_len, const int32_t* kv_len, int64_t batch,
                            int64_t len_q, int64_t len_kv, int32_t* q_out, int32_t* kv_out,
                            cudaStream_t stream);

// The contract's mask (bool = keep, or additive; broadcast strides p.mask_stride)
// as a dense additive bias [mB, mH, Lq, Lk] of dtype `out_dtype`: bool false ->
// -inf, additive values converted.
cudaError_t mask_to_bias(const SdpaParams& p, int64_t mask_b, int64_t mask_h, void* bias,
                         DType out_dtype, cudaStream_t stream);

// After the cuDNN forward: query rows i >= qlen, and rows with no visible key,
// get out = 0 and lse = -inf (the sink's logit when there are sinks and the row
// is in range). Rows whose lse is -inf or below -1e30 (everything masked) count as
// having no visible key; a NaN lse (a visible NaN logit) keeps cuDNN's row. lse may be
// null only where no row has a key (Lk == 0): then only out is written.
cudaError_t fix_forward_rows(const SdpaParams& p, void* out, float* lse, cudaStream_t stream);

// Stats for the cuDNN backward: lse, with -inf (rows with nothing) replaced by +FLT_MAX
// so that cuDNN's P = exp(s - stats) is 0 there instead of NaN; a NaN lse stays NaN (the
// contract's NaN gradients of a NaN row).
cudaError_t stats_for_backward(const float* lse, int64_t n, float* out, cudaStream_t stream);

// Zeroes rows l >= len of a [B, H, L, D] tensor with (batch, head, position)
// strides `stride` (element size from dtype). `len_is_q` picks p.q_lengths
// (clamped to Lq) vs p.kv_lengths (clamped to Lk).
cudaError_t zero_rows_past_length(const SdpaParams& p, bool len_is_q, void* x, int64_t heads,
                                  int64_t len, int64_t dim, const int64_t stride[3],
                                  cudaStream_t stream);

// Elements spanned by a [B, H, L, D] tensor with (batch, head, position) strides `stride`.
int64_t strided_extent(int64_t batch, int64_t heads, int64_t len, int64_t dim,
                       const int64_t stride[3]);

// dst (strided_extent elements, the same strides) = src with rows l >= len zeroed. cuDNN
// multiplies a hidden key's probability 0 by its value and a hidden query's 0 by its row
// (0 * NaN = NaN), so a NaN past a length would reach outputs and gradients: its inputs
// past the lengths are handed over zeroed.
cudaError_t copy_zeroing_rows_past_length(const SdpaParams& p, bool len_is_q, const void* src,
                                          void* dst, int64_t heads, int64_t len, int64_t dim,
                                          const int64_t stride[3], cudaStream_t stream);

}  // namespace jax_sdpa::cudnn_kernels
