"""Our CUDA decode kernels on the GPU: correctness matrix + timing beside the peers.

Run on the GPU machine with the package installed (benchmarks/gpu_run.sh builds it), from
outside the checkout:
    python3 -P benchmarks/gpu_decode.py --out $OUT

Calls the installed package's FFI target `jax_sdpa_cuda_fwd` directly (jax.ffi.ffi_call).
Sections (--only):
  check      correctness vs the float64 oracle (jax_sdpa.oracle) under its tolerance
             policy (16-bit: twice our XLA path's error in the same dtype plus a floor),
             outputs poisoned, the cache past its length NaN
  bench      the decode rows of the README's GPU table + fp32 + B64 rows: ours vs jax.nn
             xla / cudnn, GB/s, fraction of the measured device copy bandwidth
  crossover  ours vs jax.nn cudnn over batch, keys and queries per kv head
The kernel variants under their knobs are timed by benchmarks/tuning/decode_sweep.py (which
imports this file's rows and timing).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_sdpa import oracle, vjp  # noqa: E402  (the float64 oracle + tolerance policy)
from jax_sdpa.config import StaticParams  # noqa: E402
from jax_sdpa.primitives import ffi_call_args  # noqa: E402
from jax_sdpa.dispatch import cuda_decode_workspace_bytes_for  # noqa: E402

TARGET = "jax_sdpa_cuda_fwd"
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


# ---------------------------------------------------------------------------
# registration + the call
# ---------------------------------------------------------------------------
def register():
    """The installed package's decode target (jax_sdpa._ext registers it on import)."""
    from jax_sdpa import _ext

    assert _ext.has_backend("cuda"), _ext.status()
    return "jax_sdpa._sdpa_cuda"


def ours(q, k, v, *, scale=None, mask=None, sinks=None, qlen=None, kvlen=None, wl=-1, wr=-1,
         bottom_right=True, seq_major=False):
    if seq_major:
        B, Lq, Hq, D = q.shape
    else:
        B, Hq, Lq, D = q.shape
    out_shape = q.shape[:-1] + (v.shape[-1],)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    Hk, Lk, Dv = (k.shape[2], k.shape[1], v.shape[3]) if seq_major else \
        (k.shape[1], k.shape[2], v.shape[3])
    # The third result: the kernel's workspace (split-K partials + counters), sized as
    # jax_sdpa's lowering sizes it; dropped.
    ws = cuda_decode_workspace_bytes_for(B, Hq, Hk, Lq, Lk, Dv)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct((B, Hq, Lq), jnp.float32),
         jax.ShapeDtypeStruct((ws,), jnp.uint8)),
    )
    operands, attrs = ffi_call_args(
        scale=scale, window_left=wl, window_right=wr, bottom_right=bottom_right,
        seq_major=seq_major, mask=mask, sinks=sinks, q_lengths=qlen, kv_lengths=kvlen,
        fp32_precision=0)
    out, lse, _ = call(q, k, v, *operands, **attrs)
    return out, lse


# ---------------------------------------------------------------------------
# correctness matrix
# ---------------------------------------------------------------------------
HEAD_DIMS = [(64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256),
             (512, 512), (192, 128), (96, 64)]


