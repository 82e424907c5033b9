"""What a packed call's conditionals cost on the GPU: the packed row (B2 H32/KV8 L8192 D128
bfloat16 causal, 8 equal segments a row) through flash-attn3's varlen kernels in the forms
jax_sdpa's lowering can take, beside flash-attn3-jax's own varlen call told the boundaries.

    python3 -P benchmarks/profiling/packed_conditionals.py [--rounds 2] [--out DIR]

Variants (each a custom_vjp over jax_sdpa.flash_attn3's varlen lowering, ids a constant of the
program): `plain` finds the runs on the device and calls the kernels; `fwd_cond` adds the
forward's lax.cond with a fallback branch (our flash forward), `bwd_switch` the backward's
lax.switch over its buckets with the fallback as branch 0 (our flash backward), `both` the
two; `none` is implementation=None. us per call by benchmarks/bench_gpu.py's measure (the
forward as K dependent calls in one jit, forward+backward back to back). Needs
flash-attn3-jax and our CUDA kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "0")  # never time the test-only poisoning

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import bench_gpu as bg  # noqa: E402
import jax_sdpa  # noqa: E402
from jax_sdpa import flash_attn3 as f3  # noqa: E402

B, L, HQ, HK, D, SEGMENTS = 2, 8192, 32, 8, 128, 8
S, T = L // SEGMENTS, B * L
PARAMS = types.SimpleNamespace(scale=D ** -0.5, window_right=0)
CU = np.arange(0, T + 1, S, dtype=np.int32)


def ids():
    return jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32) // S, (B, L))


def flash_attn3_jax(q, k, v):
    import flash_attn3_jax as fa
    flat = lambda x: x.reshape(T, *x.shape[2:])  # noqa: E731
    cu = jnp.asarray(CU)
    return fa.flash_mha_varlen(flat(q), flat(k), flat(v), cu, cu, max_seqlen_q=S,
                               max_seqlen_k=S, is_causal=True).reshape(q.shape)


def ours(implementation=None):
    return lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=True, q_segment_ids=ids(), implementation=implementation)


def lowered(fwd_cond: bool, bwd_switch: bool):
    """Each direction plain (the runs found, the varlen call) or as the lowering emits it
    (flash_attn3._packed: its conditional, our flash kernel as the fallback branch)."""
    cap = f3.max_sequences(B, L)
    optional = lambda: (None,) * 4 + (ids(), ids())  # noqa: E731  (only the ids are read)
    packed_fwd = f3._packed("fwd", PARAMS, lambda q, k, v, *_: (
        ours("cuda")(q, k, v), jnp.zeros((B, HQ, L), jnp.float32)))
    packed_bwd = f3._packed("bwd", PARAMS, lambda q, k, v, out, lse, dout, *_: jax.vjp(
        ours("cuda"), q, k, v)[1](dout))

    def forward(q, k, v):
        if fwd_cond:
            return packed_fwd(q, k, v, *optional())
        cu = f3.sequence_runs(ids(), ids(), cap)[0]
        return f3._varlen_forward(q, k, v, cu, params=PARAMS)

    def backward(q, k, v, out, lse, dout):
        if bwd_switch:
            return packed_bwd(q, k, v, out, lse, dout, *optional())
        cu = f3.sequence_runs(ids(), ids(), cap)[0]
        return f3._varlen_backward(q, k, v, out, lse, dout, cu, sequences=B * SEGMENTS,
                                   longest=S, params=PARAMS)

    @jax.custom_vjp
    def f(q, k, v):
        return forward(q, k, v)[0]

    def f_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    f.defvjp(f_fwd, lambda res, dout: backward(*res, dout))
    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    shapes = ((B, L, HQ, D), (B, L, HK, D), (B, L, HK, D))
    qkv = tuple(jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)
                for k, s in zip(ks, shapes))
    variants = {"flash_attn3_jax": flash_attn3_jax, "none": ours(),
                "plain": lowered(False, False), "fwd_cond": lowered(True, False),
                "bwd_switch": lowered(False, True), "both": lowered(True, True)}
    ref = flash_attn3_jax(*qkv)
    want = jax.vjp(flash_attn3_jax, *qkv)[1](ref)[0].astype(jnp.float32)
    result = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "us": {},
              "dq_max_diff_vs_flash_attn3_jax": {}}
    for name, fn in variants.items():
        dq = jax.vjp(fn, *qkv)[1](ref)[0].astype(jnp.float32)
        result["dq_max_diff_vs_flash_attn3_jax"][name] = float(jnp.max(jnp.abs(dq - want)))
    for _ in range(args.rounds):
        for name, fn in variants.items():
            for backward in (False, True):
                t, _, _ = bg.measure(fn, qkv, backward)
                key = f"{name}/{'fwd+bwd' if backward else 'fwd'}"
                result["us"].setdefault(key, []).append(round(t * 1e6, 1))
                print(key, result["us"][key][-1], flush=True)
    print(json.dumps(result, indent=1))
    with open(os.path.join(args.out, "packed_conditionals.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
