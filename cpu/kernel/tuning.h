// The CPU kernel's tile and task choices, one row each with its reason and where it was
// measured (docs/cpu.md has the figures; benchmarks/results/cpu_2core/ the runs).
// Part of the CPU kernel: attention_kernel.cc includes it inside its ISA variant's namespace
// (one translation unit a variant); not a header of its own.
#pragma once

// Vector width W (floats) and the micro-kernel's register block MR x NR vectors: as many
// accumulators as the ISA's vector registers hold beside the B vectors and a broadcast.
#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MR = 6, NR = 4;  // 24 zmm accumulators + 4 B vectors + 1 broadcast
#elif defined(__AVX__)
constexpr int W = 8;
constexpr int MR = 6, NR = 2;  // 12 + 2 + 1 of 16 ymm
#else
constexpr int W = 4;
constexpr int MR = 6, NR = 2;  // 12 + 2 + 1 of 16 xmm/NEON registers (of 32 on NEON)
#endif

// Rows (queries x group heads) of a query tile and keys of a block: a tile's scores, Q^T
// and O^T stay in L2 beside a block's K and V rows (64 x 64 float32 scores: 16 KiB).
constexpr int64_t kBq = 64;
constexpr int64_t kBk = 64;
// bfloat16 forwards on wide tiles (AVX512-BF16 / AMX) take key blocks of kBkBf16: half as
// many online-softmax steps (O^T's rescale, block maxima, tile loads) for the same AMX
// work. Scratch is sized for the larger of the two (kBkMax).
constexpr int64_t kBkBf16 = 128;
constexpr int64_t kBkMax = kBkBf16 > kBk ? kBkBf16 : kBk;

// Wide (prefill) tiles a task walks together over the key blocks, so each block of K and V
// read from L3 or memory serves that many query tiles, where a kv head's K and V exceed
// kWideGroupMinKvBytes. On the 2-core AMD EPYC (Zen 3, AVX2, 512 KiB L2), through the API,
// alternating: B1 H8/KV2 D128 GQA forward L8192 4.05-4.11 -> 3.21-3.30 s, L4096 926-935 ->
// 726-761 ms, L2048 within noise; B1 H8 D64 L4096 415-432 -> 391-409 ms; but L1024 (512 KiB
// of K and V a head, kept in L2 across one-tile tasks) 26.2-29.2 -> 30.0-31.9 ms. Measured
// while the VM ran both threads at 70-90 GFLOP/s; later at 130-150 the two were within noise.
// AVX-512 builds keep one tile a task (unmeasured there).
constexpr int64_t kWideTilesPerTask = W == 8 ? 4 : 1;
constexpr int64_t kWideGroupMinKvBytes = 1 << 20;

// Split keys: when a call has fewer than four tasks a thread (B1 decode), each tile's keys
// are cut into shares of at least this many key rows (keys times the heads walked
// together), one task each; shorter shares cost more in merges than they save (B1 H8/KV2
// D64 Lk1024, two shares instead of four: 25.5 -> 24.0 us a call in the kernel harness).
constexpr int64_t kSplitKeys = 1024;

// Decode from a slot-major cache: a task walks up to this many kv heads of a batch row
// together, reading each key's rows of all of them in order (one head a task strides over
// them: 1.8x slower at B1 H32/KV8 D128 Lk32768, docs/cpu.md).
constexpr int64_t kGroupHeads = 16;

// Narrow (decode-shaped) tiles: at most this many rows take the narrow kernels; wider tiles
// fill the transposed micro-kernel's lanes.
constexpr int64_t kNarrow = W < 8 ? W : 8;

// Decode prefetch: K rows this far ahead of the scores' loads (into L2; past a block's end,
// into the next block's rows). The interleaved K rows are read from memory at half the
// bandwidth without it (B1 H32/KV8 D128 Lk16384 float32 8.35 -> 4.87 ms); a whole block
// ahead rather than 16 rows: bf16 3.9 -> 2.7 ms, float32 6.7 -> 5.3 ms at B1 Lk16384, B8
// Lk4096 bf16 8.1 -> 5.8 ms, float32 13.0 -> 10.8 ms (kernel harness, 4 KiB pages; 32 and
// 48 rows gained a third of that, two blocks ahead nothing more). At most kBk: NextRows holds
// one block's rows.
constexpr int64_t kAheadRows = kBk;

