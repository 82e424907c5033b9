"""cuDNN-specific GPU tests (run on the H200 machine; skipped without a GPU).

Two levels:
- the FFI targets jax_sdpa_cudnn_fwd / _bwd called directly through
  `jax.ffi.ffi_call` with the kernel contract's operands (docs/ffi_contract.md),
  against the float64 oracle (jax_sdpa.oracle) on the same rounded inputs: every mask
  form, lengths, windows, sinks, GQA, Dv != D, both layouts, fp16/bf16, forward and
  backward;
- the public API with implementation="cudnn" (against the oracle, and beside jax.nn's own
  cuDNN path).

Bounds are jax_sdpa.oracle's policy: fp16/bf16 error no more than 2x that of our XLA path in
the same dtype plus a floor. Outputs are NaN-poisoned by the handler before the kernel runs
(JAX_SDPA_POISON_OUTPUTS, set in conftest).
"""

from __future__ import annotations

import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdpa import dispatch, oracle

gpu = pytest.mark.gpu

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


def _with_workspace(target, operands, results, attrs, workspace_bytes=None):
    """`target` called with its uint8 workspace result appended (sized as the lowering sizes
    it, unless `workspace_bytes` is given), that result dropped."""
    if workspace_bytes is None:
        plan = types.SimpleNamespace(target=target, workspace_bytes=0)
        workspace_bytes = dispatch.workspace_bytes_at_lowering(plan, operands, results, attrs)
    workspace = jax.ShapeDtypeStruct((workspace_bytes,), jnp.uint8)
    out = jax.ffi.ffi_call(target, (*results, workspace))(*operands, **attrs)
    return tuple(out)[:len(results)]


def ffi_fwd(q, k, v, mask=None, sinks=None, ql=None, kvl=None, *, scale, wl=-1, wr=-1,
            br=False, seq_major=False, workspace_bytes=None):
    b = q.shape[0]
    hq, lq = (q.shape[2], q.shape[1]) if seq_major else (q.shape[1], q.shape[2])
    out = jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype)
    lse = jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)
    operands, attrs = _contract(scale, wl, wr, br, seq_major, mask, sinks, ql, kvl)
    return _with_workspace("jax_sdpa_cudnn_fwd", (q, k, v, *operands), (out, lse), attrs,
                           workspace_bytes)


def ffi_bwd(q, k, v, out, lse, dout, mask=None, sinks=None, ql=None, kvl=None, *, scale,
            wl=-1, wr=-1, br=False, seq_major=False, workspace_bytes=None):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    operands, attrs = _contract(scale, wl, wr, br, seq_major, mask, sinks, ql, kvl)
    return _with_workspace("jax_sdpa_cudnn_bwd", (q, k, v, out, lse, dout, *operands), shapes,
                           attrs, workspace_bytes)


# ---------------------------------------------------------------------------
# the float64 oracle, and the same-dtype XLA run that the 16-bit bound allows twice the
# error of ([B, H, L, D] throughout)

def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _oracle_kw(mask, sinks, ql, kvl, scale, wl, wr, br, seq_major=False):
    if mask is not None:
        mask = np.asarray(mask) if mask.dtype == jnp.bool_ else _f64(mask)
    return dict(scale=scale, mask=mask, sinks=None if sinks is None else _f64(sinks),
                q_lengths=None if ql is None else np.asarray(ql),
                kv_lengths=None if kvl is None else np.asarray(kvl), window_left=wl,
                window_right=wr, bottom_right=br, seq_major=seq_major)


def expected(q, k, v, mask=None, sinks=None, ql=None, kvl=None, dout=None, *, scale, wl=-1,
             wr=-1, br=False, seq_major=False):
    """The oracle's (out, lse) on the inputs as given, and (dq, dk, dv) with a `dout`."""
    kw = _oracle_kw(mask, sinks, ql, kvl, scale, wl, wr, br, seq_major)
    out, lse = oracle.forward(_f64(q), _f64(k), _f64(v), **kw)
    if dout is None:
        return out, lse
    g = oracle.backward(_f64(q), _f64(k), _f64(v), _f64(dout), **kw)
    return out, lse, (g["dq"], g["dk"], g["dv"])


def xla_same_dtype(q, k, v, mask=None, sinks=None, ql=None, kvl=None, dout=None, *, scale,
                   wl=-1, wr=-1, br=False):
    """Our XLA path in the inputs' dtype: out, and (dq, dk, dv) of <out, dout> with a `dout`."""
    from jax_sdpa import vjp
    from jax_sdpa.config import StaticParams

    params = StaticParams(scale=float(scale), window_left=wl, window_right=wr, bottom_right=br,
                          implementation="xla")
    f = jax.jit(lambda q, k, v: vjp.attention(q, k, v, mask, sinks, ql, kvl, params)[0])
    if dout is None:
        return f(q, k, v)
    out, pull = jax.vjp(f, q, k, v)
    return out, pull(dout.astype(out.dtype))


