"""Packed sequences (segment ids), logit soft-capping and the MLX entry's local windows, on
every implementation here, against the float64 oracle (jax_sdpa.oracle) and, for segment
ids, against jax.nn.dot_product_attention with the equivalent dense mask (jax.nn has no
soft cap). A fused backend runs these cases as soon as its target declares the feature
(`served_features()`); until then it is skipped, and only for that reason."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import _ext, oracle
from sdpa_testing import fp32_rtol, implementations_here, max_rel_error

IMPLS = implementations_here() + [None]


def _targets(impl, direction):
    if impl == "cuda":
        return ["jax_sdpa_cuda_fwd", "jax_sdpa_cuda_flash_fwd"] if direction == "fwd" else \
            ["jax_sdpa_cuda_flash_bwd"]
    return [f"jax_sdpa_{impl}_{direction}"]


def skip_unless_served(impl, features, directions=("fwd",)):
    """Skips a fused implementation whose targets don't declare `features` (the one reason
    a case may be skipped here); xla, xla_chunked and None always run."""
    if impl in (None, "xla", "xla_chunked"):
        return
    if impl == "cudnn":  # these cases are float32, which cuDNN's SDPA doesn't take
        pytest.skip("cuDNN serves 16-bit inputs only")
    for direction in directions:
        served = set()
        for target in _targets(impl, direction):
            served |= _ext.served_features(target)
        missing = set(features) - served
        if missing:
            pytest.skip(f"{impl} {direction} does not serve {sorted(missing)} yet")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int = 2
    hq: int = 4
    hk: int = 2
    lq: int = 37
    lk: int = 37
    d: int = 16
    segments: str = "sorted"  # none | sorted | singletons | unsorted | cross
    mask: Optional[str] = None  # None | causal | additive
    window: Optional[tuple] = None
    sinks: bool = False
    kv_lengths: bool = False
    cap: Optional[float] = None

    @property
    def features(self):
        f = set()
        if self.segments != "none":
            f.add("segment_ids")
        if self.cap:
            f.add("logits_soft_cap")
        return f


CASES = [
    Case("packed_causal", mask="causal"),
    Case("singletons_causal", segments="singletons", mask="causal", lq=9, lk=9),
    Case("unsorted_gqa", segments="unsorted", hq=6, hk=2, lq=21, lk=21),
    Case("cross_empty_rows", segments="cross", lq=5, lk=23, kv_lengths=True, sinks=True),
    Case("softcap_additive_sinks", segments="none", cap=1.5, mask="additive", sinks=True,
         lq=11, lk=19),
    Case("softcap_segments_window", cap=5.0, window=(4, 2), sinks=True, hq=4, hk=1),
    Case("window_causal_lengths", segments="none", window=(3, 5), mask="causal", lq=7,
         lk=19, kv_lengths=True),
    Case("decode_segments", segments="cross", lq=1, lk=33, hq=8, hk=2, cap=30.0),
    # long enough for xla_chunked's (query block, key block) tiles, some of which can't meet
    Case("long_packed_tiles", lq=600, lk=600, d=8, hq=2, hk=1, mask="causal", sinks=True,
         kv_lengths=True, cap=20.0),
    Case("long_cross_tiles", segments="cross", lq=290, lk=410, d=8, hq=2, hk=1),
]


def _segment_ids(case, rng):
    b, lq, lk = case.b, case.lq, case.lk
    if case.segments == "none":
        return None, None
    if case.segments == "sorted":
        return np.sort(rng.integers(0, 5, (b, lq)), axis=1).astype(np.int32), None
    if case.segments == "singletons":
        return np.tile(np.arange(lq, dtype=np.int32), (b, 1)), None
    if case.segments == "unsorted":
        return rng.integers(-2, 3, (b, lq)).astype(np.int32), None
    # cross: queries with ids some keys share, one query id no key has (an empty row)
    q_ids = rng.integers(0, 3, (b, lq)).astype(np.int32)
    q_ids[:, 0] = 7
    return q_ids, rng.integers(0, 3, (b, lk)).astype(np.int32)


def _inputs(case, rng):
    q = rng.standard_normal((case.b, case.hq, case.lq, case.d)).astype(np.float32)
    k = rng.standard_normal((case.b, case.hk, case.lk, case.d)).astype(np.float32)
    v = rng.standard_normal((case.b, case.hk, case.lk, case.d)).astype(np.float32)
    q_ids, kv_ids = _segment_ids(case, rng)
    mask = case.mask
    if mask == "additive":
        mask = rng.standard_normal((1, case.hq, case.lq, case.lk)).astype(np.float32)
    sinks = rng.standard_normal(case.hq).astype(np.float32) if case.sinks else None
    kvl = None
    if case.kv_lengths:
        kvl = rng.integers(1, case.lk + 1, case.b).astype(np.int32)
    return dict(q=q, k=k, v=v, mask=mask, sinks=sinks, q_ids=q_ids, kv_ids=kv_ids, kvl=kvl)


def _window_args(case):
    """The oracle's (window_left, window_right, bottom_right) for the MLX entry's rules."""
    left, right = (-1, -1) if case.window is None else case.window
    if case.mask == "causal":
        right = 0 if right < 0 else min(right, 0)
    return left, right, left >= 0 or right >= 0


def _oracle_kwargs(case, x):
    left, right, bottom_right = _window_args(case)
    mask = None if case.mask in (None, "causal") else x["mask"]
    return dict(mask=mask, sinks=x["sinks"], kv_lengths=x["kvl"], window_left=left,
                window_right=right, bottom_right=bottom_right, q_segment_ids=x["q_ids"],
                kv_segment_ids=x["kv_ids"], logits_soft_cap=case.cap)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_and_grads_against_oracle(impl, case, rng):
    skip_unless_served(impl, case.features, ("fwd", "bwd"))
    x = _inputs(case, rng)

    def f(q, k, v, mask):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=x["sinks"], key_value_seq_lengths=x["kvl"],
            q_segment_ids=x["q_ids"], kv_segment_ids=x["kv_ids"], logits_soft_cap=case.cap,
            local_window_size=case.window, implementation=impl)

    mask = x["mask"]
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v")]
    out = f(*args, mask)
    want, _ = oracle.forward(x["q"], x["k"], x["v"], **_oracle_kwargs(case, x))
    err = max_rel_error(out, want)
    assert err <= fp32_rtol(impl), f"forward error {err:.3g}"

    dout = rng.standard_normal(out.shape).astype(np.float32)
    additive = isinstance(mask, np.ndarray)
    if additive:
        _, pullback = jax.vjp(f, *args, jnp.asarray(mask))
    else:
        _, pullback = jax.vjp(lambda q, k, v: f(q, k, v, mask), *args)
    grads = pullback(jnp.asarray(dout))
    want_g = oracle.backward(x["q"], x["k"], x["v"], dout, **_oracle_kwargs(case, x))
    names = ["dq", "dk", "dv"] + (["dmask"] if additive else [])
    for g, name in zip(grads, names):
        assert np.isfinite(np.asarray(g)).all(), f"{name} not finite"
        err = max_rel_error(g, want_g[name])
        assert err <= fp32_rtol(impl, oracle.FP32_GRAD_RTOL, grad=True), \
            f"{name} error {err:.3g}"


def _dense_segment_mask(q_ids, kv_ids):
    kv_ids = q_ids if kv_ids is None else kv_ids
    return (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]  # [B, 1, T, S]


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments", ["sorted", "singletons", "cross"])
def test_jax_nn_entry_against_jax_nn_dense_mask(impl, causal, segments, rng):
    """Our jax.nn entry with segment ids = jax.nn's xla with the equivalent bool mask, rows
    that see no key included (jax.nn averages the values of a fully masked row)."""
    skip_unless_served(impl, {"segment_ids"}, ("fwd", "bwd"))
    b, t, n, kh, h = 2, 13, 4, 2, 8
    s = t if segments != "cross" else 17
    case = Case("x", b=b, lq=t, lk=s, segments=segments)
    q_ids, kv_ids = _segment_ids(case, rng)
    if causal and segments == "cross":
        q_ids[1, 3] = 7  # another empty row, past the first under causal
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, s, kh, h)), jnp.float32)
    dense = jnp.asarray(_dense_segment_mask(q_ids, kv_ids))

    def ours(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=causal, q_segment_ids=q_ids,
                                              kv_segment_ids=kv_ids, implementation=impl)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense, is_causal=causal,
                                            implementation="xla")

    with jax.default_matmul_precision("highest"):
        out, pull = jax.vjp(ours, q, k, v)
        want, pull_want = jax.vjp(theirs, q, k, v)
        dout = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
        grads, want_grads = pull(dout), pull_want(dout)
    assert max_rel_error(out, want) <= fp32_rtol(impl) * 4
    for g, w, name in zip(grads, want_grads, ("dq", "dk", "dv")):
        err = max_rel_error(g, w)
        assert err <= fp32_rtol(impl, oracle.FP32_GRAD_RTOL, grad=True) * 4, f"{name} {err:.3g}"


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_jax_nn_entry_soft_cap_against_oracle(impl, rng):
    """The jax.nn entry's cap: before the bias, with its top-left causal and GQA."""
    skip_unless_served(impl, {"logits_soft_cap"}, ("fwd", "bwd"))
    b, t, s, n, kh, h = 2, 9, 14, 4, 1, 16
    q = rng.standard_normal((b, t, n, h)).astype(np.float32)
    k = rng.standard_normal((b, s, kh, h)).astype(np.float32) * 3
    v = rng.standard_normal((b, s, kh, h)).astype(np.float32)
    bias = rng.standard_normal((1, n, t, s)).astype(np.float32)
    cap = 0.7

    def ours(q, k, v, bias):
        return jax_sdpa.dot_product_attention(q, k, v, bias=bias, is_causal=True,
                                              logits_soft_cap=cap, implementation=impl)

    out, pull = jax.vjp(ours, *(jnp.asarray(a) for a in (q, k, v, bias)))
    kw = dict(mask=bias, window_right=0, seq_major=True, logits_soft_cap=cap)
    want, _ = oracle.forward(q, k, v, **kw)
    assert max_rel_error(out, want) <= fp32_rtol(impl)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = pull(jnp.asarray(dout))
    want_g = oracle.backward(q, k, v, dout, **kw)
    for g, name in zip(grads, ("dq", "dk", "dv", "dmask")):
        err = max_rel_error(g, want_g[name])
        assert err <= fp32_rtol(impl, oracle.FP32_GRAD_RTOL, grad=True), f"{name} {err:.3g}"


