"""Our XLA path's P @ V on 16-bit decode rows, three ways (one per process: the lowering
reads jax_sdpa.reference when a call is first traced), beside jax.nn's xla:

  split  P as hi + lo 16-bit parts stacked as rows of one 16-bit matmul (the default,
         reference._probs_times_values)
  f32    P in fp32, so XLA converts V to fp32 (before: SPLIT_PV_MAX_ROWS = 0)
  v16    P rounded to V's dtype (what jax.nn does; 8 / 11 bits of P)

    python3 benchmarks/xla_pv_variants.py --variant split|f32|v16|jax.nn [--out DIR]

Times with gpu_decode.py's harness (K dependent calls in one jit, median per call).
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import gpu_decode  # noqa: E402
import jax_sdpa  # noqa: E402
from jax_sdpa import reference  # noqa: E402

ROWS = [gpu_decode.BENCH_ROWS[i] for i in (2, 3, 9, 0)] + [
    ("B1 H32/KV8 Lk2048 D192", "bf16", 1, 32, 8, 2048, 192)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True, choices=("split", "f32", "v16", "jax.nn"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.variant in ("f32", "v16"):
        reference.SPLIT_PV_MAX_ROWS = 0
    if a.variant == "v16":
        reference._pv_dtype = lambda v_dtype, acc: v_dtype
    if a.variant == "jax.nn":
        fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")  # noqa
    else:
        fn = lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, implementation="xla")  # noqa
    out = []
    for name, dt, B, Hq, Hk, Lk, D in ROWS:
        nbytes, K, res = gpu_decode.bench_one(dt, B, Hq, Hk, Lk, D,
                                              impls={a.variant: (fn, True)}, target_s=15e-3)
        r = res[a.variant]
        out.append(dict(case=name, variant=a.variant, bytes=nbytes, K=K, **r))
        cell = f"{r['GBps']:.0f} GB/s {r['us']:.1f} us" if "us" in r else f"ERR {r['error'][:80]}"
        print(f"pv {a.variant:<7} {name:<30} {cell}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"xla_pv_{a.variant}.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=out), f,
                      indent=1)


if __name__ == "__main__":
    main()
