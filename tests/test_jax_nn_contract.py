"""`jax_sdpa.dot_product_attention` against `jax.nn.dot_product_attention(implementation='xla')`
(the jax.nn drop-in): same arguments, same results, fully masked rows and residuals included."""

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from sdpa_testing import assert_close, fp32_rtol, implementations_here, serves_or_skip

IMPLS = implementations_here()


@dataclasses.dataclass(frozen=True)
class NnCase:
    b: int = 2
    t: int = 9
    s: int = 11
    n: int = 4
    k: int = 2
    h: int = 32
    dtype: str = "float32"
    bias: Optional[tuple] = None  # bias shape pattern
    mask: Optional[tuple] = None  # bool mask shape pattern
    is_causal: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    window: object = None
    unbatched: bool = False
    empty_row: bool = False  # force a fully masked query row through the mask

    def id(self):
        fields = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != f.default]
        return ",".join(fields) or "plain"


CASES = [
    NnCase(),
    NnCase(is_causal=True),
    NnCase(is_causal=True, t=12, s=7),
    NnCase(bias=("b", "n", "t", "s")),
    NnCase(bias=(1, "n", 1, "s")),
    NnCase(mask=("b", 1, "t", "s")),
    NnCase(mask=("b", "n", "t", "s"), empty_row=True),
    NnCase(mask=(1, 1, "t", "s"), bias=(1, "n", "t", "s")),
    NnCase(q_lengths=True),
    NnCase(kv_lengths=True),
    NnCase(q_lengths=True, kv_lengths=True, is_causal=True),
    NnCase(window=3),
    NnCase(window=(4, 1)),
    NnCase(window=(2, 0), is_causal=True, t=15, s=15),
    NnCase(unbatched=True, n=2, k=1),
    NnCase(n=8, k=1, t=1, s=40),
    NnCase(dtype="bfloat16", t=33, s=40, h=64, is_causal=True),
    NnCase(dtype="bfloat16", t=33, s=40, h=64, bias=(1, 1, "t", "s")),  # jax.nn fp16 fails on CPU
]


def _inputs(case, rng):
    b = 1 if case.unbatched else case.b
    full = {"b": b, "n": case.n, "t": case.t, "s": case.s}
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[case.dtype]
    q = rng.standard_normal((b, case.t, case.n, case.h))
    k = rng.standard_normal((b, case.s, case.k, case.h))
    v = rng.standard_normal((b, case.s, case.k, case.h))
    if case.unbatched:
        q, k, v = q[0], k[0], v[0]
    q, k, v = (jnp.asarray(x, dt) for x in (q, k, v))
    kw = dict(is_causal=case.is_causal, local_window_size=case.window)
    if case.bias:
        kw["bias"] = jnp.asarray(rng.standard_normal(tuple(full.get(p, p) for p in case.bias)),
                                 jnp.float32)
    if case.mask:
        m = rng.random(tuple(full.get(p, p) for p in case.mask)) < 0.8
        if case.empty_row:
            m[0, 0, 1, :] = False
        kw["mask"] = jnp.asarray(m)
    if case.q_lengths:
        ql = rng.integers(1, case.t + 1, size=b).astype(np.int32)
        kw["query_seq_lengths"] = jnp.asarray(ql)
    if case.kv_lengths:
        kvl = rng.integers(0, case.s + 1, size=b).astype(np.int32)
        kvl[0] = 0  # a batch row with no keys at all
        kw["key_value_seq_lengths"] = jnp.asarray(kvl)
    return (q, k, v), kw


def _f32(xs):
    return tuple(x.astype(jnp.float32) for x in xs)


@pytest.mark.parametrize("case", CASES, ids=NnCase.id)
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_jax_nn_xla(impl, case, rng):
    (q, k, v), kw = _inputs(case, rng)
    with serves_or_skip():
        ours = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, implementation=impl, return_residual=True, **kw))(q, k, v)
    theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, implementation="xla", return_residual=True, **kw))(q, k, v)
    assert ours[0].shape == theirs[0].shape and ours[0].dtype == theirs[0].dtype
    assert ours[1].shape == theirs[1].shape and ours[1].dtype == theirs[1].dtype
    if case.dtype == "float32":
        tol = fp32_rtol(impl, 2e-5)
        assert_close(ours[0], theirs[0], "float32", rtol_fp32=tol)
        # residual: log-sum-exp (large negative where jax.nn masks a whole row)
        np.testing.assert_allclose(np.asarray(ours[1]), np.asarray(theirs[1]), rtol=tol,
                                   atol=tol)
    else:  # both against jax.nn in float32 on the same (rounded) inputs
        want = jax.nn.dot_product_attention(*_f32((q, k, v)), implementation="xla", **kw)
        assert_close(ours[0], want, case.dtype, xla_same_dtype=theirs[0])


GRAD_CASES = [NnCase(), NnCase(is_causal=True, q_lengths=True, kv_lengths=True),
              NnCase(bias=(1, "n", "t", "s")), NnCase(mask=("b", "n", "t", "s"),
                                                         empty_row=True),
              NnCase(window=(3, 2)), NnCase(unbatched=True, n=4, k=1),
              NnCase(kv_lengths=True), NnCase(q_lengths=True, kv_lengths=True, k=2)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=NnCase.id)
@pytest.mark.parametrize("impl", IMPLS)
def test_grads_match_jax_nn_xla(impl, case, rng):
    (q, k, v), kw = _inputs(case, rng)
    bias = kw.pop("bias", None)
    ct = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn, **extra):
        def f(q, k, v, bias):
            return jnp.sum(fn(q, k, v, bias=bias, **kw, **extra) * ct)
        return f

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    with serves_or_skip():
        ours = jax.jit(jax.grad(loss(jax_sdpa.dot_product_attention, implementation=impl),
                                argnums=argnums))(q, k, v, bias)
    theirs = jax.jit(jax.grad(loss(jax.nn.dot_product_attention, implementation="xla"),
                              argnums=argnums))(q, k, v, bias)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), ours, theirs):
        assert a.shape == b.shape, name
        assert_close(a, b, "float32", rtol_fp32=fp32_rtol(impl, 5e-5, grad=True), what=name)


def test_error_messages_like_jax_nn():
    q = jnp.zeros((2, 5, 4, 8))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        jax_sdpa.dot_product_attention(q, jnp.zeros((2, 5, 3, 8)), jnp.zeros((2, 5, 3, 8)))
    with pytest.raises(ValueError, match="mask dtype should be bool"):
        jax_sdpa.dot_product_attention(q, q, q, mask=jnp.zeros((1, 1, 5, 5)))
    with pytest.raises(ValueError, match="query_seq_lengths"):
        jax_sdpa.dot_product_attention(q, q, q, query_seq_lengths=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="query dtype"):
        jax_sdpa.dot_product_attention(q.astype(jnp.float16), q, q)
    with pytest.raises(ValueError, match="not broadcastable"):
        jax_sdpa.dot_product_attention(q, q, q, bias=jnp.zeros((2, 3, 5, 5)))
