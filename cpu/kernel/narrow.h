// The narrow kernels of decode-shaped tiles (at most kNarrow rows).
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- narrow tiles (decode) ---------------------------------------------------------
// A tile of at most kNarrow rows (decode: the heads of one GQA group) wastes most of the
// transposed micro-kernel's vector lanes and is bound by its broadcast loads. Here K and V
// rows are loaded as vectors instead: scores are dot products (W of them reduced at once by
// transpose_sum), O rows accumulate V rows scaled by broadcast probabilities. Rows are
// padded to a power of two NP2 <= W; keys go KJ = W / NP2 at a time.

// lanes x of a, b: (x & h) ? a[x] + a[x + h] ... folded so the result holds a's pair sums
// where bit h of the lane is clear and b's where it is set.
template <int H>
__attribute__((always_inline)) inline vf fold(vf a, vf b) {
#if defined(__clang__)
  // clang has no two-source __builtin_shuffle with a mask vector: the same lanes, one by one
  // (GCC builds, the release ones, take the shuffle below)
  vf r;
  for (int x = 0; x < W; ++x) {
    const int lo = (x & H) ? W + x - H : x, hi = (x & H) ? W + x : x + H;
    r[x] = (lo < W ? a[lo] : b[lo - W]) + (hi < W ? a[hi] : b[hi - W]);
  }
  return r;
#else
  vi lo, hi;
  for (int x = 0; x < W; ++x) {
    lo[x] = (x & H) ? W + x - H : x;
    hi[x] = (x & H) ? W + x : x + H;
  }
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
#endif
}
template <int H>
__attribute__((always_inline)) inline void fold_level(vf* v, int n) {
  for (int i = 0; i < n / 2; ++i) v[i] = fold<H>(v[2 * i], v[2 * i + 1]);
}
constexpr int bitrev(int x) {
  int r = 0;
  for (int b = 1; b < W; b <<= 1) r = r * 2 + ((x & b) ? 1 : 0);
  return r;
}
// Lane x of the result is the sum of the lanes of v[x], x < W (v is overwritten). Always
// inlined: a call would keep the callers' accumulators in memory, stored every step.
__attribute__((always_inline)) inline vf transpose_sum(vf* v) {
  vf s[W];
#pragma GCC unroll 16
  for (int x = 0; x < W; ++x) s[x] = v[bitrev(x)];
  if constexpr (W >= 16) fold_level<8>(s, 16);
  if constexpr (W >= 8) fold_level<4>(s, 8);
  fold_level<2>(s, 4);
  fold_level<1>(s, 2);
  return s[0];
}

// Lane x of the result: v's lane x ^ H.
template <int H>
__attribute__((always_inline)) inline vf xor_lanes(vf v) {
#if defined(__clang__)
  vf r;
  for (int x = 0; x < W; ++x) r[x] = v[x ^ H];
  return r;
#else
  vi idx;
  for (int x = 0; x < W; ++x) idx[x] = x ^ H;
  return __builtin_shuffle(v, idx);
#endif
}
// Lane x of the result: the max (Max) or the sum of v's lanes congruent to x mod ns, a power
// of two <= W.
template <bool Max>
__attribute__((always_inline)) inline vf reduce_lane_groups(vf v, int ns) {
  auto step = [](vf a, vf b) { return Max ? vmax(a, b) : a + b; };
  if constexpr (W > 1) if (ns <= 1) v = step(v, xor_lanes<1>(v));
  if constexpr (W > 2) if (ns <= 2) v = step(v, xor_lanes<2>(v));
  if constexpr (W > 4) if (ns <= 4) v = step(v, xor_lanes<4>(v));
  if constexpr (W > 8) if (ns <= 8) v = step(v, xor_lanes<8>(v));
  return v;
}

// A narrow tile's scores are dense, St[j][c] for c < ns = np2 (W / ns keys a vector), so the
// softmax's exp runs on live lanes only: on the tile-wide layout it ran one vector a key for
// the 4 rows of a GQA-4 group, a quarter of bf16 decode's time.
// Keys from jn up to a whole pair of vectors (narrow_dense_end) are set to -inf here, so that
// their P is 0 (the bf16 values pass reads keys in pairs).
inline int64_t narrow_dense_end(int64_t jn, int ns) { return round_up(jn * ns, 2 * W); }

