// Unpacking XLA FFI buffers + attributes into SdpaParams, with every check a
// handler needs before it touches memory. Shared by all handlers (CPU, cuDNN,
// our CUDA kernels, Metal, the Metal emulator) so that they bind the same
// operands and attributes in the same order (docs/ffi_contract.md).
#pragma once

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>

#include "ffi/sdpa_params.h"
#include "xla/ffi/api/ffi.h"

namespace jax_sdpa {

namespace ffi = xla::ffi;

// The attributes every sdpa_fwd / sdpa_bwd custom call carries, as X(type, name, default):
// the one list behind SdpaAttrs, its FFI decoding below and any reading of the same attributes
// from elsewhere (the CUDA module sizes cuDNN workspaces from a Python dict of them).
//   fp32_precision: 0 default (fp32 inputs may use TF32 tensor cores), 1 highest (full fp32
//     accuracy); set from JAX's default matmul precision at trace time; only kernels that
//     would otherwise round fp32 operands (our CUDA flash kernels) look at it.
//   logits_soft_cap: SdpaParams::logits_soft_cap; 0 is off.
//   kv_layout: paged targets' page layout (kKvLayout*); 0 on every other target.
#define JAX_SDPA_ATTRS(X)           \
  X(double, scale, 1.0)             \
  X(int64_t, window_left, -1)       \
  X(int64_t, window_right, -1)      \
  X(bool, bottom_right, false)      \
  X(bool, seq_major, false)         \
  X(bool, has_mask, false)          \
  X(bool, has_sinks, false)         \
  X(bool, has_q_lengths, false)     \
  X(bool, has_kv_lengths, false)    \
  X(int64_t, fp32_precision, 0)     \
  X(double, logits_soft_cap, 0.0)   \
  X(bool, has_segment_ids, false)   \
  X(int64_t, kv_layout, 0)

#define JAX_SDPA_ATTR_FIELD(type, name, init) type name = init;
struct SdpaAttrs {
  JAX_SDPA_ATTRS(JAX_SDPA_ATTR_FIELD)
};
#undef JAX_SDPA_ATTR_FIELD

// Values of the fp32_precision attribute.
enum : int64_t { kFp32PrecisionDefault = 0, kFp32PrecisionHighest = 1 };

}  // namespace jax_sdpa

// The custom call's attribute dictionary unpacked into SdpaAttrs by name (all of them, no
// others): the handlers take one SdpaAttrs instead of thirteen parameters. The member list is
// JAX_SDPA_ATTRS's, each entry with a leading comma; JAX_SDPA_APPLY splits it into arguments.
#define JAX_SDPA_ATTR_MEMBER(type, name, init) , xla::ffi::StructMember<type>(#name)
#define JAX_SDPA_APPLY(macro, args) macro args
JAX_SDPA_APPLY(XLA_FFI_REGISTER_STRUCT_ATTR_DECODING,
               (jax_sdpa::SdpaAttrs JAX_SDPA_ATTRS(JAX_SDPA_ATTR_MEMBER)));
#undef JAX_SDPA_APPLY
#undef JAX_SDPA_ATTR_MEMBER

namespace jax_sdpa {

// Appends the attributes (the whole dictionary, as one SdpaAttrs) to an ffi::Bind().
template <typename Binding>
auto bind_sdpa_attrs(Binding binding) {
  // Binding::Attrs is &&-qualified: the binding has to be moved into it.
  return std::move(binding).template Attrs<SdpaAttrs>();
}

// Values of the kv_layout attribute (paged targets).
enum : int64_t {
  kKvLayoutHeadMajor = 0,  // "PHSD": pages [P, Hk, S, D]
  kKvLayoutSlotMajor = 1,  // "PSHD": pages [P, S, Hk, D] (vLLM, FlashAttention-3)
};

namespace detail {

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(d[i]);
  }
  return s + "]";
}

inline std::string dtype_str(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "dtype code " + std::to_string(static_cast<int>(t));
  }
}

// "float32 [1, 2, 5]": what a message says an operand is.
inline std::string typed_dims_str(ffi::DataType t, ffi::AnyBuffer::Dimensions d) {
  return dtype_str(t) + " " + dims_str(d);
}

