// The forward: a tile's online softmax over key blocks, split-key merges, forward tasks.
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- forward ----------------------------------------------------------------------
struct FwdCtx {
  const SdpaParams* p;
  const SdpaFwdBuffers* buf;
  Arena arena;
  SegBlocks segs;
  int64_t tiles;  // per (b, hk)
  int64_t group_heads = 1;  // kv heads a task walks together (fwd_task)
  int64_t bk = kBk;  // keys a block of wide tiles (kBkBf16 for bf16 products); narrow: kBk
  // Wide tiles a task walks together over the key blocks (kWideTilesPerTask), each with its
  // own Q^T and O^T in the task's arena; 1: the one tile uses the block scratch's.
  int64_t tiles_per_task = 1;
  // Groups of tiles_per_task consecutive tiles per (b, kv head group): tasks before splitting.
  int64_t tile_chunks() const { return (tiles + tiles_per_task - 1) / tiles_per_task; }
  // Split keys: a tile's key blocks are cut into nsplit shares, one task each, when there
  // are too few tiles to keep every thread busy (decode). Each share leaves its softmax
  // state in part; the share that finishes last (done[tile] counts them) merges them.
  int64_t nsplit = 1;
  int64_t part_floats = 0;  // per share: m, l (kBq each), O (kBq * Dv)
  float* part = nullptr;
  int64_t* done = nullptr;
  // bf16 calls on AMX tiles over a contiguous cache, several tiles a head: V^T as bf16 pairs
  // along the keys, packed once a call for every tile (pack_vt_task) instead of once a tile
  // and block: [b * Hk + hk][key block][Dv][bk / 2] pair words, zeros past the keys.
  uint32_t* vt = nullptr;
  int64_t vt_blocks = 0;  // key blocks a (b, hk)
};

// The softmax state of one tile: row maxima m, sums l, unnormalized O (narrow: rows of Dv,
// else transposed [Dv][np]).
void merge_shares(const FwdCtx& ctx, int64_t tile_id, const Tile& t, bool narrow, float* m,
                  float* l, float* O) {
  const int64_t Dv = ctx.p->head_dim_v, np = t.np, ns = ctx.nsplit;
  const float* base = ctx.part + tile_id * ns * ctx.part_floats;
  for (int64_t c = 0; c < t.n; ++c) {
    float M = -INFINITY;
    bool nan = false;
    for (int64_t s = 0; s < ns; ++s) {
      const float ms = base[s * ctx.part_floats + c];
      nan |= ms != ms;
      M = ms > M ? ms : M;
    }
    if (nan) M = NAN;
    const float mu = M == -INFINITY ? 0.0f : M;
    float lsum = 0.0f;
    for (int64_t d = 0; d < Dv; ++d) O[narrow ? c * Dv + d : d * np + c] = 0.0f;
    for (int64_t s = 0; s < ns; ++s) {
      const float* sh = base + s * ctx.part_floats;
      const float f = expf(sh[c] - mu);  // 0 for a share that saw nothing
      if (f == 0.0f) continue;
      lsum += sh[kBq + c] * f;
      const float* Os = sh + 2 * kBq;
      for (int64_t d = 0; d < Dv; ++d) {
        const int64_t x = narrow ? c * Dv + d : d * np + c;
        O[x] += Os[x] * f;
      }
    }
    m[c] = M;
    l[c] = nan ? NAN : lsum;
  }
}

