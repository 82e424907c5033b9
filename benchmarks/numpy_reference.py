"""The float64 numpy reference of docs/ffi_contract.md that the GPU checks
(gpu_decode.py, gpu_flash_check.py) compare our kernels with: head-major [B, H, L, D]
arrays, GQA by repeating K/V, bottom-right or top-left band with windows, q/kv lengths,
bool or additive masks broadcast to [B, Hq, Lq, Lk], sinks [1 or B, Hq]. Rows with nothing
visible (or past their q length) give out 0 and lse -inf.
"""
import numpy as np


def reference(q, k, v, *, scale, mask=None, sinks=None, qlen=None, kvlen=None, wl=-1, wr=-1,
              bottom_right=True, want_p=False):
    """(out, lse), and the normalized probabilities when want_p (for the backward)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, Lq, _ = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    kk, vv = np.repeat(k, Hq // Hk, axis=1), np.repeat(v, Hq // Hk, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, kk) * scale
    vis = np.zeros((B, 1, Lq, Lk), bool)
    rows = np.zeros((B, Lq), bool)
    i, j = np.arange(Lq)[:, None], np.arange(Lk)[None, :]
    for b in range(B):
        ql = Lq if qlen is None else int(np.clip(qlen[b], 0, Lq))
        kl = Lk if kvlen is None else int(np.clip(kvlen[b], 0, Lk))
        d = j - (i + (kl - ql if bottom_right else 0))
        ok = (i < ql) & (j < kl)
        if wl >= 0:
            ok &= d >= -wl
        if wr >= 0:
            ok &= d <= wr
        vis[b, 0] = ok
        rows[b] = np.arange(Lq) < ql
    vis = np.broadcast_to(vis, s.shape).copy()
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype == np.bool_:
            vis &= np.broadcast_to(m, s.shape)
        else:
            s = s + np.broadcast_to(np.asarray(m, np.float64), s.shape)
    with np.errstate(all="ignore"):
        s = np.where(vis, s, -np.inf)
        mx = s.max(-1)
        if sinks is not None:
            sk = np.broadcast_to(np.asarray(sinks, np.float64)[:, :, None], (B, Hq, Lq))
            mx = np.maximum(mx, sk)
        mf = np.where(np.isfinite(mx), mx, 0.0)
        p = np.exp(s - mf[..., None])
        tot = p.sum(-1) + (np.exp(sk - mf) if sinks is not None else 0.0)
        safe = np.where(tot > 0, tot, 1.0)
        lse = np.where(tot > 0, mf + np.log(safe), -np.inf)
        out = np.einsum("bhij,bhjd->bhid", p, vv) / safe[..., None]
    empty = ~np.isfinite(lse) | ~rows[:, None, :]
    out, lse = np.where(empty[..., None], 0.0, out), np.where(empty, -np.inf, lse)
    if want_p:
        with np.errstate(all="ignore"):
            pr = np.where(empty[..., None], 0.0, p / safe[..., None])
        return out, lse, pr
    return out, lse