inline ffi::Error invalid(const std::string& what) {
  return ffi::Error::InvalidArgument("jax_sdpa: " + what);
}

inline bool to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    default: return false;
  }
}

// Logical (b, h, l, d) extents of a q/k/v-like buffer under the layout.
struct Bhld {
  int64_t b, h, l, d;
};

inline ffi::Error read_bhld(const char* name, ffi::AnyBuffer::Dimensions dims,
                            bool seq_major, Bhld* out) {
  if (dims.size() != 4)
    return invalid(std::string(name) + " must have rank 4, got shape " + dims_str(dims));
  for (auto x : dims)
    if (x < 0) return invalid(std::string(name) + " has a negative dimension " + dims_str(dims));
  *out = seq_major ? Bhld{dims[0], dims[2], dims[1], dims[3]}
                   : Bhld{dims[0], dims[1], dims[2], dims[3]};
  return ffi::Error::Success();
}

inline void set_strides(const Bhld& s, bool seq_major, int64_t stride[3]) {
  if (seq_major) {  // [B, L, H, D]
    stride[0] = s.l * s.h * s.d;
    stride[1] = s.d;
    stride[2] = s.h * s.d;
  } else {  // [B, H, L, D]
    stride[0] = s.h * s.l * s.d;
    stride[1] = s.l * s.d;
    stride[2] = s.d;
  }
}

inline ffi::Error expect_same(const char* name, ffi::AnyBuffer::Dimensions got,
                              ffi::AnyBuffer::Dimensions want, const char* like) {
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < got.size(); ++i) same = got[i] == want[i];
  if (!same)
    return invalid(std::string(name) + " has shape " + dims_str(got) + ", expected " +
                   dims_str(want) + " (like " + like + ")");
  return ffi::Error::Success();
}


// An optional [B] int32 lengths operand (q_lengths / kv_lengths) into *out (null when absent).
inline ffi::Error unpack_lengths(const char* name, bool has, const ffi::AnyBuffer& buf,
                                 int64_t batch, const int32_t** out) {
  *out = nullptr;
  if (!has) return ffi::Error::Success();
  auto d = buf.dimensions();
  if (buf.element_type() != ffi::DataType::S32 || d.size() != 1 || d[0] != batch)
    return invalid(std::string(name) + " must be int32 [B=" + std::to_string(batch) +
                   "], got " + typed_dims_str(buf.element_type(), d));
  *out = static_cast<const int32_t*>(buf.untyped_data());
  return ffi::Error::Success();
}

// The optional sinks [1 or B, Hq] float32 into p (p->batch and p->heads_q already set).
inline ffi::Error unpack_sinks(bool has, const ffi::AnyBuffer& sinks, SdpaParams* p) {
  p->sinks = nullptr;
  if (!has) return ffi::Error::Success();
  auto sd = sinks.dimensions();
  if (sinks.element_type() != ffi::DataType::F32 || sd.size() != 2 || sd[1] != p->heads_q ||
      (sd[0] != 1 && sd[0] != p->batch))
    return invalid("sinks must be float32 [1 or B, Hq], got " +
                   typed_dims_str(sinks.element_type(), sd));
  p->sinks = static_cast<const float*>(sinks.untyped_data());
  p->sinks_batch_stride = (sd[0] == 1 && p->batch != 1) ? 0 : p->heads_q;
  return ffi::Error::Success();
}

}  // namespace detail

// The scalar attributes every target checks the same way: scale, band, fp32_precision and
// logits_soft_cap into p.
inline ffi::Error unpack_scalar_attrs(const SdpaAttrs& a, SdpaParams* p) {
  using detail::invalid;
  if (!std::isfinite(a.scale)) return invalid("scale must be finite, got " + std::to_string(a.scale));
  p->scale = a.scale;
  if (a.window_left < -1 || a.window_right < -1)
    return invalid("window sizes must be >= 0 or -1 (unbounded)");
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  p->bottom_right = a.bottom_right;
  if (a.fp32_precision != kFp32PrecisionDefault && a.fp32_precision != kFp32PrecisionHighest)
    return invalid("fp32_precision must be 0 (default) or 1 (highest), got " +
                   std::to_string(a.fp32_precision));
  if (!(a.logits_soft_cap >= 0) || !std::isfinite(a.logits_soft_cap))
    return invalid("logits_soft_cap must be finite and >= 0 (0: off), got " +
                   std::to_string(a.logits_soft_cap));
  p->logits_soft_cap = a.logits_soft_cap;
  return ffi::Error::Success();
}

