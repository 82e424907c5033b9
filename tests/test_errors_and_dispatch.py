"""Input checks (clear ValueError/TypeError at trace time, naming the argument and shapes),
`implementation=` handling and `explain`; the fp32_precision attribute; the routing of
implementation="cuda" (decode vs flash kernels) and the cuda platform's preference."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa

Q = jnp.zeros((2, 4, 5, 8))
K = jnp.zeros((2, 2, 7, 8))
V = jnp.zeros((2, 2, 7, 6))


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(q=jnp.zeros((4, 5, 8))), ValueError, r"q must have rank 4.*\(4, 5, 8\)"),
    (dict(k=jnp.zeros((3, 2, 7, 8))), ValueError, r"batch sizes differ"),
    (dict(k=jnp.zeros((2, 3, 7, 8)), v=jnp.zeros((2, 3, 7, 6))), ValueError,
     r"multiple of the number of key/value heads \(3\)"),
    (dict(v=jnp.zeros((2, 1, 7, 6))), ValueError, r"k and v must have the same number of heads"),
    (dict(k=jnp.zeros((2, 2, 7, 9))), ValueError, r"same head dim.*\(2, 2, 7, 9\)"),
    (dict(v=jnp.zeros((2, 2, 6, 6))), ValueError, r"k and v must have the same length"),
    (dict(q=jnp.zeros((2, 4, 5, 8), jnp.int32)), TypeError, r"q must have a floating dtype"),
    (dict(mask="upper"), ValueError, r"mask must be None, 'causal' or an array"),
    (dict(mask=jnp.zeros((3, 5, 7), bool)), ValueError,
     r"mask of shape \(1, 3, 5, 7\) is not broadcastable to \[B, Hq, Lq, Lk\]"),
    (dict(mask=jnp.zeros((1, 1, 1, 5, 7), bool)), ValueError, r"mask must have rank <= 4"),
    (dict(mask=jnp.zeros((5, 7), jnp.int32)), TypeError, r"mask must be boolean"),
    (dict(sinks=jnp.zeros((2,))), ValueError, r"sinks must have shape \(Hq,\) = \(4,\)"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError,
     r"query_seq_lengths must have shape \(B,\) = \(2,\)"),
    (dict(key_value_seq_lengths=jnp.zeros((2,), jnp.float32)), TypeError,
     r"key_value_seq_lengths must be an integer array"),
    (dict(implementation="flash"), ValueError, r"implementation must be None or one of"),
])
def test_bad_input_raises_clear_error(kwargs, exc, pattern):
    args = dict(q=Q, k=K, v=V)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=pattern):
        jax_sdpa.scaled_dot_product_attention(q, k, v, **args)
    # raised at trace time: also under jit / eval_shape
    with pytest.raises(exc, match=pattern):
        jax.eval_shape(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(q, k, v, **args),
                       q, k, v)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU-only machine behaviour")
def test_named_gpu_implementation_on_cpu_says_why():
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        jax_sdpa.scaled_dot_product_attention(Q, K, V, implementation="cudnn")
    with pytest.raises(NotImplementedError, match="needs a CUDA GPU"):
        jax_sdpa.dot_product_attention(jnp.zeros((1, 5, 2, 8)), jnp.zeros((1, 5, 2, 8)),
                                       jnp.zeros((1, 5, 2, 8)), implementation="cuda")


def test_explain_lists_every_implementation_with_a_reason():
    e = jax_sdpa.explain(Q, K, V, mask="causal")
    assert set(e.verdicts) == set(jax_sdpa.IMPLEMENTATIONS)
    assert e.verdicts[e.chosen][0]
    for name, (ok, reason) in e.verdicts.items():
        assert reason
    text = str(e)
    assert "implementation=None ->" in text and e.chosen in text
    # works from shapes alone
    s = jax.ShapeDtypeStruct
    e2 = jax_sdpa.explain(s((1, 8, 1, 128), jnp.bfloat16), s((1, 1, 4096, 128), jnp.bfloat16),
                          s((1, 1, 4096, 128), jnp.bfloat16), platform="cuda")
    assert e2.platform == "cuda"
    assert e2.config.is_decode


def test_none_picks_chunked_for_large_scores_on_platforms_without_kernels():
    s = jax.ShapeDtypeStruct
    big = jax_sdpa.explain(s((1, 8, 16384, 64), jnp.float32), s((1, 8, 16384, 64), jnp.float32),
                           s((1, 8, 16384, 64), jnp.float32), platform="tpu")
    small = jax_sdpa.explain(s((1, 8, 128, 64), jnp.float32), s((1, 8, 128, 64), jnp.float32),
                             s((1, 8, 128, 64), jnp.float32), platform="tpu")
    assert big.chosen == "xla_chunked" and small.chosen == "xla"


def test_empty_sequences():
    out = jax_sdpa.scaled_dot_product_attention(jnp.ones((1, 2, 0, 8)), jnp.ones((1, 2, 3, 8)),
                                                jnp.ones((1, 2, 3, 4)))
    assert out.shape == (1, 2, 0, 4)
    out = jax_sdpa.scaled_dot_product_attention(jnp.ones((1, 2, 3, 8)), jnp.ones((1, 2, 0, 8)),
                                                jnp.ones((1, 2, 0, 4)))
    assert out.shape == (1, 2, 3, 4) and not np.any(np.asarray(out))


# ---------------------------------------------------------------------------
# fp32_precision: JAX's default matmul precision -> the FFI attribute

def _custom_calls(text, target_prefix="jax_sdpa_"):
    return [line for line in text.splitlines()
            if "custom_call" in line and f"@{target_prefix}" in line]


def _fp32_precision_values(text):
    calls = _custom_calls(text)
    assert calls, "no jax_sdpa custom call in the lowered module"
    return [int(re.search(r"fp32_precision = (\d+) : i64", c).group(1)) for c in calls]


@pytest.mark.parametrize("value, expected", [
    (None, 0), ("default", 0), ("high", 0), ("bfloat16", 0), ("tensorfloat32", 0),
    ("TF32_TF32_F32", 0), ("highest", 1), ("float32", 1), ("F32_F32_F32", 1),
    ("TF32_TF32_F32_X3", 1)])
def test_current_fp32_precision_follows_jax(value, expected):
    from jax_sdpa.config import StaticParams, current_fp32_precision
    if value is None:
        assert current_fp32_precision() == 0 and StaticParams(scale=1.0).fp32_precision == 0
        return
    with jax.default_matmul_precision(value):
        assert current_fp32_precision() == expected
        assert StaticParams(scale=1.0).fp32_precision == expected
    assert current_fp32_precision() == 0  # the context is gone


def test_fp32_precision_from_config_update_and_environment():
    import subprocess
    import sys

    from jax_sdpa.config import current_fp32_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        assert current_fp32_precision() == 1
        with jax.default_matmul_precision("bfloat16"):  # the context wins over the global
            assert current_fp32_precision() == 0
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert current_fp32_precision() == 0
    code = "from jax_sdpa.config import current_fp32_precision as c; print(c())"
    for env_value, want in (("highest", "1"), ("float32", "1"), ("tensorfloat32", "0")):
        env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION=env_value, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, cwd="/", check=True).stdout.strip()
        assert out == want, (env_value, out)


def test_fp32_precision_reaches_the_lowering():
    """The custom call's attributes carry fp32_precision = 1 under 'highest', 0 otherwise,
    for the forward and the backward; the same jitted function is retraced."""
    from jax_sdpa import _ext
    if not _ext.has_backend("cpu"):
        pytest.skip("the native CPU kernel is not built")
    f = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cpu"))
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_sdpa.scaled_dot_product_attention(
        q, k, v, implementation="cpu")), argnums=(0, 1, 2)))
    assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [0]
    assert _fp32_precision_values(g.lower(Q, K, V).as_text()) == [0, 0]
    for name in ("highest", "float32"):
        with jax.default_matmul_precision(name):
            assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [1]
            text = g.lower(Q, K, V).as_text()
            assert _fp32_precision_values(text) == [1, 1]
            assert any("jax_sdpa_cpu_bwd" in c for c in _custom_calls(text))
    with jax.default_matmul_precision("tensorfloat32"):
        assert _fp32_precision_values(f.lower(Q, K, V).as_text()) == [0]
    # and it runs (the handlers bind the attribute) with the same result
    q = jnp.asarray(np.random.default_rng(0).standard_normal(Q.shape), jnp.float32)
    k = jnp.asarray(np.random.default_rng(1).standard_normal(K.shape), jnp.float32)
    v = jnp.asarray(np.random.default_rng(2).standard_normal(V.shape), jnp.float32)
    default = f(q, k, v)
    with jax.default_matmul_precision("highest"):
        highest = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(default), np.asarray(highest))


def test_handlers_validate_fp32_precision():
    from jax_sdpa import _ext
    if not _ext.has_backend("cpu"):
        pytest.skip("the native CPU kernel is not built")
    q = jnp.zeros((1, 2, 3, 8), jnp.float32)
    from jax_sdpa.primitives import ffi_call_args
    empty, attrs = ffi_call_args(scale=1.0)
    del attrs["fp32_precision"]
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)))
    out, _ = call(q, q, q, *empty, **attrs, fp32_precision=np.int64(1))
    assert out.shape == q.shape
    with pytest.raises(Exception, match="fp32_precision must be 0"):
        jax.block_until_ready(call(q, q, q, *empty, **attrs, fp32_precision=np.int64(2)))
    with pytest.raises(Exception, match="attributes"):  # every attribute is required
        jax.block_until_ready(call(q, q, q, *empty, **attrs))


# ---------------------------------------------------------------------------
# implementation="cuda": the decode kernel or the flash kernels (fake configs, CPU)

def _cfg_from(q, k, v, has_sinks=False, **kw):
    from jax_sdpa.config import Config, StaticParams
    params = StaticParams(scale=0.125, **kw)
    return Config.from_shapes(q.shape, k.shape, v.shape, q.dtype, None, None, has_sinks, False,
                              False, params)


def _cfg(dtype="float32", b=2, hq=8, hk=2, lq=256, lk=256, d=64, dv=None, has_sinks=False,
         **kw):
    s = jax.ShapeDtypeStruct
    dt = jnp.dtype(dtype)
    return _cfg_from(s((b, hq, lq, d), dt), s((b, hk, lk, d), dt), s((b, hk, lk, dv or d), dt),
                     has_sinks=has_sinks, **kw)


@pytest.fixture
def fake_h200(monkeypatch, cuda_module):
    """Every backend built, cuDNN 9.19 on a compute capability 9.0 GPU (the CUDA kernels'
    facts from the built module)."""
    from jax_sdpa import _ext, dispatch
    monkeypatch.setattr(_ext, "has_backend", lambda name: True)
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, (9, 0)))
    return dispatch


@pytest.mark.parametrize("kwargs, direction, kernel", [
    (dict(), "fwd", "flash"),  # fp32 prefill
    (dict(), "bwd", "flash"),
    (dict(dtype="bfloat16", d=512), "fwd", "flash"),
    (dict(dtype="float16", d=320, dv=128), "bwd", "flash"),
    (dict(d=8), "fwd", "flash"),
    (dict(dtype="bfloat16", b=1, hq=8, hk=8, lq=1, lk=4096, d=128), "fwd", "decode"),
    (dict(b=1, hq=8, hk=1, lq=1, lk=4096, d=128), "fwd", "decode"),  # fp32 decode
    (dict(dtype="bfloat16", b=1, hq=8, hk=8, lq=1, lk=4096, d=128), "bwd", "flash"),
    (dict(b=1, hq=8, hk=1, lq=1, lk=4096, d=40), "fwd", "flash"),  # D not built for decode
    (dict(b=1, hq=8, hk=1, lq=1, lk=4096, d=320), "fwd", "flash"),
])
def test_cuda_serves_with_the_right_kernel(fake_h200, kwargs, direction, kernel):
    dispatch = fake_h200
    cfg = _cfg(**kwargs)
    ok, why = dispatch.supports("cuda", cfg, direction, "cuda")
    assert ok, why
    assert dispatch.cuda_kernel(cfg, direction)[0] == kernel
    target = dispatch.ffi_target("cuda", direction, cfg)
    want = {"decode": f"jax_sdpa_cuda_{direction}", "flash": f"jax_sdpa_cuda_flash_{direction}"}
    assert target == want[kernel]
    assert target in why  # explain names the kernel's target ...
    assert ("decode kernel" if kernel == "decode" else "flash kernels") in why  # ... and why
    assert dispatch.choose(cfg, "cuda", direction, "cuda") == "cuda"


@pytest.mark.parametrize("kwargs, says", [
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=8192, d=128), "fed by TMA"),
    (dict(dtype="float16", b=1, hq=16, hk=2, lq=1, lk=512, d=128), "fed by TMA"),  # 8 rows
    (dict(dtype="bfloat16", b=1, hq=16, hk=1, lq=1, lk=512, d=128), "tensor cores)"),  # 16 rows
    (dict(dtype="bfloat16", b=1, hq=8, hk=2, lq=1, lk=512, d=256), "fed by TMA"),  # 4 rows
    (dict(dtype="bfloat16", b=1, hq=16, hk=1, lq=1, lk=512, d=256), "tensor cores)"),  # 16 rows
    (dict(dtype="float16", b=1, hq=32, hk=4, lq=1, lk=1024, d=512), "decode_wide_tma"),
    (dict(b=1, hq=8, hk=2, lq=1, lk=512, d=128), "CUDA cores"),  # fp32
    (dict(b=1, hq=8, hk=2, lq=1, lk=512, d=512), "decode_wide_f32"),  # fp32 D512
])
def test_cuda_decode_explains_which_kernel(fake_h200, kwargs, says):
    ok, why = fake_h200.cuda_decode_serves(_cfg(**kwargs), "fwd")
    assert ok and says in why, why


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(d=36), "multiples of 8"),
    (dict(d=64, dv=20), "multiples of 8"),
    (dict(d=520), "above 512"),
    (dict(dtype="bfloat16", d=64, dv=576), "above 512"),
    (dict(b=65536, hq=1, hk=1, lq=32, lk=32), "65535"),
    (dict(b=1, hq=70000, hk=1, lq=32, lk=32), "65535"),
    (dict(b=1, hq=1, hk=1, lq=1 << 30, lk=32, d=8), "2\\*\\*30"),
    (dict(b=1, hq=1, hk=1, lq=64, lk=1 << 30, d=8), "2\\*\\*30"),
])
def test_cuda_refusals_say_why(fake_h200, kwargs, pattern):
    dispatch = fake_h200
    cfg = _cfg(**kwargs)
    for direction in ("fwd", "bwd"):
        ok, why = dispatch.supports("cuda", cfg, direction, "cuda")
        assert not ok and re.search(pattern, why), why
        with pytest.raises(NotImplementedError, match=pattern):
            dispatch.choose(cfg, "cuda", direction, "cuda")
    assert not dispatch.supports("cuda", _cfg(), "fwd", "cpu")[0]


def test_cuda_explain_names_kernel_and_precision(fake_h200):
    dispatch = fake_h200
    s = jax.ShapeDtypeStruct
    x = s((2, 8, 512, 64), jnp.float32)
    e = jax_sdpa.explain(x, x, x, platform="cuda")
    ok, why = e.verdicts["cuda"]
    assert ok and "flash kernels" in why and "TF32" in why and "jax_sdpa_cuda_flash_fwd" in why
    assert "not the decode kernel" in why
    assert "jax_sdpa_cuda_flash_bwd" in jax_sdpa.explain(x, x, x, platform="cuda",
                                                          direction="bwd").verdicts["cuda"][1]
    with jax.default_matmul_precision("highest"):
        e = jax_sdpa.explain(x, x, x, platform="cuda")
    assert e.config.params.fp32_precision == 1 and "3xTF32" in e.verdicts["cuda"][1]
    dec = jax_sdpa.explain(s((1, 8, 1, 128), jnp.bfloat16), s((1, 8, 4096, 128), jnp.bfloat16),
                           s((1, 8, 4096, 128), jnp.bfloat16), platform="cuda")
    assert "decode kernel" in dec.verdicts["cuda"][1]
    assert "jax_sdpa_cuda_fwd" in dec.verdicts["cuda"][1]


@pytest.mark.parametrize("kwargs, direction, chosen", [
    # cuDNN wherever it serves
    (dict(dtype="bfloat16", d=128), "fwd", "cudnn"),
    (dict(dtype="float16", d=256, lq=4096, lk=4096), "bwd", "cudnn"),
    # fp32: ours up to head dim 128, fwd and bwd
    (dict(b=2, hq=38, hk=38, lq=4250, lk=4250, d=64), "fwd", "cuda"),
    (dict(b=2, hq=38, hk=38, lq=4250, lk=4250, d=64), "bwd", "cuda"),
    (dict(d=128), "fwd", "cuda"),
    (dict(d=64, dv=128), "bwd", "cuda"),
    (dict(d=192, dv=128), "fwd", "xla"),
    (dict(d=256, lq=8192, lk=8192), "fwd", "xla_chunked"),
    (dict(d=256), "bwd", "xla"),
    # 16-bit above cuDNN's 256: the wgmma kernels on this cc 9.0 GPU; with Dv <= 256 (the
    # wide / generic kernels) ours only where xla would go chunked. The backward: XLA's
    # materialized one up to XLA_WIDE_BWD_MAX_SCORE_BYTES (4 GiB of scores), ours above
    (dict(dtype="bfloat16", b=1, hq=16, hk=16, lq=4096, lk=4096, d=512, window_right=0,
          bottom_right=True), "fwd", "cuda"),
    (dict(dtype="bfloat16", b=1, hq=16, hk=16, lq=4096, lk=4096, d=512), "bwd", "xla"),
    # ... the forward with no band: XLA's materialized one within that budget
    (dict(dtype="bfloat16", d=512), "fwd", "xla"),
    (dict(dtype="bfloat16", d=512, window_right=0), "fwd", "cuda"),
    (dict(dtype="bfloat16", d=512, window_left=64), "fwd", "cuda"),
    (dict(dtype="float16", d=320), "bwd", "xla"),
    (dict(dtype="bfloat16", d=512, dv=256), "fwd", "xla"),
    (dict(dtype="bfloat16", d=512, dv=256, lq=8192, lk=8192), "bwd", "xla"),  # 4 GiB
    (dict(dtype="bfloat16", b=4, d=512, dv=256, lq=8192, lk=8192), "bwd", "cuda"),  # 8 GiB
    # decode shapes: the decode kernel's crossover rule, never the flash kernels
    (dict(b=1, hq=8, hk=1, lq=1, lk=4096, d=64), "fwd", "xla"),  # fp32: xla was faster
    (dict(b=16, hq=32, hk=8, lq=1, lk=4096, d=64), "fwd", "xla"),
    # 16-bit D512: ours from CUDA_DECODE_WIDE_MIN_KV_BYTES at <= 8 rows per kv head, else
    # our XLA path
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=8192, d=512), "fwd", "cuda"),  # 1 GiB
    (dict(dtype="bfloat16", b=1, hq=32, hk=4, lq=1, lk=8192, d=512), "fwd", "xla"),  # 64 MiB
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=2048, d=512), "fwd", "xla"),  # 256 MiB
    (dict(dtype="bfloat16", b=32, hq=32, hk=8, lq=1, lk=1024, d=512), "fwd", "cuda"),  # 512
    (dict(dtype="float16", b=1, hq=32, hk=4, lq=1, lk=1024, d=512), "fwd", "xla"),  # 8 MiB
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=2048, d=512), "fwd", "xla"),  # 32 MiB
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=2, lk=4096, d=512), "fwd", "cuda"),  # R=8
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=4, lk=4096, d=512), "fwd", "xla"),  # R=16
    (dict(b=1, hq=32, hk=4, lq=1, lk=8192, d=512), "fwd", "xla"),  # fp32 D512: xla faster
    (dict(b=1, hq=8, hk=1, lq=1, lk=4096, d=40), "fwd", "xla"),
    (dict(b=16, hq=32, hk=8, lq=1, lk=4096, d=40), "fwd", "xla"),  # decode can't: not flash
    (dict(dtype="bfloat16", b=4, hq=32, hk=4, lq=1, lk=4096, d=128), "fwd", "cuda"),  # R=8
    # cuDNN serves these: ours for 4 < R <= 32 (measured crossover), and at D128 for R <= 4
    # from CUDA_DECODE_MIN_KV_BYTES of K + V; cuDNN otherwise
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=4096, d=128), "fwd", "cuda"),  # R=4
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=4096, d=128), "fwd", "cudnn"),  # 17 MB
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=4096, d=64), "fwd", "cudnn"),  # D64
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=8, lk=4096, d=128), "fwd", "cuda"),  # R=32
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=16, lk=4096, d=128), "fwd", "cudnn"),  # R=64
    # ... and at D = Dv in {192, 256} plain decode too: ours from CUDA_DECODE_MIN_KV_BYTES
    # of K + V, our XLA path below (cuDNN was the slowest at 10 of 12 measured points)
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=8192, d=256), "fwd", "cuda"),  # 67 MB
    (dict(dtype="float16", b=8, hq=32, hk=8, lq=1, lk=2048, d=256), "fwd", "cuda"),
    (dict(dtype="float16", b=8, hq=32, hk=8, lq=1, lk=2048, d=192), "fwd", "cuda"),
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=2048, d=256), "fwd", "xla"),  # 17 MB
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=2048, d=192), "fwd", "xla"),
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=8192, d=192, dv=128), "fwd", "cudnn"),
    (dict(dtype="bfloat16", b=8, hq=32, hk=8, lq=8, lk=4096, d=256), "fwd", "cuda"),  # R=32
    (dict(dtype="bfloat16", b=1, hq=32, hk=8, lq=1, lk=8192, d=256), "bwd", "cudnn"),
])
def test_cuda_platform_preference(fake_h200, kwargs, direction, chosen):
    dispatch = fake_h200
    cfg = _cfg(**kwargs)
    got = dispatch.choose(cfg, "cuda", direction)
    assert got == chosen, (got, dispatch.explain_choice(cfg, "cuda", direction))
    if got == "cuda":
        kernel = dispatch.cuda_kernel(cfg, direction)[0]
        assert kernel == ("decode" if cfg.is_decode else "flash")


@pytest.mark.parametrize("features", [("logits_soft_cap",), ("segment_ids", "logits_soft_cap")])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_soft_cap_runs_cudnn_from_hopper_and_9_19(fake_h200, monkeypatch, features, direction):
    """16-bit prefill with a soft cap: our cuDNN graphs (its score modifier; segment ids as
    their mask) on compute capability 9.0 with cuDNN >= 9.19; on an older cuDNN or GPU,
    which cuDNN refuses by name, our flash kernels in the directions CUDA_FLASH_FOR_FEATURES
    lists for every feature used, our XLA path otherwise."""
    import dataclasses
    dispatch = fake_h200
    cfg = dataclasses.replace(_cfg(dtype="bfloat16", d=128, logits_soft_cap=30.0),
                              has_segment_ids="segment_ids" in features)
    assert cfg.features == frozenset(features)
    ok, why = dispatch.supports_cudnn(cfg, direction, "cuda")
    assert ok, why
    assert dispatch.choose(cfg, "cuda", direction) == "cudnn"
    fallback = "cuda" if direction == "fwd" else "xla"
    for facts in ((91800, (9, 0)), (91900, (8, 0))):
        monkeypatch.setattr(dispatch, "_CUDNN_FACTS", facts)
        ok, why = dispatch.supports_cudnn(cfg, direction, "cuda")
        assert not ok and "soft-capping" in why, why
        got = dispatch.choose(cfg, "cuda", direction)
        assert got == fallback, (facts, got, dispatch.explain_choice(cfg, "cuda", direction))


def test_cudnn_refuses_soft_cap_with_lengths(fake_h200):
    """cuDNN's score modifier isn't combined with q/kv lengths (wrong outputs on the H200):
    refused by name, and None takes our flash kernels' forward."""
    import dataclasses
    dispatch = fake_h200
    cfg = dataclasses.replace(_cfg(dtype="bfloat16", d=128, logits_soft_cap=30.0),
                              has_kv_lengths=True)
    ok, why = dispatch.supports_cudnn(cfg, "fwd", "cuda")
    assert not ok and "logits_soft_cap with q/kv lengths" in why, why
    assert dispatch.choose(cfg, "cuda", "fwd") == "cuda"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_segment_ids_run_cudnn_as_a_mask(fake_h200, monkeypatch, direction):
    """16-bit prefill with segment ids and no mask of its own: our cuDNN graphs with the ids
    as a [B, 1, Lq, Lk] mask, up to CUDNN_SEGMENT_MASK_MAX_BYTES of it; with a mask of the
    call's own, or past that size, our flash kernels."""
    import dataclasses

    from jax_sdpa import tuning
    from jax_sdpa.config import MASK_ADDITIVE
    dispatch = fake_h200
    cfg = dataclasses.replace(_cfg(dtype="bfloat16", d=128, window_right=0),
                              has_segment_ids=True)
    masked = dispatch.segments_as_mask(cfg)
    assert (masked.mask_kind, masked.mask_shape, masked.mask_dtype, masked.has_segment_ids) \
        == (MASK_ADDITIVE, (2, 1, 256, 256), cfg.dtype, False)
    plan = dispatch.plan(cfg, "cuda", direction)
    assert (plan.implementation, plan.segments_as_mask) == ("cudnn", True), plan
    assert "segment ids as a [B, 1, Lq, Lk] mask" in plan.reason
    assert dispatch.plan(cfg, "cuda", direction, "cudnn").segments_as_mask
    own_mask = dataclasses.replace(cfg, mask_kind=MASK_ADDITIVE, mask_shape=(2, 1, 256, 256),
                                   mask_dtype=cfg.dtype)
    assert dispatch.segments_as_mask(own_mask) is None
    assert dispatch.choose(own_mask, "cuda", direction) == "cuda"
    monkeypatch.setattr(tuning, "CUDNN_SEGMENT_MASK_MAX_BYTES", 2 * 256 * 256 * 2 - 1)
    assert dispatch.segments_as_mask(cfg) is None
    assert dispatch.choose(cfg, "cuda", direction) == "cuda"
    with pytest.raises(NotImplementedError, match="segment ids"):
        dispatch.plan(cfg, "cuda", direction, "cudnn")


