"""Every implementation available here against the float64 oracles (MLX contract, §1.1).

New backends join by being built: `implementations_here()` lists them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from sdpa_testing import (FP32_GRAD_RTOL, SLOW_IMPLEMENTATIONS, Case, assert_close,
                          cast_inputs, fp32_rtol, implementations_here, oracle_forward,
                          oracle_grads, oracle_inputs_f64, random_inputs, serves_or_skip)

IMPLS = implementations_here()

FORWARD_CASES = [
    Case(),
    Case(b=1, hq=8, hk=8, lq=1, lk=129, d=64),  # decode, MHA
    Case(b=2, hq=8, hk=1, lq=5, lk=127, d=64, mask="causal"),  # MQA, bottom-right
    Case(b=1, hq=4, hk=2, lq=9, lk=4, d=32, mask="causal"),  # Lq > Lk: empty rows -> 0
    Case(b=1, hq=2, hk=2, lq=127, lk=129, d=64, mask="causal"),
    Case(b=1, hq=2, hk=1, lq=129, lk=127, d=64),
    Case(b=1, hq=2, hk=1, lq=1, lk=1, d=16),
    Case(mask="bool"),
    Case(mask="bool", mask_shape=(1, 1, "lq", "lk")),
    Case(mask="bool", mask_shape=("b", 1, 1, "lk")),
    Case(mask="bool", mask_shape=(1, "h", "lq", 1)),
    Case(mask="additive"),
    Case(mask="additive", mask_shape=(1, "h", 1, "lk")),
    Case(mask="additive_inf", mask_shape=("b", 1, "lq", "lk")),
    Case(sinks=True),
    Case(sinks=True, mask="causal", lq=12, lk=12),
    Case(q_lengths=True),
    Case(kv_lengths=True, lq=3, lk=33),
    Case(q_lengths=True, kv_lengths=True, mask="causal", lq=11, lk=17),
    Case(q_lengths=True, kv_lengths=True, sinks=True, mask="bool"),
    Case(d=48, dv=24),
    Case(b=1, hq=2, hk=1, lq=33, lk=40, d=192, dv=128, mask="causal"),
    Case(b=1, hq=2, hk=2, lq=5, lk=70, d=96, dv=64),
]
FORWARD_CASES += [Case(b=1, hq=2, hk=1, lq=17, lk=33, d=d, mask="causal")
                  for d in (64, 72, 80, 96, 128, 192, 256, 512)]
FORWARD_CASES += [Case(dtype=dt, mask=m, lq=37, lk=45, d=64, sinks=s)
                  for dt in ("float16", "bfloat16")
                  for m, s in (("none", False), ("causal", True), ("additive", False))]
FORWARD_CASES += [Case(dtype="bfloat16", b=1, hq=4, hk=1, lq=1, lk=300, d=128,
                       kv_lengths=True),
                  Case(b=1, hq=4, hk=1, lq=1, lk=1100, d=64, kv_lengths=True),  # split-K decode
                  Case(dtype="float16", b=2, hq=8, hk=2, lq=2, lk=700, d=128, mask="causal")]

GRAD_CASES = [
    Case(),
    Case(b=1, hq=4, hk=1, lq=13, lk=21, d=32, mask="causal"),
    Case(mask="additive", mask_shape=(1, "h", "lq", "lk")),
    Case(mask="bool", sinks=True),
    Case(q_lengths=True, kv_lengths=True, mask="causal", lq=11, lk=17),
    Case(d=40, dv=24, lq=9, lk=30),
    Case(b=1, hq=2, hk=2, lq=9, lk=4, d=32, mask="causal"),  # empty rows
    Case(dtype="bfloat16", lq=33, lk=40, d=64, mask="causal"),
    Case(dtype="float16", lq=33, lk=40, d=64, sinks=True),
]


def _too_slow(impl, case):
    return impl in SLOW_IMPLEMENTATIONS and case.b * case.hq * case.lq * case.lk * case.d > 2e7


def _run(impl, inputs, case):
    args = cast_inputs(inputs, case.dtype)
    causal = isinstance(args["mask"], str)

    @jax.jit
    def fn(q, k, v, mask, sinks, ql, kvl):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, scale=case.scale, mask="causal" if causal else mask, sinks=sinks,
            query_seq_lengths=ql, key_value_seq_lengths=kvl, implementation=impl)

    return fn(args["q"], args["k"], args["v"], None if causal else args["mask"],
              args["sinks"], args["query_seq_lengths"], args["key_value_seq_lengths"])


@pytest.mark.parametrize("case", FORWARD_CASES, ids=Case.id)
@pytest.mark.parametrize("impl", IMPLS)
def test_forward_matches_float64_oracle(impl, case, rng):
    if _too_slow(impl, case):
        pytest.skip("shape too large for the Metal emulator")
    inputs = random_inputs(case, rng)
    with serves_or_skip():
        out = _run(impl, inputs, case)
    want, _ = oracle_forward(**oracle_inputs_f64(inputs, case.dtype), scale=case.scale)
    assert out.shape == want.shape and out.dtype == jnp.dtype(
        {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}[case.dtype])
    xla = None if impl == "xla" or case.dtype == "float32" else _run("xla", inputs, case)
    assert_close(out, want, case.dtype, xla_same_dtype=xla, rtol_fp32=fp32_rtol(impl))
    # rows with nothing to attend are exactly zero, never NaN
    empty = ~np.any(np.abs(want) > 0, axis=-1)
    assert np.all(np.asarray(out.astype(jnp.float32))[empty] == 0)


@pytest.mark.parametrize("case", GRAD_CASES, ids=Case.id)
@pytest.mark.parametrize("impl", IMPLS)
def test_grads_match_float64_oracle(impl, case, rng):
    if _too_slow(impl, case):
        pytest.skip("shape too large for the Metal emulator")
    inputs = random_inputs(case, rng)
    inputs["cotangent"] = rng.standard_normal((case.b, case.hq, case.lq, case.head_dim_v))
    wrt = [0, 1, 2]
    if case.mask.startswith("additive"):
        wrt.append(3)
    if case.sinks:
        wrt.append(4)
    want = oracle_grads(inputs, case, tuple(wrt))
    args = cast_inputs(inputs, case.dtype)
    mask = args["mask"]
    causal = isinstance(mask, str)
    ct = jnp.asarray(inputs["cotangent"], jnp.float32)

    def grads(implementation):
        def loss(q, k, v, m, s):
            out = jax_sdpa.scaled_dot_product_attention(
                q, k, v, scale=case.scale, mask="causal" if causal else m, sinks=s,
                query_seq_lengths=args["query_seq_lengths"],
                key_value_seq_lengths=args["key_value_seq_lengths"],
                implementation=implementation)
            return jnp.sum(out.astype(jnp.float32) * ct)

        return jax.jit(jax.grad(loss, argnums=tuple(wrt)))(
            args["q"], args["k"], args["v"], None if causal else mask, args["sinks"])

    with serves_or_skip():
        got = grads(impl)
    xla = grads("xla") if case.dtype != "float32" and impl != "xla" else [None] * len(wrt)
    names = ["dq", "dk", "dv", "dmask", "dsinks"]
    for g, w, x, i in zip(got, want, xla, wrt):
        assert_close(np.reshape(g, w.shape), w, case.dtype,
                     rtol_fp32=fp32_rtol(impl, FP32_GRAD_RTOL, grad=True),
                     xla_same_dtype=None if x is None else np.reshape(x, w.shape),
                     what=names[i])
