"""Continuous batching of the example GPT on a paged KV cache (jax_sdpa.paged_attention,
jax_sdpa.paged_kv_write): requests of different prompt lengths arrive and finish, pages come
from a free list, every iteration is one jitted step. The server lives in the package:
jax_sdpa/examples/serve.py.

    python examples/serve.py --small        # or: jax-sdpa serve-demo --small
"""

from jax_sdpa.examples.serve import main

if __name__ == "__main__":
    main()
