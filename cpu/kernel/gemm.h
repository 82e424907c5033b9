// The register-blocked micro-kernel and its GEMM; the bfloat16 products (AVX512-BF16).
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- the micro-kernel ---------------------------------------------------------
// C[r][x] (+)= sum_k A[r * rs + k * ks] * B[k * ldb + x], r < M_, x < N_ * W.
template <int M_, int N_>
void micro(int64_t K, const float* __restrict A, int64_t rs, int64_t ks,
           const float* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
           bool accumulate) {
  vf acc[M_][N_];
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) acc[r][x] = accumulate ? loadv(C + r * ldc + x * W) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[N_];
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) b[x] = loadv(B + k * ldb + x * W);
    const float* a = A + k * ks;
#pragma GCC unroll 8
    for (int r = 0; r < M_; ++r) {
      vf av = splat(a[r * rs]);
#pragma GCC unroll 8
      for (int x = 0; x < N_; ++x) acc[r][x] += av * b[x];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) storev(C + r * ldc + x * W, acc[r][x]);
}

using MicroFn = void (*)(int64_t, const float*, int64_t, int64_t, const float*, int64_t, float*,
                         int64_t, bool);
constexpr int nr_clamp(int x) { return x < NR ? x : NR; }
#define JAX_SDPA_MICRO_ROW(m) \
  {micro<m, nr_clamp(1)>, micro<m, nr_clamp(2)>, micro<m, nr_clamp(3)>, micro<m, nr_clamp(4)>}
static_assert(MR == 6 && NR <= 4, "micro-kernel table below is written for MR = 6, NR <= 4");
const MicroFn kMicro[6][4] = {JAX_SDPA_MICRO_ROW(1), JAX_SDPA_MICRO_ROW(2), JAX_SDPA_MICRO_ROW(3),
                              JAX_SDPA_MICRO_ROW(4), JAX_SDPA_MICRO_ROW(5), JAX_SDPA_MICRO_ROW(6)};
#undef JAX_SDPA_MICRO_ROW

// C[M x N] (+)= A[M x K] · B[K x N]; N a multiple of W. A by broadcast with
// strides (rs, ks); B and C row-major with leading dims ldb, ldc.
void gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rs, int64_t ks, const float* B,
          int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += NR * W) {
    int nv = (int)min64((N - n0) / W, NR);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      int mr = (int)min64(M - m0, MR);
      kMicro[mr - 1][nv - 1](K, A + m0 * rs, rs, ks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                             accumulate);
    }
  }
}

// ---- bfloat16 products (AVX512-BF16) ---------------------------------------------
// VDPBF16PS adds the two products of a pair of bfloat16s to each float32 lane, exactly
// rounded products (bf16 * bf16 fits a float32), so a bf16 GEMM takes half the instructions
// of the float32 one and needs no conversion of K and V to float32. The bfloat16 forward's
// two products run here: S^T = K · Q^T with pairs along d (K rows as they are in memory,
// Q^T packed [D/2][np] pairs), and O^T += V^T · P^T with pairs along keys (V packed
// [keys/2][Dv] pairs, P rounded to bf16 [keys/2][np] pairs; the softmax sums use P unrounded,
// as GPU flash kernels do). The backward's S^T and dP^T = V · dO^T (pairs along d, products of
// inputs) run here too; its dV, dK, dQ would need P and dS rounded and stay float32. The
// instruction treats bf16 subnormals as 0.
#if defined(__AVX512BF16__)
// Whether this call's forward products take the bf16 GEMM (non-narrow tiles).
inline bool bf16_products(const SdpaParams& p) { return p.dtype == DType::kBF16; }

// C[r][x] (+)= sum_k dot2(A[r * rs + k * ks], B[k * ldb + x]), r < M_, x < N_ * W: A and B
// hold pairs of bf16 as 32-bit words.
template <int M_, int N_>
void micro_bf16(int64_t K2, const uint32_t* __restrict A, int64_t rs, int64_t ks,
                const uint32_t* __restrict B, int64_t ldb, float* __restrict C, int64_t ldc,
                bool accumulate) {
  __m512 acc[M_][N_];
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x)
      acc[r][x] = accumulate ? _mm512_loadu_ps(C + r * ldc + x * W) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh b[N_];
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) b[x] = (__m512bh)_mm512_loadu_si512(B + k * ldb + x * W);
    const uint32_t* a = A + k * ks;
