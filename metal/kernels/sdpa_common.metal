// Helpers shared by the attention kernels: masking rules (docs/ffi_contract.md), 8x8 fragment
// I/O with bounds, row reductions. Compiles with Apple's compiler and with msl_emulator.h.
// The host concatenates sdpa_shared.h, this file and the kernel files into one source, so
// local #includes below are guarded and may be stripped.
#ifndef JAX_SDPA_METAL_COMMON
#define JAX_SDPA_METAL_COMMON

#ifdef __METAL_VERSION__
#include <metal_stdlib>
#define MSL_TG_ARRAY(T, name, n) threadgroup T name[n]
#define MSL_INSTANTIATE_KERNEL(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;
#endif
#include "sdpa_shared.h"

using namespace metal;

#define SDPA_LOG2E 1.4426950408889634f
#define SDPA_LN2 0.6931471805599453f
#define SDPA_NEG_INF (-INFINITY)

// ---- masking rules ----------------------------------------------------------------------------

// Valid length of batch row b, clamped to [0, full] (lengths are data; never trust them).
METAL_FUNC int sdpa_length(device const int* lengths, int has, int b, int full) {
  if (has == 0) return full;
  int n = lengths[b];
  return n < 0 ? 0 : (n > full ? full : n);
}

// Keys [first, last) of the band around query i's diagonal position i + off.
METAL_FUNC int sdpa_band_first(int i, int off, int wl) {
  return wl < 0 ? 0 : max(0, i + off - wl);
}
METAL_FUNC int sdpa_band_last(int i, int off, int wr, int kvlen) {
  return wr < 0 ? kvlen : min(kvlen, max(0, i + off + wr + 1));
}

// Additive mask value in base 2 for (b, h, i, j), or -inf where a bool mask hides the key.
METAL_FUNC float sdpa_mask2(device const uchar* mask, constant SdpaMetalParams& p, int b, int h,
                            int i, int j) {
  const long idx = b * p.mask_stride[0] + h * p.mask_stride[1] + i * p.mask_stride[2] +
                   j * p.mask_stride[3];
  if (p.mask_kind == SDPA_MASK_BOOL) return mask[idx] != 0 ? 0.0f : SDPA_NEG_INF;
  float x;
  if (p.mask_dtype == SDPA_DT_F16)
    x = float(((device const half*)mask)[idx]);
  else if (p.mask_dtype == SDPA_DT_BF16)
    x = float(((device const bfloat*)mask)[idx]);
  else
    x = ((device const float*)mask)[idx];
  return x * SDPA_LOG2E;
}

// Base-2 score of q.k (`dot`) before the mask: scale * q.k, or with soft-capping (the CAP
// kernels) cap * tanh(scale * q.k / cap) (the cap comes before the additive mask); `t` gets
// the tanh, whose 1 - t^2 the backward needs.
template <bool CAP>
METAL_FUNC float sdpa_score2(float dot, constant SdpaMetalParams& p, thread float& t) {
  if (!CAP) return dot * p.scale_log2;
  t = tanh(dot * p.scale_over_cap);
  return p.cap_log2 * t;
}

// Segment id of position i of batch row b (packed sequences; only when has_segment_ids).
METAL_FUNC int sdpa_seg(device const int* ids, int b, int len, int i) {
  return ids[long(b) * len + i];
}

// Base-2 logit of key j for query i given q.k (`dot`), or -inf when j is not visible: i < qlen,
// j < kvlen, the band, the segments and the mask are checked here; `key_ok` is false for a key
// on a page outside the pool (paged K/V). `t`: see sdpa_score2.
template <bool CAP>
METAL_FUNC float sdpa_logit2(float dot, device const uchar* mask, device const int* q_seg,
                             device const int* kv_seg, constant SdpaMetalParams& p, int b,
                             int h, int i, int j, int qlen, int kvlen, int off, bool key_ok,
                             thread float& t) {
  if (!key_ok || i >= qlen || j >= kvlen || j < sdpa_band_first(i, off, p.window_left) ||
      j >= sdpa_band_last(i, off, p.window_right, kvlen))
    return SDPA_NEG_INF;
  if (p.has_segment_ids != 0 &&
      sdpa_seg(q_seg, b, p.len_q, i) != sdpa_seg(kv_seg, b, p.len_kv, j))
    return SDPA_NEG_INF;
  float x = sdpa_score2<CAP>(dot, p, t);
  if (p.mask_kind != SDPA_MASK_NONE) {
    const float m = sdpa_mask2(mask, p, b, h, i, j);
    if (m == SDPA_NEG_INF) return SDPA_NEG_INF;
    x += m;
  }
  return x;
}

// ---- K/V rows (contiguous or paged) -----------------------------------------------------------