def test_segment_ids_lower_to_cudnn_with_their_mask(fake_h200):
    """Exported for the cuda platform: the cuDNN custom calls of a packed call take the mask
    built from the ids ([B, 1, Lq, Lk] of the input dtype) with has_mask set and
    has_segment_ids clear, forward and backward. A forward with ids of its own for the keys
    keeps its lse (jax.nn's rules for rows that see no key read it); q_segment_ids alone
    leave every query its own key, and that forward drops it."""
    from jax import export
    targets = ("jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_fwd_no_lse", "jax_sdpa_cudnn_bwd")
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
    s = jax.ShapeDtypeStruct
    x, ids = s((2, 128, 4, 64), jnp.bfloat16), s((2, 128), jnp.int32)

    def loss(q, k, v, ids):
        return jnp.sum(jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                                      q_segment_ids=ids).astype(jnp.float32))

    for fn, want in ((lambda q, k, v, ids: jax_sdpa.dot_product_attention(
            q, k, v, q_segment_ids=ids), ["jax_sdpa_cudnn_fwd_no_lse"]),
                     (lambda q, k, v, ids: jax_sdpa.dot_product_attention(
                         q, k, v, q_segment_ids=ids, kv_segment_ids=ids),
                      ["jax_sdpa_cudnn_fwd"]),
                     (jax.grad(loss, argnums=(0, 1, 2)),
                      ["jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_bwd"])):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            x, x, x, ids)
        lines = _custom_calls(exp.mlir_module())
        assert [line.split("@")[1].split("(")[0] for line in lines] == want
        for line in lines:
            assert re.search(r"has_mask = true", line) and \
                re.search(r"has_segment_ids = false", line), line
            assert "tensor<2x1x128x128xbf16>" in line, line


