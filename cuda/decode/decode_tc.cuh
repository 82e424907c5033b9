// decode_tc_kernel: bf16 / fp16 decode on tensor cores (mma.sync m16n8k16), K/V through a
// per-warp cp.async ring; its tile step is shared with decode_tma_kernel.
#pragma once

#include "cuda/decode/decode_common.cuh"

namespace jax_sdpa {
namespace cuda_decode {

// ---- bf16 / fp16: tensor cores -------------------------------------------------
//
// One warp's 16-key tile on tensor cores, shared by decode_tc_kernel and
// decode_tma_kernel: S = Q K^T (mma m16n8k16, Q rows as A, two 8-key n-tiles of K as
// B), the online softmax update of the rows' max / sum (log2 domain), then O^T += V^T
// P^T (V^T as A, 16 dv rows; P^T as B, n = 8 query rows). The kernels differ only in
// where the fragments live, given as callables:
//   qk(c, qa, qb, k0, k1): QK step c's 16-byte fragments: Q rows g, g + 8 and the K rows of
//                          mma keys g, g + 8 (thread t's 8 head dims of the step; the
//                          same head-dim order for Q and K)
//   key(n, e1):            the key index of score element s[n][e], e1 = e & 1 (mma key
//                          8n + 2t + e1)
//   pv(c, v0, v1, v2, v3): PV step c's fragments: 8 dv of thread row g from the V rows of
//                          mma keys 2t, 2t + 1, 2t + 8, 2t + 9
// S's accumulator layout is P^T's B layout, so P never leaves registers.
template <typename T, int D, int DV, int NT, class QK, class Key, class PV>
__device__ __forceinline__ void tc_tile_step(const Args& a, const RowInfo& rowA,
                                             const RowInfo& rowB, QK qk, Key key, PV pv,
                                             float& mA, float& mB, float& lA, float& lB,
                                             float (&acc)[(DV + 63) / 64][4][NT][4]) {
  constexpr int NKC = (D + 31) / 32;   // 32-wide head-dim steps (QK)
  constexpr int NVC = (DV + 63) / 64;  // 64-wide dv steps (PV)
  const int lane = threadIdx.x & 31, t = lane & 3;
  // S = Q K^T. Of each 16-byte fragment, elements {0..3} feed the first k16 step and
  // {4..7} the second (logical k = 2t, 2t+1, 2t+8, 2t+9 = the fragment's 0..3, then
  // 4..7). Two accumulator sets (even / odd steps) halve the dependent mma chain (D512:
  // 32 -> 16 deep), which bounds a warp's tile time at one warp per scheduler.
  float s[2][4], s_odd[2][4];
  fill_zero(s);
  fill_zero(s_odd);
#pragma unroll
  for (int c = 0; c < NKC; ++c) {
    uint4 qa, qb, k0, k1;
    qk(c, qa, qb, k0, k1);
    mma_qk_step<T>((c & 1) ? s_odd : s, qa, qb, k0, k1);
  }
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] += s_odd[n][e];