// A tile's softmax state: its rows, maxima m, sums l, the last block's rescale alpha and its
// unnormalized O (narrow: rows of Dv in Or, queries in Qr; else transposed [Dv][np] in the
// task's Ot, queries in its Qt), and the keys [ka, kb) of its share.
struct TileState {
  Tile t;
  bool narrow;
  bool bf16_pairs;  // narrow with the bf16 products (bf16 on AVX512-BF16): both by VDPBF16PS
  int np2;
  float *Qr, *Or, *Qt, *Ot, *m, *l, *alpha;
  uint32_t* Qb;  // narrow bf16 tiles on AVX512-BF16: Qr as bf16 pairs (narrow_pair_words)
  uint32_t* Qp;  // wide tiles' bf16 products: Qt as bf16 pairs
  int64_t ka, kb;
  float* O() const { return narrow ? Or : Ot; }
};
inline int64_t pair_words(int64_t D) { return (D + 1) / 2; }
// own_wide: the tile keeps its wide Q^T, O^T and Q pairs (FwdCtx::tiles_per_task > 1).
size_t tile_state_bytes(int64_t D, int64_t Dv, bool own_wide) {
  return 4 * (size_t)round_up(kBq * 8, 64) + (size_t)round_up(kBq * 4, 64) +
         floats_bytes(W * D) + floats_bytes(W * Dv) + 3 * floats_bytes(kBq) +
         floats_bytes(W * narrow_pair_words(D)) +
         (own_wide ? floats_bytes(D * kBq) + floats_bytes(Dv * kBq) +
                         floats_bytes(pair_words(D) * kBq)
                   : 0);
}

// What a task reuses for every block of every tile it runs.
struct BlockScratch {
  KeyRun* runs;
  float *Qt, *St, *Ot, *Kf, *Vf, *zero_row, *tmp;
  const void** kr;  // narrow tiles: each key's K / V row (float32 or bf16 in place, or
  const void** vr;  // converted float32 in Kf / Vf; null: hidden)
  const char** next_k;  // narrow tiles: the K and V rows of the next block (NextRows)
  const char** next_v;
  uint32_t *Qp, *Kp, *Vp, *Pp;  // bf16 pairs (bf16_products)
};
size_t block_scratch_bytes(int64_t D, int64_t Dv) {
  return (size_t)round_up(4 * kBkMax * 8, 64) + floats_bytes(max64(D, Dv)) +
         4 * (size_t)round_up(kBk * 8, 64) +
         floats_bytes(D * kBq) + floats_bytes(kBkMax * kBq) + floats_bytes(Dv * kBq) +
         floats_bytes(kBk * D) + floats_bytes(kBk * Dv) + floats_bytes(max64(D, Dv)) +
         floats_bytes(pair_words(D) * kBq) + floats_bytes(kBkMax * pair_words(D)) +
         floats_bytes(kBkMax / 2 * Dv) + floats_bytes(kBkMax / 2 * kBq);
}
BlockScratch carve_block_scratch(Carver& cv, int64_t D, int64_t Dv) {
  BlockScratch sc;
  sc.runs = reinterpret_cast<KeyRun*>(cv.ints(4 * kBkMax));
  sc.Qt = cv.floats(D * kBq);
  sc.St = cv.floats(kBkMax * kBq);
  sc.Ot = cv.floats(Dv * kBq);
  sc.Kf = cv.floats(kBk * D);
  sc.Vf = cv.floats(kBk * Dv);
  sc.zero_row = cv.floats(max64(D, Dv));  // a K or V row of zeros, float32 or bf16
  sc.tmp = cv.floats(max64(D, Dv));
  sc.kr = reinterpret_cast<const void**>(cv.ints(kBk));
  sc.vr = reinterpret_cast<const void**>(cv.ints(kBk));
  sc.next_k = reinterpret_cast<const char**>(cv.ints(kBk));
  sc.next_v = reinterpret_cast<const char**>(cv.ints(kBk));
  sc.Qp = reinterpret_cast<uint32_t*>(cv.floats(pair_words(D) * kBq));
  sc.Kp = reinterpret_cast<uint32_t*>(cv.floats(kBkMax * pair_words(D)));
  sc.Vp = reinterpret_cast<uint32_t*>(cv.floats(kBkMax / 2 * Dv));
  sc.Pp = reinterpret_cast<uint32_t*>(cv.floats(kBkMax / 2 * kBq));
  return sc;
}