def test_decode_where_cudnn_cannot_serve(fake_h200, monkeypatch):
    """16-bit decode that cuDNN refuses (sinks before cuDNN 9.13): ours from
    CUDA_DECODE_MIN_KV_BYTES of K + V, xla below."""
    dispatch = fake_h200
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91200, (9, 0)))
    big = _cfg(dtype="bfloat16", b=8, hq=32, hk=8, lq=1, lk=8192, d=128, has_sinks=True)
    small = _cfg(dtype="bfloat16", b=1, hq=8, hk=1, lq=1, lk=4096, d=128, has_sinks=True)
    assert not dispatch.supports_cudnn(big, "fwd", "cuda")[0]
    assert dispatch.choose(big, "cuda", "fwd") == "cuda"  # 268 MB of K/V
    assert dispatch.choose(small, "cuda", "fwd") == "xla"  # 2 MB
    fp32 = _cfg(b=8, hq=32, hk=8, lq=1, lk=8192, d=128, has_sinks=True)
    assert dispatch.choose(fp32, "cuda", "fwd") == "xla"


def test_cuda_flash_preferred_rule(fake_h200):
    dispatch = fake_h200
    pref = dispatch._cuda_flash_preferred
    assert pref(_cfg(d=128)) and pref(_cfg(d=8)) and not pref(_cfg(d=136))
    assert not pref(_cfg(b=1, hq=8, hk=1, lq=1, lk=4096, d=64))  # decode shape
    big = dict(b=1, hq=16, hk=16, lq=4096, lk=4096)
    assert pref(_cfg(dtype="bfloat16", d=264, **big))
    assert not pref(_cfg(dtype="bfloat16", d=256, **big))
    # 16-bit head dims > 256, small scores: the wgmma kernels beat our XLA path on the H200
    # (cc 9.0) in both directions; D or Dv <= 256 has no wgmma kernel
    small = _cfg(dtype="float16", d=512)
    assert pref(small, "fwd") and pref(small, "bwd")
    assert not pref(_cfg(dtype="float16", d=512, dv=128), "fwd")


