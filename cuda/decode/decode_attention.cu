// Host side of our decode kernels: which (D, Dv) are built, the kernel
// configuration per shape, the split-K heuristic and the launches.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <unistd.h>        // environ

#include "ffi/tuning_knobs.h"
#include "cuda/decode/decode_attention.h"
#include "cuda/decode/decode_kernels.h"

namespace jax_sdpa {
namespace cuda_decode {
namespace {

bool dims_built(int64_t d, int64_t dv) {
#define JAX_SDPA_X(D_, DV_) \
  if (d == D_ && dv == DV_) return true;
  JAX_SDPA_DECODE_DIMS(JAX_SDPA_X)
#undef JAX_SDPA_X
  return false;
}

KernelInfo select_kernel(DType dtype, int64_t d, int64_t dv, int rows_per_block,
                         const KernelVariant& want) {
  switch (dtype) {
    case DType::kF32: return select_f32(d, dv, want);
    case DType::kF16: return select_f16(d, dv, rows_per_block == 16, want);
    case DType::kBF16: return select_bf16(d, dv, rows_per_block == 16, want);
  }
  return KernelInfo{};
}

// The sweep knobs (JAX_SDPA_CUDA_DECODE_*, tuning builds only: ffi/tuning_knobs.h),
// read per plan so that one process can time several settings.
int env_int(const char* name, int fallback) {
  const char* v = tuning_knob(name);
  if (v == nullptr || *v == 0) return fallback;
  return std::atoi(v);
}

// Device facts, read once per device (attribute and property queries only: no allocation).
constexpr int kMaxSplits = 256;  // fused combine: per-split weights live in smem
// What workspace_bytes sizes for, with no device at hand: a generous bound on SMs x resident
// blocks (choose_splits takes at most 2 * slots / units + 2 splits) and a lower bound on
// the keys a split takes (make_plan's min_keys is at least 32).
constexpr int64_t kSlotsBound = 160 * 4;
constexpr int64_t kMinSplitKeysBound = 16;

struct DeviceFacts {
  int sms = 0;
  int cc_major = 0;
  size_t max_smem_optin = 0;
  bool h200 = false;  // an H200 (its name): the paged shapes of decode_tuning.h
};
std::mutex g_mu;
std::map<int, DeviceFacts> g_devices;
std::map<std::pair<const void*, int>, int> g_occupancy;  // (kernel, device) -> blocks/SM

cudaError_t device_facts(int device, DeviceFacts* out) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_devices.find(device);
  if (it != g_devices.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  DeviceFacts f;
  int v = 0;
  cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return e;
  f.sms = v;
  e = cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device);
  if (e != cudaSuccess) return e;
  f.cc_major = v;
  e = cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (e != cudaSuccess) return e;
  f.max_smem_optin = static_cast<size_t>(v);
  cudaDeviceProp prop;
  e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) return e;
  f.h200 = std::strstr(prop.name, "H200") != nullptr;
  g_devices[device] = f;
  *out = f;
  return cudaSuccess;
}

// Raises the kernel's dynamic smem limit (once per device) and returns its
// occupancy in blocks per SM.
cudaError_t occupancy(const KernelInfo& k, int device, int* blocks) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto key = std::make_pair(k.func, device);
  auto it = g_occupancy.find(key);
  if (it != g_occupancy.end()) {
    *blocks = it->second;
    return cudaSuccess;
  }
  cudaError_t e = cudaFuncSetAttribute(k.func, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(k.smem));
  if (e != cudaSuccess) return e;
  int n = 0;
  e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k.func, k.threads, k.smem);
  if (e != cudaSuccess) return e;
  if (n < 1) n = 1;
  g_occupancy[key] = n;
  *blocks = n;
  return cudaSuccess;
}

// The largest cluster (splits of a unit) the cluster merge takes: 16 is the H100 / H200
// limit with non-portable sizes allowed (8 portable). By default it takes up to
// tuning::kAutoClusterSplits; COMBINE=cluster (tuning builds) up to this.
constexpr int kMaxClusterSplits = 16;
constexpr int kAutoClusterSplits = tuning::kAutoClusterSplits;