#pragma GCC unroll 8
    for (int r = 0; r < M_; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[r * rs]);
#pragma GCC unroll 8
      for (int x = 0; x < N_; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], av, b[x]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < M_; ++r)
#pragma GCC unroll 8
    for (int x = 0; x < N_; ++x) _mm512_storeu_ps(C + r * ldc + x * W, acc[r][x]);
}

using MicroBf16Fn = void (*)(int64_t, const uint32_t*, int64_t, int64_t, const uint32_t*,
                             int64_t, float*, int64_t, bool);
#define JAX_SDPA_MICRO_ROW(m)                                                 \
  {micro_bf16<m, nr_clamp(1)>, micro_bf16<m, nr_clamp(2)>, micro_bf16<m, nr_clamp(3)>, \
   micro_bf16<m, nr_clamp(4)>}
const MicroBf16Fn kMicroBf16[6][4] = {JAX_SDPA_MICRO_ROW(1), JAX_SDPA_MICRO_ROW(2),
                                      JAX_SDPA_MICRO_ROW(3), JAX_SDPA_MICRO_ROW(4),
                                      JAX_SDPA_MICRO_ROW(5), JAX_SDPA_MICRO_ROW(6)};
#undef JAX_SDPA_MICRO_ROW

// ---- AMX tiles ------------------------------------------------------------------
// TDPBF16PS adds a 16-row x 32-bf16 tile of A times a 16-pair-row x 16-column tile of B (B's
// layout here: row k holds the pairs of rows 2k, 2k + 1) into a 16 x 16 float32 tile, the
// work of 32 VDPBF16PS. gemm_bf16 runs on them where the CPU and OS allow it
// (amx_bf16_enabled) and A is contiguous along its pairs in whole tiles (ks = 1, K2 a
// multiple of 16): S^T = K · Q^T of the forward and the backward's S^T and dP^T. Callers
// that pack their operands for the tiles call gemm_bf16_amx directly: the forward's
// O^T += V^T · P^T from the call's packed V^T, the backward's dV, dK and dQ^T.
struct alignas(64) AmxTileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles have no renaming: a load into a tile waits for every product still reading it. So
// each loaded tile feeds two products, and no load reuses a tile a product of the same step
// reads. The 2 x 2 block: C tiles 0, 1 = rows [0, 16) x columns [0, 16), [16, 32); C tiles
// 2, 3 = rows [16, 16 + rb) x the same; A rows in tiles 4 (first 16) and 5, B columns in
// tiles 6, 7. The 1 x NT block (NT <= 2; the last rows or columns): C tiles 0 .. NT - 1 for
// rows [0, mr), A in tile 4, B in tiles 6, 7.
__attribute__((target("amx-tile,amx-bf16"))) void amx_configure(int ra, int rb) {
  AmxTileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)ra;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(rb > 0 ? rb : 1);
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