def test_decode_with_lengths_runs_our_decode_kernel(fake_h200):
    """The KV-cache call (key_value_seq_lengths) goes to our decode kernel where cuDNN would
    serve it (CUDA_DECODE_OVER_CUDNN_WITH_LENGTHS); without lengths the R <= 4 row stays
    with cuDNN at D64."""
    from jax_sdpa.config import Config, StaticParams
    dispatch = fake_h200
    dt = np.dtype(jnp.bfloat16)
    shapes = ((1, 32, 1, 64), (1, 8, 32768, 64), (1, 8, 32768, 64))
    for lengths, want in ((True, "cuda"), (False, "cudnn")):
        cfg = Config.from_shapes(*shapes, dt, None, None, False, False, lengths,
                                 StaticParams(scale=0.1))
        assert dispatch.choose(cfg, "cuda", "fwd") == want, dispatch.explain_choice(cfg, "cuda")


@pytest.mark.parametrize("dtype, d, cap, says, chosen", [
    ("bfloat16", 128, 0.0, "our decode kernel through the page table", "cuda"),
    ("float16", 64, 0.0, "our decode kernel through the page table", "cuda"),
    ("float32", 128, 0.0, "feature kernel (fp32 has no paged decode kernel", "xla"),
    ("bfloat16", 96, 0.0, "feature kernel (head dims (D=96, Dv=96) have no paged decode",
     "xla"),
    ("bfloat16", 128, 30.0, "feature kernel (soft-capping rules out", "xla"),
])
def test_cuda_paged_explains_which_kernel_reads_the_pages(fake_h200, dtype, d, cap, says,
                                                          chosen):
    """The paged target's kernel, as the CUDA module says (paged_decode_unsupported_reason);
    None takes the target only where the paged decode kernel reads the pages
    (CUDA_PAGED_FLASH_FOR_NONE), else the XLA gather."""
    from jax_sdpa import _ext
    from jax_sdpa.config import Config, StaticParams
    dispatch = fake_h200
    if dispatch.paged_target("cuda") not in _ext.ffi_targets():
        pytest.skip("this build's CUDA module has no paged target")
    dt = np.dtype(jnp.dtype(dtype))
    shapes = ((8, 32, 1, d), (8, 8, 8192, d), (8, 8, 8192, d))
    cfg = Config.from_shapes(*shapes, dt, None, None, False, False, True,
                             StaticParams(scale=0.1, logits_soft_cap=cap))
    picked, verdicts = dispatch.explain_paged_choice(cfg, "cuda")
    ok, why = verdicts["cuda"]
    assert picked == chosen and ok and says in why, (picked, why)


