// jax_sdpa._sdpa_cuda: the CUDA-platform FFI handlers as capsules, and what the native code
// knows that dispatch needs (jax_sdpa/dispatch.py asks these, never re-derives them): the
// decode kernels' workspace bytes, default kernel and refusals, the flash kernels' refusals
// and wgmma availability, cuDNN's band alignment and refusals, and the cuDNN in the process.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "cuda/cudnn/cudnn_sdpa.h"
#include "cuda/decode/decode_attention.h"
#include "cuda/flash/flash_attention.h"
#include "ffi/module_facts.h"
#include "ffi/module_registrations.h"
#include "ffi/sdpa_params.h"
#include "ffi/shaped_call.h"

namespace nb = nanobind;

using jax_sdpa::def_shape_fact;
using jax_sdpa::shape_params;

namespace {

using Shaped = std::pair<std::vector<int64_t>, std::string>;  // (dims, numpy dtype name)

// The custom call's attribute dictionary (primitives.ffi_attrs) as the handlers decode it, or
// why not: the handlers refuse a dictionary with a name JAX_SDPA_ATTRS doesn't list.
std::string attrs_from_dict(const nb::dict& d, jax_sdpa::SdpaAttrs* a) {
  size_t known = 0;
  auto get = [&](const char* key, auto* field) {
    if (!d.contains(key)) return;
    *field = nb::cast<std::decay_t<decltype(*field)>>(d[key]);
    ++known;
  };
#define JAX_SDPA_GET_ATTR(type, name, init) get(#name, &a->name);
  JAX_SDPA_ATTRS(JAX_SDPA_GET_ATTR)
#undef JAX_SDPA_GET_ATTR
  if (known == d.size()) return "";
  std::string unknown;
  for (auto [key, value] : d) {
    const std::string name = nb::cast<std::string>(key);
    bool listed = false;
#define JAX_SDPA_IS_ATTR(type, attr, init) listed = listed || name == #attr;
    JAX_SDPA_ATTRS(JAX_SDPA_IS_ATTR)
#undef JAX_SDPA_IS_ATTR
    if (!listed) unknown += (unknown.empty() ? "" : ", ") + name;
  }
  return "attributes the handlers don't decode: " + unknown;
}

// (bytes, '') of a cuDNN target's workspace result, or (0, why) where it can't be sized: the
// call unpacked as its handler will unpack it, then cudnn::scratch_bytes.
std::pair<int64_t, std::string> cudnn_workspace_bytes(bool backward, bool lse_wanted,
                                                      const std::vector<Shaped>& operands,
                                                      const std::vector<Shaped>& results,
                                                      const nb::dict& attr_dict) {
  const size_t n_in = backward ? 12 : 9, n_out = backward ? 3 : 2;
  if (operands.size() != n_in || results.size() != n_out)
    throw std::invalid_argument("cudnn_workspace_bytes: expected " + std::to_string(n_in) +
                                " operands and " + std::to_string(n_out) + " results");
  jax_sdpa::ShapedBuffers shaped;
  std::vector<xla::ffi::AnyBuffer> in, out;
  for (const Shaped& s : operands) in.push_back(shaped.add(s.first, s.second));
  for (const Shaped& s : results) out.push_back(shaped.add(s.first, s.second));
  jax_sdpa::SdpaAttrs attrs;
  if (std::string why = attrs_from_dict(attr_dict, &attrs); !why.empty()) return {0, why};
  const size_t opt_at = backward ? 6 : 3;
  const jax_sdpa::OptionalOperands opt{in[opt_at],     in[opt_at + 1], in[opt_at + 2],
                                       in[opt_at + 3], in[opt_at + 4], in[opt_at + 5]};
  jax_sdpa::SdpaParams p;
  xla::ffi::Error e;
  if (backward) {
    jax_sdpa::SdpaBwdBuffers b;
    e = jax_sdpa::unpack_backward(attrs, in[0], in[1], in[2], in[3], in[4], in[5], opt, out[0],
                                  out[1], out[2], &p, &b);
  } else {
    jax_sdpa::SdpaFwdBuffers b;
    e = jax_sdpa::unpack_forward(attrs, in[0], in[1], in[2], opt, out[0], out[1], &p, &b,
                                 lse_wanted);
  }
  if (e.failure()) return {0, e.message()};
  int64_t bytes = 0;
  jax_sdpa::cudnn::Status st = jax_sdpa::cudnn::scratch_bytes(p, backward, lse_wanted, &bytes);
  if (!st.ok()) return {0, st.message};
  return {bytes, ""};
}

}  // namespace