def _cases():
    cases = []
    # every head dim x dtype, GQA 4, random kv lengths, sinks on odd ones
    for n, (D, Dv) in enumerate(HEAD_DIMS):
        for dt in ("bf16", "fp16", "fp32"):
            cases.append(dict(name=f"D{D}/{Dv} {dt} gqa4 kvlen" + (" sinks" if n % 2 else ""),
                              dt=dt, B=3, Hq=8, Hk=2, Lq=1, Lk=517 + 37 * n, D=D, Dv=Dv,
                              kvlen="rand", sinks=(n % 2 == 1)))
    for dt in ("bf16", "fp32", "fp16"):
        D = 128
        c = lambda **kw: dict(dt=dt, D=D, Dv=D, **kw)  # noqa: E731
        cases += [
            c(name=f"{dt} G8 Lk1000", B=2, Hq=32, Hk=4, Lq=1, Lk=1000),
            c(name=f"{dt} MQA G16 (16 rows)", B=2, Hq=16, Hk=1, Lq=1, Lk=777, kvlen="rand"),
            c(name=f"{dt} Lq3 G4 causal-br qlen kvlen", B=4, Hq=8, Hk=2, Lq=3, Lk=600, wr=0,
              kvlen="rand", qlen="rand"),
            c(name=f"{dt} Lq5 G8 causal top-left (3 row chunks)", B=2, Hq=16, Hk=2, Lq=5, Lk=300,
              wr=0, bottom_right=False),
            c(name=f"{dt} bool mask [B,1,Lq,Lk] + empty row", B=3, Hq=8, Hk=2, Lq=2, Lk=450,
              mask="bool_b1"),
            c(name=f"{dt} additive f32 mask [1,Hq,1,Lk]", B=2, Hq=8, Hk=2, Lq=1, Lk=640,
              mask="add_f32"),
            c(name=f"{dt} additive bf16 mask full with -inf", B=2, Hq=8, Hk=4, Lq=2, Lk=333,
              mask="add_bf16_full"),
            c(name=f"{dt} sinks [B,Hq] + kvlen 0 rows", B=3, Hq=8, Hk=2, Lq=1, Lk=500,
              sinks="batch", kvlen="zero1"),
            c(name=f"{dt} window 100 bottom-right", B=2, Hq=8, Hk=2, Lq=4, Lk=1200, wl=100, wr=0),
            c(name=f"{dt} seq_major", B=2, Hq=8, Hk=2, Lq=2, Lk=700, seq_major=True,
              kvlen="rand"),
            c(name=f"{dt} Lk1", B=2, Hq=8, Hk=2, Lq=1, Lk=1),
            c(name=f"{dt} Lk17 qlen0 row", B=2, Hq=8, Hk=2, Lq=1, Lk=17, qlen="zero1"),
            c(name=f"{dt} Lk4250 long", B=1, Hq=8, Hk=8, Lq=1, Lk=4250),
            c(name=f"{dt} B64 single pass", B=64, Hq=16, Hk=8, Lq=1, Lk=200, kvlen="rand",
              sinks=True),
        ]
    for dt in ("bf16", "fp32"):
        cases += [
            dict(name=f"{dt} D512 G8 Lk3000 kvlen sinks", dt=dt, B=2, Hq=16, Hk=2, Lq=1,
                 Lk=3000, D=512, Dv=512, kvlen="rand", sinks=True),
            dict(name=f"{dt} D256 MQA Lq2 G8 (16 rows) causal", dt=dt, B=2, Hq=8, Hk=1, Lq=2,
                 Lk=900, D=256, Dv=256, wr=0),
        ]
    # D256 at 8 rows a block (16 bits: decode_tma_kernel with one tile a 64-wide chunk on
    # sm_90+) and D512 (the wide kernels at 16 bits, decode_wide_tma_kernel on sm_90+;
    # fp32: the CUDA-core kernels): the features.
    for dt in ("bf16", "fp16"):
        cases += _feature_cases(dt, 256, top_left="Lq2 G4 causal top-left", top_left_lq=2,
                                long=("B2 G4 Lk8192 kvlen", 8))
    for dt in ("bf16", "fp16", "fp32"):
        cases += _feature_cases(dt, 512, top_left="Lq3 G4 causal top-left (2 row chunks)",
                                top_left_lq=3, long=("B1 G8 Lk8192 kvlen", 4))
    return cases


