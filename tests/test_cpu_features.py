"""The cpu kernel's packed sequences (segment ids) and logit soft-capping, forward and backward,
through direct calls of its FFI targets (jax_sdpa_cpu_fwd / _bwd) against the float64 oracle
(jax_sdpa.oracle; the segments also written as the equivalent bool mask) within its tolerance
policy. Fresh random inputs, odd shapes, GQA, segments of length 1, unsorted ids, rows that see
nothing; outputs are poisoned by the handlers (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_sdpa import _ext, oracle
from jax_sdpa.primitives import ffi_call_args

pytestmark = pytest.mark.skipif(_ext.module("_sdpa_cpu") is None,
                                reason="the cpu kernel is not built into this installation")

RTOL = oracle.tolerance("float32", "cpu")
GRAD_RTOL = oracle.tolerance("float32", "cpu", grad=True)
LSE_ATOL = oracle.lse_tolerance("float32", "cpu")
# Two calls doing the same visible work: the policy's bounds for that named case.
SAME_WORK_RTOL = oracle.tolerance("float32", case="fp32_same_work")
SAME_WORK_GRAD_RTOL = oracle.tolerance("float32", case="fp32_same_work", grad=True)


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _call_fwd(q, k, v, **kw):
    operands, attrs = ffi_call_args(**kw)
    results = (jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
               jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", results)
    out, lse = jax.jit(lambda *a: call(*a, **attrs))(q, k, v, *operands)
    return np.asarray(out), np.asarray(lse)


def _call_bwd(q, k, v, out, lse, dout, **kw):
    operands, attrs = ffi_call_args(**kw)
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_bwd", results)
    grads = jax.jit(lambda *a: call(*a, **attrs))(q, k, v, out, lse, dout, *operands)
    return [np.asarray(g) for g in grads]


def _rel(got, want):
    return oracle.max_rel_error(got, want)


def _lse_err(got, want):
    return oracle.lse_error(got, want)


def _tol(dtype):
    return oracle.tolerance(dtype, "cpu")


def _segments(rng, b, length, kind):
    """int32 [b, length] segment ids: sorted packing with random lengths (some of length 1),
    or unsorted random ids."""
    if kind == "unsorted":
        return rng.integers(0, 3, size=(b, length)).astype(np.int32)
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(4, length - 1), replace=False))
        ids = np.zeros(length, np.int32)
        for c in cuts:
            ids[c:] += 1
        ids[-1] = ids[-2] + 1 if length > 1 else 0  # a segment of length 1 at the end
        rows.append(ids + 7)  # ids need not start at 0
    return np.stack(rows)


def _segment_mask(q_ids, kv_ids, hq):
    """[B, Hq, Lq, Lk] bool: the segments as the equivalent dense mask."""
    same = q_ids[:, :, None] == kv_ids[:, None, :]
    return np.broadcast_to(same[:, None], (q_ids.shape[0], hq) + same.shape[1:])


SEG_SHAPES = [  # b, hq, hk, lq, lk, d
    (2, 4, 2, 37, 37, 16),
    (1, 3, 1, 130, 130, 32),
    (2, 2, 2, 70, 201, 8),
]


@pytest.mark.parametrize("kind", ["sorted", "unsorted"])
@pytest.mark.parametrize("shape", SEG_SHAPES, ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
@pytest.mark.parametrize("causal", [False, True])
def test_segments_forward_and_backward(shape, kind, causal, rng):
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    qs = _segments(rng, b, lq, kind)
    ks = qs.copy() if lq == lk else _segments(rng, b, lk, kind)
    if lq != lk:
        qs[0, : lq // 3] = -5  # queries whose segment no key has: nothing to attend
    kvl = np.array([lk - 3] + [lk] * (b - 1), np.int32)
    dense = _segment_mask(qs, ks, hq)
    kw = dict(scale=1 / np.sqrt(d), kv_lengths=kvl, q_segment_ids=qs, kv_segment_ids=ks)
    ow = dict(kv_lengths=kvl, mask=dense)
    if causal:
        kw.update(window_right=0, bottom_right=True)
        ow.update(window_right=0, bottom_right=True)
    out, lse = _call_fwd(q, k, v, **kw)
    want, want_lse = oracle.forward(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), **ow)
    assert _rel(out, want) <= RTOL
    assert _lse_err(lse, want_lse) <= LSE_ATOL
    dout = _normal(rng, *out.shape)
    grads = _call_bwd(q, k, v, out, lse, dout, **kw)
    wg = oracle.backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         dout.astype(np.float64), **ow)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert _rel(g, wg[name]) <= GRAD_RTOL, name


def test_segments_with_mask_sinks_lengths_window_bf16(rng):
    """Segments ANDed with a bool mask, a window, q/kv lengths, sinks; bfloat16 inputs."""
    b, hq, hk, lq, lk, d = 2, 4, 1, 90, 90, 24
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    qs = _segments(rng, b, lq, "sorted")
    mask = rng.random((b, 1, lq, lk)) < 0.7
    sinks = _normal(rng, 1, hq)
    ql = np.array([lq - 5, lq], np.int32)
    kvl = np.array([lk, lk - 11], np.int32)
    kw = dict(scale=0.3, window_left=20, window_right=5, q_lengths=ql, kv_lengths=kvl,
              sinks=sinks, q_segment_ids=qs, kv_segment_ids=qs)
    dense = mask & _segment_mask(qs, qs, hq)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    out, lse = _call_fwd(bf(q), bf(k), bf(v), mask=jnp.asarray(mask), **kw)
    want, _ = oracle.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                             scale=0.3, mask=dense, sinks=sinks.astype(np.float64), q_lengths=ql,
                             kv_lengths=kvl, window_left=20, window_right=5)
    assert _rel(out.astype(np.float32), want) <= _tol("bfloat16")


def test_nan_key_of_another_segment_never_reaches_a_row(rng):
    b, hq, hk, l, d = 1, 2, 1, 64 + 9, 8
    q, k, v = _normal(rng, b, hq, l, d), _normal(rng, b, hk, l, d), _normal(rng, b, hk, l, d)
    qs = np.zeros((b, l), np.int32)
    qs[:, 40:] = 1
    k[0, 0, 45] = np.nan  # segment 1: rows 40.. are NaN, rows ..39 never see it
    kw = dict(scale=0.25, q_segment_ids=qs, kv_segment_ids=qs)
    out, _ = _call_fwd(q, k, v, **kw)
    assert np.isfinite(out[0, :, :40]).all()
    assert np.isnan(out[0, :, 40:]).all()
    dout = _normal(rng, *out.shape)
    k0 = k.copy()
    k0[0, 0, 45] = 0.0
    out0, lse0 = _call_fwd(q, k0, v, **kw)
    assert _rel(out[0, :, :40], out0[0, :, :40]) <= SAME_WORK_RTOL


def test_segment_blocks_that_never_meet_cost_nothing_but_still_write(rng):
    """Every output is written when whole key blocks are skipped (poisoned outputs), and a
    packed call equals the per-segment calls."""
    b, hq, hk, seg, d = 1, 2, 2, 128, 16
    n = 4
    l = n * seg
    q, k, v = _normal(rng, b, hq, l, d), _normal(rng, b, hk, l, d), _normal(rng, b, hk, l, d)
    ids = np.repeat(np.arange(n, dtype=np.int32), seg)[None]
    kw = dict(scale=0.25, q_segment_ids=ids, kv_segment_ids=ids)
    out, lse = _call_fwd(q, k, v, **kw)
    dout = _normal(rng, *out.shape)
    dq, dk, dv = _call_bwd(q, k, v, out, lse, dout, **kw)
    for s in range(n):
        sl = slice(s * seg, (s + 1) * seg)
        o1, l1 = _call_fwd(q[:, :, sl], k[:, :, sl], v[:, :, sl], scale=0.25)
        g1 = _call_bwd(q[:, :, sl], k[:, :, sl], v[:, :, sl], o1, l1, dout[:, :, sl], scale=0.25)
        assert _rel(out[:, :, sl], o1) <= SAME_WORK_RTOL
        for got, want in zip((dq, dk, dv), g1):
            assert _rel(got[:, :, sl], want) <= SAME_WORK_GRAD_RTOL


# ---------------------------------------------------------------------------
# soft-capping (the contract: cap before the additive mask; sinks are not capped)

@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 2, 33, 47, 16), (1, 2, 1, 1, 130, 64),
                                   (1, 8, 2, 70, 70, 40)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
def test_soft_cap_forward_and_backward(shape, with_bias, rng):
    b, hq, hk, lq, lk, d = shape
    # large logits, so that the cap matters (tanh saturates for some)
    q = 3 * _normal(rng, b, hq, lq, d)
    k, v = _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    cap = float(rng.uniform(2.0, 8.0))
    scale = 1 / np.sqrt(d)
    bias = _normal(rng, b, hq, lq, lk) if with_bias else None
    sinks = _normal(rng, 1, hq)
    causal = lq > 1
    kw = dict(scale=scale, logits_soft_cap=cap, sinks=sinks,
              mask=None if bias is None else jnp.asarray(bias))
    if causal:
        kw.update(window_right=0, bottom_right=True)
    out, lse = _call_fwd(q, k, v, **kw)
    dout = _normal(rng, *out.shape)
    ow = dict(scale=scale, logits_soft_cap=cap, sinks=sinks[0].astype(np.float64),
              mask=None if bias is None else bias.astype(np.float64))
    if causal:
        ow.update(window_right=0, bottom_right=True)
    want, want_lse = oracle.forward(*(x.astype(np.float64) for x in (q, k, v)), **ow)
    wg = oracle.backward(*(x.astype(np.float64) for x in (q, k, v, dout)), **ow)
    assert _rel(out, want) <= RTOL
    assert _lse_err(lse, want_lse) <= LSE_ATOL
    grads = _call_bwd(q, k, v, out, lse, dout, **kw)
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert _rel(got, wg[name]) <= GRAD_RTOL, name


def test_soft_cap_with_segments_and_tiny_logits(rng):
    """Logits near 0 (tanh's small-argument branch) and a huge cap equal the uncapped call;
    composes with segments."""
    b, hq, hk, l, d = 1, 2, 1, 77, 8
    q, k, v = 1e-3 * _normal(rng, b, hq, l, d), _normal(rng, b, hk, l, d), _normal(rng, b, hk, l, d)
    ids = _segments(rng, b, l, "sorted")
    base = dict(scale=1.0, q_segment_ids=ids, kv_segment_ids=ids)
    capped, _ = _call_fwd(q, k, v, logits_soft_cap=1e4, **base)
    plain, _ = _call_fwd(q, k, v, **base)
    assert _rel(capped, plain) <= SAME_WORK_RTOL
    small_cap, _ = _call_fwd(q, k, v, logits_soft_cap=0.01, **base)
    want, _ = oracle.forward(*(x.astype(np.float64) for x in (q, k, v)), scale=1.0,
                             logits_soft_cap=0.01, q_segment_ids=ids, kv_segment_ids=ids)
    assert _rel(small_cap, want) <= RTOL


# ---------------------------------------------------------------------------
# decode-shaped tiles (at most 8 rows of one kv head: the narrow kernels)

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 1, 300, 64), (1, 4, 4, 1, 77, 16),
                                   (3, 16, 2, 1, 129, 128), (1, 6, 2, 2, 65, 32),
                                   (1, 2, 1, 3, 200, 8)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
def test_decode_tiles(shape, dtype, rng):
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    if dtype == "bfloat16":
        q, k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    kvl = rng.integers(1, lk + 1, size=b).astype(np.int32)
    sinks = _normal(rng, 1, hq)
    cap = 5.0
    kw = dict(scale=1 / np.sqrt(d), kv_lengths=kvl, sinks=sinks, window_right=0,
              bottom_right=True)
    dt = jnp.dtype(dtype)
    out, lse = _call_fwd(*(jnp.asarray(x, dt) for x in (q, k, v)), **kw)
    want, want_lse = oracle.forward(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), scale=1 / np.sqrt(d),
                                    sinks=sinks.astype(np.float64), kv_lengths=kvl,
                                    window_right=0, bottom_right=True)
    assert _rel(out.astype(np.float32), want) <= _tol(dtype)
    assert _lse_err(lse, want_lse) <= LSE_ATOL
    # with the soft cap
    kw.update(logits_soft_cap=cap)
    out, _ = _call_fwd(*(jnp.asarray(x, dt) for x in (q, k, v)), **kw)
    want, _ = oracle.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                             scale=1 / np.sqrt(d), sinks=sinks.astype(np.float64),
                             kv_lengths=kvl, window_right=0, bottom_right=True,
                             logits_soft_cap=cap)
    assert _rel(out.astype(np.float32), want) <= _tol(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("climb", [0.5, 3.0, 5.0, 7.0])
def test_row_maxima_climbing_across_key_blocks(climb, dtype, rng):
    """Logits that rise by `climb` from one 64-key block to the next for six blocks, then
    stay (at most 42: larger logits would carry float32 rounding past the tolerance): the
    running maxima move block after block, by less and more than the exps' range, and O is
    rescaled each time; the output and lse match float64, causal and not, with the keys also
    split across threads (one tile of many keys)."""
    b, hq, hk, d = 1, 4, 2, 32
    for lq, lk in ((80, 64 * 9 + 23), (16, 64 * 40 + 5)):
        # q . k_j = climb * min(j / 64, 6) + noise: key j's logit climbs with j
        q = _normal(rng, b, hq, lq, d) * 0.1
        q[..., 0] = 1.0
        k = _normal(rng, b, hk, lk, d) * 0.1
        k[..., 0] = climb * np.minimum(np.arange(lk) / 64, 6.0)
        v = _normal(rng, b, hk, lk, d)
        q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
        for causal in (False, True):
            band = dict(window_right=0, bottom_right=True) if causal else {}
            out, lse = _call_fwd(q, k, v, scale=1.0, **band)
            want, want_lse = oracle.forward(*(np.asarray(x, np.float64) for x in (q, k, v)),
                                            scale=1.0, **band)
            assert _rel(out.astype(np.float32), want) <= _tol(dtype), (lq, lk, causal)
            assert _lse_err(lse, want_lse) <= oracle.lse_tolerance(dtype, "cpu"), (lq, causal)


@pytest.mark.parametrize("shape", [(1, 4, 1, 1, 3000, 64), (1, 2, 2, 40, 2500, 32),
                                   (1, 3, 1, 2, 2100, 24)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
def test_keys_split_across_threads(shape, rng):
    """Few tiles and many keys: each tile's keys are cut into shares whose softmax states
    merge; a share past the length sees nothing, a NaN key reaches only its rows."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    sinks = _normal(rng, 1, hq)
    for kvl in (lk, lk // 3):
        lengths = np.full(b, kvl, np.int32)
        kw = dict(scale=1 / np.sqrt(d), kv_lengths=lengths, sinks=sinks)
        out, lse = _call_fwd(q, k, v, **kw)
        want, want_lse = oracle.forward(q.astype(np.float64), k.astype(np.float64),
                                        v.astype(np.float64), scale=1 / np.sqrt(d),
                                        sinks=sinks.astype(np.float64), kv_lengths=lengths)
        assert _rel(out, want) <= RTOL
        assert _lse_err(lse, want_lse) <= LSE_ATOL
    k_nan = k.copy()
    k_nan[0, 0, lk - 5] = np.nan  # in the last share; kv head 0 only
    out, lse = _call_fwd(q, k_nan, v, scale=1 / np.sqrt(d))
    g = hq // hk
    assert np.isnan(out[0, :g]).all() and np.isnan(lse[0, :g]).all()
    assert np.isfinite(out[0, g:]).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(2, 40, 20, 1, 1500, 32), (1, 12, 3, 2, 2100, 16),
                                   (3, 8, 8, 1, 90, 64)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
def test_decode_from_a_slot_major_cache(shape, dtype, rng):
    """Decode from [B, L, H, D] (jax.nn's layout): a task walks up to 16 kv heads of a batch
    row together (20 heads: a group of 16 and one of 4), keys split into shares or not; per-row
    lengths (one 0), sinks; a NaN key reaches only its kv head's rows, a NaN past the length
    none."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, lq, hq, d), _normal(rng, b, lk, hk, d), _normal(rng, b, lk, hk, d)
    if dtype == "bfloat16":
        q, k, v = (np.array(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (q, k, v))
    kvl = rng.integers(lk // 2, lk + 1, size=b).astype(np.int32)
    kvl[-1] = 0 if b > 1 else kvl[-1]
    k[0, kvl[0]:, :] = np.nan  # past row 0's length: never read
    v[0, kvl[0]:, :] = np.nan
    k[-1, :, hk - 1] = np.nan if b == 1 else 0.0  # b == 1: kv head hk-1 only
    sinks = _normal(rng, 1, hq)
    kw = dict(scale=1 / np.sqrt(d), kv_lengths=kvl, sinks=sinks, bottom_right=True,
              window_right=0, seq_major=True)
    operands, attrs = ffi_call_args(**kw)
    dt = jnp.dtype(dtype)
    results = (jax.ShapeDtypeStruct((b, lq, hq, d), dt), jax.ShapeDtypeStruct((b, hq, lq),
                                                                               jnp.float32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", results)
    out, lse = jax.jit(lambda *a: call(*a, **attrs))(*(jnp.asarray(x, dt) for x in (q, k, v)),
                                                      *operands)
    out = np.asarray(out.astype(jnp.float32)).transpose(0, 2, 1, 3)
    lse = np.asarray(lse)
    q64, k64, v64 = (x.transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v))
    k64, v64 = np.nan_to_num(k64, nan=0.0), np.nan_to_num(v64, nan=0.0)
    want, want_lse = oracle.forward(q64, k64, v64, scale=1 / np.sqrt(d),
                                    sinks=sinks.astype(np.float64), kv_lengths=kvl,
                                    window_right=0, bottom_right=True)
    g = hq // hk
    finite = np.ones(hq, bool)
    if b == 1:
        finite[(hk - 1) * g:] = False
        assert np.isnan(out[-1, ~finite]).all() and np.isnan(lse[-1, ~finite]).all()
    assert _rel(out[:, finite], want[:, finite]) <= _tol(dtype)
    assert _lse_err(lse[:, finite], want_lse[:, finite]) <= LSE_ATOL


@pytest.mark.parametrize("shape", [(1, 16, 16, 300, 130, 64), (2, 32, 8, 65, 200, 128),
                                   (1, 4, 2, 40, 90, 32)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}".format(*s))
def test_prefill_from_a_slot_major_cache(shape, rng):
    """[B, L, H, D] prefill: with more than 256 query rows a kv head (the first two shapes) K
    and V are copied head-major once before the tiles run, else read in place; an additive
    mask, lengths, NaN past them."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = _normal(rng, b, lq, hq, d), _normal(rng, b, lk, hk, d), _normal(rng, b, lk, hk, d)
    kvl = rng.integers(lk // 2, lk + 1, size=b).astype(np.int32)
    k[0, kvl[0]:] = np.nan
    v[0, kvl[0]:] = np.nan
    bias = _normal(rng, 1, hq, lq, lk)
    operands, attrs = ffi_call_args(scale=1 / np.sqrt(d), kv_lengths=kvl, mask=bias,
                                    seq_major=True)
    results = (jax.ShapeDtypeStruct((b, lq, hq, d), jnp.float32),
               jax.ShapeDtypeStruct((b, hq, lq), jnp.float32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", results)
    out, lse = jax.jit(lambda *a: call(*a, **attrs))(q, k, v, *operands)
    q64, k64, v64 = (np.nan_to_num(x.transpose(0, 2, 1, 3).astype(np.float64)) for x in (q, k, v))
    want, want_lse = oracle.forward(q64, k64, v64, scale=1 / np.sqrt(d), kv_lengths=kvl,
                                    mask=bias.astype(np.float64))
    assert _rel(np.asarray(out).transpose(0, 2, 1, 3), want) <= RTOL
    assert _lse_err(lse, want_lse) <= LSE_ATOL


@pytest.mark.parametrize("case", ["causal", "window", "segments", "lengths"])
def test_prefill_tiles_sharing_a_task(case, rng):
    """Prefill whose kv heads hold more than a MiB of K and V: on AVX2 builds consecutive
    query tiles of a head share a task and walk the key blocks together (kWideTilesPerTask),
    each over its own keys (a sliding window starts every tile at other keys); other builds
    run them a tile a task. Against the float64 oracle, [B, H, L, D] layout, 66 tiles a kv
    head with a wide last tile."""
    b, hq, hk, lq, lk, d = 1, 4, 2, 2085, 2085, 128
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    kw, want_kw = dict(scale=1 / np.sqrt(d)), {}
    if case == "causal":
        kw.update(window_right=0, bottom_right=True)
        want_kw["mask"] = "causal"
    elif case == "window":
        kw.update(window_left=300, window_right=0, bottom_right=True)
        want_kw.update(window_left=300, window_right=0, bottom_right=True)
    elif case == "segments":
        ids = np.repeat(np.arange(7, dtype=np.int32), -(-lq // 7))[None, :lq]
        kw.update(q_segment_ids=ids, kv_segment_ids=ids)
        want_kw["q_segment_ids"] = ids
    else:
        kvl = np.array([1500], np.int32)
        k[:, :, kvl[0]:] = np.nan
        v[:, :, kvl[0]:] = np.nan
        kw["kv_lengths"] = want_kw["kv_lengths"] = kvl
    out, lse = _call_fwd(q, k, v, **kw)
    q64, k64, v64 = (np.nan_to_num(x.astype(np.float64)) for x in (q, k, v))
    want, want_lse = oracle.forward(q64, k64, v64, scale=1 / np.sqrt(d), **want_kw)
    assert _rel(out, want) <= RTOL
    assert _lse_err(lse, want_lse) <= LSE_ATOL


# ---------------------------------------------------------------------------
# the paged forward (pages read in place)

@pytest.mark.parametrize("layout", ["PHSD", "PSHD"])
@pytest.mark.parametrize("case", [  # b, hq, hk, lq, d, page, pages_per_seq, dtype
    (2, 8, 2, 1, 64, 16, 80, "float32"),   # decode, keys split across threads
    (3, 4, 4, 3, 32, 24, 5, "bfloat16"),   # page size not a divisor of the key block
    (1, 2, 1, 17, 24, 8, 9, "float32"),    # chunked prefill: wide tiles
], ids=str)
def test_paged_forward_reads_pages_in_place(layout, case, rng):
    import jax_sdpa

    b, hq, hk, lq, d, s, pps, dtype = case
    dt = jnp.dtype(dtype)
    num_pages = b * pps + 3
    lengths = rng.integers(lq, pps * s + 1, size=b).astype(np.int32)
    k = rng.standard_normal((b, hk, pps * s, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, pps * s, d)).astype(np.float32)
    k, v = (np.asarray(jnp.asarray(x, dt).astype(jnp.float32)) for x in (k, v))
    table = rng.permutation(num_pages)[: b * pps].reshape(b, pps).astype(np.int32)
    pool_k = np.full((num_pages, hk, s, d), np.nan, np.float32)  # unused pages: NaN
    pool_v = np.full((num_pages, hk, s, d), np.nan, np.float32)
    for bi in range(b):
        for j in range(pps):
            if j * s < lengths[bi]:  # pages past the length stay NaN: never read
                pool_k[table[bi, j]] = k[bi, :, j * s:(j + 1) * s]
                pool_v[table[bi, j]] = v[bi, :, j * s:(j + 1) * s]
    if layout == "PSHD":
        pool_k, pool_v = pool_k.transpose(0, 2, 1, 3), pool_v.transpose(0, 2, 1, 3)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    q = np.asarray(jnp.asarray(q, dt).astype(jnp.float32))
    sinks = rng.standard_normal(hq).astype(np.float32)
    sinks = np.asarray(jnp.asarray(sinks, dt).astype(jnp.float32))
    for cap in (None, 4.0):
        got = jax.jit(lambda q, kp, vp, t, n: jax_sdpa.paged_attention(
            q, kp, vp, t, n, mask="causal", sinks=jnp.asarray(sinks, dt), logits_soft_cap=cap,
            kv_layout=layout, implementation="cpu"))(
                *(jnp.asarray(x, dt) for x in (q, pool_k, pool_v)), table, lengths)
        got = np.asarray(got.astype(jnp.float32))
        assert np.isfinite(got).all()
        kz, vz = np.nan_to_num(k), np.nan_to_num(v)
        want, _ = oracle.forward(q.astype(np.float64), kz.astype(np.float64),
                                 vz.astype(np.float64), sinks=sinks.astype(np.float64),
                                 kv_lengths=lengths, window_right=0, bottom_right=True,
                                 logits_soft_cap=cap)
        assert _rel(got, want) <= _tol(dtype), cap


# ---------------------------------------------------------------------------
# bfloat16 products (the x86-64-v4-bf16 variant: VDPBF16PS, P rounded to bfloat16)

def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_bf16_variant_is_picked_where_the_cpu_has_avx512_bf16():
    """The variant in use on a CPU with AVX512-BF16 is the one with the bf16 products, and
    JAX_SDPA_CPU_ISA=v4 still caps it at plain AVX-512 (checked in a fresh process: the pick
    happens once)."""
    import os
    import subprocess
    import sys
    flags = _cpu_flags()
    if not {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16"} <= flags:
        pytest.skip("this CPU has no AVX512-BF16")
    if os.environ.get("JAX_SDPA_CPU_ISA"):
        pytest.skip("JAX_SDPA_CPU_ISA caps the variant in this run")
    assert _ext.module("_sdpa_cpu").isa() == "x86-64-v4-bf16"
    code = "from jax_sdpa import _ext; print(_ext.module('_sdpa_cpu').isa())"
    env = dict(os.environ, JAX_SDPA_CPU_ISA="v4")
    # cwd "/": from the repository root `-c` would import the source tree's jax_sdpa, which
    # has no compiled modules
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/", check=True).stdout.split()
    assert out[-1] == "x86-64-v4"


def test_amx_tiles_where_the_cpu_and_os_allow_and_off_by_env():
    """Where the x86-64-v4-bf16 variant runs on a CPU with AMX-BF16 and AMX-TILE, the bf16
    products that read their left operand along its pairs (S^T, dP^T) run on AMX tiles; with
    JAX_SDPA_CPU_AMX=0 they stay on VDPBF16PS, and the prefill-shaped bf16 cases whose head
    dims fill whole tiles (D 64, 128) still match float64 (in a fresh process: the choice
    happens once)."""
    import os
    import subprocess
    import sys
    m = _ext.module("_sdpa_cpu")
    if m.isa() != "x86-64-v4-bf16" or not {"amx_bf16", "amx_tile"} <= _cpu_flags():
        assert not m.amx()
        pytest.skip("no AMX-BF16 under the bf16 variant here")
    if os.environ.get("JAX_SDPA_CPU_AMX") == "0":
        pytest.skip("JAX_SDPA_CPU_AMX=0 in this run")
    assert m.amx()
    env = dict(os.environ, JAX_SDPA_CPU_AMX="0")
    code = "from jax_sdpa import _ext; print(_ext.module('_sdpa_cpu').amx())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd="/", check=True).stdout.split()
    assert out[-1] == "False"
    # -P: from the repository root `-m` would put the source tree's jax_sdpa (no compiled
    # modules) first on the path
    run = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-n", "0",
         "-k", "test_bf16_forward_and_backward_match_float64 and (d64v64 or d128v128)"],
        env=env, capture_output=True, text=True)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-2000:]


BF16_SHAPES = [  # b, hq, hk, lq, lk, d, dv: prefill-shaped tiles (more than 8 rows a kv head)
    (1, 4, 2, 37, 37, 64, 64),
    (2, 3, 1, 130, 201, 80, 80),
    (1, 2, 2, 77, 65, 128, 128),
    (1, 4, 1, 45, 99, 33, 17),   # odd D, Dv and key counts: zero-padded pairs
]


def _bf16_case(rng, shape, case, short):
    """bf16-valued float32 q, k, v of `shape` (b, hq, hk, lq, lk, d, dv), the first row's keys
    cut `short` below lk, sinks, and `case`'s feature: (q, k, v, kw for the targets, ow for
    the oracle, extra target operands)."""
    b, hq, hk, lq, lk, d, dv = shape
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q, k, v = (np.array(bf(_normal(rng, *s)).astype(jnp.float32))
               for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)))
    kvl = np.array([lk - short] + [lk] * (b - 1), np.int32)
    sinks = _normal(rng, 1, hq)
    kw = dict(scale=1 / np.sqrt(d), kv_lengths=kvl, sinks=sinks)
    ow = dict(scale=1 / np.sqrt(d), kv_lengths=kvl, sinks=sinks[0].astype(np.float64))
    extra = {}
    if case == "causal":
        kw.update(window_right=0, bottom_right=True)
        ow.update(window_right=0, bottom_right=True)
    elif case == "mask":
        mask = rng.random((b, 1, lq, lk)) < 0.6
        extra = dict(mask=jnp.asarray(mask))
        ow.update(mask=mask)
    elif case == "segments":
        qs, ks = _segments(rng, b, lq, "sorted"), _segments(rng, b, lk, "sorted")
        kw.update(q_segment_ids=qs, kv_segment_ids=ks)
        ow.update(q_segment_ids=qs, kv_segment_ids=ks)
    elif case == "softcap":
        q = q * 4  # logits the cap bends
        kw.update(logits_soft_cap=5.0)
        ow.update(logits_soft_cap=5.0)
    return q, k, v, kw, ow, extra


@pytest.mark.parametrize("case", ["plain", "causal", "mask", "segments", "softcap"])
@pytest.mark.parametrize("shape", BF16_SHAPES,
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}v{}".format(*s))
def test_bf16_forward_and_backward_match_float64(shape, case, rng):
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q, k, v, kw, ow, extra = _bf16_case(rng, shape, case, short=3)
    out, lse = _call_fwd(bf(q), bf(k), bf(v), **kw, **extra)
    want, want_lse = oracle.forward(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), **ow)
    # The output's own rounding to bf16 is 2^-9 relative; P's rounding adds less.
    bf16 = dict(case="cpu_bfloat16")
    assert _rel(out.astype(np.float32), want) <= oracle.tolerance("bfloat16", **bf16)
    # Scores are exact products summed in float32: lse is float32-accurate.
    assert _lse_err(lse, want_lse) <= oracle.lse_tolerance("bfloat16", "cpu")
    # The backward (S^T and dP^T by bf16 pairs) from our forward's outputs. Its rowsum(dout *
    # out) takes the bf16 output's rounding, which short packed segments (dP - D cancelling)
    # lift to 1e-2 of a gradient for any bf16 backward: the oracle starts from the same out.
    dout = np.asarray(bf(_normal(rng, *out.shape)).astype(jnp.float32))
    grads = _call_bwd(bf(q), bf(k), bf(v), out, lse, bf(dout), **kw, **extra)
    wg = oracle.backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                         dout.astype(np.float64), out=out, **ow)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert _rel(g, wg[name]) <= oracle.tolerance("bfloat16", grad=True, **bf16), name


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 4, 1, 150, 150, 64, 64), (1, 2, 1, 260, 300, 128, 128),
                                   (1, 6, 2, 100, 190, 80, 80)],
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}v{}".format(*s))
def test_bf16_prefill_of_many_tiles_matches_float64(shape, causal, rng):
    """bf16 prefill of at least four query tiles a kv head: on AMX, K's rows are read in
    place and V^T is packed once for every tile (whole key blocks and the call's last; a
    block cut short by a row's length or a GQA tile's causal end packs its own). Per-row
    lengths end mid-block with NaN past them, never read."""
    b, hq, hk, lq, lk, d, dv = shape
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q, k, v = (np.array(bf(_normal(rng, *s)).astype(jnp.float32))
               for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)))
    kvl = np.array([lk] + [lk - 37] * (b - 1), np.int32) if b > 1 else np.array([lk - 45],
                                                                                np.int32)
    for bb in range(b):
        k[bb, :, kvl[bb]:] = np.nan
        v[bb, :, kvl[bb]:] = np.nan
    kw = dict(scale=1 / np.sqrt(d), kv_lengths=kvl)
    if causal:
        kw.update(window_right=0, bottom_right=True)
    out, lse = _call_fwd(bf(q), bf(k), bf(v), **kw)
    want, want_lse = oracle.forward(q.astype(np.float64), np.nan_to_num(k.astype(np.float64)),
                                    np.nan_to_num(v.astype(np.float64)), **kw)
    assert np.isfinite(out.astype(np.float32)).all()
    assert _rel(out.astype(np.float32), want) <= oracle.tolerance("bfloat16", case="cpu_bfloat16")
    assert _lse_err(lse, want_lse) <= oracle.lse_tolerance("bfloat16", "cpu")