// Element offset of key j's row in batch row b, relative to the kv head's base
// (k + hk * stride[1]); s0, s2 are the (batch or page, position or slot) strides. -1 for a key
// on a page outside [0, num_pages): such a key is invisible and never read.
METAL_FUNC long sdpa_kv_row(device const int* page_indices, constant SdpaMetalParams& p, int b,
                            int j, long s0, long s2) {
  if (p.paged == 0) return long(b) * s0 + long(j) * s2;
  const int page = page_indices[long(b) * p.pages_per_seq + j / p.page_size];
  if (page < 0 || page >= p.num_pages) return -1;
  return long(page) * s0 + long(j % p.page_size) * s2;
}

// Segment-id ranges: [min, max] of the ids of `n` consecutive positions from `first` (lanes
// 0..n-1 read one each; n <= 32), over the simdgroup. Blocks whose ranges don't overlap can't
// see each other (exact for sorted packing, conservative otherwise). Call uniformly.
struct SdpaSegRange {
  int lo, hi;
};
METAL_FUNC SdpaSegRange sdpa_seg_range(device const int* ids, int b, int len, int first, int n,
                                       uint lane) {
  const bool ok = int(lane) < n;
  const int id = ok ? sdpa_seg(ids, b, len, first + int(lane)) : 0;
  return {simd_min(ok ? id : 0x7fffffff), simd_max(ok ? id : -0x7fffffff - 1)};
}
METAL_FUNC bool sdpa_seg_meet(SdpaSegRange a, SdpaSegRange b) {
  return a.lo <= b.hi && b.lo <= a.hi;
}

// exp2(x - m) that is 0 (not NaN) when x or m is -inf, and NaN when x is: a NaN score
// makes its row NaN whatever max() does with NaN (MSL's keeps the first argument).
METAL_FUNC float sdpa_exp2_safe(float x, float m) {
  if (isnan(x)) return x;
  return (x == SDPA_NEG_INF || m == SDPA_NEG_INF) ? 0.0f : exp2(x - m);
}

// The backward's P = exp2(x - lse2) from the forward's natural-log lse (lse2 = lse * log2(e)).
// That round trip and the recomputed score each round by an ulp or so, which near 1e30 is
// enough to overflow exp2 or to lose the row's maximum: within 4 ulps of lse2 (2^-22 of it,
// a P error below 3e-6 at |lse| ~ 10) x is taken as the maximum, and P never exceeds 1.
METAL_FUNC float sdpa_exp2_prob(float x, float lse2) {
  if (isnan(x)) return x;
  if (x == SDPA_NEG_INF || lse2 == SDPA_NEG_INF) return 0.0f;
  const float d = x - lse2;
  return exp2(d > -fabs(lse2) * 0x1p-22f ? 0.0f : d);  // a NaN d (NaN lse2) stays NaN
}

// A row is live (gives its values, its lse, and NaN when a score was) unless its softmax sum
// is exactly 0: nothing visible. `l > 0` would take a NaN row for an empty one.
METAL_FUNC bool sdpa_row_live(float l) { return l != 0.0f; }

// ---- 8x8 fragments ----------------------------------------------------------------------------
// Lane l holds row (q & 4) + ((l / 2) % 4) and columns (q & 2) * 2 + (l % 2) * 2 + {0, 1},
// q = l / 4 (Metal's simdgroup_matrix layout). Loading per lane lets edge tiles read zeros
// instead of out-of-bounds memory.
METAL_FUNC int sdpa_frag_row(uint lane) {
  const uint q = lane / 4;
  return int((q & 4) + ((lane / 2) % 4));
}
METAL_FUNC int sdpa_frag_col(uint lane) {
  const uint q = lane / 4;
  return int((q & 2) * 2 + (lane % 2) * 2);
}

// m[r][c] = base[(row0 + r) * stride + col0 + c], 0 for rows >= nrows.
template <typename T>
METAL_FUNC void sdpa_load(thread simdgroup_float8x8& m, device const T* base, long stride,
                          int row0, int nrows, int col0, uint lane) {
  const int r = row0 + sdpa_frag_row(lane), c = col0 + sdpa_frag_col(lane);
  const bool ok = r < nrows;
  device const T* src = base + (ok ? long(r) * stride + c : 0);
  m.thread_elements()[0] = ok ? float(src[0]) : 0.0f;
  m.thread_elements()[1] = ok ? float(src[1]) : 0.0f;
}