@pytest.mark.parametrize("direction, knob", [("fwd", "JAX_SDPA_FLASH_WGMMA"),
                                             ("bwd", "JAX_SDPA_FLASH_WGMMA_BWD")])
def test_wgmma_flash_needs_hopper_and_its_knob(fake_h200, monkeypatch, direction, knob):
    dispatch = fake_h200
    small = _cfg(dtype="bfloat16", d=512, window_right=0)
    # the causal forward's choice follows the wgmma kernel (the backward's is XLA's at this
    # size)
    picks = (lambda: dispatch.choose(small, "cuda", direction)) if direction == "fwd" else None
    assert dispatch._wgmma_flash_runs(small, direction)
    assert picks is None or picks() == "cuda"
    monkeypatch.setenv(knob, "0")
    assert not dispatch._wgmma_flash_runs(small, direction)
    assert picks is None or picks() == "xla"
    monkeypatch.delenv(knob)
    for cc in ((8, 0), (10, 0)):  # an A100, a Blackwell: no sm_90a
        monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, cc))
        assert not dispatch._wgmma_flash_runs(small, direction)
        assert picks is None or picks() == "xla"


def test_cudnn_workspace_binding_unpacks_the_call_as_the_handler(cuda_module):
    """`cudnn_workspace_bytes` reads the call from shapes with the handler's own unpacking:
    a bad result shape comes back as the handler's message, a wrong count raises; a good
    call is sized (bytes, '') on a GPU, or says why not (bytes 0) without one."""
    from jax_sdpa import primitives
    from jax_sdpa.config import StaticParams
    attrs = {k: v.item() if isinstance(v, np.generic) else v for k, v in primitives.ffi_attrs(
        StaticParams(scale=0.125, window_right=0), dict(
            has_mask=False, has_sinks=False, has_q_lengths=False, has_kv_lengths=False,
            has_segment_ids=False)).items()}
    x = ((2, 4, 128, 64), "bfloat16")
    operands = [x, x, x, ((0,), "float32"), ((0,), "float32")] + [((0,), "int32")] * 4
    lse = ((2, 4, 128), "float32")
    bytes_, why = cuda_module.cudnn_workspace_bytes(False, True, operands, [x, lse], attrs)
    assert (bytes_ > 0 and why == "") or (bytes_ == 0 and why), (bytes_, why)
    assert "don't decode" not in why  # the lowering writes only attributes the handlers read
    bytes_, why = cuda_module.cudnn_workspace_bytes(
        False, True, operands, [x, ((2, 4, 129), "float32")], attrs)
    assert bytes_ == 0 and "lse must be float32 [B, Hq, Lq] = [2, 4, 128]" in why, why
    bytes_, why = cuda_module.cudnn_workspace_bytes(False, False, operands, [x, lse], attrs)
    assert bytes_ == 0 and "returns no lse" in why, why  # the no-lse form takes f32 [0]
    with pytest.raises(ValueError, match="expected 9 operands and 2 results"):
        cuda_module.cudnn_workspace_bytes(False, True, operands[:8], [x, lse], attrs)
    # a name the handlers' attribute decoding doesn't list (they would refuse the call)
    bytes_, why = cuda_module.cudnn_workspace_bytes(False, True, operands, [x, lse],
                                                    {**attrs, "window_middle": 3})
    assert bytes_ == 0 and why == "attributes the handlers don't decode: window_middle", why


