"""Train a tiny byte-level GPT (Flax nnx, attention on jax_sdpa) and generate with a
fixed-size KV cache. The model lives in the package: jax_sdpa/examples/gpt.py.

    python examples/gpt.py --steps 50 --tokens 64
"""

from jax_sdpa.examples.gpt import main

if __name__ == "__main__":
    main()
