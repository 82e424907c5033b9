"""Input checks (clear ValueError/TypeError at trace time, naming the argument and shapes),
`implementation=` handling and `explain`; the fp32_precision attribute."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa

Q = jnp.zeros((2, 4, 5, 8))
K = jnp.zeros((2, 2, 7, 8))
V = jnp.zeros((2, 2, 7, 6))


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(q=jnp.zeros((4, 5, 8))), ValueError, r"q must have rank 4.*\(4, 5, 8\)"),
    (dict(k=jnp.zeros((3, 2, 7, 8))), ValueError, r"batch sizes differ"),
    (dict(k=jnp.zeros((2, 3, 7, 8)), v=jnp.zeros((2, 3, 7, 6))), ValueError,
     r"multiple of the number of key/value heads \(3\)"),
    (dict(v=jnp.zeros((2, 1, 7, 6))), ValueError, r"k and v must have the same number of heads"),
    (dict(k=jnp.zeros((2, 2, 7, 9))), ValueError, r"same head dim.*\(2, 2, 7, 9\)"),
    (dict(v=jnp.zeros((2, 2, 6, 6))), ValueError, r"k and v must have the same length"),
    (dict(q=jnp.zeros((2, 4, 5, 8), jnp.int32)), TypeError, r"q must have a floating dtype"),
    (dict(mask="upper"), ValueError, r"mask must be None, 'causal' or an array"),
    (dict(mask=jnp.zeros((3, 5, 7), bool)), ValueError,
     r"mask of shape \(1, 3, 5, 7\) is not broadcastable to \[B, Hq, Lq, Lk\]"),
    (dict(mask=jnp.zeros((1, 1, 1, 5, 7), bool)), ValueError, r"mask must have rank <= 4"),
    (dict(mask=jnp.zeros((5, 7), jnp.int32)), TypeError, r"mask must be boolean"),
    (dict(sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \(B,\) = \(2,\)"),
    (dict(key_value_seq_lengths=jnp.zeros((2,), jnp.float32)), TypeError,
     r"key_value_seq_lengths must be an integer array"),
    (dict(implementation="flash"), ValueError, r"implementation must be None or one of"),
])
def test_bad_input_raises_clear_error(kwargs, exc, pattern):
    args = dict(q=Q, k=K, v=V)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=pattern):
        jax_sdpa.scaled_dot_product_attention(q, k, v, **args)
    # raised at trace time: also under jit / eval_shape
    with pytest.raises(exc, match=pattern):
        jax.eval_shape(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, **args),
                       q, k, v)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only machine behaviour")
def test_named_gpu_implementation_on_cpu_says_why():
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        jax_sdpa.scaled_dot_product_attention(Q, K, V, implementation="cudnn")
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        jax_sdpa.dot_product_attention(jnp.zeros((1, 5, 2, 8)), jnp.zeros((1, 5, 2, 8)),
                                       jnp.zeros((1, 5, 2, 8)), implementation="cuda")


def test_explain_lists_every_implementation_with_a_reason():
    e = jax_sdpa.explain(Q, K, V, mask="causal")
    assert set(e.verdicts) == set(jax_sdpa.IMPLEMENTATIONS)
    assert e.verdicts[e.chosen][0]
    for name, (ok, reason) in e.verdicts.items():
        assert reason
    text = str(e)
    assert "implementation=None ->" in text and e.chosen in text
    # works from shapes alone
    s = jax.ShapeDtypeStruct
    e2 = jax_sdpa.explain(s((1, 8, 1, 128), jnp.bfloat16), s((1, 1, 4096, 128), jnp.bfloat16),
                          s((1, 1, 4096, 128), jnp.bfloat16), platform="cuda")
    assert e2.platform == "cuda"
    assert e2.config.is_decode


def test_none_picks_chunked_for_large_scores_on_platforms_without_kernels():
    s = jax.ShapeDtypeStruct
    big = jax_sdpa.explain(s((1, 8, 16384, 64), jnp.float32), s((1, 8, 16384, 64), jnp.float32),
                           s((1, 8, 16384, 64), jnp.float32), platform="tpu")
    small = jax_sdpa.explain(s((1, 8, 128, 64), jnp.float32), s((1, 8, 128, 64), jnp.float32),
                             s((1, 8, 128, 64), jnp.float32), platform="tpu")
    assert big.chosen == "xla_chunked" and small.chosen == "xla"


def test_empty_sequences():
    out = jax_sdpa.scaled_dot_product_attention(jnp.ones((1, 2, 0, 8)), jnp.ones((1, 2, 3, 8)),
                                                jnp.ones((1, 2, 3, 4)))
    assert out.shape == (1, 2, 0, 4)
    out = jax_sdpa.scaled_dot_product_attention(jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 0, 8)),
                                                jnp.ones((1, 2, 0, 4)))
    assert out.shape == (1, 2, 3, 4) and not np.any(np.asarray(out))


# ---------------------------------------------------------------------------
# fp32_precision: JAX's default matmul precision -> the FFI attribute

def _custom_calls(text, target_prefix="jax_sdpa_"):
    return [line for line in text.splitlines()
            if "custom_call" in line and f"@{target_prefix}" in line]


def _fp32_precision_values(text):
    calls = _custom_calls(text)
    assert calls, "no jax_sdpa custom call in the lowered module"
    return [int(re.search(r"fp32_precision = (\d+) : i64", c).group(1)) for c in calls]


@pytest.mark.parametrize("value, expected", [
    (None, 0), ("default", 0), ("high", 0), ("bfloat16", 0), ("tensorfloat32", 0),
    ("TF32_TF32_F32", 0), ("highest", 1), ("float32", 1), ("F32_F32_F32", 1),
    ("TF32_TF32_F32_X3", 1)])
def test_current_fp32_precision_follows_jax(value, expected):
    from jax_sdpa.config import StaticParams, current_fp32_precision
    if value is None:
        assert current_fp32_precision() == 0 and StaticParams(scale=1.0).fp32_precision == 0
        return
    with jax.default_matmul_precision(value):
        assert current_fp32_precision() == expected
        assert StaticParams(scale=1.0).fp32_precision == expected
    assert current_fp32_precision() == 0  # the context is gone


def test_fp32_precision_from_config_update_and_environment():
    import subprocess
    import sys

    from jax_sdpa.config import current_fp32_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        assert current_fp32_precision() == 1
        with jax.default_matmul_precision("bfloat16"):  # the context wins over the global
            assert current_fp32_precision() == 0
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert current_fp32_precision() == 0
    code = "from jax_sdpa.config import current_fp32_precision as c; print(c())"
    for env_value, want in (("highest", "1"), ("float32", "1"), ("tensorfloat32", "0")):
        env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION=env_value, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, cwd="/", check=True).stdout.strip()
        assert out == want, (env_value, out)


def test_fp32_precision_reaches_the_lowering():
    """The custom call's attributes carry fp32_precision = 1 under 'highest', 0 otherwise,
    for the forward and the backward; the same jitted function is retraced."""
    from jax_sdpa import _ext
    if not _ext.has_backend("cpu"):
        pytest.skip("the native CPU kernel is not built")
    f = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cpu"))
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_sdpa.scaled_dot_product_attention(
        q, k, v, implementation="cpu")), argnums=(0, 1, 2)))
    assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [0]
    assert _fp32_precision_values(g.lower(Q, K, V).as_text()) == [0, 0]
    for name in ("highest", "float32"):
        with jax.default_matmul_precision(name):
            assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [1]
            text = g.lower(Q, K, V).as_text()
            assert _fp32_precision_values(text) == [1, 1]
            assert any("jax_sdpa_cpu_bwd" in c for c in _custom_calls(text))
    with jax.default_matmul_precision("tensorfloat32"):
        assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [0]
    # and it runs (the handlers bind the attribute) with the same result
    q = jnp.asarray(np.random.default_rng(0).standard_normal(Q.shape), jnp.float32)
    k = jnp.asarray(np.random.default_rng(1).standard_normal(K.shape), jnp.float32)
    v = jnp.asarray(np.random.default_rng(2).standard_normal(V.shape), jnp.float32)
    default = f(q, k, v)
    with jax.default_matmul_precision("highest"):
        highest = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(highest))


def test_handlers_validate_fp32_precision():
    from jax_sdpa import _ext
    if not _ext.has_backend("cpu"):
        pytest.skip("the native CPU kernel is not built")
    q = jnp.zeros((1, 2, 3, 8), jnp.float32)
    attrs = dict(scale=1.0, window_left=np.int64(-1), window_right=np.int64(-1),
                 bottom_right=False, seq_major=False, has_mask=False, has_sinks=False,
                 has_q_lengths=False, has_kv_lengths=False)
    empty = (jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.float32),
             jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))
    out, _ = call(q, q, q, *empty, **attrs, fp32_precision=np.int64(1))
    assert out.shape == q.shape
    with pytest.raises(Exception, match="fp32_precision must be 0"):
        jax.block_until_ready(call(q, q, q, *empty, **attrs, fp32_precision=np.int64(2)))
    with pytest.raises(Exception, match="attributes"):  # every attribute is required
        jax.block_until_ready(call(q, q, q, *empty, **attrs))