// The online softmax step of a narrow tile: St = P = exp(S - new max), and the ns rows' max m,
// sum l and the rescale alpha of their O.
void narrow_softmax(float* St, int64_t jn, int ns, float* m, float* l, float* alpha) {
  const int64_t end = narrow_dense_end(jn, ns);
  for (int64_t x = jn * ns; x < end; ++x) St[x] = -INFINITY;
  vf mx0 = splat(-INFINITY), mx1 = splat(-INFINITY);  // two chains: max has a latency
  for (int64_t x = 0; x < end; x += 2 * W) {
    mx0 = vmax(mx0, loadv(St + x));
    mx1 = vmax(mx1, loadv(St + x + W));
  }
  const vf mx = reduce_lane_groups<true>(vmax(mx0, mx1), ns);
  float lanes[W];
  for (int x = 0; x < W; ++x) lanes[x] = m[x % ns];
  const vf mo = loadv(lanes);
  const vf mn = vmax(mo, mx);
  const vf mu = select(mn == splat(-INFINITY), splat(0.0f), mn);  // nothing yet: no shift
  const vf al = vexp_diff(mo, mu);
  vf s0 = vf{}, s1 = vf{};
  for (int64_t x = 0; x < end; x += 2 * W) {
    const vf e0 = vexp_diff(loadv(St + x), mu), e1 = vexp_diff(loadv(St + x + W), mu);
    storev(St + x, e0);
    storev(St + x + W, e1);
    s0 += e0;
    s1 += e1;
  }
  const vf sum = reduce_lane_groups<false>(s0 + s1, ns);
  float mns[W], als[W], sums[W];
  storev(mns, mn);
  storev(als, al);
  storev(sums, sum);
  for (int c = 0; c < ns; ++c) {
    l[c] = l[c] * als[c] + sums[c];
    m[c] = mns[c];
    alpha[c] = als[c];
  }
}

// St[j][c] = K row j · Q row c for j < jn, c < NP2 (columns NP2.. of St are left alone);
// kr[j] null: a hidden key, its row is 0 here.
// Software prefetch for decode, which reads every K and V row once: K rows kAheadRows ahead
// of the scores' loads, past the block's end into the next block's rows, and the next
// block's V rows into L2 as the same rows of this block are scored (next: kBk pointers each,
// null for none or hidden). The scores read KJ rows interleaved, which the hardware
// prefetcher does not follow from memory (half the bandwidth without this); V a block ahead
// rather than this block's own (fetched only a scores pass before the values pass read them):
// B8 H32/KV8 D128 Lk4096 bf16 5.40 -> 5.14 ms, B1 Lk32768 f32 9.0-10.3 -> 8.2-9.9 ms (kernel
// harness, two threads; float32 V is not prefetched now: kPrefetchFloat32V).
struct NextRows {
  const char* const* k;
  int64_t kbytes;
  const char* const* v;  // null: no V prefetch (float32 rows, or rows converted into scratch)
  int64_t vbytes;
};
__attribute__((always_inline)) inline void prefetch_row(const void* row, int64_t bytes,
                                                     bool to_l1) {
  const char* r = static_cast<const char*>(row);
  if (to_l1)
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(r + x, 0, 3);
  else
    for (int64_t x = 0; x < bytes; x += 64) __builtin_prefetch(r + x, 0, 2);
}

// The prefetches of the scores' group of KJ keys from j0: the K rows kAheadRows ahead (of
// kbytes each; past the block's end, the next block's rows) and the next block's V rows of
// the group's indices. Always inlined: GCC takes a call whose only effects are prefetches for
// a call without effects and drops it.
template <int KJ>
__attribute__((always_inline)) inline void prefetch_ahead(const void* const* kr, int64_t jn,
                                                         int64_t j0, int64_t kbytes,
                                                         const NextRows& nx) {
  // The next block's rows start at jn: never further ahead than the block (its rows are
  // what NextRows holds).
  const int64_t ahead = min64(kAheadRows, jn);
  for (int64_t i = j0 + ahead; i < j0 + ahead + KJ; ++i) {
    if (i < jn) {
      if (kr[i]) prefetch_row(kr[i], kbytes, false);
    } else if (i - jn < kBk && nx.k[i - jn]) {
      prefetch_row(nx.k[i - jn], nx.kbytes, false);
    }
  }
  if (nx.v)
    for (int64_t u = j0; u < min64(kBk, j0 + KJ); ++u)
      if (nx.v[u]) prefetch_row(nx.v[u], nx.vbytes, false);
}

