// Flash-attention prefill forward: the generic kernel and what every flash kernel shares (docs/cuda_flash.md).
//
// Work decomposition: blockIdx.x = q_tile * n_dv_chunks + dv_chunk,
// blockIdx.y = query head, blockIdx.z = batch. A block (4 warps, 128 threads)
// owns 64 query rows (16 per warp) and DVC output columns of Dv. Q's 64 rows
// stay in shared memory for the whole key loop; keys stream in 64-key blocks:
// S = Q K^T over D in 64-column chunks of K (cp.async into shared memory),
// then the online softmax in registers, then O += P V over this block's DVC
// columns of V. When Dv > DVC the S computation is repeated by each of the
// n_dv_chunks blocks of a tile (the price of a small register footprint at
// head dim 512; see docs/cuda_flash.md for the planned fix).
//
// Tensor cores: mma.sync m16n8k8 with f32 accumulation for every dtype:
// tf32 (fp32 inputs, optionally split into hi + lo tf32 parts, "3xTF32", for
// ~fp32 accuracy), f16 and bf16. m16n8k8 keeps one fragment code path per
// dtype and lets any head dim that is a multiple of 8 run without padding.
//
// Masking follows ffi/sdpa_params.h: the key loop covers only the union of the
// tile's band ranges (band/causal block skipping, kv length); each score is
// then checked against the row's exact visibility (length, band, bool mask,
// additive mask). Rows i >= q_len produce out = 0, lse = -inf.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/flash/flash_attention.h"
#include "cuda/common/device_helpers.cuh"
#include "cuda/common/kernel_args.h"
#include "cuda/common/mma_helpers.cuh"
#include "cuda/common/softmax_rules.cuh"
#include "ffi/sdpa_params.h"

