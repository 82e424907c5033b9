// Host side of decode v2 (DRAFT, compile-checked only; opt-in with
// JAX_SDPA_CUDA_DECODE_V2=1, read per call by cuda/decode_attention.cu).
// Kernels: decode_v2.cuh. Design: docs/cuda_decode.md, "v2 draft (not yet run)".
#include "decode_v2.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "decode_v2.cuh"

namespace jax_sdpa {
namespace cuda_decode {
namespace v2 {
namespace {

// Per head dim: consumer warps NW, ring stages NS (16-key K+V tiles), rows 8 * NT.
//   D64  NT2: stage 5.3 KB x 24 = 126 KB ring, ~149 KB smem
//   D128 NT2: stage 9.3 KB x 16 = 148 KB ring, ~186 KB smem
//   D256 NT2: stage 17.3 KB x 8 = 138 KB ring, ~213 KB smem
//   D512 NT1: stage 33.3 KB x 5 = 166 KB ring, ~208 KB smem (2 consumer warps: a
//             warp's 16-key D512 tile is ~1000 cycles of mma vs ~2000 cycles of HBM
//             time per SM at 16 B/cycle, so 2 warps keep up and leave 3 stages in flight)
template <int D> struct Tune;
template <> struct Tune<64> { static constexpr int NW = 4, NS = 24; };
template <> struct Tune<128> { static constexpr int NW = 4, NS = 16; };
template <> struct Tune<256> { static constexpr int NW = 4, NS = 8; };
template <> struct Tune<512> { static constexpr int NW = 2, NS = 5; };

struct KInfo {
  const void* func = nullptr;
  void (*launch)(const Args&, const Work&, int grid, cudaStream_t) = nullptr;
  void (*combine)(const Args&, const Work&, cudaStream_t) = nullptr;
  int threads = 0, warps = 0, stages = 0;
  size_t smem = 0;
};

template <typename T, int D, int NT>
KInfo info() {
  constexpr int NW = Tune<D>::NW, NS = Tune<D>::NS;
  using Cfg = Config<T, D, NT, NW, NS>;
  static_assert(Cfg::kSmem <= 227 * 1024, "decode_v2_kernel: too much shared memory");
  KInfo k;
  k.func = reinterpret_cast<const void*>(&decode_v2_kernel<T, D, NT, NW, NS>);
  k.launch = [](const Args& a, const Work& w, int grid, cudaStream_t st) {
    decode_v2_kernel<T, D, NT, NW, NS><<<grid, Cfg::kThreads, Cfg::kSmem, st>>>(a, w);
  };
  k.combine = [](const Args& a, const Work& w, cudaStream_t st) {
    const long long items = static_cast<long long>(w.U) * a.R * (D / 4);
    combine_v2_kernel<T, D><<<static_cast<unsigned>((items + 127) / 128), 128, 0, st>>>(a, w);
  };
  k.threads = Cfg::kThreads;
  k.warps = NW;
  k.stages = NS;
  k.smem = Cfg::kSmem;
  return k;
}

template <typename T>
KInfo select_t(int64_t d, int nt) {
  switch (d) {
    case 64: return nt == 1 ? info<T, 64, 1>() : info<T, 64, 2>();
    case 128: return nt == 1 ? info<T, 128, 1>() : info<T, 128, 2>();
    case 256: return nt == 1 ? info<T, 256, 1>() : info<T, 256, 2>();
    case 512: return nt == 1 ? info<T, 512, 1>() : KInfo{};
  }
  return KInfo{};
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::atoi(v);
}

struct Facts {
  int sms = 0, major = 0;
  size_t smem_optin = 0;
};
std::mutex g_mu;
std::map<int, Facts> g_facts;
std::map<std::pair<const void*, int>, int> g_occ;

bool device_facts(int device, Facts* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_facts.find(device);
  if (it != g_facts.end()) {
    *out = it->second;
    return true;
  }
  Facts f;
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return false;
  f.sms = v;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  f.major = v;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return false;
  f.smem_optin = static_cast<size_t>(v);
  g_facts[device] = f;
  *out = f;
  return true;
}

int occupancy(const KInfo& k, int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto key = std::make_pair(k.func, device);
  auto it = g_occ.find(key);
  if (it != g_occ.end()) return it->second;
  int n = 0;
  if (cudaFuncSetAttribute(k.func, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(k.smem)) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.func, k.threads, k.smem) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  g_occ[key] = n;
  return n;
}

// Everything decided on the host for one call.
struct Plan {
  KInfo k;
  Work w{};
  size_t scratch = 0;
  bool ok = false;
};

bool aligned16(int64_t stride_elems) { return (stride_elems * 2) % 16 == 0; }

Plan make(const SdpaParams& p, int device) {
  Plan pl;
  if (p.dtype != DType::kF16 && p.dtype != DType::kBF16) return pl;
  if (p.head_dim != p.head_dim_v) return pl;
  const int64_t d = p.head_dim;
  if (d != 64 && d != 128 && d != 256 && d != 512) return pl;
  const int64_t R = p.group() * p.len_q;
  if (R < 1 || R > (d == 512 ? 8 : 16)) return pl;
  if (p.len_kv < 1 || p.len_kv > (int64_t{1} << 30)) return pl;
  const int64_t U = p.batch * p.heads_kv;
  if (U < 1 || U > (int64_t{1} << 30)) return pl;
  for (int i = 0; i < 3; ++i)
    if (!aligned16(p.k_stride[i]) || !aligned16(p.v_stride[i]) || !aligned16(p.q_stride[i]))
      return pl;
  Facts f;
  if (!device_facts(device, &f) || f.major < 9) return pl;
  const int nt = R <= 8 ? 1 : 2;
  pl.k = p.dtype == DType::kBF16 ? select_t<__nv_bfloat16>(d, nt) : select_t<__half>(d, nt);
  if (pl.k.func == nullptr || pl.k.smem > f.smem_optin) return pl;
  const int occ = occupancy(pl.k, device);
  if (occ < 1) return pl;
  const int64_t tpu = (p.len_kv + kTileKeys - 1) / kTileKeys;
  const int64_t T = U * tpu;
  int64_t C = static_cast<int64_t>(f.sms) * occ;
  const int want = env_int("JAX_SDPA_CUDA_DECODE_V2_CTAS", 0);  // sweep: pin the grid
  if (want > 0) C = want;
  C = std::max<int64_t>(1, std::min<int64_t>(C, T));
  pl.w.T = T;
  pl.w.U = static_cast<int>(U);
  pl.w.TPU = static_cast<int>(tpu);
  pl.w.C = static_cast<int>(C);
  const size_t o_bytes = static_cast<size_t>(2 * C) * kSlotRows * d * sizeof(float);
  const size_t l_bytes = static_cast<size_t>(2 * C) * kSlotRows * sizeof(float);
  pl.scratch = (o_bytes + 255) / 256 * 256 + (l_bytes + 255) / 256 * 256;
  pl.ok = true;
  return pl;
}

}  // namespace

bool enabled() { return env_int("JAX_SDPA_CUDA_DECODE_V2", 0) > 0; }

size_t scratch_bytes(const SdpaParams& p, int device) {
  const Plan pl = make(p, device);
  return pl.ok ? pl.scratch : 0;
}

cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, void* scratch,
                   size_t scratch_size, int* counters, int num_counters, cudaStream_t stream,
                   bool* served) {
  *served = false;
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows == 0) return cudaSuccess;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  Plan pl = make(p, device);
  if (!pl.ok || scratch == nullptr || scratch_size < pl.scratch) return cudaSuccess;
  // Bulk copies and uint4 loads need 16-byte aligned bases.
  for (const void* ptr : {buf.q, buf.k, buf.v})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaSuccess;