// Sets up the tile of rows tile * kBq .. of (b, hk) for key share `share`: its rows, the sinks
// as a first softmax column, O = 0 and its packed queries.
void start_tile(const FwdCtx& ctx, int64_t b, int64_t hk, int64_t tile, int64_t share,
                Carver& cv, const BlockScratch& sc, TileState* st) {
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  Tile& t = st->t;
  t.b = b;
  t.hk = hk;
  t.r0 = tile * kBq;
  t.n = min64(kBq, p.len_q * p.group() - t.r0);
  t.col_i = cv.ints(kBq);
  t.col_h = cv.ints(kBq);
  t.kf = cv.ints(kBq);
  t.kl = cv.ints(kBq);
  t.qseg = cv.i32(kBq);
  st->Qr = cv.floats(W * D);
  st->Or = cv.floats(W * Dv);
  st->m = cv.floats(kBq);
  st->l = cv.floats(kBq);
  st->alpha = cv.floats(kBq);
  st->Qb = reinterpret_cast<uint32_t*>(cv.floats(W * narrow_pair_words(D)));
  const bool own_wide = ctx.tiles_per_task > 1;
  st->Qt = own_wide ? cv.floats(D * kBq) : sc.Qt;
  st->Ot = own_wide ? cv.floats(Dv * kBq) : sc.Ot;
  st->Qp = own_wide ? reinterpret_cast<uint32_t*>(cv.floats(pair_words(D) * kBq)) : sc.Qp;
  setup_tile(p, &t);
  // Decode-shaped tiles take the narrow kernels (whole vectors of K and V rows).
  st->narrow = t.n <= kNarrow && D % W == 0 && Dv % W == 0;
#if defined(__AVX512BF16__)
  st->bf16_pairs = st->narrow && bf16_products(p);
#else
  st->bf16_pairs = false;
#endif
  st->np2 = np2_for(t.n);
  for (int64_t c = 0; c < t.np; ++c) {
    bool sink = share == 0 && p.sinks && c < t.n && t.col_i[c] < t.qlen;
    // A sink is one more softmax column with logit sinks[h] and no value.
    st->m[c] = sink ? p.sinks[t.b * p.sinks_batch_stride + t.col_h[c]] : -INFINITY;
    st->l[c] = sink ? 1.0f : 0.0f;
  }
  memset(st->O(), 0, Dv * (st->narrow ? st->np2 : t.np) * sizeof(float));
  // This share of the tile's key blocks.
  const int64_t bk = ctx.bk;
  const int64_t nblk = t.KL > t.KF ? (t.KL - t.KF + bk - 1) / bk : 0;
  st->ka = t.KF + share * nblk / ctx.nsplit * bk;
  st->kb = min64(t.KL, t.KF + (share + 1) * nblk / ctx.nsplit * bk);
  if (st->kb > st->ka) {
    // Narrow tiles read their queries as rows (Qr) only: the transposed copy's strided
    // stores cost decode about 8% of a B1 Lk1024 call, split into shares of 128 keys.
    pack_rows(p, t, ctx.buf->q, p.q_stride, D, st->narrow ? nullptr : st->Qt,
              st->narrow ? st->Qr : nullptr, D, sc.tmp);
#if defined(__AVX512BF16__)
    if (bf16_products(p) && !st->narrow) pack_q_pairs(st->Qt, D, t.np, st->Qp);
    if (st->bf16_pairs) pack_q_rows_bf16(st->Qr, D, st->np2, st->Qb, narrow_pair_words(D));
#endif
  }
}

#if defined(__AVX512BF16__)
// Task (b * Hk + hk) of the V^T packing (FwdCtx::vt).
void pack_vt_task(void* vctx, int64_t task, int) {
  const FwdCtx& ctx = *static_cast<const FwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const int64_t Dv = p.head_dim_v, pairs = ctx.bk / 2;
  const int64_t b = task / p.heads_kv, hk = task % p.heads_kv;
  const uint16_t* v =
      static_cast<const uint16_t*>(ctx.buf->v) + b * p.v_stride[0] + hk * p.v_stride[1];
  uint32_t* dst = ctx.vt + task * ctx.vt_blocks * Dv * pairs;
  for (int64_t blk = 0; blk < ctx.vt_blocks; ++blk, dst += Dv * pairs)
    pack_pairs_transposed(v, p.v_stride[2], blk * ctx.bk, p.len_kv, pairs, Dv, dst, pairs);
}
#endif