// The optional operands of both directions, in the contract's order.
struct OptionalOperands {
  const ffi::AnyBuffer& mask;
  const ffi::AnyBuffer& sinks;
  const ffi::AnyBuffer& q_lengths;
  const ffi::AnyBuffer& kv_lengths;
  const ffi::AnyBuffer& q_segment_ids;
  const ffi::AnyBuffer& kv_segment_ids;
};

// Unpacks q, k, v, the optional operands and the attributes of a (non-paged) call.
// Checks ranks, consistency, dtypes, broadcastability and sizes; never reads
// buffer contents (lengths are clamped by the kernels via clamp_length).
inline ffi::Error unpack_inputs(const SdpaAttrs& a, const ffi::AnyBuffer& q,
                                const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                const OptionalOperands& opt, SdpaParams* p) {
  const ffi::AnyBuffer& mask = opt.mask;
  const ffi::AnyBuffer& sinks = opt.sinks;
  const ffi::AnyBuffer& q_lengths = opt.q_lengths;
  const ffi::AnyBuffer& kv_lengths = opt.kv_lengths;
  using detail::invalid;
  detail::Bhld qs, ks, vs;
  if (auto e = detail::read_bhld("q", q.dimensions(), a.seq_major, &qs); e.failure()) return e;
  if (auto e = detail::read_bhld("k", k.dimensions(), a.seq_major, &ks); e.failure()) return e;
  if (auto e = detail::read_bhld("v", v.dimensions(), a.seq_major, &vs); e.failure()) return e;
  if (!detail::to_dtype(q.element_type(), &p->dtype))
    return invalid("q must be float32, float16 or bfloat16, got " +
                   detail::dtype_str(q.element_type()));
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid("q, k and v must have the same dtype, got " +
                   detail::dtype_str(q.element_type()) + ", " +
                   detail::dtype_str(k.element_type()) + ", " +
                   detail::dtype_str(v.element_type()));
  if (ks.b != qs.b || vs.b != qs.b)
    return invalid("q, k, v batch sizes differ: q " + detail::dims_str(q.dimensions()) +
                   ", k " + detail::dims_str(k.dimensions()) + ", v " +
                   detail::dims_str(v.dimensions()));
  if (ks.h == 0 || vs.h != ks.h || qs.h % ks.h != 0)
    return invalid("heads: q has " + std::to_string(qs.h) + ", k " + std::to_string(ks.h) +
                   ", v " + std::to_string(vs.h) + "; need k == v and q a multiple of k");
  if (ks.d != qs.d)
    return invalid("q and k head dims differ: q " + detail::dims_str(q.dimensions()) + ", k " +
                   detail::dims_str(k.dimensions()));
  if (vs.l != ks.l)
    return invalid("k and v lengths differ: k " + detail::dims_str(k.dimensions()) + ", v " +
                   detail::dims_str(v.dimensions()));
  if (qs.d == 0 || vs.d == 0)
    return invalid("head dims must be positive, got D=" + std::to_string(qs.d) +
                   ", Dv=" + std::to_string(vs.d));

  p->batch = qs.b;
  p->heads_q = qs.h;
  p->heads_kv = ks.h;
  p->len_q = qs.l;
  p->len_kv = ks.l;
  p->head_dim = qs.d;
  p->head_dim_v = vs.d;
  p->seq_major = a.seq_major;
  detail::set_strides(qs, a.seq_major, p->q_stride);
  detail::set_strides(ks, a.seq_major, p->k_stride);
  detail::set_strides(vs, a.seq_major, p->v_stride);
  detail::set_strides({qs.b, qs.h, qs.l, vs.d}, a.seq_major, p->o_stride);

  if (auto e = unpack_scalar_attrs(a, p); e.failure()) return e;

  // mask: rank 4 (b, h_q, i, j), each dim 1 or full; head-major in both layouts.
  p->mask_kind = MaskKind::kNone;
  p->mask = nullptr;
  if (a.has_mask) {
    auto md = mask.dimensions();
    const int64_t full[4] = {p->batch, p->heads_q, p->len_q, p->len_kv};
    if (md.size() != 4)
      return invalid("mask must have rank 4, got shape " + detail::dims_str(md));
    int64_t stride = 1;
    for (int axis = 3; axis >= 0; --axis) {
      if (md[axis] == full[axis] && full[axis] != 1) {
        p->mask_stride[axis] = stride;
      } else if (md[axis] == 1) {
        p->mask_stride[axis] = 0;
      } else {
        return invalid("mask shape " + detail::dims_str(md) +
                       " does not broadcast to [B, Hq, Lq, Lk] = [" +
                       std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " +
                       std::to_string(full[2]) + ", " + std::to_string(full[3]) + "]");
      }
      stride *= md[axis];
    }
    if (mask.element_type() == ffi::DataType::PRED) {
      p->mask_kind = MaskKind::kBool;
    } else if (detail::to_dtype(mask.element_type(), &p->mask_dtype)) {
      p->mask_kind = MaskKind::kAdditive;
    } else {
      return invalid("mask must be bool, float32, float16 or bfloat16, got " +
                     detail::dtype_str(mask.element_type()));
    }
    p->mask = mask.untyped_data();
  }

  if (auto e = detail::unpack_sinks(a.has_sinks, sinks, p); e.failure()) return e;

  if (auto e = detail::unpack_lengths("q_lengths", a.has_q_lengths, q_lengths, p->batch,
                                      &p->q_lengths);
      e.failure())
    return e;
  if (auto e = detail::unpack_lengths("kv_lengths", a.has_kv_lengths, kv_lengths, p->batch,
                                      &p->kv_lengths);
      e.failure())
    return e;

  p->q_segment_ids = p->kv_segment_ids = nullptr;
  if (a.has_segment_ids) {
    auto unpack_ids = [&](const char* name, const ffi::AnyBuffer& buf, int64_t len,
                          const int32_t** out) -> ffi::Error {
      auto d = buf.dimensions();
      if (buf.element_type() != ffi::DataType::S32 || d.size() != 2 || d[0] != p->batch ||
          d[1] != len)
        return invalid(std::string(name) + " must be int32 [B, " +
                       (len == p->len_q ? "Lq" : "Lk") + "] = [" + std::to_string(p->batch) +
                       ", " + std::to_string(len) + "], got " +
                       detail::typed_dims_str(buf.element_type(), d));
      *out = static_cast<const int32_t*>(buf.untyped_data());
      return ffi::Error::Success();
    };
    if (auto e = unpack_ids("q_segment_ids", opt.q_segment_ids, p->len_q, &p->q_segment_ids);
        e.failure())
      return e;
    if (auto e = unpack_ids("kv_segment_ids", opt.kv_segment_ids, p->len_kv,
                            &p->kv_segment_ids);
        e.failure())
      return e;
  }
  if (a.kv_layout != 0)
    return invalid("kv_layout must be 0 on a non-paged target, got " +
                   std::to_string(a.kv_layout));
  return ffi::Error::Success();
}

