// macOS runner: executes a launch Plan (host_plan.h) on the GPU with Metal.
// - kernels: a prebuilt sdpa_kernels.metallib next to the module if the build made one, else
//   the embedded source (kJaxSdpaMetalSource) compiled on first use with safe math (scores
//   can be -inf; fast math may turn that into NaN); pipelines cached by name;
// - buffers: XLA's host buffers are wrapped without a copy when page-aligned (16 KiB pages on
//   Apple silicon; the length is rounded up inside the same pages), copied otherwise;
// - one command queue, one command buffer per call (serial dispatches, so each kernel sees the
//   previous one's writes), wait for completion, an autorelease pool per call.
// Built only on macOS (ARC). Not compiled on the Linux CI: keep it small.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "metal/host/host_plan.h"

extern const char kJaxSdpaMetalSource[];

namespace jax_sdpa {
namespace metal {
namespace {

constexpr uintptr_t kPage = 16384;

std::string ns_error(NSError* e) {
  return e ? std::string([[e localizedDescription] UTF8String]) : std::string("unknown error");
}

class MetalRunner : public Runner {
 public:
  bool init(std::string* err) {
    @autoreleasepool {
      device_ = MTLCreateSystemDefaultDevice();
      if (device_ == nil) {
        *err = "MTLCreateSystemDefaultDevice() returned nil";
        return false;
      }
      queue_ = [device_ newCommandQueue];
      dummy_ = [device_ newBufferWithLength:16 options:MTLResourceStorageModeShared];
      name_ = [[device_ name] UTF8String];
    }
    return true;
  }

  std::string describe() override { return name_; }

  std::string run(const Plan& plan) override {
    @autoreleasepool {
      std::string err;
      std::vector<id<MTLComputePipelineState>> psos;
      for (const PlanLaunch& l : plan.launches) {
        id<MTLComputePipelineState> pso = pipeline(l.kernel, &err);
        if (pso == nil) return err;
        if (pso.maxTotalThreadsPerThreadgroup < l.threads)
          return l.kernel + ": needs " + std::to_string(l.threads) +
                 " threads per threadgroup, the device allows " +
                 std::to_string(pso.maxTotalThreadsPerThreadgroup);
        psos.push_back(pso);
      }
      const size_t n = plan.buffers.size();
      std::vector<id<MTLBuffer>> bufs(n, nil);
      std::vector<bool> copy_back(n, false);
      for (size_t i = 0; i < n; ++i) {
        const PlanBuffer& b = plan.buffers[i];
        if (b.kind == BufKind::kParams) continue;
        if (b.bytes == 0) {
          bufs[i] = dummy_;  // absent optional operand / empty scratch: never read
          continue;
        }
        if (b.kind == BufKind::kScratch) {
          bufs[i] = [device_ newBufferWithLength:b.bytes options:MTLResourceStorageModePrivate];
        } else if (reinterpret_cast<uintptr_t>(b.ptr) % kPage == 0) {
          const size_t len = (b.bytes + kPage - 1) / kPage * kPage;
          bufs[i] = [device_ newBufferWithBytesNoCopy:b.ptr
                                               length:len
                                              options:MTLResourceStorageModeShared
                                          deallocator:nil];
        } else if (b.kind == BufKind::kInput) {
          bufs[i] = [device_ newBufferWithBytes:b.ptr
                                         length:b.bytes
                                        options:MTLResourceStorageModeShared];
        } else {
          bufs[i] = [device_ newBufferWithLength:b.bytes options:MTLResourceStorageModeShared];
          copy_back[i] = true;
        }
        if (bufs[i] == nil) return "could not allocate a Metal buffer of " + std::to_string(b.bytes) + " bytes";
      }
      id<MTLCommandBuffer> cb = [queue_ commandBuffer];
      id<MTLComputeCommandEncoder> enc = [cb computeCommandEncoder];  // serial dispatch
      for (size_t li = 0; li < plan.launches.size(); ++li) {
        const PlanLaunch& l = plan.launches[li];
        [enc setComputePipelineState:psos[li]];
        for (size_t a = 0; a < l.args.size(); ++a) {
          const int bi = l.args[a];
          if (bi == plan.params_index)
            [enc setBytes:&plan.params length:sizeof(SdpaMetalParams) atIndex:a];
          else
            [enc setBuffer:bufs[size_t(bi)] offset:0 atIndex:a];
        }
        [enc dispatchThreadgroups:MTLSizeMake(l.grid[0], l.grid[1], l.grid[2])
            threadsPerThreadgroup:MTLSizeMake(l.threads, 1, 1)];
      }
      [enc endEncoding];
      [cb commit];
      [cb waitUntilCompleted];
      if ([cb status] != MTLCommandBufferStatusCompleted)
        return "Metal command buffer failed: " + ns_error([cb error]);
      for (size_t i = 0; i < n; ++i)
        if (copy_back[i]) std::memcpy(plan.buffers[i].ptr, [bufs[i] contents], plan.buffers[i].bytes);
    }
    return "";
  }

 private:
  id<MTLLibrary> library(std::string* err) {
    if (library_ != nil) return library_;
    NSError* e = nil;
    // A prebuilt .metallib installed next to this module (needs Xcode's offline compiler).
    Dl_info info;
    if (dladdr(reinterpret_cast<const void*>(kJaxSdpaMetalSource), &info) && info.dli_fname) {
      std::string path(info.dli_fname);
      path = path.substr(0, path.find_last_of('/') + 1) + "sdpa_kernels.metallib";
      NSURL* url = [NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]];
      if ([[NSFileManager defaultManager] fileExistsAtPath:[url path]])
        library_ = [device_ newLibraryWithURL:url error:&e];
    }
    if (library_ == nil) {
      MTLCompileOptions* opts = [MTLCompileOptions new];
      opts.languageVersion = MTLLanguageVersion3_1;  // bfloat
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
      if (@available(macOS 15.0, *)) {
        opts.mathMode = MTLMathModeSafe;
      } else {
        opts.fastMathEnabled = NO;
      }
#else
      opts.fastMathEnabled = NO;
#endif
      library_ = [device_ newLibraryWithSource:[NSString stringWithUTF8String:kJaxSdpaMetalSource]
                                       options:opts
                                         error:&e];
    }
    if (library_ == nil) *err = "compiling the Metal kernels failed: " + ns_error(e);
    return library_;
  }

  id<MTLComputePipelineState> pipeline(const std::string& name, std::string* err) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    id<MTLLibrary> lib = library(err);
    if (lib == nil) return nil;
    id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
    if (fn == nil) {
      *err = "no Metal kernel named " + name;
      return nil;
    }
    NSError* e = nil;
    id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&e];
    if (pso == nil) {
      *err = "pipeline " + name + ": " + ns_error(e);
      return nil;
    }
    pipelines_[name] = pso;
    return pso;
  }

  id<MTLDevice> device_ = nil;
  id<MTLCommandQueue> queue_ = nil;
  id<MTLBuffer> dummy_ = nil;
  id<MTLLibrary> library_ = nil;
  std::string name_;
  std::mutex mu_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

std::string g_error;

}  // namespace

Runner* runner() {
  static MetalRunner* r = [] {
    auto* m = new MetalRunner();
    if (!m->init(&g_error)) {
      delete m;
      return static_cast<MetalRunner*>(nullptr);
    }
    return m;
  }();
  return r;
}

std::string runner_error() {
  runner();
  return g_error;
}

}  // namespace metal
}  // namespace jax_sdpa
