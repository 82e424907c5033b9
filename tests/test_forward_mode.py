"""Forward mode and higher orders for every implementation available here,
against jax.nn.dot_product_attention(implementation='xla') differentiated by JAX itself:
jax.jvp, jax.jacfwd, jax.linearize, grad of grad, jax.hessian, jvp of grad, vmap of jvp,
with bias, sinks (as jax.nn sees them: one more key of logit `sink` and value 0), GQA and
causal masks; first-order reverse mode still runs the fused backward kernel.

Multi-device (a subprocess with 4 CPU devices, tests/forward_mode_checks.py): xla_chunked
(and cpu) inside a fully manual shard_map (the chunked scan once failed: "manual axis types
do not match"), ring attention over them, and forward mode and grad of grad under a
batch-sharded jit.
"""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from sdpa_testing import implementations_here, serves_or_skip

IMPLS = implementations_here()
FUSED = [i for i in IMPLS if i not in ("xla", "xla_chunked")]
TOL = 2e-5  # float32 against float32 (both in XLA:CPU's exact float32)


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _served(f, *args):
    """Skips when a named implementation can't serve the call (cuDNN and float32): checked
    on the plain forward, so that a transform that fails is a failure, not a skip."""
    with serves_or_skip():
        jax.block_until_ready(f(*args))