// Whether a cluster-merge kernel's grid (units clusters of n blocks) is resident at once:
// one wave, so that no cluster waits for another to leave its GPC.
cudaError_t clusters_fit(const KernelInfo& k, int device, int64_t units, int n, bool* fits) {
  *fits = false;
  int unused = 0;
  cudaError_t e = occupancy(k, device, &unused);  // sets the kernel's smem limit
  if (e != cudaSuccess) return e;
  if (n > 8) {
    e = cudaFuncSetAttribute(k.func, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return cudaSuccess;  // no large clusters here: the combine kernel merges
    }
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch_config(
      dim3(static_cast<unsigned>(units), static_cast<unsigned>(n)), k.threads, k.smem, nullptr,
      &attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, k.func, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaSuccess;
  }
  *fits = clusters >= units;
  return cudaSuccess;
}

// Split count. min_keys: least keys per split (enough bytes per block to amortize its
// start and its partial, and >= 1 tile per warp).
// - A kernel that keeps copies in flight (stages >= 2) runs best as one block per SM:
//   the most splits that keep units x n within one wave of the SMs. Measured on the
//   H200: B8 H32/KV8 Lk8192 D128 2 splits +7% over 4; B1 Lk32768 16 splits +10% over 33.
// - A kernel without (stages == 1: fp32, D256, D512) hides its load latency with
//   several resident blocks: fill one wave of SMs x resident blocks, taking more
//   splits only for a clear gain in the useful fraction of the slots (each split adds
//   partial traffic and combine work).
// - decode_tma_kernel (tma): one wave of SMs x resident blocks.
int choose_splits(int64_t units, int64_t len_kv, int sms, int blocks_per_sm, int stages,
                  int64_t min_keys, bool tma) {
  const int64_t max_split =
      std::max<int64_t>(1, std::min<int64_t>(kMaxSplits, len_kv / std::max<int64_t>(1, min_keys)));
  if (tma)
    return static_cast<int>(std::min<int64_t>(
        max_split, std::max<int64_t>(1, static_cast<int64_t>(sms) * blocks_per_sm / units)));
  if (stages >= 2)
    return static_cast<int>(std::min<int64_t>(max_split, std::max<int64_t>(1, sms / units)));
  const int64_t slots = static_cast<int64_t>(sms) * blocks_per_sm;
  auto eff = [&](int64_t n) {
    const double waves = static_cast<double>(units * n) / slots;
    return waves / std::ceil(waves);
  };
  int64_t best = 1;
  double best_eff = eff(1);
  const int64_t limit = std::min<int64_t>(max_split, 2 * slots / std::max<int64_t>(1, units) + 2);
  for (int64_t n = 2; n <= limit; ++n) {
    const double e = eff(n);
    if (e > best_eff + 0.03) {
      best = n;
      best_eff = e;
    }
  }
  return static_cast<int>(best);
}

// The device cuts a unit's key range into chunks of ceil(len / n) rounded up to
// `gran` keys (the kernel's key step), so n splits may leave the last ones empty (33
// splits of 8192 keys: 32 chunks of 256): drop those (the blocks would only write
// empty partials).
int snap_splits(int n, int64_t len_kv, int64_t gran) {
  if (n <= 1 || len_kv <= 0) return std::max(1, n);
  int64_t chunk = (len_kv + n - 1) / n;
  chunk = (chunk + gran - 1) / gran * gran;
  return static_cast<int>(std::max<int64_t>(1, (len_kv + chunk - 1) / chunk));
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// The extents of the maps' batch and key dims: the call's, or for paged K/V the pool's
// (pages, keys a page).
std::pair<int, int> map_extents(const SdpaParams& p) {
  return p.paged() ? std::make_pair(static_cast<int>(p.num_pages), static_cast<int>(p.page_size))
                   : std::make_pair(static_cast<int>(p.batch), static_cast<int>(p.len_kv));
}

// Can the TMA kernels map this call's K and V (strides, sizes)? A trial encode.
bool tma_mappable(const SdpaParams& p, int box_keys, bool chunk_boxes) {
  TmaMaps maps;
  int64_t ks[3], vs[3];
  for (int i = 0; i < 3; ++i) {
    ks[i] = p.k_stride[i];
    vs[i] = p.v_stride[i];
  }
  void* any = reinterpret_cast<void*>(uintptr_t{1} << 20);
  const auto [batch, keys] = map_extents(p);
  return encode_kv_maps(any, any, ks, vs, batch, static_cast<int>(p.heads_kv), keys,
                        p.dtype == DType::kBF16,
                        static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v), box_keys,
                        chunk_boxes, 128, &maps) == cudaSuccess;
}

// The request with no knob set. Without the TMA default applied (make_plan): also what
// runs where decode_tma_kernel can't.
KernelVariant default_request() {
  KernelVariant v;
  v.prefetch = -1;
  return v;
}

// What runs where a TMA kernel's maps can't describe the call: decode_tc_kernel in its
// default shape (paged calls: its paged build).
KernelVariant cp_async_request(const SdpaParams& p) {
  KernelVariant v = default_request();
  v.paged = p.paged();
  return v;
}

// What the per-call knobs ask for (docs/cuda_decode.md; zeros / -1 / false: the
// default for the dims), each read once.
struct KnobRequest {
  KernelVariant want;
  bool tma_off = false;       // JAX_SDPA_CUDA_DECODE_TMA=off
  bool wide_tma_off = false;  // JAX_SDPA_CUDA_DECODE_WIDE_TMA=off
  bool wide_off = false;      // JAX_SDPA_CUDA_DECODE_WIDE=off
};
KnobRequest knob_request() {
  KnobRequest r;
  r.want.prefetch = env_int("JAX_SDPA_CUDA_DECODE_L2", -1);  // -1: the kernel's default
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_CFG")) {
    if (std::sscanf(v, "%d,%d", &r.want.warps, &r.want.stages) != 2)
      r.want.warps = r.want.stages = 0;
  }
  // A variant knob "W,S" (n = 2) or "NW,S,KT" (n = 3) into r.want; false if not one.
  auto shape = [&r](const char* v, int n, bool positive) {
    int x[3] = {0, 0, 0};
    if (std::sscanf(v, "%d,%d,%d", &x[0], &x[1], &x[2]) < n) return false;
    if (positive && (x[0] <= 0 || x[1] <= 0)) return false;
    r.want.warps = x[0];
    r.want.stages = x[1];
    if (n == 3) r.want.step_tiles = x[2];
    return true;
  };
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_TMA")) {
    if (shape(v, 2, true)) r.want.tma = true;
    r.tma_off = std::strcmp(v, "off") == 0;
  }
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_WIDE")) {
    if (shape(v, 2, false)) r.want.wide = true;
    r.wide_off = std::strcmp(v, "off") == 0;
  }
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_WIDE_TMA")) {
    if (shape(v, 3, true)) r.want.wide = r.want.tma = true;
    r.wide_tma_off = std::strcmp(v, "off") == 0;
  }
  return r;
}