// Folds keys [j0, j0 + jn) into the tile's softmax state. St is [keys][np] (narrow tiles:
// dense [keys][np2], narrow_softmax); narrow tiles need sc.zero_row = 0.
void tile_block(const FwdCtx& ctx, TileState& st, const BlockScratch& sc, int64_t j0,
                int64_t jn) {
  const SdpaParams& p = *ctx.p;
  const SdpaFwdBuffers& buf = *ctx.buf;
  const Tile& t = st.t;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const int64_t np = st.narrow ? st.np2 : t.np;  // St's row stride
  float* St = sc.St;
  const SegCover seg = seg_cover(ctx.segs, t.b, j0, jn, t.qlo, t.qhi);
  if (seg == SegCover::kNone) return;  // no query of the tile meets a key of the block
  const int64_t nruns = key_runs(p, t.b, t.hk, j0, jn, sc.runs);
  const KeyRun* runs = sc.runs;
  bool hidden_runs = false;
  for (int64_t r = 0; r < nruns; ++r) hidden_runs |= runs[r].k < 0;
  const bool f32 = p.dtype == DType::kF32;
  const uint32_t* vt_block = nullptr;  // this block's packed V^T (FwdCtx::vt), if it has one
  // S^T = K · Q^T, run by run with float32 K rows in place; 16-bit rows converted into
  // scratch (zeros for hidden runs) and used as one run.
  if (st.narrow) {
    // bfloat16 rows are read in place (paired with VDPBF16PS, else widened in registers);
    // float16 converted here.
    const bool bf16 = p.dtype == DType::kBF16;
    const bool in_place = f32 || bf16;
    const int64_t item = f32 ? 4 : 2;
    if (!in_place) load_block_rows(p, buf, runs, nruns, sc.Kf, sc.Vf);
    for (int64_t r = 0; r < nruns; ++r)
      for (int64_t j = 0; j < runs[r].n; ++j) {
        const int64_t jj = runs[r].j + j;
        if (runs[r].k < 0) {
          sc.kr[jj] = sc.vr[jj] = nullptr;
        } else if (in_place) {
          sc.kr[jj] = static_cast<const char*>(buf.k) + (runs[r].k + j * p.k_stride[2]) * item;
          sc.vr[jj] = static_cast<const char*>(buf.v) + (runs[r].v + j * p.v_stride[2]) * item;
        } else {
          sc.kr[jj] = sc.Kf + jj * D;
          sc.vr[jj] = sc.Vf + jj * Dv;
        }
      }
#if defined(__AVX512BF16__)
    if (st.bf16_pairs)
      narrow_scores_bf16_np2(st.np2, D, sc.kr, jn, st.Qb, narrow_pair_words(D), sc.zero_row,
                             St, np, NextRows{sc.next_k, D * item, sc.next_v, Dv * item});
    else
#endif
      narrow_scores_any(bf16, st.np2, D, sc.kr, jn, st.Qr, D, sc.zero_row, St, np,
                        NextRows{sc.next_k, D * item,
                                 in_place && (bf16 || kPrefetchFloat32V) ? sc.next_v : nullptr,
                                 Dv * item});
  } else if (f32) {
    const float* kp = static_cast<const float*>(buf.k);
    for (int64_t r = 0; r < nruns; ++r) {
      if (runs[r].k < 0) continue;
      gemm(runs[r].n, np, D, kp + runs[r].k, p.k_stride[2], 1, st.Qt, np, St + runs[r].j * np,
           np, false);
    }
#if defined(__AVX512BF16__)
  } else if (bf16_products(p)) {  // K and V rows as bf16 pairs, hidden ones zero
    const uint16_t *krow[kBkMax], *vrow[kBkMax];
    const uint16_t* kp = static_cast<const uint16_t*>(buf.k);
    const uint16_t* vp = static_cast<const uint16_t*>(buf.v);
    for (int64_t r = 0; r < nruns; ++r)
      for (int64_t j = 0; j < runs[r].n; ++j) {
        const bool hidden = runs[r].k < 0;
        krow[runs[r].j + j] = hidden ? nullptr : kp + runs[r].k + j * p.k_stride[2];
        vrow[runs[r].j + j] = hidden ? nullptr : vp + runs[r].v + j * p.v_stride[2];
      }
    // One visible run of even-length, pair-aligned rows: K's rows are its pairs, read in
    // place. The packed V^T serves a whole block, or the last (zeros past the keys): a
    // shorter block's keys past jn may hold NaN that P = 0 must not meet.
    const bool one_run = nruns == 1 && runs[0].k >= 0;
    const bool k_in_place = one_run && D % 2 == 0 && p.k_stride[2] % 2 == 0 && runs[0].k % 2 == 0;
    const int64_t bk = ctx.bk;
    if (one_run && ctx.vt && j0 % bk == 0 && (jn == bk || j0 + jn == p.len_kv))
      vt_block = ctx.vt + ((t.b * p.heads_kv + t.hk) * ctx.vt_blocks + j0 / bk) * Dv * (bk / 2);
    if (!k_in_place) pack_k_pairs(krow, jn, D, sc.Kp);
    if (!vt_block) pack_v_pairs(vrow, jn, Dv, sc.Vp);
    if (k_in_place)
      gemm_bf16(jn, np, pair_words(D), reinterpret_cast<const uint32_t*>(kp + runs[0].k),
                p.k_stride[2] / 2, 1, st.Qp, np, St, np, false);
    else
      gemm_bf16(jn, np, pair_words(D), sc.Kp, pair_words(D), 1, st.Qp, np, St, np, false);
#endif
  } else {
    load_block_rows(p, buf, runs, nruns, sc.Kf, sc.Vf);
    gemm(jn, np, D, sc.Kf, D, 1, st.Qt, np, St, np, false);
  }
  // Wide tiles scale the scores as the softmax reads them, where that is the same bits.
  const bool scale_later = !st.narrow && scale_after_masks(p);
  scale_and_mask(p, t, j0, jn, St, np, seg, nullptr, scale_later);
  if (hidden_runs)
    for (int64_t r = 0; r < nruns; ++r)
      if (runs[r].k < 0)
        for (int64_t x = runs[r].j * np; x < (runs[r].j + runs[r].n) * np; ++x) St[x] = -INFINITY;
  float *m = st.m, *l = st.l, *alpha = st.alpha;
  if (st.narrow) {  // O = alpha * O + P · V
    narrow_softmax(St, jn, st.np2, m, l, alpha);
#if defined(__AVX512BF16__)
    if (st.bf16_pairs) {
      pack_p_pairs_dense(St, jn, st.np2, sc.Pp);
      narrow_values_bf16_np2(st.np2, Dv, sc.vr, jn, sc.Pp, np, alpha, st.Or, Dv,
                             reinterpret_cast<const uint16_t*>(sc.zero_row));
      return;
    }
#endif
    narrow_values_any(p.dtype == DType::kBF16, st.np2, Dv, sc.vr, jn, St, np, alpha, st.Or, Dv);
    return;
  }
  // Block maxima, key by key in order for each query; all of the tile's vectors in one pass
  // (one vector at a time would wait on each max's latency).
  vf bmax[kBq / W];
  for (int64_t v = 0; v < np / W; ++v) bmax[v] = splat(-INFINITY);
  for (int64_t j = 0; j < jn; ++j)
    for (int64_t v = 0; v < np / W; ++v) bmax[v] = vmax(bmax[v], loadv(St + j * np + v * W));
  const vf scale = splat(scale_later ? (float)p.scale : 1.0f);
  // e^(x - mu) of key j of the W queries at c0. x is rounded on its own, as the scaling
  // pass's store rounds it: fused into the exp's subtraction, the row's largest score would
  // leave its rounding error (about 1e23 for logits near 1e31) where exp needs 0.
  auto exp_of = [&](int64_t j, int64_t c0, vf mu) {
    vf x = loadv(St + j * np + c0) * scale;
    keep_rounded(x);
    return vexp_diff(x, mu);
  };
#if defined(__AVX512BF16__)
  // bf16 products take P as bf16 pairs along the keys (Pp), written here as the pairs'
  // exps are made rather than by a pass over St.
  uint32_t* Pp = bf16_products(p) ? sc.Pp : nullptr;
#endif
  for (int64_t c0 = 0; c0 < np; c0 += W) {  // online softmax, W queries at a time
    vf mx = bmax[c0 / W] * scale;
    vf mo = loadv(m + c0);
    vf mn = vmax(mo, mx);
    vf mu = select(mn == splat(-INFINITY), splat(0.0f), mn);  // nothing yet: no shift
    vf al = vexp_diff(mo, mu);
    vf sum = vf{};
#if defined(__AVX512BF16__)
    if (Pp) {
      for (int64_t j = 0; j < jn; j += 2) {
        const vf lo = exp_of(j, c0, mu);
        sum += lo;
        vf hi = vf{};  // an odd last key's pair: zero
        if (j + 1 < jn) {
          hi = exp_of(j + 1, c0, mu);
          sum += hi;
        }
        store_p_pairs(Pp + j / 2 * np + c0, (__m512)lo, (__m512)hi);
      }
    } else
#endif
      for (int64_t j = 0; j < jn; ++j) {
        const vf e = exp_of(j, c0, mu);
        storev(St + j * np + c0, e);
        sum += e;
      }
    storev(l + c0, loadv(l + c0) * al + sum);
    storev(m + c0, mn);
    storev(alpha + c0, al);
  }
  // O^T *= alpha, but for chunks of W queries whose maxima all held (alpha exactly 1, NaN
  // not): most chunks of a long row's later blocks.
  float* Ot = st.Ot;
  int64_t moved[kBq / W], nmoved = 0;
  for (int64_t c0 = 0; c0 < np; c0 += W) {
    bool held = true;
    for (int64_t x = c0; x < c0 + W; ++x) held &= alpha[x] == 1.0f;
    if (!held) moved[nmoved++] = c0;
  }
  for (int64_t d = 0; d < Dv; ++d)
    for (int64_t u = 0; u < nmoved; ++u)
      storev(Ot + d * np + moved[u], loadv(Ot + d * np + moved[u]) * loadv(alpha + moved[u]));
  // O^T += V^T · P^T (hidden runs have P = 0 and are skipped: never read)
  if (f32) {
    const float* vp = static_cast<const float*>(buf.v);
    for (int64_t r = 0; r < nruns; ++r) {
      if (runs[r].k < 0) continue;
      gemm(Dv, np, runs[r].n, vp + runs[r].v, 1, p.v_stride[2], St + runs[r].j * np, np, Ot, np,
           true);
    }
#if defined(__AVX512BF16__)
  } else if (bf16_products(p)) {  // P's pairs are in sc.Pp (the softmax above)
    if (vt_block) {  // P's pair rows zero up to whole tiles, as V^T's are
      const int64_t k2 = pair_words(jn), k2p = round_up(k2, 16);
      memset(sc.Pp + k2 * np, 0, (k2p - k2) * np * sizeof(uint32_t));
      gemm_bf16_amx(Dv, np, k2p, vt_block, ctx.bk / 2, sc.Pp, np, nullptr, Ot, np, true);
    } else {
      gemm_bf16(Dv, np, pair_words(jn), sc.Vp, 1, Dv, sc.Pp, np, Ot, np, true);
    }
#endif
  } else {
    gemm(Dv, np, jn, sc.Vf, 1, Dv, St, np, Ot, np, true);
  }
}

