// cuDNN SDPA (cudnn-frontend graphs) for the jax_sdpa kernel contract
// (docs/ffi_contract.md). No XLA types here: cuda/cudnn/ffi_handler.cc unpacks the
// call into SdpaParams + buffers and hands over its workspace as a Scratch.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi/sdpa_params.h"

namespace jax_sdpa::cudnn {

// Device memory that lives until the FFI call returns (stream-ordered use only).
class Scratch {
 public:
  virtual ~Scratch() = default;
  // nullptr when the allocation fails.
  virtual void* allocate(size_t bytes, size_t alignment) = 0;
};

// The alignment of each scratch piece a call takes out of one workspace buffer (cuDNN's
// workspace wants 256 bytes); scratch_bytes counts every piece rounded up to it.
constexpr size_t kScratchAlignment = 256;


struct Status {
  enum Code { kOk = 0, kInvalidArgument, kUnimplemented, kResourceExhausted, kInternal };
  Code code = kOk;
  std::string message;

  bool ok() const { return code == kOk; }
  static Status Ok() { return {}; }
  static Status Error(Code c, std::string m) { return {c, std::move(m)}; }
};

// out, lse = attention(q, k, v, ...): lse natural-log float32 [B, Hq, Lq];
// rows with nothing to attend get out = 0 and lse = -inf (or the sink). b.lse null (the
// caller wants no lse): cuDNN skips its stats unless the row fix-up reads them (then they
// go to scratch).
Status sdpa_forward(const SdpaParams& p, const SdpaFwdBuffers& b, cudaStream_t stream,
                    Scratch& scratch);

// dq, dk, dv from (q, k, v, out, lse, dout); dsinks / dmask are computed in JAX.
Status sdpa_backward(const SdpaParams& p, const SdpaBwdBuffers& b, cudaStream_t stream,
                     Scratch& scratch);

// The bytes of scratch sdpa_forward (backward false; lse_wanted: b.lse given) / sdpa_backward
// take for this call on the current device, each piece rounded up to kScratchAlignment, plus one alignment of
// slack: cuDNN's workspace for the call's plan (built now and cached, so the call finds it)
// and the clamped lengths, the mask as a bias, the inputs with rows past the lengths zeroed
// and the stats (the backward's; a forward's without lse whose rows need fixing). Asked at lowering, it sizes the cuDNN targets' workspace result.
// Fails as the call itself would (cuDNN refuses the graph, no device, ...).
Status scratch_bytes(const SdpaParams& p, bool backward, bool lse_wanted, int64_t* bytes);

// Whether the graph asks cuDNN for a bottom-right aligned band: a causal / window bound that
// excludes keys, bottom-right alignment, and Lq != Lk or lengths (the rules dispatch
// applies to such calls: cuDNN >= 9.6, no bias).
bool bottom_right_aligned(const SdpaParams& p, bool has_lengths);

// Why our cuDNN graphs refuse a call for what it combines ('' when they don't): soft-capping
// with q/kv lengths, per-batch sinks [B, Hq] (B > 1). The handlers refuse with it and
// dispatch asks it (`cudnn_unsupported_reason` of the _sdpa_cuda module).
std::string unsupported_reason(const SdpaParams& p, bool has_lengths, bool per_batch_sinks);

long runtime_version();   // cudnnGetVersion() of the loaded libcudnn
long compiled_version();  // CUDNN_VERSION of the headers
long frontend_version();  // CUDNN_FRONTEND_VERSION of the headers
long graph_cache_size();
long graph_cache_capacity();
void clear_graph_cache();

}  // namespace jax_sdpa::cudnn