// Transposed: m[r][c] = base[(row0 + c) * stride + col0 + r], 0 for rows row0 + c >= nrows.
template <typename T>
METAL_FUNC void sdpa_load_t(thread simdgroup_float8x8& m, device const T* base, long stride,
                            int row0, int nrows, int col0, uint lane) {
  const int r = col0 + sdpa_frag_row(lane), c = row0 + sdpa_frag_col(lane);
  for (int e = 0; e < 2; ++e) {
    const bool ok = c + e < nrows;
    m.thread_elements()[e] = ok ? float(base[long(c + e) * stride + r]) : 0.0f;
  }
}

// K/V fragments by row offset (sdpa_kv_row; -1 or a key past the range reads zeros):
// m[r][c] = base[off + col0 + c] for this lane's row r, `off` its row's offset.
template <typename T>
METAL_FUNC void sdpa_load_kv(thread simdgroup_float8x8& m, device const T* base, long off,
                             int col0, uint lane) {
  device const T* src = base + (off >= 0 ? off + col0 + sdpa_frag_col(lane) : 0);
  m.thread_elements()[0] = off >= 0 ? float(src[0]) : 0.0f;
  m.thread_elements()[1] = off >= 0 ? float(src[1]) : 0.0f;
}
// Transposed: m[r][c] = base[off_c + col0 + r], off[e] the offset of this lane's column e.
template <typename T>
METAL_FUNC void sdpa_load_kv_t(thread simdgroup_float8x8& m, device const T* base,
                               const thread long* off, int col0, uint lane) {
  const int r = col0 + sdpa_frag_row(lane);
  for (int e = 0; e < 2; ++e)
    m.thread_elements()[e] = off[e] >= 0 ? float(base[off[e] + r]) : 0.0f;
}

// base[(row0 + r) * stride + col0 + c] = scale * m[r][c] for rows < nrows.
template <typename T>
METAL_FUNC void sdpa_store(thread simdgroup_float8x8& m, device T* base, long stride,
                           int row0, int nrows, int col0, float scale, uint lane) {
  const int r = row0 + sdpa_frag_row(lane), c = col0 + sdpa_frag_col(lane);
  if (r < nrows) {
    device T* dst = base + long(r) * stride + c;
    dst[0] = T(m.thread_elements()[0] * scale);
    dst[1] = T(m.thread_elements()[1] * scale);
  }
}

// The lane holding fragment element (r, c) (c even: it also holds (r, c + 1)), the inverse
// of sdpa_frag_row / sdpa_frag_col.
METAL_FUNC ushort sdpa_frag_lane(int r, int c) {
  return ushort(((r >> 2) & 1) << 4 | ((c >> 2) & 1) << 3 | (r & 3) << 1 | ((c >> 1) & 1));
}

// acc += a * b where a zero entry of a (an invisible pair: P or dS selected to 0) contributes
// nothing even when the b entry it meets is NaN or inf (0 * NaN is NaN): the product runs on b
// with its non-finite entries zeroed, and only when some lane holds one (rare; the test is one
// simd_any) those entries are added back, each times its nonzero a entries. So values, keys or
// queries that a row cannot see never reach its result, as the contract asks.
METAL_FUNC void sdpa_mma_select(thread simdgroup_float8x8& acc, thread simdgroup_float8x8& a,
                                thread simdgroup_float8x8& b, uint lane) {
  const float b0 = b.thread_elements()[0], b1 = b.thread_elements()[1];
  if (!simd_any(!isfinite(b0) || !isfinite(b1))) {
    simdgroup_multiply_accumulate(acc, a, b, acc);
    return;
  }
  simdgroup_float8x8 bf;
  bf.thread_elements()[0] = isfinite(b0) ? b0 : 0.0f;
  bf.thread_elements()[1] = isfinite(b1) ? b1 : 0.0f;
  simdgroup_multiply_accumulate(acc, a, bf, acc);
  const int r = sdpa_frag_row(lane), c = sdpa_frag_col(lane);
  for (int kk = 0; kk < 8; ++kk) {
    const float a_rk = simd_shuffle(a.thread_elements()[kk & 1], sdpa_frag_lane(r, kk));
    for (int e = 0; e < 2; ++e) {
      const float b_kc = simd_shuffle(b.thread_elements()[e], sdpa_frag_lane(kk, c));
      if (a_rk != 0.0f && !isfinite(b_kc)) acc.thread_elements()[e] += a_rk * b_kc;
    }
  }
}

// Reductions over the 8 columns of a fragment row: the row's 4 lanes are l, l^1, l^8, l^9.
METAL_FUNC float sdpa_row_max(float x) {
  x = max(x, simd_shuffle_xor(x, ushort(1)));
  return max(x, simd_shuffle_xor(x, ushort(8)));
}
METAL_FUNC float sdpa_row_sum(float x) {
  x += simd_shuffle_xor(x, ushort(1));
  return x + simd_shuffle_xor(x, ushort(8));
}

#endif  // JAX_SDPA_METAL_COMMON
