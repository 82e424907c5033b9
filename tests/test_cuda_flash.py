"""Our CUDA flash kernels through the public API (GPU only; skipped without a CUDA device).

implementation="cuda" runs the flash kernels (targets jax_sdpa_cuda_flash_{fwd,bwd}) for
every call the decode kernel does not take. A compact matrix against the float64 oracles of
tests/sdpa_testing.py: fp32 at JAX's default matmul precision (TF32) and at "highest"
(3xTF32; the fp32_precision attribute), forward and jax.grad; bf16/fp16 at head dims 512
and 320 (beyond cuDNN) with causal + GQA + sinks + lengths; the jax.nn layout
([B, T, N, H], seq_major) through dot_product_attention; outputs NaN-poisoned by the
handler first (JAX_SDPA_POISON_OUTPUTS=1, set by conftest). Tolerances: jax_sdpa.oracle's
policy: TF32 2e-3; highest 1e-5 forward and gradients (its named case "cuda_3xtf32": the
general fp32 bar allows gradients 2e-5); fp16/bf16 no worse than 2x XLA's error in the same
dtype plus a floor.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import oracle
from sdpa_testing import (FP32_RTOL, TF32_GRAD_RTOL, TF32_RTOL, Case,
                          assert_close, cast_inputs, oracle_forward,
                          oracle_grads, oracle_inputs_f64, random_inputs)

pytestmark = pytest.mark.gpu

# Our 3xTF32 kernels' gradients under "highest": the policy's named case for them.
FP32_GRAD_RTOL = oracle.tolerance("float32", grad=True, case="cuda_3xtf32")


@pytest.fixture(autouse=True)
def _needs_cuda_kernels():
    from jax_sdpa import _ext
    if jax.default_backend() != "gpu" or not _ext.has_backend("cuda"):
        pytest.skip("needs a CUDA GPU and our CUDA kernels built")


def _precision(name):
    """'default' (fp32_precision 0, whatever JAX_DEFAULT_MATMUL_PRECISION says) or
    'highest' (1)."""
    return jax.default_matmul_precision("default" if name == "default" else "highest")


def _mlx_call(case, impl, args):
    causal = isinstance(args["mask"], str)

    def fn(q, k, v, mask, sinks, ql, kvl):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, scale=case.scale, mask="causal" if causal else mask, sinks=sinks,
            query_seq_lengths=ql, key_value_seq_lengths=kvl, implementation=impl)

    operands = (args["q"], args["k"], args["v"], None if causal else args["mask"],
                args["sinks"], args["query_seq_lengths"], args["key_value_seq_lengths"])
    return fn, operands


def _forward(case, impl, inputs):
    fn, operands = _mlx_call(case, impl, cast_inputs(inputs, case.dtype))
    return jax.jit(fn)(*operands)


def _grads(case, impl, inputs, wrt):
    args = cast_inputs(inputs, case.dtype)
    fn, operands = _mlx_call(case, impl, args)
    ct = jnp.asarray(inputs["cotangent"], jnp.float32)

    def loss(*xs):
        return jnp.sum(fn(*xs).astype(jnp.float32) * ct)

    return jax.jit(jax.grad(loss, argnums=wrt))(*operands)


def _wrt(case):
    wrt = [0, 1, 2]
    if case.mask.startswith("additive"):
        wrt.append(3)
    if case.sinks:
        wrt.append(4)
    return tuple(wrt)


def _with_cotangent(case, rng):
    inputs = random_inputs(case, rng)
    inputs["cotangent"] = rng.standard_normal((case.b, case.hq, case.lq, case.head_dim_v))
    return inputs


def _oracle_out(inputs, case):
    fwd_inputs = {n: x for n, x in inputs.items() if n != "cotangent"}
    return oracle_forward(**oracle_inputs_f64(fwd_inputs, case.dtype), scale=case.scale)[0]


def _assert_zero_rows(out, want):
    """Rows with nothing to attend (and rows past q_lengths) are exactly 0, never NaN."""
    empty = ~np.any(np.abs(want) > 0, axis=-1)
    assert np.all(np.asarray(jnp.asarray(out).astype(jnp.float32))[empty] == 0)


def test_poisoning_is_on():
    assert os.environ.get("JAX_SDPA_POISON_OUTPUTS") == "1"


def test_routing_on_this_gpu():
    s = jax.ShapeDtypeStruct
    x = s((2, 8, 512, 64), jnp.float32)
    e = jax_sdpa.explain(x, x, x, mask="causal")
    assert e.verdicts["cuda"][0] and "jax_sdpa_cuda_flash_fwd" in e.verdicts["cuda"][1], str(e)
    assert e.chosen == "cuda", str(e)  # fp32, head dim <= 128: ours over xla
    b = s((2, 8, 512, 64), jnp.bfloat16)
    assert jax_sdpa.explain(b, b, b).chosen == "cudnn"
    f = jax.jit(jax.grad(lambda q: jnp.sum(jax_sdpa.scaled_dot_product_attention(
        q, q, q, implementation="cuda"))))
    text = f.lower(x).as_text()
    assert "jax_sdpa_cuda_flash_fwd" in text and "jax_sdpa_cuda_flash_bwd" in text
    with jax.default_matmul_precision("highest"):
        assert "fp32_precision = 1" in f.lower(x).as_text()


FP32_CASES = [
    Case(b=2, hq=4, hk=2, lq=130, lk=200, d=64, mask="causal"),
    Case(b=2, hq=6, hk=2, lq=77, lk=100, d=128, sinks=True, kv_lengths=True),
    Case(b=1, hq=2, hk=1, lq=65, lk=90, d=40, dv=72, mask="additive"),
]


@pytest.mark.parametrize("case", FP32_CASES, ids=Case.id)
def test_fp32_default_is_tf32_and_highest_is_fp32(case, rng):
    inputs = _with_cotangent(case, rng)
    want = _oracle_out(inputs, case)
    wrt = _wrt(case)
    want_grads = oracle_grads(inputs, case, wrt)
    names = ["dq", "dk", "dv", "dmask", "dsinks"]
    errors = {}
    for precision, rtol, grad_rtol in (("default", TF32_RTOL, TF32_GRAD_RTOL),
                                       ("highest", FP32_RTOL, FP32_GRAD_RTOL)):
        with _precision(precision):
            out = _forward(case, "cuda", inputs)
            grads = _grads(case, "cuda", inputs, wrt)
        errors[precision] = assert_close(out, want, "float32", rtol_fp32=rtol,
                                         what=f"{precision} out")
        _assert_zero_rows(out, want)
        for g, w, i in zip(grads, want_grads, wrt):
            assert_close(np.reshape(g, w.shape), w, "float32", rtol_fp32=grad_rtol,
                         what=f"{precision} {names[i]}")
    # the attribute reaches the kernel: TF32 is measurably less exact than 3xTF32
    assert errors["default"] > 4 * errors["highest"], errors


LOW_PRECISION_CASES = [
    Case(dtype=dt, b=2, hq=4, hk=2, lq=70, lk=150, d=d, mask="causal", sinks=True,
         kv_lengths=True)
    for dt in ("bfloat16", "float16") for d in (512, 320)
] + [
    Case(dtype="bfloat16", b=2, hq=4, hk=1, lq=33, lk=130, d=320, dv=128, mask="bool",
         mask_shape=("b", 1, "lq", "lk"), q_lengths=True, kv_lengths=True),
    Case(dtype="float16", b=1, hq=4, hk=2, lq=100, lk=64, d=512, dv=256, mask="additive",
         mask_shape=(1, "h", "lq", "lk")),
]


@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=Case.id)
def test_16bit_big_head_dims(case, rng):
    inputs = _with_cotangent(case, rng)
    want = _oracle_out(inputs, case)
    out = _forward(case, "cuda", inputs)
    assert out.dtype == jnp.dtype(case.dtype) and out.shape == want.shape
    assert_close(out, want, case.dtype, xla_same_dtype=_forward(case, "xla", inputs))
    _assert_zero_rows(out, want)
    wrt = _wrt(case)
    want_grads = oracle_grads(inputs, case, wrt)
    got = _grads(case, "cuda", inputs, wrt)
    xla = _grads(case, "xla", inputs, wrt)
    names = ["dq", "dk", "dv", "dmask", "dsinks"]
    for g, w, x, i in zip(got, want_grads, xla, wrt):
        assert_close(np.reshape(g, w.shape), w, case.dtype,
                     xla_same_dtype=np.reshape(x, w.shape), what=names[i])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seq_major_through_dot_product_attention(dtype, rng):
    """[B, T, N, H] in, top-left causal with a left window, GQA, kv lengths (>= 1, so no
    row is empty: jax.nn's convention for those differs from the contract's)."""
    b, t, s, n, k, h = 2, 96, 96, 4, 2, 64
    window = (40, 0)
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    kk = rng.standard_normal((b, s, k, h)).astype(np.float32)
    v = rng.standard_normal((b, s, k, h)).astype(np.float32)
    kvl = np.array([s, 57], np.int32)
    ct = rng.standard_normal((b, t, n, h)).astype(np.float32)

    def run(impl, q, kk, v):
        return jax_sdpa.dot_product_attention(
            q, kk, v, is_causal=True, local_window_size=window, key_value_seq_lengths=kvl,
            implementation=impl)

    def grads(impl, *xs):
        return jax.jit(jax.grad(lambda *a: jnp.sum(run(impl, *a).astype(jnp.float32) * ct),
                                argnums=(0, 1, 2)))(*xs)

    args = [jnp.asarray(x, dt) for x in (q, kk, v)]
    bhld = lambda x: np.swapaxes(np.asarray(jnp.asarray(x, dt).astype(jnp.float32),  # noqa
                                            np.float64), 1, 2)
    want, _ = oracle_forward(bhld(q), bhld(kk), bhld(v), key_value_seq_lengths=kvl,
                             window_left=window[0], window_right=window[1])
    want = np.swapaxes(want, 1, 2)
    with _precision("highest"):
        out = jax.jit(lambda *a: run("cuda", *a))(*args)
        got = grads("cuda", *args)
        xla_out = None if dtype == "float32" else jax.jit(lambda *a: run("xla", *a))(*args)
        xla_grads = [None] * 3 if dtype == "float32" else grads("xla", *args)
    assert out.shape == (b, t, n, h) and out.dtype == dt
    assert_close(out, want, dtype, xla_same_dtype=xla_out)
    want_grads = oracle.backward(bhld(q), bhld(kk), bhld(v), np.swapaxes(ct, 1, 2),
                                 kv_lengths=kvl, window_left=window[0],
                                 window_right=window[1])
    for name, g, x in zip(("dq", "dk", "dv"), got, xla_grads):
        assert_close(g, np.swapaxes(want_grads[name], 1, 2), dtype, rtol_fp32=FP32_GRAD_RTOL,
                     xla_same_dtype=x, what=name)


def test_poisoned_outputs_are_all_written(rng):
    """Padding rows (q_lengths), empty rows (kv_length 0, causal Lq > Lk) and odd tiles:
    every element of out/dq/dk/dv is written (the handler NaN-fills them first)."""
    case = Case(b=3, hq=4, hk=2, lq=131, lk=67, d=72, mask="causal", q_lengths=True,
                kv_lengths=True)
    inputs = _with_cotangent(case, rng)
    inputs["query_seq_lengths"] = np.array([131, 100, 5], np.int32)
    inputs["key_value_seq_lengths"] = np.array([67, 0, 30], np.int32)
    want = _oracle_out(inputs, case)
    with _precision("highest"):
        out = _forward(case, "cuda", inputs)
        grads = _grads(case, "cuda", inputs, (0, 1, 2))
    assert_close(out, want, "float32")
    _assert_zero_rows(out, want)
    want_grads = oracle_grads(inputs, case, (0, 1, 2))
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close(g, w, "float32", rtol_fp32=FP32_GRAD_RTOL, what=name)
        assert not np.any(np.asarray(g)[1]), f"{name}: batch 1 sees no key: exact zeros"
