// One ISA variant of the CPU flash-attention kernel: the launchers (how a call becomes
// tasks on the pool) here, the kernels in cpu/kernel/ (tuning.h: the tile and task choices).
// CMake compiles this file once per variant with -DJAX_SDPA_CPU_ISA=<namespace> and
// matching -march flags; the parts in cpu/kernel/ are included inside the variant's
// namespace, everything has internal linkage or lives in that namespace, and no std template
// is instantiated, so a wide-ISA copy of an inline function can never be what a narrower
// caller links to.
//
// Layout of the work (docs/ffi_contract.md has the semantics):
// - A "row" of a (batch b, kv head hk) pair is (query i, head g of the group),
//   numbered r = i * G + g, so a query tile holds all heads of a GQA group that
//   share the kv head (decode with Lq = 1 still fills the tile).
// - Scores are computed transposed, S^T[key][row] = K · Q^T, so the softmax
//   statistics of a query are a vector lane and every step of the online
//   softmax is a plain vector op; the product with V is O^T += V^T · P^T.
// - Every product goes through one register-blocked micro-kernel
//   C[MR x NR*W] += A[MR x K] · B[K x NR*W] with A read by broadcast (any
//   strides, so K and V rows are used in place for float32) and B/C rows of
//   contiguous vectors in scratch padded to a multiple of W.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu/attention_kernel.h"

#ifndef JAX_SDPA_CPU_ISA
#error "compile with -DJAX_SDPA_CPU_ISA=<variant namespace>"
#endif

