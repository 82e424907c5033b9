// Scratch arenas, packed-sequence block ranges, a query tile and where a block's keys live.
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// ---- scratch --------------------------------------------------------------------
// One aligned block per participant, carved into float arrays.
struct Arena {
  char* base = nullptr;
  size_t per = 0;  // bytes per participant
};
inline size_t floats_bytes(int64_t n) { return (size_t)round_up(n * 4, 64); }
bool arena_alloc(Arena* a, size_t per, int participants) {
  a->per = (size_t)round_up((int64_t)per, 64);
  a->base = static_cast<char*>(aligned_alloc(64, a->per * participants));
  return a->base != nullptr;
}
struct Carver {
  char* p;
  float* floats(int64_t n) {
    float* r = reinterpret_cast<float*>(p);
    p += floats_bytes(n);
    return r;
  }
  int32_t* i32(int64_t n) {
    int32_t* r = reinterpret_cast<int32_t*>(p);
    p += (size_t)round_up(n * 4, 64);
    return r;
  }
  int64_t* ints(int64_t n) {
    int64_t* r = reinterpret_cast<int64_t*>(p);
    p += (size_t)round_up(n * 8, 64);
    return r;
  }
};

// ---- packed sequences -------------------------------------------------------------
// The [lo, hi] range of the kv segment ids of every aligned block of kBk keys of every
// batch row, computed once per call: a (query tile, key block) pair whose ranges do not
// overlap has no visible pair and is skipped (exact for sorted packing, conservative else).
struct SegBlocks {
  const int32_t* q_ids = nullptr;   // null: no segment ids
  const int32_t* kv_ids = nullptr;
  int32_t* lo = nullptr;            // [B][nblk]
  int32_t* hi = nullptr;
  int64_t nblk = 0;
};

bool seg_blocks_build(const SdpaParams& p, SegBlocks* s) {
  if (!p.q_segment_ids) return true;
  s->q_ids = p.q_segment_ids;
  s->kv_ids = p.kv_segment_ids;
  s->nblk = (p.len_kv + kBk - 1) / kBk;
  const int64_t n = max64(1, p.batch * s->nblk);
  s->lo = static_cast<int32_t*>(malloc(2 * n * sizeof(int32_t)));
  if (!s->lo) return false;
  s->hi = s->lo + n;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t blk = 0; blk < s->nblk; ++blk) {
      const int32_t* ids = p.kv_segment_ids + b * p.len_kv;
      int32_t lo = INT32_MAX, hi = INT32_MIN;
      for (int64_t j = blk * kBk; j < min64(p.len_kv, (blk + 1) * kBk); ++j) {
        lo = ids[j] < lo ? ids[j] : lo;
        hi = ids[j] > hi ? ids[j] : hi;
      }
      s->lo[b * s->nblk + blk] = lo;
      s->hi[b * s->nblk + blk] = hi;
    }
  return true;
}

// What keys [j0, j0 + jn) of row b need against a tile of query ids in [qlo, qhi].
enum class SegCover { kNone, kAll, kPartial };
SegCover seg_cover(const SegBlocks& s, int64_t b, int64_t j0, int64_t jn, int32_t qlo,
                   int32_t qhi) {
  if (!s.q_ids) return SegCover::kAll;
  if (jn <= 0 || qlo > qhi) return SegCover::kNone;
  int32_t lo = INT32_MAX, hi = INT32_MIN;
  for (int64_t blk = j0 / kBk; blk <= (j0 + jn - 1) / kBk; ++blk) {
    lo = s.lo[b * s.nblk + blk] < lo ? s.lo[b * s.nblk + blk] : lo;
    hi = s.hi[b * s.nblk + blk] > hi ? s.hi[b * s.nblk + blk] : hi;
  }
  if (hi < qlo || lo > qhi) return SegCover::kNone;
  return lo == hi && qlo == qhi ? SegCover::kAll : SegCover::kPartial;
}

// ---- a query tile ---------------------------------------------------------------
struct Tile {
  int64_t b, hk, r0, n, np;  // rows r0 .. r0+n of (b, hk); np = n rounded up to W
  int64_t qlen, kvlen;
  int64_t *col_i, *col_h, *kf, *kl;  // per row: query, head, visible band [kf, kl)
  int64_t KF, KL;                    // union of the bands
  int64_t maxKF, minKL;              // a key block inside [maxKF, minKL) needs no band mask
  int32_t* qseg;                     // per row (np of them): its query's segment id
  int32_t qlo, qhi;                  // their range over rows that see a key (lo > hi: none)
};

