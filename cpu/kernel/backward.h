// The backward: P recomputed per tile from the saved lse, dK / dV per key chunk, dQ summed.
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- backward ---------------------------------------------------------------------
// Words of a K^T row in the backward's AMX path: the chunk's key pairs and one tile of zeros
// (a chunk's last block reads whole tiles).
inline int64_t bwd_kt_words(int64_t chunk) { return chunk / 2 + 16; }

struct BwdCtx {
  const SdpaParams* p;
  const SdpaBwdBuffers* buf;
  Arena arena;
  int64_t nchunk, chunk;  // key chunks per (b, hk) and their length
  float* dq_part;         // [nchunk][B][Hk][Lq * G][Dp] float32, each bwd_task's part zeroed by it
  int64_t Dp, Dvp;
  SegBlocks segs;
};

void bwd_task(void* vctx, int64_t task, int participant) {
  const BwdCtx& ctx = *static_cast<const BwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const SdpaBwdBuffers& buf = *ctx.buf;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group(), Dp = ctx.Dp, Dvp = ctx.Dvp;
  const int64_t BH = p.batch * p.heads_kv;
  const int64_t ch = task / BH, bh = task % BH;
  const int64_t b = bh / p.heads_kv, hk = bh % p.heads_kv;
  // This task's part of dq, zeroed by the thread that sums into it (dq_part is not).
  float* dqp = ctx.dq_part + ((ch * p.batch + b) * p.heads_kv + hk) * (p.len_q * G) * Dp;
  memset(dqp, 0, p.len_q * G * Dp * sizeof(float));
  const int64_t k0 = ch * ctx.chunk, k1 = min64(p.len_kv, k0 + ctx.chunk);
  if (k1 <= k0) return;
  const int64_t kvlen = clamp_length(p.kv_lengths, b, p.len_kv);
  const int64_t qlen = clamp_length(p.q_lengths, b, p.len_q);
  const int64_t k1e = min64(k1, kvlen);  // keys past kvlen get zero gradients
  const int64_t nk = k1 - k0;

  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  Tile t;
  t.b = b;
  t.hk = hk;
  t.col_i = cv.ints(kBq);
  t.col_h = cv.ints(kBq);
  t.kf = cv.ints(kBq);
  t.kl = cv.ints(kBq);
  t.qseg = cv.i32(kBq);
  float* Kc = cv.floats(ctx.chunk * Dp);
  float* Vc = cv.floats(ctx.chunk * Dvp);
  float* dKc = cv.floats(ctx.chunk * Dp);
  float* dVc = cv.floats(ctx.chunk * Dvp);
  float* Qt = cv.floats(D * kBq);
  float* Qr = cv.floats(kBq * Dp);
  float* dOt = cv.floats(Dv * kBq);
  float* dOr = cv.floats(kBq * Dvp);
  float* St = cv.floats(kBk * kBq);
  float* dPt = cv.floats(kBk * kBq);
  float* dcap = p.logits_soft_cap > 0 ? cv.floats(kBk * kBq) : nullptr;
  float* lse_use = cv.floats(kBq);
  float* delta = cv.floats(kBq);
  float* tmp = cv.floats(2 * max64(Dp, Dvp));
  // bf16 pairs along d of K, V (the chunk's) and Q, dO (the tile's) for S^T and dP^T: both
  // products of inputs, exact in float32 (bf16_products).
  uint32_t* Kpc = reinterpret_cast<uint32_t*>(cv.floats(ctx.chunk * pair_words(D)));
  uint32_t* Vpc = reinterpret_cast<uint32_t*>(cv.floats(ctx.chunk * pair_words(Dv)));
  uint32_t* Qp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(D) * kBq));
  uint32_t* dOp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(Dv) * kBq));
  // On AMX tiles dV, dK and dQ^T take bf16 pairs too, with P and dS rounded to bf16 as GPU
  // flash kernels round them: P^T and dS^T rows in pairs along the queries (Pa, dSa), the
  // tile's Q and dO rows (Qb, dOb) and dS^T (dSb) in pairs across rows, and K^T (Kt: D rows
  // of the chunk's key pairs and a tile's more of zeros, packed once a chunk). dQ^T sums in
  // dQt until the tile's last block.
  const int64_t ktw = bwd_kt_words(ctx.chunk);
  uint32_t* Kt = reinterpret_cast<uint32_t*>(cv.floats(D * ktw));
  uint32_t* Pa = reinterpret_cast<uint32_t*>(cv.floats(kBk * kBq / 2));
  uint32_t* dSa = reinterpret_cast<uint32_t*>(cv.floats(kBk * kBq / 2));
  uint32_t* dSb = reinterpret_cast<uint32_t*>(cv.floats(kBk / 2 * kBq));
  uint32_t* Qb = reinterpret_cast<uint32_t*>(cv.floats(kBq / 2 * Dp));
  uint32_t* dOb = reinterpret_cast<uint32_t*>(cv.floats(kBq / 2 * Dvp));
  float* dQt = cv.floats(D * kBq);

  const int64_t kbase = b * p.k_stride[0] + hk * p.k_stride[1];
  const int64_t vbase = b * p.v_stride[0] + hk * p.v_stride[1];
  memset(Kc, 0, nk * Dp * sizeof(float));
  memset(Vc, 0, nk * Dvp * sizeof(float));
  memset(dKc, 0, nk * Dp * sizeof(float));
  memset(dVc, 0, nk * Dvp * sizeof(float));
  for (int64_t j = k0; j < k1e; ++j) {
    load_row(buf.k, p.dtype, kbase + j * p.k_stride[2], D, Kc + (j - k0) * Dp);
    load_row(buf.v, p.dtype, vbase + j * p.v_stride[2], Dv, Vc + (j - k0) * Dvp);
  }
