// The one plain description of an attention call that every backend consumes.
//
// FFI handlers (ffi/*.cc) decode XLA buffers + attributes into these structs
// (see ffi/ffi_args.h); kernels (cpu/, cuda/, the Metal host glue) never see
// XLA types. Semantics are written down in docs/ffi_contract.md; the helpers at
// the bottom are the executable form of the masking rules, shared by every
// C++/CUDA kernel so that they cannot disagree.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAX_SDPA_HD __host__ __device__ __forceinline__
#else
#define JAX_SDPA_HD inline
#endif

namespace jax_sdpa {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
enum class MaskKind : int32_t { kNone = 0, kBool = 1, kAdditive = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kF16: return "float16";
    case DType::kBF16: return "bfloat16";
  }
  return "?";
}

// Shapes, strides and flags. All strides are in elements; the last dimension of
// q/k/v/out (the head dim) is contiguous. A stride of 0 means "broadcast".
struct SdpaParams {
  int64_t batch = 0;       // B
  int64_t heads_q = 0;     // Hq
  int64_t heads_kv = 0;    // Hk (Hq % Hk == 0; query head h uses kv head h / (Hq/Hk))
  int64_t len_q = 0;       // Lq
  int64_t len_kv = 0;      // Lk
  int64_t head_dim = 0;    // D  (q, k)
  int64_t head_dim_v = 0;  // Dv (v, out)
  DType dtype = DType::kF32;  // of q, k, v, out (and dout, dq, dk, dv)
  bool seq_major = false;     // false: [B, H, L, D]; true: [B, L, H, D]

  // Strides (batch, head, position) of q / out (same shape up to D vs Dv)
  // and of k / v. dq uses q's strides, dk/dv use k's/v's, dout uses out's.
  int64_t q_stride[3] = {0, 0, 0};
  int64_t k_stride[3] = {0, 0, 0};
  int64_t v_stride[3] = {0, 0, 0};
  int64_t o_stride[3] = {0, 0, 0};

  double scale = 1.0;
  // Band of visible keys around the (aligned) diagonal; -1 = unbounded.
  // Causal is window_right == 0.
  int64_t window_left = -1;
  int64_t window_right = -1;
  bool bottom_right = false;

  MaskKind mask_kind = MaskKind::kNone;
  DType mask_dtype = DType::kF32;   // additive masks only
  const void* mask = nullptr;       // bool masks are 1 byte per element
  int64_t mask_stride[4] = {0, 0, 0, 0};  // (b, h_q, i, j); 0 where broadcast

  const float* sinks = nullptr;     // [sB, Hq] float32, unscaled logits
  int64_t sinks_batch_stride = 0;   // 0 when sB == 1, Hq when sB == B

  const int32_t* q_lengths = nullptr;   // [B] or nullptr
  const int32_t* kv_lengths = nullptr;  // [B] or nullptr

  int64_t group() const { return heads_q / heads_kv; }
};

struct SdpaFwdBuffers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [B, Hq, Lq], natural log; -inf for rows with nothing
};

struct SdpaBwdBuffers {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const float* lse = nullptr;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
};

// ---- masking rules (see docs/ffi_contract.md) --------------------------------

// Valid length of row b's queries / keys, clamped to [0, L]: handlers never
// trust data-dependent inputs.
JAX_SDPA_HD int64_t clamp_length(const int32_t* lengths, int64_t b, int64_t full) {
  if (lengths == nullptr) return full;
  int64_t n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// Offset that aligns the diagonal: query i sits at key position i + offset.
JAX_SDPA_HD int64_t diagonal_offset(bool bottom_right, int64_t q_len, int64_t kv_len) {
  return bottom_right ? kv_len - q_len : 0;
}

// Keys [first, last) that the band lets query i see (before lengths and masks).
struct KeyRange {
  int64_t first;
  int64_t last;
};
JAX_SDPA_HD KeyRange band_keys(int64_t i, int64_t offset, int64_t window_left,
                               int64_t window_right, int64_t kv_len) {
  int64_t pos = i + offset;
  int64_t first = window_left < 0 ? 0 : pos - window_left;
  int64_t last = window_right < 0 ? kv_len : pos + window_right + 1;
  if (first < 0) first = 0;
  if (last > kv_len) last = kv_len;
  if (last < first) last = first;
  return {first, last};
}

}  // namespace jax_sdpa
