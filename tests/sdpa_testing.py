"""The shared test base: cases, inputs, oracles and tolerances for every implementation.

Every backend runs the same cases by being listed in `implementations_here()`;
the oracles are independent of the code under test:
- `oracle_forward`: attention in numpy float64, written from docs/ffi_contract.md;
- `oracle_grads`: jax.grad of the exact reference in float64 (autodiff of the
  forward, independent of our hand-written backward formulas);
- MLX on the CPU (tests/test_mlx_parity.py) and jax.nn's xla implementation
  (tests/test_jax_nn_contract.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa import _ext, dispatch, reference
from jax_sdpa.config import FP32_PRECISION_HIGHEST, StaticParams, current_fp32_precision

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": jnp.bfloat16}


def implementations_here(platform: Optional[str] = None):
    """Implementations that can run on this machine's default platform."""
    platform = platform or ("cuda" if jax.default_backend() == "gpu" else jax.default_backend())
    names = ["xla", "xla_chunked"]
    for name in ("cpu", "metal", "cudnn", "cuda"):
        if dispatch.FUSED_PLATFORMS[name] == platform and _ext.has_backend(name):
            names.append(name)
    return names


# Shapes the Metal emulator runs in reasonable time; other implementations get all.
SLOW_IMPLEMENTATIONS = {"metal"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention call, described statically (inputs are drawn fresh per run)."""

    b: int = 2
    hq: int = 4
    hk: int = 2
    lq: int = 7
    lk: int = 9
    d: int = 32
    dv: Optional[int] = None
    dtype: str = "float32"
    mask: str = "none"  # none | causal | bool | additive | additive_inf
    mask_shape: Optional[tuple] = None  # broadcast pattern, e.g. (1, 1, "lq", "lk")
    sinks: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    scale: Optional[float] = None

    @property
    def head_dim_v(self):
        return self.dv or self.d

    def id(self):
        parts = [f"b{self.b}h{self.hq}k{self.hk}", f"q{self.lq}k{self.lk}", f"d{self.d}"]
        if self.dv:
            parts.append(f"dv{self.dv}")
        parts.append(self.dtype)
        if self.mask != "none":
            shape = "" if self.mask_shape is None else "x".join(str(s) for s in self.mask_shape)
            parts.append(self.mask + shape)
        for flag in ("sinks", "q_lengths", "kv_lengths"):
            if getattr(self, flag):
                parts.append(flag)
        return "-".join(parts)

    def mask_dims(self):
        full = {"b": self.b, "h": self.hq, "lq": self.lq, "lk": self.lk}
        pattern = self.mask_shape or ("b", "h", "lq", "lk")
        return tuple(full[p] if isinstance(p, str) else p for p in pattern)


def random_inputs(case: Case, rng: np.random.Generator):
    """Fresh random inputs: dict of numpy arrays (float32 for float data)."""
    dv = case.head_dim_v
    q = rng.standard_normal((case.b, case.hq, case.lq, case.d)).astype(np.float32)
    k = rng.standard_normal((case.b, case.hk, case.lk, case.d)).astype(np.float32)
    v = rng.standard_normal((case.b, case.hk, case.lk, dv)).astype(np.float32)
    mask = None
    if case.mask == "bool":
        mask = rng.random(case.mask_dims()) < 0.7
    elif case.mask == "additive":
        mask = rng.standard_normal(case.mask_dims()).astype(np.float32)
    elif case.mask == "additive_inf":
        mask = rng.standard_normal(case.mask_dims()).astype(np.float32)
        mask[rng.random(mask.shape) < 0.3] = -np.inf
    elif case.mask == "causal":
        mask = "causal"
    sinks = rng.standard_normal((case.hq,)).astype(np.float32) if case.sinks else None
    ql = rng.integers(0, case.lq + 1, size=case.b).astype(np.int32) if case.q_lengths else None
    kvl = rng.integers(0, case.lk + 1, size=case.b).astype(np.int32) if case.kv_lengths else None
    if ql is not None:
        ql[0] = case.lq  # one full row so that not everything is padding
    return dict(q=q, k=k, v=v, mask=mask, sinks=sinks, query_seq_lengths=ql,
                key_value_seq_lengths=kvl)


def cast_inputs(inputs, dtype):
    """Array inputs as jax arrays in the case dtype (masks keep theirs)."""
    out = dict(inputs)
    for name in ("q", "k", "v"):
        out[name] = jnp.asarray(inputs[name], DTYPES[dtype])
    for name in ("mask",):
        if out[name] is not None and not isinstance(out[name], str):
            out[name] = jnp.asarray(out[name])
    for name in ("sinks", "query_seq_lengths", "key_value_seq_lengths"):
        if out[name] is not None:
            out[name] = jnp.asarray(out[name])
    return out


def rounded_float64(x, dtype):
    """What the kernel actually sees: x rounded to `dtype`, as float64."""
    return np.asarray(jnp.asarray(x, DTYPES[dtype]).astype(jnp.float32), np.float64)


# ---------------------------------------------------------------------------
# float64 numpy oracle (MLX semantics; docs/ffi_contract.md)

def oracle_forward(q, k, v, mask=None, sinks=None, query_seq_lengths=None,
                   key_value_seq_lengths=None, scale=None, window_left=-1, window_right=-1,
                   bottom_right=False):
    """q [B, Hq, Lq, D] ... in float64. mask: None | 'causal' | bool | additive array
    broadcastable to [B, Hq, Lq, Lk]. Returns (out [B, Hq, Lq, Dv], lse [B, Hq, Lq])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = hq // hk
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    k_full = np.repeat(k, g, axis=1)
    v_full = np.repeat(v, g, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, k_full) * scale
    if isinstance(mask, str):
        assert mask == "causal"
        window_right, bottom_right = 0, True
        mask = None
    visible = np.ones((b, hq, lq, lk), bool)
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            visible &= np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape),
                                       visible.shape)
        else:
            add = np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
                                  .astype(np.float64), s.shape)
            s = s + add
            visible &= np.isfinite(add)
    qlen = np.full(b, lq) if query_seq_lengths is None else np.clip(query_seq_lengths, 0, lq)
    kvlen = np.full(b, lk) if key_value_seq_lengths is None else np.clip(
        key_value_seq_lengths, 0, lk)
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    for bi in range(b):
        vis = (i < qlen[bi]) & (j < kvlen[bi])
        offset = kvlen[bi] - qlen[bi] if bottom_right else 0
        dd = j - (i + offset)
        if window_left >= 0:
            vis &= dd >= -window_left
        if window_right >= 0:
            vis &= dd <= window_right
        visible[bi] &= vis[None]
    s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe[..., None])
    total = p.sum(-1)
    if sinks is not None:
        total = total + np.exp(np.asarray(sinks, np.float64)[None, :, None] - m_safe)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    padded = i[None, :, 0] >= qlen[:, None]  # [B, Lq]
    lse = np.where(padded[:, None, :], -np.inf, lse)
    p = np.where(np.isfinite(lse)[..., None], p / np.where(total > 0, total, 1)[..., None], 0)
    out = np.einsum("bhij,bhjd->bhid", p, v_full)
    return out, lse