def _feature_cases(dt, D, top_left, top_left_lq, long):
    """One head dim's feature cases (D = Dv): causal both alignments, masks, sinks with
    empty rows, window, seq_major, lengths; `long` = (name, Hk) of a Lk8192 case."""
    c = lambda **kw: dict(dt=dt, D=D, Dv=D, **kw)  # noqa: E731
    p = f"{dt} D{D}"
    return [
        c(name=f"{p} Lq2 G4 causal-br qlen kvlen", B=3, Hq=8, Hk=2, Lq=2, Lk=700, wr=0,
          kvlen="rand", qlen="rand"),
        c(name=f"{p} {top_left}", B=2, Hq=8, Hk=2, Lq=top_left_lq, Lk=300, wr=0,
          bottom_right=False),
        c(name=f"{p} bool mask [B,1,Lq,Lk] + empty row", B=2, Hq=8, Hk=2, Lq=2, Lk=450,
          mask="bool_b1"),
        c(name=f"{p} additive bf16 mask full with -inf", B=2, Hq=8, Hk=4, Lq=2, Lk=333,
          mask="add_bf16_full"),
        c(name=f"{p} sinks [B,Hq] + kvlen 0 rows", B=3, Hq=8, Hk=2, Lq=1, Lk=500,
          sinks="batch", kvlen="zero1"),
        c(name=f"{p} window 100 bottom-right", B=2, Hq=8, Hk=2, Lq=2, Lk=1200, wl=100, wr=0),
        c(name=f"{p} seq_major kvlen", B=2, Hq=8, Hk=2, Lq=2, Lk=700, seq_major=True,
          kvlen="rand"),
        c(name=f"{p} Lk17 qlen0 row", B=2, Hq=8, Hk=2, Lq=1, Lk=17, qlen="zero1"),
        c(name=f"{p} {long[0]}", B=2, Hq=32, Hk=long[1], Lq=1, Lk=8192, kvlen="rand"),
    ]


def _make_inputs(case, rng):
    dt = DTYPES[case["dt"]]
    B, Hq, Hk, Lq, Lk, D, Dv = (case[x] for x in ("B", "Hq", "Hk", "Lq", "Lk", "D", "Dv"))
    q = jnp.asarray(rng.standard_normal((B, Hq, Lq, D)), dt)
    k = jnp.asarray(rng.standard_normal((B, Hk, Lk, D)), dt)
    v = jnp.asarray(rng.standard_normal((B, Hk, Lk, Dv)), dt)
    kw = dict(wl=case.get("wl", -1), wr=case.get("wr", -1),
              bottom_right=case.get("bottom_right", True))
    kvl = case.get("kvlen")
    if kvl == "rand":
        kw["kvlen"] = rng.integers(0, Lk + 1, size=B).astype(np.int32)
        kw["kvlen"][0] = Lk  # one full row
        if B > 2:
            kw["kvlen"][1] = Lk + 5  # clamped
    elif kvl == "zero1":
        kw["kvlen"] = np.full(B, Lk, np.int32)
        kw["kvlen"][1] = 0
    ql = case.get("qlen")
    if ql == "rand":
        kw["qlen"] = rng.integers(0, Lq + 1, size=B).astype(np.int32)
    elif ql == "zero1":
        kw["qlen"] = np.full(B, Lq, np.int32)
        kw["qlen"][1] = 0
    mk = case.get("mask")
    if mk == "bool_b1":
        m = rng.random((B, 1, Lq, Lk)) < 0.7
        m[0, 0, 0, :] = False  # a fully masked row
        kw["mask"] = m
    elif mk == "add_f32":
        kw["mask"] = rng.standard_normal((1, Hq, 1, Lk)).astype(np.float32)
    elif mk == "add_bf16_full":
        m = rng.standard_normal((B, Hq, Lq, Lk)).astype(np.float32)
        m[rng.random(m.shape) < 0.3] = -np.inf
        m[1, 2, 0, :] = -np.inf  # fully masked
        kw["mask"] = np.asarray(jnp.asarray(m, jnp.bfloat16).astype(jnp.float32))
        kw["mask_dtype"] = jnp.bfloat16
    sk = case.get("sinks")
    if sk is True:
        kw["sinks"] = (rng.standard_normal((1, Hq)) * 2).astype(np.float32)
    elif sk == "batch":
        kw["sinks"] = (rng.standard_normal((B, Hq)) * 2).astype(np.float32)
    return q, k, v, kw