BF16_DECODE_SHAPES = [  # b, hq, hk, lq, lk, d, dv: decode-shaped tiles (at most 8 rows)
    (1, 8, 2, 1, 300, 48, 48),      # D an odd multiple of 16: a half vector of bf16 pairs
    (2, 8, 1, 1, 257, 128, 80),     # 8 rows; Dv = 2.5 vectors of pairs; odd key count
    (1, 4, 4, 2, 77, 16, 16),       # one head a kv head, two queries
    (1, 16, 4, 1, 1100, 256, 256),  # Dv = 8 vectors of pairs in one pass; keys split
    (1, 6, 3, 1, 65, 64, 112),      # Dv != D
]


@pytest.mark.parametrize("case", ["plain", "causal", "mask", "softcap"])
@pytest.mark.parametrize("seq_major", [False, True], ids=["bhld", "blhd"])
@pytest.mark.parametrize("shape", BF16_DECODE_SHAPES,
                         ids=lambda s: "b{}h{}k{}q{}k{}d{}v{}".format(*s))
def test_bf16_decode_tiles_match_float64(shape, seq_major, case, rng):
    """bfloat16 decode-shaped tiles: on the x86-64-v4-bf16 variant both products run by
    VDPBF16PS (K and Q paired along d, two keys' V rows paired with their probabilities
    rounded to bf16); elsewhere the rows are widened. Either way the output is within a few
    of its own bf16 roundings of the float64 oracle, with lengths, sinks, a bool mask or the
    soft cap; a NaN key reaches only its kv head's rows."""
    b, hq, hk, lq, lk, d, dv = shape
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q, k, v, kw, ow, extra = _bf16_case(rng, shape, case, short=2)
    k[0, 0, lk - 1] = np.nan  # past row 0's length: never read
    v[0, 0, lk - 1] = np.nan
    want, want_lse = oracle.forward(q.astype(np.float64), k.astype(np.float64),
                                    v.astype(np.float64), **ow)
    layout = (lambda x: x.transpose(0, 2, 1, 3)) if seq_major else (lambda x: x)
    operands, attrs = ffi_call_args(**kw, **extra, seq_major=seq_major)
    out_shape = layout(np.zeros((b, hq, lq, dv), np.float32)).shape
    results = (jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
               jax.ShapeDtypeStruct((b, hq, lq), jnp.float32))
    call = jax.ffi.ffi_call("jax_sdpa_cpu_fwd", results)
    out, lse = jax.jit(lambda *a: call(*a, **attrs))(*(bf(layout(x)) for x in (q, k, v)),
                                                      *operands)
    out = layout(np.asarray(out.astype(jnp.float32)))
    # The output's own rounding to bf16 is 2^-9 relative; P's rounding adds less.
    assert _rel(out, want) <= oracle.tolerance("bfloat16", case="cpu_bfloat16")
    # Scores are exact products summed in float32: lse is float32-accurate.
    assert _lse_err(lse, want_lse) <= oracle.lse_tolerance("bfloat16", "cpu")
    if case == "plain" and b > 1:  # a NaN key in row 1's range reaches kv head 0's rows only
        k[1, 0, 3] = np.nan
        out, _ = jax.jit(lambda *a: call(*a, **attrs))(*(bf(layout(x)) for x in (q, k, v)),
                                                        *operands)
        out = layout(np.asarray(out.astype(jnp.float32)))
        g = hq // hk
        assert np.isnan(out[1, :g]).all() and np.isfinite(out[1, g:]).all()
        assert np.isfinite(out[0]).all()


