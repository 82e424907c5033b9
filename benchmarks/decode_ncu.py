"""One decode call per benchmark row, for Nsight Compute to profile (the kernels'
memory throughput, stall reasons and occupancy):

    ncu -k regex:decode_ --section SpeedOfLight --section WarpStateStats ... \
        python3 -P benchmarks/decode_ncu.py [--rows 0,2,3]

Each row runs its call twice (compile + one more), so profile with --launch-skip 0
and count two launches per row (plus the combine kernel where it runs).
"""
import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_decode as gd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="0,2,3")
    args = ap.parse_args()
    gd.register(use_module=True)
    for i in args.rows.split(","):
        name, dt, B, Hq, Hk, Lk, D = gd.BENCH_ROWS[int(i)]
        q, k, v = gd._row_inputs(dt, B, Hq, Hk, Lk, D)
        f = jax.jit(lambda q, k, v: gd.ours(q, k, v)[0])
        for _ in range(2):
            jax.block_until_ready(f(q, k, v))
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