def run_check(seed=0, verbose=True, quick=False):
    rng = np.random.default_rng(seed)
    results = []
    cases = _cases()
    if quick:
        cases = cases[::3]
    for case in cases:
        q, k, v, kw = _make_inputs(case, rng)
        D = case["D"]
        scale = 1.0 / math.sqrt(D)
        seq_major = case.get("seq_major", False)
        call_kw = dict(scale=scale, wl=kw["wl"], wr=kw["wr"], bottom_right=kw["bottom_right"],
                       seq_major=seq_major)
        for name in ("qlen", "kvlen", "sinks"):
            if name in kw:
                call_kw[name] = jnp.asarray(kw[name])
        if "mask" in kw:
            call_kw["mask"] = jnp.asarray(kw["mask"], kw.get("mask_dtype", None))
        qi, ki, vi = q, k, v
        if "kvlen" in kw:
            # A fixed-size cache holds anything past its length: NaN there must not leak.
            past = (np.arange(case["Lk"])[None, None, :, None]
                    >= np.minimum(kw["kvlen"], case["Lk"])[:, None, None, None])
            ki, vi = (jnp.where(past, jnp.nan, x).astype(x.dtype) for x in (k, v))
        if seq_major:
            qi, ki, vi = (jnp.swapaxes(x, 1, 2) for x in (qi, ki, vi))
        rec = dict(case=case["name"], dtype=case["dt"],
                   shape=[case[x] for x in ("B", "Hq", "Hk", "Lq", "Lk", "D", "Dv")])
        if verbose:
            print(f"...  {case['name']}", flush=True)  # names the case if the process dies
        try:
            out, lse = jax.jit(lambda a, b, c: ours(a, b, c, **call_kw))(qi, ki, vi)
            out = np.asarray(out.astype(jnp.float32), np.float64)
            lse = np.asarray(lse, np.float64)
            if seq_major:
                out = np.swapaxes(out, 1, 2)
        except Exception as e:  # noqa: BLE001
            rec.update(ok=False, error=str(e)[:400])
            results.append(rec)
            if verbose:
                print(f"FAIL {case['name']}: {str(e)[:300]}", flush=True)
            continue
        okw = dict(scale=scale, mask=kw.get("mask"), sinks=kw.get("sinks"),
                   q_lengths=kw.get("qlen"), kv_lengths=kw.get("kvlen"), window_left=kw["wl"],
                   window_right=kw["wr"], bottom_right=kw["bottom_right"])
        ref_out, ref_lse = oracle.forward(
            np.asarray(q.astype(jnp.float32)), np.asarray(k.astype(jnp.float32)),
            np.asarray(v.astype(jnp.float32)), **okw)
        nan = bool(np.isnan(out).any() or np.isnan(lse).any())
        rel = oracle.max_rel_error(out, ref_out) if not nan else float("inf")
        xla_err = None
        if case["dt"] != "fp32":  # our XLA path in the same dtype, on the clean cache
            params = StaticParams(scale=scale, window_left=kw["wl"], window_right=kw["wr"],
                                  bottom_right=kw["bottom_right"], implementation="xla")
            opt = [call_kw.get(n) for n in ("mask", "sinks", "qlen", "kvlen")]
            xo = jax.jit(lambda a, b, c: vjp.attention(a, b, c, *opt, params)[0])(q, k, v)
            xla_err = oracle.max_rel_error(np.asarray(xo.astype(jnp.float32)), ref_out)
        dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[case["dt"]]
        tol = oracle.tolerance(dtype, "cuda", xla_error=xla_err)
        inf_ok = bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)))
        fin = np.isfinite(ref_lse)
        lse_err = oracle.lse_error(lse, ref_lse) if not nan else float("inf")
        lse_tol = oracle.lse_tolerance(dtype, "cuda")
        zero_ok = bool(np.all(out[np.isneginf(ref_lse)] == 0))
        ok = (not nan) and rel <= tol and inf_ok and lse_err <= lse_tol and zero_ok
        rec.update(ok=ok, rel_err=rel, lse_err=lse_err, nan=nan, neg_inf_lse_match=inf_ok,
                   empty_rows_zero=zero_ok, empty_rows=int((~fin).sum()))
        results.append(rec)
        if verbose:
            print(f"{'ok  ' if ok else 'FAIL'} {case['name']:<48} rel={rel:.2e} lse={lse_err:.1e} "
                  f"empty={rec['empty_rows']} nan={nan} infmatch={inf_ok} zeros={zero_ok}",
                  flush=True)
    n_ok = sum(r["ok"] for r in results)
    print(f"check: {n_ok}/{len(results)} passed", flush=True)
    return results


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------
# Each timed execution runs K dependent calls: a while loop of K / UNROLL trips with
# UNROLL calls unrolled in its body. The execution's fixed cost (dispatch, the host's wait
# for the result: about 0.3 ms on the H200 machine) is spread over K, so K is large:
# with K = 8..32 (our first harness) that cost added 20-30 us to every call of every
# implementation (the GPU idled between executions: benchmarks/profiling/decode_profile.py).
UNROLL = 16