def test_oracle_soft_cap_and_segments_from_first_principles(rng):
    """The oracle's two new rules, checked against a direct computation: a per-segment loop
    of plain softmax attention over capped logits."""
    b, h, l, d, cap = 1, 1, 10, 4, 0.9
    q, k, v = (rng.standard_normal((b, h, l, d)) for _ in range(3))
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 5]], np.int32)
    got, _ = oracle.forward(q, k, v, q_segment_ids=ids, logits_soft_cap=cap)
    want = np.zeros_like(got)
    for seg in np.unique(ids):
        idx = np.flatnonzero(ids[0] == seg)
        logits = q[0, 0, idx] @ k[0, 0, idx].T / np.sqrt(d)
        logits = cap * np.tanh(logits / cap)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        want[0, 0, idx] = (p / p.sum(-1, keepdims=True)) @ v[0, 0, idx]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # gradients: finite differences of the float64 oracle
    dout = rng.standard_normal(got.shape)
    grads = oracle.backward(q, k, v, dout, q_segment_ids=ids, logits_soft_cap=cap)
    eps = 1e-6
    for name, x in (("dq", q), ("dk", k)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = {"dq": (xp, k), "dk": (q, xp)}[name]
            argm = {"dq": (xm, k), "dk": (q, xm)}[name]
            fp = oracle.forward(*args, v, q_segment_ids=ids, logits_soft_cap=cap)[0]
            fm = oracle.forward(*argm, v, q_segment_ids=ids, logits_soft_cap=cap)[0]
            num[idx] = np.sum((fp - fm) * dout) / (2 * eps)
        np.testing.assert_allclose(grads[name], num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_window_in_mlx_entry_composes_with_sinks(impl, rng):
    """local_window_size in the MLX entry: bottom-right aligned (offset Lk - Lq), with sinks
    and with mask='causal' (right = min(right, 0))."""
    skip_unless_served(impl, ())
    b, hq, hk, lq, lk, d = 2, 4, 2, 6, 20, 32
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    sinks = rng.standard_normal(hq).astype(np.float32)
    for window, mask, (left, right) in [(3, None, (3, 3)), ((5, 0), None, (5, 0)),
                                        ((2, 4), "causal", (2, 0)), (7, "causal", (7, 0))]:
        out = jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=sinks, local_window_size=window, implementation=impl)
        want, _ = oracle.forward(q, k, v, sinks=sinks, window_left=left, window_right=right,
                                 bottom_right=True)
        assert max_rel_error(out, want) <= fp32_rtol(impl), (window, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("segments", ["sorted", "singletons", "cross"])
def test_cudnn_serves_segment_ids_as_a_mask(causal, segments, rng):
    """16-bit segment ids on cuDNN (the ids become a [B, 1, Lq, Lk] -inf mask in the
    lowering): forward and grads against jax.nn's xla with the equivalent bool mask in
    float32 on the same bf16 inputs, within the bf16 tolerance policy; None picks it."""
    if "cudnn" not in implementations_here():
        pytest.skip("no cuDNN here")
    b, t, n, kh, h = 2, 77, 4, 2, 64
    s = t if segments != "cross" else 93
    q_ids, kv_ids = _segment_ids(Case("x", b=b, lq=t, lk=s, segments=segments), rng)
    dense = jnp.asarray(_dense_segment_mask(q_ids, kv_ids))
    q, k, v, dout = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in
                     ((b, t, n, h), (b, s, kh, h), (b, s, kh, h), (b, t, n, h)))

    def ours(impl):
        return lambda q, k, v: jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
            implementation=impl)

    def jax_nn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=dense, is_causal=causal,
                                            implementation="xla")

    def run(fn, *args):
        out, pull = jax.vjp(fn, *args)
        return (out, *pull(dout.astype(out.dtype)))

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        want = run(jax_nn, *f32)
    same_dtype = run(jax_nn, q, k, v)
    assert jax_sdpa.explain(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2),
                            q_segment_ids=q_ids, kv_segment_ids=kv_ids).chosen == "cudnn"
    for impl in ("cudnn", None):
        got = run(ours(impl), q, k, v)
        for g, w, x, name in zip(got, want, same_dtype, ("out", "dq", "dk", "dv")):
            tol = oracle.tolerance("bfloat16", xla_error=max_rel_error(x, w))
            err = max_rel_error(g, w)
            assert err <= tol, f"{impl} {name} {err:.3g} > {tol:.3g}"