def test_cudnn_calls_carry_a_workspace_and_no_lse_form(fake_h200):
    """Exported for the cuda platform: every cuDNN custom call returns a uint8 workspace after
    its contract results (256 bytes here, where no GPU sizes it: the handler tops it up
    outside CUDA-graph capture), and the forward whose lse nobody reads returns f32 [0] in
    lse's place."""
    from jax import export
    targets = ("jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_fwd_no_lse", "jax_sdpa_cudnn_bwd")
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]
    x = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)  # D64: cuDNN for None

    def results(fn):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(x, x, x)
        return {line.split("@")[1].split("(")[0]: line.rsplit("->", 1)[1]
                for line in _custom_calls(exp.mlir_module())}

    def attention(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True)

    got = results(attention)
    assert list(got) == ["jax_sdpa_cudnn_fwd_no_lse"], got
    assert re.search(r"tensor<2x128x4x64xbf16>, tensor<0xf32>, tensor<256xui8>",
                     got["jax_sdpa_cudnn_fwd_no_lse"]), got
    got = results(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)),
                           argnums=(0, 1, 2)))
    assert sorted(got) == ["jax_sdpa_cudnn_bwd", "jax_sdpa_cudnn_fwd"], got
    assert re.search(r"tensor<2x4x128xf32>, tensor<256xui8>", got["jax_sdpa_cudnn_fwd"]), got
    assert re.search(r"(tensor<2x128x4x64xbf16>, ){3}tensor<256xui8>",
                     got["jax_sdpa_cudnn_bwd"]), got