// The TMA kernel a call with no knob set gets, if any (8 rows a block, 16 bits; where
// it can't run, make_plan keeps the plain default): decode_tma_kernel at D = Dv in
// {128, 256}, decode_wide_tma_kernel at 512, shaped as decode_tuning.h says.
bool tma_default(const SdpaParams& p, int rb, int64_t units, int sms, const KnobRequest& req,
                 KernelVariant* v) {
  if (rb != 8 || p.dtype == DType::kF32 || p.head_dim != p.head_dim_v) return false;
  if (p.head_dim == 128 && !req.tma_off) {
    v->tma = true;
    const tuning::Shape& s = units >= sms ? tuning::kTma128Filled : tuning::kTma128Sparse;
    v->warps = s.warps;
    v->stages = s.stages;
    v->prefetch = 0;
    return true;
  }
  if (p.head_dim == 256 && !req.tma_off) {
    v->tma = true;
    v->warps = tuning::kTma256.warps;
    v->stages = tuning::kTma256.stages;
    v->prefetch = 0;
    return true;
  }
  if (p.head_dim == 512 && !req.wide_tma_off) {
    v->tma = v->wide = true;
    v->warps = tuning::kWideTma.warps;
    v->stages = tuning::kWideTma.stages;
    v->step_tiles = tuning::kWideTma.step_tiles;
    return true;
  }
  return false;
}

// The H200's paged table (decode_tuning.h) for a paged call of 8 rows a block: the shape of
// the cp.async kernel it takes over the defaults, or null where the defaults stay. At D128
// it replaces the TMA kernel's sparse-grid shape (pages of whole 16-key tiles, fewer units
// than SMs; tma_default's choice), at D64 the cp.async default.
const tuning::Shape* h200_paged_shape(const SdpaParams& p, bool sparse_grid) {
  if (p.head_dim == 128 && p.head_dim_v == 128 && p.page_size % kTileKeys == 0 && sparse_grid)
    return &tuning::kPagedH200Sparse128;
  if (p.head_dim == 64 && p.head_dim_v == 64) return &tuning::kPagedH200D64;
  return nullptr;
}

// Query rows a block takes: 16 (tensor cores, Dv <= 256) when the group has more than
// tuning::kSixteenRowsAbove, else 8.
int rows_per_block(const SdpaParams& p) {
  const int64_t R = p.group() * p.len_q;
  const bool tensor_cores = p.dtype != DType::kF32 && p.head_dim_v <= 256;
  return (tensor_cores && R > tuning::kSixteenRowsAbove) ? 16 : 8;
}

// fp32 D = Dv = 512 runs decode_wide_f32_kernel unless JAX_SDPA_CUDA_DECODE_WIDE=off.
bool wide_f32_default(const SdpaParams& p, const KernelVariant& want, const KnobRequest& req) {
  return p.dtype == DType::kF32 && p.head_dim == 512 && p.head_dim_v == 512 &&
         want == default_request() && !req.wide_off;
}

size_t pad_ws(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

}  // namespace

WorkspaceLayout workspace_layout(const SdpaParams& p, int num_splits, int64_t units, bool fused) {
  WorkspaceLayout w;
  if (num_splits <= 1) return w;
  const size_t n = static_cast<size_t>(num_splits);
  const size_t rows = static_cast<size_t>(p.batch * p.heads_q * p.len_q);
  w.part_o = 0;
  w.part_lse = pad_ws(n * rows * static_cast<size_t>(p.head_dim_v) * sizeof(float));
  w.counters = w.part_lse + pad_ws(n * rows * sizeof(float));
  w.bytes = w.counters + (fused ? pad_ws(static_cast<size_t>(units) * sizeof(int)) : 0);
  return w;
}