// A handler's kernels serve the base contract plus the Feature bits in `served` (the set it
// registered with, ffi/registry.h): a call using any other is refused, naming it.
inline ffi::Error refuse_unserved(const SdpaParams& p, uint32_t served, const char* target) {
  uint32_t missing = p.features() & ~served;
  for (uint32_t f = 1; missing != 0; f <<= 1) {
    if (missing & f)
      return detail::invalid(std::string(target) + " does not serve " + feature_name(f) +
                             " (this build's kernels)");
    missing &= ~f;
  }
  return ffi::Error::Success();
}

// Checks an output/gradient buffer against the expected shape and q's dtype.
inline ffi::Error check_like(const char* name, const ffi::AnyBuffer::Dimensions got,
                             ffi::DataType got_type, const ffi::AnyBuffer& like,
                             const char* like_name, int64_t last_dim) {
  auto want = like.dimensions();
  if (got.size() != 4 || want.size() != 4 || got[0] != want[0] || got[1] != want[1] ||
      got[2] != want[2] || got[3] != last_dim)
    return detail::invalid(std::string(name) + " has shape " + detail::dims_str(got) +
                           ", inconsistent with " + like_name + " " + detail::dims_str(want));
  if (got_type != like.element_type())
    return detail::invalid(std::string(name) + " has dtype " + detail::dtype_str(got_type) +
                           ", " + like_name + " " + detail::dtype_str(like.element_type()));
  return ffi::Error::Success();
}

