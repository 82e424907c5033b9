"""Ring attention: context parallelism over a named mesh axis (inside `jax.shard_map`).

    out = ring_attention(q, k, v, axis_name="sp", mask="causal")

Each device holds one slice of the sequence (the layout of `scaled_dot_product_attention`:
q [B, Hq, L/n, D], k [B, Hk, L/n, D], v [B, Hk, L/n, Dv]; device i holds positions
i*L/n .. (i+1)*L/n - 1). K/V blocks travel around the ring with `lax.ppermute` while each
device runs the platform's fused kernel (the package's primitives, so cuDNN / CPU / Metal
/ the reference, whatever `implementation` picks) on its queries against the block it
holds, and merges the partial (out, lse) by log-sum-exp. The backward runs the fused
backward primitive per block with the *global* lse and passes dK/dV accumulators around
the ring with their block, so each ends at its owner after n hops.

Causal masking needs no new kernel attribute: with the contiguous layout the block a
device holds at ring step t is (statically) its own diagonal block at t = 0 -- plain
causal on equal lengths -- and for t > 0 either entirely visible (source < own index) or
entirely invisible (skipped under `lax.cond`).

Contiguous causal work is unbalanced (the last device does n blocks, the first one).
`layout="zigzag"` balances it: the sequence is cut into 2n chunks and device i holds
chunks i and 2n-1-i (`to_zigzag` / `from_zigzag` permute a global sequence into that
order and back). Then every off-diagonal step is exactly half a block: all local queries
against the first half of the keys (source < i) or the second half of the queries
against all keys (source > i).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Hashable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_sdpa import checks, dispatch, primitives
from jax_sdpa.config import StaticParams

__all__ = ["ring_attention", "to_zigzag", "from_zigzag", "zigzag_order"]


# ---------------------------------------------------------------------------
# zig-zag layout helpers

def zigzag_order(num_devices: int) -> np.ndarray:
    """Chunk order of the zig-zag layout: [0, 2n-1, 1, 2n-2, ...] (2n chunks)."""
    n = int(num_devices)
    return np.array([c for i in range(n) for c in (i, 2 * n - 1 - i)])


def _permute_chunks(x, order, axis):
    axis = axis % x.ndim
    length = x.shape[axis]
    chunks = len(order)
    if length % chunks:
        raise ValueError(f"the sequence length {length} (axis {axis}) must be divisible by "
                         f"2 * num_devices = {chunks} for the zig-zag layout")
    shape = x.shape[:axis] + (chunks, length // chunks) + x.shape[axis + 1:]
    x = jnp.take(x.reshape(shape), jnp.asarray(order), axis=axis)
    return x.reshape(x.shape[:axis] + (length,) + x.shape[axis + 2:])


def to_zigzag(x, num_devices: int, axis: int = 2):
    """Permutes a global sequence (natural order along `axis`, default the L of
    [B, H, L, D]) so that splitting it contiguously over `num_devices` gives device i the
    chunks i and 2n-1-i. Apply to q, k and v before sharding; `from_zigzag` undoes it."""
    return _permute_chunks(x, zigzag_order(num_devices), axis)


def from_zigzag(x, num_devices: int, axis: int = 2):
    """Inverse of `to_zigzag` (e.g. for the gathered output)."""
    return _permute_chunks(x, np.argsort(zigzag_order(num_devices)), axis)


# ---------------------------------------------------------------------------
# the public function

@dataclasses.dataclass(frozen=True)
class _Ring:
    axis_name: Hashable
    causal: bool
    zigzag: bool
    params: StaticParams  # non-causal block params; the diagonal block adds causality

    @property
    def diag_params(self):
        return dataclasses.replace(self.params, window_right=0)


def ring_attention(q, k, v, *, axis_name, mask: Optional[str] = None,
                   scale: Optional[float] = None, sinks=None, layout: Optional[str] = None,
                   q_segment_ids=None, kv_segment_ids=None,
                   logits_soft_cap: Optional[float] = None,
                   implementation: Optional[str] = None):
    """Attention over a sequence split across the mesh axis `axis_name`; call it inside
    `jax.shard_map` with q, k, v sharded along L (dim 2) over that axis.

    Same layout and contract as `scaled_dot_product_attention` on the global arrays:
    q [B, Hq, L, D], k [B, Hk, L, D], v [B, Hk, L, Dv] (local shards here), GQA/MQA,
    `scale` (default 1/sqrt(D)), `sinks` [Hq] (replicated over the axis), `mask` None or
    "causal" (self-attention: the global Lq equals Lk, so bottom-right = top-left).
    `layout`: None (contiguous: device i holds positions i*L/n..) or "zigzag" (device i
    holds chunks i and 2n-1-i of 2n; see `to_zigzag`). `implementation` as for
    `scaled_dot_product_attention` (each block runs through that kernel).
    `q_segment_ids` / `kv_segment_ids`: the local shards [B, L/n] of the global ids (in the
    same layout as q and k; the kv ids travel around the ring with their K/V block);
    `q_segment_ids` alone serves as both. `logits_soft_cap` as in
    `scaled_dot_product_attention`.
    Returns the local shard of the output, [B, Hq, L/n, Dv] in the inputs' dtype.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, L, D], got shape {x.shape}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    b, hq, lq, d = q.shape
    _, hk, lk, _ = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if v.shape[1] != hk or v.shape[2] != lk:
        raise ValueError(f"k and v must agree in heads and length: k {k.shape}, v {v.shape}")
    if hk == 0 or hq % hk:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number "
                         f"of key/value heads ({hk}): q {q.shape}, k {k.shape}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must have the same head dim: q {q.shape}, k {k.shape}")
    if mask not in (None, "causal"):
        raise ValueError(f"ring_attention supports mask=None or 'causal', got {mask!r}")
    if layout not in (None, "contiguous", "zigzag"):
        raise ValueError(f"layout must be None, 'contiguous' or 'zigzag', got {layout!r}")
    if implementation is not None and implementation not in dispatch.IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {dispatch.IMPLEMENTATIONS}, "
                         f"got {implementation!r}")
    causal = mask == "causal"
    zigzag = causal and layout == "zigzag"  # without a mask every layout is the same
    if causal and lq != lk:
        raise ValueError(f"causal ring attention is self-attention: the local q and k "
                         f"lengths must be equal, got q {q.shape}, k {k.shape}")
    if zigzag and lq % 2:
        raise ValueError(f"layout='zigzag' needs an even local length, got {lq}")
    dtype = jnp.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (hq,):
            raise ValueError(f"sinks must have shape (Hq,) = ({hq},), got {sinks.shape}")

    segments = checks.check_segment_ids(q_segment_ids, kv_segment_ids, b, lq, lk)
    scale = float(1.0 / math.sqrt(d) if scale is None else scale)
    params = StaticParams(scale=scale, window_left=-1, window_right=-1, bottom_right=False,
                          seq_major=False, implementation=implementation,
                          logits_soft_cap=checks.check_soft_cap(logits_soft_cap))
    ring = _Ring(axis_name, causal, zigzag, params)
    if b == 0 or lq == 0:
        return jnp.zeros(q.shape[:3] + (v.shape[3],), dtype)
    return _ring(q, k, v, sinks, None if segments[0] is None else segments, ring)


