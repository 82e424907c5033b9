// Fast float32 flash-attention forward on TF32 tensor cores, head dims <= 128.
//
// The generic forward (flash_attention.cuh) serves every dtype and head dim; this one
// is the hot path for fp32 prefill (diffusion transformers: SD3 is D=64), where
// cuDNN refuses fp32. What makes it faster than the generic kernel:
// - 32 query rows per warp (two m16 tiles), 128 per block: every K/V fragment read
//   from shared memory feeds two mma instead of one.
// - Fragments come in with ldmatrix (Q's A and K's B fragments, read as b16 pairs:
//   an 8x8 b16 matrix is an 8-row x 4-float tile, exactly tf32's fragment layout).
// - P never leaves registers: S's accumulator is fed back as PV's A fragment by
//   permuting the key index inside each 8-key step (A's k column t <-> key 2t,
//   t + 4 <-> key 2t + 1), so V's B fragment reads rows 2t and 2t + 1.
// - Shared rows are kD + 4 floats: ldmatrix rows, V[2t][g] and V[2t+1][g] are all
//   bank-conflict-free.
// - K/V tiles are double-buffered (cp.async of tile j + 1 during tile j), and are
//   rounded to tf32 once in shared memory (TF32 mode) instead of per fragment read.
// - Key tiles that lie entirely inside every row's visible band with no mask skip
//   the per-element visibility checks.
// - The softmax runs in base 2 (scale * log2 e folded into one multiply).
// kMode 1 = TF32 (JAX's default precision), 2 = 3xTF32 (hi/lo split, ~fp32).
#pragma once

#include <cstdlib>
#include <string>

#include "ffi/tuning_knobs.h"
#include "cuda/flash/flash_attention.cuh"
#include "cuda/flash/flash_tuning.h"

namespace jax_sdpa {
namespace cuda_flash {
namespace tc {

// A block has kWarps warps of 32 query rows each (kBM = 32 * kWarps rows).

// rows x kCols floats from global (row stride gstride) into shared (row stride
// kCols + 4); rows >= valid_rows and columns >= valid_cols are zero. Thread x
// copies 16-byte chunks x, x + kThreads, ...: round_own_chunks walks the same chunks.
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void load_rows(float* s, const float* g, int64_t gstride,
                                          int valid_rows, int valid_cols) {
  constexpr int kVec = kCols / 4;
  constexpr int kStride = kCols + 4;
#pragma unroll
  for (int x = threadIdx.x; x < kRows * kVec; x += kThreads) {
    const int r = x / kVec;
    const int c = (x % kVec) * 4;
    const bool ok = r < valid_rows && c < valid_cols;
    cp_async16(s + r * kStride + c, ok ? g + r * gstride + c : g, ok);
  }
}

// Rounds this thread's own landed chunks to tf32 (visible to it after cp.async.wait).
template <int kRows, int kCols, int kThreads>
__device__ __forceinline__ void round_own_chunks(float* s) {
  constexpr int kVec = kCols / 4;
  constexpr int kStride = kCols + 4;
#pragma unroll
  for (int x = threadIdx.x; x < kRows * kVec; x += kThreads) {
    float4* p = reinterpret_cast<float4*>(s + (x / kVec) * kStride + (x % kVec) * 4);
    float4 v = *p;
    v.x = round_tf32(v.x);
    v.y = round_tf32(v.y);
    v.z = round_tf32(v.z);
    v.w = round_tf32(v.w);
    *p = v;
  }
}

// d += a * b on tf32 tensor cores; kMode 2 splits raw fp32 operands into hi + lo.
template <int kMode>
__device__ __forceinline__ void mma_tc(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (kMode == 1) {
    mma_tf32(d, a, b);  // operands already rounded to tf32
  } else {
    uint32_t ah[4], al[4], bh[2], bl[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ah[i] = to_tf32(__uint_as_float(a[i]));
      al[i] = to_tf32(__uint_as_float(a[i]) - __uint_as_float(ah[i]));
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      bh[i] = to_tf32(__uint_as_float(b[i]));
      bl[i] = to_tf32(__uint_as_float(b[i]) - __uint_as_float(bh[i]));
    }
    mma_tf32x3(d, ah, al, bh, bl);
  }
}

template <int kD, int kBN, int kWarps, int kStages>
constexpr size_t smem_bytes() {
  constexpr int kBM = 32 * kWarps;
  return sizeof(float) * (static_cast<size_t>(kBM) * (kD + 4) + 2ull * kStages * kBN * (kD + 4));
}

// kD: head dim D and Dv padded up (zero columns); kBN: keys per tile; kWarps: warps
// per block (32 query rows each); kStages: K/V buffers (2: a barrier before a buffer
// is refilled; 3: the refilled buffer was last read two tiles ago, before the
// previous tile's barrier, so that barrier suffices).
template <int kMode, int kD, int kBN, int kWarps, int kStages>
__global__ void __launch_bounds__(kWarps * 32, kWarps == 4 ? (kBN == 32 && kD == 64 ? 3 : 2) : 1)
    flash_fwd_tc_kernel(const FwdArgs a) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kBM = 32 * kWarps;
  constexpr int kStride = kD + 4;  // floats per shared row
  constexpr int kNT = kBN / 8;     // 8-key tiles of S
  constexpr int kOT = kD / 8;      // 8-column tiles of O
  constexpr int kKS = kD / 8;      // 8-wide steps over D
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(16) float smem_f[];
  float* sQ = smem_f;
  float* sK = sQ + kBM * kStride;            // [kStages][kBN][kStride]
  float* sV = sK + kStages * kBN * kStride;  // [kStages][kBN][kStride]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  // Heaviest tiles first (causal): the last query tile sees the most keys.
  const int q_tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / a.G;
  const int q0 = q_tile * kBM;

