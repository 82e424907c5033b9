"""Multi-device checks for tests/test_forward_mode.py, run in a subprocess (the device count
must be set before JAX initializes):

    python tests/forward_mode_checks.py xla_chunked,cpu

Prints `CHECK <name>[<impl>] ok|FAIL <detail>` per check and implementation.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import oracle  # noqa: E402

IMPL = "xla_chunked"
_rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def normal(*shape):
    return jnp.asarray(_rng.standard_normal(shape), jnp.float32)


# Two float32 runs of one call: the tolerance policy's named case for them.
TOL = oracle.tolerance("float32", case="fp32_agreement")


def close(got, want, what, tol=TOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        err = oracle.max_rel_error(g, w)
        if not np.isfinite(np.asarray(g, np.float64)).all() or err > tol:
            raise AssertionError(f"{what}: max error {err:.3g} > {tol}")


def mesh(n, name):
    return Mesh(np.array(jax.devices()[:n]), (name,))


def sdpa(impl, **kw):
    return lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, implementation=impl,
                                                                 **kw)


def m_shard_map_batch_heads():
    """Fully manual shard_map over the batch: forward, grad and jvp per shard equal the
    unsharded xla call."""
    q, k, v = normal(4, 4, 9, 16), normal(4, 2, 11, 16), normal(4, 2, 11, 16)
    lengths = jnp.array([11, 5, 8, 1], jnp.int32)
    for kw in (dict(mask="causal"), dict(key_value_seq_lengths=lengths)):
        spec = P("x")
        local = lambda q, k, v, lengths: sdpa(IMPL, **dict(kw, **(  # noqa: E731
            {"key_value_seq_lengths": lengths} if "key_value_seq_lengths" in kw else {})))(
            q, k, v)
        sm = jax.shard_map(local, mesh=mesh(4, "x"), in_specs=(spec, spec, spec, spec),
                           out_specs=spec)
        f = lambda q, k, v: sm(q, k, v, lengths)  # noqa: E731
        ref = sdpa("xla", **kw)
        close(jax.jit(f)(q, k, v), ref(q, k, v), "forward")
        loss = lambda g: (lambda q, k, v: jnp.sum(jnp.sin(g(q, k, v))))  # noqa: E731
        close(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v),
              jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v), "grad")
        t = (normal(*q.shape), normal(*k.shape), normal(*v.shape))
        close(jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(q, k, v, *t),
              jax.jvp(ref, (q, k, v), t), "jvp")


def m_shard_map_heads_only_q_varies():
    """Heads split, k/v replicated over the axis (the scan carries must vary like q)."""
    q, k, v = normal(1, 4, 7, 8), normal(1, 1, 7, 8), normal(1, 1, 7, 8)
    sm = jax.shard_map(sdpa(IMPL, mask="causal"), mesh=mesh(2, "h"),
                       in_specs=(P(None, "h"), P(), P()), out_specs=P(None, "h"))
    close(jax.jit(sm)(q, k, v), sdpa("xla", mask="causal")(q, k, v), "forward")
    g = jax.jit(jax.grad(lambda q: jnp.sum(sm(q, k, v) ** 2)))(q)
    close(g, jax.grad(lambda q: jnp.sum(sdpa("xla", mask="causal")(q, k, v) ** 2))(q), "grad")


def m_sharded_jit_forward_mode():
    """Under jit over batch-sharded NamedShardings (custom partitioning of the primitives):
    jvp and grad of grad still match the unsharded xla call."""
    from jax.sharding import NamedSharding
    q, k, v = normal(4, 4, 9, 16), normal(4, 2, 9, 16), normal(4, 2, 9, 16)
    spec = NamedSharding(mesh(4, "b"), P("b"))
    placed = [jax.device_put(x, spec) for x in (q, k, v)]
    f, ref = sdpa(IMPL, mask="causal"), sdpa("xla", mask="causal")
    t = (normal(*q.shape), normal(*k.shape), normal(*v.shape))
    close(jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(*placed, *t), jax.jvp(ref, (q, k, v), t),
          "jvp")
    gg = lambda g: jax.grad(lambda q: jnp.sum(jax.grad(  # noqa: E731
        lambda q: jnp.sum(jnp.sin(g(q, k, v))))(q) ** 2))
    close(jax.jit(gg(f))(placed[0]), gg(ref)(q), "grad of grad")


def _ring(layout, n=4):
    q, k, v = normal(2, 2, 32, 8), normal(2, 2, 32, 8), normal(2, 2, 32, 8)
    perm, unperm = (lambda x: x), (lambda x: x)
    if layout == "zigzag":
        perm = lambda x: jax_sdpa.ring.to_zigzag(x, n)  # noqa: E731
        unperm = lambda x: jax_sdpa.ring.from_zigzag(x, n)  # noqa: E731
    spec = P(None, None, "sp")
    sm = jax.shard_map(lambda q, k, v: jax_sdpa.ring_attention(
        q, k, v, axis_name="sp", mask="causal", layout=layout, implementation=IMPL),
        mesh=mesh(n, "sp"), in_specs=(spec, spec, spec), out_specs=spec)
    f = lambda q, k, v: unperm(sm(perm(q), perm(k), perm(v)))  # noqa: E731
    ref = sdpa("xla", mask="causal")
    close(jax.jit(f)(q, k, v), ref(q, k, v), "ring forward")
    loss = lambda g: (lambda q, k, v: jnp.sum(jnp.sin(g(q, k, v))))  # noqa: E731
    close(jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(q, k, v),
          jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v), "ring grad")


def m_ring_contiguous():
    _ring(None)


def m_ring_zigzag():
    _ring("zigzag")


CHECKS = [m_shard_map_batch_heads, m_shard_map_heads_only_q_varies, m_sharded_jit_forward_mode,
          m_ring_contiguous, m_ring_zigzag]


def main():
    global IMPL
    assert len(jax.devices()) >= 4, jax.devices()
    for impl in sys.argv[1].split(","):
        IMPL = impl
        for check in CHECKS:
            name = f"{check.__name__}[{impl}]"
            try:
                check()
                print(f"CHECK {name} ok", flush=True)
            except Exception as e:  # noqa: BLE001 - report every check
                detail = f"{type(e).__name__}: {e}".replace("\n", " | ")[:1500]
                print(f"CHECK {name} FAIL {detail}", flush=True)
                traceback.print_exc(file=sys.stderr)


if __name__ == "__main__":
    main()
