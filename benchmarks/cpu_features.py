"""The cpu kernel's packed sequences, soft-capping and paged decode, each beside the call it
must be measured against, in one run (direct calls of the FFI targets, so the rows time the
kernel and nothing of dispatch):

- packed: B1 H8 D64 L4096, 8 equal segments, against the same call unpacked (full
  attention), forward and forward+backward;
- softcap: the same shape with logits_soft_cap=30 against it without, forward and
  forward+backward (D64 and D128);
- paged: decode B8 Hq32/Hk8 Lk4096 D128 fp32 reading pages in place (both kv layouts,
  page sizes 16 and 64)
  against the contiguous cache, and the xla gather (jax_sdpa.paged_attention's xla path)
  beside them.

The machine is shared: each pair is timed interleaved (A, B, A, B, ...), medians reported,
with the load average before and after. Usage:
  python benchmarks/cpu_features.py [--only packed,softcap,paged] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from jax_sdpa import _ext
from jax_sdpa.primitives import ffi_call_args


def _load():
    return os.getloadavg()


def _fwd_fn(q, k, v, **kw):
    operands, attrs = ffi_call_args(**kw)
    results = (jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
               jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", results)
    return jax.jit(lambda q, k, v, *ops: call(q, k, v, *ops, **attrs)), (q, k, v, *operands)


def _fwd_bwd_fn(q, k, v, dout, **kw):
    operands, attrs = ffi_call_args(**kw)
    fwd = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", (
        jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
        jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))
    bwd = jax.ffi.ffi_call("jax_sdpa_cpu_bwd", tuple(
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))

    def f(q, k, v, dout, *ops):
        out, lse = fwd(q, k, v, *ops, **attrs)
        return bwd(q, k, v, out, lse, dout, *ops, **attrs)

    return jax.jit(f), (q, k, v, dout, *operands)


def interleaved(fns, reps, min_time=0.0):
    """{name: median seconds} timing each (jitted, args) in turn, `reps` rounds."""
    times = {name: [] for name in fns}
    for name, (f, args) in fns.items():
        jax.block_until_ready(f(*args))  # compile + warm
    start = time.perf_counter()
    r = 0
    while r < reps or time.perf_counter() - start < min_time:
        for name, (f, args) in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - t0)
        r += 1
    return {name: statistics.median(t) for name, t in times.items()}, r


def _row(suite, rows, name, secs, rounds, load0, ref=None):
    row = dict(suite=suite, row=name, median_ms=secs * 1e3, rounds=rounds,
               load_before=load0[0], load_after=_load()[0])
    if ref is not None:
        row["ratio_to_reference"] = secs / ref
    rows.append(row)
    extra = "" if ref is None else f"  ratio {secs / ref:.3f}"
    print(f"{suite:8s} {name:55s} {secs * 1e3:9.2f} ms{extra}  (load {load0[0]:.1f})",
          flush=True)


def bench_packed(rows, reps):
    rng = np.random.default_rng(0)
    b, h, l, d, nseg = 1, 8, 4096, 64, 8
    q, k, v, dout = (jnp.asarray(rng.standard_normal((b, h, l, d)), jnp.float32)
                     for _ in range(4))
    ids = jnp.asarray(np.repeat(np.arange(nseg, dtype=np.int32), l // nseg)[None])
    seg = dict(q_segment_ids=ids, kv_segment_ids=ids)
    for direction, make, args in (("fwd", _fwd_fn, (q, k, v)),
                                  ("fwd+bwd", _fwd_bwd_fn, (q, k, v, dout))):
        load0 = _load()
        t, r = interleaved({"unpacked": make(*args, scale=0.125),
                            "packed": make(*args, scale=0.125, **seg)}, reps)
        name = f"B{b} H{h} D{d} L{l} {direction}"
        _row("packed", rows, f"{name} unpacked", t["unpacked"], r, load0)
        _row("packed", rows, f"{name} {nseg} equal segments", t["packed"], r, load0,
             ref=t["unpacked"])


def bench_softcap(rows, reps):
    rng = np.random.default_rng(1)
    for b, h, l, d in ((1, 8, 2048, 64), (1, 8, 2048, 128)):
        q, k, v, dout = (jnp.asarray(rng.standard_normal((b, h, l, d)), jnp.float32)
                         for _ in range(4))
        for direction, make, args in (("fwd", _fwd_fn, (q, k, v)),
                                      ("fwd+bwd", _fwd_bwd_fn, (q, k, v, dout))):
            load0 = _load()
            sc = 1 / np.sqrt(d)
            t, r = interleaved({"plain": make(*args, scale=sc),
                                "capped": make(*args, scale=sc, logits_soft_cap=30.0)}, reps)
            name = f"B{b} H{h} D{d} L{l} {direction}"
            _row("softcap", rows, f"{name} no cap", t["plain"], r, load0)
            _row("softcap", rows, f"{name} logits_soft_cap=30", t["capped"], r, load0,
                 ref=t["plain"])


def bench_paged(rows, reps):
    rng = np.random.default_rng(2)
    b, hq, hk, lk, d = 8, 32, 8, 4096, 128
    for page in (16, 64):
        pps = lk // page
        npages = b * pps
        q = jnp.asarray(rng.standard_normal((b, hq, 1, d)), jnp.float32)
        k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
        v = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
        table = rng.permutation(npages).astype(np.int32).reshape(b, pps)
        # pages [P, Hk, S, D] ("PHSD") holding the same cache: page table[b, j] = keys j*S.. of row b
        kp = np.empty((npages, hk, page, d), np.float32)
        vp = np.empty((npages, hk, page, d), np.float32)
        for bi in range(b):
            for j in range(pps):
                kp[table[bi, j]] = k[bi, :, j * page:(j + 1) * page]
                vp[table[bi, j]] = v[bi, :, j * page:(j + 1) * page]
        kvl = jnp.full((b,), lk, jnp.int32)
        kc, vc = jnp.asarray(k), jnp.asarray(v)
        table = jnp.asarray(table)
        phsd = (jnp.asarray(kp), jnp.asarray(vp))
        pshd = (jnp.asarray(kp.transpose(0, 2, 1, 3)), jnp.asarray(vp.transpose(0, 2, 1, 3)))
        sc = 1 / np.sqrt(d)

        def paged(layout, impl):
            return jax.jit(lambda q, kp, vp, t, n: jax_sdpa.paged_attention(
                q, kp, vp, t, n, kv_layout=layout, implementation=impl))

        contiguous = jax.jit(lambda q, k, v, n: jax_sdpa.scaled_dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation="cpu"))
        fns = {
            "contiguous cpu": (contiguous, (q, kc, vc, kvl)),
            "paged PHSD cpu": (paged("PHSD", "cpu"), (q, *phsd, table, kvl)),
            "paged PSHD cpu": (paged("PSHD", "cpu"), (q, *pshd, table, kvl)),
            "paged PHSD xla (gather)": (paged("PHSD", "xla"), (q, *phsd, table, kvl)),
        }
        load0 = _load()
        t, r = interleaved(fns, reps)
        name = f"decode B{b} Hq{hq}/Hk{hk} Lk{lk} D{d} fp32 page {page}"
        ref = t["contiguous cpu"]
        for key in fns:
            _row("paged", rows, f"{name} {key}", t[key], r, load0,
                 ref=None if key == "contiguous cpu" else ref)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="packed,softcap,paged")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if _ext.module("_sdpa_cpu") is None:
        sys.exit("the cpu kernel is not built")
    rows = []
    cpu = _ext.module("_sdpa_cpu")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=platform.machine(), cpus=os.cpu_count(), isa=cpu.isa(),
                threads=cpu.num_threads(), jax=jax.__version__, python=platform.python_version(),
                load_start=_load())
    for part in a.only.split(","):
        {"packed": bench_packed, "softcap": bench_softcap, "paged": bench_paged}[part](rows, a.reps)
    meta["load_end"] = _load()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
