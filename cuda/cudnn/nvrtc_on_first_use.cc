// The NVRTC functions that cudnn-frontend (>= 1.2x, experimental/nvrtc_shim.h) calls when it
// compiles its own normalization kernels at run time: never for our attention graphs. Defined
// here so that the module loads without libnvrtc (the frontend would otherwise need it linked):
// each opens libnvrtc on its first call and forwards to it, or returns
// NVRTC_ERROR_INTERNAL_ERROR when there is none. Hidden (the module's default visibility), so
// another libnvrtc in the process is neither shadowed nor used by mistake.
// Built only for a cudnn-frontend that includes nvrtc.h (cmake/JaxSdpaCudaToolchain.cmake).
#include <dlfcn.h>
#include <nvrtc.h>

#include <cstddef>
#include <initializer_list>

namespace {

void* nvrtc_library() {
  static void* const handle = [] {
    for (const char* name : {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}) {
      if (void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return h;
    }
    return static_cast<void*>(nullptr);
  }();
  return handle;
}

template <typename Fn>
Fn nvrtc_function(const char* name) {
  void* library = nvrtc_library();
  return library ? reinterpret_cast<Fn>(dlsym(library, name)) : nullptr;
}

}  // namespace

#define JAX_SDPA_NVRTC_ON_FIRST_USE(name, params, args)                     \
  extern "C" nvrtcResult name params {                                      \
    static const auto fn = nvrtc_function<nvrtcResult(*) params>(#name);  \
    return fn ? fn args : NVRTC_ERROR_INTERNAL_ERROR;                        \
  }

JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcVersion, (int* major, int* minor), (major, minor))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcCreateProgram,
                            (nvrtcProgram * prog, const char* src, const char* name,
                             int numHeaders, const char* const* headers,
                             const char* const* includeNames),
                            (prog, src, name, numHeaders, headers, includeNames))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcDestroyProgram, (nvrtcProgram * prog), (prog))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcCompileProgram,
                            (nvrtcProgram prog, int numOptions, const char* const* options),
                            (prog, numOptions, options))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcGetCUBINSize, (nvrtcProgram prog, size_t* cubinSizeRet),
                            (prog, cubinSizeRet))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcGetCUBIN, (nvrtcProgram prog, char* cubin), (prog, cubin))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcGetProgramLogSize, (nvrtcProgram prog, size_t* logSizeRet),
                            (prog, logSizeRet))
JAX_SDPA_NVRTC_ON_FIRST_USE(nvrtcGetProgramLog, (nvrtcProgram prog, char* log), (prog, log))

extern "C" const char* nvrtcGetErrorString(nvrtcResult result) {
  using Fn = const char* (*)(nvrtcResult);
  static const auto fn = nvrtc_function<Fn>("nvrtcGetErrorString");
  return fn ? fn(result) : "NVRTC is not available (libnvrtc was not found)";
}