def calls_for(est_s, target_s=30e-3):
    """K for one execution of about target_s: a multiple of UNROLL in [64, 1024]."""
    K = int(target_s / max(est_s, 1e-7)) // UNROLL * UNROLL
    return max(4 * UNROLL, min(1024, K))


def _loop_fn(fn, K, unroll=UNROLL):
    """jit of K dependent calls of fn(q, *rest) -> out (a tiny function of out is fed
    back into q): a while loop of K / unroll trips, `unroll` calls per trip."""

    def run(q, *rest):  # k, v are arguments, never captured constants
        def body(_, q):
            out = fn(q, *rest)
            return q + (out.reshape(-1)[0] * 1e-30).astype(q.dtype)

        return jax.lax.fori_loop(0, K, body, q, unroll=max(1, min(unroll, K)))

    return jax.jit(run)


def _time_compiled(f, args, K, reps=5):
    jax.block_until_ready(f(*args))  # warm-up (and, the first time, compile)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / K


def _time_loop(fn, args, K, reps=5):
    """K dependent calls of fn in one jit (see _loop_fn); returns median seconds per call."""
    return _time_compiled(_loop_fn(fn, K), args, K, reps)


def copy_bandwidth(nbytes=4 << 30):
    """Device-to-device memcpy (cupy, CUDA events), counting read + write; falls
    back to an XLA elementwise pass."""
    try:
        import cupy as cp  # type: ignore

        a = cp.ones((nbytes,), cp.uint8)
        b = cp.empty_like(a)
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        ts = []
        for i in range(12):
            e0.record()
            cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, 0)
            e1.record()
            e1.synchronize()
            if i >= 2:
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e-3)
        del a, b
        cp.get_default_memory_pool().free_all_blocks()
        return 2 * nbytes / float(np.median(ts))
    except Exception as e:  # noqa: BLE001
        print("cupy copy failed, using XLA:", str(e)[:120], flush=True)
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    ts = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        ts.append(time.perf_counter() - t0)
    return 2 * nbytes / float(np.median(ts))  # read + write


BENCH_ROWS = [
    # name, dtype, B, Hq, Hk, Lk, D
    ("B8 H32/KV8 Lk8192 D128", "bf16", 8, 32, 8, 8192, 128),
    ("B1 H32/KV8 Lk32768 D128", "bf16", 1, 32, 8, 32768, 128),
    ("B1 H32/KV4 Lk8192 D512", "bf16", 1, 32, 4, 8192, 512),
    ("B1 H32/KV4 Lk1024 D512 fp16", "fp16", 1, 32, 4, 1024, 512),
    ("B64 H32/KV8 Lk2048 D128", "bf16", 64, 32, 8, 2048, 128),
    ("B8 H32/KV8 Lk8192 D128 fp32", "fp32", 8, 32, 8, 8192, 128),
    ("B1 H32/KV8 Lk32768 D128 fp32", "fp32", 1, 32, 8, 32768, 128),
    ("B1 H32/KV4 Lk8192 D512 fp32", "fp32", 1, 32, 4, 8192, 512),
    ("B64 H32/KV8 Lk2048 D128 fp32", "fp32", 64, 32, 8, 2048, 128),
    ("B1 H32/KV8 Lk8192 D256", "bf16", 1, 32, 8, 8192, 256),
]
# Host cost per call (decode_profile.py --host; decode_ncu.py rows h0, h1): decode calls so
# small that the GPU work is a few us, so the wall time a call is what the host spends
# issuing one (the FFI handler's planning, tensor-map encoding and launches; XLA's own
# launches for the peers) and the kernels' times are their fixed costs. One split at D128;
# split-K + combine at D512.
HOST_ROWS = [("host B1 H32/KV8 Lk64 D128", "bf16", 1, 32, 8, 64, 128),
             ("host B1 H32/KV4 Lk512 D512", "fp16", 1, 32, 4, 512, 512)]