def _close(got, want, what, tol=TOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
        assert np.isfinite(g).all(), f"{what}: not finite"
        err = np.max(np.abs(g - w)) / max(1.0, np.max(np.abs(w))) if w.size else 0.0
        assert err <= tol, f"{what}: error {err:.3g} > {tol}"


def _problem(rng, b=1, t=5, s=6, n=2, k=1, h=8):
    q, kk, v = _normal(rng, b, t, n, h), _normal(rng, b, s, k, h), _normal(rng, b, s, k, h)
    bias = _normal(rng, 1, n, t, s)
    return q, kk, v, bias


def _pair(impl, is_causal=False, with_bias=True):
    """(ours, jax.nn's xla) as functions of (q, k, v, bias)."""
    def ours(q, k, v, bias):
        return jax_sdpa.dot_product_attention(q, k, v, bias=bias if with_bias else None,
                                              is_causal=is_causal, implementation=impl)

    def theirs(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias if with_bias else None,
                                            is_causal=is_causal, implementation="xla")

    return ours, theirs


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("impl", IMPLS)
def test_jvp_jacfwd_linearize(impl, is_causal, rng):
    q, k, v, bias = _problem(rng)
    ours, theirs = _pair(impl, is_causal)
    tangents = tuple(_normal(rng, *x.shape) for x in (q, k, v, bias))
    _served(ours, q, k, v, bias)
    got = jax.jit(lambda *a: jax.jvp(ours, a[:4], a[4:]))(q, k, v, bias, *tangents)
    _, lin = jax.linearize(ours, q, k, v, bias)
    lin_got = jax.jit(lin)(*tangents)
    jac = jax.jit(jax.jacfwd(ours, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.jit(lambda *a: jax.jvp(theirs, a[:4], a[4:]))(q, k, v, bias, *tangents)
    _close(got, want, f"{impl} jvp")
    _close(lin_got, want[1], f"{impl} linearize")
    _close(jac, jax.jit(jax.jacfwd(theirs, argnums=(0, 1, 2, 3)))(q, k, v, bias),
           f"{impl} jacfwd")


@pytest.mark.parametrize("impl", IMPLS)
def test_second_order(impl, rng):
    q, k, v, bias = _problem(rng, t=4, s=5)
    ours, theirs = _pair(impl, is_causal=True)

    def loss(f):
        return lambda q, k, v, bias: jnp.sum(jnp.sin(f(q, k, v, bias)) * jnp.cos(q[..., :1]))

    def grad_of_grad(f):  # reverse over reverse
        g = jax.grad(loss(f), argnums=(0, 1, 2, 3))
        return jax.grad(lambda *a: sum(jnp.sum(x ** 2) for x in g(*a)), argnums=(0, 1, 2, 3))

    def jvp_of_grad(f, tangents):  # forward over reverse
        return lambda *a: jax.jvp(jax.grad(loss(f), argnums=(0, 1, 2, 3)), a, tangents)[1]

    tangents = tuple(_normal(rng, *x.shape) for x in (q, k, v, bias))
    _served(ours, q, k, v, bias)
    got = jax.jit(grad_of_grad(ours))(q, k, v, bias)
    hess = jax.jit(jax.hessian(loss(ours), argnums=(0, 2)))(q, k, v, bias)
    fr = jax.jit(jvp_of_grad(ours, tangents))(q, k, v, bias)
    _close(got, jax.jit(grad_of_grad(theirs))(q, k, v, bias), f"{impl} grad of grad")
    _close(hess, jax.jit(jax.hessian(loss(theirs), argnums=(0, 2)))(q, k, v, bias),
           f"{impl} hessian")
    _close(fr, jax.jit(jvp_of_grad(theirs, tangents))(q, k, v, bias), f"{impl} jvp of grad")


def _sinks_as_jax_nn(q, k, v, sinks, is_causal):
    """jax.nn with one more key (k = 0, v = 0) whose bias is the sink logit: exactly our sinks."""
    b, t, n, h = q.shape
    k1 = jnp.concatenate([k, jnp.zeros((b, 1) + k.shape[2:], k.dtype)], axis=1)
    v1 = jnp.concatenate([v, jnp.zeros((b, 1) + v.shape[2:], v.dtype)], axis=1)
    s = k.shape[1]
    bias = jnp.concatenate([jnp.zeros((1, n, t, s)), jnp.broadcast_to(
        sinks[None, :, None, None], (1, n, t, 1))], axis=-1)
    mask = jnp.ones((1, 1, t, s + 1), bool)
    if is_causal:
        mask = mask.at[..., :s].set(jnp.tril(jnp.ones((t, s), bool)))
    return jax.nn.dot_product_attention(q, k1, v1, bias=bias, mask=mask, implementation="xla")


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_forward_mode_and_second_order(impl, rng):
    q, k, v, _ = _problem(rng, n=4, k=2)
    sinks = _normal(rng, 4)

    def ours(q, k, v, sinks):
        return jax_sdpa.dot_product_attention(q, k, v, sinks=sinks, is_causal=True,
                                              implementation=impl)

    def theirs(q, k, v, sinks):
        return _sinks_as_jax_nn(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), sinks,
                                True)

    tangents = tuple(_normal(rng, *x.shape) for x in (q, k, v, sinks))
    _served(ours, q, k, v, sinks)
    got = jax.jit(lambda *a: jax.jvp(ours, a[:4], a[4:]))(q, k, v, sinks, *tangents)
    hess = jax.jit(jax.hessian(lambda s: jnp.sum(ours(q, k, v, s) ** 3)))(sinks)
    _close(got, jax.jit(lambda *a: jax.jvp(theirs, a[:4], a[4:]))(q, k, v, sinks, *tangents),
           f"{impl} jvp with sinks")
    _close(hess, jax.jit(jax.hessian(lambda s: jnp.sum(theirs(q, k, v, s) ** 3)))(sinks),
           f"{impl} hessian in sinks")


@pytest.mark.parametrize("impl", IMPLS)
def test_mlx_entry_forward_mode_with_lengths_and_bool_mask(impl, rng):
    """The MLX entry: bottom-right causal, lengths, bool mask, through the jax.nn emulation
    (bottom-right causal = a bool mask; lengths = a bool mask; padded query rows 0)."""
    b, hq, hk, lq, lk, d = 2, 4, 2, 5, 7, 8
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    mask = jnp.asarray(rng.random((b, 1, lq, lk)) < 0.8).at[..., 0].set(True)
    ql, kvl = jnp.array([5, 3], jnp.int32), jnp.array([7, 6], jnp.int32)

    def ours(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, query_seq_lengths=ql, key_value_seq_lengths=kvl,
            implementation=impl)

    def theirs(q, k, v):
        i, j = jnp.arange(lq)[:, None], jnp.arange(lk)[None, :]
        keep = mask & (j < kvl[:, None, None, None]) & (i < ql[:, None, None, None])
        out = jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (
            q, jnp.repeat(k, 2, 1), jnp.repeat(v, 2, 1))), mask=keep,
            implementation="xla")
        out = jnp.swapaxes(out, 1, 2)
        return jnp.where((jnp.arange(lq) < ql[:, None])[:, None, :, None], out, 0)

    tangents = tuple(_normal(rng, *x.shape) for x in (q, k, v))
    _served(ours, q, k, v)
    got = jax.jit(lambda *a: jax.jvp(ours, a[:3], a[3:]))(q, k, v, *tangents)
    gg = jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(
        lambda q: jnp.sum(jnp.sin(ours(q, k, v))))(q) ** 2)))(q)
    _close(got, jax.jit(lambda *a: jax.jvp(theirs, a[:3], a[3:]))(q, k, v, *tangents),
           f"{impl} jvp")
    _close(gg, jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(
        lambda q: jnp.sum(jnp.sin(theirs(q, k, v))))(q) ** 2)))(q), f"{impl} grad of grad")


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_of_jvp_and_jvp_of_vmap(impl, rng):
    q, k, v, bias = _problem(rng)
    ours, theirs = _pair(impl)
    qs = jnp.stack([q, 2 * q, -q])
    tqs = _normal(rng, *qs.shape)
    tbias = _normal(rng, 3, *bias.shape)

    def jvp_q_bias(f):
        return lambda q, tq, tb: jax.jvp(lambda q, b: f(q, k, v, b), (q, bias), (tq, tb))

    _served(ours, q, k, v, bias)
    got = jax.jit(jax.vmap(jvp_q_bias(ours)))(qs, tqs, tbias)
    got2 = jax.jit(lambda qs, tqs: jax.jvp(jax.vmap(lambda q: ours(q, k, v, bias)),
                                           (qs,), (tqs,)))(qs, tqs)
    _close(got, jax.jit(jax.vmap(jvp_q_bias(theirs)))(qs, tqs, tbias), f"{impl} vmap of jvp")
    _close(got2, jax.jit(lambda qs, tqs: jax.jvp(jax.vmap(lambda q: theirs(q, k, v, bias)),
                                                 (qs,), (tqs,)))(qs, tqs),
           f"{impl} jvp of vmap")