def test_cuda_routing_in_the_lowering(fake_h200):
    """Exported for the cuda platform from this CPU machine: the custom call targets that
    implementation="cuda" and implementation=None lower to, with their fp32_precision."""
    from jax import export

    from jax_sdpa import vjp
    from jax_sdpa.config import StaticParams

    targets = ("jax_sdpa_cuda_fwd", "jax_sdpa_cuda_flash_fwd", "jax_sdpa_cuda_flash_bwd",
               "jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_fwd_no_lse", "jax_sdpa_cudnn_bwd")
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in targets]

    def calls(fn, *args):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
        return [(line.split("@")[1].split("(")[0], _fp32_precision_values(line)[0])
                for line in _custom_calls(exp.mlir_module())]

    def named(impl):  # binds the primitives directly: api.py checks names on this platform
        def loss(q, k, v):
            p = StaticParams(scale=0.125, implementation=impl)
            return jnp.sum(vjp.attention(q, k, v, None, None, None, None, p)[0])
        return loss

    s = jax.ShapeDtypeStruct
    x = s((2, 4, 128, 64), jnp.float32)
    assert calls(named("cuda"), x, x, x) == [("jax_sdpa_cuda_flash_fwd", 0)]
    assert calls(jax.grad(named("cuda")), x, x, x) == [("jax_sdpa_cuda_flash_fwd", 0),
                                                       ("jax_sdpa_cuda_flash_bwd", 0)]
    with jax.default_matmul_precision("highest"):
        assert calls(jax.grad(named("cuda")), x, x, x) == [("jax_sdpa_cuda_flash_fwd", 1),
                                                           ("jax_sdpa_cuda_flash_bwd", 1)]
        assert calls(jax.grad(named(None)), x, x, x) == [("jax_sdpa_cuda_flash_fwd", 1),
                                                         ("jax_sdpa_cuda_flash_bwd", 1)]
    q, kv = s((2, 4, 1, 64), jnp.bfloat16), s((2, 4, 300, 64), jnp.bfloat16)
    assert calls(jax.grad(lambda q, k, v: named("cuda")(q, k, v).astype(jnp.float32)),
                 q, kv, kv) == [("jax_sdpa_cuda_fwd", 0), ("jax_sdpa_cuda_flash_bwd", 0)]
    b = s((2, 4, 128, 64), jnp.bfloat16)
    assert [t for t, _ in calls(jax.grad(lambda q, k, v: named(None)(q, k, v).astype(
        jnp.float32)), b, b, b)] == ["jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_bwd"]

    # The public entries' forward alone: cuDNN skips its stats unless lse is read (the
    # residual, jax.nn's empty-row rules under lengths, or differentiation).
    def nn(**kw):
        return lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=True, **kw)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32))

    bt = s((2, 128, 4, 64), jnp.bfloat16)
    lengths = jnp.array([100, 128], jnp.int32)
    forward_only = {
        "plain": (nn(), "jax_sdpa_cudnn_fwd_no_lse"),
        "residual": (lambda q, k, v: nn(return_residual=True)(q, k, v)[1], "jax_sdpa_cudnn_fwd"),
        "lengths": (nn(key_value_seq_lengths=lengths), "jax_sdpa_cudnn_fwd"),
        "mlx": (lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
            q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), mask="causal"),
            "jax_sdpa_cudnn_fwd_no_lse"),
    }
    for name, (fn, target) in forward_only.items():
        assert [t for t, _ in calls(fn, bt, bt, bt)] == [target], name
    for fn in (nn(), forward_only["mlx"][0]):
        assert [t for t, _ in calls(jax.grad(loss(fn), argnums=(0, 1, 2)), bt, bt, bt)] == [
            "jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_bwd"]