#if defined(__AVX512BF16__)
  const bool bf16 = bf16_products(p);
  const bool amx = bf16 && amx_bf16_enabled();
  if (bf16)
    for (int64_t j = k0; j < k1; ++j) {
      const bool live = j < k1e;
      pack_row_pairs(live ? static_cast<const uint16_t*>(buf.k) + kbase + j * p.k_stride[2]
                          : nullptr, D, Kpc + (j - k0) * pair_words(D));
      pack_row_pairs(live ? static_cast<const uint16_t*>(buf.v) + vbase + j * p.v_stride[2]
                          : nullptr, Dv, Vpc + (j - k0) * pair_words(Dv));
    }
  if (amx)
    pack_pairs_transposed(static_cast<const uint16_t*>(buf.k) + kbase, p.k_stride[2], k0, k1e,
                          ktw, D, Kt, ktw);
#else
  const bool amx = false;
  (void)Kpc, (void)Vpc, (void)Qp, (void)dOp, (void)Kt, (void)Pa, (void)dSa, (void)dSb;
  (void)Qb, (void)dOb, (void)dQt;
#endif
  const int64_t rows = qlen * G;
  for (int64_t r0 = 0; k1e > k0 && r0 < rows; r0 += kBq) {
    t.r0 = r0;
    t.n = min64(kBq, rows - r0);
    setup_tile(p, &t);
    int64_t js = max64(t.KF, k0);
    const int64_t je = min64(t.KL, k1e);
    if (je <= js) continue;
    if (amx) js -= (js - k0) & 1;  // K^T's pairs start on the chunk's even keys (the key
                                   // before the tile's first is masked: P = dS = 0)
    if (seg_cover(ctx.segs, b, js, je - js, t.qlo, t.qhi) == SegCover::kNone) continue;
    const int64_t np = t.np;
    pack_rows(p, t, buf.q, p.q_stride, D, Qt, Qr, Dp, tmp);
    pack_rows(p, t, buf.dout, p.o_stride, Dv, dOt, dOr, Dvp, tmp);
#if defined(__AVX512BF16__)
    if (bf16) {
      pack_q_pairs(Qt, D, np, Qp);
      pack_q_pairs(dOt, Dv, np, dOp);
    }
    const int64_t k2q = round_up(np / 2, 16);  // pairs of queries, whole tiles
    if (amx) {
      pack_pairs_across(Qr, t.n, Dp, Dp, k2q, Qb);
      pack_pairs_across(dOr, t.n, Dvp, Dvp, k2q, dOb);
      memset(dQt, 0, D * np * sizeof(float));
    }
#endif
    for (int64_t c = 0; c < np; ++c) {
      lse_use[c] = INFINITY;  // exp(s - inf) = 0: no probability for this column
      delta[c] = 0.0f;
      if (c >= t.n) continue;
      const int64_t i = t.col_i[c], h = t.col_h[c];
      float lv = buf.lse[(b * p.heads_q + h) * p.len_q + i];
      if (lv != -INFINITY) lse_use[c] = lv;  // NaN included: the row's gradients are NaN
      const int64_t oidx = b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
      load_row(buf.out, p.dtype, oidx, Dv, tmp);
      float s = 0.0f;
      for (int64_t d = 0; d < Dv; ++d) s += tmp[d] * dOr[c * Dvp + d];
      delta[c] = s;
    }
    for (int64_t j0 = js; j0 < je; j0 += kBk) {
      const int64_t jn = min64(kBk, je - j0);
      const SegCover seg = seg_cover(ctx.segs, b, j0, jn, t.qlo, t.qhi);
      if (seg == SegCover::kNone) continue;
      const float* kb = Kc + (j0 - k0) * Dp;
      const float* vb = Vc + (j0 - k0) * Dvp;
#if defined(__AVX512BF16__)
      if (bf16) {
        gemm_bf16(jn, np, pair_words(D), Kpc + (j0 - k0) * pair_words(D), pair_words(D), 1, Qp,
                  np, St, np, false);
        scale_and_mask(p, t, j0, jn, St, t.np, seg, dcap);
        gemm_bf16(jn, np, pair_words(Dv), Vpc + (j0 - k0) * pair_words(Dv), pair_words(Dv), 1,
                  dOp, np, dPt, np, false);
      } else
#endif
      {
        gemm(jn, np, D, kb, Dp, 1, Qt, np, St, np, false);  // S^T
        scale_and_mask(p, t, j0, jn, St, t.np, seg, dcap);
        gemm(jn, np, Dv, vb, Dvp, 1, dOt, np, dPt, np, false);  // dP^T = V · dO^T
      }
      for (int64_t j = 0; j < jn; ++j)
        for (int64_t c0 = 0; c0 < np; c0 += W) {
          // P <= 1: the recomputed score can round above the forward's max near 1e30.
          vf pr = vexp_nonpositive(
              clamp_nonpositive(loadv(St + j * np + c0) - loadv(lse_use + c0)));
          storev(St + j * np + c0, pr);
          // dS (through the cap's derivative) selected where P = 0: a hidden key's dP or
          // cap derivative may be NaN, and 0 * NaN is NaN.
          vf ds = pr * (loadv(dPt + j * np + c0) - loadv(delta + c0));
          if (dcap) ds *= loadv(dcap + j * np + c0);
          storev(dPt + j * np + c0, select(pr == splat(0.0f), splat(0.0f), ds));
        }
      // dV += P^T · dO, dK += dS^T · Q, dQ += dS · K (scale applied at the end)
#if defined(__AVX512BF16__)
      if (amx) {
        const int64_t k2k = round_up(pair_words(jn), 16);  // pairs of keys, whole tiles
        pack_pairs_along(St, jn, np, np, k2q, Pa, kBq / 2);
        pack_pairs_along(dPt, jn, np, np, k2q, dSa, kBq / 2);
        pack_pairs_across(dPt, jn, np, np, k2k, dSb);
        gemm_bf16_amx(jn, Dvp, k2q, Pa, kBq / 2, dOb, Dvp, nullptr, dVc + (j0 - k0) * Dvp, Dvp,
                      true);
        gemm_bf16_amx(jn, Dp, k2q, dSa, kBq / 2, Qb, Dp, nullptr, dKc + (j0 - k0) * Dp, Dp, true);
        gemm_bf16_amx(D, np, k2k, Kt + (j0 - k0) / 2, ktw, dSb, np, nullptr, dQt, np, true);
        continue;
      }
#endif
      gemm(jn, Dvp, np, St, np, 1, dOr, Dvp, dVc + (j0 - k0) * Dvp, Dvp, true);
      gemm(jn, Dp, np, dPt, np, 1, Qr, Dp, dKc + (j0 - k0) * Dp, Dp, true);
      gemm(t.n, Dp, jn, dPt, 1, np, kb, Dp, dqp + r0 * Dp, Dp, true);
    }
    if (amx)  // the tile's dQ^T into its rows
      for (int64_t c = 0; c < t.n; ++c)
        for (int64_t d = 0; d < D; ++d) dqp[(r0 + c) * Dp + d] += dQt[d * np + c];
  }
  const float scale = (float)p.scale;
  for (int64_t j = k0; j < k1; ++j) {
    store_row(buf.dk, p.dtype, kbase + j * p.k_stride[2], dKc + (j - k0) * Dp, scale, D);
    store_row(buf.dv, p.dtype, vbase + j * p.v_stride[2], dVc + (j - k0) * Dvp, 1.0f, Dv);
  }
}

