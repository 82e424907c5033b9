// Host side shared by the macOS Metal runner and the Linux emulator: turns the unpacked call
// (jax_sdpa::SdpaParams) into the kernel parameter struct and a list of kernel launches over
// named buffers. Which kernel runs (decode vs tiled, number of key splits) is decided here,
// once, for both platforms. No XLA, no Metal, no emulator types.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ffi/sdpa_params.h"
#include "ffi/tuning_knobs.h"
#include "metal/host/metal_tuning.h"
#include "metal/kernels/sdpa_shared.h"

namespace jax_sdpa {
namespace metal {

enum class BufKind { kInput, kOutput, kScratch, kParams };

struct PlanBuffer {
  BufKind kind;
  void* ptr;     // host memory (inputs/outputs); null for scratch and params
  size_t bytes;  // 0 for absent optional operands
};

struct PlanLaunch {
  std::string kernel;
  uint32_t grid[3];  // threadgroups
  uint32_t threads;  // per threadgroup
  std::vector<int> args;  // indices into Plan::buffers, in [[buffer(i)]] order
};

struct Plan {
  SdpaMetalParams params;
  std::vector<PlanBuffer> buffers;
  std::vector<PlanLaunch> launches;
  int params_index = -1;
};

// A platform runner: the emulator on Linux, Metal on macOS.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual std::string describe() = 0;
  // Executes the launches in order and waits for them; "" on success, else the error.
  virtual std::string run(const Plan& plan) = 0;
};
Runner* runner();  // defined by runner_emulator.cc or host_macos.mm; null if unavailable
std::string runner_error();  // why runner() is null

inline const char* dtype_tag(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kF16: return "f16";
    case DType::kBF16: return "bf16";
  }
  return "?";
}

// Smallest instantiated head-dim bucket >= max(D, Dv), or 0 if none.
inline int dmax_bucket(int64_t d, int64_t dv) {
  const int64_t m = std::max(d, dv);
  for (int b : {64, 128, 256, 512})
    if (m <= b) return b;
  return 0;
}

// "" if the Metal kernels can serve these params, else why not.
inline std::string unsupported_reason(const SdpaParams& p) {
  if (p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0)
    return "head dims must be multiples of 8 (got D=" + std::to_string(p.head_dim) +
           ", Dv=" + std::to_string(p.head_dim_v) + ")";
  if (dmax_bucket(p.head_dim, p.head_dim_v) == 0)
    return "head dims above 512 are not supported (got D=" + std::to_string(p.head_dim) +
           ", Dv=" + std::to_string(p.head_dim_v) + ")";
  const int64_t big = int64_t(1) << 30;
  if (p.len_q >= big || p.len_kv >= big || p.batch * p.heads_q * p.len_q >= (int64_t(1) << 40))
    return "sequence too long for the Metal kernels";
  if (p.paged() && (p.page_size <= 0 || p.num_pages >= big || p.pages_per_seq >= big))
    return "page table out of the Metal kernels' range (page_size " +
           std::to_string(p.page_size) + ", " + std::to_string(p.num_pages) + " pages)";
  return "";
}

// A force knob's value (tuning builds and the emulator only: ffi/tuning_knobs.h), else
// fallback.
inline int knob_int(const char* name, int fallback) {
  const char* s = tuning_knob(name);
  if (s == nullptr || *s == 0) return fallback;
  return std::atoi(s);
}

inline int clamp_window(int64_t w, int64_t lq, int64_t lk) {
  if (w < 0) return -1;
  return int(std::min<int64_t>(w, lq + lk + 1));
}