// Writes the tile's rows (out = O / l, lse = m + log l) once its last share is in. task: this
// share's task id, tile_task: the tile's (tile_task * nsplit + share = task).
void finish_tile(const FwdCtx& ctx, TileState& st, const BlockScratch& sc, int64_t task,
                 int64_t tile_task) {
  const SdpaParams& p = *ctx.p;
  const Tile& t = st.t;
  const int64_t Dv = p.head_dim_v;
  float *m = st.m, *l = st.l, *O = st.O(), *tmp = sc.tmp;
  const bool narrow = st.narrow;
  if (ctx.nsplit > 1) {  // leave this share's state; the last share of the tile merges
    float* mine = ctx.part + task * ctx.part_floats;
    memcpy(mine, m, t.n * sizeof(float));
    memcpy(mine + kBq, l, t.n * sizeof(float));
    memcpy(mine + 2 * kBq, O, Dv * (narrow ? st.np2 : t.np) * sizeof(float));
    if (__atomic_add_fetch(&ctx.done[tile_task], 1, __ATOMIC_ACQ_REL) != ctx.nsplit) return;
    merge_shares(ctx, tile_task, t, narrow, m, l, O);
  }
  // Wide tiles stream their rows past the cache (decode rows are few and read soon).
  const bool stream = !narrow;
  // Nothing visible (l == 0) -> 0 and -inf. A NaN score made l NaN: the row is NaN (l > 0
  // would call it empty).
  for (int64_t c = 0; c < t.n; ++c) {
    const int64_t i = t.col_i[c], h = t.col_h[c];
    const int64_t oidx = t.b * p.o_stride[0] + h * p.o_stride[1] + i * p.o_stride[2];
    float* lse = ctx.buf->lse + (t.b * p.heads_q + h) * p.len_q + i;
    const bool live = i < t.qlen && l[c] != 0.0f;
    *lse = live ? m[c] + logf(l[c]) : -INFINITY;
    if (live && t.KL > t.KF) {
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = narrow ? O[c * Dv + d] : O[d * t.np + c];
      (stream ? store_row_streamed : store_row)(ctx.buf->out, p.dtype, oidx, tmp, 1.0f / l[c],
                                                Dv);
    } else if (live) {  // a sink and no key: 0 (NaN with a NaN sink)
      for (int64_t d = 0; d < Dv; ++d) tmp[d] = 0.0f;
      store_row(ctx.buf->out, p.dtype, oidx, tmp, 1.0f / l[c], Dv);
    } else {
      store_zeros(ctx.buf->out, p.dtype, oidx, Dv);
    }
  }
  if (stream) stream_fence();
}