  const RowLengths len = row_lengths(a, b);
  const int qlen = len.qlen, kvlen = len.kvlen;
  const int64_t offset = len.offset;

  const float* Q = static_cast<const float*>(a.q) + b * a.qs[0] + h * a.qs[1];
  const float* K = static_cast<const float*>(a.k) + b * a.ks[0] + hk * a.ks[1];
  const float* V = static_cast<const float*>(a.v) + b * a.vs[0] + hk * a.vs[1];

  // (tile_key_range, flash_attention.cuh, computes the same; using it changed this
  // validated kernel's machine code, so that waits for a GPU run.)
  int key_lo = 0, key_hi = 0;
  if (q0 < qlen) {
    const int last_row = min(q0 + kBM, qlen) - 1;
    key_lo = static_cast<int>(band_keys(q0, offset, a.wl, a.wr, kvlen).first);
    key_hi = static_cast<int>(band_keys(last_row, offset, a.wl, a.wr, kvlen).last);
    if (key_hi < key_lo) key_hi = key_lo;
  }
  const int kb_begin = (key_lo / kBN) * kBN;
  const int n_tiles = key_hi > kb_begin ? (key_hi - kb_begin + kBN - 1) / kBN : 0;

  load_rows<kBM, kD, kThreads>(sQ, Q + static_cast<int64_t>(q0) * a.qs[2], a.qs[2], a.Lq - q0, a.D);
  cp_async_commit();
  auto load_kv = [&](int tile, int stage) {
    const int kb = kb_begin + tile * kBN;
    load_rows<kBN, kD, kThreads>(sK + stage * kBN * kStride, K + static_cast<int64_t>(kb) * a.ks[2], a.ks[2],
                       kvlen - kb, a.D);
    load_rows<kBN, kD, kThreads>(sV + stage * kBN * kStride, V + static_cast<int64_t>(kb) * a.vs[2], a.vs[2],
                       kvlen - kb, a.Dv);
  };
  if (n_tiles > 0) load_kv(0, 0);
  cp_async_commit();

  // This thread's rows: r = mt * 2 + half -> row warp*32 + mt*16 + g + 8*half.
  int row[4];
  float m[4], l[4];  // running max (base-2 logits), this lane's partial row sum
  const float c = a.scale * kLog2e;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    row[r] = q0 + warp * 32 + (r / 2) * 16 + g + 8 * (r % 2);
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (a.sinks != nullptr && row[r] < qlen) {
      m[r] = a.sinks[b * a.sinks_bs + h] * kLog2e;  // exp2(sink - m) = 1, counted once
      l[r] = t == 0 ? 1.f : 0.f;
    }
  }
  float acc[2][kOT][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int n = 0; n < kOT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][n][e] = 0.f;

  // ldmatrix lane roles: matrix i = lane / 8 supplies row lane % 8.
  const int lrow = lane & 7, lmat = lane >> 3;
  const float* q_frag_base = sQ + (warp * 32 + lrow + (lmat & 1) * 8) * kStride + (lmat >> 1) * 4;
  const int k_frag_off = (lrow + (lmat >> 1) * 8) * kStride + (lmat & 1) * 4;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile % kStages;
    const int kb = kb_begin + tile * kBN;
    if (tile + 1 < n_tiles) load_kv(tile + 1, (tile + 1) % kStages);
    cp_async_commit();
    cp_async_wait<1>();  // Q and this tile have landed (for this thread)
    if constexpr (kMode == 1) {
      if (tile == 0) round_own_chunks<kBM, kD, kThreads>(sQ);
      round_own_chunks<kBN, kD, kThreads>(sK + stage * kBN * kStride);
      round_own_chunks<kBN, kD, kThreads>(sV + stage * kBN * kStride);
    }
    __syncthreads();
    const float* sKs = sK + stage * kBN * kStride;
    const float* sVs = sV + stage * kBN * kStride;