// T: the rows' element type (float, or uint16_t for bfloat16 bits read in place).
template <int NP2, typename T>
void narrow_scores(int64_t D, const void* const* kr, int64_t jn, const float* Qr, int64_t Dp,
                   const float* zero_row, float* St, int64_t np, const NextRows& nx) {
  constexpr int KJ = W / NP2;
  const T* zero = reinterpret_cast<const T*>(zero_row);  // all-zero bits: 0 in either type
  for (int64_t j0 = 0; j0 < jn; j0 += KJ) {
    const T* rows[KJ];
#pragma GCC unroll 16
    for (int u = 0; u < KJ; ++u)
      rows[u] = (j0 + u < jn && kr[j0 + u]) ? static_cast<const T*>(kr[j0 + u]) : zero;
    prefetch_ahead<KJ>(kr, jn, j0, D * (int64_t)sizeof(T), nx);
    vf acc[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) acc[s] = vf{};
    for (int64_t d = 0; d < D; d += W) {
      vf kv[KJ];
#pragma GCC unroll 16
      for (int u = 0; u < KJ; ++u) kv[u] = load_elems(rows[u] + d);
#pragma GCC unroll 8
      for (int c = 0; c < NP2; ++c) {
        const vf qv = loadv(Qr + c * Dp + d);
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) acc[u * NP2 + c] += kv[u] * qv;
      }
    }
    // transpose_sum overwrites its array: a copy, so that acc stays in registers in the loop
    // (handing acc itself kept it in memory, stored every step).
    vf sums[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) sums[s] = acc[s];
    float lanes[W];
    storev(lanes, transpose_sum(sums));
    for (int u = 0; u < KJ && j0 + u < jn; ++u)
      memcpy(St + (j0 + u) * np, lanes + u * NP2, NP2 * sizeof(float));
  }
}

// Or[c][d0 .. d0 + DVC*W) = alpha[c] * Or[c][..] + sum_j P[j][c] * V row j, c0 <= c < c0 + RP.
template <int RP, int DVC, typename T>
void narrow_values(int64_t c0, int64_t d0, const void* const* vr, int64_t jn, const float* P,
                   int64_t np, const float* alpha, float* Or, int64_t ldo) {
  vf acc[RP][DVC];
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u)
      acc[c][u] = loadv(Or + (c0 + c) * ldo + d0 + u * W) * splat(alpha[c0 + c]);
  for (int64_t j = 0; j < jn; ++j) {
    if (!vr[j]) continue;  // hidden: P = 0 and never read
    vf vv[DVC];
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u) vv[u] = load_elems(static_cast<const T*>(vr[j]) + d0 + u * W);
#pragma GCC unroll 8
    for (int c = 0; c < RP; ++c) {
      const vf pc = splat(P[j * np + c0 + c]);
#pragma GCC unroll 16
      for (int u = 0; u < DVC; ++u) acc[c][u] += pc * vv[u];
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 16
    for (int u = 0; u < DVC; ++u) storev(Or + (c0 + c) * ldo + d0 + u * W, acc[c][u]);
}

// Rows a pass takes: as many of np2 as kValueAccs / DVC accumulators allow (at least 1).
constexpr int rows_per_pass(int np2, int dvc) {
  return np2 * dvc <= kValueAccs ? np2 : (kValueAccs / dvc < 1 ? 1 : kValueAccs / dvc);
}

// Columns d0 .. d0 + DVC*W of every row c < NP2, rows_per_pass of them a pass.
template <int NP2, int DVC, typename T>
void narrow_values_rows(int64_t d0, const void* const* vr, int64_t jn, const float* P,
                        int64_t np, const float* alpha, float* Or, int64_t ldo) {
  constexpr int RP = rows_per_pass(NP2, DVC);
  for (int64_t c0 = 0; c0 < NP2; c0 += RP)
    narrow_values<RP, DVC, T>(c0, d0, vr, jn, P, np, alpha, Or, ldo);
}