cudaError_t encode_kv_maps(const void* k, const void* v, const int64_t (&ks)[3],
                           const int64_t (&vs)[3], int B, int Hk, int Lk, bool bf16, int d, int dv,
                           int box_keys, bool chunk_boxes, int l2, TmaMaps* maps) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr || d % 64 != 0 || dv % 64 != 0 || box_keys > 256)
    return cudaErrorNotSupported;
  // Tensor dims 2..4 = (kv head, key, batch) sorted by stride (the encoder wants them
  // ordered). The kernel reads the order back from the maps.
  // Index 0, 1, 2 = kv head, key, batch (ks / vs: batch, head, key element strides).
  const int64_t size[3] = {Hk, Lk, B};
  const int64_t kst[3] = {ks[1], ks[2], ks[0]}, vst[3] = {vs[1], vs[2], vs[0]};
  int order[3] = {0, 1, 2};
  std::sort(order, order + 3, [&](int x, int y) { return kst[x] < kst[y]; });
  // L2 fetch size: the plan's (tuning::kTmaL2Bytes; JAX_SDPA_CUDA_DECODE_TMA_L2 in tuning
  // builds).
  const CUtensorMapL2promotion promotion =
      l2 == 0 ? CU_TENSOR_MAP_L2_PROMOTION_NONE
              : (l2 == 64 ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
                          : (l2 == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                                       : CU_TENSOR_MAP_L2_PROMOTION_L2_256B));
  auto one = [&](const void* base, const int64_t (&st)[3], int width, CUtensorMap* map) {
    const int esz = 2;
    cuuint64_t dims[5] = {64, static_cast<cuuint64_t>(width / 64), 0, 0, 0};
    cuuint64_t strides[4] = {128, 0, 0, 0};  // bytes, dims 1..4
    cuuint32_t box[5] = {64, static_cast<cuuint32_t>(chunk_boxes ? 1 : width / 64), 1, 1, 1};
    const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
    for (int i = 0; i < 3; ++i) {
      const int dim = order[i];
      dims[2 + i] = static_cast<cuuint64_t>(size[dim]);
      strides[1 + i] = static_cast<cuuint64_t>(st[dim] * esz);
      if (dim == 1) box[2 + i] = static_cast<cuuint32_t>(box_keys);
    }
    const CUresult r = encode(
        map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 5,
        const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
        CU_TENSOR_MAP_SWIZZLE_128B, promotion,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS;
  };
  // Both maps use K's dim order: V must be ordered the same way.
  for (int i = 0; i + 1 < 3; ++i)
    if (vst[order[i]] > vst[order[i + 1]]) return cudaErrorNotSupported;
  if (!one(k, kst, d, &maps->k) || !one(v, vst, dv, &maps->v)) return cudaErrorNotSupported;
  for (int i = 0; i < 3; ++i) maps->order[i] = order[i];
  return cudaSuccess;
}

KernelInfo select_f32(int64_t d, int64_t dv, const KernelVariant& want) {
#define JAX_SDPA_X(D_, DV_) \
  if (d == D_ && dv == DV_) return simt_select<D_, DV_>(want);
  JAX_SDPA_DECODE_DIMS(JAX_SDPA_X)
#undef JAX_SDPA_X
  return KernelInfo{};
}

std::vector<std::pair<int, int>> built_head_dims() {
  std::vector<std::pair<int, int>> dims;
#define JAX_SDPA_X(D_, DV_) dims.emplace_back(D_, DV_);
  JAX_SDPA_DECODE_DIMS(JAX_SDPA_X)
#undef JAX_SDPA_X
  return dims;
}

size_t workspace_bytes(const SdpaParams& p) {
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows <= 0 || p.heads_kv <= 0) return kWorkspaceAlign;
  // The fewest units (16 rows a block) allow the most splits; the most units (8 rows a
  // block) need the most counters.
  const int64_t group_rows = p.group() * p.len_q;
  const int64_t units_fewest = p.batch * p.heads_kv * ((group_rows + 15) / 16);
  const int64_t units_most = p.batch * p.heads_kv * ((group_rows + 7) / 8);
  const int64_t n_max = std::min<int64_t>(
      {kMaxSplits, 2 * kSlotsBound / std::max<int64_t>(1, units_fewest) + 2,
       std::max<int64_t>(1, p.len_kv / kMinSplitKeysBound)});
  if (n_max <= 1) return kWorkspaceAlign;
  return std::max(kWorkspaceAlign,
                  workspace_layout(p, static_cast<int>(n_max), units_most, true).bytes);
}

const char* default_kernel_name(const SdpaParams& p) {
  if (!dims_built(p.head_dim, p.head_dim_v)) return "";
  KnobRequest none;
  none.want = default_request();
  KernelVariant want = none.want;
  const int rb = rows_per_block(p);
  const int64_t units = p.batch * p.heads_kv * ((p.group() * p.len_q + rb - 1) / rb);
  KernelVariant dflt;
  if (tma_default(p, rb, units, static_cast<int>(std::min<int64_t>(units, INT32_MAX)), none,
                  &dflt))
    want = dflt;
  if (wide_f32_default(p, want, none)) return "decode_wide_f32_kernel";
  const KernelInfo k = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, want);
  if (k.func == nullptr) return "";
  if (k.variant.tma) return k.variant.wide ? "decode_wide_tma_kernel" : "decode_tma_kernel";
  if (k.variant.wide) return "decode_wide_kernel";
  return k.tensor_cores ? "decode_tc_kernel" : "decode_simt_kernel";
}

std::string unsupported_reason(const SdpaParams& p) {
  if (!dims_built(p.head_dim, p.head_dim_v))
    return "head dims (D=" + std::to_string(p.head_dim) + ", Dv=" + std::to_string(p.head_dim_v) +
           ") are not built (D=Dv in {64, 72, 80, 96, 128, 192, 256, 512}, or (192, 128), "
           "(96, 64))";
  const int64_t lim = (int64_t{1} << 31) - 1;
  if (p.len_kv > lim || p.batch * p.heads_q * p.len_q > lim ||
      p.batch * p.heads_kv * ((p.group() * p.len_q + 7) / 8) > lim)
    return "shape too large for 32-bit block indexing";
  return "";
}

