// What a native module tells dispatch about a call's shapes (jax_sdpa/dispatch.py asks, never
// re-derives): a shape fact is a function of SdpaParams bound as
// m.name(dtype, batch, heads_q, heads_kv, len_q, len_kv, head_dim, head_dim_v).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ffi/sdpa_params.h"

namespace jax_sdpa {

inline DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::kF32;
  if (name == "float16") return DType::kF16;
  if (name == "bfloat16") return DType::kBF16;
  throw std::invalid_argument("dtype must be float32, float16 or bfloat16, got " + name);
}

// The shapes of a call as the kernels see them ([B, H, L, D], dense); no buffers.
inline SdpaParams shape_params(const std::string& dtype, int64_t batch, int64_t heads_q,
                               int64_t heads_kv, int64_t len_q, int64_t len_kv,
                               int64_t head_dim, int64_t head_dim_v) {
  SdpaParams p;
  p.dtype = dtype_from_name(dtype);
  p.batch = batch;
  p.heads_q = heads_q;
  p.heads_kv = heads_kv;
  p.len_q = len_q;
  p.len_kv = len_kv;
  p.head_dim = head_dim;
  p.head_dim_v = head_dim_v;
  return p;
}

// m.name(dtype, batch, heads_q, heads_kv, len_q, len_kv, head_dim, head_dim_v) = fact(shape).
template <typename Fact>
void def_shape_fact(nanobind::module_& m, const char* name, Fact fact, const char* doc) {
  m.def(
      name,
      [fact](const std::string& dtype, int64_t b, int64_t hq, int64_t hk, int64_t lq, int64_t lk,
             int64_t d, int64_t dv) { return fact(shape_params(dtype, b, hq, hk, lq, lk, d, dv)); },
      nanobind::arg("dtype"), nanobind::arg("batch"), nanobind::arg("heads_q"),
      nanobind::arg("heads_kv"), nanobind::arg("len_q"), nanobind::arg("len_kv"),
      nanobind::arg("head_dim"), nanobind::arg("head_dim_v"), doc);
}

}  // namespace jax_sdpa
