"""Numerics users rely on, for every implementation available here:

- NaN: a row whose visible scores include a NaN is NaN (as jax.nn's xla gives) and so is
  its dq; rows that cannot see it (causal, bool mask, window) stay finite and exact;
  queries, keys and values outside the valid lengths never reach outputs or gradients,
  whatever they hold; rows with nothing to attend stay zeros.
- Scalars: bad scale / is_causal / local_window_size / return_residual raise at trace time
  naming the argument; lengths beyond int32 clamp; head dims of 0; float32 at scale 1e30
  matches the float64 reference.
- Zero query heads: the backward writes every element (outputs are poisoned by conftest).

The float64 oracles are fed finite inputs only: where an input is NaN, the oracle sees the
same call with that entry set to 0, which is exact for every row that cannot see it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from sdpa_testing import (FP32_GRAD_RTOL, FP32_RTOL, Case, implementations_here,
                          max_rel_error, oracle_forward, oracle_grads, serves_or_skip)

IMPLS = implementations_here()


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _mlx(impl, q, k, v, **kw):
    with serves_or_skip():
        return np.asarray(jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
            q, k, v, implementation=impl, **kw))(q, k, v))


def _rows_nan(x):
    """[B, H, L] bool: the row is NaN in every element."""
    return np.all(np.isnan(x), axis=-1)


def _check_rows(got, want, nan_rows, what):
    """Rows in nan_rows are all NaN; every other row is finite and equals the oracle."""
    assert np.all(_rows_nan(got)[nan_rows]), f"{what}: rows that see a NaN are not NaN"
    keep = ~nan_rows
    assert np.isfinite(got[keep]).all(), f"{what}: a row that cannot see the NaN is not finite"
    err = max_rel_error(got[keep], want[keep])
    assert err <= FP32_RTOL * 3, f"{what}: finite rows off by {err:.3g}"


# Lq 6 runs the Metal decode kernel (Lq <= 8), Lq 20 its tiled kernel.
SHAPES = [(1, 2, 1, 6, 6, 8), (2, 4, 2, 20, 20, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_query_makes_its_row_nan(impl, mask, shape, rng):
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    bad = (b - 1, hq - 1, lq // 2, d - 1)
    q_nan = q.copy()
    q_nan[bad] = np.nan
    q_zero = q.copy()
    q_zero[bad] = 0.0
    got = _mlx(impl, q_nan, k, v, mask=mask)
    want, _ = oracle_forward(q_zero, k, v, mask=mask)
    nan_rows = np.zeros(got.shape[:3], bool)
    nan_rows[bad[:3]] = True
    _check_rows(got, want, nan_rows, f"{impl} NaN q{bad}")
    # and the gradient agrees: that row's dq is NaN, the others' finite
    dq = np.asarray(jax.jit(jax.grad(lambda q: jnp.sum(jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask=mask, implementation=impl))))(q_nan))
    assert np.all(np.isnan(dq[bad[:3]])), f"{impl}: the NaN row's dq is not NaN"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("masking", ["causal", "bool"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_key_reaches_only_rows_that_see_it(impl, masking, shape, rng):
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    j = lk // 2
    k_nan = k.copy()
    k_nan[0, 0, j, 1] = np.nan
    k_zero = k.copy()
    k_zero[0, 0, j, 1] = 0.0
    if masking == "causal":  # bottom-right with Lq = Lk: query i sees key j iff j <= i
        mask = "causal"
        sees = np.broadcast_to((np.arange(lq) >= j)[None, None, :], (b, hq, lq))
    else:
        mask = rng.random((b, hq, lq, lk)) < 0.6
        mask[..., 0] = True  # no empty rows
        mask[0, 0, 0, j] = False  # one row of kv head 0 that doesn't see key j, whatever the draw
        sees = mask[..., j]
    got = _mlx(impl, q, k_nan, v, mask=mask)
    want, _ = oracle_forward(q, k_zero, v, mask=mask)
    group = hq // hk
    nan_rows = np.zeros(got.shape[:3], bool)
    nan_rows[0, :group] = sees[0, :group]  # the query heads of kv head 0, batch 0
    assert nan_rows.any() and (~nan_rows).any()
    _check_rows(got, want, nan_rows, f"{impl} NaN k[0, 0, {j}] {masking}")


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_in_additive_mask_makes_its_row_nan(impl, rng):
    b, hq, hk, lq, lk, d = 1, 2, 1, 9, 12, 8
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    bias = _normal(rng, b, hq, lq, lk)
    bias_nan = bias.copy()
    bias_nan[0, 1, 4, 7] = np.nan
    bias_zero = bias.copy()
    bias_zero[0, 1, 4, 7] = 0.0
    got = _mlx(impl, q, k, v, mask=bias_nan)
    want, _ = oracle_forward(q, k, v, mask=bias_zero)
    nan_rows = np.zeros(got.shape[:3], bool)
    nan_rows[0, 1, 4] = True
    _check_rows(got, want, nan_rows, f"{impl} NaN in the additive mask")


@pytest.mark.parametrize("impl", IMPLS)
def test_jax_nn_entry_has_jax_nn_nan_rows(impl, rng):
    """The drop-in's NaN rows are jax.nn's xla ones: a NaN query's row; a NaN key only in
    the rows its causal mask lets see it."""
    b, t, n, h = 1, 7, 2, 8
    q, k, v = (_normal(rng, b, t, n, h) for _ in range(3))
    q[0, 2, 1, 3] = np.nan
    k[0, 4, 0, 0] = np.nan
    for kw in (dict(), dict(is_causal=True)):
        with serves_or_skip():
            got = np.asarray(jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
                q, k, v, implementation=impl, **kw))(q, k, v))
        want = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{impl} {kw}")
        fin = np.isfinite(want)
        assert fin.any()
        assert max_rel_error(got[fin], want[fin]) <= 3 * FP32_RTOL


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("impl", IMPLS)
def test_values_past_the_lengths_never_reach_results(impl, shape, rng):
    """NaN (and huge) queries/keys/values outside the valid lengths: outputs and all three
    gradients equal those with zeros there (the padded keys' dk, dv and rows' dq are 0)."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    ql = np.array([lq - 2] + [lq] * (b - 1), np.int32)
    kvl = np.array([lk - 3] + [lk - 1] * (b - 1), np.int32)
    ct = _normal(rng, b, hq, lq, d)
    clean = [x.copy() for x in (q, k, v)]
    dirty = [x.copy() for x in (q, k, v)]
    for x, c, lengths in ((dirty[0], clean[0], ql), (dirty[1], clean[1], kvl),
                          (dirty[2], clean[2], kvl)):
        for bi, n in enumerate(lengths):
            x[bi, :, n:] = np.nan
            x[bi, :, n:][..., :1] = 3e38
            c[bi, :, n:] = 0.0

    def f(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask="causal", query_seq_lengths=ql, key_value_seq_lengths=kvl,
            implementation=impl)

    def grads(args):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2)))(*args)

    with serves_or_skip():
        out, want = np.asarray(jax.jit(f)(*dirty)), np.asarray(jax.jit(f)(*clean))
        got_g, want_g = grads(dirty), grads(clean)
    assert np.isfinite(out).all(), f"{impl}: padding reached the output"
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g):
        g, w = np.asarray(g), np.asarray(w)
        assert np.isfinite(g).all(), f"{impl}: padding reached {name}"
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=name)
    oracle, _ = oracle_forward(*clean, mask="causal", query_seq_lengths=ql,
                               key_value_seq_lengths=kvl)
    assert max_rel_error(out, oracle) <= 3 * FP32_RTOL


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_row_stays_zero_next_to_a_nan(impl, rng):
    """A row with nothing to attend is 0 even when a key it cannot see is NaN."""
    b, hq, hk, lq, lk, d = 1, 2, 2, 5, 6, 8
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    mask = np.ones((b, hq, lq, lk), bool)
    mask[0, 0, 2] = False  # row 2 of head 0 sees nothing
    mask[0, 0, :, 3] = False  # nobody in head 0 sees key 3 ...
    k[0, 0, 3] = np.nan  # ... which is NaN
    got = _mlx(impl, q, k, v, mask=mask)
    assert np.all(got[0, 0, 2] == 0)
    assert np.isfinite(got[0, 0]).all()


