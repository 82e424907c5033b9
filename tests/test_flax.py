"""jax_sdpa.flax against Flax's own attention, in linen and nnx modules."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import _ext  # noqa: E402
from jax_sdpa.flax import attention_fn, make_attention_fn  # noqa: E402

IMPLS = [None, "xla", "xla_chunked"] + [n for n in ("cpu", "metal") if _ext.has_backend(n)]


def _seed():
    return int(np.random.default_rng().integers(2**31))  # fresh inputs every run


def _close(got, want, rtol=1e-5, what="", scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if scale is None:
        scale = float(np.max(np.abs(want), initial=0.0))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(scale, 1e-6),
                               err_msg=what)


def _tree_close(got, want, rtol=1e-5, what=""):
    # one scale for the whole tree: some gradients (e.g. of the key bias) are exactly
    # zero in theory and only rounding noise in practice
    scale = max(float(np.max(np.abs(np.asarray(x)), initial=0.0))
                for x in jax.tree.leaves(want))
    jax.tree.map(lambda a, b: _close(a, b, rtol, what, scale), got, want)


# --------------------------------------------------------------------------
# the function alone


def test_function_matches_flax_batch_dims_bias_masks():
    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (2, 3, 7, 4, 16))
    k = jax.random.normal(ks[1], (2, 3, 9, 4, 16))
    v = jax.random.normal(ks[2], (2, 3, 9, 4, 16))
    bias = jax.random.normal(ks[3], (3, 1, 7, 9))  # broadcast over the first batch dim
    mask = jax.random.bernoulli(ks[4], 0.7, (2, 3, 1, 7, 9))
    float_mask = mask.astype(jnp.float32)  # Flax: nonzero = attend
    want = nn.dot_product_attention(q, k, v, bias=bias, mask=mask)
    want0 = nn.dot_product_attention(q[0, 0], k[0, 0], v[0, 0], mask=mask[0, 0])
    for impl in IMPLS:
        fn = make_attention_fn(implementation=impl)
        what = f"{impl}, seed {seed}"
        _close(jax.jit(fn)(q, k, v, bias, mask), want, what=what)
        if impl is None:
            _close(jax.jit(lambda *a: fn(*a[:3], bias=a[3], mask=a[4]))(
                q, k, v, bias, float_mask), want, what=what)
            # no batch dims at all
            _close(jax.jit(fn)(q[0, 0], k[0, 0], v[0, 0], None, mask[0, 0]), want0, what=what)


def test_function_dtype_and_promotion():
    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (2, 5, 2, 8), jnp.bfloat16)
    k = jax.random.normal(ks[1], (2, 5, 2, 8), jnp.float32)
    v = jax.random.normal(ks[2], (2, 5, 2, 8), jnp.float32)
    out = jax.jit(attention_fn)(q, k, v)
    assert out.dtype == jnp.float32  # promoted like Flax
    out = jax.jit(functools.partial(attention_fn, dtype=jnp.bfloat16))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want = nn.dot_product_attention(q.astype(jnp.float32), k, v)
    _close(out, want, rtol=2e-2, what=f"seed {seed}")


def test_function_sinks_and_errors():
    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(kk, (1, 6, 2, 8)) for kk in ks[:3])
    sinks = jax.random.normal(ks[3], (2,))
    out = make_attention_fn(sinks=sinks)(q, k, v)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    s = jnp.concatenate([s, jnp.broadcast_to(sinks[None, :, None, None], s.shape[:-1] + (1,))], -1)
    p = jax.nn.softmax(s, -1)[..., :-1]
    _close(out, jnp.einsum("bhqk,bkhd->bqhd", p, v), what=f"seed {seed}")
    with pytest.raises(ValueError, match="heads"):
        attention_fn(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="implementation"):
        make_attention_fn(implementation="nope")
    # dropout would apply but a fused implementation was named: a clear error, not ignored
    with pytest.raises(NotImplementedError, match="dropout"):
        make_attention_fn(implementation="xla_chunked")(
            q, k, v, dropout_rate=0.1, deterministic=False, dropout_rng=ks[0])
    with pytest.raises(ValueError, match="dropout_rng"):
        attention_fn(q, k, v, dropout_rate=0.1, deterministic=False)
    # deterministic or rate 0: dropout is off and the fused path runs
    _close(jax.jit(functools.partial(attention_fn, dropout_rate=0.1, deterministic=True))(
           q, k, v),
           nn.dot_product_attention(q, k, v))


# --------------------------------------------------------------------------
# linen
#
# Each check computes Flax's reference once and compares every implementation with it
# (one compile of the reference per test keeps the suite fast).


def _linen_check(impls, module_kw, args, kwargs, seed, rngs=None, rtol=1e-5, causal=False):
    theirs = nn.MultiHeadDotProductAttention(**module_kw)
    our_mask = kwargs.get("our_mask")
    kwargs = {k: v for k, v in kwargs.items() if k != "our_mask"}
    params = theirs.init(jax.random.key(seed), *args, **kwargs)

    def run(module, call_kwargs):
        def loss(p, *a):
            out = module.apply(p, *a, **call_kwargs, rngs=rngs)
            return jnp.sum(out * jnp.cos(out)), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, *args)
        return out, grads

    want_out, want_grads = run(theirs, kwargs)
    for impl in impls:
        fn = make_attention_fn(is_causal=causal, implementation=impl)
        ours = nn.MultiHeadDotProductAttention(attention_fn=fn, **module_kw)
        # with causal=True the function supplies the causal part of the mask itself
        call_kwargs = dict(kwargs, mask=our_mask) if causal else kwargs
        out, grads = run(ours, call_kwargs)
        _close(out, want_out, rtol, f"{impl}, seed {seed}")
        _tree_close(grads, want_grads, rtol * 5, f"{impl} grads, seed {seed}")


def test_linen_self_attention_causal_and_padding():
    seed = _seed()
    b, t, f = 2, 13, 32
    x = jax.random.normal(jax.random.key(seed), (b, t, f))
    valid = jnp.arange(t)[None] < jnp.array([t, 9])[:, None]
    padding = nn.make_attention_mask(valid, valid)
    mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((b, t))), padding)
    _linen_check(IMPLS, dict(num_heads=4, qkv_features=32), (x,), dict(mask=mask), seed)
    # make_attention_fn(is_causal=True) + the padding mask == Flax with both masks
    _linen_check([None], dict(num_heads=4, qkv_features=32), (x,),
                 dict(mask=mask, our_mask=padding), seed, causal=True)


def test_linen_cross_attention_padding():
    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 2)
    xq = jax.random.normal(ks[0], (3, 5, 24))
    xkv = jax.random.normal(ks[1], (3, 11, 16))
    kv_valid = jnp.arange(11)[None] < jnp.array([11, 4, 7])[:, None]
    mask = nn.make_attention_mask(jnp.ones((3, 5), bool), kv_valid)
    _linen_check([None], dict(num_heads=2, qkv_features=16, out_features=8), (xq, xkv),
                 dict(mask=mask), seed)


def test_linen_dropout_equals_flax():
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (2, 3, 8, 16))  # two batch dims
    rngs = {"dropout": jax.random.key(seed + 7)}
    # outputs and grads, per-element dropout
    kw = dict(num_heads=2, dropout_rate=0.4, broadcast_dropout=False, deterministic=False)
    _linen_check([None], kw, (x,), {}, seed, rngs=rngs)
    # broadcast dropout (shared over batch and heads): outputs
    kw = dict(kw, broadcast_dropout=True)
    ours = nn.MultiHeadDotProductAttention(attention_fn=attention_fn, **kw)
    theirs = nn.MultiHeadDotProductAttention(**kw)
    params = theirs.init(jax.random.key(0), x)
    apply_ours = jax.jit(lambda p, x, key: ours.apply(p, x, rngs={"dropout": key}))
    _close(apply_ours(params, x, rngs["dropout"]),
           jax.jit(lambda p, x, key: theirs.apply(p, x, rngs={"dropout": key}))(
               params, x, rngs["dropout"]), what=f"seed {seed}")
    # the dropout really applies: different rngs give different outputs
    a = apply_ours(params, x, jax.random.key(1))
    b = apply_ours(params, x, jax.random.key(2))
    assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def test_linen_sow_weights_and_bf16():
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (2, 6, 16))
    ours = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attention_fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=2)
    params = theirs.init(jax.random.key(1), x)
    _, ours_w = ours.apply(params, x, sow_weights=True, mutable=["intermediates"])
    _, theirs_w = theirs.apply(params, x, sow_weights=True, mutable=["intermediates"])
    _tree_close(ours_w, theirs_w, what=f"seed {seed}")
    ours = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=attention_fn,
                                           dtype=jnp.bfloat16)
    theirs = nn.MultiHeadDotProductAttention(num_heads=2, dtype=jnp.bfloat16)
    got, want = jax.jit(ours.apply)(params, x), theirs.apply(params, x)
    assert got.dtype == want.dtype == jnp.bfloat16
    _close(got, want, rtol=3e-2, what=f"seed {seed}")


# --------------------------------------------------------------------------
# nnx


def _nnx_run(model, args, kwargs):
    @nnx.jit  # kwargs (masks, flags) closed over: flags must stay static
    def run(model, args):
        def loss(m):
            out = m(*args, **kwargs)
            return jnp.sum(out * jnp.cos(out)), out

        (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return out, nnx.state(grads, nnx.Param)

    return run(model, args)


def _nnx_check(impls, module_kw, args, kwargs, seed, rtol=1e-5, causal=False,
               our_kwargs=None):
    theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(seed), **module_kw)
    want_out, want_grads = _nnx_run(theirs, args, kwargs)
    for impl in impls:
        fn = make_attention_fn(is_causal=causal, implementation=impl)
        ours = nnx.MultiHeadAttention(attention_fn=fn, rngs=nnx.Rngs(seed), **module_kw)
        out, grads = _nnx_run(ours, args, kwargs if our_kwargs is None else our_kwargs)
        _close(out, want_out, rtol, f"{impl}, seed {seed}")
        _tree_close(grads, want_grads, rtol * 5, f"{impl} grads, seed {seed}")


def _nnx_supports_gqa():
    import inspect
    return "num_kv_heads" in inspect.signature(nnx.MultiHeadAttention.__init__).parameters


GQA = [1, 2] if _nnx_supports_gqa() else [1]


@pytest.mark.parametrize("group", GQA)
def test_nnx_self_attention_causal_padding(group):
    """GQA where nnx has it, causal + padding masks, every implementation."""
    seed = _seed()
    b, t, f, heads = 2, 11, 32, 4
    x = jax.random.normal(jax.random.key(seed), (b, t, f))
    valid = jnp.arange(t)[None] < jnp.array([t, 6])[:, None]
    causal = nnx.make_causal_mask(jnp.ones((b, t)))
    mask = nnx.combine_masks(causal, nnx.make_attention_mask(valid, valid))
    kw = dict(num_heads=heads, in_features=f, qkv_features=32, decode=False)
    if group > 1:
        kw["num_kv_heads"] = heads // group
    _nnx_check(IMPLS if group == GQA[-1] else [None], kw, (x,), dict(mask=mask), seed)
    if group > 1:
        return
    # nnx's own is_causal= flag, and make_attention_fn(is_causal=True)
    _nnx_check([None], kw, (x,), dict(is_causal=True), seed)
    _nnx_check([None], kw, (x,), dict(mask=causal), seed, causal=True, our_kwargs={})


def test_nnx_cross_attention():
    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 2)
    xq = jax.random.normal(ks[0], (2, 4, 16))
    xkv = jax.random.normal(ks[1], (2, 9, 16))
    kv_valid = jnp.arange(9)[None] < jnp.array([9, 3])[:, None]
    mask = nnx.make_attention_mask(jnp.ones((2, 4), bool), kv_valid)
    _nnx_check([None], dict(num_heads=2, in_features=16, decode=False), (xq, xkv),
               dict(mask=mask), seed)


def test_nnx_dropout_equals_flax():
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (2, 8, 16))
    kw = dict(num_heads=2, in_features=16, dropout_rate=0.3, decode=False)
    ours = nnx.MultiHeadAttention(attention_fn=attention_fn,
                                  rngs=nnx.Rngs(seed, dropout=seed + 1), **kw)
    theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(seed, dropout=seed + 1), **kw)
    train = nnx.jit(lambda m, x: m(x, deterministic=False))  # advances m's dropout rng
    a = train(ours, x)
    b = train(theirs, x)
    _close(a, b, what=f"seed {seed}")
    a2 = train(ours, x)  # next rng draw: a different dropout pattern
    assert float(jnp.max(jnp.abs(a - a2))) > 1e-3
    run = nnx.jit(lambda m, x: m(x, deterministic=True))
    _close(run(ours, x), run(theirs, x), what=f"seed {seed}")


def test_nnx_decode_cache_matches_flax():
    """nnx's own KV-cache decoding (a length mask over the cache) through attention_fn."""
    seed = _seed()
    x = jax.random.normal(jax.random.key(seed), (2, 5, 16))
    kw = dict(num_heads=2, in_features=16, decode=True)
    ours = nnx.MultiHeadAttention(attention_fn=attention_fn, rngs=nnx.Rngs(seed), **kw)
    theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(seed), **kw)
    for m in (ours, theirs):
        m.init_cache(x.shape)
    step = nnx.jit(lambda m, x: m(x))
    for i in range(x.shape[1]):
        _close(step(ours, x[:, i:i + 1]), step(theirs, x[:, i:i + 1]),
               what=f"seed {seed} step {i}")