// sc.next_k / next_v: the K / V rows of the next block, keys [j1, j1 + n) (n <= kBk), of
// the nh kv heads from hk0 a task walks (the tile's own head alone where nh = 1), key by
// key: the tile of head hk0 + s takes the s-th nh-th of those keys, so that the heads'
// prefetches cover the next block in address order. Null past the tile's keys, where
// hidden, and past the share.
void next_block_rows(const FwdCtx& ctx, const TileState& st, int64_t j1, int64_t n,
                     int64_t hk0, int64_t nh, const BlockScratch& sc) {
  const SdpaParams& p = *ctx.p;
  const char* kp = static_cast<const char*>(ctx.buf->k);
  const char* vp = static_cast<const char*>(ctx.buf->v);
  const int64_t item = dtype_bytes(p.dtype);
  for (int64_t j = 0; j < kBk; ++j) sc.next_k[j] = sc.next_v[j] = nullptr;
  const int64_t per = (n + nh - 1) / nh, k0 = j1 + (st.t.hk - hk0) * per;
  const int64_t kn = min64(per, min64(st.kb, j1 + n) - k0);
  if (kn <= 0) return;
  KeyRun runs[kBk];
  for (int64_t h = 0; h < nh; ++h) {
    const int64_t nruns = key_runs(p, st.t.b, hk0 + h, k0, kn, runs);
    for (int64_t r = 0; r < nruns; ++r)
      if (runs[r].k >= 0)
        for (int64_t j = 0; j < runs[r].n; ++j) {
          const int64_t slot = (runs[r].j + j) * nh + h;
          if (slot >= kBk) continue;
          sc.next_k[slot] = kp + (runs[r].k + j * p.k_stride[2]) * item;
          sc.next_v[slot] = vp + (runs[r].v + j * p.v_stride[2]) * item;
        }
  }
}