NB_MODULE(_sdpa_cuda, m) {
  namespace decode = jax_sdpa::cuda_decode;
  namespace flash = jax_sdpa::cuda_flash;
  m.doc() = "jax_sdpa NVIDIA backend: cuDNN SDPA graphs and our CUDA kernels behind XLA FFI";
  jax_sdpa::def_registrations(m);

  def_shape_fact(m, "decode_unsupported_reason", &decode::unsupported_reason,
                 "Why the decode kernels can't serve these shapes ('' when they can).");
  m.def(
      "decode_workspace_bytes",
      [](int64_t b, int64_t hq, int64_t hk, int64_t lq, int64_t lk, int64_t dv) {
        return decode::workspace_bytes(shape_params("float32", b, hq, hk, lq, lk, dv, dv));
      },
      nb::arg("batch"), nb::arg("heads_q"), nb::arg("heads_kv"), nb::arg("len_q"),
      nb::arg("len_kv"), nb::arg("head_dim_v"),
      "Bytes of the decode target's uint8 workspace result for these shapes (>= 256).");
  def_shape_fact(
      m, "decode_default_kernel",
      [](const jax_sdpa::SdpaParams& p) { return std::string(decode::default_kernel_name(p)); },
      "The decode kernel the default plan runs on an sm_90+ GPU ('' where not built).");
  def_shape_fact(m, "paged_decode_unsupported_reason", &decode::paged_unsupported_reason,
                 "Why the decode kernels can't read a paged call of these shapes in place ('' "
                 "when they can; the paged target then runs the flash feature kernel).");
  def_shape_fact(m, "flash_unsupported_reason", &flash::unsupported_reason,
                 "Why the flash kernels can't serve these shapes ('' when they can).");
  m.def(
      "flash_wgmma_serves",
      [](bool backward, const std::string& dtype, int64_t d, int64_t dv, int cc_major,
         int cc_minor) {
        return flash::wgmma_serves(backward, shape_params(dtype, 1, 1, 1, 1, 1, d, dv), cc_major,
                                   cc_minor);
      },
      nb::arg("backward"), nb::arg("dtype"), nb::arg("head_dim"), nb::arg("head_dim_v"),
      nb::arg("cc_major"), nb::arg("cc_minor"),
      "Whether the wgmma flash kernel of this direction runs these head dims on a GPU of this "
      "compute capability (and JAX_SDPA_FLASH_WGMMA / _BWD is not 0).");
  m.def(
      "cudnn_bottom_right_aligned",
      [](int64_t lq, int64_t lk, int64_t window_left, int64_t window_right, bool bottom_right,
         bool has_lengths) {
        jax_sdpa::SdpaParams p = shape_params("float16", 1, 1, 1, lq, lk, 8, 8);
        p.window_left = window_left;
        p.window_right = window_right;
        p.bottom_right = bottom_right;
        return jax_sdpa::cudnn::bottom_right_aligned(p, has_lengths);
      },
      nb::arg("len_q"), nb::arg("len_kv"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("bottom_right"), nb::arg("has_lengths"),
      "Whether our cuDNN graph asks for a bottom-right aligned band for this call.");
  m.def(
      "cudnn_unsupported_reason",
      [](int64_t batch, double logits_soft_cap, bool has_lengths, bool per_batch_sinks) {
        jax_sdpa::SdpaParams p = shape_params("float16", batch, 1, 1, 1, 1, 8, 8);
        p.logits_soft_cap = logits_soft_cap;
        return jax_sdpa::cudnn::unsupported_reason(p, has_lengths, per_batch_sinks);
      },
      nb::arg("batch"), nb::arg("logits_soft_cap"), nb::arg("has_lengths"),
      nb::arg("per_batch_sinks"),
      "Why our cuDNN graphs refuse a call for what it combines ('' when they don't).");
  m.def("cudnn_workspace_bytes", &cudnn_workspace_bytes, nb::arg("backward"),
        nb::arg("lse_wanted"), nb::arg("operands"), nb::arg("results"), nb::arg("attrs"),
        "(bytes, '') of the workspace result a cuDNN target takes for this call on the current "
        "device (its plan is built now and cached), or (0, why) where it can't be sized; "
        "operands and results are (dims, numpy dtype name) in the target's order, attrs its "
        "attribute dictionary.");
  // What a cuDNN target's workspace holds where cudnn_workspace_bytes can't size it: one
  // piece's alignment; the handler takes the rest from XLA's allocator outside capture.
  m.attr("cudnn_scratch_alignment") = jax_sdpa::cudnn::kScratchAlignment;
  m.def("cudnn_version", &jax_sdpa::cudnn::runtime_version,
        "Version of the libcudnn loaded in this process (e.g. 91900), -1 if it can't be queried.");
  m.def("cudnn_compiled_version", &jax_sdpa::cudnn::compiled_version,
        "CUDNN_VERSION of the headers this module was built with.");
  m.def("cudnn_frontend_version", &jax_sdpa::cudnn::frontend_version,
        "cudnn-frontend version this module was built with (e.g. 11600).");
  m.def("graph_cache_size", &jax_sdpa::cudnn::graph_cache_size,
        "Number of cuDNN graphs cached now (all devices).");
  m.def("graph_cache_capacity", &jax_sdpa::cudnn::graph_cache_capacity,
        "Capacity of the graph cache (env JAX_SDPA_CUDNN_CACHE_SIZE, default 256).");
  m.def("clear_graph_cache", &jax_sdpa::cudnn::clear_graph_cache,
        "Drops every cached cuDNN graph.");
}
