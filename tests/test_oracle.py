"""The float64 oracle (jax_sdpa/oracle.py) and the dispatch plan.

The oracle is what every other test compares with, so it is checked here against first
principles: a direct softmax on tiny shapes, its own finite differences for the backward, and
the contract's NaN rules (a row whose visible logits hold a NaN is NaN; keys that are not
visible never reach anything, whatever they hold; a row with nothing to attend is zeros)."""

import numpy as np
import pytest

from jax_sdpa import oracle


def _direct(q, k, v, scale, visible, sink=None):
    """Softmax attention over the visible keys of one (batch, head), by definition."""
    out = np.zeros((q.shape[0], v.shape[1]))
    lse = np.full(q.shape[0], -np.inf)
    for i in range(q.shape[0]):
        js = np.flatnonzero(visible[i])
        logits = [scale * q[i] @ k[j] for j in js] + ([sink] if sink is not None else [])
        if not logits:
            continue
        m = max(logits)
        total = sum(np.exp(x - m) for x in logits)
        lse[i] = m + np.log(total)
        for j in js:
            out[i] += np.exp(scale * q[i] @ k[j] - lse[i]) * v[j]
    return out, lse


def test_forward_is_the_definition(rng):
    b, hq, hk, lq, lk, d, dv = 2, 4, 2, 5, 7, 8, 6
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d), (b, hk, lk, dv)))
    sinks = rng.standard_normal(hq)
    kvl = np.array([7, 3])
    out, lse = oracle.forward(q, k, v, scale=0.3, mask="causal", sinks=sinks, kv_lengths=kvl)
    for bi in range(b):
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        visible = (j <= i + kvl[bi] - lq) & (j < kvl[bi])
        for h in range(hq):
            want, want_lse = _direct(q[bi, h], k[bi, h // 2], v[bi, h // 2], 0.3, visible,
                                     sinks[h])
            np.testing.assert_allclose(out[bi, h], want, atol=1e-12)
            np.testing.assert_allclose(lse[bi, h], want_lse, atol=1e-12)


def test_backward_matches_finite_differences(rng):
    b, hq, hk, lq, lk, d = 1, 2, 1, 4, 6, 5
    q, k, v, dout = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d),
                                                      (b, hk, lk, d), (b, hq, lq, d)))
    mask = rng.standard_normal((1, hq, lq, lk))
    sinks = rng.standard_normal(hq)
    kw = dict(scale=0.4, mask=mask, sinks=sinks, q_lengths=np.array([3]), window_left=2)
    grads = oracle.backward(q, k, v, dout, **kw)

    def loss(q=q, k=k, v=v, mask=mask, sinks=sinks):
        return float(np.sum(oracle.forward(q, k, v, **{**kw, "mask": mask, "sinks": sinks})[0]
                            * dout))

    eps = 1e-6
    for name, x in (("dq", q), ("dk", k), ("dv", v), ("dmask", mask), ("dsinks", sinks)):
        arg = {"dq": "q", "dk": "k", "dv": "v", "dmask": "mask", "dsinks": "sinks"}[name]
        fd = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[idx] += eps
            down[idx] -= eps
            fd[idx] = (loss(**{arg: up}) - loss(**{arg: down})) / (2 * eps)
        np.testing.assert_allclose(grads[name], fd, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("seq_major", [False, True])
def test_backward_from_a_given_output(seq_major, rng):
    """`out=` replaces the exact rowsum(dout * out) with the given output's: the exact output
    changes nothing; an output off by e moves dq by exactly -scale * P (dout . e) K."""
    b, hq, hk, lq, lk, d = 2, 4, 2, 5, 7, 3
    q, k, v, dout = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d),
                                                      (b, hk, lk, d), (b, hq, lq, d)))
    kw = dict(scale=0.6, sinks=rng.standard_normal(hq), kv_lengths=np.array([4, 7]))
    if seq_major:
        q, k, v, dout = (np.swapaxes(x, 1, 2) for x in (q, k, v, dout))
    out, lse = oracle.forward(q, k, v, seq_major=seq_major, **kw)
    exact = oracle.backward(q, k, v, dout, seq_major=seq_major, **kw)
    given = oracle.backward(q, k, v, dout, seq_major=seq_major, out=out, **kw)
    for name in exact:
        np.testing.assert_allclose(given[name], exact[name], rtol=1e-12, atol=1e-12)
    off = rng.standard_normal(out.shape) * 1e-2
    moved = oracle.backward(q, k, v, dout, seq_major=seq_major, out=out + off, **kw)
    heads = (lambda x: np.swapaxes(x, 1, 2)) if seq_major else (lambda x: x)
    k_full = np.repeat(heads(k), hq // hk, axis=1)
    logits = kw["scale"] * heads(q) @ np.swapaxes(k_full, -1, -2)
    seen = np.arange(lk) < kw["kv_lengths"][:, None, None, None]
    prob = np.where(seen, np.exp(logits - lse[..., None]), 0.0)
    shift = np.sum(heads(dout) * heads(off), axis=-1, keepdims=True)  # delta's change
    want = heads(exact["dq"]) - kw["scale"] * (prob * shift) @ k_full
    np.testing.assert_allclose(heads(moved["dq"]), want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(moved["dv"], exact["dv"], rtol=1e-12, atol=1e-12)
    assert not np.allclose(moved["dq"], exact["dq"])


def test_nan_rows_and_invisible_keys(rng):
    b, hq, lq, lk, d = 2, 2, 4, 6, 8
    q, k, v = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hq, lk, d), (b, hq, lk, d)))
    kvl = np.array([4, 6])
    clean, _ = oracle.forward(q, k, v, kv_lengths=kvl)
    # NaN / inf past the length never reach anything
    k2, v2 = k.copy(), v.copy()
    k2[0, :, 4:] = np.nan
    v2[0, :, 5] = np.inf
    out, lse = oracle.forward(q, k2, v2, kv_lengths=kvl)
    np.testing.assert_array_equal(out, clean)
    grads = oracle.backward(q, k2, v2, np.ones_like(q), kv_lengths=kvl)
    assert all(np.isfinite(g).all() for g in grads.values())
    np.testing.assert_array_equal(grads["dk"][0, :, 4:], 0)
    # a NaN in one query row makes that row NaN, and only that row
    q3 = q.copy()
    q3[1, 0, 2, 3] = np.nan
    out, lse = oracle.forward(q3, k, v, kv_lengths=kvl)
    assert np.isnan(out[1, 0, 2]).all() and np.isnan(lse[1, 0, 2])
    rest = np.ones(out.shape[:3], bool)
    rest[1, 0, 2] = False
    np.testing.assert_array_equal(out[rest], clean[rest])
    # a NaN logit from a visible mask entry: its row only; a masked-out NaN key: nothing
    mask = np.zeros((1, 1, lq, lk))
    mask[0, 0, 1, 0] = np.nan
    out, _ = oracle.forward(q, k, v, mask=mask)
    assert np.isnan(out[:, :, 1]).all() and np.isfinite(np.delete(out, 1, axis=2)).all()
    k4 = k.copy()
    k4[:, :, 0] = np.nan
    keep = np.ones((1, 1, 1, lk), bool)
    keep[..., 0] = False
    out, _ = oracle.forward(q, k4, v, mask=keep)
    np.testing.assert_array_equal(out, oracle.forward(q, k, v, mask=keep)[0])
    # nothing to attend: zeros and -inf (the sink's logit with sinks)
    out, lse = oracle.forward(q, k, v, kv_lengths=np.array([0, 6]), sinks=np.array([0.5, -1.0]))
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_array_equal(lse[0], np.array([0.5, -1.0])[:, None] + 0 * lse[0])