# ---------------------------------------------------------------------------
# scalars

def _qkv(rng, b=1, hq=2, hk=1, lq=5, lk=7, d=8, dv=None):
    return (jnp.asarray(_normal(rng, b, hq, lq, d)), jnp.asarray(_normal(rng, b, hk, lk, d)),
            jnp.asarray(_normal(rng, b, hk, lk, d if dv is None else dv)))


@pytest.mark.parametrize("scale,error", [
    (float("nan"), ValueError), (float("inf"), ValueError), (-float("inf"), ValueError),
    (np.float32("nan"), ValueError), (1j, TypeError), (np.complex64(1), TypeError),
    ("0.5", TypeError), (True, TypeError), (np.array([0.5, 0.5]), TypeError),
    (jnp.ones((1,)), TypeError)])
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_scale_raises_at_trace_time(impl, scale, error, rng):
    q, k, v = _qkv(rng)
    with pytest.raises(error, match="scale"):
        jax_sdpa.scaled_dot_product_attention(q, k, v, scale=scale, implementation=impl)
    qn, kn, vn = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    with pytest.raises(error, match="scale"):
        jax_sdpa.dot_product_attention(qn, kn, vn, scale=scale, implementation=impl)


def test_traced_scale_is_a_clear_type_error(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="scale must be a static Python number"):
        jax.jit(lambda s: jax_sdpa.scaled_dot_product_attention(q, k, v, scale=s))(0.5)
    # a concrete scalar array is a number
    np.testing.assert_allclose(
        jax_sdpa.scaled_dot_product_attention(q, k, v, scale=jnp.float32(0.25)),
        jax_sdpa.scaled_dot_product_attention(q, k, v, scale=0.25))