  // s[n][e]: row g (e < 2) or g + 8, key key(n, e & 1).
  float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = key(n, e & 1);
      const bool upper = e >= 2;
      if (upper && NT == 1) {
        s[n][e] = -INFINITY;
        continue;
      }
      // Scalar selects (a reference to either struct would put both on the stack).
      const int first = upper ? rowB.first : rowA.first;
      const int last = upper ? rowB.last : rowA.last;
      const int64_t mrow = upper ? rowB.mrow : rowA.mrow;
      s[n][e] = masked_score(a, s[n][e] * a.scale_log2, j, first, last, mrow);
      if (upper)
        mxB = fmaxf(mxB, s[n][e]);
      else
        mxA = fmaxf(mxA, s[n][e]);
    }
  float muA;
  const float alA = online_rescale<SoftmaxExp::kExp2>(mA, fmaxf(mA, quad_max(mxA)), muA);
  float alB = 1.f, muB = 0.f;
  if (NT == 2) alB = online_rescale<SoftmaxExp::kExp2>(mB, fmaxf(mB, quad_max(mxB)), muB);
  float sumA = 0.f, sumB = 0.f;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    s[n][0] = exp2f(s[n][0] - muA);
    s[n][1] = exp2f(s[n][1] - muA);
    sumA += s[n][0] + s[n][1];
    if (NT == 2) {
      s[n][2] = exp2f(s[n][2] - muB);
      s[n][3] = exp2f(s[n][3] - muB);
      sumB += s[n][2] + s[n][3];
    }
  }
  lA = lA * alA + sumA;  // per-thread partial; quad-reduced at the end
  if (NT == 2) lB = lB * alB + sumB;

  // Rescale O^T: its columns are query rows 2t, 2t+1 (+8 for the second n-tile);
  // their alphas live in lanes 4 * row. Skipped (warp-uniform) once no row's max
  // moves, the common case after the first tiles.
  if (__any_sync(0xffffffffu, alA != 1.f || alB != 1.f)) {
    const float a0 = __shfl_sync(0xffffffffu, alA, (2 * t) * 4);
    const float a1 = __shfl_sync(0xffffffffu, alA, (2 * t + 1) * 4);
    float b0 = 1.f, b1 = 1.f;
    if (NT == 2) {
      b0 = __shfl_sync(0xffffffffu, alB, (2 * t) * 4);
      b1 = __shfl_sync(0xffffffffu, alB, (2 * t + 1) * 4);
    }
#pragma unroll
    for (int c = 0; c < NVC; ++c)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        acc[c][j][0][0] *= a0;
        acc[c][j][0][1] *= a1;
        acc[c][j][0][2] *= a0;
        acc[c][j][0][3] *= a1;
        if (NT == 2) {
          acc[c][j][NT - 1][0] *= b0;
          acc[c][j][NT - 1][1] *= b1;
          acc[c][j][NT - 1][2] *= b0;
          acc[c][j][NT - 1][3] *= b1;
        }
      }
  }

  // P^T as B (k = key, n = query row): (keys 2t, 2t+1 | 2t+8, 2t+9; row g) is
  // exactly what this thread holds in s.
  uint32_t pb[NT][2];
  pb[0][0] = pack2<T>(s[0][0], s[0][1]);
  pb[0][1] = pack2<T>(s[1][0], s[1][1]);
  if (NT == 2) {
    pb[NT - 1][0] = pack2<T>(s[0][2], s[0][3]);
    pb[NT - 1][1] = pack2<T>(s[1][2], s[1][3]);
  }

  // O^T += V^T P^T. m-tile j's rows g / g+8 are the fragment's dv 2j / 2j+1, so each A
  // register is two halves of two loaded words (prmt).
#pragma unroll
  for (int c = 0; c < NVC; ++c) {
    uint4 v0, v1, v2, v3;
    pv(c, v0, v1, v2, v3);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t A[4];
      vt_fragment(v0, v1, v2, v3, j, A);
#pragma unroll
      for (int n = 0; n < NT; ++n)
        mma16816<T>(acc[c][j][n], A[0], A[1], A[2], A[3], pb[n][0], pb[n][1]);
    }
  }
}

// After a tc_tile_step warp's last tile: rows g's and (NT == 2) g + 8's per-thread partial
// sums reduced over the quad (decode_tc_kernel, decode_tma_kernel).
template <int NT>
__device__ __forceinline__ void tc_quad_sums(float& lA, float& lB) {
  lA = quad_sum(lA);
  if (NT == 2) lB = quad_sum(lB);
}


//
// decode_tc_kernel: each warp streams its own 16-key tiles (tc_tile_step), 8 packed
// query rows waste no accumulator. Fragments are read straight from the row-major,
// padded smem tiles with 16-byte loads: the head dim inside each 32-wide chunk and the
// dv rows inside each 64-wide chunk are permuted consistently (see the kernel), which
// needs no ldmatrix and no transpose.
template <typename T, int D, int DV, int NT, int W, int S>
struct TcConfig {
  static constexpr int kThreads = W * 32;
  // Row pads against bank conflicts: the QK reads of a quarter-warp cover 64 B of
  // two adjacent K rows (stride wanted = 64 mod 128 B); the PV reads cover 16 B
  // of four rows 2 apart (stride wanted = 16 mod 32 B). (Unpadded rows, so that each
  // 128-byte global line lands on an aligned smem line, were slower and left the L2 hit
  // rate as it was: docs/cuda_decode.md.)
  static constexpr int DP = D + ((64 - (D * 2) % 128) + 128) % 128 / 2;
  static constexpr int DVP = DV + 8;
  static constexpr int kStage = kTileKeys * (DP + DVP);
  static constexpr size_t kQBytes = 16 * DP * sizeof(T);
  static constexpr size_t kRingBytes = static_cast<size_t>(W) * S * kStage * sizeof(T);
  static constexpr size_t kRedBytes = static_cast<size_t>(W) * 16 * (2 + DV) * sizeof(float);
  static constexpr size_t kSmem =
      (kQBytes + kRingBytes) > kRedBytes ? (kQBytes + kRingBytes) : kRedBytes;
};