def test_jax_sdpa_is_really_used():
    x = jnp.ones((1, 4, 8))
    m = nnx.MultiHeadAttention(num_heads=2, in_features=8, attention_fn=attention_fn,
                               rngs=nnx.Rngs(0), decode=False)
    jaxpr = str(jax.make_jaxpr(lambda x: m(x))(x))
    assert "jax_sdpa_fwd" in jaxpr
    assert jax_sdpa.explain(jnp.ones((1, 2, 4, 4)), jnp.ones((1, 2, 4, 4)),
                            jnp.ones((1, 2, 4, 4))).chosen in jax_sdpa.IMPLEMENTATIONS


# --------------------------------------------------------------------------
# precision


def test_precision_highest_runs_fused_in_full_fp32_mode(monkeypatch):
    """Off CPU, Flax's precision=HIGHEST keeps the fused path and asks the kernels for full
    float32 accuracy (fp32_precision = 1 on the custom call); HIGH still takes the exact
    path; the default precision leaves the attribute at 0. The trace platform is faked
    (a GPU's decision), the lowering is this machine's."""
    import re

    from jax_sdpa import api

    if not _ext.has_backend("cpu"):
        pytest.skip("needs the native CPU kernel (its custom call carries the attribute)")
    monkeypatch.setattr(api, "trace_platform", lambda: "cuda")
    ks = jax.random.split(jax.random.key(_seed()), 3)
    q, k, v = (jax.random.normal(x, (2, 9, 4, 16)) for x in ks)

    def lowered(precision):
        fn = make_attention_fn(implementation=None)
        f = jax.jit(lambda q, k, v: fn(q, k, v, precision=precision))
        return f.lower(q, k, v).as_text()

    def attrs(text):
        return [int(m) for m in re.findall(r"fp32_precision = (\d+) : i64", text)]

    assert attrs(lowered(jax.lax.Precision.HIGHEST)) == [1]
    assert attrs(lowered("highest")) == [1]
    assert attrs(lowered(None)) == [0]
    assert attrs(lowered(jax.lax.Precision.HIGH)) == []  # exact XLA path, no custom call
    with pytest.raises(NotImplementedError, match="precision"):
        make_attention_fn(implementation="cpu")(q, k, v, precision=jax.lax.Precision.HIGH)
    # and the numbers are Flax's
    want = nn.dot_product_attention(q, k, v, precision=jax.lax.Precision.HIGHEST)
    _close(jax.jit(lambda q, k, v: make_attention_fn()(q, k, v,
                                                       precision=jax.lax.Precision.HIGHEST))(
        q, k, v), want)