CUDNN_SOFT_CAP_CASES = [
    Case("plain_gqa", b=2, hq=8, hk=2, lq=200, lk=200, d=64, segments="none", cap=1.5),
    Case("causal_d128", b=1, hq=4, hk=4, lq=333, lk=333, d=128, segments="none",
         mask="causal", cap=5.0),
    Case("bottom_right", b=2, hq=4, hk=2, lq=77, lk=300, d=128, segments="none",
         mask="causal", cap=2.0),
    Case("rows_without_keys", b=1, hq=2, hk=1, lq=130, lk=60, d=64, segments="none",
         mask="causal", cap=2.0),
    Case("window", b=1, hq=4, hk=2, lq=257, lk=257, d=64, segments="none", window=(32, 0),
         cap=3.0),
    Case("additive_sinks", b=2, hq=4, hk=4, lq=100, lk=120, d=64, segments="none",
         mask="additive", sinks=True, cap=1.5),
    Case("packed_causal", b=2, hq=4, hk=2, lq=150, lk=150, d=64, mask="causal", cap=4.0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUDNN_SOFT_CAP_CASES, ids=lambda c: c.name)
def test_cudnn_soft_cap_against_oracle(case, rng):
    """16-bit soft-capped calls on cuDNN (its score modifier: the cap, then the band, length
    and bias masks): forward and grads against the float64 oracle on the same bf16 inputs,
    within the bf16 policy (2x our XLA path's error); None picks cuDNN for them."""
    if "cudnn" not in implementations_here():
        pytest.skip("no cuDNN here")
    x = _inputs(case, rng)
    for n in ("q", "k", "v", "sinks"):  # the oracle sees exactly the bf16 values used
        if x[n] is not None:
            x[n] = np.asarray(jnp.asarray(x[n], jnp.bfloat16).astype(jnp.float32))
    sinks = None if x["sinks"] is None else jnp.asarray(x["sinks"], jnp.bfloat16)
    args = [jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v")]
    kw = dict(mask=x["mask"], sinks=sinks, key_value_seq_lengths=x["kvl"],
              q_segment_ids=x["q_ids"], kv_segment_ids=x["kv_ids"], logits_soft_cap=case.cap,
              local_window_size=case.window)
    for direction in ("fwd", "bwd"):
        explanation = jax_sdpa.explain(*args, direction=direction, **kw)
        assert explanation.chosen == "cudnn", (direction, explanation.verdicts["cudnn"])
    dout = rng.standard_normal((case.b, case.hq, case.lq, case.d)).astype(np.float32)
    want, _ = oracle.forward(x["q"], x["k"], x["v"], **_oracle_kwargs(case, x))
    want_g = oracle.backward(x["q"], x["k"], x["v"], dout, **_oracle_kwargs(case, x))

    def run(impl):
        fn = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(  # noqa: E731
            q, k, v, implementation=impl, **kw)
        out, pull = jax.vjp(fn, *args)
        return (out, *pull(jnp.asarray(dout, out.dtype)))

    baseline = run("xla")
    for impl in ("cudnn", None):
        got = run(impl)
        for g, b, w, name in zip(got, baseline, (want, want_g["dq"], want_g["dk"],
                                                  want_g["dv"]), ("out", "dq", "dk", "dv")):
            assert np.isfinite(np.asarray(g.astype(jnp.float32))).all(), f"{impl} {name}"
            tol = oracle.tolerance("bfloat16", xla_error=max_rel_error(b, w))
            err = max_rel_error(g, w)
            assert err <= tol, f"{impl} {name} {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------
# dispatch: refusals name the feature; implementation=None never fails for want of it

@pytest.mark.parametrize("impl", [i for i in implementations_here()
                                  if i not in ("xla", "xla_chunked")])
@pytest.mark.parametrize("feature", ["segment_ids", "logits_soft_cap"])
def test_unserved_feature_is_refused_by_name(impl, feature, rng):
    q = jnp.zeros((1, 2, 8, 32), jnp.bfloat16 if impl == "cudnn" else jnp.float32)
    kw = ({"q_segment_ids": jnp.zeros((1, 8), jnp.int32)} if feature == "segment_ids"
          else {"logits_soft_cap": 10.0})
    if jax_sdpa.explain(q, q, q, **kw).verdicts[impl][0]:  # its target, or cuDNN's mask
        pytest.skip(f"{impl} serves {feature}")
    text = "segment ids" if feature == "segment_ids" else "logits_soft_cap"
    with pytest.raises(NotImplementedError, match=text):
        jax_sdpa.scaled_dot_product_attention(q, q, q, implementation=impl, **kw)
    explanation = jax_sdpa.explain(q, q, q, **kw)
    ok, reason = explanation.verdicts[impl]
    assert not ok and text in reason
    assert explanation.chosen in ("xla", "xla_chunked") or \
        feature in _ext.served_features(_targets(explanation.chosen, "fwd")[0])
    out = jax_sdpa.scaled_dot_product_attention(q, q, q, **kw)  # None: never fails
    assert out.shape == q.shape


# ---------------------------------------------------------------------------
# bad arguments: trace-time errors naming the argument

def _q(b=2, h=2, l=8, d=16):
    return jnp.zeros((b, h, l, d), jnp.float32)


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(q_segment_ids=np.zeros((2, 7), np.int32)), ValueError, r"q_segment_ids.*\[2, 8\]"),
    (dict(q_segment_ids=np.zeros((8,), np.int32)), ValueError, "q_segment_ids"),
    (dict(q_segment_ids=np.zeros((2, 8), np.float32)), TypeError, "q_segment_ids.*int32"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int16)), ValueError, "q_segment_ids.*int32"),
    (dict(q_segment_ids=np.zeros((2, 8), bool)), TypeError, "q_segment_ids"),
    (dict(q_segment_ids=np.zeros((2, 8), np.int32), kv_segment_ids=np.zeros((2, 9), np.int32)),
     ValueError, r"kv_segment_ids.*\[B, Lk\]"),
    (dict(kv_segment_ids=np.zeros((2, 8), np.int32)), ValueError, "needs q_segment_ids"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap="10"), TypeError, "logits_soft_cap"),
    (dict(logits_soft_cap=True), TypeError, "logits_soft_cap"),
    (dict(logits_soft_cap=np.ones(2)), TypeError, "logits_soft_cap"),
    (dict(local_window_size=-2), ValueError, "local_window_size"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "local_window_size"),
    (dict(local_window_size=1.5), TypeError, "local_window_size"),
])
def test_bad_arguments_mlx_entry(kwargs, error, text):
    with pytest.raises(error, match=text):
        jax_sdpa.scaled_dot_product_attention(_q(), _q(), _q(), **kwargs)