// O rows += P . V, in column chunks of up to kValueAccs vectors. Each pass reads its chunk
// of every V row in key order, so at D <= kValueAccs * W whole rows in order: passes over
// the block's rows a few vectors each defeat the hardware prefetcher when V comes from
// memory (decode), about 2.7x slower reads. bfloat16 rows widened in registers take chunks
// of kValueAccs / NP2 vectors instead, every row a pass (kWidenedValuesAllRows).
template <int NP2, typename T>
void narrow_values_all(int64_t Dv, const void* const* vr, int64_t jn, const float* P,
                       int64_t np, const float* alpha, float* Or, int64_t ldo) {
  constexpr int kChunk =
      kWidenedValuesAllRows && sizeof(T) == 2 ? kValueAccs / NP2 : kValueAccs;
  int64_t d0 = 0;
  for (; d0 + kChunk * W <= Dv; d0 += kChunk * W)
    narrow_values_rows<NP2, kChunk, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  if constexpr (kChunk > 8)
    for (; d0 + 8 * W <= Dv; d0 += 8 * W)
      narrow_values_rows<NP2, 8, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  if constexpr (kChunk > 4)
    for (; d0 + 4 * W <= Dv; d0 += 4 * W)
      narrow_values_rows<NP2, 4, T>(d0, vr, jn, P, np, alpha, Or, ldo);
  for (; d0 < Dv; d0 += W) narrow_values_rows<NP2, 1, T>(d0, vr, jn, P, np, alpha, Or, ldo);
}

int np2_for(int64_t n) { return n <= 1 ? 1 : n <= 2 ? 2 : n <= 4 ? 4 : 8; }

template <typename T>
void narrow_scores_np2(int np2, int64_t D, const void* const* kr, int64_t jn, const float* Qr,
                       int64_t Dp, const float* zero_row, float* St, int64_t np,
                       const NextRows& nx) {
  switch (np2) {
    case 1: return narrow_scores<1, T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx);
    case 2: return narrow_scores<2, T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx);
    case 4: return narrow_scores<(W >= 4 ? 4 : 1), T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx);
    default: return narrow_scores<(W >= 8 ? 8 : 1), T>(D, kr, jn, Qr, Dp, zero_row, St, np, nx);
  }
}
// bf16: the rows are bfloat16 bits read in place, else float32.
void narrow_scores_any(bool bf16, int np2, int64_t D, const void* const* kr, int64_t jn,
                       const float* Qr, int64_t Dp, const float* zero_row, float* St,
                       int64_t np, const NextRows& nx) {
  if (bf16) return narrow_scores_np2<uint16_t>(np2, D, kr, jn, Qr, Dp, zero_row, St, np, nx);
  narrow_scores_np2<float>(np2, D, kr, jn, Qr, Dp, zero_row, St, np, nx);
}
template <typename T>
void narrow_values_np2(int np2, int64_t Dv, const void* const* vr, int64_t jn, const float* P,
                       int64_t np, const float* alpha, float* Or, int64_t ldo) {
  switch (np2) {
    case 1: return narrow_values_all<1, T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    case 2: return narrow_values_all<2, T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    case 4: return narrow_values_all<(W >= 4 ? 4 : 1), T>(Dv, vr, jn, P, np, alpha, Or, ldo);
    default: return narrow_values_all<(W >= 8 ? 8 : 1), T>(Dv, vr, jn, P, np, alpha, Or, ldo);
  }
}
void narrow_values_any(bool bf16, int np2, int64_t Dv, const void* const* vr, int64_t jn,
                       const float* P, int64_t np, const float* alpha, float* Or, int64_t ldo) {
  if (bf16) return narrow_values_np2<uint16_t>(np2, Dv, vr, jn, P, np, alpha, Or, ldo);
  narrow_values_np2<float>(np2, Dv, vr, jn, P, np, alpha, Or, ldo);
}

constexpr int64_t kBf16Vec = 2 * W;  // bf16 elements in a vector

#if defined(__AVX512BF16__)
// bfloat16 narrow tiles on CPUs with AVX512-BF16: both products by VDPBF16PS, half the
// instructions of widening each element (the float32 FMAs of the widened rows left decode
// compute-bound at about half the read bandwidth). Scores pair K and Q along d: Qb holds the
// tile's query rows as bf16 pairs (exact: they are bf16 values), rows of ldq words
// zero-padded to a multiple of 32 elements. The values pass pairs keys: two V rows
// interleaved per 128-bit lane (a fixed column order, undone where O is loaded and stored)
// times their probabilities rounded to bf16, after the online softmax summed them unrounded.