# --------------------------------------------------------------------------
# logit soft-capping and packed sequences (segment ids)

def _unserved(impl, feature):
    return impl not in (None, "xla", "xla_chunked") and not all(
        feature in _ext.served_features(f"jax_sdpa_{impl}_{d}") for d in ("fwd", "bwd"))


def test_soft_cap_matches_oracle_and_exact_path():
    """make_attention_fn(logits_soft_cap=c): the cap before bias and mask, fused and on the
    exact path (module= forces it), forward and gradients."""
    from jax_sdpa import oracle

    seed = _seed()
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (2, 7, 4, 16))
    k = jax.random.normal(ks[1], (2, 9, 4, 16)) * 3
    v = jax.random.normal(ks[2], (2, 9, 4, 16))
    bias = jax.random.normal(ks[3], (1, 4, 7, 9))
    cap = 0.8
    want, _ = oracle.forward(np.asarray(q), np.asarray(k), np.asarray(v), mask=np.asarray(bias),
                             seq_major=True, logits_soft_cap=cap)
    for impl in IMPLS:
        if _unserved(impl, "logits_soft_cap"):
            continue
        fn = make_attention_fn(implementation=impl, logits_soft_cap=cap)
        _close(jax.jit(fn)(q, k, v, bias), want, what=f"{impl}, seed {seed}")
    exact = make_attention_fn(logits_soft_cap=cap)
    _close(exact(q, k, v, bias, module=_Sink()), want, what=f"exact, seed {seed}")
    fused = make_attention_fn(logits_soft_cap=cap)
    g_fused = jax.grad(lambda q, k: jnp.sum(jnp.sin(fused(q, k, v, bias))), (0, 1))(q, k)
    g_exact = jax.grad(lambda q, k: jnp.sum(jnp.sin(exact(q, k, v, bias, module=_Sink()))),
                       (0, 1))(q, k)
    _tree_close(g_fused, g_exact, 2e-5, f"grads, seed {seed}")
    with pytest.raises(ValueError, match="logits_soft_cap"):
        make_attention_fn(logits_soft_cap=0.0)