    // ---- S = Q K^T ----
    float s[2][kNT][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) {
      uint32_t qa[2][4];
      ldmatrix_x4(qa[0], q_frag_base + kk * 8);
      ldmatrix_x4(qa[1], q_frag_base + 16 * kStride + kk * 8);
#pragma unroll
      for (int n2 = 0; n2 < kNT / 2; ++n2) {
        uint32_t kf[4];
        ldmatrix_x4(kf, sKs + n2 * 16 * kStride + k_frag_off + kk * 8);
        const uint32_t b0[2] = {kf[0], kf[1]}, b1[2] = {kf[2], kf[3]};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_tc<kMode>(s[mt][2 * n2], qa[mt], b0);
          mma_tc<kMode>(s[mt][2 * n2 + 1], qa[mt], b1);
        }
      }
    }

    // ---- scale (base 2), visibility, running max ----
    const bool full = a.mask_kind == 0 && kb + kBN <= kvlen && q0 + kBM <= qlen &&
                      (a.wr < 0 || static_cast<int64_t>(kb + kBN - 1) - (q0 + offset) <= a.wr) &&
                      (a.wl < 0 || static_cast<int64_t>(kb) - (q0 + kBM - 1 + offset) >= -a.wl);
    float mnew[4] = {m[0], m[1], m[2], m[3]};
    // Full tile with a positive scale: the max is taken on the raw scores and the
    // scale is folded into the exponent's FFMA below (s_scale = c); otherwise s is
    // scaled here (s_scale = 1).
    const bool folded = full && c > 0.f;
    const float s_scale = folded ? c : 1.f;
    if (folded) {
      float raw[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) raw[mt * 2 + e / 2] = fmaxf(raw[mt * 2 + e / 2], s[mt][n][e]);
#pragma unroll
      for (int r = 0; r < 4; ++r) mnew[r] = fmaxf(mnew[r], raw[r] * c);
    } else if (full) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = mt * 2 + e / 2;
            s[mt][n][e] *= c;
            mnew[r] = fmaxf(mnew[r], s[mt][n][e]);
          }
    } else {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < kNT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = mt * 2 + e / 2;
            const int i = row[r];
            const int j = kb + n * 8 + 2 * t + (e & 1);
            bool vis = band_visible(a, i, j, qlen, kvlen, offset);
            float x = s[mt][n][e] * c;
            if (vis && a.mask_kind != 0) x += mask_value(a, b, h, i, j, &vis) * kLog2e;
            x = vis ? x : -INFINITY;
            s[mt][n][e] = x;
            mnew[r] = fmaxf(mnew[r], x);
          }
    }
    float alpha[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      float mu;
      alpha[r] = online_rescale<SoftmaxExp::kFastExp2>(m[r], quad_max(mnew[r]), mu);
      mnew[r] = mu;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int n = 0; n < kNT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = mt * 2 + e / 2;
          const float p = fast_exp2(fmaf(s[mt][n][e], s_scale, -mnew[r]));
          s[mt][n][e] = p;
          l[r] += p;
        }
#pragma unroll
      for (int n = 0; n < kOT; ++n) {
        acc[mt][n][0] *= alpha[mt * 2];
        acc[mt][n][1] *= alpha[mt * 2];
        acc[mt][n][2] *= alpha[mt * 2 + 1];
        acc[mt][n][3] *= alpha[mt * 2 + 1];
      }
    }

    // ---- O += P V: S's accumulator is PV's A fragment with keys permuted ----
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      uint32_t pa[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const float* sj = s[mt][j];
        if constexpr (kMode == 1) {
          pa[mt][0] = to_tf32(sj[0]);
          pa[mt][1] = to_tf32(sj[2]);
          pa[mt][2] = to_tf32(sj[1]);
          pa[mt][3] = to_tf32(sj[3]);
        } else {
          pa[mt][0] = __float_as_uint(sj[0]);
          pa[mt][1] = __float_as_uint(sj[2]);
          pa[mt][2] = __float_as_uint(sj[1]);
          pa[mt][3] = __float_as_uint(sj[3]);
        }
      }
      const float* v0 = sVs + (j * 8 + 2 * t) * kStride + g;
