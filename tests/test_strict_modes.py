"""Strict JAX modes: `jax.numpy_rank_promotion("raise")` (jax's own test base
sets it), `jax_numpy_dtype_promotion="strict"`, `jax.debug_nans(True)` and
`jax.debug_infs(True)` run every entry point clean, eager and under jit, forward, reverse
and forward mode, for every implementation here, with the same results as without them.
Masks, biases, lengths and sinks are all exercised: the -inf of masked scores and of an
empty row's lse must stay inside the computation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
import jax_sdpa.flax
from sdpa_testing import implementations_here, serves_or_skip

IMPLS = implementations_here()

MODES = {
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "dtype_promotion_strict": lambda: jax.numpy_dtype_promotion("strict"),
    "debug_nans": lambda: jax.debug_nans(True),
    "debug_infs": lambda: jax.debug_infs(True),
}


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k, v = n(2, 4, 5, 8), n(2, 2, 7, 8), n(2, 2, 7, 8)
    mask = np.asarray(rng.random((2, 4, 5, 7)) < 0.6)
    mask[0, 1, 3] = False  # an empty row
    q_ids = np.array([[0, 0, 1, 1, 9], [2, 2, 2, 3, 3]], np.int32)  # 9: an empty row
    kv_ids = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 3, 3, 3, 3, 3]], np.int32)
    pages = n(6, 2, 4, 8)
    return dict(q=q, k=k, v=v, mask=jnp.asarray(mask), bias=n(1, 4, 5, 7),
                sinks=n(4), ql=jnp.array([5, 3], jnp.int32), kvl=jnp.array([4, 7], jnp.int32),
                q_ids=jnp.asarray(q_ids), kv_ids=jnp.asarray(kv_ids), k_pages=pages,
                v_pages=-pages, page_indices=jnp.array([[3, 0, -1], [5, 1, 2]], jnp.int32))


def _calls(impl):
    """name -> f(inputs): every entry point, masks of every kind, AD in both modes."""
    def mlx(x, **kw):
        return jax_sdpa.scaled_dot_product_attention(x["q"], x["k"], x["v"],
                                                     implementation=impl, **kw)

    def nn(x, **kw):
        sw = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        return jax_sdpa.dot_product_attention(sw(x["q"]), sw(x["k"]), sw(x["v"]),
                                              implementation=impl, **kw)

    def grad(f):
        return lambda x: jax.grad(lambda q: jnp.sum(jnp.sin(f(dict(x, q=q)))))(x["q"])

    def jvp(f):
        return lambda x: jax.jvp(lambda q: f(dict(x, q=q)), (x["q"],), (x["q"] * 0.5,))[1]

    lengths = lambda x: mlx(x, mask="causal", sinks=x["sinks"],  # noqa: E731
                            query_seq_lengths=x["ql"], key_value_seq_lengths=x["kvl"])
    bias_mask = lambda x: nn(x, bias=x["bias"], mask=x["mask"])  # noqa: E731

    def packed(x):
        return mlx(x, mask="causal", sinks=x["sinks"], q_segment_ids=x["q_ids"],
                   kv_segment_ids=x["kv_ids"], logits_soft_cap=2.0, local_window_size=(3, 1),
                   key_value_seq_lengths=x["kvl"])

    return {
        "mlx_plain": lambda x: mlx(x),
        "mlx_bool_mask": lambda x: mlx(x, mask=x["mask"]),
        "mlx_additive": lambda x: mlx(x, mask=x["bias"]),
        "mlx_causal_lengths_sinks": lengths,
        "nn_bias_and_mask": bias_mask,
        "nn_causal_lengths_residual": lambda x: nn(
            x, is_causal=True, query_seq_lengths=x["ql"], key_value_seq_lengths=x["kvl"],
            return_residual=True),
        "nn_window": lambda x: nn(x, local_window_size=(2, 1)),
        "grad_bool_mask": grad(lambda x: mlx(x, mask=x["mask"])),
        "grad_lengths_sinks": grad(lengths),
        "grad_bias_and_mask": lambda x: jax.grad(lambda b: jnp.sum(jnp.sin(bias_mask(
            dict(x, bias=b)))))(x["bias"]),
        "jvp_lengths_sinks": jvp(lengths),
        "mlx_segments_soft_cap_window": packed,
        "grad_segments_soft_cap_window": grad(packed),
        "nn_segments_soft_cap_bias": lambda x: nn(x, bias=x["bias"], q_segment_ids=x["q_ids"],
                                                  kv_segment_ids=x["kv_ids"],
                                                  logits_soft_cap=1.5),
        "paged": lambda x: jax_sdpa.paged_attention(
            x["q"], x["k_pages"], x["v_pages"], x["page_indices"], x["kvl"] + 3,
            mask="causal", sinks=x["sinks"], logits_soft_cap=3.0, implementation=impl),
        "vmap": lambda x: jax.vmap(lambda q: mlx(dict(x, q=q), mask=x["mask"]))(
            jnp.stack([x["q"], -x["q"]])),
        "flax": lambda x: jax_sdpa.flax.make_attention_fn(implementation=impl)(
            *(jnp.swapaxes(x[n], 1, 2) for n in ("q", "k", "v")), bias=x["bias"],
            mask=x["mask"]),
    }


CALLS = list(_calls("xla"))
# Under jit the debug modes check only the outputs; eager they check every operation that
# runs outside a compiled computation (and, in jax.grad, the residuals between them).
JIT_CALLS = ["nn_causal_lengths_residual", "grad_lengths_sinks", "jvp_lengths_sinks"]


def _check(impl, mode, call, jit):
    x = _inputs()
    f = _calls(impl)[call]
    f = jax.jit(f) if jit else f
    with serves_or_skip():
        want = jax.block_until_ready(f(x))
    with MODES[mode]():
        got = jax.block_until_ready(f(x))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("impl", IMPLS)
def test_runs_clean_under_strict_modes(impl, mode, call):
    _check(impl, mode, call, jit=False)


@pytest.mark.parametrize("call", JIT_CALLS)
@pytest.mark.parametrize("mode", ["debug_nans", "debug_infs"])
@pytest.mark.parametrize("impl", IMPLS)
def test_runs_clean_under_debug_modes_in_jit(impl, mode, call):
    _check(impl, mode, call, jit=True)