def test_q_segment_ids_alone_needs_equal_lengths():
    with pytest.raises(ValueError, match="q_segment_ids alone.*kv_segment_ids"):
        jax_sdpa.scaled_dot_product_attention(_q(l=8), _q(l=9), _q(l=9),
                                              q_segment_ids=np.zeros((2, 8), np.int32))
    with pytest.raises(ValueError, match=r"q_segment_ids.*\[B, T\]"):
        jax_sdpa.dot_product_attention(jnp.zeros((2, 8, 2, 16)), jnp.zeros((2, 8, 2, 16)),
                                       jnp.zeros((2, 8, 2, 16)),
                                       q_segment_ids=np.zeros((2, 9), np.int32))


def test_traced_soft_cap_is_a_clear_error():
    with pytest.raises(TypeError, match="logits_soft_cap must be a static"):
        jax.jit(lambda c: jax_sdpa.scaled_dot_product_attention(
            _q(), _q(), _q(), logits_soft_cap=c))(1.0)


def test_segment_ids_unbatched_jax_nn_entry(rng):
    """[T, N, H] inputs take [T] ids."""
    t, n, h = 10, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((t, n, h)), jnp.float32) for _ in range(3))
    ids = np.array([0] * 4 + [1] * 6, np.int32)
    out = jax_sdpa.dot_product_attention(q, k, v, q_segment_ids=ids)
    want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(ids[:, None] == ids[None])[None])
    assert out.shape == (t, n, h)
    assert max_rel_error(out, want) < 1e-5


