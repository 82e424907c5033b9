"""Differentiation: a `jax.custom_vjp` around the forward primitive.

The forward saves (q, k, v, out, lse); the backward binds `sdpa_bwd_p` with the
saved float32 lse and never re-runs the forward. Gradients of sinks and of an
additive mask are computed here in JAX (cheap for sinks; the mask gradient is as
large as the mask) and only when those inputs are being differentiated
(`symbolic_zeros` tells us which inputs are perturbed).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

from jax_sdpa import primitives, reference
from jax_sdpa.config import StaticParams


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def attention(q, k, v, mask, sinks, q_lengths, kv_lengths, params: StaticParams):
    """(out, lse); lse is a non-differentiable residual (its cotangent is ignored)."""
    return primitives.fwd(q, k, v, mask, sinks, q_lengths, kv_lengths, params)


def _value(x):
    return None if x is None else x.value


def _perturbed(x):
    return x is not None and x.perturbed


def _attention_fwd(q, k, v, mask, sinks, q_lengths, kv_lengths, params):
    qv, kv_, vv, maskv, sinksv, qlv, kvlv = map(
        _value, (q, k, v, mask, sinks, q_lengths, kv_lengths))
    out, lse = primitives.fwd(qv, kv_, vv, maskv, sinksv, qlv, kvlv, params)
    # Flags ride in the residuals' tree structure (leafless `()` = yes, None = no)
    # so that they stay static Python values in the backward.
    residuals = (qv, kv_, vv, maskv, sinksv, qlv, kvlv, out, lse,
                 () if _perturbed(mask) else None, () if _perturbed(sinks) else None)
    return (out, lse), residuals


def _attention_bwd(params, residuals, cotangents):
    q, k, v, mask, sinks, q_lengths, kv_lengths, out, lse, want_dmask, want_dsinks = residuals
    dout, _ = cotangents  # the lse residual is not differentiated (like jax.nn)
    if isinstance(dout, SymbolicZero):
        dout = jnp.zeros(dout.shape, dout.dtype)
    dout = dout.astype(out.dtype)
    dq, dk, dv = primitives.bwd(q, k, v, out, lse, dout, mask, sinks, q_lengths, kv_lengths,
                                params)
    dmask = None
    if want_dmask is not None and mask is not None and mask.dtype != jnp.bool_:
        dmask = _mask_grad(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, params)
    dsinks = None
    if want_dsinks is not None and sinks is not None:
        dsinks = _sinks_grad(out, lse, dout, sinks, params)
    return dq, dk, dv, dmask, dsinks, None, None


def _sinks_grad(out, lse, dout, sinks, params):
    """d loss / d sink[h] = -sum_{b, i} P_sink(b, h, i) * (dout_i . out_i)."""
    if params.seq_major:
        out, dout = jnp.swapaxes(out, 1, 2), jnp.swapaxes(dout, 1, 2)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)  # [B,H,L]
    finite = jnp.isfinite(lse)
    s = sinks.astype(jnp.float32)[:, :, None]  # [sB, Hq, 1]
    p_sink = jnp.where(finite, jnp.exp(s - jnp.where(finite, lse, 0)), 0)
    grad = -jnp.sum(p_sink * delta, axis=2)  # [B, Hq]
    if sinks.shape[0] == 1:
        grad = jnp.sum(grad, axis=0, keepdims=True)
    return grad.astype(sinks.dtype)


def _mask_grad(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, params):
    """dS summed over the mask's broadcast dimensions."""
    ds = reference.dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, params,
                           precision=jax.lax.Precision.HIGHEST)
    axes = tuple(i for i in range(4) if mask.shape[i] == 1 and ds.shape[i] != 1)
    if axes:
        ds = jnp.sum(ds, axis=axes, keepdims=True)
    return ds.astype(mask.dtype)


attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