// C[r][16t + x] (+)= the pairs' products over K2 of A's row r and B's columns (16 pairs of
// k from A + k, b), for the configured blocks: RB (2 x 2) or the 1 x NT block.
template <bool RB, int NT>
__attribute__((target("amx-tile,amx-bf16"))) void amx_step(const uint32_t* A, int64_t lda,
                                                           int64_t sa, const uint32_t* b,
                                                           int64_t sb) {
  _tile_loadd(4, A, sa);
  _tile_loadd(6, b, sb);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (NT > 1) {
    _tile_loadd(7, b + 16, sb);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (RB) {
    _tile_loadd(5, A + 16 * lda, sa);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// One block (see amx_configure) over K2 pairs. Bt (if not null): B's last K2 % 16 pair rows,
// zero-padded to 16, row stride ldbt; A's rows are then readable (and zero) up to K2 rounded
// up to 16.
template <bool RB, int NT>
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(int64_t K2, const uint32_t* A,
                                                            int64_t lda, const uint32_t* B,
                                                            int64_t ldb, const uint32_t* Bt,
                                                            int64_t ldbt, float* C, int64_t ldc,
                                                            bool accumulate) {
  static_assert(!RB || NT == 2, "the 2 x 2 block has two columns of tiles");
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;  // row strides in bytes
  float* C2 = C + 16 * ldc;
  if (accumulate) {
    _tile_loadd(0, C, sc);
    if constexpr (NT > 1) _tile_loadd(1, C + 16, sc);
    if constexpr (RB) {
      _tile_loadd(2, C2, sc);
      _tile_loadd(3, C2 + 16, sc);
    }
  } else {
    _tile_zero(0);
    if constexpr (NT > 1) _tile_zero(1);
    if constexpr (RB) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const int64_t whole = K2 / 16 * 16;
  for (int64_t k = 0; k < whole; k += 16) amx_step<RB, NT>(A + k, lda, sa, B + k * ldb, sb);
  if (Bt) amx_step<RB, NT>(A + whole, lda, sa, Bt, ldbt * 4);
  _tile_stored(0, C, sc);
  if constexpr (NT > 1) _tile_stored(1, C + 16, sc);
  if constexpr (RB) {
    _tile_stored(2, C2, sc);
    _tile_stored(3, C2 + 16, sc);
  }
}

// C[M x N] (+)= A · B on the tiles: 2 x 2 blocks of 32 rows x 32 columns, the rows past
// them in a last 2 x 2 block (more than 16) or 1 x 2 block, a last 16 columns as 1 x 1.
__attribute__((target("amx-tile,amx-bf16"))) void gemm_bf16_amx(
    int64_t M, int64_t N, int64_t K2, const uint32_t* A, int64_t lda, const uint32_t* B,
    int64_t ldb, const uint32_t* Bt, float* C, int64_t ldc, bool accumulate) {
  int configured = -1;  // rows of the second row of tiles (0: a 1 x NT block), as loaded
  auto configure = [&](int ra, int rb) {
    if (configured != ra * 32 + rb) amx_configure(ra, rb);
    configured = ra * 32 + rb;
  };
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    const uint32_t* b = B + n0;
    const uint32_t* bt = Bt ? Bt + n0 : nullptr;  // row stride N
    float* c = C + n0;
    if (N - n0 < 32) {  // 16 columns
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        configure((int)min64(16, M - m0), 0);
        amx_block<false, 1>(K2, A + m0 * lda, lda, b, ldb, bt, N, c + m0 * ldc, ldc, accumulate);
      }
      break;
    }
    int64_t m0 = 0;
    for (; m0 + 16 < M; m0 += 32) {
      configure(16, (int)min64(16, M - m0 - 16));
      amx_block<true, 2>(K2, A + m0 * lda, lda, b, ldb, bt, N, c + m0 * ldc, ldc, accumulate);
    }
    if (m0 < M) {
      configure((int)(M - m0), 0);
      amx_block<false, 2>(K2, A + m0 * lda, lda, b, ldb, bt, N, c + m0 * ldc, ldc, accumulate);
    }
  }
  _tile_release();
}

// The largest transposed left operand gemm_bf16 repacks for the tiles (the forward's
// O^T += V^T · P^T: Dv rows up to 512, a key block's pairs up to 32) and the widest B.
constexpr int64_t kAmxPackRows = 512, kAmxPackPairs = 32, kAmxPackCols = 64;

// gemm over K2 pairs: C[M x N] (+)= A[M x 2*K2] · B[2*K2 x N], N a multiple of W.
void gemm_bf16(int64_t M, int64_t N, int64_t K2, const uint32_t* A, int64_t rs, int64_t ks,
               const uint32_t* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  if (M > 0 && K2 > 0 && amx_bf16_enabled()) {
    if (ks == 1 && K2 % 16 == 0) {
      gemm_bf16_amx(M, N, K2, A, rs, B, ldb, nullptr, C, ldc, accumulate);
      return;
    }
    if (rs == 1 && M <= kAmxPackRows && K2 <= kAmxPackPairs && N <= kAmxPackCols) {
      // A stored along M (V's pairs of keys, [K2][Dv]): its rows repacked contiguous along
      // the pairs, zero-padded to whole tiles, and B's last partial tile of pair rows
      // zero-padded (a 0 times a stale NaN would be NaN).
      const int64_t k2p = round_up(K2, 16), whole = K2 / 16 * 16;
      alignas(64) uint32_t at[kAmxPackRows * kAmxPackPairs];
      alignas(64) uint32_t bt[16 * kAmxPackCols];
      const __m512i step = _mm512_mullo_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
          _mm512_set1_epi32((int)ks));
      for (int64_t r = 0; r < M; ++r)
        for (int64_t k0 = 0; k0 < k2p; k0 += 16) {  // 16 pairs of row r, zeros past K2
          const __mmask16 live = (__mmask16)((1u << min64(16, K2 - k0)) - 1);  // K2 > k0 here
          _mm512_store_si512(at + r * k2p + k0,
                             _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, step,
                                                         A + r + k0 * ks, 4));
        }
      const bool tail = whole < K2;
      if (tail)
        for (int64_t k = 0; k < 16; ++k)
          for (int64_t x = 0; x < N; ++x) bt[k * N + x] = whole + k < K2 ? B[(whole + k) * ldb + x] : 0;
      gemm_bf16_amx(M, N, K2, at, k2p, B, ldb, tail ? bt : nullptr, C, ldc, accumulate);
      return;
    }
  }
  for (int64_t n0 = 0; n0 < N; n0 += NR * W) {
    int nv = (int)min64((N - n0) / W, NR);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      int mr = (int)min64(M - m0, MR);
      kMicroBf16[mr - 1][nv - 1](K2, A + m0 * rs, rs, ks, B + n0, ldb, C + m0 * ldc + n0, ldc,
                                 accumulate);
    }
  }
}

