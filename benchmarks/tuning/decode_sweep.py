"""Our CUDA decode kernels' variants (JAX_SDPA_CUDA_DECODE_* knobs, read by the host launcher
when it runs: one executable per setting) timed on the target rows of
benchmarks/gpu_decode.py, one process. Needs a tuning build (-DJAX_SDPA_TUNING=ON).

    python3 -P benchmarks/tuning/decode_sweep.py [--rows SUBSTRING,...] [--out DIR]

Each setting's out and lse are compared with the default setting's under the tolerance
policy's "kernel_variant" case (jax_sdpa/oracle.py; DIFFERS beyond it, never chosen). Prints
one line per (row, setting) and the best per row.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "0")  # never time the test-only poisoning

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import gpu_decode as gd  # noqa: E402
from jax_sdpa import oracle  # noqa: E402

# Target rows x knob settings. CFG = decode_tc_kernel's warps,stages (built for D128 and
# D512 only, cuda/decode/decode_kernels.h; a tuning build); L2 = its K/V copies' L2 prefetch size
# (default 128 on tensor cores, 0 for fp32; variants built for D128 and D512: the
# default W,S and D128 W8 S2; 132 = 128 with the lines marked evict-first in the L2);
# WIDE = NW,S of the wide-head kernel (D = Dv in {256, 512}; on fp32 D512 calls:
# decode_wide_f32_kernel, the default there, NW8 S3 / S2; "off": never); WIDE_TMA = NW,S,KT of
# decode_wide_tma_kernel (16-bit D = Dv = 512, sm_90+, the default there; D256 built as
# variants; "off": never); TMA = W,S of decode_tma_kernel (16-bit D = Dv = 128 and 256,
# sm_90+, the default there; "off": never); TMA_L2 = its tensor maps' L2 fetch size (0, 64, 128,
# 256); MIN_SPLIT_KB = least K+V bytes a split; SPLITS pins the split count; COMBINE
# picks the split-K merge. {} = the defaults. Rows: (name, dt, B, Hq, Hk, Lk, D).
# (LOCKSTEP, 129, 130, TMA MODE 1 / 2 and PDL are kernels tried and not kept:
# docs/cuda_decode.md.)
SWEEP = [
    # The split-K merge behind decode_tma_kernel: in a cluster (default) vs combine_kernel.
    (gd.BENCH_ROWS[0], [{}, {"COMBINE": "kernel"}]),
    (gd.BENCH_ROWS[1], [{}, {"COMBINE": "kernel"}]),
    (gd.BENCH_ROWS[2], [{}, {"WIDE_TMA": "off"}]),
    # fp32 D512: decode_wide_f32_kernel (default) vs decode_simt_kernel.
    (gd.BENCH_ROWS[7], [{}, {"WIDE": "off"}]),
    # D256: decode_tma_kernel (default W4 S3) variants vs decode_tc_kernel (TMA=off).
    (gd.BENCH_ROWS[9], [{}, {"TMA": "4,2"}, {"TMA": "2,4"}, {"TMA": "2,6"}, {"TMA": "6,2"},
                        {"COMBINE": "kernel"}, {"TMA": "off"}]),
    (("B16 H32/KV8 Lk4096 D256", "bf16", 16, 32, 8, 4096, 256),
     [{}, {"TMA": "4,2"}, {"TMA": "6,2"}, {"TMA": "off"}]),
    # D512 fp16 Lk1024 (fixed costs dominate): fewer, longer splits (default ~32).
    (gd.BENCH_ROWS[3], [{}, {"SPLITS": "24"}, {"SPLITS": "16"}, {"SPLITS": "8"}]),
]
KNOB = "JAX_SDPA_CUDA_DECODE_"
SWEEP_KNOBS = ("CFG", "SPLITS", "COMBINE", "L2", "WIDE", "WIDE_TMA", "TMA", "TMA_L2",
               "MIN_SPLIT_KB")


def run_sweep(copy_bw, budget_s=150.0, only=()):
    """Times `ours` on the target rows under each knob setting in SWEEP (the knobs
    are read by the host launcher when it runs, which XLA does once when it captures the
    call into a CUDA graph: so one executable per setting). Prints one line per setting
    and the best per row; stops adding settings once budget_s is spent."""
    os.environ[KNOB + "VERBOSE"] = "1"  # the launcher prints each new plan (W, S, splits)
    out = []
    t_start = time.time()
    for (name, dt, B, Hq, Hk, Lk, D), settings in SWEEP:
        if only and not any(o in name for o in only):
            continue
        q, k, v = gd._row_inputs(dt, B, Hq, Hk, Lk, D)
        dtype = jnp.dtype(gd.DTYPES[dt]).name
        bounds = (oracle.tolerance(dtype, case="kernel_variant"),
                  oracle.lse_tolerance(dtype, case="kernel_variant"))
        esz = jnp.dtype(gd.DTYPES[dt]).itemsize
        nbytes = esz * (2 * B * Hq * D + 2 * B * Hk * Lk * D)
        K = gd.calls_for(nbytes / 3.0e12 + 8e-6)
        rows = []
        ref = None  # the first (default) setting's out + lse: every variant must agree
        for st in settings:
            if time.time() - t_start > budget_s:
                print(f"sweep: budget {budget_s:.0f}s spent, skipping the rest", flush=True)
                break
            for kn in SWEEP_KNOBS:
                os.environ.pop(KNOB + kn, None)
            for kn, val in st.items():
                os.environ[KNOB + kn] = val
            label = ",".join(f"{kn}={val}" for kn, val in st.items()) or "default"
            # Fresh executables per setting: a command buffer replays the plan it recorded.
            f = gd._loop_fn(lambda q_, k_, v_: gd.ours(q_, k_, v_)[0], K)
            one = jax.jit(lambda q_, k_, v_: gd.ours(q_, k_, v_))
            try:
                o, l = (np.asarray(x.astype(jnp.float32), np.float64) for x in one(q, k, v))
                if ref is None:
                    ref = (o, l)
                rel = oracle.max_rel_error(o, ref[0], floor=oracle.OWN_MAGNITUDE)
                lse_d = oracle.lse_error(l, ref[1])
                agree = bool(np.isfinite(o).all() and rel <= bounds[0] and lse_d <= bounds[1])
                t = gd._time_compiled(f, (q, k, v), K, reps=5)
                rec = dict(setting=label, us=t * 1e6, GBps=nbytes / t / 1e9,
                           frac_copy=nbytes / t / copy_bw, agrees_with_default=agree,
                           rel_vs_default=rel, lse_vs_default=lse_d)
                print(f"sweep {name:<30} {label:<22} {rec['GBps']:6.0f} GB/s {rec['us']:7.1f} us "
                      f"({rec['frac_copy']:.2f}) {'agrees' if agree else 'DIFFERS'} "
                      f"rel {rel:.1e}", flush=True)
            except Exception as e:  # noqa: BLE001
                rec = dict(setting=label, error=str(e).splitlines()[0][:160] if str(e) else "?")
                print(f"sweep {name:<30} {label:<22} ERR {rec['error'][:80]}", flush=True)
            rows.append(rec)
        for kn in SWEEP_KNOBS:
            os.environ.pop(KNOB + kn, None)
        ok = [r for r in rows if "GBps" in r and r["agrees_with_default"]]
        if ok:
            best = max(ok, key=lambda r: r["GBps"])
            print(f"sweep best {name:<25} {best['setting']:<22} {best['GBps']:.0f} GB/s "
                  f"(default {ok[0]['GBps']:.0f})", flush=True)
        out.append(dict(case=name, dtype=dt, B=B, Hq=Hq, Hk=Hk, Lk=Lk, D=D, bytes=nbytes, K=K,
                        results=rows))
    os.environ.pop(KNOB + "VERBOSE", None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="", help="comma-separated substrings of sweep rows")
    ap.add_argument("--budget", type=float, default=150.0, help="seconds of settings in all")
    args = ap.parse_args()
    info = gd.env_info()
    info["ffi_source"] = gd.register()
    print(json.dumps(info), flush=True)
    bw = gd.copy_bandwidth()
    print(f"device copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", flush=True)
    result = dict(env=info, copy_bandwidth_GBps=bw / 1e9,
                  sweep=run_sweep(bw, args.budget, only=[r for r in args.rows.split(",") if r]))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    path = os.path.join(args.out, f"decode_sweep_{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=float)
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