@pytest.mark.parametrize("impl", FUSED)
def test_first_order_reverse_mode_runs_the_fused_backward(impl, rng):
    """jax.grad lowers to the fused forward and backward kernels only: the tangent's
    reference lowering (dots in XLA) is transposed away, never emitted."""
    q, k, v, bias = _problem(rng)
    ours, _ = _pair(impl)
    _served(ours, q, k, v, bias)
    text = jax.jit(jax.grad(lambda q, k, v, b: jnp.sum(ours(q, k, v, b) ** 2),
                            argnums=(0, 1, 2, 3))).lower(q, k, v, bias).as_text()
    # (implementation "cuda" lowers to its flash kernels' targets, jax_sdpa_cuda_flash_*)
    for direction in ("fwd", "bwd"):
        assert re.search(rf"jax_sdpa_{impl}(_flash)?_{direction}\b", text), direction
    # the bias gradient is dS in XLA (one QK^T and one dO V^T product); nothing else
    assert text.count("stablehlo.dot_general") <= 2, text.count("stablehlo.dot_general")
    text = jax.jit(jax.grad(lambda q: jnp.sum(ours(q, k, v, None) ** 2))).lower(q).as_text()
    assert "stablehlo.dot_general" not in text


def test_residual_lse_is_not_differentiated(rng):
    """Like jax.nn's: the residual carries no gradient, also in forward mode."""
    q, k, v, _ = _problem(rng)
    f = lambda q: jax_sdpa.dot_product_attention(q, k, v, return_residual=True)[1]  # noqa
    np.testing.assert_array_equal(jax.jvp(f, (q,), (jnp.ones_like(q),))[1], 0)
    np.testing.assert_array_equal(jax.grad(lambda q: jnp.sum(f(q)))(q), 0)


# ---------------------------------------------------------------------------
# multi-device

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "forward_mode_checks.py"
CHECKS = re.findall(r"^def (m_\w+)\(\):", SCRIPT.read_text(), flags=re.M)


def test_shard_map_and_ring_with_xla_chunked():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    package_root = str(pathlib.Path(jax_sdpa.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    impls = ",".join(["xla_chunked"] + [i for i in ("cpu",) if i in IMPLS])
    proc = subprocess.run([sys.executable, str(SCRIPT), impls], env=env, capture_output=True,
                          text=True, timeout=900)
    results = dict(re.findall(r"CHECK (\S+) (ok|FAIL.*)", proc.stdout))
    failed = {c: r for c, r in results.items() if r != "ok"}
    expected = {f"{c}[{i}]" for c in CHECKS for i in impls.split(",")}
    missing = expected - set(results)
    assert not failed and not missing, (f"failed: {failed}\nmissing: {sorted(missing)}\n"
                                        f"{proc.stderr[-4000:]}")