@pytest.mark.parametrize("dtype, impl, grad, tf32, want", [
    ("float32", "cpu", False, False, 1e-5), ("float32", "cpu", True, False, 2e-5),
    ("float32", "cuda", False, True, 2e-3), ("float32", "cudnn", False, True, 1e-5),
    ("float16", "cuda", False, False, 2 * 0.01 + 2e-3), ("bfloat16", "cpu", True, False,
                                                          2 * 0.01 + 1.6e-2)])
def test_one_tolerance_policy(dtype, impl, grad, tf32, want):
    xla = 0.01 if dtype != "float32" else None
    assert oracle.tolerance(dtype, impl, grad=grad, xla_error=xla, tf32=tf32) == pytest.approx(want)


def test_named_cases_and_the_lse_rule():
    """Bounds that differ from the rule are named cases of the policy; the lse has its own
    rule (an absolute error)."""
    assert oracle.tolerance("float32", "cuda", grad=True, case="cuda_3xtf32") == oracle.FP32_RTOL
    assert oracle.tolerance("float32", "cuda", grad=True) == oracle.FP32_GRAD_RTOL
    for name, case in oracle.NAMED_CASES.items():
        for dtype, bounds in case.items():
            assert len(bounds) == 3, name
            for which, bound in enumerate(bounds):
                if bound is None:
                    continue
                assert bound > 0, (name, dtype)
                if which < 2:
                    assert oracle.tolerance(dtype, grad=which == 1, case=name) == bound
                else:
                    assert oracle.lse_tolerance(dtype, case=name) == bound
    with pytest.raises(ValueError, match="no such bound"):
        oracle.tolerance("float32", case="same_library")
    assert oracle.lse_tolerance("bfloat16", "cpu") == oracle.LSE_ATOL
    assert oracle.lse_tolerance("float32", "cuda", tf32=True) == oracle.TF32_LSE_ATOL
    assert oracle.lse_tolerance("bfloat16", "cudnn", tf32=True) == oracle.GPU_LSE_ATOL
    assert oracle.lse_tolerance("float32", "metal") == oracle.LSE_ATOL
    want = np.array([1.0, -np.inf, np.nan, 3.0])
    assert oracle.lse_error(want + np.array([2**-20, 0, 0, -2**-18]), want) == 2**-18
    assert oracle.lse_error(np.array([1.0, 0.0, np.nan, 3.0]), want) == np.inf
    assert oracle.lse_error(np.array([1.0, -np.inf, 0.0, 3.0]), want) == np.inf
    big = np.array([10.0, 20.0])
    assert oracle.max_rel_error(big * 0 + 0.5, big * 0 + 0.25, floor=oracle.OWN_MAGNITUDE) == 1.0
    assert oracle.max_rel_error(np.array([0.5]), np.array([0.25])) == 0.25


