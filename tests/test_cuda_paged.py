"""Our CUDA paged forward (target jax_sdpa_cuda_paged_fwd) through `jax_sdpa.paged_attention`
with implementation="cuda" (GPU only; skipped without a CUDA device).

Against the float64 contract (tests/cuda_oracle.py) on the contiguous cache gathered from the
pages in numpy: random page tables (pages shuffled over the pool, some rows' tables naming
out-of-range pages: those pages' keys are invisible and must never be read, and the pool's
unused slots hold NaN), kv lengths from Lq to the row's capacity, page sizes 8 to 64, Lq 1 to
16 (the decode shapes dispatch sends to this target), both page layouts, GQA, fp32 / bf16 / fp16, sinks, soft-capping, causal (bottom-right
against the kv lengths). Outputs are NaN-poisoned by the handler first (conftest).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_oracle import as_f64, assert_matches, oracle, tol

pytestmark = pytest.mark.gpu
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@pytest.fixture(autouse=True)
def _needs_cuda_paged():
    import jax_sdpa
    from jax_sdpa import _ext
    if jax.default_backend() != "gpu" or not _ext.has_backend("cuda"):
        pytest.skip("needs a CUDA GPU and our CUDA kernels built")
    if "jax_sdpa_cuda_paged_fwd" not in _ext.ffi_targets() or not hasattr(jax_sdpa,
                                                                         "paged_attention"):
        pytest.skip("this build has no CUDA paged target")


def _case(rng, *, dtype, layout, page_size, lq, d, hq=8, hk=2, b=3, pps=6, causal=True,
          cap=0.0, sinks=False, bad_pages=True):
    num_pages = b * pps + 3
    k_pool = np.full((num_pages, hk, page_size, d), np.nan)
    v_pool = np.full((num_pages, hk, page_size, d), np.nan)
    perm = rng.permutation(num_pages)
    table = perm[: b * pps].reshape(b, pps).astype(np.int32)
    cap_keys = pps * page_size
    kvl = np.array([cap_keys, max(lq, cap_keys // 2 + 3), lq][:b], np.int32)
    key_ok = np.ones((b, cap_keys), bool)
    for bb in range(b):
        used = (int(kvl[bb]) + page_size - 1) // page_size
        for j in range(used):
            p = table[bb, j]
            k_pool[p] = rng.standard_normal((hk, page_size, d))
            v_pool[p] = rng.standard_normal((hk, page_size, d))
            past = int(kvl[bb]) - j * page_size  # slots past the length keep NaN
            if past < page_size:
                k_pool[p, :, past:] = np.nan
                v_pool[p, :, past:] = np.nan
        if used < pps:
            table[bb, used:] = -7 if bb % 2 else num_pages + 11  # past the length: never read
    if bad_pages and kvl[1] > 2 * page_size:
        table[1, 1] = -1  # inside row 1's length: that page's keys are invisible
        key_ok[1, page_size:2 * page_size] = False
    q = rng.standard_normal((b, hq, lq, d)) * (3.0 if cap else 1.0)
    cast = lambda x: jnp.asarray(x, DTYPES[dtype])  # noqa: E731
    qj, kpj, vpj = cast(q), cast(k_pool), cast(v_pool)
    # sinks in the input dtype (they must promote to it), the oracle taking the rounded values
    snk = as_f64(cast(rng.standard_normal((1, hq)))) if sinks else None
    scale = 1.0 / np.sqrt(d)

    # The contiguous cache the pages stand for (invalid pages: zeros, hidden by key_ok).
    def gather(pool):
        pool = as_f64(pool)
        safe = np.clip(table, 0, num_pages - 1)
        g = pool[safe]  # [b, pps, hk, S, d]
        g = np.where(((table >= 0) & (table < num_pages))[:, :, None, None, None], g, 0.0)
        return np.moveaxis(g, 1, 2).reshape(b, hk, cap_keys, d)

    k, v = gather(kpj), gather(vpj)
    want = oracle(as_f64(qj), k, v, scale=scale, cap=cap, kvl=kvl, wl=-1,
                  wr=0 if causal else -1, br=True, sinks=snk, key_ok=key_ok)
    if layout == "PSHD":
        kpj, vpj = jnp.swapaxes(kpj, 1, 2), jnp.swapaxes(vpj, 1, 2)
    import jax_sdpa

    def run(q, kp, vp, t, lens):
        return jax_sdpa.paged_attention(
            q, kp, vp, t, lens, scale=scale, mask="causal" if causal else None,
            sinks=None if snk is None else cast(snk[0]),
            logits_soft_cap=cap if cap else None, kv_layout=layout, implementation="cuda")

    out = jax.jit(run)(qj, kpj, vpj, jnp.asarray(table), jnp.asarray(kvl))
    assert_matches(out, want[0], tol(dtype), "paged out")


@pytest.mark.parametrize("layout", ["PHSD", "PSHD"])
@pytest.mark.parametrize("dtype,page_size,lq,d", [
    ("bfloat16", 16, 1, 128), ("float16", 8, 5, 64), ("float32", 64, 1, 128),
    ("bfloat16", 32, 16, 256), ("float32", 8, 3, 64), ("float16", 32, 1, 256),
    ("float16", 16, 1, 64)])
def test_paged_matches_the_gathered_cache(rng, layout, dtype, page_size, lq, d):
    _case(rng, dtype=dtype, layout=layout, page_size=page_size, lq=lq, d=d)


@pytest.mark.parametrize("layout", ["PHSD", "PSHD"])
def test_paged_soft_cap_sinks_no_mask(rng, layout):
    _case(rng, dtype="bfloat16", layout=layout, page_size=16, lq=2, d=128, causal=False,
          cap=4.0, sinks=True)


@pytest.mark.parametrize("dtype,page_size,d", [("bfloat16", 16, 128), ("float16", 64, 64),
                                              ("bfloat16", 8, 256), ("bfloat16", 64, 128),
                                              ("float16", 32, 256)])
def test_paged_decode_long_cache(rng, dtype, page_size, d):
    """Long caches, where the decode kernel splits the keys over blocks (split-K partials
    and their merge), GQA 4, page sizes below, at and above its 16-key tile (and at D128 /
    D256 with pages of whole tiles: the TMA kernel, pages smaller and larger than its
    stage)."""
    _case(rng, dtype=dtype, layout="PHSD", page_size=page_size, lq=1, d=d, hq=16, hk=4, b=3,
          pps=4096 // page_size)