inline ffi::Error check_lse(ffi::AnyBuffer::Dimensions d, ffi::DataType t, const SdpaParams& p) {
  if (t != ffi::DataType::F32 || d.size() != 3 || d[0] != p.batch || d[1] != p.heads_q ||
      d[2] != p.len_q)
    return detail::invalid("lse must be float32 [B, Hq, Lq] = [" + std::to_string(p.batch) +
                           ", " + std::to_string(p.heads_q) + ", " + std::to_string(p.len_q) +
                           "], got " + detail::typed_dims_str(t, d));
  return ffi::Error::Success();
}

// Everything a forward handler checks and collects before it runs: the inputs
// (unpack_inputs), out and lse against them, and the buffers' addresses. A target that
// returns no lse (with_lse false: jax_sdpa_cudnn_fwd_no_lse) takes an f32 [0] in its place
// and gets buf->lse == nullptr.
inline ffi::Error unpack_forward(const SdpaAttrs& a, const ffi::AnyBuffer& q,
                                 const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                 const OptionalOperands& opt, const ffi::AnyBuffer& out,
                                 const ffi::AnyBuffer& lse, SdpaParams* p, SdpaFwdBuffers* buf,
                                 bool with_lse = true) {
  if (auto e = unpack_inputs(a, q, k, v, opt, p); e.failure())
    return e;
  if (auto e = check_like("out", out.dimensions(), out.element_type(), q, "q", p->head_dim_v);
      e.failure())
    return e;
  if (with_lse) {
    if (auto e = check_lse(lse.dimensions(), lse.element_type(), *p); e.failure()) return e;
  } else if (lse.element_type() != ffi::DataType::F32 || lse.dimensions().size() != 1 ||
             lse.dimensions()[0] != 0) {
    return detail::invalid("this target returns no lse: its lse result must be float32 [0], got " +
                           detail::typed_dims_str(lse.element_type(), lse.dimensions()));
  }
  buf->q = q.untyped_data();
  buf->k = k.untyped_data();
  buf->v = v.untyped_data();
  buf->out = out.untyped_data();
  buf->lse = with_lse ? static_cast<float*>(lse.untyped_data()) : nullptr;
  return ffi::Error::Success();
}

