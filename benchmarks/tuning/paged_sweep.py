"""Paged decode (`jax_sdpa.paged_attention`, our CUDA paged kernel) under its variants, beside
the same row read contiguously and the read ceiling, one process. Needs a tuning build
(-DJAX_SDPA_TUNING=ON) for the CFG settings (decode_tc_kernel<..., PAGED>'s W,S variants,
cuda/decode/decode_kernels.h); the other settings run on any build.

    python3 -P benchmarks/tuning/paged_sweep.py [--rows SUBSTRING,...] [--out DIR]

Settings per row: the default (the TMA kernel where pages hold whole 16-key tiles at D128 /
D256), TMA=off (the cp.async kernel) and its CFG=W,S variants on shuffled pages ([P, S, Hk, D], the
peers' layout, benchmarks/gpu_peers.py), the default on pages in order and on head-major
pages ([P, Hk, S, D]), the contiguous cache with lengths (our decode kernels), and the read
ceiling (K and V summed by one XLA reduction). Each paged setting's out is compared with the
default's under the "kernel_variant" tolerance (jax_sdpa/oracle.py). GB/s counts q, K, V and
out once.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "0")  # never time the test-only poisoning

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import gpu_decode as gd  # noqa: E402
import jax_sdpa  # noqa: E402
from jax_sdpa import oracle  # noqa: E402

# (name, dtype, B, Hq, Hk, Lk, D, page size): the peers' paged rows and a long single row.
ROWS = [
    ("B8 H32/KV8 Lk8192 D128 page 64", jnp.bfloat16, 8, 32, 8, 8192, 128, 64),
    ("B64 H32/KV8 Lk2048 D128 page 16", jnp.bfloat16, 64, 32, 8, 2048, 128, 16),
    ("B8 H32/KV8 Lk8192 D64 fp16 page 16", jnp.float16, 8, 32, 8, 8192, 64, 16),
    ("B1 H32/KV8 Lk32768 D128 page 16", jnp.bfloat16, 1, 32, 8, 32768, 128, 16),
    ("B4 H32/KV8 Lk8192 D256 page 32", jnp.bfloat16, 4, 32, 8, 8192, 256, 32),
]
CFGS = ["4,3", "4,4", "8,2", "8,3", "8,4", "16,2"]
KNOB = "JAX_SDPA_CUDA_DECODE_"


def pools(k, v, page_size, shuffled, head_major):
    """[B, Lk, Hk, D] k, v -> page pools and the page table [B, Lk / page_size]."""
    b, lk, hk, d = k.shape
    per = lk // page_size
    perm = (np.random.default_rng(1).permutation(b * per) if shuffled
            else np.arange(b * per)).astype(np.int32)

    def pool(x):
        pages = x.reshape(b * per, page_size, hk, x.shape[-1])
        p = jnp.zeros_like(pages).at[perm].set(pages)
        return p.transpose(0, 2, 1, 3) if head_major else p
    return pool(k), pool(v), jnp.asarray(perm.reshape(b, per))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", default="", help="comma-separated substrings of rows")
    args = ap.parse_args()
    only = [r for r in args.rows.split(",") if r]
    info = gd.env_info()
    print(json.dumps(info), flush=True)
    results = []
    for name, dt, B, Hq, Hk, Lk, D, S in ROWS:
        if only and not any(o in name for o in only):
            continue
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(ks[0], (B, Hq, 1, D), jnp.float32).astype(dt)
        k = jax.random.normal(ks[1], (B, Lk, Hk, D), jnp.float32).astype(dt)
        v = jax.random.normal(ks[2], (B, Lk, Hk, D), jnp.float32).astype(dt)
        lens = jnp.full((B,), Lk, jnp.int32)
        esz = jnp.dtype(dt).itemsize
        nbytes = esz * (2 * B * Hq * D + 2 * B * Hk * Lk * D)
        K = gd.calls_for(nbytes / 3.0e12 + 8e-6)
        tol = oracle.tolerance(jnp.dtype(dt).name, case="kernel_variant")
        settings = [("default", {}, True, False)]
        settings += [("TMA=off", {"TMA": "off"}, True, False)]
        settings += [(f"CFG={c}", {"CFG": c}, True, False) for c in CFGS]
        settings += [("pages in order", {}, False, False), ("head-major pages", {}, True, True)]
        ref = None
        rows = []
        for label, knobs, shuffled, head_major in settings:
            for kn in ("CFG", "TMA"):
                os.environ.pop(KNOB + kn, None)
            for kn, val in knobs.items():
                os.environ[KNOB + kn] = val
            kp, vp, table = pools(k, v, S, shuffled, head_major)
            layout = "PHSD" if head_major else "PSHD"
            fn = lambda q_, kp_, vp_, t_=table, l_=layout: jax_sdpa.paged_attention(  # noqa: E731
                q_, kp_, vp_, t_, lens, kv_layout=l_, implementation="cuda")
            try:
                o = np.asarray(jax.jit(fn)(q, kp, vp).astype(jnp.float32), np.float64)
                ref = o if ref is None else ref
                rel = oracle.max_rel_error(o, ref, floor=oracle.OWN_MAGNITUDE)
                t = gd._time_loop(fn, (q, kp, vp), K)
                rec = dict(setting=label, us=t * 1e6, GBps=nbytes / t / 1e9,
                           agrees_with_default=bool(np.isfinite(o).all() and rel <= tol),
                           rel_vs_default=rel)
            except Exception as e:  # noqa: BLE001
                rec = dict(setting=label, error=(str(e).splitlines() or ["?"])[0][:160])
            rows.append(rec)
            print(f"paged {name:<36} {label:<18} " + (
                f"{rec['GBps']:6.0f} GB/s {rec['us']:7.1f} us rel {rec['rel_vs_default']:.1e}"
                if "us" in rec else f"ERR {rec['error'][:90]}"), flush=True)
        for kn in ("CFG", "TMA"):
            os.environ.pop(KNOB + kn, None)
        qs = q.transpose(0, 2, 1, 3)
        contiguous = lambda q_, k_, v_: jax_sdpa.dot_product_attention(  # noqa: E731
            q_, k_, v_, key_value_seq_lengths=lens)
        extra = [("contiguous, lengths", contiguous, None), ("read ceiling", gd._read_kv, None)]
        if D == 64:  # the contiguous kernel's W,S variants (tuning builds)
            extra += [(f"contiguous CFG={c}", contiguous, c) for c in CFGS[2:]]
        for label, fn, cfg in extra:
            if cfg:
                os.environ[KNOB + "CFG"] = cfg
            t = gd._time_loop(fn, (qs, k, v), K)  # the knob is read as the executable runs
            os.environ.pop(KNOB + "CFG", None)
            rows.append(dict(setting=label, us=t * 1e6, GBps=nbytes / t / 1e9))
            print(f"paged {name:<36} {label:<18} {nbytes / t / 1e9:6.0f} GB/s {t * 1e6:7.1f} us",
                  flush=True)
        results.append(dict(case=name, dtype=jnp.dtype(dt).name, B=B, Hq=Hq, Hk=Hk, Lk=Lk, D=D,
                            page_size=S, bytes=nbytes, K=K, results=rows))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    path = os.path.join(args.out, f"paged_sweep_{stamp}.json")
    with open(path, "w") as f:
        json.dump(dict(env=info, rows=results), f, indent=1, default=float)
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
