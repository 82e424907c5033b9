"""Example models built on jax_sdpa (`jax_sdpa.examples.gpt`; needs flax)."""
