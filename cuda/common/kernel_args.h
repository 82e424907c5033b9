// What every kernel argument struct (decode and flash) carries, by value in kernel parameter
// space: the buffers, their strides and the call's masking (band, mask, sinks, lengths).
// One list of fields, spliced into each family's struct in the same place (the layout, and so
// each kernel's parameter offsets, is the family's own), and one host function that fills
// them from SdpaParams.
#pragma once

#include <cstdint>

#include "ffi/sdpa_params.h"

// q, k, v, out, lse: a struct's first fields.
#define JAX_SDPA_KERNEL_IO_FIELDS \
  const void* q;                  \
  const void* k;                  \
  const void* v;                  \
  void* out;                      \
  float* lse;

// (batch, head, position) element strides of q, k, v and out.
#define JAX_SDPA_KERNEL_STRIDE_FIELDS int64_t qs[3], ks[3], vs[3], os[3];

// The band (window_left / window_right around the diagonal, aligned bottom-right or not),
// the mask (kind, dtype, pointer, (b, h, i, j) strides), sinks [sB, Hq] and lengths.
#define JAX_SDPA_KERNEL_MASK_FIELDS \
  int64_t wl, wr;                   \
  int bottom_right;                 \
  int mask_kind, mask_dtype;        \
  const void* mask;                 \
  int64_t ms[4];                    \
  const float* sinks;               \
  int64_t sinks_bs;                 \
  const int32_t* qlen;              \
  const int32_t* kvlen;

namespace jax_sdpa {
namespace cuda_common {

// The shared fields of `a` from the call (host side).
template <typename Args>
inline void set_call_fields(const SdpaParams& p, const SdpaFwdBuffers& buf, Args* a) {
  a->q = buf.q;
  a->k = buf.k;
  a->v = buf.v;
  a->out = buf.out;
  a->lse = buf.lse;
  for (int i = 0; i < 3; ++i) {
    a->qs[i] = p.q_stride[i];
    a->ks[i] = p.k_stride[i];
    a->vs[i] = p.v_stride[i];
    a->os[i] = p.o_stride[i];
  }
  a->wl = p.window_left;
  a->wr = p.window_right;
  a->bottom_right = p.bottom_right ? 1 : 0;
  a->mask_kind = static_cast<int>(p.mask_kind);
  a->mask_dtype = static_cast<int>(p.mask_dtype);
  a->mask = p.mask;
  for (int i = 0; i < 4; ++i) a->ms[i] = p.mask_stride[i];
  a->sinks = p.sinks;
  a->sinks_bs = p.sinks_batch_stride;
  a->qlen = p.q_lengths;
  a->kvlen = p.kv_lengths;
}

}  // namespace cuda_common
}  // namespace jax_sdpa