def _row_inputs(dt, B, Hq, Hk, Lk, D, Lq=1, seed=1):
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    dtype = DTYPES[dt]
    q = jax.random.normal(kq, (B, Hq, Lq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, Hk, Lk, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, Hk, Lk, D), jnp.float32).astype(dtype)
    return q, k, v


def _impls(dt, D, seq_major_too=False, with_api=False):
    impls = {"ours": (lambda q, k, v: ours(q, k, v)[0], False)}
    if seq_major_too:
        impls["ours_seq_major"] = (lambda q, k, v: ours(q, k, v, seq_major=True)[0], True)
    impls["jax.nn xla"] = (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"), True)
    if dt != "fp32" and D <= 256:
        impls["jax.nn cudnn"] = (
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"), True)
    if with_api:
        import jax_sdpa  # the installed package

        # What a user gets: implementation=None (the dispatch's choice), and our own XLA
        # path, which it falls back to where neither CUDA kernel wins.
        impls["jax_sdpa auto"] = (lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v), True)
        impls["jax_sdpa xla"] = (lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, implementation="xla"), True)
        # Not attention: one XLA reduction that reads K and V once (scaled by a scalar of q,
        # so that the loop cannot hoist it). The harness's ceiling for a kernel that only
        # streams these bytes: per-call fixed costs included.
        impls["read K+V (xla sum)"] = (lambda q, k, v: _read_kv(q, k, v), False)
    return impls


def _read_kv(q, k, v):
    s = q.reshape(-1)[0].astype(jnp.float32)
    return (jnp.sum(k.astype(jnp.float32) * s) + jnp.sum(v.astype(jnp.float32) * s)).reshape(1)


def bench_one(dt, B, Hq, Hk, Lk, D, Lq=1, impls=None, target_s=30e-3):
    q, k, v = _row_inputs(dt, B, Hq, Hk, Lk, D, Lq)
    esz = jnp.dtype(DTYPES[dt]).itemsize
    nbytes = esz * (2 * B * Hq * Lq * D + 2 * B * Hk * Lk * D)
    K = calls_for(nbytes / 3.0e12 + 8e-6, target_s)
    res = {}
    for name, (fn, seq_major) in (impls or _impls(dt, D)).items():
        args = (q, k, v)
        if seq_major:
            args = tuple(jnp.swapaxes(x, 1, 2) for x in args)
        try:
            t = _time_loop(fn, args, K)
            res[name] = dict(us=t * 1e6, GBps=nbytes / t / 1e9)
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
            res[name] = dict(error=msg)
    return nbytes, K, res


def run_bench(copy_bw, rows=BENCH_ROWS):
    out = []
    for n, (name, dt, B, Hq, Hk, Lk, D) in enumerate(rows):
        nbytes, K, res = bench_one(dt, B, Hq, Hk, Lk, D,
                                   impls=_impls(dt, D, seq_major_too=n < 2, with_api=True))
        for r in res.values():
            if "GBps" in r:
                r["frac_copy"] = r["GBps"] * 1e9 / copy_bw
        out.append(dict(case=name, dtype=dt, B=B, Hq=Hq, Hk=Hk, Lk=Lk, D=D, bytes=nbytes, K=K,
                        results=res))
        cells = []
        for impl, r in res.items():
            cells.append(f"{impl}: " + (f"{r['GBps']:.0f} GB/s {r['us']:.1f}us ({r['frac_copy']:.2f})"
                                        if "GBps" in r else f"ERR {r['error'][:60]}"))
        print(f"{name:<32} " + " | ".join(cells), flush=True)
    return out