// A task is one key share of a group of tiles: the same rows of group_heads consecutive kv
// heads of one batch row (one head unless decode reads a slot-major cache, where the heads'
// rows share each key's memory: walking them together streams it in order instead of one
// strided head at a time), key block by key block.
void fwd_task(void* vctx, int64_t task, int participant) {
  const FwdCtx& ctx = *static_cast<const FwdCtx*>(vctx);
  const SdpaParams& p = *ctx.p;
  const int64_t D = p.head_dim, Dv = p.head_dim_v, Hk = p.heads_kv, gh = ctx.group_heads;
  const int64_t groups = (Hk + gh - 1) / gh;  // per batch row
  const int64_t BH = p.batch * Hk;
  // One group of kv heads at a time, its heaviest tiles (latest queries under a causal band)
  // first: consecutive tasks read the same K and V, which stay in cache (tile by tile across
  // all heads streamed every head's K and V once a tile: B1 H24 D64 L4096 693 -> 600 ms,
  // H8 L16384 3457 -> 3061 ms in the kernel harness). A task walks either gh kv heads of
  // one tile (decode) or ctx.tiles_per_task consecutive tiles of one kv head.
  const int64_t tpt = ctx.tiles_per_task, chunks = ctx.tile_chunks();
  const int64_t share = task % ctx.nsplit, group_task = task / ctx.nsplit;
  const int64_t bg = group_task / chunks, first = group_task % chunks * tpt;
  const int64_t b = bg / groups, hk0 = bg % groups * gh, nh = min64(gh, Hk - hk0);
  const int64_t ntiles = min64(tpt, ctx.tiles - first);

  Carver cv{ctx.arena.base + ctx.arena.per * participant};
  const BlockScratch sc = carve_block_scratch(cv, D, Dv);
  TileState states[kGroupHeads > kWideTilesPerTask ? kGroupHeads : kWideTilesPerTask];
  const int64_t nstates = nh * ntiles;  // one of the two is 1
  bool narrow = false;
  int64_t ka = INT64_MAX, kb = 0;
  for (int64_t s = 0; s < nstates; ++s) {
    start_tile(ctx, b, hk0 + s / ntiles, ctx.tiles - 1 - (first + s % ntiles), share, cv, sc,
               &states[s]);
    narrow |= states[s].narrow;
    ka = min64(ka, states[s].ka);
    kb = max64(kb, states[s].kb);
  }
  if (narrow) {
    memset(sc.zero_row, 0, max64(D, Dv) * sizeof(float));
    memset(sc.St, 0, kBk * states[0].t.np * sizeof(float));  // the scale reads whole vectors
  }
  // Decode walks the keys in blocks whose rows, and the next block's, fit kDecodeBlockBytes.
  int64_t step = narrow ? kBk : ctx.bk;
  if (narrow) {
    const int64_t item = dtype_bytes(p.dtype);
    while (step > 16 && 2 * step * nh * (D + Dv) * item > kDecodeBlockBytes) step /= 2;
  }
  for (int64_t j0 = ka; j0 < kb; j0 += step) {
    for (int64_t s = 0; s < nstates; ++s) {
      TileState& st = states[s];
      // a tile's own keys within this block (tiles of one task may start at other keys)
      const int64_t lo = max64(j0, st.ka), hi = min64(j0 + step, st.kb);
      if (lo >= hi) continue;
      if (st.narrow) next_block_rows(ctx, st, j0 + step, step, hk0, nh, sc);
      tile_block(ctx, st, sc, lo, hi - lo);
    }
  }
  for (int64_t s = 0; s < nstates; ++s) {
    const Tile& t = states[s].t;
    const int64_t tile_task = (ctx.tiles - 1 - t.r0 / kBq) * BH + b * Hk + t.hk;
    finish_tile(ctx, states[s], sc, tile_task * ctx.nsplit + share, tile_task);
  }
}
