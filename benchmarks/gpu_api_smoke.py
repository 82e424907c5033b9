"""One public-API call per GPU implementation (cudnn, cuda decode, cuda flash), forward
and gradient, against jax.nn's xla implementation: a quick check that every FFI handler
decodes its attributes and runs after a host-side change (the shared test suite is the
full check: gpu_run.sh shared).

    python3 -P benchmarks/gpu_api_smoke.py      (from /tmp, after gpu_run.sh build)
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa


def _case(impl, dtype, B, Lq, Lk, Hq, Hk, D, causal):
    ks = jax.random.split(jax.random.PRNGKey(Lq * 7 + D), 3)
    q = jax.random.normal(ks[0], (B, Lq, Hq, D), dtype)
    k = jax.random.normal(ks[1], (B, Lk, Hk, D), dtype)
    v = jax.random.normal(ks[2], (B, Lk, Hk, D), dtype)

    def loss(f, q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)

    ours = lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=causal,
                                                         implementation=impl)
    ref = lambda q, k, v: jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=causal)
    o = np.asarray(jax.jit(ours)(q, k, v).astype(jnp.float32))
    r = np.asarray(jax.jit(ref)(q, k, v))
    g = jax.jit(jax.grad(lambda *a: loss(ours, *a), argnums=(0, 1, 2)))(q, k, v)
    gr = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2)))(q, k, v)
    errs = [float(np.abs(o - r).max() / max(np.abs(r).max(), 1e-30))]
    for a, b in zip(g, gr):
        a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b)
        errs.append(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    tol = 3e-2 if dtype != jnp.float32 else 2e-3
    ok = all(np.isfinite(e) and e <= tol for e in errs)
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