inline SdpaMetalParams make_params(const SdpaParams& p) {
  SdpaMetalParams m;
  std::memset(&m, 0, sizeof(m));
  for (int a = 0; a < 3; ++a) {
    m.q_stride[a] = p.q_stride[a];
    m.k_stride[a] = p.k_stride[a];
    m.v_stride[a] = p.v_stride[a];
    m.o_stride[a] = p.o_stride[a];
  }
  for (int a = 0; a < 4; ++a) m.mask_stride[a] = p.mask_stride[a];
  m.sinks_batch_stride = p.sinks_batch_stride;
  m.batch = int32_t(p.batch);
  m.heads_q = int32_t(p.heads_q);
  m.heads_kv = int32_t(p.heads_kv);
  m.group = int32_t(p.group());
  m.len_q = int32_t(p.len_q);
  m.len_kv = int32_t(p.len_kv);
  m.head_dim = int32_t(p.head_dim);
  m.head_dim_v = int32_t(p.head_dim_v);
  m.window_left = clamp_window(p.window_left, p.len_q, p.len_kv);
  m.window_right = clamp_window(p.window_right, p.len_q, p.len_kv);
  m.bottom_right = p.bottom_right ? 1 : 0;
  m.mask_kind = int32_t(p.mask_kind);
  m.mask_dtype = int32_t(p.mask_dtype);
  m.has_sinks = p.sinks != nullptr;
  m.has_q_lengths = p.q_lengths != nullptr;
  m.has_kv_lengths = p.kv_lengths != nullptr;
  m.num_splits = 1;
  m.rows_per_group = 0;
  m.has_segment_ids = p.q_segment_ids != nullptr;
  m.paged = p.paged();
  m.page_size = int32_t(p.page_size);
  m.pages_per_seq = int32_t(p.pages_per_seq);
  m.num_pages = int32_t(p.num_pages);
  m.scale = float(p.scale);
  m.scale_log2 = float(p.scale * 1.4426950408889634);
  if (p.logits_soft_cap > 0) {
    m.scale_over_cap = float(p.scale / p.logits_soft_cap);
    m.cap_log2 = float(p.logits_soft_cap * 1.4426950408889634);
  }
  return m;
}

// Kernel-name suffix of the call's variant: soft-capping is compiled in ("_cap" kernels) so
// that the uncapped kernels carry no trace of it.
inline std::string variant_suffix(const SdpaParams& p) {
  return p.logits_soft_cap > 0 ? "_cap" : "";
}

