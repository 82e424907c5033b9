"""Is flash-attn3-jax's `flash_mha` right? Its forward (and on small shapes its gradients)
against a float32 jax.nn xla reference, on small odd shapes and on the peer rows' shapes;
jax_sdpa (implementation=None) beside it on the same inputs. One JSON line per case.

    python3 -P benchmarks/tuning/fa3_check.py [--big]
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa

SMALL = [  # (B, L, Hq, Hk, D, causal)
    (2, 96, 4, 4, 128, False), (2, 96, 4, 2, 128, False), (2, 96, 4, 4, 128, True),
    (2, 64, 4, 4, 128, False), (2, 128, 4, 4, 128, False), (2, 256, 4, 4, 128, False),
    (1, 1000, 8, 8, 128, False), (1, 4096, 8, 8, 128, False), (1, 4096, 8, 8, 128, True),
]
BIG = [(4, 4096, 32, 32, 128, False), (4, 4096, 32, 32, 128, True),
       (2, 8192, 32, 8, 128, True), (1, 16384, 16, 16, 128, True)]


def errors(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want)
    return dict(max_abs=float(err.max()), frac_over_0p05=float((err > 0.05).mean()),
                finite=bool(np.isfinite(got).all()))


def case(b, l, hq, hk, d, causal, grads, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, l, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, l, hk, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, l, hk, d), jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(ks[3], (b, l, hq, d), jnp.float32)
    import flash_attn3_jax as fa

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    impls = {
        "reference": lambda q, k, v: jax.nn.dot_product_attention(
            f32(q), f32(k), f32(v), is_causal=causal, implementation="xla"),
        "flash_attn3_jax": lambda q, k, v: fa.flash_mha(q, k, v, is_causal=causal),
        "jax_sdpa": lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=causal),
        "jaxnn_cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
    }
    res = {}
    outs = {n: jax.jit(f)(q, k, v) for n, f in impls.items()}
    for n in impls:
        if n != "reference":
            res[n] = errors(outs[n], outs["reference"])
    if grads:
        g = {n: jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f32(f(q, k, v)) * do),
                                 argnums=(0, 1, 2)))(q, k, v) for n, f in impls.items()}
        for n in impls:
            if n != "reference":
                for name, a, w in zip("dq dk dv".split(), g[n], g["reference"]):
                    res[n][name] = errors(a, w)["max_abs"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true")
    args = ap.parse_args()
    for shape in SMALL + (BIG if args.big else []):
        b, l, hq, hk, d, causal = shape
        try:
            res = case(*shape, grads=l <= 4096 and b * hq <= 8)
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(json.dumps(dict(B=b, L=l, Hq=hq, Hk=hk, D=d, causal=causal, **res)), flush=True)


if __name__ == "__main__":
    main()
