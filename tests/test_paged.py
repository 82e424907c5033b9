"""jax_sdpa.paged_attention and paged_kv_write: equal to scaled_dot_product_attention on the
contiguous cache gathered (here, in numpy) from the pages, with key_value_seq_lengths; for
random page tables, lengths 1 ... max, page sizes 8 ... 64, Lq 1 ... 17, both page layouts,
GQA, sinks, soft-capping and windows. Pages nobody may read hold NaN. A fused backend runs
these cases once its module registers a paged target that serves them; until then only
xla, xla_chunked and None run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import dispatch, paged
from sdpa_testing import fp32_rtol, implementations_here, max_rel_error

IMPLS = implementations_here() + [None]


def skip_unless_paged(impl, cfg):
    if impl in (None, "xla", "xla_chunked"):
        return
    platform = "cuda" if jax.default_backend() == "gpu" else jax.default_backend()
    ok, why = dispatch._PagedCall(cfg, platform).verdict(impl)
    if not ok:
        pytest.skip(f"{impl}: {why}")


def make_cache(rng, b, hk, d, dv, page_size, pages_per_seq, lengths, layout, spare=3):
    """A pool with each row's pages at random physical places (disjoint), NaN wherever no
    row may read, and the rows' contiguous K/V [B, Hk, pages_per_seq * S, D] (NaN past the
    lengths as well)."""
    num_pages = b * pages_per_seq + spare
    lk = pages_per_seq * page_size
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, dv)).astype(np.float32)
    for row, n in enumerate(lengths):
        k[row, :, n:] = np.nan
        v[row, :, n:] = np.nan
    order = rng.permutation(num_pages)
    page_indices = order[:b * pages_per_seq].reshape(b, pages_per_seq).astype(np.int32)
    k_pool = np.full((num_pages, hk, page_size, d), np.nan, np.float32)
    v_pool = np.full((num_pages, hk, page_size, dv), np.nan, np.float32)
    for row in range(b):
        for j, p in enumerate(page_indices[row]):
            k_pool[p] = k[row, :, j * page_size:(j + 1) * page_size]
            v_pool[p] = v[row, :, j * page_size:(j + 1) * page_size]
    # pages entirely past a row's length: any index, in range or not, must not be read
    for row, n in enumerate(lengths):
        first_unused = -(-n // page_size)
        for j in range(first_unused, pages_per_seq):
            page_indices[row, j] = rng.choice([-1, num_pages, 10**6, int(order[-1])])
    if layout == "PSHD":
        k_pool, v_pool = np.swapaxes(k_pool, 1, 2).copy(), np.swapaxes(v_pool, 1, 2).copy()
    return k_pool, v_pool, page_indices, k, v


CASES = [
    # b, hq, hk, d, page_size, pages_per_seq, lq, layout, options
    (3, 4, 2, 32, 8, 6, 1, "PHSD", dict(mask="causal")),
    (2, 8, 2, 64, 16, 4, 5, "PSHD", dict(mask="causal", sinks=True)),
    (4, 4, 4, 16, 64, 2, 17, "PHSD", dict(mask="causal", logits_soft_cap=2.0)),
    (2, 6, 3, 32, 32, 3, 3, "PSHD", dict(mask="causal", local_window_size=(20, 0),
                                          sinks=True)),
    (3, 4, 1, 16, 8, 5, 7, "PSHD", dict(local_window_size=9, logits_soft_cap=5.0)),
    (2, 4, 2, 32, 16, 3, 1, "PHSD", dict()),
]


@pytest.mark.parametrize("impl", IMPLS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}k{c[2]}d{c[3]}"
                         f"S{c[4]}p{c[5]}q{c[6]}{c[7]}-" + "-".join(c[8]))
def test_equals_contiguous_attention(impl, case, rng):
    b, hq, hk, d, s, pps, lq, layout, opts = case
    lk = pps * s
    lengths = rng.integers(1, lk + 1, b)
    lengths[0], lengths[-1] = lk, 1  # the extremes
    lengths = np.maximum(lengths, 1).astype(np.int32)
    k_pool, v_pool, idx, k, v = make_cache(rng, b, hk, d, d, s, pps, lengths, layout)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    opts = dict(opts)
    sinks = rng.standard_normal(hq).astype(np.float32) if opts.pop("sinks", False) else None
    cfg = paged.paged_config(q.shape, k_pool.shape, v_pool.shape, np.float32, idx.shape,
                             sinks is not None, _params(opts, d), paged.KV_LAYOUTS[layout])
    skip_unless_paged(impl, cfg)
    got = jax.jit(lambda *a: jax_sdpa.paged_attention(
        *a, sinks=sinks, kv_layout=layout, implementation=impl, **opts))(
        q, k_pool, v_pool, idx, lengths)
    want = jax_sdpa.scaled_dot_product_attention(
        q, np.nan_to_num(k), np.nan_to_num(v), key_value_seq_lengths=lengths, sinks=sinks,
        implementation="xla", **opts)
    assert np.isfinite(np.asarray(got)).all()
    err = max_rel_error(got, want)
    assert err <= fp32_rtol(impl), f"error {err:.3g}"


def _params(opts, d):
    left, right = jax_sdpa.checks.check_window(opts.get("local_window_size"))
    if opts.get("mask") == "causal":
        right = 0 if right < 0 else min(right, 0)
    return jax_sdpa.config.StaticParams(scale=1 / np.sqrt(d), window_left=left,
                                        window_right=right, bottom_right=True,
                                        logits_soft_cap=opts.get("logits_soft_cap") or 0.0)


@pytest.mark.parametrize("impl", IMPLS, ids=str)
def test_out_of_range_page_inside_the_length_is_invisible(impl, rng):
    """A page index outside [0, num_pages) within a row's length: that page's keys are
    invisible (never read), the others attend as usual."""
    b, hq, hk, d, s, pps = 2, 4, 2, 16, 8, 4
    lengths = np.array([32, 30], np.int32)
    k_pool, v_pool, idx, k, v = make_cache(rng, b, hk, d, d, s, pps, lengths, "PHSD")
    idx[0, 1], idx[1, 2] = -3, k_pool.shape[0] + 7
    q = rng.standard_normal((b, hq, 2, d)).astype(np.float32)
    cfg = paged.paged_config(q.shape, k_pool.shape, v_pool.shape, np.float32, idx.shape,
                             False, _params({}, d), 0)
    skip_unless_paged(impl, cfg)
    got = jax_sdpa.paged_attention(q, k_pool, v_pool, idx, lengths, implementation=impl)
    visible = np.ones((b, 1, 1, pps * s), bool)
    visible[0, ..., s:2 * s] = visible[1, ..., 2 * s:3 * s] = False
    want = jax_sdpa.scaled_dot_product_attention(q, np.nan_to_num(k), np.nan_to_num(v),
                                                 mask=visible, key_value_seq_lengths=lengths,
                                                 implementation="xla")
    assert max_rel_error(got, want) <= fp32_rtol(impl)


@pytest.mark.parametrize("layout", ["PHSD", "PSHD"])
def test_writer_and_attention_round_trip(layout, rng):
    """Prefill then decode steps through paged_kv_write, against attention over the same
    keys kept contiguously; pages come from a shuffled free list."""
    b, hq, hk, d, s, pps = 3, 4, 2, 16, 8, 5
    num_pages = b * pps + 2
    shape = (num_pages, hk, s, d) if layout == "PHSD" else (num_pages, s, hk, d)
    k_pool = jnp.full(shape, jnp.nan, jnp.float32)
    v_pool = jnp.full(shape, jnp.nan, jnp.float32)
    idx = jnp.asarray(rng.permutation(num_pages)[:b * pps].reshape(b, pps), jnp.int32)
    prompt = np.array([7, 1, 19], np.int32)
    lmax = 24
    k_all = rng.standard_normal((b, hk, lmax + 3, d)).astype(np.float32)
    v_all = rng.standard_normal((b, hk, lmax + 3, d)).astype(np.float32)
    write = jax.jit(lambda kp, vp, i, n, kn, vn: jax_sdpa.paged_kv_write(
        kp, vp, i, n, kn, vn, kv_layout=layout), donate_argnums=(0, 1))
    # prefill: each row writes its own prompt (rows padded to the longest; the padding
    # lands past the row's length and is overwritten by the decode steps below)
    k_pool, v_pool = write(k_pool, v_pool, idx, jnp.zeros(b, jnp.int32),
                           k_all[:, :, :prompt.max()], v_all[:, :, :prompt.max()])
    lengths = prompt.copy()
    for step in range(3):
        new_k = np.stack([k_all[r, :, lengths[r]:lengths[r] + 1] for r in range(b)])
        new_v = np.stack([v_all[r, :, lengths[r]:lengths[r] + 1] for r in range(b)])
        k_pool, v_pool = write(k_pool, v_pool, idx, lengths, new_k, new_v)
        lengths = lengths + 1
        q = rng.standard_normal((b, hq, 1, d)).astype(np.float32)
        got = jax_sdpa.paged_attention(q, k_pool, v_pool, idx, lengths, mask="causal",
                                       kv_layout=layout)
        contiguous_k = np.stack([np.concatenate(
            [k_all[r, :, :lengths[r]], np.zeros((hk, pps * s - lengths[r], d), np.float32)],
            axis=1) for r in range(b)])
        contiguous_v = np.stack([np.concatenate(
            [v_all[r, :, :lengths[r]], np.zeros((hk, pps * s - lengths[r], d), np.float32)],
            axis=1) for r in range(b)])
        want = jax_sdpa.scaled_dot_product_attention(q, contiguous_k, contiguous_v,
                                                     mask="causal",
                                                     key_value_seq_lengths=lengths)
        assert max_rel_error(got, want) < 1e-5, f"step {step}"


def test_writer_drops_writes_outside_the_pages(rng):
    hk, s, d = 1, 4, 2
    k_pool = jnp.zeros((3, hk, s, d))
    idx = jnp.asarray([[2, -1]], jnp.int32)  # logical page 1 has no physical page
    new = jnp.ones((1, hk, 6, d))
    k2, _ = jax_sdpa.paged_kv_write(k_pool, k_pool, idx, jnp.asarray([2], jnp.int32), new,
                                    new)
    k2 = np.asarray(k2)
    np.testing.assert_array_equal(k2[2, 0, 2:], 1)  # slots 2, 3 of page 2 written
    np.testing.assert_array_equal(k2[2, 0, :2], 0)
    np.testing.assert_array_equal(k2[:2], 0)  # nothing else touched
    # past pages_per_seq * page_size: dropped too
    k3, _ = jax_sdpa.paged_kv_write(k_pool, k_pool, jnp.asarray([[0, 1]], jnp.int32),
                                    jnp.asarray([7], jnp.int32), new, new)
    np.testing.assert_array_equal(np.asarray(k3)[1, 0, 3], 1)
    assert float(np.asarray(k3).sum()) == d  # only position 7 fitted


def test_vmap_over_rows_and_over_pools(rng):
    n, b, hq, hk, d, s, pps = 2, 2, 4, 2, 16, 8, 3
    lengths = np.stack([rng.integers(1, pps * s + 1, b) for _ in range(n)]).astype(np.int32)
    pools = [make_cache(rng, b, hk, d, d, s, pps, lengths[i], "PHSD") for i in range(n)]
    q = rng.standard_normal((n, b, hq, 2, d)).astype(np.float32)
    fn = lambda q, kp, vp, i, l: jax_sdpa.paged_attention(q, kp, vp, i, l,  # noqa: E731
                                                          mask="causal")
    # each call its own pool
    got = jax.jit(jax.vmap(fn))(q, np.stack([p[0] for p in pools]),
                                np.stack([p[1] for p in pools]),
                                np.stack([p[2] for p in pools]), lengths)
    # one shared pool, calls differing in q and lengths
    shared = jax.vmap(fn, in_axes=(0, None, None, None, 0))(
        q, pools[0][0], pools[0][1], pools[0][2], np.stack([lengths[0], lengths[0]]))
    for i in range(n):
        want = jax_sdpa.scaled_dot_product_attention(
            q[i], np.nan_to_num(pools[i][3]), np.nan_to_num(pools[i][4]), mask="causal",
            key_value_seq_lengths=lengths[i])
        assert max_rel_error(got[i], want) < 1e-5
        want0 = jax_sdpa.scaled_dot_product_attention(
            q[i], np.nan_to_num(pools[0][3]), np.nan_to_num(pools[0][4]), mask="causal",
            key_value_seq_lengths=lengths[0])
        assert max_rel_error(shared[i], want0) < 1e-5


def test_gradient_is_a_clear_error():
    q = jnp.ones((1, 2, 1, 8))
    pool = jnp.ones((2, 2, 4, 8))
    idx = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(NotImplementedError, match="forward only"):
        jax.grad(lambda q: jnp.sum(jax_sdpa.paged_attention(q, pool, pool, idx,
                                                            jnp.ones(1, jnp.int32))))(q)


def _args(**over):
    a = dict(q=jnp.ones((2, 4, 1, 8)), k_pages=jnp.ones((5, 2, 4, 8)),
             v_pages=jnp.ones((5, 2, 4, 8)), page_indices=jnp.zeros((2, 3), jnp.int32),
             kv_lengths=jnp.ones(2, jnp.int32))
    a.update(over)
    return a


@pytest.mark.parametrize("over, kw, error, text", [
    (dict(page_indices=jnp.zeros((2, 3), jnp.float32)), {}, TypeError, "page_indices"),
    (dict(page_indices=jnp.zeros((2, 3), jnp.int16)), {}, ValueError, "page_indices.*int32"),
    (dict(page_indices=jnp.zeros((3, 3), jnp.int32)), {}, ValueError,
     r"page_indices.*\[B, pages_per_seq\]"),
    (dict(page_indices=jnp.zeros((2,), jnp.int32)), {}, ValueError, "page_indices"),
    (dict(kv_lengths=jnp.ones(3, jnp.int32)), {}, ValueError, "kv_lengths"),
    (dict(kv_lengths=None), {}, TypeError, "kv_lengths"),
    (dict(kv_lengths=jnp.ones(2, jnp.float32)), {}, TypeError, "kv_lengths"),
    (dict(v_pages=jnp.ones((5, 2, 3, 8))), {}, ValueError, "k_pages.*v_pages"),
    (dict(k_pages=jnp.ones((5, 2, 4, 16))), {}, ValueError, "head dim"),
    (dict(k_pages=jnp.ones((5, 3, 4, 8)), v_pages=jnp.ones((5, 3, 4, 8))), {}, ValueError,
     "multiple"),
    (dict(k_pages=jnp.ones((5, 2, 4))), {}, ValueError, r"k_pages.*rank 4"),
    ({}, dict(mask=jnp.ones((1, 1, 1, 12), bool)), ValueError, "mask"),
    ({}, dict(mask="full"), ValueError, "mask"),
    ({}, dict(kv_layout="BHLD"), ValueError, "kv_layout"),
    ({}, dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ({}, dict(sinks=jnp.ones(3)), ValueError, "sinks"),
    ({}, dict(implementation="gpu"), ValueError, "implementation"),
])
def test_bad_arguments(over, kw, error, text):
    with pytest.raises(error, match=text):
        jax_sdpa.paged_attention(**_args(**over), **kw)


def test_writer_bad_arguments():
    pool = jnp.ones((5, 2, 4, 8))
    idx = jnp.zeros((2, 3), jnp.int32)
    with pytest.raises(ValueError, match=r"k_new.*\[B, Hk, Lnew, D\]"):
        jax_sdpa.paged_kv_write(pool, pool, idx, jnp.zeros(2, jnp.int32),
                                jnp.ones((2, 3, 1, 8)), jnp.ones((2, 2, 1, 8)))
    with pytest.raises(ValueError, match="kv_lengths"):
        jax_sdpa.paged_kv_write(pool, pool, idx, jnp.zeros(3, jnp.int32),
                                jnp.ones((2, 2, 1, 8)), jnp.ones((2, 2, 1, 8)))


@pytest.mark.parametrize("impl", [i for i in implementations_here()
                                  if i not in ("xla", "xla_chunked")])
def test_named_backend_without_paged_target_says_so(impl):
    if dispatch.paged_target(impl) in jax_sdpa._ext.ffi_targets():
        pytest.skip(f"{impl} registers a paged target")
    with pytest.raises(NotImplementedError, match="paged target"):
        jax_sdpa.paged_attention(**_args(), implementation=impl)
    # implementation=None falls back to the gather
    out = jax_sdpa.paged_attention(**_args())
    assert out.shape == (2, 4, 1, 8)


def test_direct_ffi_call_arguments():
    """paged_ffi_call_args: the attributes a paged target binds (the contract's struct)."""
    sinks, attrs = paged.paged_ffi_call_args(scale=0.5, kv_layout="PSHD")
    assert sinks.shape == (0,)
    assert attrs["kv_layout"] == 1 and attrs["bottom_right"] and not attrs["seq_major"]
    assert attrs["has_kv_lengths"] and not (attrs["has_mask"] or attrs["has_q_lengths"]
                                            or attrs["has_segment_ids"])
    assert set(attrs) == set(jax_sdpa.primitives.ffi_call_args(scale=1.0)[1])


def test_explain_names_every_implementation():
    a = _args()
    e = paged.explain(a["q"], a["k_pages"], a["v_pages"], a["page_indices"], a["kv_lengths"],
                      mask="causal", logits_soft_cap=5.0)
    assert set(e.verdicts) == set(jax_sdpa.IMPLEMENTATIONS)
    assert e.verdicts[e.chosen][0]
    assert e.verdicts["xla"][0] and "gathers" in e.verdicts["xla"][1]
    for name in ("cpu", "metal"):
        if dispatch.paged_target(name) not in jax_sdpa._ext.ffi_targets():
            assert not e.verdicts[name][0]
    assert "implementation=None ->" in str(e)