namespace jax_sdpa {
namespace cuda_flash {

constexpr int kBM = 64;       // query rows per block
constexpr int kBN = 64;       // keys per key block
constexpr int kDK = 64;       // head-dim columns of K per shared-memory chunk
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kPadBytes = 16;  // per shared-memory row: 16-byte aligned, fewer bank conflicts

// mode: 0 = 16-bit inputs, 1 = tf32, 2 = 3xTF32.
struct FwdArgs {
  JAX_SDPA_KERNEL_IO_FIELDS
  int B, Hq, G, Lq, Lk, D, Dv;
  int n_dv_chunks;
  JAX_SDPA_KERNEL_STRIDE_FIELDS
  float scale;
  JAX_SDPA_KERNEL_MASK_FIELDS
  JAX_SDPA_KERNEL_FEATURE_FIELDS  // read only by the kFeat instantiations of the generic kernels
};

// ---- device helpers -------------------------------------------------------------

using cuda_common::cp_async16;
using cuda_common::cp_async_commit;
using cuda_common::cp_async_wait;
using cuda_common::from_float;
using cuda_common::pack2;
using cuda_common::to_float;
using cuda_common::cp_async4;
using cuda_common::fast_exp2;
using cuda_common::recomputed_exponent;
using cuda_common::ldmatrix_x4;
using cuda_common::ldmatrix_x4_ordered;
using cuda_common::ldmatrix_x4_trans;
using cuda_common::ldmatrix_x4_trans_ordered;
using cuda_common::mma16816;
using cuda_common::mma_tf32;
using cuda_common::mma_tf32x3;
using cuda_common::round_tf32;
using cuda_common::to_tf32;
using cuda_common::row_output;
using cuda_common::online_rescale;
using cuda_common::quad_max;
using cuda_common::quad_sum;
using cuda_common::SoftmaxExp;
using cuda_common::row_inverse_sum;
using cuda_common::row_lse_base2;
using cuda_common::same_segment_ids;
using cuda_common::segments_may_meet;
using cuda_common::soft_capped;
using cuda_common::softmax_row_empty;
using cuda_common::physical_page;

template <typename T>
__device__ __forceinline__ uint32_t pack2_raw(T lo, T hi) {
  const uint32_t a = *reinterpret_cast<const uint16_t*>(&lo);
  const uint32_t b = *reinterpret_cast<const uint16_t*>(&hi);
  return a | (b << 16);
}

template <typename T>
__device__ __forceinline__ void mma_16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0);
template <>
__device__ __forceinline__ void mma_16<__half>(float (&d)[4], uint32_t a0, uint32_t a1,
                                               uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}
template <>
__device__ __forceinline__ void mma_16<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a1,
                                                      uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// f32 x f32 -> f32 through tf32 tensor cores: one mma (tf32) or three (3xTF32:
// a_lo*b_hi + a_hi*b_lo + a_hi*b_hi, small terms first: mma_tf32x3).
template <int kMode>
__device__ __forceinline__ void mma_f32(float (&d)[4], const float (&a)[4], const float (&b)[2]) {
  uint32_t ah[4], bh[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) ah[i] = to_tf32(a[i]);
#pragma unroll
  for (int i = 0; i < 2; ++i) bh[i] = to_tf32(b[i]);
  if constexpr (kMode == 2) {
    uint32_t al[4], bl[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) al[i] = to_tf32(a[i] - __uint_as_float(ah[i]));
#pragma unroll
    for (int i = 0; i < 2; ++i) bl[i] = to_tf32(b[i] - __uint_as_float(bh[i]));
    mma_tf32x3(d, ah, al, bh, bl);
  } else {
    mma_tf32(d, ah, bh);
  }
}

// Copies rows [0, nrows) x columns [c0, c0 + ncols) of a global matrix (row
// stride `gstride` elements) into shared memory (row stride `sstride` bytes),
// 16 bytes per cp.async; rows >= valid_rows and columns >= valid_cols are zero.
// ncols and valid_cols are multiples of 16 / sizeof(T) (head dims are multiples of 8).
template <typename T>
__device__ __forceinline__ void load_tile(char* smem, int sstride, const T* g, int64_t gstride,
                                          int nrows, int valid_rows, int c0, int ncols,
                                          int valid_cols) {
  constexpr int kVec = 16 / sizeof(T);
  const int vecs_per_row = ncols / kVec;
  const int total = nrows * vecs_per_row;
  for (int x = threadIdx.x; x < total; x += kThreads) {
    const int r = x / vecs_per_row;
    const int c = (x - r * vecs_per_row) * kVec;
    const bool ok = r < valid_rows && c0 + c < valid_cols;
    const T* src = ok ? g + r * gstride + c0 + c : g;
    cp_async16(smem + r * sstride + c * static_cast<int>(sizeof(T)), src, ok);
  }
}

// load_tile for paged K or V: row r is key kb + r, at base (the kv head's offset) + page *
// st[0] + slot * st[2] (table: the batch row's page-table row). Keys >= kvlen and keys of an
// out-of-range page are zero, never read.
template <typename T>
__device__ __forceinline__ void load_paged_tile(char* smem, int sstride, const T* base,
                                                const int64_t (&st)[3], const int32_t* table,
                                                int page_size, int num_pages, int kb, int nrows,
                                                int kvlen, int c0, int ncols, int valid_cols) {
  constexpr int kVec = 16 / sizeof(T);
  const int vecs_per_row = ncols / kVec;
  const int total = nrows * vecs_per_row;
  for (int x = threadIdx.x; x < total; x += kThreads) {
    const int r = x / vecs_per_row;
    const int c = (x - r * vecs_per_row) * kVec;
    const int j = kb + r;
    const T* src = base;
    bool ok = j < kvlen && c0 + c < valid_cols;
    if (ok) {
      const int page = physical_page(table, page_size, num_pages, j);
      ok = page >= 0;
      if (ok) src = base + page * st[0] + static_cast<int64_t>(j % page_size) * st[2] + c0 + c;
    }
    cp_async16(smem + r * sstride + c * static_cast<int>(sizeof(T)), src, ok);
  }
}

// Keys [lo, hi) that some valid row of the query tile [q0, q0 + bm) may see (its band and
// the kv length; hi >= lo), both 0 for a tile past qlen: the forwards' block skipping.
__device__ __forceinline__ void tile_key_range(const FwdArgs& a, int q0, int bm, int qlen,
                                               int kvlen, int64_t offset, int* lo, int* hi) {
  int key_lo = 0, key_hi = 0;
  if (q0 < qlen) {
    const int last_row = min(q0 + bm, qlen) - 1;
    key_lo = static_cast<int>(band_keys(q0, offset, a.wl, a.wr, kvlen).first);
    key_hi = static_cast<int>(band_keys(last_row, offset, a.wl, a.wr, kvlen).last);
    if (key_hi < key_lo) key_hi = key_lo;
  }
  *lo = key_lo;
  *hi = key_hi;
}

__device__ __forceinline__ float mask_value(const FwdArgs& a, int b, int h, int i, int j,
                                            bool* visible) {
  if (a.mask_kind == 0) return 0.f;
  const int64_t idx = b * a.ms[0] + h * a.ms[1] + static_cast<int64_t>(i) * a.ms[2] +
                      static_cast<int64_t>(j) * a.ms[3];
  if (a.mask_kind == 1) {
    if (!static_cast<const bool*>(a.mask)[idx]) *visible = false;
    return 0.f;
  }
  float m;
  if (a.mask_dtype == 0) m = static_cast<const float*>(a.mask)[idx];
  else if (a.mask_dtype == 1) m = __half2float(static_cast<const __half*>(a.mask)[idx]);
  else m = __bfloat162float(static_cast<const __nv_bfloat16*>(a.mask)[idx]);
  if (m == -INFINITY) *visible = false;
  return m;
}

// Whether every row of the query tile [q0, q0 + bm) sees every key of [kb, kb + bn): no
// mask tensor, inside both lengths and the band. Such tiles skip the per-element checks.
__device__ __forceinline__ bool tile_all_visible(const FwdArgs& a, int q0, int bm, int kb, int bn,
                                                 int qlen, int kvlen, int64_t offset) {
  bool all = a.mask_kind == 0 && q0 + bm <= qlen && kb + bn <= kvlen;
  if (all && a.wl >= 0) all = static_cast<int64_t>(kb) - (q0 + bm - 1 + offset) >= -a.wl;
  if (all && a.wr >= 0) all = static_cast<int64_t>(kb + bn - 1) - (q0 + offset) <= a.wr;
  return all;
}

// The kBr-row query tiles a backward key block [k0, k0 + kvalid) must visit: those holding
// a query i whose band reaches the block, i in [j - offset - wr, j - offset + wl] for some
// key j of it. n_qt = 0 when none does (or the block has no keys).
struct QueryTiles {
  int qb_lo, n_qt;  // first tile's row, tile count
};
template <int kBr>
__device__ __forceinline__ QueryTiles band_query_tiles(const FwdArgs& f, int k0, int kvalid,
                                                       int qlen, int64_t offset) {
  int64_t i_lo = 0, i_hi = qlen;
  if (f.wr >= 0 && k0 - offset - f.wr > i_lo) i_lo = k0 - offset - f.wr;
  if (f.wl >= 0 && k0 + kvalid - offset + f.wl < i_hi) i_hi = k0 + kvalid - offset + f.wl;
  QueryTiles qt{0, 0};
  if (kvalid > 0 && i_hi > i_lo) {
    qt.qb_lo = static_cast<int>((i_lo / kBr) * kBr);
    qt.n_qt = static_cast<int>((i_hi - qt.qb_lo + kBr - 1) / kBr);
  }
  return qt;
}

// Batch row b's valid lengths and the diagonal's offset (bottom-right alignment).
struct RowLengths {
  int qlen, kvlen;
  int64_t offset;
};
__device__ __forceinline__ RowLengths row_lengths(const FwdArgs& a, int b) {
  RowLengths r;
  r.qlen = static_cast<int>(clamp_length(a.qlen, b, a.Lq));
  r.kvlen = static_cast<int>(clamp_length(a.kvlen, b, a.Lk));
  r.offset = diagonal_offset(a.bottom_right != 0, r.qlen, r.kvlen);
  return r;
}

// What a forward block of the flash skeleton works on: query tile gridDim.x - 1 - blockIdx.x
// (the heaviest, causal, first) of batch row blockIdx.z and query head blockIdx.y, its row
// lengths and diagonal offset, the bases of its Q, K and V, and the kBN-key tiles that a
// valid row of its kBM rows may see (n_tiles from kb_begin).
template <typename T>
struct ForwardBlock {
  int h, b, hk, q0, qlen, kvlen;
  int64_t offset;
  const T *Q, *K, *V;
  int kb_begin, n_tiles;
};

template <typename T, int kBM, int kBN>
__device__ __forceinline__ ForwardBlock<T> forward_block(const FwdArgs& a) {
  ForwardBlock<T> f;
  const int q_tile = gridDim.x - 1 - blockIdx.x;
  f.h = blockIdx.y;
  f.b = blockIdx.z;
  f.hk = f.h / a.G;
  f.q0 = q_tile * kBM;
  const RowLengths len = row_lengths(a, f.b);
  f.qlen = len.qlen;
  f.kvlen = len.kvlen;
  f.offset = len.offset;
  f.Q = static_cast<const T*>(a.q) + f.b * a.qs[0] + f.h * a.qs[1];
  f.K = static_cast<const T*>(a.k) + f.b * a.ks[0] + f.hk * a.ks[1];
  f.V = static_cast<const T*>(a.v) + f.b * a.vs[0] + f.hk * a.vs[1];
  int key_lo, key_hi;
  tile_key_range(a, f.q0, kBM, f.qlen, f.kvlen, f.offset, &key_lo, &key_hi);
  f.kb_begin = (key_lo / kBN) * kBN;
  f.n_tiles = key_hi > f.kb_begin ? (key_hi - f.kb_begin + kBN - 1) / kBN : 0;
  return f;
}

// Whether query row i may see key j by the lengths and the band (masks and segment ids
// aside).
__device__ __forceinline__ bool band_visible(const FwdArgs& a, int i, int j, int qlen, int kvlen,
                                             int64_t offset) {
  bool vis = i < qlen && j < kvlen;
  if (vis) {
    const int64_t dd = static_cast<int64_t>(j) - (i + offset);
    if (a.wl >= 0 && dd < -a.wl) vis = false;
    if (a.wr >= 0 && dd > a.wr) vis = false;
  }
  return vis;
}

// (batch, query head, query) of row r of a [B, Hq, Lq] row set: the per-row kernels.
struct QueryRow {
  int b, h, i;
};
__device__ __forceinline__ QueryRow query_row(const FwdArgs& a, int64_t r) {
  QueryRow q;
  q.i = static_cast<int>(r % a.Lq);
  q.h = static_cast<int>((r / a.Lq) % a.Hq);
  q.b = static_cast<int>(r / (static_cast<int64_t>(a.Lq) * a.Hq));
  return q;
}

// A backward block's keys [k0, k0 + kvalid) of kv head hk in batch row b, and the
// (query head, query tile) pairs its band reaches: G heads x n_qt tiles from query qb_lo.
struct KeyBlock {
  RowLengths len;
  int k0, kvalid, qb_lo, n_qt, n_iter;
};
template <int kBc, int kBr>
__device__ __forceinline__ KeyBlock key_block(const FwdArgs& f, int key_tile, int b) {
  KeyBlock kb;
  kb.k0 = key_tile * kBc;
  kb.len = row_lengths(f, b);
  kb.kvalid = max(0, min(kBc, kb.len.kvlen - kb.k0));
  const QueryTiles band = band_query_tiles<kBr>(f, kb.k0, kb.kvalid, kb.len.qlen, kb.len.offset);
  kb.qb_lo = band.qb_lo;
  kb.n_qt = band.n_qt;
  kb.n_iter = f.G * band.n_qt;
  return kb;
}

// Row `row` of head h in batch row b of a [B, H, L, D]-strided operand (strides st).
template <typename T>
__device__ __forceinline__ const T* head_row(const void* base, const int64_t* st, int b, int h,
                                             int64_t row) {
  return static_cast<const T*>(base) + b * st[0] + h * st[1] + row * st[2];
}

// The backwards' key blocks visit G * n_qt (query head, query tile) pairs, starting at
// `rot` (the key tile) so that concurrent blocks of one head add into different dq rows:
// visit `it`'s head h and first query qb.
template <int kBr>
__device__ __forceinline__ void rotated_visit(int it, int rot, int n_iter, int n_qt, int qb_lo,
                                              int first_head, int& h, int& qb) {
  int idx = it + rot;
  if (idx >= n_iter) idx -= n_iter;
  const int hh = idx / n_qt;
  h = first_head + hh;
  qb = qb_lo + (idx - hh * n_qt) * kBr;
}

// cp.async of a query tile's lse and delta rows [row0, row0 + kBr) into sL / sDl (threads
// 0..kBr-1 and kBr..2kBr-1); rows >= valid_rows are zero-filled.
template <int kBr>
__device__ __forceinline__ void load_row_stats(float* sL, float* sDl, const float* lse,
                                               const float* delta, int64_t row0, int valid_rows,
                                               int tid) {
  if (tid < kBr) {
    cp_async4(sL + tid, lse + (tid < valid_rows ? row0 + tid : 0), tid < valid_rows);
  } else if (tid < 2 * kBr) {
    const int r = tid - kBr;
    cp_async4(sDl + r, delta + (r < valid_rows ? row0 + r : 0), r < valid_rows);
  }
}

// dst[0..1] += (x0, x1): one float2 reduction on sm_90+, two atomics before.
__device__ __forceinline__ void atomic_add2(float* dst, float x0, float x1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(x0, x1));
#else
  atomicAdd(dst, x0);
  atomicAdd(dst + 1, x1);
#endif
}

