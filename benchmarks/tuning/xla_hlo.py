"""The optimized HLO of our XLA path and of jax.nn's xla formulation for given shapes, side
by side, with a count of the kernels each launches: where our formulation makes XLA run
more passes over the scores than jax.nn's. Shapes with Hq = Hk also time candidate
formulations of a forward that returns lse (`formulations`).

    python3 -P benchmarks/tuning/xla_hlo.py --shapes B,Hq,Hk,Lq,Lk,D,dtype,causal ... \
        --out-dir hlo/

Writes <out-dir>/<impl>_<shape>.txt and prints, per shape and implementation, the number
of fusions, custom calls (cuBLAS, Triton) and the milliseconds of one call.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sdpa  # noqa: E402
from bench_gpu import measure  # noqa: E402


def kernel_counts(text):
    """Fusion and custom-call instructions of the entry computation."""
    entry = text[text.find("ENTRY"):]
    return dict(fusions=len(re.findall(r"= \S+ fusion\(", entry)),
                custom_calls=len(re.findall(r"custom-call\(", entry)))


def formulations(causal):
    """Candidate forwards ([B, L, H, D] in, out and lse back; no GQA) beside ours: which
    structure lets XLA fuse the softmax into one kernel while still returning lse."""
    def scores(q, k):
        s = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        s = s * jnp.float32(q.shape[-1] ** -0.5)
        if causal:
            lq, lk = s.shape[-2:]
            s = jnp.where(jnp.tril(jnp.ones((lq, lk), bool), lk - lq), s, -jnp.inf)
        return s

    def pv(p, v):
        return jnp.einsum("bhts,bshd->bthd", p.astype(v.dtype), v)

    def one_sum(q, k, v):  # jax.nn's ops, lse from the same row sum
        s = scores(q, k)
        m = jnp.max(s, axis=-1, keepdims=True)
        e = jnp.exp(s - m)
        total = jnp.sum(e, axis=-1, keepdims=True)
        return pv(e / total, v), (m + jnp.log(total))[..., 0]

    def separate_lse(q, k, v):  # jax.nn.softmax, lse as its own reduction
        s = scores(q, k)
        return pv(jax.nn.softmax(s, axis=-1), v), jax.nn.logsumexp(s, axis=-1)

    def guarded(q, k, v):  # our guards as elementwise ops with constants only
        s = scores(q, k)
        m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), jnp.finfo(jnp.float32).min)
        e = jnp.exp(jnp.minimum(s - m, 0.0))
        total = jnp.sum(e, axis=-1, keepdims=True)
        safe = jnp.where(total == 0, 1.0, total)
        lse = jnp.where(total == 0, -jnp.inf, m + jnp.log(safe))[..., 0]
        return pv(e / safe, v), lse

    def no_lse(q, k, v):  # jax.nn's forward in this layout, nothing else
        return pv(jax.nn.softmax(scores(q, k), axis=-1), v)

    return dict(one_sum=one_sum, separate_lse=separate_lse, guarded=guarded, no_lse=no_lse)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["1,16,16,4096,4096,512,bfloat16,0",
                                                    "1,32,4,1,1024,512,float16,0"])
    ap.add_argument("--out-dir", default="hlo")
    ap.add_argument("--no-dump", action="store_true", help="counts and timings only")
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    for spec in args.shapes:
        b, hq, hk, lq, lk, d, dtype, causal = spec.split(",")
        b, hq, hk, lq, lk, d = (int(x) for x in (b, hq, hk, lq, lk, d))
        causal = bool(int(causal))
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        shapes = ((b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d))
        q, k, v = (jax.random.normal(kk, s, jnp.float32).astype(dtype)
                   for kk, s in zip(ks, shapes))
        impls = {
            "jax_sdpa_xla": lambda q, k, v: jax_sdpa.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"),
            "jaxnn_xla": lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, implementation="xla"),
        }
        if hq == hk:
            impls.update(formulations(causal))
        tag = spec.replace(",", "_")
        for name, fn in impls.items():
            text = jax.jit(fn).lower(q, k, v).compile().as_text()
            if not args.no_dump:
                with open(os.path.join(args.out_dir, f"{name}_{tag}.txt"), "w") as f:
                    f.write(text)
            t, _, _ = measure(fn, (q, k, v), False)
            print(f"{spec} {name}: {kernel_counts(text)} {t * 1e3:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
