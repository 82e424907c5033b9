"""The Metal kernels' segment ids and logit soft-capping, called at the FFI boundary
(jax_sdpa_metal_fwd / _bwd through jax.ffi.ffi_call), against the float64 oracle.

Each kernel path is forced in turn (JAX_SDPA_METAL_KERNEL=full|decode, JAX_SDPA_METAL_SPLITS
for the two-pass decode), on odd shapes with GQA: sorted runs of segments (length-1 ones
included), one segment per position, unsorted ids, query ids no key has (rows with nothing
to attend), with causal bands, sinks, lengths and caps. Outputs are poisoned (conftest), so
an element a kernel forgets to write fails. On Linux these run the kernels under the
emulator; on a Mac, on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa  # noqa: F401  (registers the FFI targets)
from jax_sdpa import _ext, oracle
from jax_sdpa.primitives import ffi_call_args

pytestmark = pytest.mark.skipif(not _ext.has_backend("metal"),
                                reason="the Metal backend (or its emulator) is not built")

RTOL = oracle.tolerance("float32", "metal")
GRAD_RTOL = oracle.tolerance("float32", "metal", grad=True)
LSE_ATOL = oracle.lse_tolerance("float32", "metal")


def _call(target, results, *args, **kw):
    operands, attrs = ffi_call_args(**kw)
    return jax.ffi.ffi_call(target, results)(*args, *operands, **attrs)


def metal_fwd(q, k, v, **kw):
    results = [jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
               jax.ShapeDtypeStruct(q.shape[:3], np.float32)]
    return [np.asarray(x) for x in _call("jax_sdpa_metal_fwd", results, q, k, v, **kw)]


def metal_bwd(q, k, v, out, lse, dout, **kw):
    results = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    return [np.asarray(x) for x in
            _call("jax_sdpa_metal_bwd", results, q, k, v, out, lse, dout, **kw)]


def segment_ids(kind, b, lq, lk, rng):
    """(q ids [B, Lq], kv ids [B, Lk]) int32."""
    if kind == "runs":  # sorted runs of 1..9, ids not contiguous; kv = q (Lq == Lk)
        assert lq == lk
        ids = np.zeros((b, lq), np.int32)
        for r in range(b):
            pos, seg = 0, 2
            while pos < lq:
                n = int(rng.integers(1, 10))
                ids[r, pos:pos + n] = seg
                pos, seg = pos + n, seg + int(rng.integers(1, 3))
        return ids, ids
    if kind == "singletons":
        ids = np.tile(np.arange(lq, dtype=np.int32), (b, 1))
        return ids, ids
    if kind == "unsorted":
        return (rng.integers(-2, 2, (b, lq)).astype(np.int32),
                rng.integers(-2, 2, (b, lk)).astype(np.int32))
    # cross: sorted, different lengths for queries and keys; query id 9 has no key
    q_ids = np.sort(rng.integers(0, 4, (b, lq)), axis=1).astype(np.int32)
    kv_ids = np.sort(rng.integers(0, 4, (b, lk)), axis=1).astype(np.int32)
    q_ids[:, lq // 2] = 9
    return q_ids, kv_ids


# (name, b, hq, hk, lq, lk, d, dv, segments, causal, sinks, kv_lengths, cap)
CASES = [
    ("runs_causal", 2, 4, 2, 37, 37, 64, 64, "runs", True, False, False, None),
    ("singletons", 1, 2, 1, 13, 13, 32, 32, "singletons", True, False, False, None),
    ("unsorted_gqa_sinks", 1, 6, 2, 21, 45, 80, 64, "unsorted", False, True, True, None),
    ("cross_empty_rows", 2, 4, 1, 19, 41, 64, 64, "cross", False, True, True, None),
    ("runs_cap", 2, 2, 2, 33, 33, 64, 64, "runs", True, True, True, 2.0),
    ("cap_only", 1, 4, 2, 23, 31, 96, 96, None, False, False, False, 1.5),
    ("decode_cross_cap", 2, 8, 2, 3, 70, 64, 64, "cross", True, True, True, 30.0),
    ("decode_one_query", 2, 4, 4, 1, 53, 128, 128, "unsorted", False, True, False, 4.0),
]
# (JAX_SDPA_METAL_KERNEL, JAX_SDPA_METAL_SPLITS)
PATHS = [("auto", None), ("full", None), ("decode", None), ("decode", "3")]


def _force_path(monkeypatch, path):
    kernel, splits = path
    if kernel != "auto":
        monkeypatch.setenv("JAX_SDPA_METAL_KERNEL", kernel)
    if splits:
        monkeypatch.setenv("JAX_SDPA_METAL_SPLITS", splits)


def _inputs(case, rng):
    _, b, hq, hk, lq, lk, d, dv, segs, causal, sinks, kvl, cap = case
    x = dict(q=rng.standard_normal((b, hq, lq, d)).astype(np.float32),
             k=rng.standard_normal((b, hk, lk, d)).astype(np.float32),
             v=rng.standard_normal((b, hk, lk, dv)).astype(np.float32))
    kw = dict(scale=d ** -0.5, window_right=0 if causal else -1, bottom_right=True,
              logits_soft_cap=cap or 0.0)
    if segs:
        kw["q_segment_ids"], kw["kv_segment_ids"] = segment_ids(segs, b, lq, lk, rng)
    if sinks:
        kw["sinks"] = rng.standard_normal((1, hq)).astype(np.float32)
    if kvl:
        kw["kv_lengths"] = rng.integers(lk // 2, lk + 1, b).astype(np.int32)
    return x, kw


def _oracle_kw(kw):
    o = dict(kw)
    o["logits_soft_cap"] = o["logits_soft_cap"] or None
    return o


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(x for x in p if x))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_forward_and_backward_against_oracle(case, path, monkeypatch, rng):
    _force_path(monkeypatch, path)
    x, kw = _inputs(case, rng)
    out, lse = metal_fwd(x["q"], x["k"], x["v"], **kw)
    want, want_lse = oracle.forward(x["q"], x["k"], x["v"], **_oracle_kw(kw))
    assert oracle.max_rel_error(out, want) <= RTOL
    assert oracle.lse_error(lse, want_lse) <= LSE_ATOL  # empty rows: lse = -inf
    if case[8] == "cross":  # query id 9 has no key: nothing to attend but the sink
        empty = np.broadcast_to((kw["q_segment_ids"] == 9)[:, None, :], lse.shape)
        assert empty.any() and np.all(out[empty] == 0)

    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = metal_bwd(x["q"], x["k"], x["v"], out, lse, dout, **kw)
    want_g = oracle.backward(x["q"], x["k"], x["v"], dout, **_oracle_kw(kw))
    for g, name in zip(grads, ("dq", "dk", "dv")):
        assert np.isfinite(g).all(), f"{name} not finite"
        err = oracle.max_rel_error(g, want_g[name])
        assert err <= GRAD_RTOL, f"{name} error {err:.3g}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_segments_and_cap(dtype, rng):
    """Inputs rounded to the dtype, fed to the oracle as they are: the error left is the
    kernel's (float32 softmax and accumulation, a rounded output)."""
    b, hq, hk, lq, lk, d = 2, 4, 2, 29, 29, 64
    cast = lambda a: np.asarray(jnp.asarray(a, dtype))  # noqa: E731
    q, k, v = (cast(rng.standard_normal((b, h, lq, d))) for h in (hq, hk, hk))
    ids, _ = segment_ids("runs", b, lq, lk, rng)
    kw = dict(scale=d ** -0.5, window_right=0, bottom_right=True, logits_soft_cap=3.0,
              q_segment_ids=ids, kv_segment_ids=ids)
    out, _ = metal_fwd(q, k, v, **kw)
    assert out.dtype == q.dtype
    f64 = lambda a: np.asarray(a, np.float32).astype(np.float64)  # noqa: E731
    want, _ = oracle.forward(f64(q), f64(k), f64(v), **kw)
    assert oracle.max_rel_error(out, want) <= oracle.tolerance(dtype, "metal")