  Args a{};
  a.q = buf.q;
  a.k = buf.k;
  a.v = buf.v;
  a.out = buf.out;
  a.lse = buf.lse;
  a.B = static_cast<int>(p.batch);
  a.Hq = static_cast<int>(p.heads_q);
  a.Hk = static_cast<int>(p.heads_kv);
  a.Lq = static_cast<int>(p.len_q);
  a.Lk = static_cast<int>(p.len_kv);
  a.G = static_cast<int>(p.group());
  a.R = a.G * a.Lq;
  a.RB = a.R <= 8 ? 8 : 16;
  a.row_chunks = 1;
  a.nsplit = 0;  // unused by v2
  a.rows = rows;
  for (int i = 0; i < 3; ++i) {
    a.qs[i] = p.q_stride[i];
    a.ks[i] = p.k_stride[i];
    a.vs[i] = p.v_stride[i];
    a.os[i] = p.o_stride[i];
  }
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  a.wl = p.window_left;
  a.wr = p.window_right;
  a.bottom_right = p.bottom_right ? 1 : 0;
  a.mask_kind = static_cast<int>(p.mask_kind);
  a.mask_dtype = static_cast<int>(p.mask_dtype);
  a.mask = p.mask;
  for (int i = 0; i < 4; ++i) a.ms[i] = p.mask_stride[i];
  a.sinks = p.sinks;
  a.sinks_bs = p.sinks_batch_stride;
  a.qlen = p.q_lengths;
  a.kvlen = p.kv_lengths;
  const size_t o_bytes =
      static_cast<size_t>(2 * pl.w.C) * kSlotRows * p.head_dim_v * sizeof(float);
  a.part_o = static_cast<float*>(scratch);
  a.part_lse = reinterpret_cast<float*>(static_cast<char*>(scratch) + (o_bytes + 255) / 256 * 256);

