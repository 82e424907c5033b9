"""`jax_sdpa.scaled_dot_product_attention` against MLX's `mx.fast.scaled_dot_product_attention`
on the CPU (the MLX drop-in): same arguments, same results, on random small configurations.

MLX's fully masked rows differ by code path (mean of V, NaN or 0; we define 0), so the
cases here keep at least one visible key per row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from sdpa_testing import assert_close, implementations_here, serves_or_skip

mx = pytest.importorskip("mlx.core")

IMPLS = implementations_here()
_MX_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def _random_config(rng):
    hk = int(rng.choice([1, 2, 4]))
    cfg = dict(b=int(rng.integers(1, 3)), hk=hk, hq=hk * int(rng.choice([1, 2, 4])),
               lq=int(rng.choice([1, 3, 7, 16, 33])), d=int(rng.choice([16, 32, 64, 80])))
    cfg["lk"] = cfg["lq"] + int(rng.integers(0, 40))  # Lq <= Lk: causal rows never empty
    cfg["dv"] = int(rng.choice([cfg["d"], 32]))
    cfg["mask"] = str(rng.choice(["none", "causal", "bool", "additive", "bool_broadcast",
                                  "additive_broadcast"]))
    cfg["sinks"] = bool(rng.random() < 0.4)
    cfg["scale"] = None if rng.random() < 0.5 else float(rng.uniform(0.05, 0.5))
    return cfg


def _make(cfg, rng):
    b, hq, hk, lq, lk, d, dv = (cfg[k] for k in ("b", "hq", "hk", "lq", "lk", "d", "dv"))
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, dv)).astype(np.float32)
    mask = None
    if cfg["mask"] == "causal":
        mask = "causal"
    elif cfg["mask"].startswith("bool"):
        shape = (b, hq, lq, lk) if cfg["mask"] == "bool" else (lq, lk)
        mask = rng.random(shape) < 0.7
        mask[..., 0] = True  # every row sees at least one key (see module docstring)
    elif cfg["mask"].startswith("additive"):
        shape = (b, hq, lq, lk) if cfg["mask"] == "additive" else (1, hq, 1, lk)
        mask = rng.standard_normal(shape).astype(np.float32)
    sinks = rng.standard_normal((hq,)).astype(np.float32) if cfg["sinks"] else None
    return q, k, v, mask, sinks


def _mlx(q, k, v, mask, sinks, scale, dtype):
    dt = getattr(mx, _MX_DTYPES[dtype])
    args = [mx.array(x).astype(dt) for x in (q, k, v)]
    kw = {}
    if mask is not None:
        kw["mask"] = mask if isinstance(mask, str) else (
            mx.array(mask) if mask.dtype == bool else mx.array(mask).astype(dt))
    if sinks is not None:
        kw["sinks"] = mx.array(sinks).astype(dt)
    out = mx.fast.scaled_dot_product_attention(*args, scale=scale, **kw)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("trial", range(12))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_mlx_float32(impl, trial, rng):
    cfg = _random_config(rng)
    q, k, v, mask, sinks = _make(cfg, rng)
    scale = cfg["scale"] if cfg["scale"] is not None else 1.0 / np.sqrt(cfg["d"])
    want = _mlx(q, k, v, mask, sinks, scale, "float32")
    with serves_or_skip():
        got = jax.jit(lambda q, k, v, m, s: jax_sdpa.scaled_dot_product_attention(
            q, k, v, scale=cfg["scale"], mask="causal" if isinstance(mask, str) else m, sinks=s,
            implementation=impl))(q, k, v, None if isinstance(mask, str) else mask, sinks)
    # MLX and we both compute in float32: agreement well inside float32's rounding
    # of a length-Lk reduction.
    assert_close(got, want, "float32", rtol_fp32=3e-5, what=f"vs MLX {cfg}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_mlx_low_precision(impl, dtype, rng):
    cfg = dict(b=1, hq=4, hk=2, lq=16, lk=40, d=64, dv=64, mask="causal", sinks=True,
               scale=None)
    q, k, v, mask, sinks = _make(cfg, rng)
    scale = 1.0 / np.sqrt(cfg["d"])
    want32 = _mlx(q, k, v, mask, sinks, scale, "float32")
    theirs = _mlx(q, k, v, mask, sinks, scale, dtype)  # MLX in the same dtype
    jdt = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}[dtype]
    with serves_or_skip():
        got = jax_sdpa.scaled_dot_product_attention(
            jnp.asarray(q, jdt), jnp.asarray(k, jdt), jnp.asarray(v, jdt), mask="causal",
            sinks=jnp.asarray(sinks, jdt), implementation=impl)
    # no worse than twice MLX's own error in this dtype, plus a floor
    assert_close(got, want32, dtype, xla_same_dtype=theirs, what="vs MLX")