# ---------------------------------------------------------------------------
# transforms and memory

def test_vmap_over_segment_ids(rng):
    """vmap of q, k, v and the ids (the batching rule folds the ids with the batch)."""
    n, b, h, l, d = 3, 2, 2, 12, 8
    q, k, v = (rng.standard_normal((n, b, h, l, d)).astype(np.float32) for _ in range(3))
    ids = np.sort(rng.integers(0, 3, (n, b, l)), axis=-1).astype(np.int32)
    fn = lambda q, k, v, i: jax_sdpa.scaled_dot_product_attention(  # noqa: E731
        q, k, v, q_segment_ids=i, mask="causal", logits_soft_cap=2.0)
    got = jax.vmap(fn)(q, k, v, ids)
    grads = jax.vmap(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 1, 2)))(q, k, v, ids)
    for i in range(n):
        want = oracle.forward(q[i], k[i], v[i], q_segment_ids=ids[i], mask="causal",
                              logits_soft_cap=2.0)[0]
        assert max_rel_error(got[i], want) < 1e-5
        want_g = oracle.backward(q[i], k[i], v[i], np.ones(want.shape), q_segment_ids=ids[i],
                                 mask="causal", logits_soft_cap=2.0)
        for g, name in zip(grads, ("dq", "dk", "dv")):
            assert max_rel_error(g[i], want_g[name]) < 2e-5
    # ids shared by every vmapped call (not batched) and batched q only
    got = jax.vmap(fn, in_axes=(0, 0, 0, None))(q, k, v, ids[0])
    want = oracle.forward(q[1], k[1], v[1], q_segment_ids=ids[0], mask="causal",
                          logits_soft_cap=2.0)[0]
    assert max_rel_error(got[1], want) < 1e-5


