"""The Metal paged forward (jax_sdpa_metal_paged_fwd) at the FFI boundary, every kernel path
forced in turn, against the float64 oracle on the contiguous cache the pages stand for.

The pool holds NaN wherever no row may read (spare pages, slots past a row's length), the
page indices past a row's length are garbage (negative, too large, or another row's page),
and one index inside a row's length is out of range: that page's keys are invisible (the
oracle gets them as a bool mask). Outputs are poisoned (conftest).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_sdpa  # noqa: F401  (registers the FFI targets)
from jax_sdpa import _ext, oracle

pytestmark = pytest.mark.skipif("jax_sdpa_metal_paged_fwd" not in _ext.ffi_targets(),
                                reason="the Metal backend (or its emulator) is not built")

RTOL = oracle.tolerance("float32", "metal")
LSE_ATOL = oracle.lse_tolerance("float32", "metal")
LAYOUTS = {"PHSD": 0, "PSHD": 1}


def metal_paged_fwd(q, k_pages, v_pages, page_indices, kv_lengths, *, scale, layout,
                    sinks=None, cap=0.0, window_left=-1, window_right=-1):
    dv = v_pages.shape[3]
    results = [jax.ShapeDtypeStruct(q.shape[:3] + (dv,), q.dtype),
               jax.ShapeDtypeStruct(q.shape[:3], np.float32)]
    attrs = dict(scale=float(scale), window_left=int(window_left),
                 window_right=int(window_right), bottom_right=True, seq_major=False,
                 has_mask=False, has_sinks=sinks is not None, has_q_lengths=False,
                 has_kv_lengths=True, fp32_precision=np.int64(0),
                 logits_soft_cap=float(cap), has_segment_ids=False,
                 kv_layout=np.int64(LAYOUTS[layout]))
    sinks = np.zeros((0,), np.float32) if sinks is None else sinks
    out = jax.ffi.ffi_call("jax_sdpa_metal_paged_fwd", results)(
        q, k_pages, v_pages, page_indices, kv_lengths, sinks, **attrs)
    return [np.asarray(x) for x in out]


def make_pool(rng, b, hk, d, dv, s, pps, lengths, layout):
    """(k_pool, v_pool, page_indices, k, v, key_visible [B, Lk]): contiguous k/v [B, Hk, Lk, D]
    and a shuffled pool holding them; row 0's second page index is out of range."""
    num_pages = b * pps + 2
    lk = pps * s
    k = rng.standard_normal((b, hk, lk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, lk, dv)).astype(np.float32)
    order = rng.permutation(num_pages)
    table = order[:b * pps].reshape(b, pps).astype(np.int32)
    k_pool = np.full((num_pages, hk, s, d), np.nan, np.float32)
    v_pool = np.full((num_pages, hk, s, dv), np.nan, np.float32)
    for row in range(b):
        for j, p in enumerate(table[row]):
            n = int(np.clip(lengths[row] - j * s, 0, s))  # slots past the length stay NaN
            k_pool[p, :, :n] = k[row, :, j * s:j * s + n]
            v_pool[p, :, :n] = v[row, :, j * s:j * s + n]
    visible = np.ones((b, lk), bool)
    if pps > 1 and lengths[0] > s:
        table[0, 1] = num_pages + 3  # inside the length, out of range: invisible
        visible[0, s:2 * s] = False
    for row in range(b):
        for j in range(-(-int(lengths[row]) // s), pps):
            table[row, j] = rng.choice([-1, num_pages, 10**6, int(order[-1])])
    if layout == "PSHD":
        k_pool, v_pool = np.swapaxes(k_pool, 1, 2).copy(), np.swapaxes(v_pool, 1, 2).copy()
    return k_pool, v_pool, table, k, v, visible


# (b, hq, hk, lq, d, dv, page_size, pages_per_seq, sinks, causal, cap)
CASES = [
    (2, 4, 2, 1, 64, 64, 8, 9, True, True, None),
    (3, 8, 2, 5, 128, 64, 16, 4, False, True, 20.0),
    (2, 2, 1, 17, 64, 64, 16, 5, True, True, None),
    (1, 4, 4, 9, 32, 32, 32, 3, False, False, 3.0),
    (2, 6, 3, 3, 80, 80, 64, 2, True, False, None),
]
PATHS = [("auto", None), ("full", None), ("decode", None), ("decode", "3")]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(x for x in p if x))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}k{c[2]}q{c[3]}d{c[4]}s{c[6]}")
def test_paged_forward_against_oracle(case, path, layout, monkeypatch, rng):
    b, hq, hk, lq, d, dv, s, pps, sinks, causal, cap = case
    kernel, splits = path
    if kernel != "auto":
        monkeypatch.setenv("JAX_SDPA_METAL_KERNEL", kernel)
    if splits:
        monkeypatch.setenv("JAX_SDPA_METAL_SPLITS", splits)
    lk = pps * s
    lengths = rng.integers(lq, lk + 1, b).astype(np.int32)
    lengths[0] = max(lengths[0], min(lk, s + lq + 1))  # row 0 reaches its invisible page
    lengths[-1] = lk if b > 1 else lengths[-1]
    k_pool, v_pool, table, k, v, visible = make_pool(rng, b, hk, d, dv, s, pps, lengths, layout)
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    sk = rng.standard_normal((1, hq)).astype(np.float32) if sinks else None
    scale = d ** -0.5
    out, lse = metal_paged_fwd(q, k_pool, v_pool, table, lengths, scale=scale, layout=layout,
                               sinks=sk, cap=cap or 0.0, window_right=0 if causal else -1)
    mask = np.broadcast_to(visible[:, None, None, :], (b, 1, lq, lk))
    want, want_lse = oracle.forward(q, np.nan_to_num(k), np.nan_to_num(v), scale=scale,
                                    mask=mask, sinks=sk, kv_lengths=lengths,
                                    window_right=0 if causal else -1, bottom_right=True,
                                    logits_soft_cap=cap)
    assert np.isfinite(out).all(), "a page or slot nobody may read reached the output"
    assert oracle.max_rel_error(out, want) <= RTOL
    assert oracle.lse_error(lse, want_lse) <= LSE_ATOL


def test_paged_half_precision(rng):
    import jax.numpy as jnp
    b, hq, hk, lq, d, s, pps = 2, 4, 2, 2, 64, 16, 3
    lengths = np.array([40, 21], np.int32)
    k_pool, v_pool, table, k, v, visible = make_pool(rng, b, hk, d, d, s, pps, lengths, "PSHD")
    q = rng.standard_normal((b, hq, lq, d)).astype(np.float32)
    to_bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    out, _ = metal_paged_fwd(to_bf16(q), to_bf16(k_pool), to_bf16(v_pool), table, lengths,
                             scale=0.125, layout="PSHD")
    assert out.dtype == jnp.bfloat16
    f64 = lambda a: np.asarray(to_bf16(a), np.float32).astype(np.float64)  # noqa: E731
    mask = np.broadcast_to(visible[:, None, None, :], (b, 1, lq, pps * s))
    want, _ = oracle.forward(f64(q), f64(np.nan_to_num(k)), f64(np.nan_to_num(v)),
                             scale=0.125, mask=mask, kv_lengths=lengths, bottom_right=True)
    assert oracle.max_rel_error(out, want) <= oracle.tolerance("bfloat16", "metal")


def test_paged_target_serves_soft_cap_not_backward():
    assert "logits_soft_cap" in _ext.served_features("jax_sdpa_metal_paged_fwd")
    assert "jax_sdpa_metal_paged_bwd" not in _ext.ffi_targets()
