"""One decode call per benchmark row, for Nsight Compute to profile (the kernels'
memory throughput, stall reasons, occupancy and launch configuration), ours and,
with --peers, jax.nn's cudnn and xla implementations of the same call:

    ncu --clock-control none -k regex:'decode_|flash|sdpa|gemm|fusion' \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 -P benchmarks/profiling/decode_ncu.py --rows 0 --peers cudnn

Each call runs twice (compile + one more): profile the second (--launch-skip).
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import gpu_decode as gd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="0,2,3")
    ap.add_argument("--peers", default="", help="comma list of jax.nn implementations: cudnn,xla")
    args = ap.parse_args()
    gd.register()
    for i in args.rows.split(","):
        # "h0", "h1": gd.HOST_ROWS (tiny calls: the kernels' fixed costs)
        row = gd.HOST_ROWS[int(i[1:])] if i.startswith("h") else gd.BENCH_ROWS[int(i)]
        name, dt, B, Hq, Hk, Lk, D = row
        q, k, v = gd._row_inputs(dt, B, Hq, Hk, Lk, D)
        f = jax.jit(lambda q, k, v: gd.ours(q, k, v)[0])
        for _ in range(2):
            jax.block_until_ready(f(q, k, v))
        print("ran ours", name, flush=True)
        qs, ks, vs = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # jax.nn: [B, L, H, D]
        for impl in filter(None, args.peers.split(",")):
            g = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q, k, v, implementation=impl))
            try:
                for _ in range(2):
                    jax.block_until_ready(g(qs, ks, vs))
                print("ran", impl, name, flush=True)
            except Exception as e:  # noqa: BLE001 (cudnn refuses fp32, D > 256)
                print("skip", impl, name, str(e).splitlines()[0][:100], flush=True)


if __name__ == "__main__":
    main()