def test_cuda_decode_workspace_bytes(cuda_module):
    """The decode kernel's workspace (split-K partials + counters) against a hand count:
    n_max = min(256, 2 * 640 // units16 + 2, max(1, Lk // 16)), partial out n * rows * Dv
    f32 + partial lse n * rows f32 + counters units8 int32, each padded to 256 bytes."""
    from jax_sdpa import dispatch
    size = dispatch.cuda_decode_workspace_bytes_for
    # B2 Hq4 Hk4 Lq1 Lk300 Dv64: rows 8, units 8; n = min(256, 162, 18) = 18:
    # 18*8*64*4 = 36864, 18*8*4 = 576 -> 768, 8*4 = 32 -> 256
    assert size(2, 4, 4, 1, 300, 64) == 36864 + 768 + 256
    # B1 Hq32 Hk8 Lq1 Lk32768 Dv128: rows 32, units 8 (R = 4); n = min(256, 162, 2048) = 162:
    # 162*32*128*4 = 2654208, 162*32*4 = 20736, 8*4 = 32 -> 256
    assert size(1, 32, 8, 1, 32768, 128) == 2654208 + 20736 + 256
    # B3 Hq16 Hk1 Lq2 Lk4096 Dv256: R = 32 rows, units16 = 6, units8 = 12; rows 96;
    # n = min(256, 1280 // 6 + 2 = 215, 256) = 215: 215*96*256*4 = 21135360,
    # 215*96*4 = 82560 -> 82688, 12*4 = 48 -> 256
    assert size(3, 16, 1, 2, 4096, 256) == 21135360 + 82688 + 256
    # one split at most (Lk < 32) or nothing to do: the 256-byte minimum, never empty
    assert size(2, 4, 4, 1, 31, 64) == 256
    assert size(0, 4, 4, 1, 300, 64) == 256
    cfg = _cfg(dtype="bfloat16", b=2, hq=4, hk=4, lq=1, lk=300, d=64)
    assert dispatch.cuda_decode_workspace_bytes(cfg) == size(2, 4, 4, 1, 300, 64)


@pytest.mark.parametrize("seq_major", [False, True])
def test_cuda_decode_lowering_adds_the_workspace_result(fake_h200, seq_major):
    """implementation="cuda" on a decode shape, exported for the cuda platform: the custom
    call `jax_sdpa_cuda_fwd` has a third result, a ui8 workspace of the helper's size, which
    the lowering drops (the function still returns out, or out and lse)."""
    from jax import export

    from jax_sdpa import dispatch, vjp
    from jax_sdpa.config import StaticParams

    s = jax.ShapeDtypeStruct
    b, hq, hk, lq, lk, d = 2, 16, 4, 2, 1000, 128
    if seq_major:
        q, kv = s((b, lq, hq, d), jnp.bfloat16), s((b, lk, hk, d), jnp.bfloat16)
    else:
        q, kv = s((b, hq, lq, d), jnp.bfloat16), s((b, hk, lk, d), jnp.bfloat16)
    lengths = s((b,), jnp.int32)
    params = StaticParams(scale=0.125, implementation="cuda", seq_major=seq_major)
    want_ws = dispatch.cuda_decode_workspace_bytes_for(b, hq, hk, lq, lk, d)
    checks = [export.DisabledSafetyCheck.custom_call("jax_sdpa_cuda_fwd")]

    def both(q, k, v, kvl):
        return vjp.attention(q, k, v, None, None, None, kvl, params)

    def out_only(q, k, v, kvl):
        return both(q, k, v, kvl)[0]

    out_shape = q.shape
    lse_shape = (b, hq, lq)
    for fn, want_outs in ((both, [out_shape, lse_shape]), (out_only, [out_shape])):
        exp = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(
            q, kv, kv, lengths)
        assert [a.shape for a in exp.out_avals] == want_outs
        calls = _custom_calls(exp.mlir_module())
        assert len(calls) == 1 and "@jax_sdpa_cuda_fwd(" in calls[0], calls
        results = calls[0].rsplit("->", 1)[1]
        types = re.findall(r"tensor<([^>]*)>", results)
        assert len(types) == 3, results
        assert types[0] == "x".join(map(str, out_shape)) + "xbf16"
        assert types[1] == "x".join(map(str, lse_shape)) + "xf32"
        assert types[2] == f"{want_ws}xui8"
