"""Small calls of every CUDA path (cuDNN, our decode and flash kernels), forward and
gradient, for compute-sanitizer: each tool runs this script once.

    compute-sanitizer --tool memcheck python3 -P benchmarks/gpu_sanitize.py
    (gpu_run.sh sanitize runs memcheck, racecheck, initcheck and synccheck)

XLA's own allocator hands out slices of one pool, which memcheck can't see past; the
platform allocator gives every buffer its own allocation, so an access past a buffer is
an access past an allocation.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sdpa  # noqa: E402

# (implementation, dtype, B, Lq, Lk, Hq, Hk, D, causal, extra)
CASES = [
    ("cudnn", jnp.bfloat16, 2, 67, 67, 4, 2, 64, True, {}),
    ("cudnn", jnp.bfloat16, 1, 1, 300, 4, 1, 128, False, {"lengths": True}),
    ("cuda", jnp.bfloat16, 2, 1, 333, 8, 2, 128, False, {"lengths": True}),   # decode
    ("cuda", jnp.float32, 1, 1, 130, 4, 4, 512, False, {}),                   # decode wide fp32
    ("cuda", jnp.bfloat16, 1, 1, 257, 8, 2, 512, False, {"sinks": True}),      # decode wide
    ("cuda", jnp.bfloat16, 1, 70, 70, 2, 1, 128, True, {}),                   # flash
    ("cuda", jnp.float32, 1, 45, 77, 2, 2, 64, False, {"lengths": True}),     # flash fp32
    ("cuda", jnp.bfloat16, 1, 65, 65, 2, 2, 512, True, {}),                   # flash wgmma
]


def run(impl, dtype, b, lq, lk, hq, hk, d, causal, extra):
    ks = jax.random.split(jax.random.PRNGKey(lq * 31 + d), 4)
    q = jax.random.normal(ks[0], (b, hq, lq, d), dtype)
    k = jax.random.normal(ks[1], (b, hk, lk, d), dtype)
    v = jax.random.normal(ks[2], (b, hk, lk, d), dtype)
    kw = dict(mask="causal" if causal else None, implementation=impl)
    if extra.get("lengths"):
        kw["key_value_seq_lengths"] = jnp.arange(b, dtype=jnp.int32) * 7 + lk - 9
    if extra.get("sinks"):
        kw["sinks"] = jax.random.normal(ks[3], (hq,), dtype)

    def loss(q, k, v):
        return jnp.sum(jax_sdpa.scaled_dot_product_attention(q, k, v, **kw).astype(jnp.float32))

    out = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, **kw))(q, k, v)
    jax.block_until_ready(out)
    if lq > 1:  # the decode kernel has no backward: its gradients run elsewhere
        jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))


def main():
    failed = 0
    for c in CASES:
        try:
            run(*c)
            print("ran", c[:9], flush=True)
        except Exception as e:  # noqa: BLE001
            failed += 1
            print("FAIL", c[:9], type(e).__name__, str(e).splitlines()[0][:200], flush=True)
    print("sanitize cases:", len(CASES) - failed, "ran,", failed, "failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