class _Sink:
    """A stand-in module that takes sown weights (forces the exact path)."""

    def sow(self, *args):
        pass


def test_nnx_packed_sequences_equal_a_dense_mask():
    """A model called inside `jax_sdpa.flax.segment_ids(ids)` equals Flax's own attention
    with the equivalent mask (causal within each segment), outputs and parameter grads."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    b, length, feat = 2, 24, 32
    x = jnp.asarray(rng.standard_normal((b, length, feat)), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, length)), axis=1), jnp.int32)
    causal = nnx.make_causal_mask(ids).astype(bool)
    dense = (ids[:, :, None] == ids[:, None, :])[:, None] & causal
    module_kw = dict(num_heads=4, in_features=feat, qkv_features=feat, decode=False)

    theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(seed), **module_kw)
    want_out, want_grads = _nnx_run(theirs, (x,), dict(mask=dense))
    for impl in IMPLS:
        if _unserved(impl, "segment_ids"):
            continue
        ours = nnx.MultiHeadAttention(attention_fn=make_attention_fn(is_causal=True,
                                                                     implementation=impl),
                                      rngs=nnx.Rngs(seed), **module_kw)

        @nnx.jit
        def run(model, x, ids):
            def loss(m):
                with jax_sdpa.flax.segment_ids(ids):
                    out = m(x)
                return jnp.sum(out * jnp.cos(out)), out

            (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
            return out, nnx.state(grads, nnx.Param)

        out, grads = run(ours, x, ids)
        _close(out, want_out, 1e-5, f"{impl}, seed {seed}")
        _tree_close(grads, want_grads, 5e-5, f"{impl} grads, seed {seed}")


def test_segment_ids_block_checks_shapes_and_scopes():
    q = jnp.zeros((2, 8, 2, 16))
    with jax_sdpa.flax.segment_ids(jnp.zeros((2, 7), jnp.int32)):
        with pytest.raises(ValueError, match=r"segment_ids.*\[2, 8\]"):
            attention_fn(q, q, q)
    # outside the block nothing is packed
    ids = jnp.asarray([[0] * 4 + [1] * 4] * 2, jnp.int32)
    with jax_sdpa.flax.segment_ids(ids):
        packed = attention_fn(q + 1, q, q + jnp.arange(8.0)[:, None, None])
    plain = attention_fn(q + 1, q, q + jnp.arange(8.0)[:, None, None])
    assert not np.allclose(packed, plain)
    np.testing.assert_allclose(packed[:, :4], 1.5, rtol=1e-6)