void setup_tile(const SdpaParams& p, Tile* t) {
  const int64_t G = p.group();
  t->qlen = clamp_length(p.q_lengths, t->b, p.len_q);
  t->kvlen = clamp_length(p.kv_lengths, t->b, p.len_kv);
  const int64_t off = diagonal_offset(p.bottom_right, t->qlen, t->kvlen);
  t->np = round_up(t->n, W);
  t->KF = INT64_MAX;
  t->KL = 0;
  t->maxKF = 0;
  t->minKL = INT64_MAX;
  t->qlo = INT32_MAX;
  t->qhi = INT32_MIN;
  for (int64_t c = 0; c < t->n; ++c) {
    int64_t r = t->r0 + c, i = r / G;
    t->col_i[c] = i;
    t->col_h[c] = t->hk * G + r % G;
    int64_t f = 0, l = 0;
    if (i < t->qlen) {
      KeyRange kr = band_keys(i, off, p.window_left, p.window_right, t->kvlen);
      f = kr.first;
      l = kr.last;
    }
    t->kf[c] = f;
    t->kl[c] = l;
    if (l > f) {
      t->KF = min64(t->KF, f);
      t->KL = max64(t->KL, l);
    }
    t->maxKF = max64(t->maxKF, f);
    t->minKL = min64(t->minKL, l);
    if (p.q_segment_ids) {
      const int32_t id = p.q_segment_ids[t->b * p.len_q + i];
      t->qseg[c] = id;
      if (l > f) {
        t->qlo = id < t->qlo ? id : t->qlo;
        t->qhi = id > t->qhi ? id : t->qhi;
      }
    }
  }
  if (p.q_segment_ids)
    for (int64_t c = t->n; c < t->np; ++c) t->qseg[c] = t->n ? t->qseg[0] : 0;
  if (t->KL == 0) t->KF = 0;
}

// Whether the scale can wait until the softmax reads the scores (saving a pass over them):
// no additive mask or soft cap needs them scaled first, and a finite positive scale keeps the
// -inf of masked scores -inf and commutes with the max (rounding is monotone): the same bits.
inline bool scale_after_masks(const SdpaParams& p) {
  const float scale = (float)p.scale;  // what the scores are multiplied by
  return p.logits_soft_cap <= 0 && p.mask_kind != MaskKind::kAdditive && scale > 0 &&
         scale < INFINITY;
}

// St[jn x np] (np: the tile's np, or a narrow tile's np2) holds q·k for keys j0.. of the tile;
// applies scale (unless scale_later: the caller scales as it reads, scale_after_masks), the
// soft cap, the mask, the band and (seg == kPartial) the segment ids (-inf = invisible).
// Padding columns (c >= n) are left alone where masks apply. With a soft cap, dcap (when
// given) receives its derivative 1 - tanh^2 per score (backward).
void scale_and_mask(const SdpaParams& p, const Tile& t, int64_t j0, int64_t jn, float* St,
                    int64_t np, SegCover seg, float* dcap, bool scale_later = false) {
  if (p.logits_soft_cap > 0) {  // never with scale_later (scale_after_masks)
    const vf pre = splat((float)(p.scale / p.logits_soft_cap));
    const vf cap = splat((float)p.logits_soft_cap);
    for (int64_t x = 0; x < jn * np; x += W) {
      vf th = vtanh(loadv(St + x) * pre);
      storev(St + x, cap * th);
      if (dcap) storev(dcap + x, splat(1.0f) - th * th);
    }
  } else if (!scale_later) {
    const vf sc = splat((float)p.scale);
    for (int64_t x = 0; x < jn * np; x += W) storev(St + x, loadv(St + x) * sc);
  }
  if (p.mask_kind != MaskKind::kNone) {
    const int64_t* ms = p.mask_stride;
    for (int64_t c = 0; c < t.n; ++c) {
      if (t.kl[c] <= t.kf[c]) continue;  // invisible anyway
      int64_t base = t.b * ms[0] + t.col_h[c] * ms[1] + t.col_i[c] * ms[2] + j0 * ms[3];
      if (p.mask_kind == MaskKind::kBool) {
        const uint8_t* m = static_cast<const uint8_t*>(p.mask) + base;
        for (int64_t j = 0; j < jn; ++j)
          if (!m[j * ms[3]]) St[j * np + c] = -INFINITY;
      } else if (p.mask_dtype == DType::kF32) {
        const float* m = static_cast<const float*>(p.mask) + base;
        for (int64_t j = 0; j < jn; ++j) St[j * np + c] += m[j * ms[3]];
      } else {
        for (int64_t j = 0; j < jn; ++j)
          St[j * np + c] += load_one(p.mask, p.mask_dtype, base + j * ms[3]);
      }
    }
  }
  if (j0 < t.maxKF || j0 + jn > t.minKL) {
    for (int64_t c = 0; c < t.n; ++c) {
      int64_t lo = min64(max64(t.kf[c] - j0, 0), jn), hi = min64(max64(t.kl[c] - j0, 0), jn);
      if (hi < lo) hi = lo;
      for (int64_t j = 0; j < lo; ++j) St[j * np + c] = -INFINITY;
      for (int64_t j = hi; j < jn; ++j) St[j * np + c] = -INFINITY;
    }
  }
  if (seg == SegCover::kPartial) {  // selected, not added: a NaN score of another segment goes
    const int32_t* kv = p.kv_segment_ids + t.b * p.len_kv + j0;
    const vf hidden = splat(-INFINITY);
    for (int64_t j = 0; j < jn; ++j) {
      if (np % W != 0) {  // a narrow tile's dense rows: fewer columns than a vector
        for (int64_t c = 0; c < np; ++c)
          if (t.qseg[c] != kv[j]) St[j * np + c] = -INFINITY;
        continue;
      }
      vi id;
      for (int x = 0; x < W; ++x) id[x] = kv[j];
      for (int64_t c0 = 0; c0 < np; c0 += W) {
        vi qs;
        memcpy(&qs, t.qseg + c0, sizeof qs);
        storev(St + j * np + c0, select(qs == id, loadv(St + j * np + c0), hidden));
      }
    }
  }
}

