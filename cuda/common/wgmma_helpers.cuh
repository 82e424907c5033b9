// Hopper warpgroup MMA (wgmma, sm_90a only) wrappers for the flash kernels: shared-memory
// matrix descriptors, fence / commit / wait, and the m64nNk16 shapes the wgmma flash kernels use
// (cuda/flash/flash_fwd_wgmma.cu, cuda/flash/flash_bwd_wgmma.cu).
// The m64nNk16 f32 accumulator of a warpgroup: warp w (of 4) holds rows 16 w + lane / 4 and
// + 8; register 4 i + e is column 8 i + 2 (lane % 4) + (e & 1) of row + 8 (e >> 1).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_sdpa {
namespace cuda_common {

// Byte offset of 16-byte unit u (0..7) of row r in a 128-byte-swizzled chunk tile
// ([rows][64] 16-bit elements, the layout wgmma_desc describes).
__device__ __forceinline__ uint32_t swizzle128_offset(int r, int u) {
  return static_cast<uint32_t>(r * 128 + ((u ^ (r & 7)) << 4));
}

// A shared-memory matrix descriptor with the 128-byte swizzle (PTX "matrix descriptor"):
// start address, leading and stride byte offsets (all in 16-byte units, 14 bits each) and
// the swizzle mode in bits 62-63 (1 = 128 bytes). The tiles must be 1024-byte aligned.
// K-major operands (rows of 64 16-bit elements = one 128-byte line): LBO unused (16), SBO =
// 1024 (the next 8 rows). MN-major (transposed) operands: LBO = the next 64-wide chunk tile
// along M / N, SBO = 1024 (the next 8 rows along K).
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t smem_addr, uint32_t lbo_bytes,
                                               uint32_t sbo_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFFu) << 32) | (uint64_t{1} << 62);
}

// Orders this thread's register writes of an accumulator before the next wgmma reads it.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// d (+)= A B, m64nNk16 with f32 accumulators (N / 2 registers a thread), A and B 16-bit in
// shared memory (descriptors a, b); scale_d 0: d = A B. kTransA / kTransB = 0: the operand
// is K-major; 1: MN-major (transposed: M / N contiguous in each 128-byte line, e.g. V stored
// key-major as B, or dO stored row-major as A = dO^T). One specialization of WgmmaM64K16
// per (16-bit type, N): the PTX type name, the shape and the register list differ.
template <typename T, int N>
struct WgmmaM64K16;

template <typename T, int N, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], uint64_t a, uint64_t b,
                                             int scale_d) {
  WgmmaM64K16<T, N>::template run<kTransA, kTransB>(d, a, b, scale_d);
}

// Operand lists of R = N / 2 accumulator registers: the PTX list "{%0, ..., %R-1}", the
// scale_d predicate source (%R+2), the tail "a-desc, b-desc, p, scale-a, scale-b, trans-a,
// trans-b" (%R, %R+1, the trans flags %R+3, %R+4 as "n" immediates) and the "+f" outputs.
#define JAX_SDPA_WGMMA_REGS_16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define JAX_SDPA_WGMMA_PRED_16 "%18"
#define JAX_SDPA_WGMMA_TAIL_16 "%16, %17, p, 1, 1, %19, %20;\n}\n"
#define JAX_SDPA_WGMMA_OUTS_16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define JAX_SDPA_WGMMA_REGS_32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define JAX_SDPA_WGMMA_PRED_32 "%34"
#define JAX_SDPA_WGMMA_TAIL_32 "%32, %33, p, 1, 1, %35, %36;\n}\n"
#define JAX_SDPA_WGMMA_OUTS_32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define JAX_SDPA_WGMMA_REGS_128 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define JAX_SDPA_WGMMA_PRED_128 "%130"
#define JAX_SDPA_WGMMA_TAIL_128 "%128, %129, p, 1, 1, %131, %132;\n}\n"
#define JAX_SDPA_WGMMA_OUTS_128 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

#define JAX_SDPA_WGMMA_DEF(T, PTX, N, R)                                                   \
  template <>                                                                              \
  struct WgmmaM64K16<T, N> {                                                               \
    template <int kTransA, int kTransB>                                                    \
    __device__ static __forceinline__ void run(float (&d)[R], uint64_t a, uint64_t b,      \
                                               int scale_d) {                              \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " JAX_SDPA_WGMMA_PRED_##R ", 0;\n"    \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " "       \
                   JAX_SDPA_WGMMA_REGS_##R ", " JAX_SDPA_WGMMA_TAIL_##R                   \
                   : JAX_SDPA_WGMMA_OUTS_##R                                               \
                   : "l"(a), "l"(b), "r"(scale_d), "n"(kTransA), "n"(kTransB));            \
    }                                                                                      \
  };

JAX_SDPA_WGMMA_DEF(__nv_bfloat16, "bf16", 32, 16)
JAX_SDPA_WGMMA_DEF(__half, "f16", 32, 16)
JAX_SDPA_WGMMA_DEF(__nv_bfloat16, "bf16", 64, 32)
JAX_SDPA_WGMMA_DEF(__half, "f16", 64, 32)
JAX_SDPA_WGMMA_DEF(__nv_bfloat16, "bf16", 256, 128)
JAX_SDPA_WGMMA_DEF(__half, "f16", 256, 128)
#undef JAX_SDPA_WGMMA_DEF
#undef JAX_SDPA_WGMMA_REGS_16
#undef JAX_SDPA_WGMMA_PRED_16
#undef JAX_SDPA_WGMMA_TAIL_16
#undef JAX_SDPA_WGMMA_OUTS_16
#undef JAX_SDPA_WGMMA_REGS_32
#undef JAX_SDPA_WGMMA_PRED_32
#undef JAX_SDPA_WGMMA_TAIL_32
#undef JAX_SDPA_WGMMA_OUTS_32
#undef JAX_SDPA_WGMMA_REGS_128
#undef JAX_SDPA_WGMMA_PRED_128
#undef JAX_SDPA_WGMMA_TAIL_128
#undef JAX_SDPA_WGMMA_OUTS_128

}  // namespace cuda_common
}  // namespace jax_sdpa
