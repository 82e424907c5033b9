"""The kernel contract (docs/ffi_contract.md) written out in float64 numpy for the GPU tests
of our CUDA kernels and cuDNN (tests/test_cuda_features.py, tests/test_cudnn.py): segment
ids, logit soft-capping, sinks, lengths, bands, forward and backward, with the contract's
NaN rules (hidden terms selected away, never multiplied by 0). Independent of jax_sdpa's own
references; verified against jax autodiff of a dense jnp version."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def _visibility(b, lq, lk, ql, kvl, wl, wr, br, qseg, kvseg, key_ok=None):
    vis = np.zeros((b, 1, lq, lk), bool)
    for bb in range(b):
        qlen = lq if ql is None else int(np.clip(ql[bb], 0, lq))
        kvlen = lk if kvl is None else int(np.clip(kvl[bb], 0, lk))
        off = kvlen - qlen if br else 0
        i = np.arange(lq)[:, None]
        j = np.arange(lk)[None, :]
        d = j - (i + off)
        v = (i < qlen) & (j < kvlen)
        if wl >= 0:
            v &= d >= -wl
        if wr >= 0:
            v &= d <= wr
        if qseg is not None:
            v &= qseg[bb][:, None] == kvseg[bb][None, :]
        if key_ok is not None:
            v &= key_ok[bb][None, :]
        vis[bb, 0] = v
    return vis


def _sel_mm(spec, w, x):
    """einsum(spec, w, x) where a zero weight selects its term away (a NaN in x meets only
    nonzero weights), as the contract sums only visible terms; a NaN weight stays NaN."""
    nan_x = np.isnan(x)
    r = np.einsum(spec, w, np.where(nan_x, 0.0, x))
    hit = np.einsum(spec, (w != 0).astype(np.float64), nan_x.astype(np.float64)) > 0
    return np.where(hit, np.nan, r)


def oracle(q, k, v, dout=None, *, scale, cap=0.0, qseg=None, kvseg=None, ql=None, kvl=None,
           wl=-1, wr=-1, br=False, sinks=None, key_ok=None):
    """(out, lse[, dq, dk, dv]) in float64. Queries past q length and keys past kv length are
    zeroed before use (the contract: never read); hidden scores are replaced, never added to.
    key_ok: [B, Lk] bool, False hides a key from every row (a paged cache's invalid page)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = hq // hk
    vis = _visibility(b, lq, lk, ql, kvl, wl, wr, br, qseg, kvseg, key_ok)
    qlen = np.full(b, lq) if ql is None else np.clip(ql, 0, lq)
    kvlen = np.full(b, lk) if kvl is None else np.clip(kvl, 0, lk)
    live_q = np.arange(lq)[None, None, :, None] < qlen[:, None, None, None]
    live_k = np.arange(lk)[None, None, :, None] < kvlen[:, None, None, None]
    if key_ok is not None:
        live_k = live_k & np.asarray(key_ok)[:, None, :, None]
    kk = np.repeat(np.where(live_k, k, 0.0), g, axis=1)
    vv = np.repeat(np.where(live_k, v, 0.0), g, axis=1)
    qq = np.where(live_q, q, 0.0)
    x = scale * np.einsum("bhid,bhjd->bhij", qq, kk)
    t = np.tanh(x / cap) if cap > 0 else None
    s = cap * t if cap > 0 else x
    s = np.where(vis, s, -np.inf)
    sink = None
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, :, None, None], (b, hq, lq, 1))
        sink = np.where(live_q, sink, -np.inf)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        if sink is not None:
            m = np.maximum(m, sink)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        e = np.where(vis, np.exp(s - m_safe), 0.0)
        tot = e.sum(-1, keepdims=True) + (np.exp(sink - m_safe) if sink is not None else 0.0)
        lse = np.where(tot == 0, -np.inf, np.log(tot) + m_safe)
        p = np.where(vis & (lse != -np.inf), np.exp(s - np.where(np.isinf(lse), 0.0, lse)), 0.0)
        out = _sel_mm("bhij,bhjd->bhid", p, vv)
    lse = lse[..., 0]
    if dout is None:
        return out, lse
    do = np.where(live_q, np.asarray(dout, np.float64), 0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        dp = np.einsum("bhid,bhjd->bhij", do, vv)
        delta = (do * out).sum(-1, keepdims=True)
        ds = np.where(vis, p * (dp - delta), 0.0)
        dsx = ds * (1 - t * t) if cap > 0 else ds
        dq = scale * _sel_mm("bhij,bhjd->bhid", dsx, kk)
        dk = scale * _sel_mm("bhij,bhid->bhjd", dsx, qq).reshape(b, hk, g, lk, -1).sum(2)
        dv = _sel_mm("bhij,bhid->bhjd", p, do).reshape(b, hk, g, lk, -1).sum(2)
    return out, lse, dq, dk, dv


def as_f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def assert_matches(got, want, tol, what):
    """NaN exactly where the oracle has NaN (and -inf where it has -inf); elsewhere within
    tol * max(1, max |want|)."""
    got = as_f64(got)
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), (
        f"{what}: NaN at {np.argwhere(nan_got != nan_want)[:8].tolist()} "
        f"(got NaN {nan_got.sum()}, oracle NaN {nan_want.sum()})")
    ok = ~nan_want
    inf_want = np.isinf(want) & ok
    assert np.array_equal(got[inf_want], want[inf_want]), f"{what}: infinities differ"
    fin = ok & ~inf_want
    if fin.any():
        err = np.abs(got[fin] - want[fin]).max() / max(1.0, np.abs(want[fin]).max())
        assert err <= tol, f"{what}: max rel error {err:.3g} > {tol}"