def test_matmul_paths_agree(rng):
    """The oracle's products: BLAS over finite rows and columns, einsum where a NaN or inf
    must reach exactly its own elements."""
    a, b = rng.standard_normal((2, 3, 5, 7)), rng.standard_normal((2, 3, 7, 4))
    want = np.einsum("...ij,...jk->...ik", a, b)
    np.testing.assert_allclose(oracle._matmul(a, b), want, rtol=0, atol=1e-12)
    a[1, 2, 3, 0] = np.nan
    b[0, 1, 0, 2] = np.inf
    b[0, 1, 1, 2] = 0.0
    got = oracle._matmul(a, b)
    with np.errstate(invalid="ignore"):
        want = np.einsum("...ij,...jk->...ik", a, b)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-12)


def test_one_plan_per_lowering():
    """dispatch.plan decides implementation, target, workspace and reason together."""
    import jax
    import jax.numpy as jnp

    from jax_sdpa import dispatch
    from jax_sdpa.config import Config, StaticParams

    s = jax.ShapeDtypeStruct((1, 4, 64, 32), jnp.float32)
    cfg = Config.from_shapes(s.shape, s.shape, s.shape, s.dtype, None, None, False, False, False,
                             StaticParams(scale=0.2))
    for impl in ("xla", "xla_chunked"):
        p = dispatch.plan(cfg, "cpu", "fwd", impl)
        assert (p.implementation, p.target, p.workspace_bytes) == (impl, None, 0) and p.reason
    p = dispatch.plan(cfg, "cpu", "bwd")
    assert p.implementation == dispatch.choose(cfg, "cpu", "bwd")
    if p.target is not None:
        assert p.target == f"jax_sdpa_{p.implementation}_bwd" and p.workspace_bytes == 0
    with pytest.raises(NotImplementedError, match="cudnn"):
        dispatch.plan(cfg, "cpu", "fwd", "cudnn")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("chunked", [False, True])