namespace detail {
inline uint32_t ceil_div(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

// Bytes spanned by a buffer with the given extents/strides (elements), or 0 if any extent is 0.
inline size_t span_bytes(const int64_t* ext, const int64_t* stride, int n, size_t esize) {
  int64_t last = 0;
  for (int a = 0; a < n; ++a) {
    if (ext[a] == 0) return 0;
    last += (ext[a] - 1) * stride[a];
  }
  return size_t(last + 1) * esize;
}

inline size_t qkv_bytes(const SdpaParams& p, int64_t h, int64_t l, int64_t d) {
  return size_t(p.batch * h * l * d) * size_t(dtype_bytes(p.dtype));
}

// Bytes of k (d = D, stride k_stride) or v: contiguous [B, Hk, Lk, d] (either layout), or a
// page pool [P, Hk, S, d] in any order of its first three axes (paged calls).
inline size_t kv_bytes(const SdpaParams& p, const int64_t* stride, int64_t d) {
  if (!p.paged()) return qkv_bytes(p, p.heads_kv, p.len_kv, d);
  const int64_t ext[4] = {p.num_pages, p.heads_kv, p.page_size, d};
  const int64_t str[4] = {stride[0], stride[1], stride[2], 1};
  return span_bytes(ext, str, 4, size_t(dtype_bytes(p.dtype)));
}

// Optional operands shared by forward and backward (page_indices: forward only).
struct Optional {
  int mask, sinks, qlen, kvlen, qseg, kvseg, pages;
};
inline Optional add_optional(const SdpaParams& p, Plan* plan) {
  auto add = [&](BufKind k, const void* ptr, size_t n) {
    plan->buffers.push_back({k, const_cast<void*>(ptr), ptr ? n : 0});
    return int(plan->buffers.size()) - 1;
  };
  Optional o;
  size_t mask_bytes = 0;
  if (p.mask != nullptr) {
    const int64_t ext[4] = {p.batch, p.heads_q, p.len_q, p.len_kv};
    const size_t item = p.mask_kind == MaskKind::kBool ? 1 : size_t(dtype_bytes(p.mask_dtype));
    mask_bytes = span_bytes(ext, p.mask_stride, 4, item);
  }
  o.mask = add(BufKind::kInput, p.mask, mask_bytes);
  o.sinks = add(BufKind::kInput, p.sinks,
                size_t((p.sinks_batch_stride ? p.batch : 1) * p.heads_q) * sizeof(float));
  o.qlen = add(BufKind::kInput, p.q_lengths, size_t(p.batch) * sizeof(int32_t));
  o.kvlen = add(BufKind::kInput, p.kv_lengths, size_t(p.batch) * sizeof(int32_t));
  o.qseg = add(BufKind::kInput, p.q_segment_ids, size_t(p.batch * p.len_q) * sizeof(int32_t));
  o.kvseg = add(BufKind::kInput, p.kv_segment_ids, size_t(p.batch * p.len_kv) * sizeof(int32_t));
  o.pages = add(BufKind::kInput, p.page_indices, size_t(p.batch * p.pages_per_seq) * sizeof(int32_t));
  return o;
}
inline int add_buffer(Plan* plan, BufKind k, const void* ptr, size_t n) {
  plan->buffers.push_back({k, const_cast<void*>(ptr), n});
  return int(plan->buffers.size()) - 1;
}
inline void add_launch(Plan* plan, std::string name, uint32_t gx, uint32_t gy, uint32_t gz,
                       uint32_t threads, std::vector<int> args) {
  if (uint64_t(gx) * gy * gz == 0) return;  // nothing to do (empty dims)
  plan->launches.push_back({std::move(name), {gx, gy, gz}, threads, std::move(args)});
}
}  // namespace detail

// Decode kernel for few queries (all query heads of a GQA group share each K/V read),
// tiled kernel otherwise (metal_tuning.h). JAX_SDPA_METAL_KERNEL=decode|full forces one
// (tuning builds and the emulator, whose tests force each path).
inline bool use_decode(const SdpaParams& p) {
  const char* force = tuning_knob("JAX_SDPA_METAL_KERNEL");
  if (force != nullptr && std::strcmp(force, "decode") == 0) return true;
  if (force != nullptr && std::strcmp(force, "full") == 0) return false;
  return p.len_q <= tuning::kDecodeMaxQueries;
}

// Key splits of the two-pass decode: long caches with few threadgroups get split so that the
// GPU has enough threadgroups, each split keeping enough keys (metal_tuning.h).
// JAX_SDPA_METAL_SPLITS=n forces (tuning builds and the emulator).
inline int decode_splits(const SdpaParams& p, int64_t groups) {
  int forced = knob_int("JAX_SDPA_METAL_SPLITS", 0);
  int n = 1;
  if (forced > 0) {
    n = forced;
  } else if (p.len_kv >= tuning::kSplitMinKeys) {
    const int64_t want = (tuning::kSplitTargetThreadgroups + groups - 1) /
                         std::max<int64_t>(groups, 1);
    n = int(std::min<int64_t>(want, p.len_kv / tuning::kSplitMinKeysEach));
  }
  return std::max(1, std::min(n, SDPA_MAX_SPLITS));
}

inline std::string plan_forward(const SdpaParams& p, const SdpaFwdBuffers& io, Plan* plan) {
  std::string why = unsupported_reason(p);
  if (!why.empty()) return why;
  plan->params = make_params(p);
  const int dmax = dmax_bucket(p.head_dim, p.head_dim_v);
  const std::string tag = dtype_tag(p.dtype);
  const std::string var = variant_suffix(p);
  using detail::add_buffer;
  const int q = add_buffer(plan, BufKind::kInput, io.q, detail::qkv_bytes(p, p.heads_q, p.len_q, p.head_dim));
  const int k = add_buffer(plan, BufKind::kInput, io.k, detail::kv_bytes(p, p.k_stride, p.head_dim));
  const int v = add_buffer(plan, BufKind::kInput, io.v, detail::kv_bytes(p, p.v_stride, p.head_dim_v));
  const auto opt = detail::add_optional(p, plan);
  const int out = add_buffer(plan, BufKind::kOutput, io.out, detail::qkv_bytes(p, p.heads_q, p.len_q, p.head_dim_v));
  const size_t nrows = size_t(p.batch * p.heads_q * p.len_q);
  const int lse = add_buffer(plan, BufKind::kOutput, io.lse, nrows * sizeof(float));
  const int prm = add_buffer(plan, BufKind::kParams, nullptr, sizeof(SdpaMetalParams));
  plan->params_index = prm;

  if (use_decode(p)) {
    const int rows = SDPA_DEC_ROWS(dmax);
    const uint32_t chunks = detail::ceil_div(p.group() * p.len_q, rows);
    const int splits = decode_splits(p, int64_t(chunks) * p.heads_kv * p.batch);
    plan->params.num_splits = splits;
    plan->params.rows_per_group = rows;
    const int part_o = add_buffer(plan, BufKind::kScratch, nullptr,
                                  splits > 1 ? nrows * splits * p.head_dim_v * sizeof(float) : 0);
    const int part_ml = add_buffer(plan, BufKind::kScratch, nullptr,
                                   splits > 1 ? nrows * splits * 2 * sizeof(float) : 0);
    detail::add_launch(plan, "sdpa_decode_" + tag + "_" + std::to_string(dmax) + var, chunks,
                       uint32_t(p.heads_kv), uint32_t(p.batch * splits),
                       SDPA_DEC_SG * SDPA_SIMD,
                       {q, k, v, opt.mask, opt.sinks, opt.qlen, opt.kvlen, opt.qseg, opt.kvseg,
                        opt.pages, out, lse, part_o, part_ml, prm});
    if (splits > 1)
      detail::add_launch(plan, "sdpa_decode_combine_" + tag,
                         detail::ceil_div(int64_t(nrows), SDPA_COMBINE_SG), 1, 1,
                         SDPA_COMBINE_SG * SDPA_SIMD,
                         {part_o, part_ml, opt.sinks, opt.qlen, out, lse, prm});
  } else {
    detail::add_launch(plan, "sdpa_fwd_" + tag + "_" + std::to_string(dmax) + var,
                       detail::ceil_div(p.len_q, SDPA_TILED_ROWS), uint32_t(p.heads_q),
                       uint32_t(p.batch), SDPA_TILED_SG * SDPA_SIMD,
                       {q, k, v, opt.mask, opt.sinks, opt.qlen, opt.kvlen, opt.qseg, opt.kvseg,
                        opt.pages, out, lse, prm});
  }
  return "";
}

inline std::string plan_backward(const SdpaParams& p, const SdpaBwdBuffers& io, Plan* plan) {
  std::string why = unsupported_reason(p);
  if (!why.empty()) return why;
  if (p.paged()) return "paged K/V has no backward (paged attention is for inference)";
  plan->params = make_params(p);
  const int dmax = dmax_bucket(p.head_dim, p.head_dim_v);
  const std::string tag = dtype_tag(p.dtype);
  using detail::add_buffer;
  const size_t qb = detail::qkv_bytes(p, p.heads_q, p.len_q, p.head_dim);
  const size_t kb = detail::qkv_bytes(p, p.heads_kv, p.len_kv, p.head_dim);
  const size_t vb = detail::qkv_bytes(p, p.heads_kv, p.len_kv, p.head_dim_v);
  const size_t ob = detail::qkv_bytes(p, p.heads_q, p.len_q, p.head_dim_v);
  const size_t nrows = size_t(p.batch * p.heads_q * p.len_q);
  const int q = add_buffer(plan, BufKind::kInput, io.q, qb);
  const int k = add_buffer(plan, BufKind::kInput, io.k, kb);
  const int v = add_buffer(plan, BufKind::kInput, io.v, vb);
  const int out = add_buffer(plan, BufKind::kInput, io.out, ob);
  const int lse = add_buffer(plan, BufKind::kInput, io.lse, nrows * sizeof(float));
  const int dout = add_buffer(plan, BufKind::kInput, io.dout, ob);
  const auto opt = detail::add_optional(p, plan);
  const int dq = add_buffer(plan, BufKind::kOutput, io.dq, qb);
  const int dk = add_buffer(plan, BufKind::kOutput, io.dk, kb);
  const int dv = add_buffer(plan, BufKind::kOutput, io.dv, vb);
  const int delta = add_buffer(plan, BufKind::kScratch, nullptr, nrows * sizeof(float));
  const int prm = add_buffer(plan, BufKind::kParams, nullptr, sizeof(SdpaMetalParams));
  plan->params_index = prm;
  const std::string sfx = tag + "_" + std::to_string(dmax) + variant_suffix(p);
  const uint32_t threads = SDPA_TILED_SG * SDPA_SIMD;
  detail::add_launch(plan, "sdpa_bwd_delta_" + tag, detail::ceil_div(int64_t(nrows), SDPA_TILED_SG),
                     1, 1, threads, {out, dout, delta, prm});
  detail::add_launch(plan, "sdpa_bwd_dq_" + sfx, detail::ceil_div(p.len_q, SDPA_TILED_ROWS),
                     uint32_t(p.heads_q), uint32_t(p.batch), threads,
                     {q, k, v, opt.mask, opt.qlen, opt.kvlen, opt.qseg, opt.kvseg, dout, lse,
                      delta, dq, prm});
  detail::add_launch(plan, "sdpa_bwd_dkdv_" + sfx, detail::ceil_div(p.len_kv, SDPA_TILED_ROWS),
                     uint32_t(p.heads_kv), uint32_t(p.batch), threads,
                     {q, k, v, opt.mask, opt.qlen, opt.kvlen, opt.qseg, opt.kvseg, dout, lse,
                      delta, dk, dv, prm});
  return "";
}

}  // namespace metal
}  // namespace jax_sdpa
