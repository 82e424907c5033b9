"""jax.export of calls that run our FFI kernels: export, serialize, deserialize, call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import _ext

pytest.importorskip("flatbuffers")  # jax.export's serialization needs it (the test extra)


def _round_trip(fn, *args):
    exported = jax.export.export(jax.jit(fn), disabled_checks=jax_sdpa.disabled_export_checks())(
        *args)
    restored = jax.export.deserialize(exported.serialize())
    return exported, restored


def _inputs(rng, b=2, hq=4, hk=2, lq=24, lk=40, d=32):
    q = jnp.asarray(rng.standard_normal((b, hq, lq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, hk, lk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, hk, lk, d)), jnp.float32)
    return q, k, v


def _attention(q, k, v):
    return jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal")


def _fused_target(direction):
    """The FFI target implementation=None runs here, or None (the pure-JAX path)."""
    ex = jax_sdpa.explain(*(jax.ShapeDtypeStruct((2, 4, 24, 32), jnp.float32),) * 3,
                          mask="causal", direction=direction)
    if ex.chosen in ("xla", "xla_chunked"):
        return None
    return f"jax_sdpa_{ex.chosen}_{direction}"


def test_disabled_checks_name_every_registered_target():
    checks = jax_sdpa.disabled_export_checks()
    assert len(checks) == len(_ext.ffi_targets())
    assert all(isinstance(c, jax.export.DisabledSafetyCheck) for c in checks)
    for target in _ext.ffi_targets():
        assert jax.export.DisabledSafetyCheck.custom_call(target) in checks


def test_forward_round_trip(rng):
    q, k, v = _inputs(rng)
    exported, restored = _round_trip(_attention, q, k, v)
    target = _fused_target("fwd")
    if target is not None:  # the artifact holds our kernel, not a fallback
        assert f"@{target}" in exported.mlir_module()
    want = jax.jit(_attention)(q, k, v)
    got = restored.call(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    # fresh inputs through the same artifact
    q2, k2, v2 = _inputs(rng)
    np.testing.assert_allclose(np.asarray(restored.call(q2, k2, v2)),
                               np.asarray(jax.jit(_attention)(q2, k2, v2)), rtol=1e-6,
                               atol=1e-6)


def test_backward_round_trip(rng):
    q, k, v = _inputs(rng)
    do = jnp.asarray(rng.standard_normal((2, 4, 24, 32)), jnp.float32)

    def out_and_grads(q, k, v, do):
        out, vjp = jax.vjp(_attention, q, k, v)
        return out, vjp(do)

    exported, restored = _round_trip(out_and_grads, q, k, v, do)
    target = _fused_target("bwd")
    if target is not None:
        assert f"@{target}" in exported.mlir_module()
    want_out, want_grads = jax.jit(out_and_grads)(q, k, v, do)
    got_out, got_grads = restored.call(q, k, v, do)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=1e-6, atol=1e-6)
    for got, want in zip(got_grads, want_grads):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # and the derivative is the reference's, not just self-consistent
    ref = jax.grad(lambda q, k, v: jnp.vdot(jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="xla"), do), argnums=(0, 1, 2))(q, k, v)
    for got, want in zip(got_grads, ref):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_export_without_the_disabled_checks_names_our_target(rng):
    target = _fused_target("fwd")
    if target is None:
        pytest.skip("no fused implementation serves this call here (pure-JAX path)")
    q, k, v = _inputs(rng)
    with pytest.raises(ValueError, match=target):
        jax.export.export(jax.jit(_attention))(q, k, v)


def test_named_xla_exports_without_disabled_checks(rng):
    q, k, v = _inputs(rng)
    f = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(  # noqa: E731
        q, k, v, mask="causal", implementation="xla")
    restored = jax.export.deserialize(jax.export.export(jax.jit(f))(q, k, v).serialize())
    np.testing.assert_allclose(np.asarray(restored.call(q, k, v)),
                               np.asarray(jax.jit(f)(q, k, v)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("entry", ["mlx", "jax.nn"])
def test_symbolic_batch_is_refused_by_name(entry):
    (b,) = jax.export.symbolic_shape("b")
    if entry == "mlx":
        spec = jax.ShapeDtypeStruct((b, 4, 24, 32), jnp.float32)
        fn = _attention
    else:  # [B, T, N, H]
        spec = jax.ShapeDtypeStruct((b, 24, 4, 32), jnp.float32)
        fn = lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=True)  # noqa
    with pytest.raises(NotImplementedError, match=r"q\.shape\[0\] \(batch\) is the symbolic "
                                                  r"dimension 'b'"):
        jax.export.export(jax.jit(fn), disabled_checks=jax_sdpa.disabled_export_checks())(
            spec, spec, spec)