// W pairs (bf16(lo[c]), bf16(hi[c])) of two keys' float32 rows, c < W, stored at dst.
inline void store_p_pairs(uint32_t* dst, __m512 lo, __m512 hi) {
  const __m512i lanes = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  const __m512i ab = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo in words 0..15, hi above
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(lanes, ab));
}

// Pp[q][c] = (bf16(P[2q][c]), bf16(P[2q+1][c])) for q < ceil(jn / 2), c < np, the pair of an
// odd last key zero; P is float32 [jn] rows of ldp.
void pack_p_pairs_ld(const float* P, int64_t jn, int64_t ldp, int64_t np, uint32_t* Pp) {
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const float* lo = P + 2 * q * ldp;
    const float* hi = 2 * q + 1 < jn ? lo + ldp : nullptr;
    for (int64_t c0 = 0; c0 < np; c0 += W)
      store_p_pairs(Pp + q * np + c0, _mm512_loadu_ps(lo + c0),
                    hi ? _mm512_loadu_ps(hi + c0) : _mm512_setzero_ps());
  }
}
// Rows [j0, j0 + 2 pairs) of a bf16 [keys][dim] buffer (row stride rs) transposed into pairs
// along the keys: dst[d * ld + q] = (X[j0 + 2q][d], X[j0 + 2q + 1][d]), keys from jend on zero.
// The A operand of a product reduced over keys (the forward's V^T, the backward's K^T).
void pack_pairs_transposed(const uint16_t* X, int64_t rs, int64_t j0, int64_t jend,
                           int64_t pairs, int64_t dim, uint32_t* dst, int64_t ld) {
  for (int64_t q = 0; q < pairs; ++q) {
    const int64_t j = j0 + 2 * q;
    const uint16_t* lo = j < jend ? X + j * rs : nullptr;
    const uint16_t* hi = j + 1 < jend ? X + (j + 1) * rs : nullptr;
    for (int64_t d = 0; d < dim; ++d)
      dst[d * ld + q] = (lo ? lo[d] : 0u) | (hi ? (uint32_t)hi[d] << 16 : 0u);
  }
}