def test_xla_path_with_16bit_probabilities(dtype, chunked, rng):
    """Our XLA path as a GPU runs it (P and dS rounded to the input dtype before their
    matmuls, dispatch.xla_probs_dtype) within the 16-bit tolerance of the oracle: forward
    and the three gradients, GQA, causal, lengths, exact and chunked."""
    import jax.numpy as jnp

    from jax_sdpa import reference
    from jax_sdpa.config import StaticParams

    b, hq, hk, lq, lk, d = 2, 4, 2, 37, 53, 24
    q, k, v, dout = (rng.standard_normal(s) for s in ((b, hq, lq, d), (b, hk, lk, d),
                                                     (b, hk, lk, d), (b, hq, lq, d)))
    kvl = np.array([53, 29])
    x16 = [jnp.asarray(x, dtype) for x in (q, k, v, dout)]
    x64 = [np.asarray(x.astype(jnp.float32), np.float64) for x in x16]
    params = StaticParams(scale=d ** -0.5, window_right=0, bottom_right=True)
    fwd = reference.chunked_forward if chunked else reference.exact_forward
    bwd = reference.chunked_backward if chunked else reference.exact_backward
    extra = dict(block=16) if chunked else {}
    want_out, _ = oracle.forward(*x64[:3], scale=d ** -0.5, mask="causal", kv_lengths=kvl)
    want = oracle.backward(*x64, scale=d ** -0.5, mask="causal", kv_lengths=kvl)
    kvl_j = jnp.asarray(kvl, jnp.int32)
    errors = {}
    for probs in (None, dtype):
        out, lse = fwd(*x16[:3], None, None, None, kvl_j, None, None, params,
                       probs_dtype=probs, **extra)
        grads = bwd(*x16[:3], out, lse, x16[3], None, None, None, kvl_j, None, None, params,
                    probs_dtype=probs, **extra)
        errors[probs] = [oracle.max_rel_error(out, want_out)] + [
            oracle.max_rel_error(g, want[n]) for g, n in zip(grads, ("dq", "dk", "dv"))]
    for err16, err32 in zip(errors[dtype], errors[None]):
        assert err16 <= oracle.tolerance(dtype, xla_error=err32), errors


def test_xla_probs_dtype_is_the_gpu_16bit_input_dtype():
    from jax_sdpa import dispatch
    from jax_sdpa.config import Config, StaticParams

    def cfg(dtype):
        shape = (1, 4, 64, 32)
        return Config.from_shapes(shape, shape, shape, np.dtype(dtype), None, None, False,
                                  False, False, StaticParams(scale=0.2))

    import ml_dtypes
    assert dispatch.xla_probs_dtype(cfg(ml_dtypes.bfloat16), "cuda") == "bfloat16"
    assert dispatch.xla_probs_dtype(cfg(np.float16), "cuda") == "float16"
    assert dispatch.xla_probs_dtype(cfg(np.float32), "cuda") is None
    assert dispatch.xla_probs_dtype(cfg(ml_dtypes.bfloat16), "cpu") is None
    plan = dispatch.plan(cfg(np.float16), "cpu", "fwd", "xla")
    assert plan.probs_dtype is None