def test_soft_cap_bounds_huge_logits(rng):
    """At scale 1e3 the uncapped logits are ~1e4; capped at 5 they stay in [-5, 5], so the
    forward is the oracle's (no overflow, no lost maximum) up to float32's rounding of q.k,
    which the scale multiplies: a key whose logit the cap leaves unsaturated (|q.k| < ~0.02)
    moves by ~1e-4, and the output and lse by up to ~3e-5 (2.5e-5 and 1.05e-5 the largest of
    300 seeds), hence 1e-4 there. The backward at scale 30 (logits ~200, most saturated): the
    same rounding times 30 moves a logit by ~1e-5, which tanh' and the softmax carry into
    dq and dk (2.1e-5 the largest of 300 seeds), hence 5e-5; at 1e3 it would move tanh' by
    ~1e-4."""
    b, h, lq, lk, d = 1, 2, 17, 23, 32
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for n in (lq, lk, lk))
    for scale, rtol, lse_atol in ((1e3, 1e-4, 1e-4), (30.0, RTOL, LSE_ATOL)):
        kw = dict(scale=scale, logits_soft_cap=5.0)
        out, lse = metal_fwd(q, k, v, **kw)
        want, want_lse = oracle.forward(q, k, v, **kw)
        assert oracle.max_rel_error(out, want) <= rtol
        assert oracle.lse_error(lse, want_lse) <= lse_atol
    dout = rng.standard_normal(out.shape).astype(np.float32)
    want_g = oracle.backward(q, k, v, dout, **kw)
    for g, name in zip(metal_bwd(q, k, v, out, lse, dout, **kw), ("dq", "dk", "dv")):
        assert oracle.max_rel_error(g, want_g[name]) <= 5e-5, name