def run_crossover(dims=(128,)):
    """Ours vs jax.nn cudnn (and xla at D != 128) on decode shapes, bf16 H32/KV8: at D128
    over batch, cache length and query rows per kv head (the dispatch rule's grid); at
    other head dims (--crossover-dims) plain decode over batch and cache length (from
    Lk1024 at D > 256), and B8 Lk4096 at 8 / 16 / 32 query rows per kv head."""
    pts = []
    grid = []
    for D in dims:
        if D == 128:
            grid += [(B, Lk, 1, D) for B in (1, 8, 32, 128) for Lk in (512, 4096)]
            grid += [(8, 4096, Lq, D) for Lq in (2, 4, 8, 16)]
        else:
            lks = (1024, 2048, 8192) if D > 256 else (2048, 8192)
            grid += [(B, Lk, 1, D) for B in (1, 8, 32) for Lk in lks]
            grid += [(8, 4096, Lq, D) for Lq in (2, 4, 8)]  # R = 8 / 16 / 32
    for (B, Lk, Lq, D) in grid:
        keep = ("ours", "jax.nn cudnn") + (() if D == 128 else ("jax.nn xla", "jax_sdpa xla"))
        impls = {k_: v_ for k_, v_ in _impls("bf16", D, with_api=D != 128).items() if k_ in keep}
        nbytes, K, res = bench_one("bf16", B, 32, 8, Lk, D, Lq=Lq, impls=impls, target_s=15e-3)
        o = res.get("ours", {}).get("us")
        c = res.get("jax.nn cudnn", {}).get("us")
        x = res.get("jax.nn xla", {}).get("us")
        jx = res.get("jax_sdpa xla", {}).get("us")
        pts.append(dict(B=B, Hq=32, Hk=8, Lk=Lk, Lq=Lq, D=D, rows_per_kv_head=4 * Lq,
                        ours_us=o, cudnn_us=c, xla_us=x, jax_sdpa_xla_us=jx,
                        ratio=(c / o) if (o and c) else None))
        print(f"crossover D{D} B{B} Lk{Lk} Lq{Lq} (rows/kv head {4 * Lq}): ours {o} us, "
              f"cudnn {c} us, xla {x} us, jax_sdpa xla {jx} us, cudnn/ours "
              f"{pts[-1]['ratio']}", flush=True)
    return pts


def env_info():
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    try:
        info["gpu"] = jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        from jax._src.lib import cuda_versions  # type: ignore

        info["cudnn"] = cuda_versions.cudnn_get_version()
        info["cuda_runtime"] = cuda_versions.cuda_runtime_get_version()
        info["cuda_driver"] = cuda_versions.cuda_driver_get_version()
    except Exception as e:  # noqa: BLE001
        info["versions_error"] = str(e)[:200]
    try:
        nv = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20)
        info["nvcc"] = nv.stdout.strip().splitlines()[-1]
    except Exception:  # noqa: BLE001
        pass
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="check,bench,crossover")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="every third check case")
    ap.add_argument("--rows", default="", help="bench row indices, e.g. 0,2")
    ap.add_argument("--tag", default="", help="added to the JSON file name")
    ap.add_argument("--crossover-dims", default="128", help="head dims of --only crossover")
    args = ap.parse_args()
    src = register()
    info = env_info()
    info["ffi_source"] = src
    info["knobs"] = {k: v for k, v in os.environ.items() if k.startswith("JAX_SDPA_")}
    print(json.dumps(info), flush=True)
    result = dict(env=info)
    only = args.only.split(",")
    t0 = time.time()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M")
    path = os.path.join(args.out, f"gpu_decode_{'_'.join(only)}{args.tag}_{stamp}.json")

    def save():  # after every section: a later crash or timeout keeps what was measured
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=float)

    if "check" in only:
        result["check"] = run_check(quick=args.quick)
        save()
        print(f"[check took {time.time() - t0:.0f}s]", flush=True)
    if "bench" in only or "crossover" in only:
        bw = copy_bandwidth()
        result["copy_bandwidth_GBps"] = bw / 1e9
        print(f"device copy bandwidth (read+write): {bw / 1e9:.0f} GB/s", flush=True)
    if "bench" in only:
        rows = BENCH_ROWS
        if args.rows:
            rows = [BENCH_ROWS[int(i)] for i in args.rows.split(",")]
        result["bench"] = run_bench(result["copy_bandwidth_GBps"] * 1e9, rows)
        save()
        print(f"[bench done at {time.time() - t0:.0f}s]", flush=True)
    if "crossover" in only:
        result["crossover"] = run_crossover(
            tuple(int(d) for d in args.crossover_dims.split(",")))
        save()
        print(f"[crossover done at {time.time() - t0:.0f}s]", flush=True)
    save()
    print("wrote", path, flush=True)
    failed = [r["case"] for r in result.get("check", []) if not r["ok"]]
    if failed:
        print("FAILED:", failed, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
