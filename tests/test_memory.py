"""xla_chunked keeps O(L) memory: compiled temporaries far below the L x L scores."""

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa

B, H, L, D = 1, 8, 16384, 64
SCORES_BYTES = 4 * B * H * L * L  # 8 GiB of float32 scores


def _temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("with_grad", [False, True])
def test_xla_chunked_temporaries_stay_small(with_grad):
    x = jax.ShapeDtypeStruct((B, H, L, D), jnp.float32)

    def fwd(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                     implementation="xla_chunked")

    fn = fwd
    if with_grad:
        fn = jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v)), argnums=(0, 1, 2))
    temp = _temp_bytes(fn, x, x, x)
    print(f"xla_chunked {'fwd+bwd' if with_grad else 'fwd'} temporaries: {temp / 2**20:.1f} MiB"
          f" (scores would be {SCORES_BYTES / 2**30:.0f} GiB)")
    assert temp < SCORES_BYTES / 16


def test_none_never_materializes_huge_scores():
    x = jax.ShapeDtypeStruct((B, H, L, D), jnp.float32)
    fn = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal")
    assert _temp_bytes(fn, x, x, x) < SCORES_BYTES / 16
