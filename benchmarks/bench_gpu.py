"""cuDNN path on the GPU beside jax.nn, the prefill and decode rows below, in one run.

    python3 benchmarks/bench_gpu.py --out results.json [--rows prefill,decode] [--quick]

Per row and mode (forward; forward+backward):
- ours_bhld: jax_sdpa.scaled_dot_product_attention(..., implementation="cudnn"), [B, H, L, D]
- ours_btnh: jax_sdpa.dot_product_attention(..., implementation="cudnn"), [B, T, N, H]
- jaxnn_cudnn / jaxnn_xla: jax.nn.dot_product_attention, [B, T, N, H]
Median device time: each timed sample enqueues n dependent calls (async dispatch
keeps the GPU busy) inside one jitted lax.fori_loop for short calls, and divides.
TFLOP/s counts 4*B*Hq*Lq*Lk*D (halved for causal), x3.5 for forward+backward;
decode reports GB/s over q, k, v and out read/written once. Temporaries come from
compiled.memory_analysis().
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"  # never time the test-only poisoning
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sdpa  # noqa: E402

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32

# (name, B, Hq, Hk, Lq, Lk, D, causal, dtype)
PREFILL = [
    ("B4 H32 L4096 D128", 4, 32, 32, 4096, 4096, 128, False, BF16),
    ("B4 H32 L4096 D128 causal", 4, 32, 32, 4096, 4096, 128, True, BF16),
    ("B1 H16 L16384 D128 causal", 1, 16, 16, 16384, 16384, 128, True, BF16),
    ("B2 H32/KV8 L8192 D128 causal (GQA)", 2, 32, 8, 8192, 8192, 128, True, BF16),
    ("B4 H16 L4096 D64", 4, 16, 16, 4096, 4096, 64, False, BF16),
    ("B2 H16 L4096 D256 causal", 2, 16, 16, 4096, 4096, 256, True, BF16),
    ("SD3: B2 H38 L4250 D64 fp16", 2, 38, 38, 4250, 4250, 64, False, F16),
    ("SD3: B2 H38 L4250 D64 fp32", 2, 38, 38, 4250, 4250, 64, False, F32),
]
DECODE = [
    ("decode B8 H32/KV8 Lk8192 D128", 8, 32, 8, 1, 8192, 128, True, BF16),
    ("decode B1 H32/KV8 Lk32768 D128", 1, 32, 8, 1, 32768, 128, True, BF16),
    ("decode B1 H32/KV4 Lk8192 D512", 1, 32, 4, 1, 8192, 512, True, BF16),
    ("decode B1 H32/KV4 Lk1024 D512 fp16", 1, 32, 4, 1, 1024, 512, True, F16),
]


def impls(causal):
    mask = "causal" if causal else None
    return {
        "ours_bhld": ("bhld", lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, implementation="cudnn")),
        "ours_btnh": ("btnh", lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")),
        "jaxnn_cudnn": ("btnh", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn")),
        "jaxnn_xla": ("btnh", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla")),
    }


def decode_impls():
    # One query against a full cache: no mask needed (the query is the last position).
    return {
        "ours_bhld": ("bhld", lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
            q, k, v, implementation="cudnn")),
        "ours_btnh": ("btnh", lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, implementation="cudnn")),
        "jaxnn_cudnn": ("btnh", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn")),
        "jaxnn_xla": ("btnh", lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="xla")),
    }


def make(layout, b, hq, hk, lq, lk, d, dtype, seed=0):
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    if layout == "bhld":
        shapes = ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d))
    else:
        shapes = ((b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d))
    return tuple(jax.random.normal(kk, s, F32).astype(dtype) for kk, s in zip((k1, k2, k3), shapes))


def one_call(fn, backward):
    """The timed unit: the forward, or forward + backward (cotangent = the output) with all
    three gradients returned (XLA would otherwise drop the dk / dv work of a pure-JAX
    backward that only dq needs)."""
    if not backward:
        return fn

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(out)

    return fwd_bwd


LOOP_UNROLL = 8


def looped(unit, n):
    """n dependent calls in one jit (for short calls): each call's q gets one element
    nudged by the last result, so XLA can neither hoist nor overlap them, at the cost
    of one tiny in-place update. The loop is unrolled LOOP_UNROLL times: each trip of an
    XLA GPU while loop waits for its predicate on the host (~20 us a trip), which would
    otherwise count against every call of a JAX implementation and not against torch's."""
    def body(_, q_k_v):
        q, k, v = q_k_v
        r = unit(q, k, v)
        r = r[0] if isinstance(r, tuple) else r
        nudge = (r.reshape(-1)[0] * 1e-3).astype(q.dtype)
        return (q.at[(0,) * q.ndim].add(nudge), k, v)

    return jax.jit(lambda q, k, v: jax.lax.fori_loop(0, n, body, (q, k, v),
                                                     unroll=LOOP_UNROLL)[0])