// Score x (scaled, base 2) of query row i and key j, or -inf where the row may not see
// the key (lengths, band); the mask added (log2e-scaled) or applied.
__device__ __forceinline__ float visible_score(const FwdArgs& a, int b, int h, int i, int j,
                                               int qlen, int kvlen, int64_t offset, float x) {
  constexpr float kLog2e = 1.4426950408889634f;
  bool vis = band_visible(a, i, j, qlen, kvlen, offset);
  if (vis && a.mask_kind != 0) x += mask_value(a, b, h, i, j, &vis) * kLog2e;
  return vis ? x : -INFINITY;
}

// ---- the forward kernel -------------------------------------------------------------

// kFeat: the instantiation that serves the contract features (segment ids, soft-capping;
// FwdArgs' feature fields); the others never read them.
template <typename T, int kMode, int kDVC, bool kFeat>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(const FwdArgs a) {
  constexpr int kNT = kBN / 8;   // n8 tiles of S per warp
  constexpr int kOT = kDVC / 8;  // n8 tiles of O per warp
  extern __shared__ __align__(16) char smem[];
  const int q_stride_b = a.D * static_cast<int>(sizeof(T)) + kPadBytes;
  constexpr int k_stride_b = kDK * static_cast<int>(sizeof(T)) + kPadBytes;
  constexpr int v_stride_b = kDVC * static_cast<int>(sizeof(T)) + kPadBytes;
  constexpr int p_stride = kBN + 4;  // floats, fp32 modes only
  char* sQ = smem;
  char* sK = sQ + kBM * q_stride_b;
  char* sV = sK + kBN * k_stride_b;
  float* sP = reinterpret_cast<float*>(sV + kBN * v_stride_b);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int q_tile = blockIdx.x / a.n_dv_chunks;
  const int dv_chunk = blockIdx.x - q_tile * a.n_dv_chunks;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / a.G;
  const int q0 = q_tile * kBM;
  const int c0v = dv_chunk * kDVC;

  // (row_lengths() here, not its fields, costs the fp32 D128 feature instantiation 34
  // spilled instructions.)
  const int qlen = static_cast<int>(clamp_length(a.qlen, b, a.Lq));
  const int kvlen = static_cast<int>(clamp_length(a.kvlen, b, a.Lk));
  const int64_t offset = diagonal_offset(a.bottom_right != 0, qlen, kvlen);

  const T* Q = static_cast<const T*>(a.q) + b * a.qs[0] + h * a.qs[1];
  // Paged K/V (kFeat only): the kv head's offset in the page pool; rows come per page.
  const bool paged = kFeat && a.pages != nullptr;
  const int32_t* table = paged ? a.pages + static_cast<int64_t>(b) * a.pages_per_seq : nullptr;
  const T* K = static_cast<const T*>(a.k) + (paged ? 0 : b * a.ks[0]) + hk * a.ks[1];
  const T* V = static_cast<const T*>(a.v) + (paged ? 0 : b * a.vs[0]) + hk * a.vs[1];

  // Keys any valid row of the tile may see (band + kv length): block skipping.
  int key_lo, key_hi;
  tile_key_range(a, q0, kBM, qlen, kvlen, offset, &key_lo, &key_hi);

  // Q tile -> shared memory (rows beyond Lq are zero).
  load_tile<T>(sQ, q_stride_b, Q + static_cast<int64_t>(q0) * a.qs[2], a.qs[2], kBM,
               min(kBM, a.Lq - q0), 0, a.D, a.D);
  cp_async_commit();

  // Per thread: rows r0 = warp*16 + g and r1 = r0 + 8 of the tile.
  const int row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
  float m[2], l[2];
  float acc[kOT][4];
#pragma unroll
  for (int n = 0; n < kOT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (a.sinks != nullptr && row[r] < qlen) {
      m[r] = a.sinks[b * a.sinks_bs + h];  // exp(sink - m) = 1
      l[r] = 1.f;
    }
  }

  const int kb_begin = (key_lo / kBN) * kBN;
  for (int kb = kb_begin; kb < key_hi; kb += kBN) {
    // Segment ids: skip a key block no row of the tile shares a segment with (every warp
    // computes the same answer, so the whole block skips; nothing of the block is in flight).
    if constexpr (kFeat) {
      if (!segments_may_meet(a.qseg, a.kvseg, b, a.Lq, a.Lk, q0, min(q0 + kBM, qlen), kb,
                             min(kb + kBN, kvlen)))
        continue;
    }
    const int kvalid = kvlen - kb;  // keys >= kvlen are zero-filled
    float s[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;

    // ---- S = Q K^T, D in chunks of kDK ----
    for (int d0 = 0; d0 < a.D; d0 += kDK) {
      const int dk = min(kDK, a.D - d0);
      __syncthreads();  // previous users of sK are done
      if (paged) {
        load_paged_tile<T>(sK, k_stride_b, K, a.ks, table, a.page_size, a.num_pages, kb, kBN,
                           kvlen, d0, dk, a.D);
        if (d0 + kDK >= a.D)
          load_paged_tile<T>(sV, v_stride_b, V, a.vs, table, a.page_size, a.num_pages, kb, kBN,
                             kvlen, c0v, kDVC, a.Dv);
      } else {
        load_tile<T>(sK, k_stride_b, K + static_cast<int64_t>(kb) * a.ks[2], a.ks[2], kBN,
                     kvalid, d0, dk, a.D);
        // Last chunk: also start V's copy (overlaps the last S chunk).
        if (d0 + kDK >= a.D)
          load_tile<T>(sV, v_stride_b, V + static_cast<int64_t>(kb) * a.vs[2], a.vs[2], kBN,
                       kvalid, c0v, kDVC, a.Dv);
      }
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
      const char* qbase = sQ + (warp * 16) * q_stride_b + d0 * static_cast<int>(sizeof(T));
      for (int kk = 0; kk < dk; kk += 8) {
        if constexpr (kMode == 0) {
          const char* qa = qbase + kk * 2;
          const uint32_t a0 = *reinterpret_cast<const uint32_t*>(qa + g * q_stride_b + t * 4);
          const uint32_t a1 =
              *reinterpret_cast<const uint32_t*>(qa + (g + 8) * q_stride_b + t * 4);
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(
                sK + (n * 8 + g) * k_stride_b + kk * 2 + t * 4);
            mma_16<T>(s[n], a0, a1, b0);
          }
        } else {
          const char* qa = qbase + kk * 4;
          const float af[4] = {
              *reinterpret_cast<const float*>(qa + g * q_stride_b + t * 4),
              *reinterpret_cast<const float*>(qa + (g + 8) * q_stride_b + t * 4),
              *reinterpret_cast<const float*>(qa + g * q_stride_b + (t + 4) * 4),
              *reinterpret_cast<const float*>(qa + (g + 8) * q_stride_b + (t + 4) * 4)};
#pragma unroll
          for (int n = 0; n < kNT; ++n) {
            const char* kr = sK + (n * 8 + g) * k_stride_b + kk * 4;
            const float bf[2] = {*reinterpret_cast<const float*>(kr + t * 4),
                                 *reinterpret_cast<const float*>(kr + (t + 4) * 4)};
            mma_f32<kMode>(s[n], af, bf);
          }
        }
      }
    }

    // ---- scale, mask, online softmax ----
    float mnew[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int i = row[r];
        const int j = kb + n * 8 + 2 * t + (e & 1);
        bool vis = band_visible(a, i, j, qlen, kvlen, offset);
        float x = s[n][e] * a.scale;
        if constexpr (kFeat) {
          if (a.soft_cap > 0.f) x = soft_capped(x, a.soft_cap);
          vis = vis && same_segment_ids(a.qseg, a.kvseg, b, a.Lq, a.Lk, i, j);
          // A key of an out-of-range page is invisible (its zero-filled row never counts).
          if (paged && vis) vis = physical_page(table, a.page_size, a.num_pages, j) >= 0;
        }
        if (vis) x += mask_value(a, b, h, i, j, &vis);
        x = vis ? x : -INFINITY;
        s[n][e] = x;
        mnew[r] = fmaxf(mnew[r], x);
      }
    }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      constexpr SoftmaxExp kExpKind = kMode == 2 ? SoftmaxExp::kExp : SoftmaxExp::kFastExp;
      float mu;
      alpha[r] = online_rescale<kExpKind>(m[r], quad_max(mnew[r]), mu);
      mnew[r] = mu;  // the subtrahend for this block's exponentials
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kNT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const float p = kMode == 2 ? expf(s[n][e] - mnew[r]) : __expf(s[n][e] - mnew[r]);
        s[n][e] = p;
        rowsum[r] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 1);
      rowsum[r] += __shfl_xor_sync(0xffffffffu, rowsum[r], 2);
      l[r] = l[r] * alpha[r] + rowsum[r];
    }
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      acc[n][0] *= alpha[0];
      acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1];
      acc[n][3] *= alpha[1];
    }

    // ---- O += P V (V chunk already in shared memory) ----
    if constexpr (kMode == 0) {
      // The accumulator fragment of S's n8 tile j is the A fragment of k-chunk j.
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const uint32_t a0 = pack2<T>(s[j][0], s[j][1]);
        const uint32_t a1 = pack2<T>(s[j][2], s[j][3]);
        const T* v0 = reinterpret_cast<const T*>(sV + (j * 8 + 2 * t) * v_stride_b);
        const T* v1 = reinterpret_cast<const T*>(sV + (j * 8 + 2 * t + 1) * v_stride_b);
#pragma unroll
        for (int n = 0; n < kOT; ++n) {
          const uint32_t b0 = pack2_raw<T>(v0[n * 8 + g], v1[n * 8 + g]);
          mma_16<T>(acc[n], a0, a1, b0);
        }
      }
    } else {
      // fp32: P goes through this warp's shared-memory slice to reach the A layout.
      float* P = sP + warp * 16 * p_stride;
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
        P[g * p_stride + n * 8 + 2 * t] = s[n][0];
        P[g * p_stride + n * 8 + 2 * t + 1] = s[n][1];
        P[(g + 8) * p_stride + n * 8 + 2 * t] = s[n][2];
        P[(g + 8) * p_stride + n * 8 + 2 * t + 1] = s[n][3];
      }
      __syncwarp();
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const float af[4] = {P[g * p_stride + j * 8 + t], P[(g + 8) * p_stride + j * 8 + t],
                             P[g * p_stride + j * 8 + t + 4],
                             P[(g + 8) * p_stride + j * 8 + t + 4]};
        const float* v0 = reinterpret_cast<const float*>(sV + (j * 8 + t) * v_stride_b);
        const float* v1 = reinterpret_cast<const float*>(sV + (j * 8 + t + 4) * v_stride_b);