// Everything a paged forward handler checks and collects before it runs: q, the page pool
// in its layout, page_indices [B, pages_per_seq], kv_lengths [B], sinks, out and lse, and
// the fixed attributes of a paged call (no mask, q lengths or segment ids; kv lengths
// present; bottom-right; head-major q). Fills SdpaParams' paged fields: len_kv =
// pages_per_seq * page_size and k_stride / v_stride = (page, head, slot) strides of the
// layout (paged_key_row). Never reads buffer contents: page indices are range-checked and
// lengths clamped by the kernels (paged_key_row, clamp_length).
inline ffi::Error unpack_paged_forward(const SdpaAttrs& a, const ffi::AnyBuffer& q,
                                       const ffi::AnyBuffer& k_pages,
                                       const ffi::AnyBuffer& v_pages,
                                       const ffi::AnyBuffer& page_indices,
                                       const ffi::AnyBuffer& kv_lengths,
                                       const ffi::AnyBuffer& sinks, const ffi::AnyBuffer& out,
                                       const ffi::AnyBuffer& lse, SdpaParams* p,
                                       SdpaFwdBuffers* buf) {
  using detail::dims_str;
  using detail::invalid;
  if (a.has_mask || a.has_q_lengths || a.has_segment_ids)
    return invalid("a paged call takes no mask, q_lengths or segment ids (has_mask, "
                   "has_q_lengths and has_segment_ids must be false)");
  if (!a.has_kv_lengths) return invalid("a paged call needs kv_lengths (has_kv_lengths)");
  if (!a.bottom_right || a.seq_major)
    return invalid("a paged call is bottom-right aligned with q [B, Hq, Lq, D] "
                   "(bottom_right = true, seq_major = false)");
  if (a.kv_layout != kKvLayoutHeadMajor && a.kv_layout != kKvLayoutSlotMajor)
    return invalid("kv_layout must be 0 (pages [P, Hk, S, D]) or 1 ([P, S, Hk, D]), got " +
                   std::to_string(a.kv_layout));
  const bool head_major = a.kv_layout == kKvLayoutHeadMajor;
  const char* layout = head_major ? "[num_pages, Hk, page_size, " : "[num_pages, page_size, Hk, ";

  detail::Bhld qs;
  if (auto e = detail::read_bhld("q", q.dimensions(), false, &qs); e.failure()) return e;
  if (!detail::to_dtype(q.element_type(), &p->dtype))
    return invalid("q must be float32, float16 or bfloat16, got " +
                   detail::dtype_str(q.element_type()));
  if (k_pages.element_type() != q.element_type() || v_pages.element_type() != q.element_type())
    return invalid("q, k_pages and v_pages must have the same dtype, got " +
                   detail::dtype_str(q.element_type()) + ", " +
                   detail::dtype_str(k_pages.element_type()) + ", " +
                   detail::dtype_str(v_pages.element_type()));
  auto kd = k_pages.dimensions(), vd = v_pages.dimensions();
  if (kd.size() != 4 || vd.size() != 4)
    return invalid(std::string("k_pages and v_pages must have rank 4 ") + layout +
                   "D], got " + dims_str(kd) + " and " + dims_str(vd));
  for (auto x : kd)
    if (x < 0) return invalid("k_pages has a negative dimension " + dims_str(kd));
  for (auto x : vd)
    if (x < 0) return invalid("v_pages has a negative dimension " + dims_str(vd));
  const int64_t num_pages = kd[0];
  const int64_t heads_kv = head_major ? kd[1] : kd[2];
  const int64_t page_size = head_major ? kd[2] : kd[1];
  const int64_t head_dim = kd[3], head_dim_v = vd[3];
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return invalid(std::string("k_pages ") + dims_str(kd) + " and v_pages " + dims_str(vd) +
                   " must agree in num_pages, Hk and page_size (" + layout + "D])");
  if (num_pages == 0 || page_size == 0)
    return invalid("the page pool must hold pages of at least one slot, got k_pages " +
                   dims_str(kd));
  if (heads_kv == 0 || qs.h % heads_kv != 0)
    return invalid("heads: q has " + std::to_string(qs.h) + ", k_pages " +
                   std::to_string(heads_kv) + "; need q a multiple of k_pages' (k_pages " +
                   dims_str(kd) + ", " + layout + "D])");
  if (head_dim != qs.d)
    return invalid("q and k_pages head dims differ: q " + dims_str(q.dimensions()) +
                   ", k_pages " + dims_str(kd));
  if (qs.d == 0 || head_dim_v == 0)
    return invalid("head dims must be positive, got D=" + std::to_string(qs.d) +
                   ", Dv=" + std::to_string(head_dim_v));

  auto pd = page_indices.dimensions();
  if (page_indices.element_type() != ffi::DataType::S32 || pd.size() != 2 || pd[0] != qs.b ||
      pd[1] < 1)
    return invalid("page_indices must be int32 [B=" + std::to_string(qs.b) +
                   ", pages_per_seq >= 1], got " +
                   detail::typed_dims_str(page_indices.element_type(), pd));
  if (auto e = detail::unpack_lengths("kv_lengths", true, kv_lengths, qs.b, &p->kv_lengths);
      e.failure())
    return e;

  p->batch = qs.b;
  p->heads_q = qs.h;
  p->heads_kv = heads_kv;
  p->len_q = qs.l;
  p->pages_per_seq = pd[1];
  p->page_size = page_size;
  p->num_pages = num_pages;
  p->len_kv = pd[1] * page_size;
  p->head_dim = qs.d;
  p->head_dim_v = head_dim_v;
  p->seq_major = false;
  detail::set_strides(qs, false, p->q_stride);
  detail::set_strides({qs.b, qs.h, qs.l, head_dim_v}, false, p->o_stride);
  auto page_strides = [&](int64_t d, int64_t stride[3]) {
    stride[0] = heads_kv * page_size * d;                  // page
    stride[1] = head_major ? page_size * d : d;            // head
    stride[2] = head_major ? d : heads_kv * d;             // slot
  };
  page_strides(head_dim, p->k_stride);
  page_strides(head_dim_v, p->v_stride);
  p->page_indices = static_cast<const int32_t*>(page_indices.untyped_data());
  p->q_lengths = nullptr;
  p->q_segment_ids = p->kv_segment_ids = nullptr;
  p->mask_kind = MaskKind::kNone;
  p->mask = nullptr;

  if (auto e = unpack_scalar_attrs(a, p); e.failure()) return e;
  if (auto e = detail::unpack_sinks(a.has_sinks, sinks, p); e.failure()) return e;

  if (auto e = check_like("out", out.dimensions(), out.element_type(), q, "q", head_dim_v);
      e.failure())
    return e;
  if (auto e = check_lse(lse.dimensions(), lse.element_type(), *p); e.failure()) return e;
  buf->q = q.untyped_data();
  buf->k = k_pages.untyped_data();
  buf->v = v_pages.untyped_data();
  buf->out = out.untyped_data();
  buf->lse = static_cast<float*>(lse.untyped_data());
  return ffi::Error::Success();
}

