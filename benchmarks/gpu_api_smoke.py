"""One public-API call per GPU implementation (cudnn, cuda decode, cuda flash), forward
and gradient, against the float64 oracle (jax_sdpa.oracle) under its tolerance policy: a
quick check that every FFI handler decodes its attributes and runs after a host-side change
(the shared test suite is the full check: gpu_run.sh shared).

    python3 -P benchmarks/gpu_api_smoke.py      (from /tmp, after gpu_run.sh build)
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from jax_sdpa import oracle
from jax_sdpa.config import FP32_PRECISION_HIGHEST, current_fp32_precision


def _case(impl, dtype, B, Lq, Lk, Hq, Hk, D, causal):
    ks = jax.random.split(jax.random.PRNGKey(Lq * 7 + D), 4)
    q = jax.random.normal(ks[0], (B, Lq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Lk, Hk, D), dtype)
    v = jax.random.normal(ks[2], (B, Lk, Hk, D), dtype)
    w = jax.random.normal(ks[3], (B, Lq, Hq, D), jnp.float32)

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) * w)

    def run(implementation):
        f = lambda q, k, v: jax_sdpa.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation=implementation)
        o = jax.jit(f)(q, k, v)
        g = jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=(0, 1, 2)))(q, k, v)
        return [np.asarray(x.astype(jnp.float32)) for x in (o, *g)]

    # The oracle on the same rounded inputs ([B, T, N, H]; jax.nn's causal is top-left) and
    # cotangent (w in the output's dtype); errors relative to the oracle's own magnitude.
    f64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, w.astype(dtype))]
    kw = dict(window_right=0 if causal else -1, seq_major=True)
    got = run(impl)
    want_out, _ = oracle.forward(*f64[:3], **kw)
    grads = oracle.backward(*f64, **kw)
    want = [want_out, grads["dq"], grads["dk"], grads["dv"]]
    dt = jnp.dtype(dtype).name
    xla = run("xla") if dt != "float32" else [None] * 4
    tf32 = current_fp32_precision() != FP32_PRECISION_HIGHEST
    errs, ok = [], True
    for i, (g, w, x) in enumerate(zip(got, want, xla)):
        err = oracle.max_rel_error(g, w, floor=oracle.OWN_MAGNITUDE)
        tol = oracle.tolerance(dt, impl, grad=i > 0, tf32=tf32, xla_error=None if x is None
                               else oracle.max_rel_error(x, w, floor=oracle.OWN_MAGNITUDE))
        errs.append(err)
        ok &= bool(np.isfinite(err) and err <= tol)
    name = f"{impl} {jnp.dtype(dtype).name} B{B} Lq{Lq} Lk{Lk} H{Hq}/{Hk} D{D}{' causal' if causal else ''}"
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rel err out/dq/dk/dv " +
          " ".join(f"{e:.1e}" for e in errs), flush=True)
    return ok


def main():
    cases = [
        ("cudnn", jnp.bfloat16, 2, 256, 256, 8, 2, 128, True),
        ("cuda", jnp.bfloat16, 4, 1, 1000, 8, 2, 128, False),   # decode kernel forward
        ("cuda", jnp.float32, 2, 1, 777, 8, 8, 512, False),
        ("cuda", jnp.bfloat16, 2, 200, 200, 4, 4, 512, True),  # flash kernels
        ("cuda", jnp.float32, 1, 130, 130, 4, 2, 64, True),
    ]
    ok = True
    for c in cases:
        try:
            ok &= _case(*c)
        except Exception as e:  # noqa: BLE001
            ok = False
            print(f"FAIL {c[0]} {c}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    print("api smoke:", "all ok" if ok else "FAILURES", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
