"""The shared test base: cases, inputs, oracles and tolerances for every implementation.

Every backend runs the same cases by being listed in `implementations_here()`;
the oracles are independent of the code under test:
- `oracle_forward` / `oracle_grads`: jax_sdpa.oracle, attention and its gradients in numpy
  float64, written from docs/ffi_contract.md (the tolerances are its policy too);
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

from jax_sdpa import _ext, dispatch, oracle
from jax_sdpa.config import FP32_PRECISION_HIGHEST, current_fp32_precision

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
    """Array inputs as jax arrays in the case dtype (masks keep theirs; sinks take the case
    dtype too: MLX's contract wants their dtype to promote to the output's)."""
    out = dict(inputs)
    for name in ("q", "k", "v"):
        out[name] = jnp.asarray(inputs[name], DTYPES[dtype])
    if out["sinks"] is not None:
        out["sinks"] = jnp.asarray(inputs["sinks"], DTYPES[dtype])
    for name in ("mask",):
        if out[name] is not None and not isinstance(out[name], str):
            out[name] = jnp.asarray(out[name])
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if out[name] is not None:
            out[name] = jnp.asarray(out[name])
    return out


def rounded_float64(x, dtype):
    """What the kernel actually sees: x rounded to `dtype`, as float64."""
    return np.asarray(jnp.asarray(x, DTYPES[dtype]).astype(jnp.float32), np.float64)


# ---------------------------------------------------------------------------
# the oracle: jax_sdpa.oracle (numpy float64, independent of the code under test)

def oracle_forward(q, k, v, mask=None, sinks=None, query_seq_lengths=None,
                   key_value_seq_lengths=None, scale=None, window_left=-1, window_right=-1,
                   bottom_right=False):
    """q [B, Hq, Lq, D] ... in float64. mask: None | 'causal' | bool | additive array
    broadcastable to [B, Hq, Lq, Lk]. Returns (out [B, Hq, Lq, Dv], lse [B, Hq, Lq])."""
    return oracle.forward(q, k, v, scale=scale, mask=mask, sinks=sinks,
                          q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
                          window_left=window_left, window_right=window_right,
                          bottom_right=bottom_right)


def oracle_inputs_f64(inputs, dtype):
    """Oracle inputs: the case's inputs rounded to its dtype, then float64."""
    out = dict(inputs)
    for name in ("q", "k", "v") + (("sinks",) if inputs.get("sinks") is not None else ()):
        out[name] = rounded_float64(inputs[name], dtype)
    return out


def oracle_grads(inputs, case, wrt):
    """The oracle's float64 gradients (jax_sdpa.oracle.backward: from the forward's
    probabilities, independent of our backward). `inputs` as from random_inputs plus a
    "cotangent" [B, Hq, Lq, Dv]; `wrt` indexes (q, k, v, mask, sinks)."""
    f64 = oracle_inputs_f64(inputs, case.dtype)
    mask = f64["mask"]
    if mask is not None and not isinstance(mask, str) and mask.dtype != np.bool_:
        mask = np.asarray(mask, np.float64)
    grads = oracle.backward(f64["q"], f64["k"], f64["v"], inputs["cotangent"],
                            scale=case.scale or 1.0 / np.sqrt(case.d), mask=mask,
                            sinks=f64["sinks"], q_lengths=f64["query_seq_lengths"],
                            kv_lengths=f64["key_value_seq_lengths"])
    names = ("dq", "dk", "dv", "dmask", "dsinks")
    return [np.asarray(grads[names[i]]) for i in wrt]


# ---------------------------------------------------------------------------
# tolerances

# One policy: jax_sdpa.oracle's.
FP32_RTOL = oracle.FP32_RTOL
FP32_GRAD_RTOL = oracle.FP32_GRAD_RTOL
TF32_RTOL = oracle.TF32_RTOL
TF32_GRAD_RTOL = oracle.TF32_GRAD_RTOL
TF32_IMPLEMENTATIONS = oracle.TF32_IMPLEMENTATIONS
LOW_PRECISION_FLOOR = oracle.LOW_PRECISION_FLOOR


def fp32_rtol(impl, rtol=FP32_RTOL, grad=False):
    """The float32 tolerance for `impl` under JAX's *current* default matmul precision:
    `rtol` (full fp32) under "highest" (e.g. JAX_DEFAULT_MATMUL_PRECISION=highest, as the
    GPU runs of the shared suite use) or where nothing rounds to TF32 (the CPU); at the
    default precision on a GPU, TF32_RTOL (TF32_GRAD_RTOL for gradients) for
    TF32_IMPLEMENTATIONS."""
    tf32 = current_fp32_precision() != FP32_PRECISION_HIGHEST and jax.default_backend() == "gpu"
    if tf32 and impl in TF32_IMPLEMENTATIONS:
        return max(rtol, TF32_GRAD_RTOL if grad else TF32_RTOL)
    return rtol


def max_rel_error(got, want):
    return oracle.max_rel_error(got, want)


def assert_no_nan(x, what="output"):
    arr = np.asarray(jnp.asarray(x).astype(jnp.float32))
    assert not np.isnan(arr).any(), f"{what} contains NaN"


def assert_close(got, want, dtype, xla_same_dtype=None, rtol_fp32=FP32_RTOL, what="output"):
    """fp32: max error <= rtol_fp32 relative to max |want|. fp16/bf16: no worse than 2x
    the error of XLA in the same dtype plus a floor (jax_sdpa.oracle.tolerance)."""
    assert_no_nan(got, what)
    err = max_rel_error(got, want)
    if dtype == "float32":
        assert err <= rtol_fp32, f"{what}: relative error {err:.3g} > {rtol_fp32:.1g}"
        return err
    bound = oracle.tolerance(dtype, xla_error=None if xla_same_dtype is None else
                             max_rel_error(xla_same_dtype, want))
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