def test_long_calls_on_a_busy_machine(rng):
    """With twice as many spinning processes as cores, the pool finds the cores contended and
    offers long calls (forward, backward, a long decode) to its extra threads; every call,
    before and after the switch, matches the float64 oracle. Once the spinners stop, the
    verdict ends by itself within busy_verdict_seconds() while only short calls run (they
    never measure the cores), and those still match."""
    import subprocess
    import sys
    import time
    cpu = _ext.module("_sdpa_cpu")
    if cpu.num_threads() < 2:
        pytest.skip("one thread: the pool has no extra threads")
    b, hq, hk, lq, lk, d = 1, 4, 2, 512, 2048, 64  # 4 * 512 * 2048 * 128 multiply-adds: long
    q, k, v = _normal(rng, b, hq, lq, d), _normal(rng, b, hk, lk, d), _normal(rng, b, hk, lk, d)
    dout = _normal(rng, b, hq, lq, d)
    kw = dict(scale=1 / np.sqrt(d), window_right=0, bottom_right=True)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    want, want_lse = oracle.forward(q64, k64, v64, **kw)
    want_grads = oracle.backward(q64, k64, v64, dout.astype(np.float64), **kw)
    dq_, dk_, dv_ = (32, 2, 16384)  # one-query decode over 2 x 16384 x 128 float32 keys: long
    dq_in = _normal(rng, 1, dq_, 1, 128)
    dk_in, dv_in = _normal(rng, 1, dk_, dv_, 128), _normal(rng, 1, dk_, dv_, 128)
    want_decode, _ = oracle.forward(*(x.astype(np.float64) for x in (dq_in, dk_in, dv_in)),
                                    scale=0.125)

    def check():
        out, lse = _call_fwd(q, k, v, **kw)
        assert _rel(out, want) <= RTOL and _lse_err(lse, want_lse) <= LSE_ATOL
        grads = _call_bwd(q, k, v, out, lse, dout, **kw)
        for name, got in zip(("dq", "dk", "dv"), grads):
            assert _rel(got, want_grads[name]) <= GRAD_RTOL, name
        out, _ = _call_fwd(dq_in, dk_in, dv_in, scale=0.125)
        assert _rel(out, want_decode) <= RTOL

    check()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(2 * cpu.num_threads())]
    try:
        time.sleep(0.5)
        deadline = time.monotonic() + 60
        while not cpu.oversubscribed() and time.monotonic() < deadline:
            check()
        assert cpu.oversubscribed(), "the pool did not find the cores contended"
        check()
        check()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    short_q, short_kv = _normal(rng, 1, 8, 1, 64), _normal(rng, 1, 2, 256, 64)  # a short decode
    want_short, _ = oracle.forward(short_q.astype(np.float64), short_kv.astype(np.float64),
                                   short_kv.astype(np.float64), scale=0.125)
    deadline = time.monotonic() + cpu.busy_verdict_seconds() + 1.0
    while cpu.oversubscribed() and time.monotonic() < deadline:
        out, _ = _call_fwd(short_q, short_kv, short_kv, scale=0.125)
        assert _rel(out, want_short) <= RTOL
    assert not cpu.oversubscribed(), "short calls on a quiet machine kept the busy verdict"
