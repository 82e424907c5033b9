"""Our CUDA flash-attention prefill kernels (docs/cuda_flash.md) on the GPU:
correctness matrix against the float64 oracle (jax_sdpa.oracle), then the timing rows.

Run on the GPU machine after building the package with the CUDA backend:
    python3 -P benchmarks/gpu_flash_check.py --out $OUT               # TF32 fp32 + fp16/bf16
    JAX_SDPA_CUDA_FP32=highest python3 -P benchmarks/gpu_flash_check.py --only check

Calls `jax_sdpa_cuda_flash_fwd` and `jax_sdpa_cuda_flash_bwd` (as jax_sdpa._ext registers
them) directly through jax.ffi.ffi_call. Outputs are poisoned (JAX_SDPA_POISON_OUTPUTS=1) so
that an element the kernel forgets to write shows up as NaN. JAX_SDPA_CUDA_FP32=highest (read
here) passes fp32_precision = 1 (3xTF32) on the direct calls, judged by the tolerance policy's
case for it (fp32 gradients as exact as the outputs), and runs the API rows under
jax.default_matmul_precision("highest"); unset: TF32.
"""
from __future__ import annotations

import argparse
import json
import math
import os
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

FWD = "jax_sdpa_cuda_flash_fwd"
BWD = "jax_sdpa_cuda_flash_bwd"
DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}
HIGHEST = os.environ.get("JAX_SDPA_CUDA_FP32", "") == "highest"


def registered():
    """The flash targets jax_sdpa._ext registered from the CUDA module."""
    from jax_sdpa import _ext

    found = [name for name in (FWD, BWD) if name in _ext.ffi_targets()]
    if FWD not in found:
        sys.exit(f"{FWD} is not registered: {_ext.status().get('_sdpa_cuda')}")
    return found


def flash_fwd(q, k, v, *, scale=None, mask=None, sinks=None, qlen=None, kvlen=None, wl=-1,
              wr=-1, bottom_right=True, seq_major=False):
    """out, lse from our kernel; q/k/v head-major [B,H,L,D] or seq-major [B,L,H,D]."""
    if seq_major:
        B, Lq, Hq, D = q.shape
    else:
        B, Hq, Lq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    call = jax.ffi.ffi_call(FWD, (jax.ShapeDtypeStruct(q.shape[:-1] + (v.shape[-1],), q.dtype),
                                  jax.ShapeDtypeStruct((B, Hq, Lq), jnp.float32)))
    operands, attrs = ffi_call_args(
        scale=scale, window_left=wl, window_right=wr, bottom_right=bottom_right,
        seq_major=seq_major, mask=mask, sinks=sinks, q_lengths=qlen, kv_lengths=kvlen,
        fp32_precision=1 if HIGHEST else 0)
    return call(q, k, v, *operands, **attrs)


