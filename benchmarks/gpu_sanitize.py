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
    ("cuda", jnp.bfloat16, 2, 75, 75, 4, 2, 64, True, {"segments": True, "softcap": True}),
    ("cuda", jnp.float32, 1, 1, 200, 4, 2, 128, False, {"softcap": True, "lengths": True}),
    ("cuda", jnp.bfloat16, 2, 3, 0, 8, 2, 128, False, {"paged": True}),       # paged decode
    ("cuda", jnp.bfloat16, 2, 1, 0, 8, 2, 128, False, {"paged": True}),       # paged TMA
    ("cuda", jnp.float16, 2, 1, 0, 8, 2, 256, False, {"paged": True}),        # paged TMA D256
]


def run(impl, dtype, b, lq, lk, hq, hk, d, causal, extra):
    ks = jax.random.split(jax.random.PRNGKey(lq * 31 + d), 4)
    q = jax.random.normal(ks[0], (b, hq, lq, d), dtype)
    k = jax.random.normal(ks[1], (b, hk, lk, d), dtype)
    v = jax.random.normal(ks[2], (b, hk, lk, d), dtype)
    if extra.get("paged"):  # 9 pages of 16 slots, shuffled; lengths 37 and 70
        kp = jax.random.normal(ks[1], (9, 16, hk, d), dtype)
        vp = jax.random.normal(ks[2], (9, 16, hk, d), dtype)
        table = jnp.array([[3, 0, 7, 1, 5], [8, 2, 6, 4, 12]], jnp.int32)  # 12: out of range
        lens = jnp.array([37, 70], jnp.int32)
        jax.block_until_ready(jax.jit(lambda q: jax_sdpa.paged_attention(
            q, kp, vp, table, lens, mask="causal", kv_layout="PSHD", implementation=impl))(q))
        return
    kw = dict(mask="causal" if causal else None, implementation=impl)
    if extra.get("segments"):
        kw["q_segment_ids"] = (jnp.arange(lq, dtype=jnp.int32) // 11)[None].repeat(b, 0)
    if extra.get("softcap"):
        kw["logits_soft_cap"] = 5.0
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