  // Combine: fused (the last CTA of a split unit) while its serial share is short:
  // segments per unit ~ C / U + 2, each R x Dv/4 float4 loads over the consumer
  // threads; past ~48 loads a thread (D512 B1: 35 x 8 x 128 / 64 = 560) a separate
  // grid-wide combine launch is faster. JAX_SDPA_CUDA_DECODE_V2_COMBINE=fused|kernel.
  const int64_t nseg = (pl.w.C + pl.w.U - 1) / pl.w.U + 2;
  const int64_t per_thread = nseg * a.R * (p.head_dim_v / 4) / (pl.k.warps * 32);
  bool fused = per_thread <= 48;
  if (const char* v = std::getenv("JAX_SDPA_CUDA_DECODE_V2_COMBINE")) {
    if (std::strcmp(v, "kernel") == 0) fused = false;
    else if (std::strcmp(v, "fused") == 0) fused = true;
  }
  if (counters == nullptr || pl.w.U > num_counters) fused = false;
  pl.w.fused = fused ? 1 : 0;
  a.counters = fused ? counters : nullptr;

  if (env_int("JAX_SDPA_CUDA_DECODE_VERBOSE", 0) > 0) {
    char line[320];
    std::snprintf(line, sizeof(line),
                  "jax_sdpa cuda decode v2: B%lld Hq%lld Hk%lld Lq%lld Lk%lld D%lld dtype%d -> "
                  "NW%d NS%d rows %d CTAs %d units %d tiles/unit %d smem %zu combine %s\n",
                  static_cast<long long>(p.batch), static_cast<long long>(p.heads_q),
                  static_cast<long long>(p.heads_kv), static_cast<long long>(p.len_q),
                  static_cast<long long>(p.len_kv), static_cast<long long>(p.head_dim),
                  static_cast<int>(p.dtype), pl.k.warps, pl.k.stages, a.R, pl.w.C, pl.w.U,
                  pl.w.TPU, pl.k.smem, fused ? "fused" : "kernel");
    static std::mutex mu;
    static std::string last;
    std::lock_guard<std::mutex> lock(mu);
    if (last != line) {
      last = line;
      std::fputs(line, stderr);
    }
  }

  *served = true;
  pl.k.launch(a, pl.w, pl.w.C, stream);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  // No unit split (every CTA range is whole units): nothing to combine.
  const bool any_split = !(pl.w.T % pl.w.C == 0 && (pl.w.T / pl.w.C) % pl.w.TPU == 0);
  if (!fused && any_split) {
    pl.k.combine(a, pl.w, stream);
    e = cudaGetLastError();
  }
  return e;
}

}  // namespace v2
}  // namespace cuda_decode
}  // namespace jax_sdpa