// PF: the copies' L2 mode (cp_async16_l2). PAGED: K and V are page pools read through the
// page table (paged_rows): a key the table doesn't place is zero-filled and invisible.
template <typename T, int D, int DV, int NT, int W, int S, int PF, bool PAGED = false>
__global__ void __launch_bounds__(W * 32, 1) decode_tc_kernel(const Args a) {
  using Cfg = TcConfig<T, D, DV, NT, W, S>;
  constexpr int DP = Cfg::DP, DVP = Cfg::DVP, STAGE = Cfg::kStage;
  constexpr int RB = NT * 8;
  constexpr int NVC = (DV + 63) / 64;  // 64-wide dv chunks (PV)
  extern __shared__ __align__(16) unsigned char smem[];
  T* Qs = reinterpret_cast<T*>(smem);  // [16][DP]
  T* ring = reinterpret_cast<T*>(smem + Cfg::kQBytes);

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const BlockWork wk = block_work(a, RB);
  const int b = wk.b, kvh = wk.kvh, r0 = wk.r0, split = wk.split, qlen = wk.qlen;
  const int kvlen = wk.kvlen;
  int ks0, ks1;
  split_range(a, r0, RB, split, qlen, kvlen, &ks0, &ks1);
  const int ntiles = key_steps(ks0, ks1);
  const int my_tiles = ntiles > w ? (ntiles - w + W - 1) / W : 0;

  const T* kbase = kv_head_base<T, PAGED>(a.k, a.ks, b, kvh);
  const T* vbase = kv_head_base<T, PAGED>(a.v, a.vs, b, kvh);
  const int32_t* table = PAGED ? a.pages + static_cast<int64_t>(b) * a.pages_per_seq : nullptr;
  T* myring = ring + w * S * STAGE;
  auto tile_key = [&](int i) { return ks0 + (w + i * W) * kTileKeys; };  // my i-th tile's j0
  // paged: the table entry of the next tile to issue, loaded a tile step ahead, and the
  // readable-key masks of the tiles in flight, oldest first (a FIFO in registers).
  int next_entry = PAGED && 0 < my_tiles ? paged_entry(a, table, tile_key(0), ks1, lane) : -1;
  [[maybe_unused]] unsigned in_flight[S];
  auto issue = [&](int i) {  // my i-th tile's copies into its stage
    T* stage = myring + (i % S) * STAGE;
    if constexpr (PAGED) {
      const PagedRows rows = paged_rows(a, next_entry, tile_key(i), lane);
      in_flight[S - 1] = rows.readable;
      if (i + 1 < my_tiles) next_entry = paged_entry(a, table, tile_key(i + 1), ks1, lane);
      load_paged_tile<T, D, DV, DP, DVP, PF>(stage, kbase, vbase, rows, lane);
    } else {
      load_tile<T, D, DV, DP, DVP, PF>(stage, kbase, vbase, a.ks[2], a.vs[2], tile_key(i), ks1,
                                       lane);
    }
  };

  // Start the first tiles' copies before anything else.
#pragma unroll
  for (int st = 0; st < S - 1; ++st) {
    if (st < my_tiles) issue(st);
    if constexpr (PAGED) {
#pragma unroll
      for (int f = 0; f + 1 < S; ++f) in_flight[f] = in_flight[f + 1];
    }
    cp_async_commit();
  }

  // Q rows of the block -> smem (zeros past the group / chunk).
  load_q_rows<T, D, DP, 16, RB, Cfg::kThreads>(Qs, a, b, kvh, r0, tid);
  __syncthreads();

  const RowInfo rowA = row_info(a, b, kvh, r0 + g, qlen, kvlen);
  RowInfo rowB = rowA;
  if (NT == 2) rowB = row_info(a, b, kvh, r0 + g + 8, qlen, kvlen);

  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  float acc[NVC][4][NT][4];
  fill_zero(acc);

  for (int it = 0; it < my_tiles; ++it) {
    {
      const int nx = it + S - 1;
      if (nx < my_tiles) issue(nx);
      cp_async_commit();
    }
    cp_async_wait<S - 1>();
    __syncwarp();
    const T* Ks = myring + (it % S) * STAGE;
    const T* Vs = Ks + kTileKeys * DP;
    const int j0 = tile_key(it);
    // paged: the keys the table places (the others were zero-filled; their scores -inf)
    unsigned readable = 0u;
    if constexpr (PAGED) {
      readable = in_flight[0];
#pragma unroll
      for (int f = 0; f + 1 < S; ++f) in_flight[f] = in_flight[f + 1];
    }

    // Thread (g, t) reads 8 consecutive head-dim elements [32c + 8t, +8) of Q rows g,
    // g+8 and K keys g, g+8; elements {0..3} feed the first k16 step and {4..7} the
    // second, so logical k = 2t, 2t+1, 2t+8, 2t+9 map to physical 32c + 8t + {0,1,2,3}
    // (+4), identically for A and B. PV: thread (g, t) reads dv [64c + 8g, +8) of keys 2t,
    // 2t+1, 2t+8, 2t+9; m-tile j's rows g / g+8 are dv 64c + 8g + 2j / +1, so each A
    // register is two halves of two loaded words (prmt: vt_fragment, in tc_tile_step).
    auto qk = [&](int c, uint4& qa, uint4& qb, uint4& k0, uint4& k1) {
      const int d = 32 * c + 8 * t;
      qa = qb = k0 = k1 = make_uint4(0, 0, 0, 0);
      if (32 * c + 32 <= D || d < D) {
        qa = *reinterpret_cast<const uint4*>(Qs + g * DP + d);
        if (NT == 2) qb = *reinterpret_cast<const uint4*>(Qs + (g + 8) * DP + d);
        k0 = *reinterpret_cast<const uint4*>(Ks + g * DP + d);
        k1 = *reinterpret_cast<const uint4*>(Ks + (g + 8) * DP + d);
      }
    };
    auto key = [&](int n, int e1) {
      const int r = 8 * n + 2 * t + e1;
      if constexpr (PAGED) return (readable >> r) & 1u ? j0 + r : -1;  // -1: before first
      return j0 + r;
    };
    auto pv = [&](int c, uint4& v0, uint4& v1, uint4& v2, uint4& v3) {
      const int dv = 64 * c + 8 * g;
      v0 = v1 = v2 = v3 = make_uint4(0, 0, 0, 0);
      if (64 * c + 64 <= DV || dv < DV) load_vt_rows<DVP>(Vs, t, dv, v0, v1, v2, v3);
    };
    tc_tile_step<T, D, DV, NT>(a, rowA, rowB, qk, key, pv, mA, mB, lA, lB, acc);
    __syncwarp();  // the stage is refilled next iteration
  }
  cp_async_wait<0>();

  tc_quad_sums<NT>(lA, lB);
  __syncthreads();  // every warp is done with Q and the ring: reuse smem
  float* red = reinterpret_cast<float*>(smem);
  float* red_m = red;
  float* red_l = red + W * 16;
  float* red_o = red + 2 * W * 16;
  if (t == 0) {
    red_m[w * 16 + g] = mA;
    red_l[w * 16 + g] = lA;
    red_m[w * 16 + g + 8] = NT == 2 ? mB : -INFINITY;
    red_l[w * 16 + g + 8] = NT == 2 ? lB : 0.f;
  }
#pragma unroll
  for (int c = 0; c < NVC; ++c)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int dv = 64 * c + 8 * g + 2 * j;
      if (dv < DV) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int row = 8 * n + 2 * t;
          float* o0 = red_o + (w * 16 + row) * DV + dv;
          float* o1 = o0 + DV;
          o0[0] = acc[c][j][n][0];
          o0[1] = acc[c][j][n][2];
          o1[0] = acc[c][j][n][1];
          o1[1] = acc[c][j][n][3];
        }
      }
    }
  __syncthreads();
  block_finish<T, DV, W>(a, red, RB, b, kvh, r0, split, qlen);
}

}  // namespace cuda_decode
}  // namespace jax_sdpa