def oracle_inputs_f64(inputs, dtype):
    """Oracle inputs: the case's inputs rounded to its dtype, then float64."""
    out = dict(inputs)
    for name in ("q", "k", "v"):
        out[name] = rounded_float64(inputs[name], dtype)
    return out


def oracle_grads(inputs, case, wrt):
    """jax.grad of the exact reference in float64 (independent of our backward).
    `inputs` as from random_inputs plus a "cotangent" [B, Hq, Lq, Dv]; `wrt` indexes
    (q, k, v, mask, sinks). Returns numpy float64 gradients."""
    with jax.enable_x64(True):
        f64 = oracle_inputs_f64(inputs, case.dtype)
        mask = f64["mask"]
        params = StaticParams(scale=case.scale or 1.0 / np.sqrt(case.d))
        if isinstance(mask, str):
            params = StaticParams(scale=params.scale, window_right=0, bottom_right=True)
            mask = None
        elif mask is not None:
            mask = jnp.asarray(mask.reshape((1,) * (4 - mask.ndim) + mask.shape))
            if mask.dtype != jnp.bool_:
                mask = mask.astype(jnp.float64)
        sinks = None if f64["sinks"] is None else jnp.asarray(f64["sinks"], jnp.float64)[None]
        ql, kvl = f64["query_seq_lengths"], f64["key_value_seq_lengths"]
        ct = jnp.asarray(inputs["cotangent"], jnp.float64)

        def loss(q, k, v, mask, sinks):
            out, _ = reference.forward(q, k, v, mask, sinks,
                                       None if ql is None else jnp.asarray(ql),
                                       None if kvl is None else jnp.asarray(kvl), params,
                                       precision=jax.lax.Precision.HIGHEST)
            return jnp.sum(out * ct)

        args = [jnp.asarray(f64[n], jnp.float64) for n in ("q", "k", "v")] + [mask, sinks]
        grads = jax.grad(loss, argnums=wrt)(*args)
        return [np.asarray(g) for g in grads]