# ---------------------------------------------------------------------------
# forward

def _axis_size(axis_name):
    if hasattr(lax, "axis_size"):
        return int(lax.axis_size(axis_name))
    return int(lax.psum(1, axis_name))  # pragma: no cover - older jax


def _varies(x, axis_name) -> bool:
    """Whether x is typed as varying over axis_name (False when vma is not tracked)."""
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    vma = getattr(aval, "vma", None)  # jax <= 0.9
    if vma is None:  # jax 0.10+: aval.manual_axis_type.varying
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return bool(vma) and axis_name in vma


def _merge(o, l, ob, lb):
    """Combine two normalized partial results (out f32, lse f32) by log-sum-exp."""
    m = jnp.maximum(l, lb)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w, wb = jnp.exp(l - m_safe), jnp.exp(lb - m_safe)
    total = w + wb
    ok = total > 0
    inv = jnp.where(ok, 1.0 / jnp.where(ok, total, 1.0), 0.0)
    o = (o * (w * inv)[..., None] + ob * (wb * inv)[..., None])
    l = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, total, 1.0)), -jnp.inf)
    return o, l


def _attend(q, k, v, params, qs=None, ks=None):
    out, lse = primitives.fwd(q, k, v, None, None, None, None, params, q_segment_ids=qs,
                              kv_segment_ids=ks)
    return out.astype(jnp.float32), lse


