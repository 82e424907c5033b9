// One call of a contract target as its handler receives it. Every handler binds the same
// shape of call: its context, then RemainingArgs and RemainingRets, then the attributes
// (bind_call). unpack_*_call takes the buffers out of the frame in the contract's order
// (docs/ffi_contract.md), with a readable error when their count is off, unpacks and checks
// them (ffi/ffi_args.h) and refuses a contract feature the handler's kernels don't serve.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "ffi/ffi_args.h"

namespace jax_sdpa {

// ctx (e.g. ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()) + every operand +
// every result + the attribute dictionary.
template <typename Binding>
auto bind_call(Binding binding) {
  return bind_sdpa_attrs(std::move(binding).RemainingArgs().RemainingRets());
}

// The buffers of a call: the first kArgs operands and kRets results are the contract's, then
// up to kExtra more results of the target's own (the workspace of the decode and cuDNN
// targets).
template <size_t kArgs, size_t kRets, size_t kExtra = 1>
struct CallBuffers {
  std::array<std::optional<ffi::AnyBuffer>, kArgs> in;
  std::array<std::optional<ffi::AnyBuffer>, kRets + kExtra> out;

  const ffi::AnyBuffer& arg(size_t i) const { return *in[i]; }
  const ffi::AnyBuffer& ret(size_t i) const { return *out[i]; }
  // Takes them from the frame: kArgs operands, kRets + extra results, no others.
  ffi::Error take(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, size_t extra,
                  const char* call) {
    if (args.size() != kArgs || rets.size() != kRets + extra || extra > kExtra)
      return detail::invalid(std::string(call) + " takes " + std::to_string(kArgs) +
                             " operands and " + std::to_string(kRets + extra) +
                             " results (docs/ffi_contract.md), got " +
                             std::to_string(args.size()) + " and " +
                             std::to_string(rets.size()));
    for (size_t i = 0; i < kArgs; ++i) {
      auto b = args.get<ffi::AnyBuffer>(i);
      if (!b.has_value()) return detail::invalid(std::string(call) + ": operand " +
                                                 std::to_string(i) + " is not a buffer");
      in[i].emplace(*b);
    }
    for (size_t i = 0; i < kRets + extra; ++i) {
      auto b = rets.get<ffi::AnyBuffer>(i);
      if (!b.has_value()) return detail::invalid(std::string(call) + ": result " +
                                                 std::to_string(i) + " is not a buffer");
      out[i].emplace(**b);
    }
    return ffi::Error::Success();
  }
};

// The forward: q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids ->
// out, lse [, extra].
struct ForwardCall {
  CallBuffers<9, 2> b;
  SdpaParams p;
  SdpaFwdBuffers buf;
  const ffi::AnyBuffer& out() const { return b.ret(0); }
  const ffi::AnyBuffer& lse() const { return b.ret(1); }
  const ffi::AnyBuffer& extra() const { return b.ret(2); }
};

// The backward: q, k, v, out, lse, dout, then the forward's six optional operands ->
// dq, dk, dv [, extra].
struct BackwardCall {
  CallBuffers<12, 3> b;
  SdpaParams p;
  SdpaBwdBuffers buf;
  const ffi::AnyBuffer& dq() const { return b.ret(0); }
  const ffi::AnyBuffer& dk() const { return b.ret(1); }
  const ffi::AnyBuffer& dv() const { return b.ret(2); }
  const ffi::AnyBuffer& extra() const { return b.ret(3); }
};

// The paged forward: q, k_pages, v_pages, page_indices, kv_lengths, sinks -> out, lse
// [, extra].
struct PagedForwardCall {
  CallBuffers<6, 2> b;
  SdpaParams p;
  SdpaFwdBuffers buf;
  const ffi::AnyBuffer& out() const { return b.ret(0); }
  const ffi::AnyBuffer& lse() const { return b.ret(1); }
  const ffi::AnyBuffer& extra() const { return b.ret(2); }
};

// `who` names the handler in errors ("cpu", "cuda flash", ...); `served` its Feature bits.
// with_lse false: the target returns no lse (f32 [0] in its place; unpack_forward).
inline ffi::Error unpack_forward_call(const SdpaAttrs& a, const ffi::RemainingArgs& args,
                                      const ffi::RemainingRets& rets, size_t extra_results,
                                      uint32_t served, const char* who, ForwardCall* c,
                                      bool with_lse = true) {
  if (auto e = c->b.take(args, rets, extra_results, who); e.failure()) return e;
  const auto& in = c->b;
  const OptionalOperands opt{in.arg(3), in.arg(4), in.arg(5), in.arg(6), in.arg(7), in.arg(8)};
  if (auto e = unpack_forward(a, in.arg(0), in.arg(1), in.arg(2), opt, c->out(), c->lse(),
                              &c->p, &c->buf, with_lse);
      e.failure())
    return e;
  return refuse_unserved(c->p, served, who);
}

inline ffi::Error unpack_backward_call(const SdpaAttrs& a, const ffi::RemainingArgs& args,
                                       const ffi::RemainingRets& rets, size_t extra_results,
                                       uint32_t served, const char* who, BackwardCall* c) {
  if (auto e = c->b.take(args, rets, extra_results, who); e.failure()) return e;
  const auto& in = c->b;
  const OptionalOperands opt{in.arg(6), in.arg(7), in.arg(8), in.arg(9), in.arg(10),
                             in.arg(11)};
  if (auto e = unpack_backward(a, in.arg(0), in.arg(1), in.arg(2), in.arg(3), in.arg(4),
                               in.arg(5), opt, c->dq(), c->dk(), c->dv(), &c->p, &c->buf);
      e.failure())
    return e;
  return refuse_unserved(c->p, served, who);
}

inline ffi::Error unpack_paged_forward_call(const SdpaAttrs& a, const ffi::RemainingArgs& args,
                                            const ffi::RemainingRets& rets, size_t extra_results,
                                            uint32_t served, const char* who,
                                            PagedForwardCall* c) {
  if (auto e = c->b.take(args, rets, extra_results, who); e.failure()) return e;
  const auto& in = c->b;
  if (auto e = unpack_paged_forward(a, in.arg(0), in.arg(1), in.arg(2), in.arg(3), in.arg(4),
                                    in.arg(5), c->out(), c->lse(), &c->p, &c->buf);
      e.failure())
    return e;
  return refuse_unserved(c->p, served, who);
}

}  // namespace jax_sdpa