def check(got, want, xla, dtype, what):
    """No NaN; the error relative to the oracle's own magnitude within the policy's bound
    (the same-dtype XLA run's error measured alike)."""
    got32 = np.asarray(jnp.asarray(got, jnp.float32))
    assert not np.isnan(got32).any(), f"{what}: NaN (unwritten or bad) elements"
    err = oracle.max_rel_error(got32, want, floor=oracle.OWN_MAGNITUDE)
    xla_error = oracle.max_rel_error(xla, want, floor=oracle.OWN_MAGNITUDE)
    bound = oracle.tolerance(dtype, "cudnn", xla_error=xla_error)
    assert err <= bound, f"{what}: relative error {err:.3g} > {bound:.3g} ({dtype})"
    return err


def agree(a, b):
    """max_rel_error of two cuDNN runs of one call: within the policy's named case."""
    return oracle.max_rel_error(a, np.asarray(jnp.asarray(b, jnp.float32), np.float64),
                                floor=oracle.OWN_MAGNITUDE)


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
    want, want_lse = expected(q, k, v, mask, sinks, ql, kvl, **flags)
    check(out, want, xla_same_dtype(q, k, v, mask, sinks, ql, kvl, **flags), dtype, "out")
    # lse: -inf exactly where the oracle has nothing, no NaN; close elsewhere.
    err = oracle.lse_error(lse, want_lse)
    f32_bias = CASES[name].get("mask") in ("add32", "addinf")
    bound = oracle.lse_tolerance(dtype, "cudnn", case="cudnn_f32_bias" if f32_bias else None)
    assert err <= bound, f"lse error {err:.3g}"
    # Rows with nothing to attend are exactly zero.
    empty = ~np.isfinite(want_lse)
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
    _, _, want = expected(q, k, v, mask, sinks, ql, kvl, dout, **flags)
    _, xla = xla_same_dtype(q, k, v, mask, sinks, ql, kvl, dout, **flags)
    for nm, g, w, x in zip(("dq", "dk", "dv"), got, want, xla):
        check(g, w, x, dtype, nm)
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
    want_out, _, want_grads = expected(q, k, v, dout=dout, **flags)
    xla_out, xla_grads = xla_same_dtype(q, k, v, dout=dout, **flags)
    try:
        for nm, g, w, x in zip(("out", "dq", "dk", "dv"), got, (want_out, *want_grads),
                               (xla_out, *xla_grads)):
            check(g, w, x, "bfloat16", nm)
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