def _ids(segs, sl=slice(None)):
    """Segment ids (None or [B, L]) restricted to positions `sl`."""
    return None if segs is None else segs[:, sl]


def _pad_front(x, axis, total, value=0.0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (total - x.shape[axis], 0)
    return jnp.pad(x, widths, constant_values=value)


def _block_fwd(ring: _Ring, t, r, q, kb, vb, qs, ksb):
    """(out f32, lse) of the local queries against the block held at ring step t (qs, ksb:
    the queries' and the block's segment ids, or None)."""
    if not ring.causal:
        return _attend(q, kb, vb, ring.params, qs, ksb)
    if t == 0:  # own block: causal on equal lengths
        return _attend(q, kb, vb, ring.diag_params, qs, ksb)
    lq = q.shape[2]
    if ring.zigzag:
        c = lq // 2

        def lower():  # source < r: all queries see the source's first chunk
            return _attend(q, kb[:, :, :c], vb[:, :, :c], ring.params, qs,
                           _ids(ksb, slice(None, c)))

        def upper():  # source > r: the second local chunk sees both source chunks
            o, l = _attend(q[:, :, c:], kb, vb, ring.params, _ids(qs, slice(c, None)), ksb)
            return _pad_front(o, 2, lq), _pad_front(l, 2, lq, -jnp.inf)

        return lax.cond(r >= t, lower, upper)

    def full():
        return _attend(q, kb, vb, ring.params, qs, ksb)

    def skip():  # a block entirely above the diagonal: no kernel call
        o = jnp.zeros_like(q, jnp.float32, shape=q.shape[:3] + vb.shape[3:])
        return o, jnp.full_like(q[..., 0], -jnp.inf, jnp.float32)

    # the block from device r - t is below the diagonal iff it did not wrap around
    return lax.cond(r >= t, full, skip)


def _sink_merge(o, l, sinks):
    s = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], l.shape)
    return _merge(o, l, jnp.zeros_like(o), s)


def _forward(q, k, v, sinks, segs, ring: _Ring):
    n = _axis_size(ring.axis_name)
    r = lax.axis_index(ring.axis_name)
    perm = [(i, (i + 1) % n) for i in range(n)]
    qs, ksb = (None, None) if segs is None else segs
    kb, vb = k, v
    o = l = None
    for t in range(n):
        # send first so that the transfer overlaps this step's kernel (the keys' segment
        # ids travel with their block)
        nxt = lax.ppermute((kb, vb, ksb), ring.axis_name, perm) if t < n - 1 else None
        ob, lb = _block_fwd(ring, t, r, q, kb, vb, qs, ksb)
        o, l = (ob, lb) if o is None else _merge(o, l, ob, lb)
        if nxt is not None:
            kb, vb, ksb = nxt
    if sinks is not None:
        o, l = _sink_merge(o, l, sinks)
    return o.astype(q.dtype), l


# ---------------------------------------------------------------------------
# backward

def _grads(q, kb, vb, out, lse, dout, params, qs=None, ks=None):
    dq, dk, dv = primitives.bwd(q, kb, vb, out, lse, dout, None, None, None, None, params,
                                q_segment_ids=qs, kv_segment_ids=ks)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _pad_back(x, axis, total):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, total - x.shape[axis])
    return jnp.pad(x, widths)


