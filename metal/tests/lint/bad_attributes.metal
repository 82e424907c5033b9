// Negative test for lint_kernels.py: compiles (and would run in the emulator, which binds by
// position), but Metal binds by attribute: buffer indices skip 1, and simdgroup/lane are swapped.
#include "../../kernels/sdpa_common.metal"

template <typename T>
[[kernel]] void bad_attributes(device T* x [[buffer(0)]], device T* y [[buffer(2)]],
                               uint3 tgp [[threadgroup_position_in_grid]],
                               uint sg [[thread_index_in_simdgroup]],
                               uint lane [[simdgroup_index_in_threadgroup]],
                               uint tid [[thread_index_in_threadgroup]]) {
  y[tid] = x[tid] + T(sg + lane);
}
MSL_INSTANTIATE_KERNEL("bad_attributes", bad_attributes, float)