@gpu
def test_workspace_is_sized_at_lowering_and_topped_up_outside_capture(key):
    """The targets' workspace result holds every piece of scratch the graphs take (kv
    lengths: a zeroed copy of V and K); a workspace too small for them (0 bytes) is topped up
    from XLA's scratch allocator when the call is not captured, with the same results."""
    c = dict(b=3, hq=4, hk=2, lq=96, lk=160, d=64, kvl=True, wr=0, br=True)
    (q, k, v, mask, sinks, ql, kvl), flags = make_inputs(c, "bfloat16", key)
    dout = jax.random.normal(jax.random.fold_in(key, 5), q.shape, jnp.float32).astype(q.dtype)
    operands, attrs = _contract(flags["scale"], flags["wl"], flags["wr"], flags["br"], False,
                                None, None, None, kvl)
    plan = types.SimpleNamespace(target="jax_sdpa_cudnn_bwd", workspace_bytes=0)
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    lse = jax.ShapeDtypeStruct(q.shape[:3], jnp.float32)
    sized = dispatch.workspace_bytes_at_lowering(plan, (q, k, v, q, lse, dout, *operands),
                                                 results, attrs)
    # the zeroed copies of q, dout, k and v alone, each rounded up to 256 bytes
    copies = sum(-(-x.size * 2 // 256) * 256 for x in (q, dout, k, v))
    assert sized >= copies

    def run(workspace_bytes):
        @jax.jit
        def f(q, k, v, dout, kvl):
            out, lse = ffi_fwd(q, k, v, None, None, None, kvl, **flags,
                               workspace_bytes=workspace_bytes)
            return (out, lse, *ffi_bwd(q, k, v, out, lse, dout, None, None, None, kvl, **flags,
                                       workspace_bytes=workspace_bytes))
        return [np.asarray(x, np.float32) for x in f(q, k, v, dout, kvl)]

    got, topped_up = run(None), run(0)
    for nm, a, b in zip(("out", "lse"), got, topped_up):
        np.testing.assert_array_equal(a, b, err_msg=nm)
    _, _, want = expected(q, k, v, None, None, None, kvl, dout, **flags)
    _, xla = xla_same_dtype(q, k, v, None, None, None, kvl, dout, **flags)
    for nm, g, t, w, x in zip(("dq", "dk", "dv"), got[2:], topped_up[2:], want, xla):
        check(g, w, x, "bfloat16", nm)
        check(t, w, x, "bfloat16", nm)


@gpu
def test_dependent_calls_in_a_loop(key):
    """Decode steps as dependent calls in one jitted fori_loop (where XLA may capture the
    call into a CUDA graph) give what the same steps give called one by one."""
    import jax_sdpa
    c = dict(b=2, hq=8, hk=2, lq=1, lk=512, d=64)
    (q, k, v, *_), _ = make_inputs(c, "bfloat16", key)
    kvl = jnp.array([300, 512], jnp.int32)

    def step(q, k, v, kvl):
        return jax_sdpa.scaled_dot_product_attention(q, k, v, key_value_seq_lengths=kvl,
                                                     implementation="cudnn")

    looped = jax.jit(lambda q: jax.lax.fori_loop(0, 6, lambda i, x: step(x, k, v, kvl), q))(q)
    one = jax.jit(step)
    x = q
    for _ in range(6):
        x = one(x, k, v, kvl)
    np.testing.assert_array_equal(np.asarray(looped, np.float32), np.asarray(x, np.float32))


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
    bound = oracle.tolerance(dtype, case="same_library")
    assert agree(_btnh(ours), theirs) <= bound
    assert agree(ours_btnh, theirs) <= bound


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_api_grads_against_the_oracle(dtype, key):
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
    want = oracle.backward(_f64(q), _f64(k), _f64(v), _f64(w), scale=flags["scale"],
                           mask="causal")
    xla = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2)))(q, k, v)
    for nm, g, x in zip(("dq", "dk", "dv"), got, xla):
        check(g, want[nm], x, dtype, nm)


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
    band = dict(kvl=kvl, scale=flags["scale"], wr=0, br=True)
    want, _ = expected(q, k, v, **band)
    check(got, want, xla_same_dtype(q, k, v, **band), "bfloat16", "decode out")


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
    want, _ = expected(*args, bias, None, ql, kvl, scale=1 / np.sqrt(64), seq_major=True)
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, **kw, implementation="xla"))(*args)
    check(ours, want, xla, "bfloat16", "jax.nn-contract out")
    # vmap over an extra leading axis folds into the batch.
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    vm = jax.jit(jax.vmap(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cudnn")))(*stacked)
    single = jax.jit(lambda q, k, v: jax_sdpa.scaled_dot_product_attention(
        q, k, v, mask="causal", implementation="cudnn"))(q * 0.5, k * 0.5, v * 0.5)
    assert agree(vm[1], single) <= oracle.tolerance("bfloat16", case="same_library")


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
    from cuda_oracle import as_f64, assert_lse_matches, assert_matches, lse_tol, oracle, tol
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
    assert_matches(out, want[0], tol(dtype), "cudnn out")
    assert_lse_matches(lse, want[1], lse_tol(dtype), "cudnn lse")
    grads = jax.jit(lambda *x: ffi_bwd(*x, mask, None, jnp.asarray(ql), jnp.asarray(kvl),
                                       scale=scale))(qj, kj, vj, out, lse, dj)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert_matches(g, w, tol(dtype, grad=True), "cudnn " + name)


@gpu
def test_nan_in_every_row_of_a_head_without_lengths():
    """No lengths, no mask (the fix-ups do not run): cuDNN's raw rows. A NaN in one key
    makes every row of its kv head's group NaN; the other heads stay finite."""
    from cuda_oracle import as_f64, assert_lse_matches, assert_matches, lse_tol, oracle, tol
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    b, hq, hk, lq, lk, d = 1, 4, 2, 64, 64, 64
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, d)))
    k[0, 1, 5, 7] = np.nan
    qj, kj, vj = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out, lse = jax.jit(lambda q, k, v: ffi_fwd(q, k, v, scale=0.125))(qj, kj, vj)
    want = oracle(as_f64(qj), as_f64(kj), as_f64(vj), scale=0.125)
    assert np.isnan(want[0][0, 2:]).all() and np.isfinite(want[0][0, :2]).all()
    assert_matches(out, want[0], tol("bfloat16"), "cudnn out")
    assert_lse_matches(lse, want[1], lse_tol("bfloat16"), "cudnn lse")