#pragma unroll
      for (int n = 0; n < kOT; ++n) {
        const uint32_t vb[2] = {__float_as_uint(v0[n * 8]), __float_as_uint(v0[kStride + n * 8])};
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) mma_tc<kMode>(acc[mt][n], pa[mt], vb);
      }
    }
    if constexpr (kStages == 2) __syncthreads();  // this buffer is refilled next
  }
  cp_async_wait<0>();

  // ---- epilogue: normalize, write out + lse ----
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    l[r] = quad_sum(l[r]);
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int i = row[r];
    if (i >= a.Lq) continue;
    const bool empty = softmax_row_empty(l[r]) || i >= qlen;  // a NaN sum is not empty
    const float inv = row_inverse_sum(l[r], empty);
    float* O = static_cast<float*>(a.out) + b * a.os[0] + h * a.os[1] +
               static_cast<int64_t>(i) * a.os[2];
    const int mt = r / 2, half = r % 2;
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      const int col = n * 8 + 2 * t;
      if (col < a.Dv)
        *reinterpret_cast<float2*>(O + col) =
            make_float2(row_output(acc[mt][n][2 * half], inv, empty), row_output(acc[mt][n][2 * half + 1], inv, empty));
    }
    if (t == 0)
      a.lse[(static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i] =
          row_lse_base2(m[r], l[r], empty);
  }
}

template <int kMode, int kD, int kBN, int kWarps, int kStages>
cudaError_t launch(const SdpaParams& p, const SdpaFwdBuffers& buf, cudaStream_t stream) {
  constexpr int kBM = 32 * kWarps;
  const FwdArgs a = make_fwd_args(p, buf, kD);
  constexpr size_t smem = smem_bytes<kD, kBN, kWarps, kStages>();
  auto kernel = flash_fwd_tc_kernel<kMode, kD, kBN, kWarps, kStages>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  dim3 grid((a.Lq + kBM - 1) / kBM, a.Hq, a.B);
  kernel<<<grid, kWarps * 32, smem, stream>>>(a);
  return cudaGetLastError();
}

// Tile configurations, "<keys per tile>x<warps>s<stages>": the default per head-dim class
// from flash_tuning.h; in tuning builds JAX_SDPA_FLASH_FWD_CFG (read on every call) picks
// another.
template <int kMode>
cudaError_t launch_cfg(const SdpaParams& p, const SdpaFwdBuffers& buf, cudaStream_t stream,
                       bool wide, const char* cfg) {
  // cfg may name one configuration per head-dim class, comma-separated.
  const std::string c = cfg == nullptr ? "" : cfg;
  auto named = [&](const char* name) { return c.find(name) != std::string::npos; };
  (void)named;
  if (!wide) {
#if JAX_SDPA_TUNING
    if (named("64x4s2")) return launch<kMode, 64, 64, 4, 2>(p, buf, stream);
    if (named("64x8s2")) return launch<kMode, 64, 64, 8, 2>(p, buf, stream);
    if (named("32x4s3")) return launch<kMode, 64, 32, 4, 3>(p, buf, stream);
#endif
    constexpr tuning::FwdTile t = tuning::kFwdNarrow;
    return launch<kMode, 64, t.keys, t.warps, t.stages>(p, buf, stream);
  }
#if JAX_SDPA_TUNING
  if (named("32x4s2")) return launch<kMode, 128, 32, 4, 2>(p, buf, stream);
  if (named("16x8s3")) return launch<kMode, 128, 16, 8, 3>(p, buf, stream);
#endif
  constexpr tuning::FwdTile t = tuning::kFwdWide;
  return launch<kMode, 128, t.keys, t.warps, t.stages>(p, buf, stream);
}

// Serves fp32 with D, Dv <= 128; returns cudaErrorNotSupported otherwise (the caller
// falls back to the generic kernel). Both defaults run one block of 8 warps per SM
// (D <= 64: 174 KB of shared memory, 3 K/V stages; D <= 128: 203 KB, 2 stages).
inline cudaError_t launch_forward_fast_f32(const SdpaParams& p, const SdpaFwdBuffers& buf,
                                           Fp32Mode mode, cudaStream_t stream) {
  const int64_t d = p.head_dim > p.head_dim_v ? p.head_dim : p.head_dim_v;
  if (d > 128 || p.dtype != DType::kF32) return cudaErrorNotSupported;
  const char* cfg = tuning_knob("JAX_SDPA_FLASH_FWD_CFG");
  return mode == Fp32Mode::kHighest ? launch_cfg<2>(p, buf, stream, d > 64, cfg)
                                    : launch_cfg<1>(p, buf, stream, d > 64, cfg);
}

}  // namespace tc
}  // namespace cuda_flash
}  // namespace jax_sdpa
