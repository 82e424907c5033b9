"""cuDNN-specific GPU tests (run on the H200 machine; skipped without a GPU).

Two levels:
- the FFI targets jax_sdpa_cudnn_fwd / _bwd called directly through
  `jax.ffi.ffi_call` with the kernel contract's operands (docs/ffi_contract.md),
  against a float32 HIGHEST-precision reference computed on the GPU from the
  same (rounded) inputs: every mask form, lengths, windows, sinks, GQA, Dv != D,
  both layouts, fp16/bf16, forward and backward;
- the public API with implementation="cudnn" (against jax.nn's own cuDNN and
  xla paths).

fp16/bf16 tolerance (DESIGN §4): error no more than 2x that of the same-dtype
XLA-style computation plus a small floor. Outputs are NaN-poisoned by the
handler before the kernel runs (JAX_SDPA_POISON_OUTPUTS, set in conftest).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gpu = pytest.mark.gpu

HIGHEST = jax.lax.Precision.HIGHEST
FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2}
DT = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _cudnn_built():
    try:
        if jax.default_backend() != "gpu":
            return False
        from jax_sdpa import _ext
        return _ext.has_backend("cudnn")
    except Exception:
        return False


@pytest.fixture(autouse=True)
def _needs_cudnn(request):
    if request.node.get_closest_marker("gpu") and not _cudnn_built():
        pytest.skip("the cuDNN backend is not built or there is no GPU")


@pytest.fixture
def key(request):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[{request.node.name}] seed = {seed}")
    return jax.random.PRNGKey(seed)


# ---------------------------------------------------------------------------
# direct FFI calls (the kernel contract)

def _contract(scale, wl, wr, br, seq_major, mask, sinks, ql, kvl):
    from jax_sdpa.primitives import ffi_call_args
    return ffi_call_args(scale=scale, window_left=wl, window_right=wr, bottom_right=br,
                         seq_major=seq_major, mask=mask, sinks=sinks, q_lengths=ql,
                         kv_lengths=kvl)


def ffi_fwd(q, k, v, mask=None, sinks=None, ql=None, kvl=None, *, scale, wl=-1, wr=-1,
            br=False, seq_major=False):
    b = q.shape[0]
    hq, lq = (q.shape[2], q.shape[1]) if seq_major else (q.shape[1], q.shape[2])
    out = jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)
    call = jax.ffi.ffi_call("jax_sdpa_cudnn_fwd", (out, lse))
    operands, attrs = _contract(scale, wl, wr, br, seq_major, mask, sinks, ql, kvl)
    return call(q, k, v, *operands, **attrs)


def ffi_bwd(q, k, v, out, lse, dout, mask=None, sinks=None, ql=None, kvl=None, *, scale,
            wl=-1, wr=-1, br=False, seq_major=False):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call("jax_sdpa_cudnn_bwd", shapes)
    operands, attrs = _contract(scale, wl, wr, br, seq_major, mask, sinks, ql, kvl)
    return call(q, k, v, out, lse, dout, *operands, **attrs)


# ---------------------------------------------------------------------------
# reference on the GPU: the contract in jnp, [B, H, L, D], differentiable

def reference(q, k, v, mask=None, sinks=None, ql=None, kvl=None, *, scale, wl=-1, wr=-1,
              br=False, low=None):
    """(out, lse). low=None: float32 HIGHEST throughout. low=dtype: XLA-style in that
    dtype (logits and P.V in `low`, softmax in float32), the DESIGN §4 yardstick."""
    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = hq // hk
    k = jnp.repeat(k, g, axis=1)
    v = jnp.repeat(v, g, axis=1)
    if low is None:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        s = jnp.einsum("bhid,bhjd->bhij", q, k, precision=HIGHEST) * scale
    else:
        q, k, v = (x.astype(low) for x in (q, k, v))
        s = (jnp.einsum("bhid,bhjd->bhij", q, k) * jnp.asarray(scale, low)).astype(jnp.float32)
    qlen = jnp.full((b,), lq) if ql is None else jnp.clip(ql, 0, lq)
    kvlen = jnp.full((b,), lk) if kvl is None else jnp.clip(kvl, 0, lk)
    i = jnp.arange(lq)[None, None, :, None]
    j = jnp.arange(lk)[None, None, None, :]
    qlen4, kvlen4 = qlen[:, None, None, None], kvlen[:, None, None, None]
    off = (kvlen4 - qlen4) if br else 0
    d = j - (i + off)
    vis = (i < qlen4) & (j < kvlen4)
    if wl >= 0:
        vis &= d >= -wl
    if wr >= 0:
        vis &= d <= wr
    if mask is not None:
        if mask.dtype == jnp.bool_:
            vis &= mask
        else:
            add = jnp.broadcast_to(mask.astype(jnp.float32), s.shape)
            vis &= jnp.isfinite(add)
            s = s + jnp.where(jnp.isfinite(add), add, 0.0)
    vis = jnp.broadcast_to(vis, s.shape)
    s_safe = jnp.where(vis, s, -1e30)
    m = jnp.max(s_safe, axis=-1, keepdims=True)
    sink = None
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.reshape((-1, hq))[:, :, None, None], (b, hq, 1, 1))
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(m)
    e = jnp.where(vis, jnp.exp(s_safe - m), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    if sink is not None:
        total = total + jnp.exp(sink - m)
    has = total > 0
    lse = jnp.where(has, jnp.log(jnp.where(has, total, 1.0)) + m, -jnp.inf)
    p = e / jnp.where(has, total, 1.0)
    if low is None:
        out = jnp.einsum("bhij,bhjd->bhid", p, v, precision=HIGHEST)
    else:
        out = jnp.einsum("bhij,bhjd->bhid", p.astype(low), v).astype(jnp.float32)
    row_ok = jnp.arange(lq)[None, None, :] < qlen[:, None, None]
    lse = jnp.where(row_ok, lse[..., 0], -jnp.inf)
    out = jnp.where(row_ok[..., None], out, 0.0)
    return out, lse


def rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-6))


def check(got, want, low_ref, dtype, what):
    got32 = np.asarray(jnp.asarray(got, jnp.float32))
    assert not np.isnan(got32).any(), f"{what}: NaN (unwritten or bad) elements"
    err = rel_err(got32, want)
    bound = 2 * rel_err(low_ref, want) + FLOOR[dtype]
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g} ({dtype})"
    return err


# ---------------------------------------------------------------------------
# cases

CASES = {
    "plain": dict(b=2, hq=4, hk=4, lq=128, lk=128, d=64),
    "gqa_odd_dv": dict(b=2, hq=8, hk=2, lq=127, lk=129, d=128, dv=64),
    "causal_top_left": dict(b=2, hq=4, hk=4, lq=129, lk=129, d=64, wr=0),
    "causal_br_short_q": dict(b=2, hq=4, hk=2, lq=37, lk=300, d=64, wr=0, br=True),
    "causal_br_long_q": dict(b=2, hq=4, hk=2, lq=200, lk=77, d=64, wr=0, br=True),
    "window_br": dict(b=1, hq=4, hk=4, lq=256, lk=256, d=128, wl=16, wr=0, br=True),
    "window_tl_both": dict(b=2, hq=4, hk=4, lq=100, lk=160, d=64, wl=8, wr=4),
    "window_left_only": dict(b=1, hq=2, hk=2, lq=96, lk=96, d=64, wl=32),
    "lengths_causal": dict(b=3, hq=4, hk=2, lq=64, lk=200, d=64, wr=0, br=True, ql=True, kvl=True),
    "lengths_window": dict(b=3, hq=4, hk=4, lq=80, lk=80, d=64, wl=20, wr=0, br=True, ql=True,
                           kvl=True),
    "kv_lengths_only": dict(b=3, hq=4, hk=4, lq=33, lk=190, d=64, kvl=True),
    "bias_per_head": dict(b=2, hq=4, hk=4, lq=64, lk=96, d=64, mask="add", mshape=(1, "h", "q", "k")),
    "bias_f32_per_batch": dict(b=2, hq=4, hk=4, lq=64, lk=96, d=64, mask="add32",
                               mshape=("b", 1, "q", "k")),
    "bias_key_broadcast_inf": dict(b=2, hq=4, hk=4, lq=64, lk=96, d=64, mask="addinf",
                                   mshape=(1, 1, 1, "k")),
    "bool_mask_empty_rows": dict(b=2, hq=4, hk=2, lq=64, lk=80, d=64, mask="bool",
                                 mshape=("b", 1, "q", "k")),
    "bool_mask_causal": dict(b=2, hq=4, hk=4, lq=64, lk=64, d=64, mask="bool",
                             mshape=(1, "h", "q", "k"), wr=0),
    "sinks_causal_lengths": dict(b=3, hq=4, hk=2, lq=48, lk=96, d=64, sinks=1, wr=0, br=True,
                                 ql=True, kvl=True),
    "decode_half_cache": dict(b=4, hq=32, hk=8, lq=1, lk=1024, d=128, wr=0, br=True, kvl="half"),
    "d72": dict(b=1, hq=4, hk=4, lq=100, lk=100, d=72, wr=0),
    "d256": dict(b=1, hq=2, hk=2, lq=200, lk=200, d=256),
    "d192_dv128": dict(b=1, hq=2, hk=1, lq=128, lk=128, d=192, dv=128, wr=0),
}

BWD_CASES = ["plain", "gqa_odd_dv", "causal_br_short_q", "causal_top_left", "window_tl_both",
             "lengths_causal", "kv_lengths_only", "bias_per_head", "bool_mask_empty_rows",
             "sinks_causal_lengths", "d256", "decode_half_cache", "window_left_only",
             "d192_dv128"]


def make_inputs(c, dtype, key):
    ks = jax.random.split(key, 8)
    b, hq, hk, lq, lk, d = c["b"], c["hq"], c["hk"], c["lq"], c["lk"], c["d"]
    dv = c.get("dv", d)
    q = jax.random.normal(ks[0], (b, hq, lq, d), jnp.float32).astype(DT[dtype])
    k = jax.random.normal(ks[1], (b, hk, lk, d), jnp.float32).astype(DT[dtype])
    v = jax.random.normal(ks[2], (b, hk, lk, dv), jnp.float32).astype(DT[dtype])
    mask = None
    if "mask" in c:
        full = {"b": b, "h": hq, "q": lq, "k": lk}
        shape = tuple(full[s] if isinstance(s, str) else s for s in c["mshape"])
        if c["mask"] == "bool":
            mask = jax.random.uniform(ks[3], shape) < 0.75
            mask = mask.at[..., 3, :].set(False) if shape[2] > 3 else mask  # an empty row
        else:
            mask = jax.random.normal(ks[3], shape, jnp.float32)
            if c["mask"] == "addinf":
                mask = jnp.where(jax.random.uniform(ks[4], shape) < 0.3, -jnp.inf, mask)
            if c["mask"] == "add":
                mask = mask.astype(DT[dtype])
    sinks = None
    if c.get("sinks"):
        sinks = jax.random.normal(ks[5], (1 if c["sinks"] == 1 else b, hq), jnp.float32)
    ql = kvl = None
    if c.get("ql"):
        ql = jax.random.randint(ks[6], (b,), 0, lq + 1).at[0].set(lq).at[1].set(0)
    if c.get("kvl") == "half":
        kvl = jax.random.randint(ks[7], (b,), lk // 4, lk // 2 + 1)
    elif c.get("kvl"):
        kvl = jax.random.randint(ks[7], (b,), 0, lk + 1).at[0].set(lk)
    scale = 1.0 / np.sqrt(d)
    flags = dict(scale=scale, wl=c.get("wl", -1), wr=c.get("wr", -1), br=c.get("br", False))
    return (q, k, v, mask, sinks, ql, kvl), flags


def to_layout(x, seq_major):
    return jnp.swapaxes(x, 1, 2) if seq_major else x


VARIANTS = [("bfloat16", False), ("float16", True)]  # (dtype, seq_major)

# Features whose support depends on the installed cuDNN; a refusal must come as our
# readable error, and is reported (xfail) with cuDNN's own reason.
DEPENDS_ON_CUDNN = {"window_left_only", "d192_dv128"}


def run_case(name, fn, *args):
    try:
        return jax.block_until_ready(fn(*args))
    except Exception as e:  # noqa: BLE001
        if name in DEPENDS_ON_CUDNN and "can't serve this attention call" in str(e):
            pytest.xfail(f"cuDNN refuses {name}: {str(e)[:600]}")
        raise


@gpu
@pytest.mark.parametrize("dtype,seq_major", VARIANTS, ids=["bf16-BHLD", "f16-BLHD"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_contract(name, dtype, seq_major, key):
    (q, k, v, mask, sinks, ql, kvl), flags = make_inputs(CASES[name], dtype, key)
    lay = lambda x: to_layout(x, seq_major)  # noqa: E731
    fn = jax.jit(lambda *a: ffi_fwd(*a, **flags, seq_major=seq_major))
    out, lse = run_case(name, fn, lay(q), lay(k), lay(v), mask, sinks, ql, kvl)
    out = to_layout(out, seq_major)
    want, want_lse = reference(q, k, v, mask, sinks, ql, kvl, **flags)
    low, _ = reference(q, k, v, mask, sinks, ql, kvl, **flags, low=DT[dtype])
    check(out, want, low, dtype, "out")
    # lse: -inf exactly where the reference has nothing; close elsewhere.
    lse, want_lse = np.asarray(lse), np.asarray(want_lse)
    assert not np.isnan(lse).any(), "lse has NaN"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    if fin.any():
        tol = 2e-2 if dtype == "bfloat16" else 5e-3
        assert np.max(np.abs(lse[fin] - want_lse[fin])) <= tol * max(1.0, np.max(np.abs(want_lse[fin])))
    # Rows with nothing to attend are exactly zero.
    empty = ~fin
    if empty.any():
        assert np.all(np.asarray(out, np.float32)[empty] == 0)


@gpu
@pytest.mark.parametrize("dtype,seq_major", VARIANTS, ids=["bf16-BHLD", "f16-BLHD"])
@pytest.mark.parametrize("name", BWD_CASES)
def test_backward_contract(name, dtype, seq_major, key):
    (q, k, v, mask, sinks, ql, kvl), flags = make_inputs(CASES[name], dtype, key)
    dout = jax.random.normal(jax.random.fold_in(key, 99), q.shape[:3] + (v.shape[3],),
                             jnp.float32).astype(DT[dtype])
    lay = lambda x: to_layout(x, seq_major)  # noqa: E731

    @jax.jit
    def ours(q, k, v, dout, mask, sinks, ql, kvl):
        out, lse = ffi_fwd(q, k, v, mask, sinks, ql, kvl, **flags, seq_major=seq_major)
        return ffi_bwd(q, k, v, out, lse, dout, mask, sinks, ql, kvl, **flags,
                       seq_major=seq_major)

    got = run_case(name, ours, lay(q), lay(k), lay(v), lay(dout), mask, sinks, ql, kvl)
    got = [to_layout(g, seq_major) for g in got]

    def grads(low):
        f = lambda q, k, v: reference(q, k, v, mask, sinks, ql, kvl, **flags, low=low)[0]  # noqa: E731
        if low is None:
            args = tuple(x.astype(jnp.float32) for x in (q, k, v))
        else:
            args = (q, k, v)
        _, vjp = jax.vjp(f, *args)
        return vjp(dout.astype(jnp.float32))

    want = jax.jit(lambda: grads(None))()
    low = jax.jit(lambda: grads(DT[dtype]))()
    for nm, g, w, lo in zip(("dq", "dk", "dv"), got, want, low):
        check(g, w, lo, dtype, nm)
    if ql is not None:  # padded query rows: dq exactly 0
        pad = np.arange(q.shape[2])[None, :] >= np.asarray(ql)[:, None]
        assert np.all(np.asarray(got[0], np.float32).transpose(0, 2, 1, 3)[pad] == 0)
    if kvl is not None:  # keys past the cache length: dk, dv exactly 0
        pad = np.arange(k.shape[2])[None, :] >= np.asarray(kvl)[:, None]
        for g in got[1:]:
            assert np.all(np.asarray(g, np.float32).transpose(0, 2, 1, 3)[pad] == 0)


@gpu
def test_float32_is_refused_with_a_reason(key):
    q = jax.random.normal(key, (1, 2, 64, 64), jnp.float32)
    with pytest.raises(Exception, match="float16 or bfloat16"):
        jax.block_until_ready(jax.jit(lambda q: ffi_fwd(q, q, q, scale=0.125))(q))


@gpu
def test_unsupported_head_dim_maps_to_a_readable_error(key):
    # cuDNN wants head dims that are multiples of 8; its support check's message
    # must come back readable. (D = 512 is *not* refused by cuDNN 9.19 on the H200.)
    q = jax.random.normal(key, (1, 2, 64, 36), jnp.float32).astype(jnp.bfloat16)
    with pytest.raises(Exception, match="can't serve this attention call"):
        jax.block_until_ready(jax.jit(lambda q: ffi_fwd(q, q, q, scale=0.1))(q))


@gpu
@pytest.mark.parametrize("lq", [1, 256])
def test_head_dim_512_status(lq, key):
    """cuDNN 9.19 built a D = 512 graph on the H200 without complaint; dispatch still
    refuses D > 256 until this shows the numbers are right (forward and backward).
    Refused or wrong -> xfail with the reason; right -> pass (then lift the limit)."""
    c = dict(b=1, hq=8, hk=2, lq=lq, lk=512, d=512, wr=0, br=True)
    (q, k, v, *_), flags = make_inputs(c, "bfloat16", key)
    dout = jax.random.normal(jax.random.fold_in(key, 5), q.shape, jnp.float32).astype(q.dtype)

    @jax.jit
    def ours(q, k, v, dout):
        out, lse = ffi_fwd(q, k, v, **flags)
        return (out,) + tuple(ffi_bwd(q, k, v, out, lse, dout, **flags))

    try:
        got = jax.block_until_ready(ours(q, k, v, dout))
    except Exception as e:  # noqa: BLE001
        pytest.xfail(f"cuDNN refuses D=512: {str(e)[:400]}")
    f = lambda q, k, v, low: reference(q, k, v, **flags, low=low)[0]  # noqa: E731
    want_out = f(q, k, v, None)
    low_out = f(q, k, v, jnp.bfloat16)
    _, vjp = jax.vjp(lambda *a: f(*a, None), *(x.astype(jnp.float32) for x in (q, k, v)))
    want = (want_out,) + tuple(vjp(dout.astype(jnp.float32)))
    _, vjp_low = jax.vjp(lambda *a: f(*a, jnp.bfloat16), q, k, v)
    low = (low_out,) + tuple(vjp_low(dout))
    try:
        for nm, g, w, lo in zip(("out", "dq", "dk", "dv"), got, want, low):
            check(g, w, lo, "bfloat16", nm)
    except AssertionError as e:
        pytest.xfail(f"cuDNN D=512 numbers are off: {e}")


@gpu
def test_bottom_right_band_with_bias_is_refused_readably(key):
    # Seen on cuDNN 9.19: "Bottom right causal mask is only supported with
    # is_bias=False" (forward and backward); dispatch refuses it beforehand.
    (q, k, v, mask, *_), flags = make_inputs(
        dict(b=2, hq=4, hk=4, lq=64, lk=128, d=64, mask="add", mshape=(1, "h", "q", "k"),
             wr=0, br=True), "bfloat16", key)
    with pytest.raises(Exception, match="can't serve this attention call"):
        jax.block_until_ready(jax.jit(lambda *a: ffi_fwd(*a, **flags))(q, k, v, mask))


@gpu
def test_per_batch_sinks_are_refused(key):
    # cuDNN 9.19 ran [B, Hq, 1, 1] sinks but gave wrong outputs: refused.
    (q, k, v, *_), flags = make_inputs(dict(b=2, hq=4, hk=4, lq=64, lk=64, d=64), "bfloat16",
                                       key)
    sinks = jax.random.normal(key, (2, 4), jnp.float32)
    with pytest.raises(Exception, match="per-batch sinks"):
        jax.block_until_ready(jax.jit(lambda q, k, v, s: ffi_fwd(q, k, v, None, s, **flags))(
            q, k, v, sinks))


def test_dispatch_rule_matches_the_graphs(monkeypatch, cuda_module):
    """CPU: the rule in jax_sdpa/dispatch.py against what the H200 showed (cuDNN 9.19)."""
    from jax_sdpa import _ext, dispatch
    from jax_sdpa.config import Config, StaticParams

    monkeypatch.setattr(_ext, "has_backend", lambda name: True)
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, (9, 0)))

    def cfg(dtype="bfloat16", d=128, lq=256, lk=256, mask=None, br=False, wr=-1, ql=False,
            sinks=False):
        return Config.from_shapes((2, 8, lq, d), (2, 2, lk, d), (2, 2, lk, d), np.dtype(dtype),
                                  None if mask is None else (1, 8, lq, lk), mask, sinks, ql,
                                  False, StaticParams(scale=0.1, window_right=wr,
                                                      bottom_right=br))

    ok = lambda c, direction="fwd": dispatch.supports_cudnn(c, direction, "cuda")[0]  # noqa: E731
    assert ok(cfg())
    assert ok(cfg(dtype="float16", d=72, lq=100, lk=300, wr=0, br=True), "bwd")
    assert ok(cfg(mask=np.dtype(bool), wr=0, br=True))  # square: alignment irrelevant
    assert ok(cfg(d=256), "bwd")
    assert ok(cfg(sinks=True, ql=True, wr=0, br=True))
    assert not ok(cfg(dtype="float32"))
    assert not ok(cfg(d=264))
    assert not ok(cfg(d=36))
    assert not ok(cfg(mask=np.dtype("bfloat16"), wr=0, br=True, lq=64))
    assert not ok(cfg(mask=np.dtype(bool), wr=0, br=True, ql=True), "bwd")
    assert not dispatch.supports_cudnn(cfg(), "fwd", "cpu")[0]
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91200, (9, 0)))
    assert not ok(cfg(sinks=True))  # sinks need cuDNN 9.13
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, (7, 5)))
    assert not ok(cfg())  # pre-Ampere


def test_cuda_module_when_built():
    """CPU (CI builds the CUDA extension without a GPU): the module loads and says
    what it was built with. JAX_SDPA_EXPECT_CUDA=1 makes a missing build a failure."""
    from jax_sdpa import _ext
    m = _ext.module("_sdpa_cuda")
    if m is None:
        why = _ext.status().get("_sdpa_cuda", "?")
        if os.environ.get("JAX_SDPA_EXPECT_CUDA") == "1":
            pytest.fail("the CUDA extension was expected but is " + why)
        pytest.skip("the CUDA extension is not built here: " + why)
    assert {"jax_sdpa_cudnn_fwd", "jax_sdpa_cudnn_bwd"} <= set(m.registrations())
    # implementation="cuda" routes to these (jax_sdpa/dispatch.py: ffi_target)
    assert {"jax_sdpa_cuda_fwd", "jax_sdpa_cuda_flash_fwd",
            "jax_sdpa_cuda_flash_bwd"} <= set(m.registrations())
    assert m.cudnn_compiled_version() >= 90000
    assert m.cudnn_frontend_version() >= 11600
    assert m.graph_cache_capacity() >= 0
    v = m.cudnn_version()  # the wheel's libcudnn answers without a GPU too
    assert v == -1 or v >= 90000


@gpu
def test_graph_cache_reuses_graphs(key):
    from jax_sdpa import _ext
    m = _ext.module("_sdpa_cuda")
    (q, k, v, *_), flags = make_inputs(dict(b=1, hq=2, hk=2, lq=72, lk=88, d=64), "bfloat16", key)
    f = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, **flags))
    jax.block_until_ready(f(q, k, v))
    n = m.graph_cache_size()
    assert 1 <= n <= m.graph_cache_capacity()
    jax.block_until_ready(f(q + 1, k, v))  # same shapes: no new graph
    assert m.graph_cache_size() == n
    jax.block_until_ready(f(q[:, :, :40], k, v))  # new shape: one more
    assert m.graph_cache_size() == min(n + 1, m.graph_cache_capacity())


# ---------------------------------------------------------------------------
# the public API with implementation="cudnn"

def _btnh(x):
    return jnp.swapaxes(x, 1, 2)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_api_matches_jax_nn_cudnn(causal, dtype, key):
    import jax_sdpa
    (q, k, v, *_), _ = make_inputs(dict(b=2, hq=8, hk=2, lq=256, lk=256, d=128), dtype, key)
    ours = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal" if causal else None, implementation="cudnn"))(q, k, v)
    ours_btnh = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))(_btnh(q), _btnh(k), _btnh(v))
    theirs = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))(_btnh(q), _btnh(k), _btnh(v))
    assert rel_err(_btnh(ours), theirs) <= 1e-2
    assert rel_err(ours_btnh, theirs) <= 1e-2


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_api_grads_vs_float32_reference(dtype, key):
    import jax_sdpa
    (q, k, v, *_), flags = make_inputs(dict(b=2, hq=8, hk=4, lq=100, lk=160, d=64), dtype, key)
    w = jax.random.normal(jax.random.fold_in(key, 7), (2, 8, 100, 64), jnp.float32)

    def loss(impl):
        def f(q, k, v):
            o = jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                      implementation=impl)
            return jnp.sum(o.astype(jnp.float32) * w)
        return f

    got = jax.jit(jax.grad(loss("cudnn"), argnums=(0, 1, 2)))(q, k, v)
    f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(*f32)
    low = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for nm, g, wnt, lo in zip(("dq", "dk", "dv"), got, want, low):
        check(g, wnt, lo, dtype, nm)


@gpu
def test_api_decode_half_filled_cache(key):
    import jax_sdpa
    c = dict(b=4, hq=32, hk=8, lq=1, lk=2048, d=128)
    (q, k, v, *_), flags = make_inputs(c, "bfloat16", key)
    kvl = jnp.array([1024, 1, 2047, 700], jnp.int32)

    @jax.jit
    def step(q, k, v, kvl):
        return jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                     key_value_seq_lengths=kvl,
                                                     implementation="cudnn")

    got = step(q, k, v, kvl)
    want, _ = reference(q, k, v, kvl=kvl, scale=flags["scale"], wr=0, br=True)
    low, _ = reference(q, k, v, kvl=kvl, scale=flags["scale"], wr=0, br=True,
                       low=jnp.bfloat16)
    check(got, want, low, "bfloat16", "decode out")


@gpu
def test_api_vmap_and_jax_nn_features(key):
    import jax_sdpa
    (q, k, v, *_), _ = make_inputs(dict(b=2, hq=4, hk=4, lq=96, lk=96, d=64), "bfloat16", key)
    bias = jax.random.normal(jax.random.fold_in(key, 3), (1, 4, 96, 96), jnp.bfloat16)
    ql = jnp.array([96, 50], jnp.int32)
    kvl = jnp.array([96, 70], jnp.int32)
    kw = dict(bias=bias, query_seq_lengths=ql, key_value_seq_lengths=kvl)
    args = (_btnh(q), _btnh(k), _btnh(v))
    ours = jax.jit(lambda q, k, v: jax_sdpa.dot_product_attention(
        q, k, v, **kw, implementation="cudnn"))(*args)
    f32 = tuple(x.astype(jnp.float32) for x in args)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, bias=bias.astype(jnp.float32), query_seq_lengths=ql,
            key_value_seq_lengths=kvl, implementation="xla"))(*f32)
    low = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, **kw, implementation="xla"))(*args)
    check(ours, want, low, "bfloat16", "jax.nn-contract out")
    # vmap over an extra leading axis folds into the batch.
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    vm = jax.jit(jax.vmap(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cudnn")))(*stacked)
    single = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cudnn"))(q * 0.5, k * 0.5, v * 0.5)
    assert rel_err(vm[1], single) <= 1e-2


@gpu
def test_explain_and_refusals(key):
    import jax_sdpa
    q = jax.random.normal(key, (1, 4, 64, 64), jnp.float32)
    with pytest.raises(NotImplementedError, match="float16 or bfloat16"):
        jax_sdpa.scaled_dot_product_attention(q, q, q, implementation="cudnn")
    qb = q.astype(jnp.bfloat16)
    ex = jax_sdpa.explain(qb, qb, qb, mask="causal")
    assert ex.chosen in ("cudnn", "cuda"), str(ex)


# ---------------------------------------------------------------------------
# NaN semantics around cuDNN (docs/ffi_contract.md "NaN"): what cuDNN itself does with a
# NaN is measured here, on the GPU, against the float64 contract (tests/cuda_oracle.py): a
# visible NaN logit makes its row NaN, other rows stay finite, keys / values past the kv
# length and queries past the q length never reach an output or a gradient, gradients of a
# NaN row are NaN. (The handler keeps a NaN lse row and a NaN backward stat; docs/cudnn.md.)

@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("masked", [False, True], ids=["lengths", "lengths+bool-mask"])
def test_nan_rows_and_nan_past_lengths(dtype, masked):
    from cuda_oracle import as_f64, assert_matches, oracle
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    b, hq, hk, lq, lk, d = 2, 4, 2, 70, 90, 64
    q = rng.standard_normal((b, hq, lq, d))
    k = rng.standard_normal((b, hk, lk, d))
    v = rng.standard_normal((b, hk, lk, d))
    dout = rng.standard_normal((b, hq, lq, d))
    ql = np.array([lq, lq - 2], np.int32)
    kvl = np.array([lk - 7, lk // 2], np.int32)
    q[0, 1, lq - 1, 3] = np.nan               # one visible NaN logit row
    k[0, :, lk - 3, :] = np.nan               # past kv length of batch row 0
    v[1, :, lk // 2 + 1:, :] = np.nan         # past kv length of batch row 1
    q[1, 1, lq - 1, :] = np.nan               # past q length of batch row 1
    dout[1, 1, lq - 1, :] = np.nan
    cast = lambda x: jnp.asarray(x, DT[dtype])  # noqa: E731
    qj, kj, vj, dj = cast(q), cast(k), cast(v), cast(dout)
    scale = 1.0 / np.sqrt(d)
    mask = None
    if masked:  # a bool mask that hides nothing the lengths keep: the mask -> bias path
        mask = jnp.ones((1, 1, lq, lk), bool)
    out, lse = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, mask, None, jnp.asarray(ql),
                                               jnp.asarray(kvl), scale=scale))(qj, kj, vj)
    want = oracle(as_f64(qj), as_f64(kj), as_f64(vj), as_f64(dj), scale=scale, ql=ql, kvl=kvl)
    tol = {"bfloat16": 3e-2, "float16": 6e-3}[dtype]
    assert_matches(out, want[0], tol, "cudnn out")
    assert_matches(lse, want[1], 2e-3, "cudnn lse")
    grads = jax.jit(lambda *x: ffi_bwd(*x, mask, None, jnp.asarray(ql), jnp.asarray(kvl),
                                       scale=scale))(qj, kj, vj, out, lse, dj)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_matches(g, w, 2 * tol, "cudnn " + name)


@gpu
def test_nan_in_every_row_of_a_head_without_lengths():
    """No lengths, no mask (the fix-ups do not run): cuDNN's raw rows. A NaN in one key
    makes every row of its kv head's group NaN; the other heads stay finite."""
    from cuda_oracle import as_f64, assert_matches, oracle
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    b, hq, hk, lq, lk, d = 1, 4, 2, 64, 64, 64
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    k[0, 1, 5, 7] = np.nan
    qj, kj, vj = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out, lse = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, scale=0.125))(qj, kj, vj)
    want = oracle(as_f64(qj), as_f64(kj), as_f64(vj), scale=0.125)
    assert np.isnan(want[0][0, 2:]).all() and np.isfinite(want[0][0, :2]).all()
    assert_matches(out, want[0], 3e-2, "cudnn out")
    assert_matches(lse, want[1], 2e-3, "cudnn lse")
