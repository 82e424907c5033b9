"""Cost of the contract features on our CUDA kernels (GPU machine; implementation="cuda").

Rows, each beside the same call without the feature, forward and forward+backward (median of
10 jitted calls after 3 warm-ups, milliseconds): packed sequences (8 equal segments, segment
ids) vs one unpacked sequence of the same length, logit soft-capping vs none, and decode
with soft-capping vs none. Prints one JSON object a row. Run from /tmp with the installed
package: `python3 -P benchmarks/gpu_features.py` (--quick: shorter sequences).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa


def median_ms(fn, args, reps=10):
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def call(q, k, v, seg, cap, causal):
    return jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal" if causal else None, q_segment_ids=seg, kv_segment_ids=seg,
        logits_soft_cap=cap, implementation="cuda")


def row(name, b, hq, hk, lq, lk, d, dtype, *, segments, cap, causal, backward=True):
    key = jax.random.PRNGKey(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (b, hq, lq, d), dtype)
    k = jax.random.normal(kk, (b, hk, lk, d), dtype)
    v = jax.random.normal(kv, (b, hk, lk, d), dtype)
    seg = None
    if segments:
        seg = jnp.broadcast_to(jnp.arange(lk, dtype=jnp.int32) // (lk // segments), (b, lk))
    out = {"row": name}
    for label, s, c in (("without", None, None), ("with", seg, cap)):
        fwd = jax.jit(lambda q, k, v, s=s, c=c: call(q, k, v, s, c, causal))
        out[f"fwd_ms_{label}"] = round(median_ms(fwd, (q, k, v)), 3)
        if backward:
            loss = lambda q, k, v, s=s, c=c: jnp.sum(call(q, k, v, s, c, causal).astype(  # noqa: E731
                jnp.float32))
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            out[f"fwd_bwd_ms_{label}"] = round(median_ms(g, (q, k, v)), 3)
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    L = 1024 if args.quick else 4096
    row(f"packed 8 segments B1 H16 L{L} D128 bf16", 1, 16, 16, L, L, 128, jnp.bfloat16,
        segments=8, cap=None, causal=True)
    row(f"packed 8 segments B1 H16 L{L} D128 fp32", 1, 16, 16, L, L, 128, jnp.float32,
        segments=8, cap=None, causal=True)
    row(f"soft-cap 50 B1 H16 L{L} D256 bf16", 1, 16, 8, L, L, 256, jnp.bfloat16,
        segments=None, cap=50.0, causal=True)
    row("decode soft-cap 50 B8 H32/KV8 Lk8192 D256 bf16", 8, 32, 8, 1, 8192, 256, jnp.bfloat16,
        segments=None, cap=50.0, causal=False, backward=False)


if __name__ == "__main__":
    main()