#pragma unroll
        for (int n = 0; n < kOT; ++n) {
          const float bf[2] = {v0[n * 8 + g], v1[n * 8 + g]};
          mma_f32<kMode>(acc[n], af, bf);
        }
      }
      __syncwarp();
    }
  }
  // No key block ran (or, with segment ids, every one was skipped): Q's copy is in flight.
  if (kFeat || key_hi <= kb_begin) cp_async_wait<0>();

  // ---- epilogue: normalize, write out (and lse from the first Dv chunk) ----
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row[r];
    if (i >= a.Lq) continue;
    const bool empty = softmax_row_empty(l[r]) || i >= qlen;
    const float inv = row_inverse_sum(l[r], empty);
    T* O = static_cast<T*>(a.out) + b * a.os[0] + h * a.os[1] + static_cast<int64_t>(i) * a.os[2];
#pragma unroll
    for (int n = 0; n < kOT; ++n) {
      const int c = c0v + n * 8 + 2 * t;
      if (c < a.Dv) {  // Dv is a multiple of 8: c + 1 < Dv too
        O[c] = from_float<T>(row_output(acc[n][2 * r], inv, empty));
        O[c + 1] = from_float<T>(row_output(acc[n][2 * r + 1], inv, empty));
      }
    }
    if (dv_chunk == 0 && t == 0)
      a.lse[(static_cast<int64_t>(b) * a.Hq + h) * a.Lq + i] =
          empty ? -INFINITY : m[r] + logf(l[r]);
  }
}

