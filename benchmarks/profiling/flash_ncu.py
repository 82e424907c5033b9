"""One forward + backward call of a flash benchmark row (benchmarks/gpu_flash_check.py
BENCH_ROWS) through our CUDA flash kernels, for Nsight Compute to profile:

    ncu --clock-control none -k regex:flash_bwd_wgmma -c 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 -P benchmarks/profiling/flash_ncu.py --row D512

The call runs twice (compile + one more).
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import gpu_flash_check as fc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="D512", help="substring of a bench row name")
    args = ap.parse_args()
    fc.registered()
    name, dts, B, H, L, D, causal = next(r for r in fc.BENCH_ROWS if args.row in r[0])
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    q, k, v = (jax.random.normal(x, (B, H, L, D), fc.DTYPES[dts]) for x in (kq, kk, kv))
    wr = 0 if causal else -1

    def fb(q, k, v):
        o, lse = fc.flash_fwd(q, k, v, wr=wr)
        return fc.flash_bwd(q, k, v, o, lse, o, wr=wr)

    f = jax.jit(fb)
    for _ in range(2):
        jax.block_until_ready(f(q, k, v))
    print("ran", name, flush=True)


if __name__ == "__main__":
    main()