// The same for a backward handler: inputs, out/dout/lse, and dq/dk/dv.
inline ffi::Error unpack_backward(const SdpaAttrs& a, const ffi::AnyBuffer& q,
                                  const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                  const ffi::AnyBuffer& out, const ffi::AnyBuffer& lse,
                                  const ffi::AnyBuffer& dout, const OptionalOperands& opt,
                                  const ffi::AnyBuffer& dq, const ffi::AnyBuffer& dk,
                                  const ffi::AnyBuffer& dv, SdpaParams* p, SdpaBwdBuffers* buf) {
  if (auto e = unpack_inputs(a, q, k, v, opt, p); e.failure())
    return e;
  struct Like {
    const char* name;
    const ffi::AnyBuffer& buf;
    const ffi::AnyBuffer& like;
    const char* like_name;
    int64_t last_dim;
  };
  const Like checks[] = {{"out", out, q, "q", p->head_dim_v}, {"dout", dout, q, "q", p->head_dim_v},
                         {"dq", dq, q, "q", p->head_dim},     {"dk", dk, k, "k", p->head_dim},
                         {"dv", dv, v, "v", p->head_dim_v}};
  for (const Like& c : checks)
    if (auto e = check_like(c.name, c.buf.dimensions(), c.buf.element_type(), c.like, c.like_name,
                            c.last_dim);
        e.failure())
      return e;
  if (auto e = check_lse(lse.dimensions(), lse.element_type(), *p); e.failure()) return e;
  buf->q = q.untyped_data();
  buf->k = k.untyped_data();
  buf->v = v.untyped_data();
  buf->out = out.untyped_data();
  buf->lse = static_cast<const float*>(lse.untyped_data());
  buf->dout = dout.untyped_data();
  buf->dq = dq.untyped_data();
  buf->dk = dk.untyped_data();
  buf->dv = dv.untyped_data();
  return ffi::Error::Success();
}

// Tests set JAX_SDPA_POISON_OUTPUTS=1 so that handlers fill every output with NaN
// before running the kernel: an element the kernel forgets to write then fails
// the comparison instead of passing on whatever memory held. Read once.
inline bool poison_outputs_requested() {
  static const bool requested = [] {
    const char* v = std::getenv("JAX_SDPA_POISON_OUTPUTS");
    return v != nullptr && std::strcmp(v, "0") != 0 && v[0] != '\0';
  }();
  return requested;
}

// Host-memory handlers (CPU, Metal): the poisoning itself. Empty buffers are skipped (they
// may have no address).
inline void poison_host_outputs(std::initializer_list<const ffi::AnyBuffer*> results) {
  if (!poison_outputs_requested()) return;
  for (const ffi::AnyBuffer* r : results)
    if (r->size_bytes() > 0) std::memset(r->untyped_data(), 0xff, r->size_bytes());
}

}  // namespace jax_sdpa
