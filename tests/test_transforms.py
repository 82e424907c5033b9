"""jit, vmap (every in_axes form, nested), grad, grad-of-vmap, vmap-of-grad, eval_shape,
checkpoint and loops, for every implementation available here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
import functools

from sdpa_testing import (assert_close, fp32_rtol, implementations_here, oracle_forward,
                          serves_or_skip)

IMPLS = implementations_here()


def skip_if_not_served(test):
    """These tests are float32: an implementation that refuses it (cuDNN) skips."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with serves_or_skip():
            return test(*args, **kwargs)
    return wrapper


def _qkv(rng, b=2, hq=4, hk=2, lq=6, lk=10, d=16, dv=8):
    q = jnp.asarray(rng.standard_normal((b, hq, lq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hk, lk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hk, lk, dv)), jnp.float32)
    return q, k, v


def _oracle(q, k, v, **kw):
    return oracle_forward(np.asarray(q, np.float64), np.asarray(k, np.float64),
                          np.asarray(v, np.float64), **kw)[0]


@pytest.mark.parametrize("impl", IMPLS)
@skip_if_not_served
@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 0, 0), (1, 1, 1),
                                     (3, 0, None)])
def test_vmap_in_axes(impl, in_axes, rng):
    n = 3
    base = _qkv(rng)
    batched = []
    for x, ax in zip(base, in_axes):
        if ax is None:
            batched.append(x)
        else:
            stacked = jnp.stack([x + i for i in range(n)])
            batched.append(jnp.moveaxis(stacked, 0, ax))
    fn = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                               implementation=impl)
    out = jax.jit(jax.vmap(fn, in_axes=in_axes))(*batched)
    for i in range(n):
        args = [x if ax is None else jnp.take(x, i, axis=ax) for x, ax in zip(batched, in_axes)]
        assert_close(out[i], _oracle(*args, mask="causal"), "float32", rtol_fp32=fp32_rtol(impl))


@pytest.mark.parametrize("impl", IMPLS)
@skip_if_not_served
def test_vmap_of_mask_sinks_lengths(impl, rng):
    """Batched mask (with a broadcast batch dim), batched sinks and lengths."""
    n = 2
    q, k, v = _qkv(rng)
    masks = jnp.asarray(rng.standard_normal((n, 1, 4, 6, 10)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
    lengths = jnp.asarray(rng.integers(1, 11, size=(n, 2)), jnp.int32)
    fn = lambda m, s, l: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask=m, sinks=s, key_value_seq_lengths=l, implementation=impl)
    out = jax.jit(jax.vmap(fn))(masks, sinks, lengths)
    for i in range(n):
        want = _oracle(q, k, v, mask=np.asarray(masks[i]), sinks=np.asarray(sinks[i]),
                       key_value_seq_lengths=np.asarray(lengths[i]))
        assert_close(out[i], want, "float32", rtol_fp32=fp32_rtol(impl))


@pytest.mark.parametrize("impl", IMPLS)
@skip_if_not_served
def test_nested_vmap_and_grad_of_vmap(impl, rng):
    q, k, v = _qkv(rng, b=1)
    q2 = jnp.stack([jnp.stack([q * (i + 1) * (j + 1) for j in range(2)]) for i in range(3)])
    fn = lambda q: jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
    out = jax.jit(jax.vmap(jax.vmap(fn)))(q2)
    assert out.shape == (3, 2) + q.shape[:3] + (v.shape[-1],)
    assert_close(out[2, 1], _oracle(q2[2, 1], k, v), "float32", rtol_fp32=fp32_rtol(impl))

    def loss(q2, k):
        f = lambda q: jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
        return jnp.sum(jax.vmap(jax.vmap(f))(q2) ** 2)

    def loss_ref(q2, k):
        f = lambda q: jax_sdpa.scaled_dot_product_attention(q, k, v, implementation="xla")
        return jnp.sum(jax.vmap(jax.vmap(f))(q2) ** 2)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(q2, k)
    want = jax.jit(jax.grad(loss_ref, argnums=(0, 1)))(q2, k)
    for g, w in zip(got, want):
        assert_close(g, w, "float32", rtol_fp32=fp32_rtol(impl, 2e-5, grad=True))


@pytest.mark.parametrize("impl", IMPLS)
@skip_if_not_served
def test_vmap_of_grad(impl, rng):
    q, k, v = _qkv(rng)
    qs = jnp.stack([q, 2 * q])

    def g(impl_name):
        f = lambda q: jnp.sum(jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask="causal", implementation=impl_name) ** 2)
        return jax.jit(jax.vmap(jax.grad(f)))(qs)

    assert_close(g(impl), g("xla"), "float32", rtol_fp32=fp32_rtol(impl, 2e-5, grad=True))


@pytest.mark.parametrize("impl", IMPLS)
@skip_if_not_served
def test_eval_shape_checkpoint_and_loops(impl, rng):
    q, k, v = _qkv(rng)
    fn = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
    shape = jax.eval_shape(fn, q, k, v)
    assert shape.shape == (2, 4, 6, 8) and shape.dtype == jnp.float32

    ck = jax.checkpoint(lambda q: jnp.sum(fn(q, k, v) ** 2))
    ref = lambda q: jnp.sum(jax_sdpa.scaled_dot_product_attention(
        q, k, v, implementation="xla") ** 2)
    assert_close(jax.jit(jax.grad(ck))(q), jax.jit(jax.grad(ref))(q), "float32",
                 rtol_fp32=fp32_rtol(impl, 2e-5, grad=True))

    # inside lax.scan and fori_loop (the decode-loop shape)
    def body(carry, _):
        out = fn(carry, k, v)
        return jnp.concatenate([out, out], axis=-1), None

    final, _ = jax.jit(lambda q: jax.lax.scan(body, q, None, length=3))(q)
    expect = q
    for _ in range(3):
        o = jnp.asarray(_oracle(expect, k, v), jnp.float32)
        expect = jnp.concatenate([o, o], axis=-1)
    assert_close(final, expect, "float32", rtol_fp32=fp32_rtol(impl, 3e-5))


def test_eager_call_matches_jit(rng):
    q, k, v = _qkv(rng)
    eager = jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal")
    jitted = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal"))(q, k, v)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)