inline size_t fwd_smem_bytes(int D, int elem_size, int dvc) {
  return static_cast<size_t>(kBM) * (D * elem_size + kPadBytes) +
         static_cast<size_t>(kBN) * (kDK * elem_size + kPadBytes) +
         static_cast<size_t>(kBN) * (dvc * elem_size + kPadBytes) +
         (elem_size == 4 ? static_cast<size_t>(kWarps) * 16 * (kBN + 4) * 4 : 0);
}

inline FwdArgs make_fwd_args(const SdpaParams& p, const SdpaFwdBuffers& buf, int dvc) {
  FwdArgs a{};
  cuda_common::set_call_fields(p, buf, &a);
  cuda_common::set_feature_fields(p, &a);
  a.B = static_cast<int>(p.batch);
  a.Hq = static_cast<int>(p.heads_q);
  a.G = static_cast<int>(p.group());
  a.Lq = static_cast<int>(p.len_q);
  a.Lk = static_cast<int>(p.len_kv);
  a.D = static_cast<int>(p.head_dim);
  a.Dv = static_cast<int>(p.head_dim_v);
  a.n_dv_chunks = static_cast<int>((p.head_dim_v + dvc - 1) / dvc);
  a.scale = static_cast<float>(p.scale);
  return a;
}

// The generic forward; the kFeat instantiation where the call uses a contract feature.
template <typename T, int kMode, int kDVC>
cudaError_t launch_fwd_t(const SdpaParams& p, const SdpaFwdBuffers& buf, cudaStream_t stream) {
  const FwdArgs a = make_fwd_args(p, buf, kDVC);
  const size_t smem = fwd_smem_bytes(a.D, static_cast<int>(sizeof(T)), kDVC);
  auto kernel = (p.features() != 0 || p.paged()) ? flash_fwd_kernel<T, kMode, kDVC, true>
                                                 : flash_fwd_kernel<T, kMode, kDVC, false>;
  cudaError_t e =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const int q_tiles = (a.Lq + kBM - 1) / kBM;
  dim3 grid(q_tiles * a.n_dv_chunks, a.Hq, a.B);
  kernel<<<grid, kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda_flash
}  // namespace jax_sdpa