// Xt[d][c] = X row of column c (zero for padding / invalid rows) and the row-major copy
// Xr[c][dp], each when asked (non-null).
void pack_rows(const SdpaParams& p, const Tile& t, const void* X, const int64_t stride[3],
               int64_t dim, float* Xt, float* Xr, int64_t dp, float* tmp) {
  const int64_t np = t.np;
  for (int64_t c = 0; c < np; ++c) {
    bool live = c < t.n && t.col_i[c] < t.qlen;
    if (live) {
      load_row(X, p.dtype, t.b * stride[0] + t.col_h[c] * stride[1] + t.col_i[c] * stride[2], dim,
               tmp);
    } else {
      memset(tmp, 0, dim * sizeof(float));
    }
    if (Xt)
      for (int64_t d = 0; d < dim; ++d) Xt[d * np + c] = tmp[d];
    if (Xr) {
      memcpy(Xr + c * dp, tmp, dim * sizeof(float));
      memset(Xr + c * dp + dim, 0, (dp - dim) * sizeof(float));
    }
  }
}

// ---- where a block's keys live --------------------------------------------------
// Keys j .. j+n of a block whose K and V rows sit at constant strides from element
// offsets k and v of the K / V buffers; k < 0: a paged key whose page index is out of
// range (invisible, never read).
struct KeyRun {
  int64_t j, n, k, v;
};

// The runs of keys [j0, j0 + jn) of (b, hk): one for a contiguous cache, one per page
// touched for a paged one. Returns how many (at most jn).
int64_t key_runs(const SdpaParams& p, int64_t b, int64_t hk, int64_t j0, int64_t jn,
                 KeyRun* runs) {
  if (!p.paged()) {
    runs[0] = {0, jn, b * p.k_stride[0] + hk * p.k_stride[1] + j0 * p.k_stride[2],
               b * p.v_stride[0] + hk * p.v_stride[1] + j0 * p.v_stride[2]};
    return 1;
  }
  int64_t nr = 0;
  for (int64_t j = 0; j < jn;) {
    const PagedRow pr =
        paged_key_row(p.page_indices, p.pages_per_seq, p.page_size, p.num_pages, b, j0 + j);
    const int64_t n = min64(jn - j, p.page_size - pr.slot);
    if (pr.page < 0) {
      runs[nr++] = {j, n, -1, -1};
    } else {
      runs[nr++] = {j, n, pr.page * p.k_stride[0] + hk * p.k_stride[1] + pr.slot * p.k_stride[2],
                    pr.page * p.v_stride[0] + hk * p.v_stride[1] + pr.slot * p.v_stride[2]};
    }
    j += n;
  }
  return nr;
}