template <int NP2>
void narrow_scores_bf16(int64_t D, const void* const* kr, int64_t jn, const uint32_t* Qb,
                        int64_t ldq, const float* zero_row, float* St, int64_t np,
                        const NextRows& nx) {
  constexpr int KJ = W / NP2;
  const uint16_t* zero = reinterpret_cast<const uint16_t*>(zero_row);
  const int64_t full = D / kBf16Vec * kBf16Vec;
  const __mmask32 half = (__mmask32)((1ull << (D - full)) - 1);  // a last partial vector
  for (int64_t j0 = 0; j0 < jn; j0 += KJ) {
    const uint16_t* rows[KJ];
#pragma GCC unroll 16
    for (int u = 0; u < KJ; ++u)
      rows[u] = (j0 + u < jn && kr[j0 + u]) ? static_cast<const uint16_t*>(kr[j0 + u]) : zero;
    prefetch_ahead<KJ>(kr, jn, j0, D * 2, nx);
    __m512 acc[W];
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) acc[s] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += kBf16Vec) {
      __m512bh kv[KJ];
      if (d < full) {
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) kv[u] = (__m512bh)_mm512_loadu_si512(rows[u] + d);
      } else {
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u) kv[u] = (__m512bh)_mm512_maskz_loadu_epi16(half, rows[u] + d);
      }
#pragma GCC unroll 8
      for (int c = 0; c < NP2; ++c) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(Qb + c * ldq + d / 2);
#pragma GCC unroll 16
        for (int u = 0; u < KJ; ++u)
          acc[u * NP2 + c] = _mm512_dpbf16_ps(acc[u * NP2 + c], kv[u], qv);
      }
    }
    vf sums[W];  // as in narrow_scores
#pragma GCC unroll 16
    for (int s = 0; s < W; ++s) sums[s] = (vf)acc[s];
    float lanes[W];
    storev(lanes, transpose_sum(sums));
    for (int u = 0; u < KJ && j0 + u < jn; ++u)
      memcpy(St + (j0 + u) * np, lanes + u * NP2, NP2 * sizeof(float));
  }
}

// Or[c][d0 .. d0 + DVC * kBf16Vec) = alpha[c] * Or[c][..] + sum_j P[j][c] * V row j for
// c0 <= c < c0 + RP, keys in pairs (Pp[q][c]: the bf16 pair of keys 2q, 2q + 1). Half: one
// chunk of W columns (the last of a Dv that is an odd multiple of W).
template <int RP, int DVC, bool Half>
void narrow_values_bf16(int64_t c0, int64_t d0, const void* const* vr, int64_t jn,
                        const uint32_t* Pp, int64_t np, const float* alpha, float* Or,
                        int64_t ldo, const uint16_t* zero) {
  // unpacklo / unpackhi of two rows hold columns 0-3, 8-11, 16-19, 24-27 / 4-7, 12-15, ...
  const __m512i to_lo = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i to_hi = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
  const __m512i from_lo_hi_0 =  // natural columns 0-15 from (lo, hi)
      _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i from_lo_hi_1 =  // natural columns 16-31
      _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __mmask32 cols = Half ? 0xFFFFu : 0xFFFFFFFFu;
  __m512 acc[RP][DVC][2];
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c) {
    const __m512 a = _mm512_set1_ps(alpha[c0 + c]);
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      const float* o = Or + (c0 + c) * ldo + d0 + u * kBf16Vec;
      const __m512 n0 = _mm512_loadu_ps(o);
      const __m512 n1 = Half ? _mm512_setzero_ps() : _mm512_loadu_ps(o + W);
      acc[c][u][0] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_lo, n1), a);
      acc[c][u][1] = _mm512_mul_ps(_mm512_permutex2var_ps(n0, to_hi, n1), a);
    }
  }
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const void* ra = vr[2 * q];
    const void* rb = 2 * q + 1 < jn ? vr[2 * q + 1] : nullptr;
    if (!ra && !rb) continue;  // hidden: P = 0 and never read
    const uint16_t* va = ra ? static_cast<const uint16_t*>(ra) : zero;
    const uint16_t* vb = rb ? static_cast<const uint16_t*>(rb) : zero;
    __m512bh pc[RP];
