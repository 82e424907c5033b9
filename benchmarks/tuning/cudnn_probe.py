"""What cuDNN itself writes where the contract has rules (padded query rows, rows
with no visible key, keys past the kv length), with our fix-ups switched off.

    JAX_SDPA_CUDNN_RAW=1 JAX_SDPA_POISON_OUTPUTS=1 python3 benchmarks/tuning/cudnn_probe.py

(a tuning build: JAX_SDPA_CUDNN_RAW exists only with -DJAX_SDPA_TUNING=ON).

Outputs are NaN-poisoned first, so "NaN" below means "cuDNN did not write it".
"""
import os
import sys

os.environ.setdefault("JAX_SDPA_CUDNN_RAW", "1")
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_sdpa import _ext  # noqa: E402
from jax_sdpa import oracle  # noqa: E402
from test_cudnn import ffi_bwd, ffi_fwd  # noqa: E402


def describe(name, x):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    if x.size == 0:
        return f"{name}: empty"
    kinds = []
    if np.isnan(x).all():
        kinds.append("all NaN (unwritten)")
    elif np.isnan(x).any():
        kinds.append(f"{np.isnan(x).mean():.0%} NaN")
    if np.isneginf(x).any():
        kinds.append(f"{np.isneginf(x).mean():.0%} -inf")
    fin = x[np.isfinite(x)]
    if fin.size:
        kinds.append(f"finite in [{fin.min():.3g}, {fin.max():.3g}], {np.mean(fin == 0):.0%} zero")
    return f"{name}: " + ", ".join(kinds)


def main():
    assert _ext.has_backend("cudnn"), _ext.status()
    key = jax.random.PRNGKey(0)
    b, hq, lq, lk, d = 2, 2, 64, 96, 64
    q = jax.random.normal(key, (b, hq, lq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, hq, lk, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (b, hq, lk, d), jnp.float32).astype(jnp.bfloat16)
    scale = d ** -0.5
    ql = jnp.array([lq, 40], jnp.int32)
    kvl = jnp.array([lk, 50], jnp.int32)

    print("== valid rows: is cuDNN's stats the natural-log logsumexp?")
    out, lse = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, scale=scale))(q, k, v)
    _, want = oracle.forward(*(np.asarray(x.astype(jnp.float32)) for x in (q, k, v)), scale=scale)
    print(f"   max |lse - ln-sum-exp| = {float(jnp.max(jnp.abs(lse - want))):.3g}; "
          f"vs log2: {float(jnp.max(jnp.abs(lse - want / np.log(2)))):.3g}")

    print("== padding mask, q_lengths [64, 40], kv_lengths [96, 50]")
    out, lse = jax.jit(lambda *a: ffi_fwd(*a, scale=scale))(q, k, v, None, None, ql, kvl)
    print("  ", describe("out rows i >= qlen (batch 1)", out[1, :, 40:]))
    print("  ", describe("lse rows i >= qlen (batch 1)", lse[1, :, 40:]))
    print("  ", describe("out valid rows", out[1, :, :40]))
    dout = jnp.ones_like(out)
    dq, dk, dv = jax.jit(lambda *a: ffi_bwd(*a, scale=scale))(
        q, k, v, jnp.nan_to_num(out), lse, dout, None, None, ql, kvl)
    print("  ", describe("dq rows i >= qlen", dq[1, :, 40:]))
    print("  ", describe("dk rows j >= kvlen", dk[1, :, 50:]))
    print("  ", describe("dv rows j >= kvlen", dv[1, :, 50:]))

    print("== bottom-right causal with Lq > Lk (rows before the diagonal see nothing)")
    qq = jnp.concatenate([q, q], axis=2)  # Lq 128 > Lk 96
    out, lse = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, scale=scale, wr=0, br=True))(qq, k, v)
    print("  ", describe("out rows 0..31 (empty)", out[:, :, :32]))
    print("  ", describe("lse rows 0..31 (empty)", lse[:, :, :32]))

    print("== bool mask with a fully masked row (as a -inf bias)")
    mask = jnp.ones((1, 1, lq, lk), bool).at[:, :, 5, :].set(False)
    out, lse = jax.jit(lambda q, k, v, m: ffi_fwd(q, k, v, m, scale=scale))(q, k, v, mask)
    print("  ", describe("out row 5", out[:, :, 5]))
    print("  ", describe("lse row 5", lse[:, :, 5]))
    sinks = jnp.zeros((1, hq), jnp.float32)
    out, lse = jax.jit(lambda q, k, v, m, s: ffi_fwd(q, k, v, m, s, scale=scale))(q, k, v, mask, sinks)
    print("  ", describe("with sinks=0: out row 5", out[:, :, 5]))
    print("  ", describe("with sinks=0: lse row 5", lse[:, :, 5]))


if __name__ == "__main__":
    main()
