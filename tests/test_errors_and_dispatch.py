"""Input checks (clear ValueError/TypeError at trace time, naming the argument and shapes),
`implementation=` handling and `explain`."""

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