namespace jax_sdpa {
namespace cpu {
namespace JAX_SDPA_CPU_ISA {
namespace {

#include "cpu/kernel/tuning.h"
#include "cpu/kernel/vectors.h"
#include "cpu/kernel/gemm.h"
#include "cpu/kernel/tiles.h"
#include "cpu/kernel/narrow.h"
#include "cpu/kernel/forward.h"
#include "cpu/kernel/backward.h"

// ---- head-major copies ------------------------------------------------------------
// Prefill from a slot-major cache ([B, L, H, D]): every tile would read each key's K and V
// rows strided over the other heads' (a page a row with many heads), and the micro-kernel's
// broadcast loads miss the TLB and the prefetcher (B1 H24 D64 L4096: 677 ms against 444
// head-major; H8 D64 L4096 10% slower). Copying K and V head-major once a call costs a pass
// over them.
struct HeadMajorCopy {
  const SdpaParams* p;
  const void* src[2];
  char* dst[2];
  int64_t item, dim[2];
  const int64_t* stride[2];
};
void head_major_task(void* vctx, int64_t task, int) {
  const HeadMajorCopy& c = *static_cast<const HeadMajorCopy*>(vctx);
  const SdpaParams& p = *c.p;
  const int64_t b = task / p.heads_kv, h = task % p.heads_kv;
  for (int x = 0; x < 2; ++x) {
    const char* src = static_cast<const char*>(c.src[x]);
    char* dst = c.dst[x] + (task * p.len_kv * c.dim[x]) * c.item;
    for (int64_t j = 0; j < p.len_kv; ++j)
      memcpy(dst + j * c.dim[x] * c.item,
             src + (b * c.stride[x][0] + h * c.stride[x][1] + j * c.stride[x][2]) * c.item,
             c.dim[x] * c.item);
  }
}
// Whether a call of these shapes is long enough for the pool's extra threads (kLongJob*).
bool long_job(const SdpaParams& p) {
  const int64_t item = dtype_bytes(p.dtype), per_key = p.head_dim + p.head_dim_v;
  const double macs = (double)p.batch * p.heads_q * p.len_q * p.len_kv * per_key;
  const double bytes = (double)p.batch * p.heads_kv * p.len_kv * per_key * item;
  return macs >= kLongJobMacs || bytes >= kLongJobBytes;
}

const char* forward_in_place(const SdpaParams& p, const SdpaFwdBuffers& buf, ThreadPool& pool) {
  const int64_t rows = p.len_q * p.group();
  if (p.batch == 0 || p.heads_q == 0 || rows == 0) return nullptr;
  FwdCtx ctx;
  ctx.p = &p;
  ctx.buf = &buf;
  ctx.tiles = (rows + kBq - 1) / kBq;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
#if defined(__AVX512BF16__)
  if (bf16_products(p)) ctx.bk = kBkBf16;
#endif
  // Decode (narrow tiles) from a slot-major cache: a task walks up to kGroupHeads kv heads
  // together, so each key's rows of all of them are read at once (one head at a time would
  // stride over them, a TLB entry and a prefetch stream per key).
  const bool narrow = rows <= kNarrow && D % W == 0 && Dv % W == 0;
  const bool slot_major = abs64(p.k_stride[1]) < abs64(p.k_stride[2]);
  ctx.group_heads = narrow && slot_major ? min64(p.heads_kv, kGroupHeads) : 1;
  const bool shared = long_job(p);
  const int parts = pool.participants(shared);
  // Prefill: consecutive query tiles of a head share a task where its K and V outgrow the
  // cache and there are tasks to spare (every tile wide: a narrow last tile keeps a task of
  // its own).
  const bool all_wide = rows % kBq == 0 || rows % kBq > kNarrow;
  const int64_t head_kv_bytes = p.len_kv * (D + Dv) * dtype_bytes(p.dtype);
  if (!narrow && all_wide && head_kv_bytes > kWideGroupMinKvBytes) {
    ctx.tiles_per_task = kWideTilesPerTask;
    if (p.batch * p.heads_kv * ctx.tile_chunks() < 4 * parts) ctx.tiles_per_task = 1;
  }
  const int64_t states = max64(ctx.group_heads, ctx.tiles_per_task);
  const size_t per = block_scratch_bytes(D, Dv) +
                     states * tile_state_bytes(D, Dv, ctx.tiles_per_task > 1);
  if (!arena_alloc(&ctx.arena, per, pool.capacity()))
    return "jax_sdpa cpu: out of memory (forward scratch)";
  if (!seg_blocks_build(p, &ctx.segs)) {
    free(ctx.arena.base);
    return "jax_sdpa cpu: out of memory (segment ranges)";
  }
  const int64_t groups = (p.heads_kv + ctx.group_heads - 1) / ctx.group_heads;
  const int64_t group_tasks = p.batch * groups * ctx.tile_chunks();
  if (parts > 1 && group_tasks < 4 * parts) {
    // A share holds at least kSplitKeys key rows (keys times the heads walked together).
    ctx.nsplit = max64(1, min64(min64((4 * parts + group_tasks - 1) / group_tasks,
                                      p.len_kv * ctx.group_heads / kSplitKeys), 16));
  }
  const int64_t tile_tasks = p.batch * p.heads_kv * ctx.tiles;
  if (ctx.nsplit > 1) {
    ctx.part_floats = 2 * kBq + kBq * Dv;
    ctx.part = static_cast<float*>(malloc(tile_tasks * ctx.nsplit * ctx.part_floats * 4));
    ctx.done = static_cast<int64_t*>(calloc(tile_tasks, sizeof(int64_t)));
    if (!ctx.part || !ctx.done) {
      free(ctx.part);
      free(ctx.done);
      ctx.part = nullptr;
      ctx.done = nullptr;
      ctx.nsplit = 1;  // no room for the shares: unsplit
    }
  }
#if defined(__AVX512BF16__)
  // bf16 on AMX over a contiguous cache with several tiles a head: V^T packed once for all
  // of them (FwdCtx::vt; without room, each tile packs its blocks).
  if (bf16_products(p) && !narrow && !p.paged() && ctx.tiles >= 4 && amx_bf16_enabled()) {
    ctx.vt_blocks = (p.len_kv + ctx.bk - 1) / ctx.bk;
    ctx.vt = static_cast<uint32_t*>(malloc(
        (size_t)(p.batch * p.heads_kv * ctx.vt_blocks * Dv * (ctx.bk / 2)) * sizeof(uint32_t)));
    if (ctx.vt) pool.parallel_for(p.batch * p.heads_kv, pack_vt_task, &ctx, shared);
  }
#endif
  pool.parallel_for(group_tasks * ctx.nsplit, fwd_task, &ctx, shared);
  free(ctx.arena.base);
  free(ctx.segs.lo);
  free(ctx.part);
  free(ctx.done);
  free(ctx.vt);
  return nullptr;
}

}  // namespace

const char* forward(const SdpaParams& p, const SdpaFwdBuffers& buf, ThreadPool& pool) {
  const int64_t rows = p.len_q * p.group();
  const int64_t item = dtype_bytes(p.dtype);
  // Worth a pass over K and V when at least four tiles a head read every key (decode and
  // short calls read each key once: they read in place).
  const bool many_tiles = rows > 4 * kBq;
  const bool strided = abs64(p.k_stride[2]) != p.head_dim || abs64(p.v_stride[2]) != p.head_dim_v;
  if (!many_tiles || !strided || p.paged() || p.batch == 0 || p.heads_kv == 0 || p.len_kv == 0)
    return forward_in_place(p, buf, pool);
  const int64_t D = p.head_dim, Dv = p.head_dim_v, BH = p.batch * p.heads_kv;
  char* copy = static_cast<char*>(malloc((size_t)(BH * p.len_kv * (D + Dv) * item)));
  if (!copy) return forward_in_place(p, buf, pool);  // no room: strided reads
  HeadMajorCopy c{&p, {buf.k, buf.v}, {copy, copy + BH * p.len_kv * D * item}, item, {D, Dv},
                  {p.k_stride, p.v_stride}};
  pool.parallel_for(BH, head_major_task, &c, /*long_job=*/false);
  SdpaParams hm = p;
  const int64_t ks[3] = {p.heads_kv * p.len_kv * D, p.len_kv * D, D};
  const int64_t vs[3] = {p.heads_kv * p.len_kv * Dv, p.len_kv * Dv, Dv};
  memcpy(hm.k_stride, ks, sizeof ks);
  memcpy(hm.v_stride, vs, sizeof vs);
  SdpaFwdBuffers hb = buf;
  hb.k = c.dst[0];
  hb.v = c.dst[1];
  const char* err = forward_in_place(hm, hb, pool);
  free(copy);
  return err;
}

const char* backward(const SdpaParams& p, const SdpaBwdBuffers& buf, ThreadPool& pool) {
  if (p.batch == 0) return nullptr;
  if (p.heads_q == 0) {  // no query rows: dq is empty, dk and dv are 0
    const int64_t kv_rows = p.batch * p.heads_kv * p.len_kv;
    store_zeros(buf.dk, p.dtype, 0, kv_rows * p.head_dim);
    store_zeros(buf.dv, p.dtype, 0, kv_rows * p.head_dim_v);
    return nullptr;
  }
  const int64_t D = p.head_dim, Dv = p.head_dim_v, G = p.group();
  BwdCtx ctx;
  ctx.p = &p;
  ctx.buf = &buf;
  ctx.Dp = round_up(D, W);
  ctx.Dvp = round_up(Dv, W);
  const bool shared = long_job(p);
  // Split the keys of each (b, hk) only as far as needed to keep every core busy: each split
  // repeats the query tiles' packing and costs a float32 copy of dq. The cores, not a busy
  // machine's extra threads, which share them (docs/cpu.md: split for those, a GQA training
  // backward took about 15% longer under load).
  const int cores = pool.cores();
  const int64_t BH = p.batch * p.heads_kv;
  const int64_t nblocks = max64(1, (p.len_kv + kBk - 1) / kBk);
  int64_t nchunk = (2 * cores + BH - 1) / BH;
  nchunk = max64(1, min64(min64(nchunk, nblocks), 16));
  ctx.chunk = round_up(max64(1, (p.len_kv + nchunk - 1) / nchunk), kBk);
  ctx.nchunk = max64(1, (p.len_kv + ctx.chunk - 1) / ctx.chunk);
  const size_t part_floats = (size_t)(BH * p.len_q * G * ctx.Dp);
  // Not calloc: its fresh zero pages, read by the first sum into them and then written, took
  // a second fault each and a TLB shootdown across the pool's threads (23% of a GQA causal
  // bf16 training step, B1 H8/KV2 D128 L4096, in the kernel's flush_tlb_mm_range). Each
  // bwd_task zeroes its part: one fault a page, on the thread that uses it.
  ctx.dq_part = static_cast<float*>(malloc((ctx.nchunk * part_floats + 1) * sizeof(float)));
  if (!ctx.dq_part) return "jax_sdpa cpu: out of memory (dq accumulator)";
  const int64_t Dp = ctx.Dp, Dvp = ctx.Dvp;
  size_t per = 4 * (size_t)round_up(kBq * 8, 64) + (size_t)round_up(kBq * 4, 64) +
               floats_bytes(kBk * kBq) + 2 * floats_bytes(ctx.chunk * Dp) +
               2 * floats_bytes(ctx.chunk * Dvp) + floats_bytes(D * kBq) +
               floats_bytes(kBq * Dp) + floats_bytes(Dv * kBq) + floats_bytes(kBq * Dvp) +
               2 * floats_bytes(kBk * kBq) + 2 * floats_bytes(kBq) +
               floats_bytes(2 * max64(Dp, Dvp)) + floats_bytes(ctx.chunk * pair_words(D)) +
               floats_bytes(ctx.chunk * pair_words(Dv)) + floats_bytes(pair_words(D) * kBq) +
               floats_bytes(pair_words(Dv) * kBq) + floats_bytes(D * bwd_kt_words(ctx.chunk)) +
               2 * floats_bytes(kBk * kBq / 2) + floats_bytes(kBk / 2 * kBq) +
               floats_bytes(kBq / 2 * Dp) + floats_bytes(kBq / 2 * Dvp) + floats_bytes(D * kBq);
  if (!arena_alloc(&ctx.arena, per, pool.capacity())) {
    free(ctx.dq_part);
    return "jax_sdpa cpu: out of memory (backward scratch)";
  }
  if (!seg_blocks_build(p, &ctx.segs)) {
    free(ctx.arena.base);
    free(ctx.dq_part);
    return "jax_sdpa cpu: out of memory (segment ranges)";
  }
  pool.parallel_for(ctx.nchunk * BH, bwd_task, &ctx, shared);
  pool.parallel_for(p.batch * p.heads_q, dq_task, &ctx, shared);
  free(ctx.arena.base);
  free(ctx.dq_part);
  free(ctx.segs.lo);
  return nullptr;
}

}  // namespace JAX_SDPA_CPU_ISA
}  // namespace cpu
}  // namespace jax_sdpa
