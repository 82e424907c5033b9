"""jax_sdpa: fused scaled-dot-product attention for JAX.

    jax_sdpa.scaled_dot_product_attention(q, k, v, ...)   # MLX's contract, [B, H, L, D]
    jax_sdpa.dot_product_attention(query, key, value, ...)  # jax.nn's contract, [B, T, N, H]
    jax_sdpa.explain(q, k, v, ...)                          # who serves a call, and why
    jax_sdpa.paged_attention(q, k_pages, v_pages, ...)      # a paged KV cache (inference)
    jax_sdpa.paged_kv_write(k_pages, v_pages, ...)          # writes new keys into pages
    jax_sdpa.disabled_export_checks()                       # for jax.export of calls to it
"""

from jax_sdpa.api import (Explanation, dot_product_attention, explain,
                          scaled_dot_product_attention)
from jax_sdpa.dispatch import IMPLEMENTATIONS
from jax_sdpa.export import disabled_export_checks
from jax_sdpa.paged import paged_attention, paged_kv_write
from jax_sdpa.ring import ring_attention  # noqa: E402  context parallelism (shard_map)

__version__ = "0.1.0"

__all__ = [
    "scaled_dot_product_attention",
    "dot_product_attention",
    "explain",
    "Explanation",
    "IMPLEMENTATIONS",
    "disabled_export_checks",
    "paged_attention",
    "paged_kv_write",
    "__version__",
]
