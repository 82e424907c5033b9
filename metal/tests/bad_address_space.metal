// Negative test for the syntax check: mixes address spaces the way MSL forbids.
// check_syntax.sh must reject this file (the good .metal files must pass).
#include "../kernels/sdpa_common.metal"

[[kernel]] void bad_address_space(device float* x [[buffer(0)]],
                                  constant SdpaMetalParams& p [[buffer(1)]],
                                  uint3 tgp [[threadgroup_position_in_grid]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]],
                                  uint tid [[thread_index_in_threadgroup]]) {
  MSL_TG_ARRAY(float, tile, 64);
  threadgroup float* t = x;  // error: device pointer into a threadgroup pointer
  device float* d = tile;    // error: threadgroup pointer into a device pointer
  d[tid] = t[tid] + p.scale;
}