# ---------------------------------------------------------------------------
# tolerances

# fp32 relative to the largest output; TF32-class kernels get their own bound.
FP32_RTOL = 1e-5
FP32_GRAD_RTOL = 2e-5
TF32_RTOL = 2e-3
TF32_GRAD_RTOL = 2e-3  # the flash kernels' 92-case validation allowed 4e-3 for the backward

# Implementations whose fp32 matmuls may run on TF32 tensor cores at JAX's default matmul
# precision on an NVIDIA GPU: our CUDA flash kernels (fp32_precision = 0) and XLA's own
# dots. (The CUDA decode kernel is fp32 exact, but "cuda" covers both kernels.)
TF32_IMPLEMENTATIONS = frozenset({"cuda", "xla", "xla_chunked"})


def fp32_rtol(impl, rtol=FP32_RTOL, grad=False):
    """The float32 tolerance for `impl` under JAX's *current* default matmul precision:
    `rtol` (full fp32) under "highest" (e.g. JAX_DEFAULT_MATMUL_PRECISION=highest, as the
    GPU runs of the shared suite use) or where nothing rounds to TF32 (the CPU); at the
    default precision on a GPU, TF32_RTOL (TF32_GRAD_RTOL for gradients) for
    TF32_IMPLEMENTATIONS."""
    if current_fp32_precision() == FP32_PRECISION_HIGHEST or jax.default_backend() != "gpu":
        return rtol
    if impl in TF32_IMPLEMENTATIONS:
        return max(rtol, TF32_GRAD_RTOL if grad else TF32_RTOL)
    return rtol
LOW_PRECISION_FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2}


def max_rel_error(got, want):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    # Inputs are unit normals, so outputs and gradients are O(1): the floor of 1 keeps an
    # all-zero oracle (e.g. dq when every row sees a single key) from turning rounding
    # noise into a huge relative error, and is then an absolute bound.
    scale = max(np.max(np.abs(want)), 1.0) if want.size else 1.0
    return float(np.max(np.abs(got - want)) / scale) if want.size else 0.0


def assert_no_nan(x, what="output"):
    arr = np.asarray(jnp.asarray(x).astype(jnp.float32))
    assert not np.isnan(arr).any(), f"{what} contains NaN"


def assert_close(got, want, dtype, xla_same_dtype=None, rtol_fp32=FP32_RTOL, what="output"):
    """fp32: max error <= rtol_fp32 relative to max |want|. fp16/bf16: no worse than 2x
    the error of XLA in the same dtype plus a floor (DESIGN §4)."""
    assert_no_nan(got, what)
    err = max_rel_error(got, want)
    if dtype == "float32":
        assert err <= rtol_fp32, f"{what}: relative error {err:.3g} > {rtol_fp32:.1g}"
        return err
    floor = LOW_PRECISION_FLOOR[dtype]
    bound = floor
    if xla_same_dtype is not None:
        bound = 2 * max_rel_error(xla_same_dtype, want) + floor
    assert err <= bound, f"{what}: relative error {err:.3g} > bound {bound:.3g} ({dtype})"
    return err


class serves_or_skip:
    """Context manager: a named implementation that can't serve this case (it raises
    NotImplementedError with its reason) skips the test instead of failing it."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and issubclass(exc_type, NotImplementedError):
            import pytest
            pytest.skip(f"not served: {exc}")
        return False