@pytest.mark.parametrize("path", [("full", None), ("decode", None)], ids=lambda p: p[0])
def test_other_segments_never_reach_results(path, monkeypatch, rng):
    """NaN / inf in the keys and values of a segment no query is in (its edges inside key
    blocks, so partly skipped blocks too) reach no output and no gradient."""
    _force_path(monkeypatch, path)
    b, h, lk, d = 2, 2, 40, 32
    lq = 5 if path[0] == "decode" else 37
    q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    q_ids = np.zeros((b, lq), np.int32)
    q_ids[:, lq // 2:] = 2
    kv_ids = np.zeros((b, lk), np.int32)
    kv_ids[:, 13:29] = 1  # no query is in segment 1
    kv_ids[:, 29:] = 2
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[:, :, 13:29] = np.nan
    v_bad[:, :, 13:29] = np.inf
    kw = dict(scale=d ** -0.5, q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    out, lse = metal_fwd(q, k_bad, v_bad, **kw)
    want, _ = oracle.forward(q, k, v, **kw)
    assert np.isfinite(out).all()
    assert oracle.max_rel_error(out, want) <= RTOL
    dout = rng.standard_normal(out.shape).astype(np.float32)
    want_g = oracle.backward(q, k, v, dout, **kw)
    for g, name in zip(metal_bwd(q, k_bad, v_bad, out, lse, dout, **kw), ("dq", "dk", "dv")):
        assert np.isfinite(g).all(), f"{name} not finite"
        assert oracle.max_rel_error(g, want_g[name]) <= GRAD_RTOL, name


@pytest.mark.parametrize("path", [("full", None), ("decode", None)], ids=lambda p: p[0])
def test_hidden_nan_reaches_only_rows_that_see_it(path, monkeypatch, rng):
    """Causal: a NaN key and value at position j inside a key block. Rows that see j are
    NaN; the rows of the same tiles that don't are finite and exact, and so are their dq
    (the product with a hidden NaN key is selected away, not multiplied by 0)."""
    _force_path(monkeypatch, path)
    b, h, d = 1, 2, 32
    lq, lk = (3, 30) if path[0] == "decode" else (30, 30)
    q = rng.standard_normal((b, h, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, h, lk, d)).astype(np.float32)
    j = lk - 2  # bottom-right causal: only the last two queries see it
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[..., j, :] = 0.0
    v_bad[..., j, :] = 0.0
    k_bad[..., j, 3] = np.nan
    v_bad[..., j, 5] = np.nan
    kw = dict(scale=d ** -0.5, window_right=0, bottom_right=True)
    out, lse = metal_fwd(q, k_bad, v_bad, **kw)
    k0, v0 = np.nan_to_num(k_bad), np.nan_to_num(v_bad)
    want, _ = oracle.forward(q, k0, v0, **kw)
    sees = np.zeros(lq, bool)
    sees[lq - 2:] = True
    assert np.isnan(out[:, :, sees]).all(), "rows that see the NaN key are not NaN"
    assert np.isfinite(out[:, :, ~sees]).all()
    assert oracle.max_rel_error(out[:, :, ~sees], want[:, :, ~sees]) <= RTOL
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq = metal_bwd(q, k_bad, v_bad, out, lse, dout, **kw)[0]
    want_dq = oracle.backward(q, k0, v0, dout, **kw)["dq"]
    assert np.isfinite(dq[:, :, ~sees]).all()
    assert oracle.max_rel_error(dq[:, :, ~sees], want_dq[:, :, ~sees]) <= GRAD_RTOL


def test_unserved_features_are_declared():
    served = _ext.served_features("jax_sdpa_metal_fwd")
    assert {"segment_ids", "logits_soft_cap"} <= served
    assert {"segment_ids", "logits_soft_cap"} <= _ext.served_features("jax_sdpa_metal_bwd")