std::string paged_unsupported_reason(const SdpaParams& p) {
  if (p.dtype == DType::kF32) return "fp32 has no paged decode kernel";
  if (std::string why = unsupported_reason(p); !why.empty()) return why;
  KernelVariant want = default_request();
  want.paged = true;
  if (select_kernel(p.dtype, p.head_dim, p.head_dim_v, rows_per_block(p), want).func == nullptr)
    return "head dims (D=" + std::to_string(p.head_dim) + ", Dv=" +
           std::to_string(p.head_dim_v) + ") have no paged decode kernel (D = Dv in {64, 128, 256})";
  return "";
}

namespace {

// make_plan's work on a cache miss (knobs read here; make_plan keys the cache on them).
cudaError_t plan_uncached(const SdpaParams& p, int device, size_t workspace_bytes,
                          DecodePlan* plan) {
  DeviceFacts f;
  cudaError_t e = device_facts(device, &f);
  if (e != cudaSuccess) return e;
  // Per-call overrides (docs/cuda_decode.md).
  const int force_splits = env_int("JAX_SDPA_CUDA_DECODE_SPLITS", 0);
  enum class Combine { kAuto, kKernel, kFused, kCluster } combine = Combine::kAuto;
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_COMBINE")) {
    if (std::strcmp(v, "kernel") == 0) combine = Combine::kKernel;
    else if (std::strcmp(v, "fused") == 0) combine = Combine::kFused;
    else if (std::strcmp(v, "cluster") == 0) combine = Combine::kCluster;
  }
  const KnobRequest req = knob_request();
  KernelVariant want = req.want;
  if (p.paged()) {  // the paged builds: the cp.async kernel's (W, S) of a tuning build, else 0
    want = cp_async_request(p);
    want.warps = req.want.warps;
    want.stages = req.want.stages;
  }
  const int64_t min_split_bytes =
      static_cast<int64_t>(std::max(1, env_int("JAX_SDPA_CUDA_DECODE_MIN_SPLIT_KB", tuning::kMinSplitKiB))) * 1024;