// Decode prefetches the next block's V rows as it scores this block's keys (NextRows) for
// 16-bit rows only. float32 V rows are left to the hardware: on the Intel Xeon VM, through
// the API, K+V prefetch against K alone, alternating: B8 H32/KV8 D128 Lk4096 15.1 / 15.1 ->
// 14.5 / 13.4 ms, B1 Lk32768 15.9 / 15.9 -> 14.2 / 15.1, B1 Lk4096 1.31 / 1.20 -> 0.99 /
// 1.16, GQA 8 B4 Lk8192 9.4 / 10.0 -> 8.8 / 10.4; bfloat16 B8 Lk4096 without either
// prefetch 7.7-9.3 -> 11.9-12.6 ms. The product build, before / after: B8 Lk4096 float32
// 14.8 / 15.2 -> 12.9 / 13.7 ms, B1 Lk1024 340 / 320 -> 304 / 283 us (loops of 200 calls).
// (On the AMD EPYC VM float32 V a block ahead had gained a little: B1 Lk32768 9.0-10.3 ->
// 8.2-9.9 ms, kernel harness.)
constexpr bool kPrefetchFloat32V = false;

// Decode from a slot-major cache keeps a block's K and V rows of every head it walks, and
// the next block's it prefetched, in the core's L2: a task walks its keys in blocks halved
// from kBk (to at least 16) while those exceed this many bytes. On the AMD EPYC VM (1 MiB L2)
// 512 KiB beat 1 MiB: B1 H32/KV8 D128 Lk16384 float32, two threads, 5.1-5.3 -> 4.6-4.8 ms
// (kernel harness). On the Intel Xeon VM (2 MiB L2) 256 KiB beat 512 KiB on every long decode
// row, 12-28% (B8 Lk4096 bfloat16 12.4-13.1 -> 9.1-10.6 ms, B1 Lk32768 float32 16.9-18.1 ->
// 14.1-14.8), 128 KiB no further (decode_block_bytes.json). On an AVX2-only AMD EPYC VM (512 KiB
// L2 a core) 256 KiB, 512 KiB and 1 MiB were within noise: B1 Lk16384 float32 13.8-15.2 /
// 13.8-15.2 / 14.1-15.7 ms, three alternating rounds through the API.
constexpr int64_t kDecodeBlockBytes = 256 << 10;

// Accumulators the narrow values kernel keeps in registers (half the vector registers), so a
// pass reads whole V rows in key order up to Dv = kValueAccs * W (passes over a few vectors of
// each row defeat the hardware prefetcher: about 2.7x slower reads from memory).
constexpr int kValueAccs = W >= 16 ? 16 : 8;

// bfloat16 V rows widened in registers (no AVX512-BF16) take every query row of a narrow tile
// in each values pass, in column chunks of kValueAccs / rows vectors, so each V element is
// widened once instead of once a row; V comes from L2 there (prefetched a block ahead), so
// the short chunks cost no reads from memory. AVX2 AMD EPYC VM, through the API, builds
// alternating (decode_bf16_values_20261207.json): B8 H32/KV8 D128 Lk4096 19.8-27.4 ->
// 13.9-22.0 ms, GQA 8 B4 Lk8192 14.3-17.2 -> 10.0-16.2, B1 H8/KV2 Lk4096 0.43-0.46 ->
// 0.31-0.38. Unmeasured on AVX-512 builds without BF16 and on NEON.
constexpr bool kWidenedValuesAllRows = true;

// A call long enough (about a millisecond on a core or more) to go to the pool's extra
// threads while other processes keep the cores busy (cpu/thread_pool.h): this many
// multiply-adds, or this many bytes of K and V read. Shorter calls lose more to waking and
// preempting those threads than they gain: B1 H32/KV8 D128 Lk1024 float32 (8 MiB) with
// stress-ng on both cores, 0.26 -> 0.40 ms a call with them (kernel harness).
constexpr int64_t kLongJobMacs = 64 << 20;
constexpr int64_t kLongJobBytes = 16 << 20;