def flash_bwd(q, k, v, out, lse, dout, *, scale=None, mask=None, sinks=None, qlen=None,
              kvlen=None, wl=-1, wr=-1, bottom_right=True, seq_major=False):
    """dq, dk, dv from our backward kernel (same layouts as flash_fwd)."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    call = jax.ffi.ffi_call(BWD, tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))
    operands, attrs = ffi_call_args(
        scale=scale, window_left=wl, window_right=wr, bottom_right=bottom_right,
        seq_major=seq_major, mask=mask, sinks=sinks, q_lengths=qlen, kv_lengths=kvlen,
        fp32_precision=1 if HIGHEST else 0)
    return call(q, k, v, out, lse, dout, *operands, **attrs)


# ---------------------------------------------------------------------------
# the oracle (jax_sdpa.oracle) and the same-dtype XLA computation its policy compares with
# ---------------------------------------------------------------------------
def _oracle_kw(kw):
    return dict(scale=kw["scale"], mask=kw.get("mask"), sinks=kw.get("sinks"),
                q_lengths=kw.get("qlen"), kv_lengths=kw.get("kvlen"), window_left=kw["wl"],
                window_right=kw["wr"], bottom_right=kw["bottom_right"])


def xla_same_dtype(args, kw, dout, seq_major):
    """(out, (dq, dk, dv)) of our XLA path in the inputs' dtype (head-major float64): the
    error the tolerance policy allows twice of."""
    params = StaticParams(scale=float(kw["scale"]), window_left=int(kw["wl"]),
                          window_right=int(kw["wr"]), bottom_right=bool(kw["bottom_right"]),
                          seq_major=seq_major, implementation="xla")
    opt = [None if kw.get(n) is None else jnp.asarray(kw[n]) for n in ("mask", "sinks", "qlen",
                                                                       "kvlen")]
    if opt[0] is not None and opt[0].ndim < 4:
        opt[0] = opt[0].reshape((1,) * (4 - opt[0].ndim) + opt[0].shape)

    def f(q, k, v):
        return vjp.attention(q, k, v, *opt, params)[0]

    out, pullback = jax.vjp(f, *args)
    grads = pullback(jnp.asarray(dout, args[0].dtype))
    tr = (lambda x: np.swapaxes(x, 1, 2)) if seq_major else (lambda x: x)
    f64 = lambda x: tr(np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64))  # noqa: E731
    return f64(out), [f64(g) for g in grads]


# ---------------------------------------------------------------------------
# correctness matrix
# ---------------------------------------------------------------------------
def cases():
    out = []
    dims = [(64, 64), (72, 72), (80, 80), (96, 96), (128, 128), (192, 192), (256, 256),
            (320, 320), (512, 512), (512, 128), (128, 512), (96, 64), (8, 8), (40, 136)]
    for n, (D, Dv) in enumerate(dims):
        for dt in ("fp32", "fp16", "bf16"):
            out.append(dict(name=f"{dt} D{D}/Dv{Dv} gqa2 Lq{129 + n} Lk{200 + 11 * n}", dt=dt,
                            B=2, Hq=4, Hk=2, Lq=129 + n, Lk=200 + 11 * n, D=D, Dv=Dv,
                            sinks=n % 3 == 0, wr=0 if n % 2 else -1))
    for dt in ("fp32", "fp16", "bf16"):
        def c(**kw):
            return {**dict(dt=dt, D=64, Dv=64, B=2, Hq=4, Hk=2), **kw}

        out += [
            c(name=f"{dt} Lq1 Lk1", Lq=1, Lk=1),
            c(name=f"{dt} Lq7 Lk127", Lq=7, Lk=127),
            c(name=f"{dt} causal top-left Lq300 Lk200", Lq=300, Lk=200, wr=0,
              bottom_right=False),
            c(name=f"{dt} causal bottom-right Lq130 Lk333 qlen kvlen", Lq=130, Lk=333, wr=0,
              qlen="rand", kvlen="rand"),
            c(name=f"{dt} causal bottom-right Lq333 Lk130 (empty rows)", Lq=333, Lk=130, wr=0),
            c(name=f"{dt} window 37/5", Lq=257, Lk=257, wl=37, wr=5),
            c(name=f"{dt} window left only 50", Lq=200, Lk=300, wl=50, bottom_right=False),
            c(name=f"{dt} bool mask [B,1,Lq,Lk] + empty rows", Lq=100, Lk=150, mask="bool_b1"),
            c(name=f"{dt} bool mask [1,1,1,Lk]", Lq=65, Lk=190, mask="bool_k"),
            c(name=f"{dt} additive f32 [1,Hq,Lq,Lk] with -inf", Lq=70, Lk=99, mask="add_f32"),
            c(name=f"{dt} additive bf16 [B,1,1,Lk]", Lq=64, Lk=128, mask="add_bf16"),
            c(name=f"{dt} sinks [B,Hq] + kvlen 0", Lq=90, Lk=160, sinks="batch", kvlen="zero1"),
            c(name=f"{dt} qlen 0 row + sinks", Lq=50, Lk=60, sinks=True, qlen="zero1"),
            c(name=f"{dt} seq_major gqa4", Lq=150, Lk=170, seq_major=True, kvlen="rand",
              Hq=8),
            c(name=f"{dt} MQA", Lq=128, Lk=256, Hq=6, Hk=1),
            c(name=f"{dt} long Lq1025 Lk1100 causal", Lq=1025, Lk=1100, wr=0, B=1, Hq=2, Hk=1),
        ]
    out.append(dict(name="bf16 D512 B1 H4 L600 causal kvlen", dt="bf16", B=1, Hq=4, Hk=4,
                    Lq=600, Lk=600, D=512, Dv=512, wr=0, kvlen="rand"))
    for dt in ("fp16", "bf16"):  # the wide-head kernel (D, Dv in (256, 512]) with every feature
        out += [
            dict(name=f"{dt} D512 wide: bool mask [B,1,Lq,Lk] + sinks [B,Hq]", dt=dt, B=2, Hq=4,
                 Hk=2, Lq=100, Lk=150, D=512, Dv=512, mask="bool_b1", sinks="batch"),
            dict(name=f"{dt} D384/Dv264 wide: additive f32 with -inf, window 37/5", dt=dt, B=1,
                 Hq=4, Hk=1, Lq=70, Lk=99, D=384, Dv=264, mask="add_f32", wl=37, wr=5),
            dict(name=f"{dt} D512 wide: seq_major qlen 0 row + kvlen, top-left causal", dt=dt,
                 B=2, Hq=2, Hk=2, Lq=131, Lk=97, D=512, Dv=512, seq_major=True, qlen="zero1",
                 kvlen="rand", wr=0, bottom_right=False),
        ]
    # Pairs of 32-key blocks (the wgmma backward's clusters): an odd number of key tiles,
    # random lengths and a window, so a pair's band is the union of two blocks' bands.
    out.append(dict(name="bf16 D512 GQA2 Lq333 Lk517 window 100/20 qlen kvlen", dt="bf16", B=2,
                    Hq=4, Hk=2, Lq=333, Lk=517, D=512, Dv=512, wl=100, wr=20, qlen="rand",
                    kvlen="rand"))
    out.append(dict(name="fp32 D512 B1 H2 L300 sinks", dt="fp32", B=1, Hq=2, Hk=2, Lq=300,
                    Lk=300, D=512, Dv=512, sinks=True))
    return out


def make_inputs(c, rng):
    dt = DTYPES[c["dt"]]
    B, Hq, Hk, Lq, Lk, D, Dv = (c[x] for x in ("B", "Hq", "Hk", "Lq", "Lk", "D", "Dv"))
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hk, Lk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hk, Lk, Dv)).astype(np.float32)
    q, k, v = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32)) for x in (q, k, v))
    kw = dict(wl=c.get("wl", -1), wr=c.get("wr", -1), bottom_right=c.get("bottom_right", True),
              scale=1.0 / math.sqrt(D))
    for key, L in (("qlen", Lq), ("kvlen", Lk)):
        mode = c.get(key)
        if mode == "rand":
            x = rng.integers(0, L + 1, size=B).astype(np.int32)
            x[0] = L + 3  # clamped
            kw[key] = x
        elif mode == "zero1":
            x = np.full((B,), L, np.int32)
            x[-1] = 0
            kw[key] = x
    m = c.get("mask")
    if m == "bool_b1":
        mm = rng.random((B, 1, Lq, Lk)) < 0.7
        mm[0, 0, 3, :] = False  # an empty row
        kw["mask"] = mm
    elif m == "bool_k":
        kw["mask"] = rng.random((1, 1, 1, Lk)) < 0.5
    elif m == "add_f32":
        mm = rng.standard_normal((1, Hq, Lq, Lk)).astype(np.float32)
        mm[0, :, 5, :] = -np.inf
        mm[0, 1, :, 7] = -np.inf
        kw["mask"] = mm
    elif m == "add_bf16":
        kw["mask"] = np.asarray(jnp.asarray(rng.standard_normal((B, 1, 1, Lk)), jnp.bfloat16))
    s = c.get("sinks")
    if s:
        kw["sinks"] = rng.standard_normal((B if s == "batch" else 1, Hq)).astype(np.float32)
    return (q, k, v), kw


def run_check(seed=0, with_bwd=False, only=()):
    """The check over cases() (those whose name contains one of `only`, if given), judged by
    jax_sdpa.oracle's tolerance policy: its "cuda_3xtf32" case for fp32 under
    JAX_SDPA_CUDA_FP32=highest, its TF32 bounds otherwise."""
    rng = np.random.default_rng(seed)
    names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}

    def tolerance(dt, grad, xla_err):
        if dt == "fp32" and HIGHEST:
            return oracle.tolerance("float32", grad=grad, case="cuda_3xtf32")
        return oracle.tolerance(names[dt], "cuda", grad=grad, xla_error=xla_err,
                                tf32=not HIGHEST)

    def lse_tolerance(dt):
        if dt == "fp32" and HIGHEST:
            return oracle.lse_tolerance("float32", case="cuda_3xtf32")
        return oracle.lse_tolerance(names[dt], "cuda", tf32=not HIGHEST)

    results, fails = [], 0
    for c in cases():
        if only and not any(o in c["name"] for o in only):
            continue
        (q, k, v), kw = make_inputs(c, rng)
        ref_o, ref_l = oracle.forward(q, k, v, **_oracle_kw(kw))
        dt = DTYPES[c["dt"]]
        sm = c.get("seq_major", False)
        tr = (lambda x: np.swapaxes(x, 1, 2)) if sm else (lambda x: x)
        args = [jnp.asarray(tr(x), dt) for x in (q, k, v)]
        jkw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val)
               for key, val in kw.items()}
        try:
            o, lse = jax.block_until_ready(flash_fwd(*args, seq_major=sm, **jkw))
        except Exception as e:  # noqa: BLE001
            results.append(dict(case=c["name"], ok=False, error=str(e)[:300]))
            fails += 1
            print(f"FAIL {c['name']}: {e}", flush=True)
            continue
        o = tr(np.asarray(o, np.float64))
        lse = np.asarray(lse, np.float64)
        err_o = oracle.max_rel_error(o, ref_o)
        dout = np.asarray(jnp.asarray(rng.standard_normal(ref_o.shape), dt).astype(jnp.float32))
        xla_o = xla_g = None
        if c["dt"] != "fp32":
            xla_o, xla_g = xla_same_dtype(args, kw, tr(dout), sm)
        tol_o = tolerance(c["dt"], False, None if xla_o is None else
                          oracle.max_rel_error(xla_o, ref_o))
        fin = np.isfinite(ref_l)
        inf_ok = bool(np.array_equal(fin, np.isfinite(lse)) and
                      np.all(lse[~fin] == -np.inf))
        err_l = oracle.lse_error(lse, ref_l)
        nan = bool(np.isnan(o).any())
        ok = (not nan) and inf_ok and err_o <= tol_o and err_l <= lse_tolerance(c["dt"])
        res = dict(case=c["name"], ok=ok, err_out=err_o, tol_out=tol_o, err_lse=err_l, nan=nan,
                   lse_inf_pattern_ok=inf_ok)
        if with_bwd:
            # Backward from the reference's out/lse (rounded like a real forward's) so
            # that its error is the backward's own; fp32 under TF32 from its own forward's,
            # as a training step runs it: the TF32 backward recomputes its scores with the
            # forward's rounding, and the reference's lse (1.2e-3 off at D8) would enter
            # dS = P (dP - delta) as a mismatch of its own (dq 2.6e-3 against 0.9e-3, in a
            # float64 emulation of TF32 that reproduces the kernel's errors to three digits).
            own = c["dt"] == "fp32" and not HIGHEST
            out_d = o if own else np.asarray(jnp.asarray(ref_o, dt).astype(jnp.float32))
            lse_d = lse if own else ref_l
            ref_g = oracle.backward(q, k, v, dout, **_oracle_kw(kw))
            rdq, rdk, rdv = ref_g["dq"], ref_g["dk"], ref_g["dv"]
            try:
                g = jax.block_until_ready(flash_bwd(
                    *args, jnp.asarray(tr(out_d), dt), jnp.asarray(lse_d, jnp.float32),
                    jnp.asarray(tr(dout), dt), seq_major=sm, **jkw))
                errs = [oracle.max_rel_error(tr(np.asarray(x, np.float64)), r)
                        for x, r in zip(g, (rdq, rdk, rdv))]
                bnan = any(bool(np.isnan(np.asarray(x, np.float32)).any()) for x in g)
                tols = [tolerance(c["dt"], True, None if xla_g is None else
                                  oracle.max_rel_error(x, r))
                        for x, r in zip(xla_g or [None] * 3, (rdq, rdk, rdv))]
                bok = (not bnan) and all(e <= t for e, t in zip(errs, tols))
                res.update(err_dq=errs[0], err_dk=errs[1], err_dv=errs[2], bwd_nan=bnan,
                           tol_dq=tols[0], tol_dk=tols[1], tol_dv=tols[2])
            except Exception as e:  # noqa: BLE001
                bok = False
                res["bwd_error"] = str(e)[:300]
            res["bwd_ok"] = bok
            ok = ok and bok
            res["ok"] = ok
        fails += not ok
        results.append(res)
        extra = (f" | dq {res.get('err_dq', float('nan')):.2e} dk {res.get('err_dk', float('nan')):.2e}"
                 f" dv {res.get('err_dv', float('nan')):.2e}") if with_bwd else ""
        print(f"{'ok  ' if ok else 'FAIL'} {c['name']}: out {err_o:.2e} lse {err_l:.2e}{extra}"
              f"{' NaN' if nan else ''}{'' if inf_ok else ' -inf pattern differs'}"
              f"{' ' + res['bwd_error'] if 'bwd_error' in res else ''}", flush=True)
    print(f"check: {len(results) - fails}/{len(results)} passed", flush=True)
    return results


# ---------------------------------------------------------------------------
# timing: median device time of a jitted call, beside jax.nn (xla / cudnn)
# ---------------------------------------------------------------------------
def median_time(fn, args, reps=10):
    for _ in range(3):  # compile, then let the clocks settle
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def temp_bytes(fn, args):
    try:
        return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001
        return -1


BENCH_ROWS = [  # (name, dtype, B, H, L, D, causal)
    ("SD3 B2 H38 L4250 D64 fp32", "fp32", 2, 38, 4250, 64, False),
    ("fp32 B1 H16 L8192 D128", "fp32", 1, 16, 8192, 128, False),
    ("D512 bf16 B1 H16 L4096 causal", "bf16", 1, 16, 4096, 512, True),
    # 128 MiB of fp32 scores: under XLA_CHUNKED_SCORE_BYTES (jax_sdpa/tuning.py), where
    # implementation=None's backward is our XLA path
    ("D512 bf16 B4 H8 L1024 causal", "bf16", 4, 8, 1024, 512, True),
    ("SD3 B2 H38 L4250 D64 fp16 (cudnn reference point)", "fp16", 2, 38, 4250, 64, False),
]


API_IMPLS = (None, "cuda", "xla", "xla_chunked")


def api_times(row, qt, kt, vt, causal, flops):
    """What a user gets: jax_sdpa.dot_product_attention forward and forward+backward (grad)
    with implementation=None ("auto": the dispatch's choice, per direction) and each named
    implementation that serves. The backward of "xla" / "xla_chunked" is our XLA backward
    from lse, the one the dispatch may pair with our CUDA forward."""
    import jax_sdpa  # the installed package

    for impl in API_IMPLS:
        tag = f"api_{impl or 'auto'}"
        f = jax.jit(lambda q, k, v, impl=impl: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl))
        g = jax.jit(jax.grad(lambda q, k, v, impl=impl: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl).astype(jnp.float32).sum(),
            argnums=(0, 1, 2)))
        try:
            t = median_time(f, (qt, kt, vt))
            row[f"{tag}_fwd_tflops"] = flops / t / 1e12
            t = median_time(g, (qt, kt, vt))
            row[f"{tag}_fwdbwd_tflops"] = 3.5 * flops / t / 1e12
            row[f"{tag}_fwdbwd_temp_gib"] = temp_bytes(g, (qt, kt, vt)) / 2**30
        except Exception as e:  # noqa: BLE001
            row[f"{tag}_error"] = str(e).splitlines()[0][:200]
    # explain takes the [B, H, L, D] layout; the rows are square, so "causal" (bottom-right)
    # is jax.nn's top-left one.
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (qt, kt, vt))
    mask = "causal" if causal else None
    row["api_auto_choice"] = ", ".join(
        f"{d} {jax_sdpa.explain(q, k, v, mask=mask, direction=d).chosen}" for d in ("fwd", "bwd"))


def run_bench(rows=BENCH_ROWS, have_bwd=False, peers=True, only=None, api=False):
    out = []
    for name, dts, B, H, L, D, causal in rows:
        if only and not any(o in name for o in only):
            continue
        dt = DTYPES[dts]
        key = jax.random.PRNGKey(1)
        kq, kk, kv = jax.random.split(key, 3)
        q, k, v = (jax.random.normal(x, (B, H, L, D), dt) for x in (kq, kk, kv))
        flops = 4 * B * H * L * L * D / (2 if causal else 1)
        row = dict(row=name)
        wr = 0 if causal else -1  # causal: the band's right edge on the diagonal
        ours = jax.jit(lambda q, k, v: flash_fwd(q, k, v, wr=wr)[0])
        try:
            t = median_time(ours, (q, k, v))
            row["ours_fwd_ms"] = t * 1e3
            row["ours_fwd_tflops"] = flops / t / 1e12
            row["ours_fwd_temp_gib"] = temp_bytes(ours, (q, k, v)) / 2**30
        except Exception as e:  # noqa: BLE001
            row["ours_fwd_error"] = str(e)[:300]
        if have_bwd:
            def fb(q, k, v):
                o, lse = flash_fwd(q, k, v, wr=wr)
                return flash_bwd(q, k, v, o, lse, o, wr=wr)  # dout = out: any dense tensor
            fbj = jax.jit(fb)
            try:
                t = median_time(fbj, (q, k, v))
                row["ours_fwdbwd_ms"] = t * 1e3
                row["ours_fwdbwd_tflops"] = 3.5 * flops / t / 1e12
                row["ours_fwdbwd_temp_gib"] = temp_bytes(fbj, (q, k, v)) / 2**30
            except Exception as e:  # noqa: BLE001
                row["ours_fwdbwd_error"] = str(e)[:300]
            # The backward alone (out and lse computed once): the forward's run-to-run
            # spread does not blur it.
            try:
                o, lse = jax.jit(lambda q, k, v: flash_fwd(q, k, v, wr=wr))(q, k, v)
                bj = jax.jit(lambda q, k, v, o, lse: flash_bwd(q, k, v, o, lse, o, wr=wr))
                t = median_time(bj, (q, k, v, o, lse))
                row["ours_bwd_ms"] = t * 1e3
                row["ours_bwd_tflops"] = 2.5 * flops / t / 1e12
            except Exception as e:  # noqa: BLE001
                row["ours_bwd_error"] = str(e)[:300]
        qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))  # jax.nn layout [B, T, N, H]
        for impl in ("xla", "cudnn") if peers else ():
            f = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation=impl))
            g = jax.jit(jax.grad(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation=impl).astype(jnp.float32).sum(),
                argnums=(0, 1, 2)))
            try:
                t = median_time(f, (qt, kt, vt))
                row[f"{impl}_fwd_tflops"] = flops / t / 1e12
                row[f"{impl}_fwd_temp_gib"] = temp_bytes(f, (qt, kt, vt)) / 2**30
                t = median_time(g, (qt, kt, vt))
                row[f"{impl}_fwdbwd_tflops"] = 3.5 * flops / t / 1e12
                row[f"{impl}_fwdbwd_temp_gib"] = temp_bytes(g, (qt, kt, vt)) / 2**30
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = str(e).splitlines()[0][:200]
        if api:
            api_times(row, qt, kt, vt, causal, flops)
        if not have_bwd:
            row["ours_fwdbwd"] = "no flash backward yet"
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def _precision():
    """The API rows' matmul precision (the direct calls pass fp32_precision themselves)."""
    import contextlib

    return jax.default_matmul_precision("highest") if HIGHEST else contextlib.nullcontext()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--only", choices=("check", "bench"))
    ap.add_argument("--out", default=None, help="folder for flash_check.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peers", action="store_true", help="time only our kernels")
    ap.add_argument("--rows", default="", help="comma-separated substrings of bench row names")
    ap.add_argument("--cases", default="", help="comma-separated substrings of check case names")
    ap.add_argument("--api", action="store_true",
                    help="bench: also time jax_sdpa.dot_product_attention per implementation")
    a = ap.parse_args()
    found = registered()
    res = dict(device=str(jax.devices()[0]), gpu=jax.devices()[0].device_kind,
               date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), jax=jax.__version__,
               targets=found,
               fp32_mode="highest (3xTF32)" if HIGHEST else "tf32")
    print(json.dumps(res), flush=True)
    if a.only in (None, "check"):
        res["check"] = run_check(a.seed, with_bwd=BWD in found,
                                 only=[c for c in a.cases.split(",") if c])
    if a.only in (None, "bench"):
        with _precision():
            res["bench"] = run_bench(have_bwd=BWD in found, peers=not a.no_peers,
                                     only=[r for r in a.rows.split(",") if r], api=a.api)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        name = "flash_check_highest.json" if HIGHEST else "flash_check.json"
        with open(os.path.join(a.out, name), "w") as f:
            json.dump(res, f, indent=1)
    if "check" in res and not all(r["ok"] for r in res["check"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
