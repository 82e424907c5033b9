// The one plain description of an attention call that every backend consumes.
//
// FFI handlers (each backend's ffi_handler.cc) unpack XLA buffers + attributes into these structs
// (see ffi/ffi_args.h); kernels (cpu/, cuda/, the Metal host glue) never see
// XLA types. Semantics are written down in docs/ffi_contract.md; the helpers at
// the bottom are the executable form of the masking rules, shared by every
// C++/CUDA kernel so that they cannot disagree.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define JAX_SDPA_HD __host__ __device__ __forceinline__
#else
#define JAX_SDPA_HD inline
#endif

namespace jax_sdpa {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
// Bytes of one element of a DType.
JAX_SDPA_HD constexpr int64_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }
enum class MaskKind : int32_t { kNone = 0, kBool = 1, kAdditive = 2 };

// Contract features beyond the base call. Every FFI target declares the set its kernels
// serve when it registers (ffi/registry.h); its handler refuses a call that uses any other
// (refuse_unserved in ffi/ffi_args.h) and jax_sdpa/dispatch.py reads the same set through
// the module's `served_features()`, so the three can never disagree.
enum Feature : uint32_t {
  kFeatureSegmentIds = 1u << 0,    // q_segment_ids / kv_segment_ids (packed sequences)
  kFeatureLogitsSoftCap = 1u << 1,  // logits_soft_cap > 0
};
constexpr uint32_t kNoFeatures = 0;
constexpr uint32_t kAllFeatures = kFeatureSegmentIds | kFeatureLogitsSoftCap;

inline const char* feature_name(uint32_t feature) {
  switch (feature) {
    case kFeatureSegmentIds: return "segment_ids";
    case kFeatureLogitsSoftCap: return "logits_soft_cap";
  }
  return "?";
}

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

  // Packed sequences: query i of row b sees key j only where
  // q_segment_ids[b * len_q + i] == kv_segment_ids[b * len_kv + j] (same_segment).
  // Both null, or both set.
  const int32_t* q_segment_ids = nullptr;   // [B, Lq] or nullptr
  const int32_t* kv_segment_ids = nullptr;  // [B, Lk] or nullptr

  // Logit soft-capping, before the additive mask: s = cap * tanh(scale * q.k / cap)
  // (soft_cap_logit). 0: off.
  double logits_soft_cap = 0.0;

  // Paged K/V (the paged targets only; page_indices is null otherwise). Key j of row b is
  // slot j % page_size of physical page page_indices[b * pages_per_seq + j / page_size];
  // k_stride / v_stride are then (page, head, slot) strides and len_kv is
  // pages_per_seq * page_size (paged_key_row).
  const int32_t* page_indices = nullptr;  // [B, pages_per_seq]
  int64_t pages_per_seq = 0;
  int64_t page_size = 0;
  int64_t num_pages = 0;

  int64_t group() const { return heads_q / heads_kv; }
  bool paged() const { return page_indices != nullptr; }
  // The features this call uses (Feature bits).
  uint32_t features() const {
    return (q_segment_ids != nullptr ? kFeatureSegmentIds : 0u) |
           (logits_soft_cap > 0 ? kFeatureLogitsSoftCap : 0u);
  }
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

// Packed sequences: may query i of row b see key j? (true when there are no segment ids)
JAX_SDPA_HD bool same_segment(const int32_t* q_segment_ids, const int32_t* kv_segment_ids,
                              int64_t b, int64_t len_q, int64_t len_kv, int64_t i, int64_t j) {
  return q_segment_ids == nullptr ||
         q_segment_ids[b * len_q + i] == kv_segment_ids[b * len_kv + j];
}

// Logit soft-capping: cap * tanh(x / cap) of the scaled logit x (cap > 0).
JAX_SDPA_HD float soft_cap_logit(float x, float cap) { return cap * tanhf(x / cap); }

// Paged K/V: where key j of batch row b lives, {physical page, slot in it}; page = -1 when
// the page index is outside [0, num_pages): such a page's keys are invisible, never read.
// Its element offset is page * stride[0] + head * stride[1] + slot * stride[2].
struct PagedRow {
  int64_t page;
  int64_t slot;
};
JAX_SDPA_HD PagedRow paged_key_row(const int32_t* page_indices, int64_t pages_per_seq,
                                   int64_t page_size, int64_t num_pages, int64_t b,
                                   int64_t j) {
  int64_t page = page_indices[b * pages_per_seq + j / page_size];
  if (page < 0 || page >= num_pages) page = -1;
  return {page, j % page_size};
}

}  // namespace jax_sdpa