// The backward's products on AMX tiles take their operands rounded to bf16 pairs along the
// reduced dim: along a row (pack_pairs_along: dst[r][q] = (X[r][2q], X[r][2q+1])) or
// across two rows (pack_pairs_across: dst[q][x] = (X[2q][x], X[2q+1][x])), zeros up to
// `pairs` pairs or pair rows (whole tiles). n: the row's floats (along) or X's rows
// (across), x < cols a multiple of W.
void pack_pairs_along(const float* X, int64_t rows, int64_t ldx, int64_t n, int64_t pairs,
                      uint32_t* dst, int64_t ldd) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ldx;
    uint32_t* d = dst + r * ldd;
    for (int64_t q0 = 0; q0 < pairs; q0 += W) {  // 16 pairs: floats [2 q0, 2 q0 + 32)
      const int64_t f = 2 * q0;
      const __m512 a = f < n ? _mm512_loadu_ps(x + f) : _mm512_setzero_ps();
      const __m512 b = f + W < n ? _mm512_loadu_ps(x + f + W) : _mm512_setzero_ps();
      _mm512_storeu_si512(d + q0, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}
void pack_pairs_across(const float* X, int64_t n, int64_t ldx, int64_t cols, int64_t pairs,
                       uint32_t* dst) {
  pack_p_pairs_ld(X, n, ldx, cols, dst);
  for (int64_t q = (n + 1) / 2; q < pairs; ++q) memset(dst + q * cols, 0, cols * sizeof(uint32_t));
}

// Qp[q][c] = the bf16 pair (Qt[2q][c], Qt[2q+1][c]) of float32 Qt [D][np] that holds bf16
// values (truncation is exact), the pair of an odd last d zero.
void pack_q_pairs(const float* Qt, int64_t D, int64_t np, uint32_t* Qp) {
  for (int64_t q = 0; 2 * q < D; ++q)
    for (int64_t c = 0; c < np; ++c) {
      const uint32_t lo = f32_to_bits(Qt[2 * q * np + c]) >> 16;
      const uint32_t hi = 2 * q + 1 < D ? f32_to_bits(Qt[(2 * q + 1) * np + c]) >> 16 : 0u;
      Qp[q * np + c] = lo | hi << 16;
    }
}

// A bf16 row of n as (n + 1) / 2 pairs, an odd n's last pair zero-padded; null: zeros.
void pack_row_pairs(const uint16_t* row, int64_t n, uint32_t* dst) {
  if (!row) {
    memset(dst, 0, (n + 1) / 2 * sizeof(uint32_t));
    return;
  }
  memcpy(dst, row, n / 2 * sizeof(uint32_t));
  if (n % 2) dst[n / 2] = row[n - 1];
}

// A block's keys as bf16 pairs: Kp[j][D2] pairs along d (pack_k_pairs), Vp[q][Dv] pairs
// along keys (pack_v_pairs: V rows 2q, 2q+1; an odd block's last partner zero). Hidden keys
// (null rows) are zero: their P is 0.
void pack_k_pairs(const uint16_t* const* krow, int64_t jn, int64_t D, uint32_t* Kp) {
  for (int64_t j = 0; j < jn; ++j) pack_row_pairs(krow[j], D, Kp + j * ((D + 1) / 2));
}
void pack_v_pairs(const uint16_t* const* vrow, int64_t jn, int64_t Dv, uint32_t* Vp) {
  for (int64_t q = 0; 2 * q < jn; ++q) {
    const uint16_t* a = vrow[2 * q];
    const uint16_t* b = 2 * q + 1 < jn ? vrow[2 * q + 1] : nullptr;
    uint32_t* vd = Vp + q * Dv;
    if (a && b) {
      for (int64_t d = 0; d < Dv; ++d) vd[d] = (uint32_t)a[d] | (uint32_t)b[d] << 16;
    } else if (a || b) {
      const uint16_t* x = a ? a : b;
      const int sh = a ? 0 : 16;
      for (int64_t d = 0; d < Dv; ++d) vd[d] = (uint32_t)x[d] << sh;
    } else {
      memset(vd, 0, Dv * sizeof(uint32_t));
    }
  }
}
#endif  // __AVX512BF16__
