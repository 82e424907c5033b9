"""The 16-bit backward at head dims > 256 (which cuDNN can't serve), timed formulation by
formulation on one GPU: what the XLA_WIDE_BWD_MAX_SCORE_BYTES row of jax_sdpa/tuning.py
chooses between.

    python3 -P benchmarks/tuning/wide_bwd.py [--shapes B,H,L,D,causal ...] --out wide_bwd.json

Per shape: forward and forward+backward (all three gradients) of implementation=None,
"cuda" and "xla" and jax.nn's xla; the backward alone as our XLA backward with float32
P / dS matmul operands (reference.exact_backward) and with them rounded to the input dtype (what
cuDNN, our flash kernels and jax.nn's autodiff feed their tensor cores).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import reference  # noqa: E402
from jax_sdpa.config import StaticParams  # noqa: E402
from bench_gpu import flops, measure, versions  # noqa: E402


def rounded_operand_backward(q, k, v, out, lse, dout, params):
    """reference.exact_backward with P and dS rounded to the input dtype before their matmuls."""
    acc = jnp.float32
    p, _, ds = reference._probs_and_dscores(q, k, v, out, lse, dout, None, None, None, None,
                                            None, params, None, acc)
    return reference._grads_from_dscores(q, k, dout, p.astype(q.dtype), ds.astype(q.dtype),
                                         params, None, acc)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1,16,4096,512,1", "1,16,4096,512,0",
                                                     "2,16,2048,384,1"])
    ap.add_argument("--out", default="wide_bwd.json")
    args = ap.parse_args()
    rows = []
    for spec in args.shapes:
        b, h, l, d, causal = (int(x) for x in spec.split(","))
        causal = bool(causal)
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        # [B, L, H, D] for the public APIs; [B, H, L, D] for the reference backward
        q, k, v, do = (jax.random.normal(kk, (b, l, h, d), jnp.float32).astype(jnp.bfloat16)
                       for kk in ks)
        f_fwd = flops(b, h, l, l, d, causal, False)
        row = dict(B=b, H=h, L=l, D=d, causal=causal, ms={}, tflops={})

        def put(name, fn, fargs, backward, work):
            try:
                t, temp, _ = measure(fn, fargs, backward)
                row["ms"][name] = t * 1e3
                row["tflops"][name] = work / t / 1e12
                print(f"{spec} {name}: {t * 1e3:.3f} ms {work / t / 1e12:.1f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001
                row["ms"][name] = None
                print(f"{spec} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)

        mask = "causal" if causal else None
        for impl in (None, "cuda", "xla"):
            fn = (lambda impl: lambda q, k, v: jax_sdpa.dot_product_attention(
                q, k, v, is_causal=causal, implementation=impl))(impl)
            put(f"jax_sdpa {impl} fwd", fn, (q, k, v), False, f_fwd)
            put(f"jax_sdpa {impl} fwd+bwd", fn, (q, k, v), True, 3.5 * f_fwd)
        nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,  # noqa
                                                          implementation="xla")
        put("jax.nn xla fwd", nn, (q, k, v), False, f_fwd)
        put("jax.nn xla fwd+bwd", nn, (q, k, v), True, 3.5 * f_fwd)
        # backward alone, from the reference's out / lse, [B, H, L, D]
        params = StaticParams(scale=d ** -0.5, window_right=0 if causal else -1)
        qh, kh, vh, doh = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
        out, lse = jax.jit(lambda q, k, v: reference.exact_forward(
            q, k, v, None, None, None, None, None, None, params))(qh, kh, vh)
        f32_bwd = lambda q, k, v: reference.exact_backward(  # noqa: E731
            q, k, v, out, lse, doh, None, None, None, None, None, None, params)
        put("xla bwd alone, float32 P/dS operands", f32_bwd, (qh, kh, vh), False, 2.5 * f_fwd)
        low_bwd = lambda q, k, v: rounded_operand_backward(q, k, v, out, lse, doh, params)  # noqa
        put("xla bwd alone, bf16 P/dS operands", low_bwd, (qh, kh, vh), False, 2.5 * f_fwd)
        rows.append(row)
    json.dump(dict(info=versions(), rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