@pytest.mark.parametrize("with_grad", [False, True])
def test_xla_chunked_segments_keep_linear_memory(with_grad):
    """Segment ids (and the soft cap) in xla_chunked never build an Lq x Lk array: the
    compiled temporaries are those of the same call without them, far below the 4 GiB an
    L x L bool segment mask would take at L = 65536."""
    b, h, length, d = 1, 4, 65536, 64
    x = jax.ShapeDtypeStruct((b, h, length, d), jnp.float32)
    ids = jax.ShapeDtypeStruct((b, length), jnp.int32)

    def temp_bytes(**kw):
        def fwd(q, k, v, ids):
            if kw:
                kw_ = dict(q_segment_ids=ids, logits_soft_cap=30.0)
            else:
                kw_ = {}
            return jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                         implementation="xla_chunked", **kw_)

        fn = fwd
        if with_grad:
            fn = jax.grad(lambda q, k, v, i: jnp.sum(fwd(q, k, v, i)), argnums=(0, 1, 2))
        return jax.jit(fn).lower(x, x, x, ids).compile().memory_analysis().temp_size_in_bytes

    plain, packed = temp_bytes(), temp_bytes(segments=True)
    print(f"xla_chunked temporaries: {plain / 2**20:.0f} MiB plain, {packed / 2**20:.0f} MiB "
          f"with segment ids + soft cap")
    assert packed < length * length / 4
    assert packed <= 1.25 * plain + 64 * length  # a few per-position arrays at most


