// Constants and the kernel parameter struct shared by the Metal shaders and the host code.
// Valid as MSL (Apple's compiler, the emulator) and as plain C++ (host). Keep the struct
// made of 8-byte fields first and 4-byte fields after, so MSL and C++ lay it out alike
// (the host static_asserts the size).
#ifndef JAX_SDPA_METAL_SDPA_SHARED_H
#define JAX_SDPA_METAL_SDPA_SHARED_H

#ifdef __METAL_VERSION__
typedef long sdpa_long;  // 64-bit in MSL
typedef int sdpa_int;
#else
#include <cstdint>
typedef int64_t sdpa_long;
typedef int32_t sdpa_int;
#endif

// Simdgroup width and the 8x8 matrix tile every tiled kernel is built from.
#define SDPA_SIMD 32
#define SDPA_TILE 8

// Tiled kernels (forward, dq, dk/dv): each simdgroup owns 8 rows (queries, or keys for dk/dv);
// SDPA_TILED_SG simdgroups per threadgroup.
#define SDPA_TILED_SG 4
#define SDPA_TILED_ROWS (SDPA_TILE * SDPA_TILED_SG)
// Forward: keys per online-softmax step (a multiple of 8).
#define SDPA_FWD_BK 16

// Few-query (decode) kernel: SDPA_DEC_SG simdgroups split the keys of one (batch, kv head,
// split); each handles up to SDPA_DEC_ROWS(dmax) packed query rows (GQA heads x queries), so
// that the threadgroup scratch SDPA_DEC_SG * rows * dmax floats stays at 16 KiB.
#define SDPA_DEC_SG 4
#define SDPA_DEC_ROWS(dmax) ((dmax) <= 128 ? 8 : ((dmax) <= 256 ? 4 : 2))
// Combine kernel of the two-pass decode: one simdgroup per output row.
#define SDPA_COMBINE_SG 4
#define SDPA_MAX_SPLITS 128

// Head-dim buckets the kernels are instantiated for; a call uses the smallest bucket
// >= max(D, Dv). D and Dv must be multiples of 8.
#define SDPA_DMAX_BUCKETS 4

// mask_kind / mask_dtype / dtype codes (same values as jax_sdpa::MaskKind / DType).
#define SDPA_MASK_NONE 0
#define SDPA_MASK_BOOL 1
#define SDPA_MASK_ADD 2
#define SDPA_DT_F32 0
#define SDPA_DT_F16 1
#define SDPA_DT_BF16 2

struct SdpaMetalParams {
  // element strides (batch, head, position); the head dim is contiguous
  sdpa_long q_stride[3];
  sdpa_long k_stride[3];
  sdpa_long v_stride[3];
  sdpa_long o_stride[3];
  sdpa_long mask_stride[4];  // (b, h_q, i, j); 0 = broadcast
  sdpa_long sinks_batch_stride;

  sdpa_int batch;
  sdpa_int heads_q;
  sdpa_int heads_kv;
  sdpa_int group;  // heads_q / heads_kv
  sdpa_int len_q;
  sdpa_int len_kv;
  sdpa_int head_dim;
  sdpa_int head_dim_v;
  sdpa_int window_left;   // -1 = unbounded
  sdpa_int window_right;  // -1 = unbounded; causal = 0
  sdpa_int bottom_right;
  sdpa_int mask_kind;
  sdpa_int mask_dtype;
  sdpa_int has_sinks;
  sdpa_int has_q_lengths;
  sdpa_int has_kv_lengths;
  sdpa_int num_splits;  // decode: key splits (1 = single pass)
  sdpa_int rows_per_group;  // decode: packed query rows per threadgroup
  sdpa_int has_segment_ids;  // packed sequences: q_seg[b, i] == kv_seg[b, j] to see key j
  // Paged K/V: key j of row b is slot j % page_size of page page_indices[b, j / page_size];
  // k_stride / v_stride are then (page, head, slot) strides. paged = 0 otherwise.
  sdpa_int paged;
  sdpa_int page_size;
  sdpa_int pages_per_seq;
  sdpa_int num_pages;
  sdpa_int pad0;
  float scale;
  float scale_log2;  // scale * log2(e): scores are kept in base 2
  // Soft-capping (the "_cap" kernels): score2 = cap_log2 * tanh(q.k * scale_over_cap).
  float scale_over_cap;  // scale / cap
  float cap_log2;        // cap * log2(e)
};

#define SDPA_PARAMS_SIZE (17 * 8 + 24 * 4 + 4 * 4)
// Checked by every compiler that sees this header (Apple's, the emulator's, the host's).
static_assert(sizeof(SdpaMetalParams) == SDPA_PARAMS_SIZE, "SdpaMetalParams layout changed");

#endif  // JAX_SDPA_METAL_SDPA_SHARED_H