@pytest.mark.parametrize("kw,error,match", [
    (dict(is_causal="no"), TypeError, "is_causal"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(local_window_size=1.5), TypeError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(local_window_size=(1.0, 2)), TypeError, "local_window_size"),
    (dict(local_window_size=(True, 2)), TypeError, "local_window_size"),
    (dict(local_window_size=-1), ValueError, "local_window_size"),
    (dict(local_window_size="3"), TypeError, "local_window_size"),
    (dict(return_residual="yes"), TypeError, "return_residual"),
])
def test_bad_jax_nn_flags_raise(kw, error, match, rng):
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in _qkv(rng, hk=2))
    with pytest.raises(error, match=match):
        jax_sdpa.dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_lengths_beyond_int32_clamp(impl, rng):
    """2**32 + 3 keys valid means all of them (it wrapped to 3 before); so does 2**31 + 5 in a
    uint32 array; a hugely negative length means none."""
    q, k, v = _qkv(rng, b=3, lq=4, lk=6)
    full = _mlx(impl, q, k, v)
    huge = np.array([2**32 + 3, 2**33, 2**40], np.int64)
    got = _mlx(impl, q, k, v, key_value_seq_lengths=huge)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-6)
    got = _mlx(impl, q, k, v, query_seq_lengths=huge, key_value_seq_lengths=huge)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-6)
    got = _mlx(impl, q, k, v, key_value_seq_lengths=jnp.asarray(
        np.array([2**31 + 5] * 3, np.uint32)))
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-6)
    got = _mlx(impl, q, k, v, key_value_seq_lengths=np.array([-2**40, 6, 6], np.int64))
    assert np.all(got[0] == 0) and np.allclose(got[1:], full[1:], atol=1e-6)
    # the jax.nn entry takes what jax.nn takes (a numpy int64 array becomes int32), clamped
    qn, kn, vn = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    with serves_or_skip():
        nn = jax_sdpa.dot_product_attention(qn, kn, vn, key_value_seq_lengths=huge,
                                            implementation=impl)
    np.testing.assert_allclose(np.swapaxes(np.asarray(nn), 1, 2), full, rtol=0, atol=1e-6)


