"""Tile configurations of the fp32 tensor-core flash forward (cuda/flash/flash_fwd_tc.cuh) timed
side by side on the GPU, one process: JAX_SDPA_FLASH_FWD_CFG is read by the launcher on
every call, so one compiled executable serves every configuration.

    python3 -P benchmarks/tuning/flash_fwd_sweep.py [--out DIR]

Needs a tuning build (-DJAX_SDPA_TUNING=ON). Each configuration's output is compared with
the default's under the tolerance policy's "kernel_variant" case (jax_sdpa/oracle.py;
flagged DIFFERS beyond it, never chosen). Prints one JSON line per (row, config) and a best
line per row.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_sdpa import oracle  # noqa: E402

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("gpu_flash_check",
                                               os.path.join(os.path.dirname(_here), "gpu_flash_check.py"))
gfc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gfc)

ROWS = [  # name, B, H, L, D, causal, configs (first = default)
    ("SD3 B2 H38 L4250 D64 fp32", 2, 38, 4250, 64, False, ["", "64x4s2", "64x8s2", "32x4s3"]),
    ("B2 H16 L8192 D64 fp32 causal", 2, 16, 8192, 64, True, ["", "64x4s2", "32x4s3"]),
    ("fp32 B1 H16 L8192 D128", 1, 16, 8192, 128, False, ["", "32x4s2", "16x8s3"]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    gfc.registered()
    bound = oracle.tolerance("float32", case="kernel_variant")
    results = []
    for name, B, H, L, D, causal, cfgs in ROWS:
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(x, (B, H, L, D), jnp.float32) for x in ks)
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        f = jax.jit(lambda q, k, v: gfc.flash_fwd(q, k, v, wr=0 if causal else -1)[0])
        ref = None
        best = None
        for cfg in cfgs:
            os.environ["JAX_SDPA_FLASH_FWD_CFG"] = cfg
            try:
                o = np.asarray(jax.block_until_ready(f(q, k, v)))
                ts = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(q, k, v))
                    ts.append(time.perf_counter() - t0)
                t = float(np.median(ts))
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(row=name, cfg=cfg or "default", error=str(e)[:200])),
                      flush=True)
                continue
            if ref is None:
                ref = o
            diff = oracle.max_rel_error(o, ref, floor=oracle.OWN_MAGNITUDE)
            differs = bool(diff > bound or not np.isfinite(o).all())
            r = dict(row=name, cfg=cfg or "default", ms=t * 1e3, tflops=flops / t / 1e12,
                     max_rel_diff_vs_default=diff, differs=differs)
            print(json.dumps(r), flush=True)
            results.append(r)
            if not differs and (best is None or t < best[1]):
                best = (cfg or "default", t)
        os.environ.pop("JAX_SDPA_FLASH_FWD_CFG", None)
        if best:
            print(f"fwd sweep best {name}: {best[0]} {flops / best[1] / 1e12:.1f} TFLOP/s",
                  flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "flash_fwd_sweep.json"), "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=results), fh,
                      indent=1)


if __name__ == "__main__":
    main()
