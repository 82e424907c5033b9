// A custom call described by its buffers' shapes and dtypes alone, so that lowering can run
// a handler's own unpacking (ffi/ffi_args.h) on a call before it exists: the questions only
// the native code can answer about a call (the bytes of its workspace) are asked of the same
// SdpaParams the handler will see. The buffers' addresses are placeholders, never read.
#pragma once

#include <cstdint>
#include <deque>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ffi/ffi_args.h"

namespace jax_sdpa {

inline XLA_FFI_DataType ffi_dtype_from_name(const std::string& name) {
  static const std::pair<const char*, XLA_FFI_DataType> kNames[] = {
      {"bool", XLA_FFI_DataType_PRED},     {"int8", XLA_FFI_DataType_S8},
      {"int16", XLA_FFI_DataType_S16},     {"int32", XLA_FFI_DataType_S32},
      {"int64", XLA_FFI_DataType_S64},     {"uint8", XLA_FFI_DataType_U8},
      {"uint32", XLA_FFI_DataType_U32},    {"float16", XLA_FFI_DataType_F16},
      {"bfloat16", XLA_FFI_DataType_BF16}, {"float32", XLA_FFI_DataType_F32},
      {"float64", XLA_FFI_DataType_F64}};
  for (const auto& [n, t] : kNames)
    if (name == n) return t;
  throw std::invalid_argument("jax_sdpa: no FFI dtype for " + name);
}

class ShapedBuffers {
 public:
  // A buffer of these dims and dtype (a numpy dtype name) at a distinct placeholder address.
  ffi::AnyBuffer add(std::vector<int64_t> dims, const std::string& dtype) {
    Held& h = held_.emplace_back();
    h.dims = std::move(dims);
    h.buf.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    h.buf.extension_start = nullptr;
    h.buf.dtype = ffi_dtype_from_name(dtype);
    // 256-byte aligned, one apart per buffer; never dereferenced.
    h.buf.data = reinterpret_cast<void*>(static_cast<uintptr_t>(held_.size()) << 20);
    h.buf.rank = static_cast<int64_t>(h.dims.size());
    h.buf.dims = h.dims.data();
    return ffi::AnyBuffer(&h.buf);
  }

 private:
  struct Held {
    std::vector<int64_t> dims;
    XLA_FFI_Buffer buf;
  };
  std::deque<Held> held_;  // stable addresses: AnyBuffer keeps a pointer to buf
};

}  // namespace jax_sdpa
