"""Drop-in behaviour found with Flax's and MLX's own attention tests:

- Flax: `force_fp32_for_softmax` gives float32 attention weights (sown) and a float32
  result with 16-bit inputs, as Flax's dot_product_attention does; precision or
  einsum_dot_general together with custom einsums raise Flax's ValueError; complex inputs
  work (Flax's own computation) wherever Flax's default works.
- MLX: sinks whose dtype does not promote to the output dtype raise MLX's error (checked
  against MLX itself when mlx is installed).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa.flax import attention_fn, make_attention_fn  # noqa: E402
from sdpa_testing import implementations_here  # noqa: E402

IMPLS = implementations_here()


def _key(rng):
    return jax.random.key(int(rng.integers(2**31)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_force_fp32_for_softmax_sows_float32_weights_like_flax(dtype, rng):
    x = jax.random.normal(_key(rng), (2, 6, 16))
    kw = dict(num_heads=2, dtype=dtype, force_fp32_for_softmax=True)
    theirs = nn.MultiHeadDotProductAttention(**kw)
    ours = nn.MultiHeadDotProductAttention(attention_fn=attention_fn, **kw)
    params = theirs.init(jax.random.key(0), x)
    (want, want_w), (got, got_w) = (
        m.apply(params, x, sow_weights=True, mutable=["intermediates"]) for m in (theirs, ours))
    (w,), (g,) = (t["intermediates"]["attention_weights"] for t in (want_w, got_w))
    assert w.dtype == g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=2e-2)


@pytest.mark.parametrize("impl", [None] + IMPLS)
def test_force_fp32_for_softmax_fused_result_is_float32(impl, rng):
    q, k, v = (jax.random.normal(kk, (2, 7, 2, 16), jnp.bfloat16)
               for kk in jax.random.split(_key(rng), 3))
    want = flax.linen.dot_product_attention(q, k, v, force_fp32_for_softmax=True)
    got = make_attention_fn(implementation=impl)(q, k, v, force_fp32_for_softmax=True)
    assert want.dtype == got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2)
    # without it, the computation dtype (as Flax)
    plain = make_attention_fn(implementation=impl)(q, k, v)
    assert plain.dtype == flax.linen.dot_product_attention(q, k, v).dtype == jnp.bfloat16


def test_precision_with_custom_einsums_is_flax_value_error(rng):
    q = jax.random.normal(_key(rng), (1, 4, 2, 8))
    kw = dict(qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)
    for extra in (dict(precision=jax.lax.Precision.HIGHEST),
                  dict(einsum_dot_general=jax.lax.dot_general)):
        with pytest.raises(ValueError, match="mutually exclusive"):
            flax.linen.dot_product_attention(q, q, q, **extra, **kw)
        with pytest.raises(ValueError, match="mutually exclusive"):
            attention_fn(q, q, q, **extra, **kw)


@pytest.mark.parametrize("dtype", [jnp.complex64])
def test_complex_inputs_take_flax_path(dtype, rng):
    ks = jax.random.split(_key(rng), 7)
    q, k, v = (jax.random.normal(a, (2, 5, 2, 8)) + 1j * jax.random.normal(b, (2, 5, 2, 8))
               for a, b in zip(ks[:3], ks[3:6]))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    mask = jax.random.bernoulli(ks[6], 0.7, (2, 2, 5, 5))
    for kw in (dict(), dict(mask=mask), dict(bias=jnp.ones((1, 2, 5, 5), dtype))):
        # Both jitted: a complex softmax's sum can come near 0 and magnify rounding, so Flax's
        # own eager and jitted results differ by up to 1e-4 relative on these inputs.
        want = jax.jit(functools.partial(flax.linen.dot_product_attention, **kw))(q, k, v)
        got = jax.jit(functools.partial(attention_fn, **kw))(q, k, v)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # gradients too, where JAX differentiates Flax's own (jax 0.12's softmax refuses complex)
    loss = lambda f: (lambda q: jnp.sum(jnp.abs(f(q, k, v)) ** 2))  # noqa: E731
    try:
        want = jax.jit(jax.grad(loss(flax.linen.dot_product_attention)))(q)
    except TypeError:
        with pytest.raises(TypeError):
            jax.jit(jax.grad(loss(attention_fn)))(q)
    else:
        np.testing.assert_allclose(jax.jit(jax.grad(loss(attention_fn)))(q), want, rtol=1e-4,
                                   atol=1e-5)
    # a named fused implementation says why it can't
    with pytest.raises(NotImplementedError, match="complex"):
        make_attention_fn(implementation="xla_chunked")(q, k, v)


def test_complex_in_flax_modules(rng):
    x = (jax.random.normal(_key(rng), (2, 4, 8)) + 0j).astype(jnp.complex64)
    theirs = nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=jnp.complex64)
    ours = nn.MultiHeadDotProductAttention(num_heads=2, param_dtype=jnp.complex64,
                                           attention_fn=attention_fn)
    params = theirs.init(jax.random.key(0), x)
    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-5,
                               atol=1e-5)


# ---------------------------------------------------------------------------
# MLX: sinks' dtype

_MLX_REJECTS = [("float16", "float32"), ("float16", "bfloat16"), ("bfloat16", "float16"),
                ("bfloat16", "float32")]
_MLX_ACCEPTS = [("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
                ("float32", "float16"), ("float32", "bfloat16")]


@pytest.mark.parametrize("qkv,sinks", _MLX_REJECTS + _MLX_ACCEPTS)
@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_dtype_rule_is_mlx_s(impl, qkv, sinks, rng):
    dt = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
    q = jnp.asarray(rng.standard_normal((1, 2, 4, 8)), dt[qkv])
    s = jnp.asarray(rng.standard_normal(2), dt[sinks])
    call = functools.partial(jax_sdpa.scaled_dot_product_attention, q, q, q, sinks=s,
                             implementation=impl)
    if (qkv, sinks) in _MLX_REJECTS:
        with pytest.raises(ValueError, match="sinks .* must promote to the output dtype"):
            call()
    else:
        try:
            out = call()
        except NotImplementedError:
            pytest.skip(f"{impl} does not serve {qkv}")
        assert out.dtype == dt[qkv]


@pytest.mark.parametrize("qkv,sinks", _MLX_REJECTS + _MLX_ACCEPTS)
def test_sinks_dtype_rule_matches_mlx_itself(qkv, sinks):
    mx = pytest.importorskip("mlx.core")
    q = mx.zeros((1, 2, 4, 8), getattr(mx, qkv))
    s = mx.zeros((2,), getattr(mx, sinks))
    try:
        mx.eval(mx.fast.scaled_dot_product_attention(q, q, q, scale=1.0, sinks=s))
        mlx_ok = True
    except ValueError as e:
        assert "sinks" in str(e)
        mlx_ok = False
    assert mlx_ok == ((qkv, sinks) in _MLX_ACCEPTS)
