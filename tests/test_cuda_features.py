"""Our CUDA kernels' contract features and NaN rules, through their FFI targets directly
(GPU only; skipped without a CUDA device).

Targets: jax_sdpa_cuda_flash_fwd / _bwd (the flash kernels) and jax_sdpa_cuda_fwd (the
decode kernels), called with `jax.ffi.ffi_call` and `jax_sdpa.primitives.ffi_call_args`
(docs/ffi_contract.md), outputs NaN-poisoned by the handlers first (conftest). The oracle is
the contract written out in float64 numpy (tests/cuda_oracle.py, independent of jax_sdpa's own
references):
segment ids (sorted packing and unsorted ids), logit soft-capping forward and backward
(d/dx c tanh(x / c) = 1 - tanh^2), and NaN semantics: a visible NaN makes its row NaN,
other rows stay finite, queries / keys / values past the lengths never reach an output or
a gradient, rows with nothing visible are 0 with lse -inf.
The CPU test at the end checks that the targets declare the features they serve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_oracle import as_f64, assert_lse_matches, assert_matches, lse_tol, oracle, tol

FLASH_FWD, FLASH_BWD, DECODE = "jax_sdpa_cuda_flash_fwd", "jax_sdpa_cuda_flash_bwd", "jax_sdpa_cuda_fwd"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _needs_gpu():
    from jax_sdpa import _ext
    if jax.default_backend() != "gpu" or not _ext.has_backend("cuda"):
        pytest.skip("needs a CUDA GPU and our CUDA kernels built")


# ---------------------------------------------------------------------------
# direct calls

def _attrs(*, scale, cap, qseg, kvseg, ql, kvl, wl, wr, br, sinks, fp32_precision=1):
    from jax_sdpa.primitives import ffi_call_args
    j = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return ffi_call_args(scale=scale, window_left=wl, window_right=wr, bottom_right=br,
                         sinks=j(sinks), q_lengths=j(ql), kv_lengths=j(kvl),
                         q_segment_ids=j(qseg), kv_segment_ids=j(kvseg),
                         fp32_precision=fp32_precision, logits_soft_cap=float(cap))


def call_fwd(target, q, k, v, **kw):
    b, hq, lq, _ = q.shape
    results = [jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
               jax.ShapeDtypeStruct((b, hq, lq), jnp.float32)]
    if target == DECODE:
        from jax_sdpa.dispatch import cuda_decode_workspace_bytes_for
        ws = cuda_decode_workspace_bytes_for(b, hq, k.shape[1], lq, k.shape[2], v.shape[3])
        results.append(jax.ShapeDtypeStruct((ws,), jnp.uint8))
    operands, attrs = _attrs(**kw)
    res = jax.ffi.ffi_call(target, tuple(results))(q, k, v, *operands, **attrs)
    return res[0], res[1]


def call_bwd(q, k, v, out, lse, dout, **kw):
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    operands, attrs = _attrs(**kw)
    return jax.ffi.ffi_call(FLASH_BWD, shapes)(q, k, v, out, lse, dout, *operands, **attrs)


def _packed_ids(rng, b, length, sizes):
    ids = np.zeros((b, length), np.int32)
    for bb in range(b):
        pos, seg = 0, int(rng.integers(0, 5))
        while pos < length:
            n = int(sizes[(pos + bb) % len(sizes)])
            ids[bb, pos:pos + n] = seg
            pos += n
            seg += 1
    return ids


def _inputs(rng, b, hq, hk, lq, lk, d, dv, dtype, scale_up=1.0):
    q = rng.standard_normal((b, hq, lq, d)) * scale_up
    k = rng.standard_normal((b, hk, lk, d))
    v = rng.standard_normal((b, hk, lk, dv))
    dout = rng.standard_normal((b, hq, lq, dv))
    cast = lambda x: jnp.asarray(x, DTYPES[dtype])  # noqa: E731
    q, k, v, dout = cast(q), cast(k), cast(v), cast(dout)
    return q, k, v, dout


def _run_case(rng, target, *, dtype, b, hq, hk, lq, lk, d, dv, cap, segments, causal,
              lengths, sinks, backward, scale_up=1.0, unsorted=False):
    q, k, v, dout = _inputs(rng, b, hq, hk, lq, lk, d, dv, dtype, scale_up)
    qseg = kvseg = None
    if segments:
        if unsorted:
            qseg = rng.integers(0, 3, (b, lq)).astype(np.int32)
            kvseg = rng.integers(0, 3, (b, lk)).astype(np.int32)
        else:
            kvseg = _packed_ids(rng, b, lk, [7, 1, 33, 64, 5, 130])
            qseg = kvseg[:, lk - lq:] if lq <= lk else _packed_ids(rng, b, lq, [9, 70])
    ql = kvl = None
    if lengths:
        ql = np.array([lq, max(1, lq - 3)][:b], np.int32)
        kvl = np.array([lk - 5, lk][:b], np.int32)
    snk = rng.standard_normal((1, hq)).astype(np.float32) if sinks else None
    scale = 1.0 / np.sqrt(d)
    kw = dict(scale=scale, cap=cap, qseg=qseg, kvseg=kvseg, ql=ql, kvl=kvl, wl=-1,
              wr=0 if causal else -1, br=causal, sinks=snk)
    out, lse = jax.jit(lambda q, k, v: call_fwd(target, q, k, v, **kw))(q, k, v)
    want = oracle(as_f64(q), as_f64(k), as_f64(v), as_f64(dout) if backward else None, **kw)
    assert_matches(out, want[0], tol(dtype), "out")
    assert_lse_matches(lse, want[1], lse_tol(dtype))
    if backward:
        grads = jax.jit(lambda *x: call_bwd(*x, **kw))(q, k, v, out, lse, dout)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
            assert_matches(g, w, tol(dtype, grad=True), name)


# ---------------------------------------------------------------------------
# features

FLASH_CASES = [
    # dtype, D, Dv, cap, segments, causal, lengths, sinks
    ("float32", 64, 64, 0.0, True, False, False, False),   # fp32 D <= 128 (tuned kernels elsewhere)
    ("float32", 64, 64, 5.0, False, True, True, True),
    ("float32", 128, 128, 5.0, True, True, False, True),
    ("bfloat16", 64, 64, 5.0, True, True, True, False),
    ("float16", 128, 128, 0.0, True, False, True, True),
    ("bfloat16", 512, 512, 3.0, True, True, False, False),  # wide heads: the generic kernel
    ("float16", 96, 64, 4.0, True, False, False, True),     # Dv != D
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d,dv,cap,segments,causal,lengths,sinks", FLASH_CASES)
def test_flash_segments_and_soft_cap(rng, dtype, d, dv, cap, segments, causal, lengths, sinks):
    _needs_gpu()
    _run_case(rng, FLASH_FWD, dtype=dtype, b=2, hq=4, hk=2, lq=203, lk=203, d=d, dv=dv,
              cap=cap, segments=segments, causal=causal, lengths=lengths, sinks=sinks,
              backward=True, scale_up=3.0 if cap else 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_unsorted_segment_ids_and_lq_ne_lk(rng, dtype):
    """Ids that are not sorted (block skipping must stay conservative) and Lq < Lk."""
    _needs_gpu()
    _run_case(rng, FLASH_FWD, dtype=dtype, b=2, hq=2, hk=1, lq=77, lk=260, d=64, dv=64,
              cap=2.0, segments=True, causal=False, lengths=True, sinks=False,
              backward=True, unsorted=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,lq,d", [("bfloat16", 1, 128), ("float16", 4, 256),
                                        ("float32", 1, 64), ("bfloat16", 3, 512)])
def test_decode_target_segments_and_soft_cap(rng, dtype, lq, d):
    _needs_gpu()
    _run_case(rng, DECODE, dtype=dtype, b=2, hq=16, hk=2, lq=lq, lk=1100, d=d, dv=d,
              cap=4.0, segments=True, causal=True, lengths=True, sinks=True, backward=False,
              scale_up=3.0)


# ---------------------------------------------------------------------------
# NaN semantics (docs/ffi_contract.md "NaN")

NAN_TARGETS = [
    # target, dtype, D, Lq, Lk: which kernel runs is the target's own choice
    (FLASH_FWD, "float32", 64, 70, 70),      # fp32 tuned tensor-core kernels
    (FLASH_FWD, "float32", 192, 70, 70),     # fp32 generic
    (FLASH_FWD, "bfloat16", 64, 70, 70),     # 16-bit generic
    (FLASH_FWD, "bfloat16", 512, 70, 70),    # wide heads (wgmma on sm_90a)
    (DECODE, "bfloat16", 128, 1, 4000),      # decode, several splits
    (DECODE, "bfloat16", 128, 2, 300),
    (DECODE, "float32", 128, 1, 4000),
    (DECODE, "bfloat16", 512, 1, 4000),      # wide decode
]


def _nan_inputs(rng, target, dtype, d, lq, lk):
    b, hq, hk = 2, 4, 2
    q, k, v, dout = (np.asarray(as_f64(x)) for x in _inputs(rng, b, hq, hk, lq, lk, d, d, dtype))
    ql = np.array([lq, max(1, lq - 2)], np.int32)
    kvl = np.array([lk - 7, lk // 2], np.int32)
    q[0, 1, lq - 1, 3] = np.nan          # one visible NaN logit row (b0, h1, last query)
    q[1, 0, :, :] = np.where(np.arange(lq)[:, None] == 0, np.nan, q[1, 0])  # a row of NaN only
    k[0, :, lk - 3, :] = np.nan          # past kv length of b0: never read
    v[1, :, lk // 2 + 1:, :] = np.nan    # past kv length of b1
    if lq > 2:
        q[1, 1, lq - 1, :] = np.nan      # past q length of b1: 0 / -inf, no gradient
        dout[1, 1, lq - 1, :] = np.nan
    return q, k, v, dout, ql, kvl


@pytest.mark.gpu
@pytest.mark.parametrize("target,dtype,d,lq,lk", NAN_TARGETS)
def test_nan_rows_and_nan_past_lengths(rng, target, dtype, d, lq, lk):
    _needs_gpu()
    q, k, v, dout, ql, kvl = _nan_inputs(rng, target, dtype, d, lq, lk)
    kw = dict(scale=1.0 / np.sqrt(d), cap=0.0, qseg=None, kvseg=None, ql=ql, kvl=kvl,
              wl=-1, wr=-1, br=False, sinks=None)
    cast = lambda x: jnp.asarray(x, DTYPES[dtype])  # noqa: E731
    qj, kj, vj, dj = cast(q), cast(k), cast(v), cast(dout)
    out, lse = jax.jit(lambda q, k, v: call_fwd(target, q, k, v, **kw))(qj, kj, vj)
    want = oracle(as_f64(qj), as_f64(kj), as_f64(vj), as_f64(dj), **kw)
    assert np.isnan(want[1][0, 1, lq - 1]) and np.isnan(want[1][1, 0, 0])
    assert_matches(out, want[0], tol(dtype), "out")
    assert_lse_matches(lse, want[1], lse_tol(dtype))
    if target == FLASH_FWD:
        grads = jax.jit(lambda *x: call_bwd(*x, **kw))(qj, kj, vj, out, lse, dj)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want[2:]):
            assert_matches(g, w, tol(dtype, grad=True), name)


@pytest.mark.gpu
@pytest.mark.parametrize("target", [FLASH_FWD, DECODE])
def test_nan_sink_and_empty_rows(rng, target):
    """A NaN sink makes its head's rows NaN; a batch row with kv length 0 is all zeros with
    lse -inf (no sinks there)."""
    _needs_gpu()
    lq, lk = (1, 600) if target == DECODE else (40, 40)
    q, k, v, _ = _inputs(rng, 2, 4, 2, lq, lk, 64, 64, "bfloat16")
    sinks = rng.standard_normal((1, 4)).astype(np.float32)
    sinks[0, 2] = np.nan
    kw = dict(scale=0.125, cap=0.0, qseg=None, kvseg=None, ql=None, kvl=None, wl=-1, wr=-1,
              br=False, sinks=sinks)
    out, lse = jax.jit(lambda q, k, v: call_fwd(target, q, k, v, **kw))(q, k, v)
    want = oracle(as_f64(q), as_f64(k), as_f64(v), **kw)
    assert_matches(out, want[0], tol("bfloat16"), "out")
    assert_lse_matches(lse, want[1], lse_tol("bfloat16"))
    kw2 = dict(kw, sinks=None, kvl=np.array([lk, 0], np.int32))
    out, lse = jax.jit(lambda q, k, v: call_fwd(target, q, k, v, **kw2))(q, k, v)
    assert np.all(as_f64(out)[1] == 0) and np.all(as_f64(lse)[1] == -np.inf)


# ---------------------------------------------------------------------------
# CPU: what the targets declare (dispatch reads the same set)

def test_cuda_targets_declare_segments_and_soft_cap():
    from jax_sdpa import _ext
    if not _ext.has_backend("cuda"):
        pytest.skip("the CUDA module is not built")
    for target in (FLASH_FWD, FLASH_BWD, DECODE):
        assert _ext.served_features(target) == {"segment_ids", "logits_soft_cap"}, target