def test_lengths_beyond_int32_clamp_with_x64(rng):
    q, k, v = _qkv(rng, b=2, lq=4, lk=6)
    full = np.asarray(jax_sdpa.scaled_dot_product_attention(q, k, v))
    with jax.enable_x64(True):
        lengths = jnp.asarray(np.array([2**32 + 3, 2**35], np.int64))
        assert lengths.dtype == jnp.int64
        got = np.asarray(jax_sdpa.scaled_dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths))
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_head_dims(impl, rng):
    # D = 0: every score is 0, so each query averages the values it sees
    q, k, v = _qkv(rng, d=0, dv=8)
    with pytest.raises(ValueError, match="scale"):
        jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
    got = _mlx(impl, q, k, v, scale=1.0, mask="causal")
    want, _ = oracle_forward(np.zeros(q.shape[:3] + (1,)), np.zeros(k.shape[:3] + (1,)),
                             np.asarray(v), mask="causal")
    assert max_rel_error(got, want) <= FP32_RTOL
    with pytest.raises(ValueError, match="scale"):
        jax_sdpa.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, k)))
    # Dv = 0: an empty output, and a backward that runs (zero gradients)
    q, k, v = _qkv(rng, d=8, dv=0)
    with serves_or_skip():
        out = jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl)
        grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_sdpa.scaled_dot_product_attention(
            q, k, v, implementation=impl) ** 2) + jnp.sum(q), argnums=(0, 1, 2)))(q, k, v)
    assert out.shape == (1, 2, 5, 0)
    np.testing.assert_array_equal(grads[0], np.ones(q.shape, np.float32))
    np.testing.assert_array_equal(grads[1], np.zeros(k.shape, np.float32))
    assert grads[2].shape == v.shape


@pytest.mark.parametrize("mask", [None, "causal"])
@pytest.mark.parametrize("scale", [1e30, -1e30])
@pytest.mark.parametrize("lq", [5, 37])
@pytest.mark.parametrize("impl", IMPLS)
def test_float32_huge_scale_matches_float64(impl, lq, scale, mask, rng):
    """Finite logits near 1e31 (float32 holds them): the output equals the float64 reference
    and the gradients are finite, dv exact, dq and dk within float32 rounding of their
    natural size |scale| |k| |v| |dout| (they are differences of nearly equal dot products:
    a saturated softmax)."""
    b, hq, hk, d = 1, 2, 1, 16
    q, k, v = (_normal(rng, b, h, lq, d) for h in (hq, hk, hk))
    ct = _normal(rng, b, hq, lq, d)
    f = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(  # noqa: E731
        q, k, v, scale=scale, mask=mask, implementation=impl)
    with serves_or_skip():
        out = np.asarray(jax.jit(f)(q, k, v))
        got = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2)))(q, k, v)
    want, _ = oracle_forward(q, k, v, mask=mask, scale=scale)
    assert max_rel_error(out, want) <= FP32_RTOL, "forward"
    inputs = dict(q=q, k=k, v=v, mask=mask, sinks=None, query_seq_lengths=None,
                  key_value_seq_lengths=None, cotangent=ct)
    case = Case(b=b, hq=hq, hk=hk, lq=lq, lk=lq, d=d, scale=scale)
    want_g = oracle_grads(inputs, case, (0, 1, 2))
    natural = abs(scale) * np.abs(q).max() * np.abs(k).max() * np.abs(v).max() * np.abs(ct).max()
    for name, g, w in zip(("dq", "dk", "dv"), got, want_g):
        g = np.asarray(g, np.float64)
        assert np.isfinite(g).all(), f"{name} not finite"
        bound = FP32_GRAD_RTOL * (1.0 if name == "dv" else natural)
        err = np.abs(g - w).max() / (max(np.abs(w).max(), 1.0) if name == "dv" else 1.0)
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_query_heads_backward_writes_every_element(impl, rng):
    """q (1, 0, 4, 8) against one kv head: the backward once returned dk/dv from
    uninitialized memory; with poisoned outputs that is NaN."""
    q = jnp.zeros((1, 0, 4, 8), jnp.float32)
    k, v = (jnp.asarray(_normal(rng, 1, 1, 4, 8)) for _ in range(2))
    for mask in (None, "causal"):
        with serves_or_skip():
            out = jax_sdpa.scaled_dot_product_attention(q, k, v, mask=mask, implementation=impl)
            dk, dv = jax.jit(jax.grad(lambda k, v: jnp.sum(jax_sdpa.scaled_dot_product_attention(
                q, k, v, mask=mask, implementation=impl)), argnums=(0, 1)))(k, v)
        assert out.shape == (1, 0, 4, 8)
        np.testing.assert_array_equal(dk, np.zeros(k.shape, np.float32))
        np.testing.assert_array_equal(dv, np.zeros(v.shape, np.float32))