#pragma GCC unroll 8
    for (int c = 0; c < RP; ++c) pc[c] = (__m512bh)_mm512_set1_epi32((int)Pp[q * np + c0 + c]);
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      const __m512i a = _mm512_maskz_loadu_epi16(cols, va + d0 + u * kBf16Vec);
      const __m512i b = _mm512_maskz_loadu_epi16(cols, vb + d0 + u * kBf16Vec);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
#pragma GCC unroll 8
      for (int c = 0; c < RP; ++c) {
        acc[c][u][0] = _mm512_dpbf16_ps(acc[c][u][0], lo, pc[c]);
        acc[c][u][1] = _mm512_dpbf16_ps(acc[c][u][1], hi, pc[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < RP; ++c)
#pragma GCC unroll 8
    for (int u = 0; u < DVC; ++u) {
      float* o = Or + (c0 + c) * ldo + d0 + u * kBf16Vec;
      _mm512_storeu_ps(o, _mm512_permutex2var_ps(acc[c][u][0], from_lo_hi_0, acc[c][u][1]));
      if (!Half)
        _mm512_storeu_ps(o + W, _mm512_permutex2var_ps(acc[c][u][0], from_lo_hi_1, acc[c][u][1]));
    }
}

// Columns d0 .. of every row c < NP2 for DVC chunks, as many rows a pass as kValueAccs
// accumulators (two a chunk) allow.
template <int NP2, int DVC, bool Half>
void narrow_values_bf16_rows(int64_t d0, const void* const* vr, int64_t jn, const uint32_t* Pp,
                             int64_t np, const float* alpha, float* Or, int64_t ldo,
                             const uint16_t* zero) {
  constexpr int RP = rows_per_pass(NP2, 2 * DVC);
  for (int64_t c0 = 0; c0 < NP2; c0 += RP)
    narrow_values_bf16<RP, DVC, Half>(c0, d0, vr, jn, Pp, np, alpha, Or, ldo, zero);
}

// O rows += P . V, every row in each pass and as many chunks as kValueAccs accumulators
// allow (two a chunk and row): each V element is loaded and interleaved once. The passes
// read parts of each V row, which the previous block's scores pass prefetched into L2; taking
// fewer rows a pass over whole rows instead (the float32 kernel's order) re-interleaved
// every V row once per pass (B1 H32/KV8 D128 Lk2048, one thread from L3: 0.47 -> 0.42 ms).
template <int NP2>
void narrow_values_bf16_all(int64_t Dv, const void* const* vr, int64_t jn, const uint32_t* Pp,
                            int64_t np, const float* alpha, float* Or, int64_t ldo,
                            const uint16_t* zero) {
  constexpr int kChunks = kValueAccs / (2 * NP2) < 1 ? 1 : kValueAccs / (2 * NP2);
  int64_t d0 = 0;
  for (; d0 + kBf16Vec <= Dv;) {
    const int64_t n = min64(kChunks, (Dv - d0) / kBf16Vec);
    switch (n) {
#define JAX_SDPA_BF16_VALUES_CASE(k) \
  case k: narrow_values_bf16_rows<NP2, k, false>(d0, vr, jn, Pp, np, alpha, Or, ldo, zero); break;
      JAX_SDPA_BF16_VALUES_CASE(1) JAX_SDPA_BF16_VALUES_CASE(2) JAX_SDPA_BF16_VALUES_CASE(3)
      JAX_SDPA_BF16_VALUES_CASE(4) JAX_SDPA_BF16_VALUES_CASE(5) JAX_SDPA_BF16_VALUES_CASE(6)
      JAX_SDPA_BF16_VALUES_CASE(7) default: JAX_SDPA_BF16_VALUES_CASE(8)
#undef JAX_SDPA_BF16_VALUES_CASE
    }
    d0 += n * kBf16Vec;
  }
  if (d0 < Dv) narrow_values_bf16_rows<NP2, 1, true>(d0, vr, jn, Pp, np, alpha, Or, ldo, zero);
}

void narrow_scores_bf16_np2(int np2, int64_t D, const void* const* kr, int64_t jn,
                            const uint32_t* Qb, int64_t ldq, const float* zero_row, float* St,
                            int64_t np, const NextRows& nx) {
  switch (np2) {
    case 1: return narrow_scores_bf16<1>(D, kr, jn, Qb, ldq, zero_row, St, np, nx);
    case 2: return narrow_scores_bf16<2>(D, kr, jn, Qb, ldq, zero_row, St, np, nx);
    case 4: return narrow_scores_bf16<4>(D, kr, jn, Qb, ldq, zero_row, St, np, nx);
    default: return narrow_scores_bf16<8>(D, kr, jn, Qb, ldq, zero_row, St, np, nx);
  }
}
void narrow_values_bf16_np2(int np2, int64_t Dv, const void* const* vr, int64_t jn,
                            const uint32_t* Pp, int64_t np, const float* alpha, float* Or,
                            int64_t ldo, const uint16_t* zero) {
  switch (np2) {
    case 1: return narrow_values_bf16_all<1>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    case 2: return narrow_values_bf16_all<2>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    case 4: return narrow_values_bf16_all<4>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
    default: return narrow_values_bf16_all<8>(Dv, vr, jn, Pp, np, alpha, Or, ldo, zero);
  }
}

// Pp[q][c] = the bf16 pair (P[2q][c], P[2q + 1][c]) of dense P [keys][ns], rounded to
// nearest even, up to narrow_dense_end (past jn, narrow_softmax left P = 0).
void pack_p_pairs_dense(const float* P, int64_t jn, int ns, uint32_t* Pp) {
  alignas(64) int16_t words[2 * W];  // word 2k / 2k + 1 of the output: keys 2q / 2q + 1, row c
  for (int k = 0; k < W; ++k) {
    const int q = k / ns, c = k % ns;
    words[2 * k] = (int16_t)(2 * q * ns + c);
    words[2 * k + 1] = (int16_t)((2 * q + 1) * ns + c);
  }
  const __m512i lanes = _mm512_load_si512(words);
  const int64_t end = narrow_dense_end(jn, ns);
  for (int64_t x = 0; x < end; x += 2 * W) {
    const __m512i ab =  // P[x .. x + W) in words 0..15, the next W above
        (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(P + x + W), _mm512_loadu_ps(P + x));
    _mm512_storeu_si512(Pp + x / 2, _mm512_permutexvar_epi16(lanes, ab));
  }
}

// Qb[c][w] = the bf16 pair (Qr[c][2w], Qr[c][2w + 1]) of the float32 rows Qr [np2][D] that
// hold bf16 values (truncation is exact), rows of ldq words zero-padded.
void pack_q_rows_bf16(const float* Qr, int64_t D, int np2, uint32_t* Qb, int64_t ldq) {
  for (int c = 0; c < np2; ++c)
    for (int64_t w = 0; w < ldq; ++w) {
      const uint32_t lo = 2 * w < D ? f32_to_bits(Qr[c * D + 2 * w]) >> 16 : 0u;
      const uint32_t hi = 2 * w + 1 < D ? f32_to_bits(Qr[c * D + 2 * w + 1]) >> 16 : 0u;
      Qb[c * ldq + w] = lo | hi << 16;
    }
}
#endif  // __AVX512BF16__
// Words of a bf16 pair row of the narrow bf16 products (D rounded up to whole vectors).
inline int64_t narrow_pair_words(int64_t D) { return round_up(D, kBf16Vec) / 2; }

// 16-bit K and V rows of a block's runs converted to float32 rows j of Kf / Vf (zeros
// for hidden runs: never read).
void load_block_rows(const SdpaParams& p, const SdpaFwdBuffers& buf, const KeyRun* runs,
                     int64_t nruns, float* Kf, float* Vf) {
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  for (int64_t r = 0; r < nruns; ++r)
    for (int64_t j = 0; j < runs[r].n; ++j) {
      float* kd = Kf + (runs[r].j + j) * D;
      float* vd = Vf + (runs[r].j + j) * Dv;
      if (runs[r].k < 0) {
        memset(kd, 0, D * sizeof(float));
        memset(vd, 0, Dv * sizeof(float));
      } else {
        load_row(buf.k, p.dtype, runs[r].k + j * p.k_stride[2], D, kd);
        load_row(buf.v, p.dtype, runs[r].v + j * p.v_stride[2], Dv, vd);
      }
    }
}