  const int64_t R = p.group() * p.len_q;
  const int rb = rows_per_block(p);
  const int64_t units = p.batch * p.heads_kv * ((R + rb - 1) / rb);
  // The device's paged table, where no knob asks for a kernel (its shape makes want differ
  // from the default below, so no TMA kernel replaces it);
  // JAX_SDPA_CUDA_DECODE_DEVICE_TABLE=h200|none picks a table on any device.
  bool h200 = f.h200;
  if (const char* v = tuning_knob("JAX_SDPA_CUDA_DECODE_DEVICE_TABLE")) h200 = std::strcmp(v, "h200") == 0;
  if (p.paged() && h200 && rb == 8 && req.want == default_request() && !req.tma_off)
    if (const tuning::Shape* shape = h200_paged_shape(p, units < f.sms)) {
      want.warps = shape->warps;
      want.stages = shape->stages;
    }
  // A TMA kernel (asked for, or the default for these dims) runs where it can: sm_90+ and
  // K / V strides its tensor maps can describe (a trial encode with the kernel's own
  // boxes); elsewhere the plain default.
  // Paged calls take the same TMA kernel (its paged build: a copy a 16-key tile) where
  // their pages hold whole tiles.
  KernelVariant dflt;
  if (want == cp_async_request(p) &&
      (!p.paged() || p.page_size % kTileKeys == 0) &&
      tma_default(p, rb, units, f.sms, req, &dflt) &&
      !(p.paged() && dflt.wide)) {
    want = dflt;
    want.paged = p.paged();
  }
  KernelInfo k = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, want);
  if (k.func == nullptr) return cudaErrorInvalidValue;
  if (k.variant.tma &&
      !(f.cc_major >= 9 && tma_mappable(p, k.tma_box_keys, k.tma_chunk_boxes))) {
    want = cp_async_request(p);
    k = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, want);
    if (k.func == nullptr) return cudaErrorInvalidValue;
  }
  // A kernel past the device's smem limit (an A100 has 163 KB a block) falls back to
  // the 150 KB D512 variants.
  for (const auto& ws : {std::make_pair(2, 2), std::make_pair(4, 1)}) {
    if (k.smem <= f.max_smem_optin || !k.tensor_cores || k.variant.paged) break;
    KernelVariant smaller;
    smaller.warps = ws.first;
    smaller.stages = ws.second;
    KernelInfo alt = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, smaller);
    if (alt.func != nullptr && alt.smem < k.smem) k = alt;
  }
  if (wide_f32_default(p, want, req)) {
    // fp32 D = Dv = 512: decode_wide_f32_kernel, the first of its stage counts that fits.
    for (const tuning::Shape& s : tuning::kWideF32) {
      KernelVariant wide;
      wide.wide = true;
      wide.warps = s.warps;
      wide.stages = s.stages;
      const KernelInfo alt = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, wide);
      if (alt.func != nullptr && alt.variant.wide && alt.smem <= f.max_smem_optin) {
        k = alt;
        break;
      }
    }
  }
  if (k.smem > f.max_smem_optin) return cudaErrorInvalidConfiguration;
  int occ = 1;
  e = occupancy(k, device, &occ);
  if (e != cudaSuccess) return e;
  if (k.variant.tma) {
    // launch() runs decode_tc_kernel instead should the real K / V pointers not map (the
    // trial above used an aligned stand-in): raise its smem limit now, while we may.
    int unused = 0;
    e = occupancy(select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, cp_async_request(p)), device,
                  &unused);
    if (e != cudaSuccess) return e;
  }
  plan->rows_per_block = rb;
  plan->row_chunks = static_cast<int>((R + rb - 1) / rb);
  plan->blocks_per_sm = occ;
  plan->num_sms = f.sms;
  plan->tensor_cores = k.tensor_cores;
  plan->kernel = k.variant;
  const int esz = p.dtype == DType::kF32 ? 4 : 2;
  const int64_t key_bytes = (p.head_dim + p.head_dim_v) * esz;
  // At least one tile per warp (the wide kernel's warps share each tile: two tiles).
  const int64_t step_keys = k.variant.wide ? 2 * kTileKeys : kTileKeys * k.variant.warps;
  // The key step a split's range is a multiple of (the device's split_range<GRAN>).
  const int64_t gran = k.variant.tma && !k.variant.wide ? step_keys : kTileKeys;
  int64_t min_keys = std::max<int64_t>(step_keys, (min_split_bytes + key_bytes - 1) / key_bytes);
  min_keys = (min_keys + 15) / 16 * 16;
  int n = force_splits > 0
              ? force_splits
              : snap_splits(choose_splits(units, p.len_kv, f.sms, occ, k.variant.stages, min_keys,
                                          k.variant.tma),
                            p.len_kv, gran);
  // The fused combine keeps rb * n weights (+ 2 rb row stats) in the kernel's smem.
  const int smem_cap = static_cast<int>((k.smem / sizeof(float) - 2 * rb) / rb);
  n = std::max(1, std::min({n, kMaxSplits, smem_cap}));
  // The partials live in the caller's workspace (XLA sizes it for the heuristic's
  // largest count, jax_sdpa/dispatch.py): fewer splits when they do not fit.
  if (n > 1 && workspace_layout(p, n, units, false).bytes > workspace_bytes) {
    while (n > 1 && workspace_layout(p, n, units, false).bytes > workspace_bytes) --n;
    n = snap_splits(n, p.len_kv, gran);
  }
  plan->num_splits = n;
  // Behind decode_tma_kernel at 2..8 splits (COMBINE=cluster: 2..16): the splits of a unit
  // merge in a thread-block cluster (cluster_finish: no partials in global memory, no
  // combine launch), where all the units' clusters fit the GPU at once.
  if (k.variant.tma && !k.variant.wide && n >= 2 &&
      ((combine == Combine::kAuto && n <= kAutoClusterSplits) ||
       (combine == Combine::kCluster && n <= kMaxClusterSplits))) {
    KernelVariant cv = k.variant;
    cv.cluster = true;
    const KernelInfo ck = select_kernel(p.dtype, p.head_dim, p.head_dim_v, rb, cv);
    bool fits = false;
    if (ck.func != nullptr && ck.variant.cluster) {
      e = clusters_fit(ck, device, units, n, &fits);
      if (e != cudaSuccess) return e;
    }
    if (fits) {
      k = ck;
      plan->kernel = k.variant;
    }
  }
  // Auto combine: the last split block of a unit merges n partials of its valid
  // rows with one float4 per thread and split; past ~48 loads per thread (D512
  // at small batch: 33 splits x 8 rows x 128 float4 / 96 threads = 363) that
  // tail is longer than a separate, grid-wide combine launch. Behind decode_tma_kernel the
  // combine kernel is faster anyway (H200, B8 H32/KV8 Lk8192 D128 bf16: 3717 vs 3608 GB/s
  // fused; decode_tuning.h).
  const int64_t valid_rows = std::min<int64_t>(R, rb);
  const int64_t per_thread = (valid_rows * (p.head_dim_v / 4) + k.threads - 1) / k.threads;
  // The fused combine's counters follow the partials in the workspace; when they
  // do not fit, the separate combine kernel (no counters) merges instead. The wide
  // kernel has no fused merge.
  const bool fused_ok = !k.variant.wide && !k.variant.cluster && n > 1 &&
                        workspace_layout(p, n, units, true).bytes <= workspace_bytes;
  bool fused = false;
  if (combine == Combine::kFused) fused = fused_ok;
  else if (combine == Combine::kAuto) fused = fused_ok && n * per_thread <= tuning::kFusedCombineMaxLoads && !k.variant.tma;
  plan->fused_combine = fused;
  plan->workspace = workspace_layout(p, n, units, fused);
  plan->tma_l2 = env_int("JAX_SDPA_CUDA_DECODE_TMA_L2", tuning::kTmaL2Bytes);
  if (env_int("JAX_SDPA_CUDA_DECODE_VERBOSE", 0) > 0) {
    char line[384];
    std::snprintf(line, sizeof(line),
                  "jax_sdpa cuda decode plan: B%lld Hq%lld Hk%lld Lq%lld Lk%lld D%lld/%lld "
                  "dtype%d -> %s%s%sW%d S%d KT%d L2 %d rows/block %d chunks %d splits %d occ %d/SM "
                  "smem %zu "
                  "combine %s workspace %zu/%zu\n",
                  static_cast<long long>(p.batch), static_cast<long long>(p.heads_q),
                  static_cast<long long>(p.heads_kv), static_cast<long long>(p.len_q),
                  static_cast<long long>(p.len_kv), static_cast<long long>(p.head_dim),
                  static_cast<long long>(p.head_dim_v), static_cast<int>(p.dtype),
                  k.variant.wide ? "wide " : "", k.variant.tma ? "tma " : "",
                  k.variant.cluster ? "cluster " : "",
                  k.variant.warps,
                  k.variant.stages, k.variant.step_tiles, k.variant.prefetch, rb, plan->row_chunks,
                  n, occ, k.smem,
                  n == 1 ? "none" : (k.variant.cluster ? "cluster" : (fused ? "fused" : "kernel")),
                  plan->workspace.bytes,
                  workspace_bytes);
    static std::mutex mu;
    static std::string last;
    std::lock_guard<std::mutex> lock(mu);
    if (last != line) {
      last = line;
      std::fputs(line, stderr);
    }
  }
  return cudaSuccess;
}

