// Host-side check of decode_tma_kernel's shared-memory layout (cuda/decode/decode_tma.cuh):
// the head-dim order (qk_chunk), the dv order (pv_chunk) and the key-row permutation
// (key_row) are bijections, and every 16-byte fragment load of a warp is free of bank
// conflicts under the 128-byte swizzle (8 lanes a phase: their 16-byte bank groups must
// differ). decode_wide_tma_kernel (cuda/decode/decode_wide_tma.cuh) lands each 64-wide chunk of
// its 16-key tiles as its own swizzled tile and reads it with the D = Dv = 64 orders, so
// check_qk<64> / check_pv<64> cover it too; decode_tma_kernel does the same at D = Dv =
// 256 (kv_offset: one [keys][64] tile a chunk), check_qk<256> / check_pv<256>. Built and run by
// tests/test_decode_tma_layout.py; prints what fails.
#include <cstdio>
#include <set>

#include "cuda/decode/decode_tma.cuh"

using namespace jax_sdpa::cuda_decode;

static int failures = 0;

#define CHECK(cond, ...)              \
  do {                                \
    if (!(cond)) {                    \
      ++failures;                     \
      std::printf("FAIL: " __VA_ARGS__); \
      std::printf("\n");              \
    }                                 \
  } while (0)

// Worst bank-conflict degree of one warp-wide 16-byte load (byte offsets per lane).
static int conflict_degree(const unsigned (&addr)[32]) {
  int worst = 1;
  for (int phase = 0; phase < 4; ++phase) {
    for (int x = 8 * phase; x < 8 * phase + 8; ++x) {
      std::set<unsigned> distinct;
      for (int y = 8 * phase; y < 8 * phase + 8; ++y)
        if ((addr[y] / 16) % 8 == (addr[x] / 16) % 8) distinct.insert(addr[y]);
      if (static_cast<int>(distinct.size()) > worst) worst = static_cast<int>(distinct.size());
    }
  }
  return worst;
}

// Is `seen` exactly {0, ..., n - 1}?
static bool covers(const std::set<int>& seen, int n) {
  return static_cast<int>(seen.size()) == n && *seen.begin() == 0 && *seen.rbegin() == n - 1;
}

// Stage keys of the D256 checks (W4: 64); a warp's 16-key tile is at row 0 of each chunk tile.
constexpr int kStageKeys = 64;

// kv_offset covers a 16-key tile's rows exactly once: every 16-byte chunk of every row at
// its own offset, each inside its row's own 128-byte line(s).
template <int DIM>
static void check_offsets() {
  std::set<unsigned> seen;
  for (int row = 0; row < 16; ++row)
    for (int c = 0; c < DIM / 8; ++c) {
      const unsigned off = kv_offset<DIM, kStageKeys>(row, c);
      const unsigned line = DIM > 128 ? (c / 8) * kStageKeys + row : row * (DIM / 64) + c / 8;
      CHECK(off / 128 == line, "kv_offset<%d>(%d, %d) left its line", DIM, row, c);
      seen.insert(off);
    }
  CHECK(static_cast<int>(seen.size()) == 16 * DIM / 8, "kv_offset<%d> is not a bijection", DIM);
}

template <int D>
static void check_qk() {
  constexpr int NKC = D / 32;
  std::set<int> chunks;
  for (int c = 0; c < NKC; ++c)
    for (int t = 0; t < 4; ++t) chunks.insert(qk_chunk<D>(c, t));
  CHECK(covers(chunks, D / 8), "qk_chunk<%d> is not a bijection onto the row's %d chunks", D,
        D / 8);
  for (int c = 0; c < NKC; ++c)
    for (int ntile = 0; ntile < 2; ++ntile) {
      unsigned addr[32];
      for (int lane = 0; lane < 32; ++lane)
        addr[lane] = kv_offset<D, kStageKeys>(key_row((lane >> 2) + 8 * ntile),
                                              qk_chunk<D>(c, lane & 3));
      const int deg = conflict_degree(addr);
      CHECK(deg == 1, "K fragment load D%d step %d n-tile %d: %d-way bank conflict", D, c, ntile,
            deg);
    }
}

template <int DV>
static void check_pv() {
  constexpr int NVC = DV / 64;
  std::set<int> chunks;
  for (int c = 0; c < NVC; ++c)
    for (int g = 0; g < 8; ++g) chunks.insert(pv_chunk<DV>(c, g));
  CHECK(covers(chunks, DV / 8), "pv_chunk<%d> is not a bijection onto the row's %d chunks", DV,
        DV / 8);
  const int keys[4] = {0, 1, 8, 9};  // v0..v3: mma keys 2t + {0, 1, 8, 9}
  for (int c = 0; c < NVC; ++c)
    for (int kk : keys) {
      unsigned addr[32];
      for (int lane = 0; lane < 32; ++lane)
        addr[lane] = kv_offset<DV, kStageKeys>(key_row(2 * (lane & 3) + kk),
                                               pv_chunk<DV>(c, lane >> 2));
      const int deg = conflict_degree(addr);
      CHECK(deg == 1, "V fragment load DV%d step %d keys 2t+%d: %d-way bank conflict", DV, c, kk,
            deg);
    }
}

int main() {
  std::set<int> rows;
  for (int k = 0; k < 16; ++k) rows.insert(key_row(k));
  CHECK(covers(rows, 16), "key_row is not a permutation of the 16 rows of a tile");
  // The swizzle keeps a chunk inside its 128-byte line and is a bijection on a line.
  for (int row = 0; row < 16; ++row) {
    std::set<unsigned> seen;
    for (int c = 0; c < 16; ++c) {
      const unsigned off = swizzled<2>(row, c);
      CHECK(off / 128 == static_cast<unsigned>(row * 2 + c / 8),
            "swizzled<2>(%d, %d) left its line", row, c);
      seen.insert(off);
    }
    CHECK(seen.size() == 16, "swizzled<2> is not a bijection on row %d", row);
  }
  // At D <= 128 kv_offset is the one-tile swizzle.
  for (int row = 0; row < 16; ++row)
    for (int c = 0; c < 16; ++c)
      CHECK((kv_offset<128, kStageKeys>(row, c) == swizzled<2>(row, c)), "kv_offset<128> moved");
  check_offsets<64>();
  check_offsets<128>();
  check_offsets<256>();
  check_qk<64>();
  check_qk<128>();
  check_qk<256>();
  check_pv<64>();
  check_pv<128>();
  check_pv<256>();
  std::printf("%s (%d failures)\n", failures == 0 ? "ok" : "FAILED", failures);
  return failures == 0 ? 0 : 1;
}
