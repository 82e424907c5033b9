// The flash family's tuning table: the tile choices of the tuned kernels, one row each with
// its reason and the results file it came from (one H200, TFLOP/s,
// benchmarks/results/h200/flash_tuning/). Variants a sweep can pick instead are built with
// -DJAX_SDPA_TUNING=ON (flash_fwd_tc.cuh, flash_bwd_tc_f32.cu).
#pragma once

namespace jax_sdpa {
namespace cuda_flash {
namespace tuning {

// A forward tile configuration, "<keys>x<warps>s<stages>".
struct FwdTile {
  int keys, warps, stages;
};

// flash_fwd_tc_kernel (fp32, D, Dv <= 64): 64 keys a tile, 8 warps, 3 K/V stages (174 KB,
// one block an SM). SD3 B2 H38 L4250: 64x4s2 88.5, 64x8s2 88.0, 64x8s3 93.2, 32x4s3 80.0;
// causal L8192: 86.5 / - / 91.8 / 76.3 (fwd_sweep.json).
constexpr FwdTile kFwdNarrow{64, 8, 3};

// ... (D, Dv <= 128): 32 keys, 8 warps, 2 stages (203 KB). B1 H16 L8192: 32x8s2 115.6,
// 32x4s2 74.3, 16x8s3 95.5 (fwd_sweep.json).
constexpr FwdTile kFwdWide{32, 8, 2};

// flash_bwd_tc_kernel (TF32): no run-time guards in the mma loops (flat), ldmatrix fragments
// (ldsm), and at D <= 64 K's and V's A fragments in registers (kreg, vreg). SD3 fwd+bwd:
// base 74.3, flat 79.6, ldsm 77.4, flat_ldsm 82.2, +kreg 82.8, +kvreg 84.7; D128 L8192: base
// 89.8, flat_ldsm 101.8 (bwd_sweep.json). 3xTF32 runs the base kernel.
// (Variant bits as flash_bwd_tc.cuh defines them: flat 1, ldsm 2, kreg 4, vreg 8; at
// D > 64 the launcher runs flat_ldsm.)
constexpr int kBwdTf32Variant = 1 | 2 | 4 | 8;

}  // namespace tuning
}  // namespace cuda_flash
}  // namespace jax_sdpa