// The JAX_SDPA_CUDA_DECODE_* entries of the environment, verbatim: one pass over it
// (a knob changed between calls makes a new plan).
std::string knob_snapshot() {
  static constexpr char kPrefix[] = "JAX_SDPA_CUDA_DECODE_";
  std::string s;
  if (!kTuningBuild) return s;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e)
    if (std::strncmp(*e, kPrefix, sizeof(kPrefix) - 1) == 0) {
      s += *e;
      s += '\n';
    }
  return s;
}

// What a plan depends on: the call's shapes, strides and flags (not its pointers), the
// workspace size, the device and the knobs.
std::string plan_key(const SdpaParams& p, int device, size_t workspace_bytes) {
  const int64_t f[] = {p.batch, p.heads_q, p.heads_kv, p.len_q, p.len_kv, p.head_dim,
                       p.head_dim_v, static_cast<int64_t>(p.dtype), p.seq_major,
                       p.q_stride[0], p.q_stride[1], p.q_stride[2], p.k_stride[0],
                       p.k_stride[1], p.k_stride[2], p.v_stride[0], p.v_stride[1],
                       p.v_stride[2], p.o_stride[0], p.o_stride[1], p.o_stride[2],
                       p.window_left, p.window_right, p.bottom_right,
                       static_cast<int64_t>(p.mask_kind), static_cast<int64_t>(p.mask_dtype),
                       p.mask_stride[0], p.mask_stride[1], p.mask_stride[2], p.mask_stride[3],
                       p.sinks != nullptr, p.sinks_batch_stride, p.q_lengths != nullptr,
                       p.kv_lengths != nullptr, p.paged(), p.page_size, device,
                       static_cast<int64_t>(workspace_bytes)};
  std::string key(reinterpret_cast<const char*>(f), sizeof(f));
  key += knob_snapshot();
  return key;
}

std::mutex g_plan_mu;
std::unordered_map<std::string, DecodePlan> g_plans;

// The last tensor maps encoded, by everything the encoding reads: a decode step under
// jit reuses its cache buffers call after call, so most calls skip the driver's encoder.
struct MapsKey {  // compared bytewise: no padding (static_assert below)
  const void* k;
  const void* v;
  int64_t ks[3], vs[3];
  int dims[10];  // B, Hk, Lk, bf16, d, dv, box_keys, chunk_boxes, l2, 0 (no tail padding)
  bool operator==(const MapsKey& o) const { return std::memcmp(this, &o, sizeof(*this)) == 0; }
};
static_assert(sizeof(MapsKey) == 2 * sizeof(void*) + 6 * sizeof(int64_t) + 10 * sizeof(int),
              "MapsKey has padding");
constexpr int kMapsCached = 16;
std::mutex g_maps_mu;
MapsKey g_maps_key[kMapsCached];
TmaMaps g_maps[kMapsCached];
int g_maps_used = 0, g_maps_next = 0;

// extents: the maps' batch and key dims (map_extents).
cudaError_t cached_kv_maps(const Args& a, const KernelInfo& k, std::pair<int, int> extents,
                           bool bf16, int d, int dv, int l2, TmaMaps* maps) {
  const auto [batch, keys] = extents;
  MapsKey key;
  std::memset(&key, 0, sizeof(key));  // padding too: the key is compared bytewise
  key.k = a.k;
  key.v = a.v;
  for (int i = 0; i < 3; ++i) {
    key.ks[i] = a.ks[i];
    key.vs[i] = a.vs[i];
  }
  const int dims[10] = {batch, a.Hk, keys, bf16, d, dv, k.tma_box_keys, k.tma_chunk_boxes, l2, 0};
  std::memcpy(key.dims, dims, sizeof(dims));
  std::lock_guard<std::mutex> lock(g_maps_mu);
  for (int i = 0; i < g_maps_used; ++i)
    if (g_maps_key[i] == key) {
      *maps = g_maps[i];
      return cudaSuccess;
    }
  cudaError_t e = encode_kv_maps(a.k, a.v, a.ks, a.vs, batch, a.Hk, keys, bf16, d, dv,
                                 k.tma_box_keys, k.tma_chunk_boxes, l2, maps);
  if (e != cudaSuccess) return e;
  const int slot = g_maps_used < kMapsCached ? g_maps_used++ : g_maps_next;
  g_maps_next = (slot + 1) % kMapsCached;
  std::memcpy(&g_maps_key[slot], &key, sizeof(key));  // bytewise, as compared
  g_maps[slot] = *maps;
  return cudaSuccess;
}

}  // namespace