def _block_bwd(ring: _Ring, t, r, q, kb, vb, out, lse, dout, qs, ksb):
    """(dq, dk, dv) float32 contributions of the block held at ring step t."""
    if not ring.causal:
        return _grads(q, kb, vb, out, lse, dout, ring.params, qs, ksb)
    if t == 0:
        return _grads(q, kb, vb, out, lse, dout, ring.diag_params, qs, ksb)
    lq = q.shape[2]
    if ring.zigzag:
        c = lq // 2

        def lower():
            dq, dk, dv = _grads(q, kb[:, :, :c], vb[:, :, :c], out, lse, dout, ring.params,
                                qs, _ids(ksb, slice(None, c)))
            return dq, _pad_back(dk, 2, lq), _pad_back(dv, 2, lq)

        def upper():
            dq, dk, dv = _grads(q[:, :, c:], kb, vb, out[:, :, c:], lse[:, :, c:],
                                dout[:, :, c:], ring.params, _ids(qs, slice(c, None)), ksb)
            return _pad_front(dq, 2, lq), dk, dv

        return lax.cond(r >= t, lower, upper)

    def full():
        return _grads(q, kb, vb, out, lse, dout, ring.params, qs, ksb)

    def skip():
        return tuple(jnp.zeros_like(x, jnp.float32) for x in (q, kb, vb))

    return lax.cond(r >= t, full, skip)


def _backward(ring: _Ring, residuals, dout):
    q, k, v, sinks, segs, out, lse, sum_sinks = residuals
    dout = dout.astype(out.dtype)
    n = _axis_size(ring.axis_name)
    r = lax.axis_index(ring.axis_name)
    perm = [(i, (i + 1) % n) for i in range(n)]
    qs, ksb = (None, None) if segs is None else segs
    kb, vb = k, v
    dq = dk_acc = dv_acc = None
    for t in range(n):
        nxt = lax.ppermute((kb, vb, ksb), ring.axis_name, perm) if t < n - 1 else None
        dq_t, dk_t, dv_t = _block_bwd(ring, t, r, q, kb, vb, out, lse, dout, qs, ksb)
        if dq is None:
            dq, dk_acc, dv_acc = dq_t, dk_t, dv_t
        else:
            dq, dk_acc, dv_acc = dq + dq_t, dk_acc + dk_t, dv_acc + dv_t
        # the accumulators travel with their block; after n hops they are home
        dk_acc, dv_acc = lax.ppermute((dk_acc, dv_acc), ring.axis_name, perm)
        if nxt is not None:
            kb, vb, ksb = nxt
    dsinks = None
    if sinks is not None:
        delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)
        finite = jnp.isfinite(lse)
        s = sinks.astype(jnp.float32)[None, :, None]
        p_sink = jnp.where(finite, jnp.exp(s - jnp.where(finite, lse, 0.0)), 0.0)
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2))
        # Sinks are shared by every device's rows. With varying-axes tracking
        # (check_vma=True) a replicated input's cotangent must be replicated too, so we
        # sum here; without it shard_map's transpose sums over the axis itself.
        if sum_sinks is not None:
            dsinks = lax.psum(dsinks, ring.axis_name)
        dsinks = dsinks.astype(sinks.dtype)
    return (dq.astype(q.dtype), dk_acc.astype(k.dtype), dv_acc.astype(v.dtype), dsinks,
            None)  # integer segment ids: no cotangent


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring(q, k, v, sinks, segs, ring: _Ring):
    return _forward(q, k, v, sinks, segs, ring)[0]


def _ring_fwd(q, k, v, sinks, segs, ring):
    out, lse = _forward(q, k, v, sinks, segs, ring)
    # decided here, where the types are the caller's (residuals may come back varying);
    # carried as tree structure (leafless () = yes) so it stays static
    sum_sinks = (() if sinks is not None and _varies(q, ring.axis_name)
                 and not _varies(sinks, ring.axis_name) else None)
    return out, (q, k, v, sinks, segs, out, lse, sum_sinks)


_ring.defvjp(_ring_fwd, _backward)