@pytest.mark.parametrize("impl", ["xla", "xla_chunked", None], ids=str)
def test_forward_mode_agrees_with_reverse_mode(impl, rng):
    """jax.jvp (the reference's own derivative) and jax.vjp (the fused backward) of one call
    with segment ids, soft cap, window and sinks: <jvp(t), c> == <t, vjp(c)>."""
    b, hq, hk, l, d = 2, 4, 2, 19, 16
    q, k, v, tq, tk, tv = (jnp.asarray(rng.standard_normal((b, h, l, d)), jnp.float32)
                           for h in (hq, hk, hk, hq, hk, hk))
    ids = jnp.asarray(np.sort(rng.integers(0, 4, (b, l)), axis=1), jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)

    def f(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask="causal", sinks=sinks, q_segment_ids=ids, logits_soft_cap=1.5,
            local_window_size=(6, 0), implementation=impl)

    with jax.default_matmul_precision("highest"):
        _, out_t = jax.jvp(f, (q, k, v), (tq, tk, tv))
        out, pullback = jax.vjp(f, q, k, v)
        c = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
        gq, gk, gv = pullback(c)
    lhs = float(jnp.vdot(out_t, c))
    rhs = float(jnp.vdot(tq, gq) + jnp.vdot(tk, gk) + jnp.vdot(tv, gv))
    assert abs(lhs - rhs) <= 1e-4 * max(1.0, abs(lhs)), (lhs, rhs)