// Plans are cached: planning reads the environment and the device's attributes and
// trial-encodes tensor maps, several microseconds of host time a call (H200: ours
// 11.8 us of wall time a tiny call where cuDNN's took 5.9).
cudaError_t make_plan(const SdpaParams& p, int device, size_t workspace_bytes,
                      DecodePlan* plan) {
  const std::string key = plan_key(p, device, workspace_bytes);
  {
    std::lock_guard<std::mutex> lock(g_plan_mu);
    auto it = g_plans.find(key);
    if (it != g_plans.end()) {
      *plan = it->second;
      return cudaSuccess;
    }
  }
  cudaError_t e = plan_uncached(p, device, workspace_bytes, plan);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(g_plan_mu);
  if (g_plans.size() >= 4096) g_plans.clear();  // a bound for processes of many shapes
  g_plans.emplace(key, *plan);
  return cudaSuccess;
}

cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, const DecodePlan& plan,
                   void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const int64_t rows = p.batch * p.heads_q * p.len_q;
  if (rows == 0) return cudaSuccess;
  KernelInfo k = select_kernel(p.dtype, p.head_dim, p.head_dim_v, plan.rows_per_block,
                               plan.kernel);
  if (k.func == nullptr || !(k.variant == plan.kernel)) return cudaErrorInvalidValue;

  Args a{};
  cuda_common::set_call_fields(p, buf, &a);
  a.B = static_cast<int>(p.batch);
  a.Hq = static_cast<int>(p.heads_q);
  a.Hk = static_cast<int>(p.heads_kv);
  a.Lq = static_cast<int>(p.len_q);
  a.Lk = static_cast<int>(p.len_kv);
  a.G = static_cast<int>(p.group());
  a.R = a.G * a.Lq;
  a.RB = plan.rows_per_block;
  a.row_chunks = plan.row_chunks;
  a.nsplit = plan.num_splits;
  a.rows = rows;
  a.scale_log2 = static_cast<float>(p.scale * 1.4426950408889634);
  a.counters = nullptr;
  a.part_o = nullptr;
  a.part_lse = nullptr;
  a.pages = p.page_indices;
  a.pages_per_seq = static_cast<int>(p.pages_per_seq);
  a.page_size = static_cast<int>(p.page_size > 0 ? p.page_size : 1);
  a.num_pages = static_cast<int>(p.num_pages);
  const int64_t units = p.batch * p.heads_kv * plan.row_chunks;
  if (plan.num_splits > 1) {
    const WorkspaceLayout& w = plan.workspace;
    if (workspace == nullptr || w.bytes > workspace_bytes ||
        reinterpret_cast<uintptr_t>(workspace) % 16 != 0)
      return cudaErrorInvalidValue;
    char* base = static_cast<char*>(workspace);
    a.part_o = reinterpret_cast<float*>(base + w.part_o);
    a.part_lse = reinterpret_cast<float*>(base + w.part_lse);
    if (plan.fused_combine) {
      // A fresh workspace holds garbage: zero the counters on the stream every call
      // (the kernel resets them itself too, but the workspace is not ours to keep).
      a.counters = reinterpret_cast<int*>(base + w.counters);
      cudaError_t e = cudaMemsetAsync(a.counters, 0, static_cast<size_t>(units) * sizeof(int),
                                      stream);
      if (e != cudaSuccess) return e;
    }
  }

  dim3 grid(static_cast<unsigned>(units), static_cast<unsigned>(plan.num_splits));
  cudaError_t e = cudaSuccess;
  bool ran_tma = k.tma_box_keys > 0;  // false once the cp.async fallback below runs
  if (k.tma_box_keys > 0) {
    TmaMaps maps;
    e = cached_kv_maps(a, k, map_extents(p), p.dtype == DType::kBF16, static_cast<int>(p.head_dim),
                       static_cast<int>(p.head_dim_v), plan.tma_l2, &maps);
    if (e == cudaSuccess) e = k.launch(a, &maps, grid, k.threads, k.smem, stream);
  } else {
    e = k.launch(a, nullptr, grid, k.threads, k.smem, stream);
  }
  if (e == cudaErrorNotSupported && k.variant.tma) {
    // The tensor maps refused these pointers (not 16-byte aligned): decode_tc_kernel
    // serves the same plan (any split count; the workspace depends on the count only).
    KernelInfo tc = select_kernel(p.dtype, p.head_dim, p.head_dim_v, plan.rows_per_block,
                                  cp_async_request(p));
    if (tc.func == nullptr) return cudaErrorInvalidValue;
    e = tc.launch(a, nullptr, grid, tc.threads, tc.smem, stream);
    ran_tma = false;
  }
  if (e != cudaSuccess) return e;
  if (plan.num_splits > 1 && !plan.fused_combine && !(ran_tma && plan.kernel.cluster)) {
    // kCombineLanes threads per (row, 4 dv) item, 128 threads a block.
    const int64_t threads = rows * (p.head_dim_v / 4) * kCombineLanes;
    k.combine(a, dim3(static_cast<unsigned>((threads + 127) / 128)), stream);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
