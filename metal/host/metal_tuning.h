// The Metal plan's tuning table: every threshold of the kernel choice (host_plan.h), one row
// each with its reason and the results file it came from. The kernels have not run on a Mac
// yet (docs/metal.md), so no row is a measurement: each says what it rests on until a GPU
// sweep replaces it.
#pragma once

#include <cstdint>

namespace jax_sdpa {
namespace metal {
namespace tuning {

// Queries (Lq) up to which the decode kernel serves, the tiled kernel above: the decode
// kernel packs a GQA group's query heads into one threadgroup so that each K/V row is read
// once for all of them, which pays while few queries share the reads. Chosen, not measured
// (no results file; the emulator's timings say nothing about a GPU).
constexpr int64_t kDecodeMaxQueries = 8;

// Keys (Lk) from which the decode kernel splits over the keys (two passes: the splits, then
// a combine); below, one pass. Chosen, not measured (no results file).
constexpr int64_t kSplitMinKeys = 1024;

// Threadgroups the splits aim for (splits = ceil(this / threadgroups without splits)), and
// the least keys a split takes: enough threadgroups to fill the GPU, each with enough keys to
// amortize its partial and the combine. Chosen, not measured (no results file).
constexpr int64_t kSplitTargetThreadgroups = 256;
constexpr int64_t kSplitMinKeysEach = 256;

}  // namespace tuning
}  // namespace metal
}  // namespace jax_sdpa
