"""implementation="flash_attn3": the jax.nn entry's calls that flash_attn3_jax's `flash_mha`
serves go there (named, or by implementation=None where jax_sdpa/tuning.py's row says so).

On the CPU, a stand-in `flash_attn3_jax` module (a float32 einsum with flash_mha's signature
and bottom-right band) checks the routing, the argument mapping (scale, causal, window,
GQA) and the refusals, against jax.nn's xla; on an sm90 GPU with the real package, its
forward and gradients against jax.nn's xla."""

import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import api, dispatch, flash_attn3, tuning
from jax_sdpa.config import StaticParams

gpu = pytest.mark.gpu
BF16_TOL = 2e-2


def _stand_in_flash_mha(calls):
    """flash_mha's contract: [B, L, H, D], GQA, band (left, right) bottom-right aligned
    (-1 unbounded), is_causal forcing right = 0; computed as a float32 einsum."""

    def flash_mha(q, k, v, softmax_scale=None, is_causal=False, window_size=(-1, -1)):
        calls.append(dict(softmax_scale=softmax_scale, is_causal=is_causal,
                          window_size=tuple(window_size), q_shape=q.shape, k_shape=k.shape))
        lq, hq, lk, hk = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
        scale = 1 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
        kk = jnp.repeat(k.astype(jnp.float32), hq // hk, axis=2)
        vv = jnp.repeat(v.astype(jnp.float32), hq // hk, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk) * scale
        left, right = window_size
        if is_causal:
            right = 0
        i = jnp.arange(lq)[:, None] + (lk - lq)
        j = jnp.arange(lk)[None, :]
        keep = jnp.ones((lq, lk), bool)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        s = jnp.where(keep, s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vv).astype(q.dtype)

    return flash_mha


@pytest.fixture
def fake_fa3(monkeypatch):
    """A stand-in flash_attn3_jax on a pretend sm90 CUDA platform; yields its call log."""
    calls = []
    module = types.ModuleType(flash_attn3.PACKAGE)
    module.flash_mha = _stand_in_flash_mha(calls)
    monkeypatch.setitem(sys.modules, flash_attn3.PACKAGE, module)
    monkeypatch.setattr(api, "_trace_platform", lambda: "cuda")
    monkeypatch.setattr(dispatch, "gpu_capabilities", lambda: ((9, 0),))
    api._attend_flash_attn3.clear_cache()  # a trace holds the module it was made with
    yield calls
    api._attend_flash_attn3.clear_cache()


def _qkv(rng, b=2, lq=96, lk=96, hq=4, hk=2, d=128, dtype=jnp.bfloat16):
    q = rng.standard_normal((b, lq, hq, d), np.float32)
    k = rng.standard_normal((b, lk, hk, d), np.float32)
    v = rng.standard_normal((b, lk, hk, d), np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _close(got, want, tol=BF16_TOL):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


# (our keyword arguments, flash_mha's expected is_causal and window_size)
MAPPINGS = {
    "plain": (dict(), False, (-1, -1)),
    "scale": (dict(scale=0.3), False, (-1, -1)),
    "causal": (dict(is_causal=True), True, (-1, -1)),
    "window": (dict(local_window_size=(16, 4)), False, (16, 4)),
    "window-causal": (dict(local_window_size=(16, 4), is_causal=True), False, (16, 0)),
    "window-int": (dict(local_window_size=8), False, (8, 8)),
}


@pytest.mark.parametrize("name", list(MAPPINGS))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_named_maps_arguments_and_matches_jax_nn(fake_fa3, rng, name, heads):
    kwargs, causal, window = MAPPINGS[name]
    q, k, v = _qkv(rng, hq=heads[0], hk=heads[1])
    out = jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3", **kwargs)
    assert len(fake_fa3) == 1
    call = fake_fa3[0]
    want_scale = kwargs.get("scale", 1 / math.sqrt(128))
    assert call["softmax_scale"] == pytest.approx(want_scale)
    assert type(call["softmax_scale"]) is float  # flash_mha asserts a Python float
    assert (call["is_causal"], call["window_size"]) == (causal, window)
    assert call["k_shape"] == k.shape  # GQA goes as is: no repeated kv heads
    _close(out, jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs))


@pytest.mark.parametrize("kwargs", [dict(), dict(is_causal=True)], ids=["full", "causal"])
def test_named_gradients_match_jax_nn(fake_fa3, rng, kwargs):
    q, k, v = _qkv(rng, lq=64, lk=64)
    do = jnp.asarray(rng.standard_normal(q.shape, np.float32), q.dtype)

    def loss(impl):
        attend = (jax_sdpa.dot_product_attention if impl == "flash_attn3"
                  else jax.nn.dot_product_attention)
        return lambda q, k, v: jnp.sum(
            attend(q, k, v, implementation=impl, **kwargs).astype(jnp.float32)
            * do.astype(jnp.float32))

    got = jax.grad(loss("flash_attn3"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    assert fake_fa3, "the call did not reach flash_mha"
    for g, w in zip(got, want):
        _close(g, w, tol=4e-2)


def test_none_follows_the_tuning_row(fake_fa3, rng, monkeypatch):
    q, k, v = _qkv(rng, lq=128, lk=128)
    monkeypatch.setattr(tuning, "FLASH_ATTN3_MIN_LEN", 128)
    out = jax_sdpa.dot_product_attention(q, k, v, is_causal=True)
    assert len(fake_fa3) == 1
    _close(out, jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    monkeypatch.setattr(tuning, "FLASH_ATTN3_MIN_LEN", 129)  # shorter than the row
    jax_sdpa.dot_product_attention(q, k, v, is_causal=True)
    monkeypatch.setattr(tuning, "FLASH_ATTN3_MIN_LEN", None)  # the row switched off
    jax_sdpa.dot_product_attention(q, k, v)
    assert len(fake_fa3) == 1


def _jax_nn_config(lq=4096, lk=4096, hq=32, hk=8, d=128, dtype=jnp.bfloat16, **kw):
    q = jax.ShapeDtypeStruct((1, lq, hq, d), dtype)
    k = jax.ShapeDtypeStruct((1, lk, hk, d), dtype)
    params = StaticParams(scale=0.1, seq_major=True, **kw)
    return api._config(q, k, k, None, None, None, None, params)


def test_none_picks_it_only_in_the_measured_region(fake_fa3):
    row = tuning.ROWS["FLASH_ATTN3_MIN_LEN"]
    assert row.value == tuning.FLASH_ATTN3_MIN_LEN and row.results and row.reason

    def routes(cfg, platform="cuda", needs_lse=False):
        return dispatch.flash_attn3_routes(cfg, platform, None, needs_lse)

    n = row.value
    assert routes(_jax_nn_config(lq=n, lk=n))
    assert routes(_jax_nn_config(lq=n, lk=n, window_right=0))
    assert not routes(_jax_nn_config(lq=n - 1, lk=n))
    assert not routes(_jax_nn_config(lq=n, lk=n - 1))
    assert not routes(_jax_nn_config(lq=1, lk=4 * n))  # decode: never
    assert not routes(_jax_nn_config(lq=n, lk=n, dtype=jnp.float32))
    assert not routes(_jax_nn_config(lq=n, lk=n, d=64))
    assert not routes(_jax_nn_config(lq=n, lk=n), platform="cpu")
    assert not routes(_jax_nn_config(lq=n, lk=n), needs_lse=True)
    # another named implementation never goes there
    assert not dispatch.flash_attn3_routes(_jax_nn_config(lq=n, lk=n), "cuda", "cudnn", False)


def test_none_falls_back_where_it_does_not_serve(fake_fa3, rng, monkeypatch):
    monkeypatch.setattr(tuning, "FLASH_ATTN3_MIN_LEN", 1)
    q, k, v = _qkv(rng, lq=32, lk=48)
    mask = jnp.asarray(rng.random((1, 1, 32, 48)) > 0.3)
    # Lq != Lk with causal: top-left vs flash_mha's bottom-right
    _close(jax_sdpa.dot_product_attention(q, k, v, is_causal=True),
           jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
    _close(jax_sdpa.dot_product_attention(q, k, v, mask=mask),
           jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
    out, lse = jax_sdpa.dot_product_attention(q, k, v, return_residual=True)
    assert lse.shape == (2, 32, 4)
    assert fake_fa3 == []


REFUSALS = {
    "mask": (dict(mask=jnp.ones((1, 1, 64, 64), bool)), r"takes no mask or bias"),
    "bias": (dict(bias=jnp.zeros((1, 1, 64, 64), jnp.bfloat16)), r"mask or bias"),
    "sinks": (dict(sinks=jnp.zeros((4,))), r"takes no sinks"),
    "q-lengths": (dict(query_seq_lengths=jnp.array([64, 3], jnp.int32)), r"query lengths"),
    "kv-lengths": (dict(key_value_seq_lengths=jnp.array([64, 3], jnp.int32)),
                   r"key/value lengths"),
    "segments": (dict(q_segment_ids=jnp.zeros((2, 64), jnp.int32)), r"segment ids"),
    "soft-cap": (dict(logits_soft_cap=30.0), r"logits_soft_cap"),
    "residual": (dict(return_residual=True), r"return_residual=True needs the lse"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_named_refuses_what_flash_mha_does_not_take(fake_fa3, rng, name):
    kwargs, pattern = REFUSALS[name]
    q, k, v = _qkv(rng, lq=64, lk=64)
    with pytest.raises(NotImplementedError, match=r"implementation='flash_attn3' can't serve "
                                                   r"this call: .*" + pattern):
        jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3", **kwargs)
    assert fake_fa3 == []


@pytest.mark.parametrize("shapes, kwargs, pattern", [
    (dict(d=64), dict(), r"head dim 128 only.*D = 64"),
    (dict(dtype=jnp.float32), dict(), r"float16 or bfloat16, got float32"),
    (dict(lq=32, lk=64), dict(is_causal=True), r"only when Lq == Lk \(Lq = 32, Lk = 64\)"),
    (dict(lq=32, lk=64), dict(local_window_size=(8, 8)), r"only when Lq == Lk"),
])
def test_named_refuses_shapes(fake_fa3, rng, shapes, kwargs, pattern):
    q, k, v = _qkv(rng, **shapes)
    with pytest.raises(NotImplementedError, match=pattern):
        jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3", **kwargs)


def test_named_without_causal_serves_lq_ne_lk(fake_fa3, rng):
    q, k, v = _qkv(rng, lq=32, lk=80)
    _close(jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3"),
           jax.nn.dot_product_attention(q, k, v, implementation="xla"))
    assert len(fake_fa3) == 1


def test_named_refuses_other_gpus_and_platforms(fake_fa3, rng, monkeypatch):
    q, k, v = _qkv(rng, lq=64, lk=64)
    monkeypatch.setattr(dispatch, "gpu_capabilities", lambda: ((9, 0), (8, 0)))
    with pytest.raises(NotImplementedError, match=r"compute capability 9.0 .*9.0, 8.0"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3")
    monkeypatch.setattr(api, "_trace_platform", lambda: "cpu")
    with pytest.raises(NotImplementedError, match=r"needs a CUDA GPU.*platform 'cpu'"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3")


def test_missing_package_says_how_to_install(fake_fa3, rng, monkeypatch):
    monkeypatch.setitem(sys.modules, flash_attn3.PACKAGE, None)  # import raises ImportError
    assert not flash_attn3.importable()
    q, k, v = _qkv(rng, lq=64, lk=64)
    with pytest.raises(NotImplementedError, match=r"pip install flash-attn3-jax"):
        jax_sdpa.dot_product_attention(q, k, v, implementation="flash_attn3")
    monkeypatch.setattr(tuning, "FLASH_ATTN3_MIN_LEN", 1)
    _close(jax_sdpa.dot_product_attention(q, k, v),  # None never fails for want of it
           jax.nn.dot_product_attention(q, k, v, implementation="xla"))


def test_mlx_entry_and_explain_name_the_layout(fake_fa3, rng):
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in _qkv(rng, lq=64, lk=64))
    with pytest.raises(NotImplementedError, match=r"\[B, H, L, D\] would need transposes"):
        jax_sdpa.scaled_dot_product_attention(q, k, v, implementation="flash_attn3")
    e = jax_sdpa.explain(q, k, v, platform="cuda")
    ok, reason = e.verdicts["flash_attn3"]
    assert not ok and "dot_product_attention" in reason and e.chosen != "flash_attn3"
    assert "flash_attn3" in str(e)


def test_explain_without_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, flash_attn3.PACKAGE, None)
    q = jnp.zeros((1, 4, 8, 128), jnp.bfloat16)
    ok, reason = jax_sdpa.explain(q, q, q, platform="cuda").verdicts["flash_attn3"]
    assert not ok and "pip install flash-attn3-jax" in reason
    ok, reason = jax_sdpa.explain(q, q, q, platform="cpu").verdicts["flash_attn3"]
    assert not ok and "CUDA GPU" in reason


def test_no_lowering_of_its_own(monkeypatch):
    """It is no primitive of ours: a lowering never emits it, even where it serves."""
    monkeypatch.setattr(flash_attn3, "serves", lambda *args, **kwargs: (True, "serves"))
    with pytest.raises(NotImplementedError, match=r"runs only from "
                                                   r"jax_sdpa.dot_product_attention"):
        dispatch.plan(_jax_nn_config(lq=64, lk=64), "cuda", "fwd", "flash_attn3")


def test_paged_calls_refuse_it():
    ok, reason = dispatch._paged_verdict("flash_attn3", _jax_nn_config(lq=1, lk=64), "cuda")
    assert not ok and "paged" in reason


# ---- the real package on an sm90 GPU -----------------------------------------------

def _real_fa3_here():
    if jax.default_backend() != "gpu" or not flash_attn3.importable():
        return False
    caps = dispatch.gpu_capabilities()
    return bool(caps) and all(cc == (9, 0) for cc in caps)


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)], ids=["MHA", "GQA"])
def test_real_flash_mha_forward_and_gradients(rng, causal, heads):
    if not _real_fa3_here():
        pytest.skip("needs flash_attn3_jax (pip install flash-attn3-jax) on sm90 GPUs")
    q, k, v = _qkv(rng, b=2, lq=1024, lk=1024, hq=heads[0], hk=heads[1])
    do = jnp.asarray(rng.standard_normal(q.shape, np.float32), q.dtype)

    def run(attend, impl):
        def loss(q, k, v):
            out = attend(q, k, v, is_causal=causal, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (dq, dk, dv), out = run(jax_sdpa.dot_product_attention, "flash_attn3")
    (wq, wk, wv), want = run(jax.nn.dot_product_attention, "xla")
    hlo = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=causal, implementation="flash_attn3")).lower(q, k, v).as_text()
    assert "jax_sdpa_" not in hlo  # flash_mha's own kernels, none of ours
    _close(out, want)
    for g, w in zip((dq, dk, dv), (wq, wk, wv)):
        scale = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
        _close(g / scale, w / scale, tol=BF16_TOL)