// dq = scale * sum over key chunks, per (b, query head).
void dq_task(void* vctx, int64_t task, int participant) {
  const BwdCtx& ctx = *static_cast<const BwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, G = p.group(), Dp = ctx.Dp;
  const int64_t b = task / p.heads_q, h = task % p.heads_q, hk = h / G, g = h % G;
  const int64_t qlen = clamp_length(p.q_lengths, b, p.len_q);
  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  float* acc = cv.floats(Dp);
  const int64_t part = p.batch * p.heads_kv * p.len_q * G * Dp;
  for (int64_t i = 0; i < p.len_q; ++i) {
    const int64_t idx = b * p.q_stride[0] + h * p.q_stride[1] + i * p.q_stride[2];
    if (i >= qlen) {
      store_zeros(ctx.buf->dq, p.dtype, idx, D);
      continue;
    }
    const float* src = ctx.dq_part + ((b * p.heads_kv + hk) * p.len_q * G + i * G + g) * Dp;
    memcpy(acc, src, D * sizeof(float));
    for (int64_t c = 1; c < ctx.nchunk; ++c)
      for (int64_t d = 0; d < D; ++d) acc[d] += src[c * part + d];
    store_row(ctx.buf->dq, p.dtype, idx, acc, (float)p.scale, D);
  }
}