def measure(fn, args, backward, target_s=0.12, samples=5):
    """Median seconds per call, temporaries (bytes) of one call, calls per sample."""
    unit = one_call(fn, backward)
    compiled = jax.jit(unit).lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", 0)) if mem is not None else -1
    jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max(target_s / one, 2), 500))
    if one < 1e-3:  # dispatch-bound: K dependent calls inside one jitted loop
        n = max(LOOP_UNROLL, n - n % LOOP_UNROLL)
        loop = looped(unit, n)
        jax.block_until_ready(loop(*args))
        run = lambda: jax.block_until_ready(loop(*args))  # noqa: E731
    else:  # long calls: async dispatch keeps the GPU busy; block once per sample
        def run():
            r = None
            for _ in range(n):
                r = compiled(*args)
            jax.block_until_ready(r)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) / n)
    return float(np.median(times)), temp, n


def flops(b, hq, lq, lk, d, causal, backward):
    f = 4.0 * b * hq * lq * lk * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def decode_bytes(b, hq, hk, lq, lk, d, dtype):
    es = jnp.dtype(dtype).itemsize
    return es * (b * hq * lq * d * 2 + b * hk * lk * d * 2)


def versions():
    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                jax=jax.__version__)
    try:
        import jaxlib
        info["jaxlib"] = jaxlib.__version__
    except Exception:
        pass
    dev = jax.devices()[0]
    info["gpu"] = getattr(dev, "device_kind", str(dev))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        info["driver"] = smi.splitlines()[0] if smi else "?"
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
        info["cuda_driver_api"] = next((ln.split("CUDA Version:")[1].split("|")[0].strip()
                                        for ln in head.splitlines() if "CUDA Version" in ln), "?")
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"? ({e})"
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
        info["nvcc"] = out.strip().splitlines()[-1]
    except Exception:
        pass
    try:
        from jax_sdpa import _ext
        m = _ext.module("_sdpa_cuda")
        info["cudnn"] = m.cudnn_version()
        info["cudnn_headers"] = m.cudnn_compiled_version()
        info["cudnn_frontend"] = m.cudnn_frontend_version()
    except Exception as e:  # noqa: BLE001
        info["cudnn"] = f"? ({e})"
    return info


def run_row(row, impl_table, decode, modes):
    name, b, hq, hk, lq, lk, d, causal, dtype = row
    res = dict(case=name, B=b, Hq=hq, Hk=hk, Lq=lq, Lk=lk, D=d, causal=causal,
               dtype=jnp.dtype(dtype).name, results={})
    for impl, (layout, fn) in impl_table.items():
        args = make(layout, b, hq, hk, lq, lk, d, dtype)
        for mode in modes:
            backward = mode == "fwd+bwd"
            key = f"{impl}/{mode}"
            try:
                sec, temp, n = measure(fn, args, backward)
                r = dict(ms=sec * 1e3, temp_gib=temp / 2**30, calls_per_sample=n)
                if decode:
                    r["GB/s"] = decode_bytes(b, hq, hk, lq, lk, d, dtype) / sec / 1e9
                else:
                    r["TFLOP/s"] = flops(b, hq, lq, lk, d, causal and lq > 1, backward) / sec / 1e12
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                r = dict(refused=f"{type(e).__name__}: {msg}")
            res["results"][key] = r
            print(json.dumps({"case": name, key: r}), flush=True)
        del args
    return res


def table(rows):
    lines = []
    for r in rows:
        for mode in ("fwd", "fwd+bwd"):
            cells = []
            metric = None
            for impl in ("ours_bhld", "ours_btnh", "jaxnn_cudnn", "jaxnn_xla"):
                x = r["results"].get(f"{impl}/{mode}")
                if x is None:
                    continue
                metric = "GB/s" if "GB/s" in x else "TFLOP/s"
                cells.append((impl, x.get(metric)))
            if not cells:
                continue
            ref = dict(cells).get("jaxnn_cudnn")
            txt = []
            for impl, val in cells:
                if val is None:
                    txt.append(f"{impl}=refused")
                else:
                    ratio = f" ({val / ref:.2f}x)" if ref else ""
                    txt.append(f"{impl}={val:.0f}{ratio if impl.startswith('ours') else ''}")
            lines.append(f"{r['case']:<38} {mode:<8} {metric}: " + "  ".join(txt))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_cudnn.json")
    ap.add_argument("--rows", default="prefill,decode")
    ap.add_argument("--quick", action="store_true", help="first prefill row and first decode row")
    ap.add_argument("--skip-xla-bwd", action="store_true")
    args = ap.parse_args()
    info = versions()
    print(json.dumps(info), flush=True)
    rows = []
    want = set(args.rows.split(","))

    def save():  # after every row, so that a run cut short keeps what it measured
        with open(args.out, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)

    if "prefill" in want:
        for row in PREFILL[:1] if args.quick else PREFILL:
            rows.append(run_row(row, impls(row[7]), False, ("fwd", "fwd+bwd")))
            save()
    if "decode" in want:
        for row in DECODE[:1] if args.quick else DECODE:
            rows.append(run_row(row, decode_impls(), True, ("fwd",)))
            save()
    print("\n" + table(rows), flush=True)


if __name__ == "__main__":
    main()
