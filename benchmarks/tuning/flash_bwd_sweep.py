"""Run-time variants of the fp32 flash backward (JAX_SDPA_FLASH_BWD_VARIANT, read by the C++
launcher on every call, so one compiled executable serves all of them; TF32 only) timed side
by side on the GPU, one process. Needs a tuning build (-DJAX_SDPA_TUNING=ON).

    python3 -P benchmarks/tuning/flash_bwd_sweep.py [--out DIR] [--budget SECONDS]

Each variant's dq, dk, dv are compared with the default kernel's under the tolerance
policy's "kernel_variant" case (jax_sdpa/oracle.py; flagged DIFFERS beyond it, never
chosen). Prints one JSON line per (row, variant) and a best line per row.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
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

VARIANTS = ("base", "flat", "ldsm", "flat_ldsm", "flat_ldsm_kreg", "flat_ldsm_kvreg")
ROWS = [  # (name, B, H, L, D, causal)
    ("SD3 B2 H38 L4250 D64 fp32", 2, 38, 4250, 64, False),
    ("fp32 B1 H16 L8192 D128", 1, 16, 8192, 128, False),
    ("SD3 B2 H38 L4250 D64 fp32 causal", 2, 38, 4250, 64, True),
]
KNOB = "JAX_SDPA_FLASH_BWD_VARIANT"


def run_sweep(budget_s=55.0, variants=VARIANTS):
    saved = os.environ.get(KNOB)
    bound = oracle.tolerance("float32", grad=True, case="kernel_variant")
    t_start = time.perf_counter()
    out = []
    try:
        for name, B, H, L, D, causal in ROWS:
            kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
            q, k, v = (jax.random.normal(x, (B, H, L, D), jnp.float32) for x in (kq, kk, kv))
            flops = 4 * B * H * L * L * D / (2 if causal else 1)
            wr = 0 if causal else -1
            fwd = jax.jit(lambda q, k, v, wr=wr: gfc.flash_fwd(q, k, v, wr=wr))

            def fb(q, k, v, wr=wr):
                o, lse = gfc.flash_fwd(q, k, v, wr=wr)
                return gfc.flash_bwd(q, k, v, o, lse, o, wr=wr)  # dout = out: any dense tensor

            fbj = jax.jit(fb)
            os.environ.pop(KNOB, None)
            t_fwd = gfc.median_time(fwd, (q, k, v))
            ref = [np.asarray(x) for x in jax.block_until_ready(fbj(q, k, v))]  # the default's
            recs = []
            for var in variants:
                if D > 64 and "reg" in var:
                    continue  # D > 64 runs flat_ldsm for these (no register room)
                if time.perf_counter() - t_start > budget_s:
                    print(f"bwd_sweep: budget {budget_s:.0f}s spent, skipping the rest",
                          flush=True)
                    break
                os.environ[KNOB] = var
                rec = dict(sweep="bwd", row=name, variant=var)
                try:
                    g = jax.block_until_ready(fbj(q, k, v))
                    diffs = [oracle.max_rel_error(x, r, floor=oracle.OWN_MAGNITUDE)
                             for x, r in zip(g, ref)]
                    del g
                    t = gfc.median_time(fbj, (q, k, v))
                    rec.update(fwdbwd_ms=t * 1e3, fwdbwd_tflops=3.5 * flops / t / 1e12,
                               fwd_ms=t_fwd * 1e3, bwd_ms_est=(t - t_fwd) * 1e3,
                               bwd_tflops_est=2.5 * flops / max(t - t_fwd, 1e-9) / 1e12,
                               rel_diff_dq=diffs[0], rel_diff_dk=diffs[1], rel_diff_dv=diffs[2],
                               status="DIFFERS" if max(diffs) > bound or
                               not all(math.isfinite(x) for x in diffs) else "ok")
                except Exception as e:  # noqa: BLE001
                    rec["error"] = str(e)[:300]
                print(json.dumps(rec), flush=True)
                out.append(rec)
                recs.append(rec)
            good = [r for r in recs if r.get("status") == "ok"]
            if good:
                best = min(good, key=lambda r: r["fwdbwd_ms"])
                base = next((r for r in recs if r["variant"] == "base" and "fwdbwd_ms" in r),
                            None)
                print(json.dumps(dict(sweep="bwd", row=name, best=best["variant"],
                                      fwdbwd_ms=best["fwdbwd_ms"],
                                      fwdbwd_tflops=best["fwdbwd_tflops"],
                                      bwd_ms_est=best["bwd_ms_est"],
                                      speedup_vs_base=(base["fwdbwd_ms"] / best["fwdbwd_ms"]
                                                       if base else None))), flush=True)
            del q, k, v, ref
    finally:
        if saved is None:
            os.environ.pop(KNOB, None)
        else:
            os.environ[KNOB] = saved
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None, help="folder for flash_bwd_sweep.json")
    ap.add_argument("--budget", type=float, default=55.0, help="seconds of variants in all")
    a = ap.parse_args()
    if gfc.BWD not in gfc.registered():
        sys.exit(f"{gfc.BWD} is not registered: no backward to sweep")
    if gfc.HIGHEST:
        print("note: JAX_SDPA_CUDA_FP32=highest: every variant runs the default kernel",
              flush=True)
    results = run_sweep(a.budget)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "flash_bwd_sweep.json"), "w") as fh:
            json.dump(dict(device=str(jax.devices()[0]), jax=jax.__version__, rows=results), fh,
                      indent=1)


if __name__ == "__main__":
    main()
