"""Pure-JAX attention: the `xla` and `xla_chunked` lowerings of the primitives.

Two algorithms over the same canonical arguments (see docs/ffi_contract.md):

- `exact_forward` / `exact_backward`: exact einsum softmax, materializing the
  [B, H, Lq, Lk] scores (fast for small problems);
- `chunked_forward` / `chunked_backward`: online softmax over blocks of keys,
  O(L) memory in the sequence length for long sequences.

Canonical arguments: q [B, Hq, Lq, D] (or [B, Lq, Hq, D] when seq_major), k, v
likewise with Hk heads; mask None or rank 4 [mB, mH, mLq, mLk] (each 1 or full,
head-major), bool = keep or additive; sinks None or float [1 or B, Hq]; lengths
None or int32 [B]; segment ids None or int32 [B, Lq] and [B, Lk] (both or neither: a
query sees a key only where their ids are equal); params.logits_soft_cap > 0 caps the
scaled logits, cap * tanh(scale * q.k / cap), before the additive mask. Returns (out, lse)
with lse float32 [B, Hq, Lq] (natural log, -inf for rows with nothing to attend, whose
output is 0).

Numerics (docs/ffi_contract.md): a row whose visible scores include a NaN gets NaN (out and
lse), and so do its gradients; masked scores are replaced, never added to, so a NaN key a
mask hides stays hidden; keys, values and queries outside the valid lengths are zeroed
before any product, so whatever they hold never reaches outputs or gradients. Exponents
are clamped at 0: s - max can come out slightly positive when XLA contracts the scaling
into an FMA, which overflows exp() for logits near 1e30.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from jax_sdpa.config import StaticParams

NEG_INF = -jnp.inf


def _to_bhld(x, seq_major):
    return jnp.swapaxes(x, 1, 2) if seq_major else x


def _from_bhld(x, seq_major):
    return jnp.swapaxes(x, 1, 2) if seq_major else x


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _valid_lengths(lengths, full):
    if lengths is None:
        return None
    return jnp.clip(lengths.astype(jnp.int32), 0, full)


def visibility(params: StaticParams, batch, len_q, len_kv, key_index, q_lengths, kv_lengths,
               bool_mask=None, q_segment_ids=None, kv_segment_ids=None, query_index=None):
    """Bool [B or 1, 1, Lq, len(key_index)]: may query i see key j (before additive masks).
    kv_segment_ids, when given, are the ids of the keys in `key_index` ([B, len(key_index)]):
    the comparison is O(Lq * len(key_index)), never O(Lq * Lk) for a block of keys.
    query_index: the queries' positions (a block of them; q_segment_ids then theirs), all
    Lq when None."""
    if query_index is None:
        query_index = jnp.arange(len_q, dtype=jnp.int32)
    i = query_index.astype(jnp.int32).reshape(1, 1, -1, 1)
    j = key_index.astype(jnp.int32).reshape(1, 1, 1, -1)
    qlen = _valid_lengths(q_lengths, len_q)
    kvlen = _valid_lengths(kv_lengths, len_kv)
    qlen_b = (jnp.full((batch,), len_q, jnp.int32) if qlen is None else qlen).reshape(-1, 1, 1, 1)
    kvlen_b = (jnp.full((batch,), len_kv, jnp.int32) if kvlen is None else kvlen).reshape(
        -1, 1, 1, 1)
    visible = (i < qlen_b) & (j < kvlen_b)
    offset = (kvlen_b - qlen_b) if params.bottom_right else 0
    d = j - (i + offset)
    if params.window_left >= 0:
        visible = visible & (d >= -params.window_left)
    if params.window_right >= 0:
        visible = visible & (d <= params.window_right)
    if bool_mask is not None:
        visible = visible & bool_mask
    if q_segment_ids is not None:
        visible = visible & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return visible


def _grouped(x, heads_kv):
    """[B, Hq, ...] -> [B, Hk, G, ...]."""
    b, hq = x.shape[:2]
    return x.reshape((b, heads_kv, hq // heads_kv) + x.shape[2:])


def _mask_grouped(mask, heads_q, heads_kv):
    """Mask [mB, mH, mLq, mLk] -> broadcastable to [B, Hk, G, Lq, Lk]."""
    if mask.shape[1] == 1:
        return mask[:, :, None]
    return _grouped(mask, heads_kv)


def _scaled_dots(qg, k, params, precision, acc):
    """scale * q.k [B, Hk, G, Lq, Lk] in acc. Float32 (and wider) queries are scaled before
    the product, so the scores leave the matmul rounded once and every later use (the max,
    the exponent, the backward's recomputation) sees the same values; a separate multiply
    could be contracted into an FMA in one of them only."""
    return _soft_cap(_scaled_product(qg, lambda q: jnp.einsum(
        "bkgid,bkjd->bkgij", q, k, precision=precision, preferred_element_type=acc),
        params, acc), params)


def _scaled_product(q, product, params, acc):
    """scale * product(q): float32 (and wider) queries scaled before it (see _scaled_dots)."""
    scale = jnp.asarray(params.scale, acc)
    if q.dtype == acc:
        return product(q * scale)
    return product(q) * scale


def _soft_cap(s, params):
    """cap * tanh(s / cap) (Gemma 2's logit soft-capping); s itself when there is no cap."""
    cap = params.logits_soft_cap
    if not cap:
        return s
    cap = jnp.asarray(cap, s.dtype)
    return cap * jnp.tanh(s / cap)


def _soft_cap_slope(capped, params):
    """d capped / d (scale * q.k) = 1 - tanh^2 from the capped logits; None without a cap."""
    cap = params.logits_soft_cap
    if not cap:
        return None
    t = capped / jnp.asarray(cap, capped.dtype)
    return 1 - t * t


def _scores(q, k, mask, params, precision, acc):
    """Scaled (soft-capped) scores [B, Hk, G, Lq, Lk] (+ additive mask), float32 or wider,
    and the cap's slope (None without a cap)."""
    s = _scaled_dots(_grouped(q, k.shape[1]), k, params, precision, acc)
    slope = _soft_cap_slope(s, params)
    if mask is not None and mask.dtype != jnp.bool_:
        s = s + _mask_grouped(mask, q.shape[1], k.shape[1]).astype(acc)
    return s, slope


def _visible_grouped(params, q, k, mask, q_lengths, kv_lengths, q_segment_ids,
                     kv_segment_ids):
    """Bool [B or 1, Hk or 1, G or 1, Lq, Lk], or None where every key is visible to every
    query (no lengths, window, boolean mask or segment ids): the materialized paths then
    select nothing, so XLA fuses their softmax as it fuses jax.nn's."""
    if (q_lengths is None and kv_lengths is None and q_segment_ids is None
            and params.window_left < 0 and params.window_right < 0
            and (mask is None or mask.dtype != jnp.bool_)):
        return None
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    bool_mask = None
    if mask is not None and mask.dtype == jnp.bool_:
        bool_mask = _mask_grouped(mask, hq, k.shape[1])
    vis = visibility(params, b, lq, lk, jnp.arange(lk), q_lengths, kv_lengths,
                     q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    vis = vis[:, :, None]  # [B, 1, 1, Lq, Lk]
    if bool_mask is not None:
        vis = vis & bool_mask
    return vis


def _sink_logits(sinks, heads_kv, acc):
    """sinks [sB, Hq] -> [sB, Hk, G, 1]."""
    return _grouped(sinks.astype(acc), heads_kv)[..., None]


def _padded_rows(q_lengths, batch, len_q):
    """Bool [B, 1, 1, Lq]: query rows beyond the valid length."""
    if q_lengths is None:
        return None
    qlen = _valid_lengths(q_lengths, len_q)
    return (jnp.arange(len_q)[None, :] >= qlen[:, None])[:, None, None, :]


def _zero_past(x, lengths):
    """x [B, H, L, ...] with the positions at or past lengths[b] set to 0 (lengths None: x)."""
    if lengths is None:
        return x
    length = x.shape[2]
    valid = jnp.arange(length, dtype=jnp.int32).reshape(1, 1, length, 1) < \
        _valid_lengths(lengths, length).reshape(-1, 1, 1, 1)
    return jnp.where(valid, x, jnp.zeros((), x.dtype))


def _shift(m):
    """The softmax shift of a row maximum m: 0 for rows with nothing visible (m = -inf);
    NaN and +inf are kept so that they reach the row."""
    return jnp.where(m == NEG_INF, jnp.zeros((), m.dtype), m)


def _exp_below(x):
    """exp(min(x, 0)): for x = s - (a maximum of s) computed with rounding (see module doc)."""
    return jnp.exp(jnp.minimum(x, jnp.zeros((), x.dtype)))


def _lse_from(shift, total):
    """log-sum-exp from the shift and the (shifted) sum: -inf for an empty row (sum 0),
    NaN for a NaN sum."""
    empty = total == 0
    return jnp.where(empty, NEG_INF, shift + jnp.log(jnp.where(empty, jnp.ones((), total.dtype),
                                                                  total)))


def _live(lse):
    """Rows that attend to something: lse != -inf (a NaN row is live, so it stays NaN)."""
    return lse != NEG_INF


def _segments(q_segment_ids, kv_segment_ids):
    """Both segment-id operands as int32, or neither."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids are given together or not at all")
    if q_segment_ids is None:
        return None, None
    return q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32)


def exact_forward(q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
            params: StaticParams, precision=None, probs_dtype=None):
    """Exact attention. Returns (out, lse). `probs_dtype`: the dtype P takes into its
    matmul (None: the accumulation dtype; `dispatch.xla_probs_dtype` decides)."""
    q_segment_ids, kv_segment_ids = _segments(q_segment_ids, kv_segment_ids)
    q, k, v = (_to_bhld(x, params.seq_major) for x in (q, k, v))
    b, hq, lq, _ = q.shape
    hk = k.shape[1]
    acc = _acc_dtype(q.dtype)
    v = _zero_past(v, kv_lengths)
    s, _ = _scores(q, k, mask, params, precision, acc)
    vis = _visible_grouped(params, q, k, mask, q_lengths, kv_lengths, q_segment_ids,
                           kv_segment_ids)
    if (not params.lse_used and vis is None and sinks is None and mask is None
            and acc == jnp.float32):
        return _forward_without_lse(s, v, b, hq, lq, q.dtype, params, precision, probs_dtype)
    if vis is not None:
        s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        m = jnp.maximum(m, _sink_logits(sinks, hk, acc))
    m_safe = _shift(m)
    p = _exp_below(s - m_safe[..., None])
    total = jnp.sum(p, axis=-1)
    if sinks is not None:
        total = total + _exp_below(_sink_logits(sinks, hk, acc) - m_safe)
    lse = _lse_from(m_safe, total)
    pad = _padded_rows(q_lengths, b, lq)
    if pad is not None:
        lse = jnp.where(pad, NEG_INF, lse)
    # a row with a sum of 0 (nothing visible, or a padded query row) has every p = 0:
    # dividing by 1 keeps it 0 without a select over the scores
    p = p / jnp.where(total == 0, jnp.ones((), acc), total)[..., None]
    out = _weighted_values(p, v, b, hq, lq, q.dtype, params, precision, probs_dtype)
    return out, lse.reshape(b, hq, lq).astype(jnp.float32)


def _forward_without_lse(s, v, b, hq, lq, out_dtype, params, precision, probs_dtype):
    """The forward of a call whose lse nobody reads and whose every key is visible: the
    softmax alone. Returning lse keeps XLA from fusing the softmax into one kernel over the
    scores (H200, B1 H16 L4096 D512 bf16: 1.75 ms with lse in any formulation, 1.35 without,
    benchmarks/results/h200/xla_hlo.txt). lse comes back NaN, as from the cuDNN forward
    without stats. The maximum is held above float32's lowest, so a row of -inf scores
    (infinite inputs) gets 0, as in `exact_forward`, and exponents are clamped at 0 (module doc)."""
    acc = s.dtype
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), jnp.finfo(acc).min)
    e = _exp_below(s - m)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total == 0, jnp.ones((), acc), total)
    out = _weighted_values(p, v, b, hq, lq, out_dtype, params, precision, probs_dtype)
    return out, jnp.full((b, hq, lq), jnp.nan, jnp.float32)


def _weighted_values(p, v, b, hq, lq, out_dtype, params, precision, probs_dtype):
    """out = P V from the normalized probabilities [B, Hk, G, Lq, Lk], in the caller's
    layout and dtype. With 16-bit P (`probs_dtype`) the matmul writes the output dtype
    itself, as jax.nn's does, rather than float32 and a conversion after it (the tensor
    cores accumulate in float32 either way)."""
    acc = p.dtype
    out = jnp.einsum("bkgij,bkjd->bkgid", _pv_operand(p, v.dtype, acc, probs_dtype), v,
                     precision=precision,
                     preferred_element_type=acc if probs_dtype is None else out_dtype)
    return _from_bhld(out.reshape(b, hq, lq, v.shape[-1]).astype(out_dtype), params.seq_major)


def _pv_operand(p, v_dtype, acc, probs_dtype):
    """P as the operand of its matmul with V: in `probs_dtype` where given, else in the
    accumulation dtype (more accurate than rounding it to 16 bits first)."""
    if probs_dtype is not None:
        return p.astype(probs_dtype)
    return p.astype(jnp.promote_types(v_dtype, acc))


def _probs_operand(x, probs_dtype):
    """P or dS as a backward matmul operand: in `probs_dtype` where given, else as
    computed (the accumulation dtype)."""
    return x if probs_dtype is None else x.astype(probs_dtype)


def exact_backward(q, k, v, out, lse, dout, mask, sinks, q_lengths, kv_lengths, q_segment_ids,
             kv_segment_ids, params: StaticParams, precision=None, probs_dtype=None):
    """Exact gradients (dq, dk, dv) from the saved lse (never re-runs the forward);
    `probs_dtype` as in `exact_forward`, for P and dS."""
    q_segment_ids, kv_segment_ids = _segments(q_segment_ids, kv_segment_ids)
    del sinks  # enters only through lse
    q, k, v, out, dout = _backward_inputs(q, k, v, out, dout, q_lengths, kv_lengths, params)
    acc = _acc_dtype(q.dtype)
    p, _, ds_dots = _probs_and_dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths,
                                       q_segment_ids, kv_segment_ids, params, precision, acc)
    dq, dk, dv = _grads_from_dscores(q, k, dout, _probs_operand(p, probs_dtype),
                                     _probs_operand(ds_dots, probs_dtype), params, precision,
                                     acc)
    return tuple(_from_bhld(x, params.seq_major) for x in (dq, dk, dv))


def _backward_inputs(q, k, v, out, dout, q_lengths, kv_lengths, params):
    """BHLD operands of a backward, zeroed outside the valid lengths."""
    q, k, v, out, dout = (_to_bhld(x, params.seq_major) for x in (q, k, v, out, dout))
    q, dout = _zero_past(q, q_lengths), _zero_past(dout, q_lengths)
    k, v = _zero_past(k, kv_lengths), _zero_past(v, kv_lengths)
    return q, k, v, out, dout


def _probs_dscores_block(s, vis, lse_g, dp, delta, slope, acc):
    """P = exp(s - lse), dS = P * (dP - delta) (the gradient of the logits, an additive
    mask's) and dS times the soft cap's slope (the gradient of scale * q.k; dS itself
    without a cap), where visible and the row is live, else 0 (selected, so that a NaN dP of
    a hidden key does not turn 0 into NaN)."""
    live = _live(lse_g) if vis is None else vis & _live(lse_g)
    lse_safe = jnp.where(_live(lse_g), lse_g, jnp.zeros((), acc))
    zero = jnp.zeros((), acc)
    p = jnp.where(live, _exp_below(s - lse_safe), zero)
    ds = jnp.where(live, p * (dp - delta), zero)
    ds_dots = ds if slope is None else jnp.where(live, ds * slope, zero)
    return p, ds, ds_dots


def _probs_and_dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, q_segment_ids,
                       kv_segment_ids, params, precision, acc):
    """P, dS = P * (dP - delta) and dS through the soft cap, all [B, Hk, G, Lq, Lk], inputs
    in BHLD."""
    hk = k.shape[1]
    s, slope = _scores(q, k, mask, params, precision, acc)
    lse_g = _grouped(lse.astype(acc), hk)[..., None]
    vis = _visible_grouped(params, q, k, mask, q_lengths, kv_lengths, q_segment_ids,
                           kv_segment_ids)
    dout_g = _grouped(dout, hk)
    delta = jnp.sum(dout_g.astype(acc) * _grouped(out, hk).astype(acc), axis=-1,
                    keepdims=True)
    dp = jnp.einsum("bkgid,bkjd->bkgij", dout_g, v, precision=precision,
                    preferred_element_type=acc)
    return _probs_dscores_block(s, vis, lse_g, dp, delta, slope, acc)


def _grads_from_dscores(q, k, dout, p, ds, params, precision, acc):
    hk = k.shape[1]
    b, hq, lq, _ = q.shape
    scale = jnp.asarray(params.scale, acc)
    qg, dout_g = _grouped(q, hk), _grouped(dout, hk)
    dq = jnp.einsum("bkgij,bkjd->bkgid", ds, k, precision=precision,
                    preferred_element_type=acc) * scale
    dk = jnp.einsum("bkgij,bkgid->bkjd", ds, qg, precision=precision,
                    preferred_element_type=acc) * scale
    dv = jnp.einsum("bkgij,bkgid->bkjd", p, dout_g, precision=precision,
                    preferred_element_type=acc)
    return (dq.reshape(b, hq, lq, q.shape[-1]).astype(q.dtype), dk.astype(k.dtype),
            dv.astype(dout.dtype))


def dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, q_segment_ids,
            kv_segment_ids, params: StaticParams, precision=None):
    """dL/d(score) [B, Hq, Lq, Lk] in float32: the gradient of an additive mask/bias
    before it is summed over the mask's broadcast dimensions (after the soft cap: the cap's
    slope is not in it)."""
    q_segment_ids, kv_segment_ids = _segments(q_segment_ids, kv_segment_ids)
    q, k, v, out, dout = _backward_inputs(q, k, v, out, dout, q_lengths, kv_lengths, params)
    acc = _acc_dtype(q.dtype)
    _, ds, _ = _probs_and_dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths,
                                  q_segment_ids, kv_segment_ids, params, precision, acc)
    b, hq, lq = q.shape[:3]
    return ds.reshape(b, hq, lq, k.shape[2])


# ---------------------------------------------------------------------------
# Chunked (online softmax) versions: O(Lq * block) temporaries, not O(Lq * Lk).

def choose_block(batch, heads_q, len_q, len_kv, budget_bytes=64 << 20):
    """Keys per block so that one block's float32 scores stay near the budget."""
    per_key = 4 * max(1, batch * heads_q * len_q)
    block = max(16, budget_bytes // per_key)
    block = 1 << int(math.floor(math.log2(block)))
    return int(min(block, max(16, 1 << (max(1, len_kv) - 1).bit_length())))


def _blocks(x, axis, block, nblocks):
    """Pads `axis` to nblocks*block and moves the block index to the front."""
    pad = nblocks * block - x.shape[axis]
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, pad)
        x = jnp.pad(x, widths)
    shape = x.shape[:axis] + (nblocks, block) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _mask_blocks(mask, block, nblocks):
    """Per-block masks: [nblocks, mB, mH, mLq, block] (or broadcast over keys)."""
    if mask is None:
        return None, False
    if mask.shape[3] == 1:
        return mask, False
    return _blocks(mask, 3, block, nblocks), True


def _key_blocks(k, v, mask, kv_segment_ids, batch, heads_q, len_q, len_kv, block):
    """K, V, the keys' segment ids (when given) and the mask (when it varies over keys) cut
    into key blocks: the block size, their count, the scan inputs (block index, K block,
    V block, segment-id block or None[, mask block]) and whether the mask is among them."""
    block = block or choose_block(batch, heads_q, len_q, len_kv)
    nblocks = max(1, -(-len_kv // block))
    m_blocks, mask_per_block = _mask_blocks(mask, block, nblocks)
    seg_blocks = (None if kv_segment_ids is None
                  else _blocks(kv_segment_ids, 1, block, nblocks))  # [nblocks, B, block]
    xs = (jnp.arange(nblocks), _blocks(k, 2, block, nblocks), _blocks(v, 2, block, nblocks),
          seg_blocks)
    return block, nblocks, xs + ((m_blocks,) if mask_per_block else ()), mask_per_block


def _keys_major(x, shape):
    """x broadcastable to [B, Hk, G, Lq, block] -> [B, Hk, block, G * Lq]."""
    b, hk, g, lq, block = shape
    x = jnp.broadcast_to(x, shape)
    return jnp.transpose(x, (0, 1, 4, 2, 3)).reshape(b, hk, block, g * lq)


def _block_scores(qg, kb, mb, idx, block, params, q_lengths, kv_lengths, q_segment_ids,
                  seg_b, shape, precision, acc, query_index=None):
    """Scaled (soft-capped) scores of key block `idx` against the grouped queries qg, their
    visibility (band, lengths, segments, keys past the end, a bool mask) and the cap's slope
    (None without a cap), an additive mask added to them, all laid out [B, Hk, block, G * Lq]:
    keys major, the group's query rows minor. seg_b: the block's key segment ids [B, block] or
    None; shape = (B, Hq, Hk, Lq, Lk); query_index: the positions of the queries in qg when
    they are a block of them (q_segment_ids then theirs). In this layout every product of the
    backward with P or dS (dK = dS^T Q, dV = P^T dO, dQ^T = K^T dS^T) reads it in place; the
    query-major layout needs a transposed copy of two score-sized arrays per block, which
    XLA's CPU backend fuses into the elementwise work of dS and P and runs several times
    slower."""
    b, hq, hk, lq, lk = shape
    g, lq_t, d = qg.shape[2], qg.shape[3], qg.shape[4]
    q_rows = qg.reshape(b, hk, g * lq_t, d)
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    s = _soft_cap(_scaled_product(q_rows, lambda q: lax.dot_general(
        kb, q, dims, precision=precision, preferred_element_type=acc), params, acc), params)
    slope = _soft_cap_slope(s, params)
    key_index = idx * block + jnp.arange(block)
    vis = visibility(params, b, lq, lk, key_index, q_lengths, kv_lengths,
                     q_segment_ids=q_segment_ids, kv_segment_ids=seg_b,
                     query_index=query_index)[:, :, None]
    vis = vis & (key_index < lk).reshape(1, 1, 1, 1, block)
    full = (b, hk, g, lq_t, block)
    if mb is not None:
        mg = _mask_grouped(mb, hq, hk)
        if mb.dtype == jnp.bool_:
            vis = vis & mg
        else:
            s = s + _keys_major(mg.astype(acc), full)
    return s, _keys_major(vis, full), slope


def _carry_zero(acc, *operands):
    """A scalar 0 of dtype acc that varies over the manual mesh axes of every operand (inside
    shard_map a scan's initial carry must have the varying axes of what the body returns).
    full_like reads no values, so NaN operands stay out of it."""
    zero = jnp.zeros((), acc)
    for x in operands:
        if x is not None:
            zero = zero + jnp.full_like(x, 0, dtype=acc, shape=())
    return zero


# Packed sequences: query blocks x key blocks, and a pair whose segment ids can't meet is
# skipped (lax.cond runs one branch), so 8 equal segments cost about 1/8 of the full call.
PACKED_BLOCK = 256


def _packed_tiles(q_segment_ids, mask, len_q, len_kv):
    """Whether a call runs on (query block, key block) tiles: segment ids, at least two
    blocks each way, and no mask that varies over queries (it would need cutting too)."""
    return (q_segment_ids is not None and len_q > PACKED_BLOCK and len_kv > PACKED_BLOCK
            and (mask is None or mask.shape[2] == 1))


def _tiles_meet(q_segment_ids, kv_segment_ids, block, nq, nk):
    """Bool [nq, nk]: may query block a and key block c share a segment in any batch row
    (their [min, max] id ranges overlap: conservative, exact for sorted packing)."""
    lo_pad, hi_pad = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min

    def ranges(ids, n):
        pad = n * block - ids.shape[1]
        lo = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=lo_pad).reshape(-1, n, block)
        hi = jnp.pad(ids, ((0, 0), (0, pad)), constant_values=hi_pad).reshape(-1, n, block)
        return lo.min(axis=-1), hi.max(axis=-1)  # [B, n]

    q_lo, q_hi = ranges(q_segment_ids, nq)
    k_lo, k_hi = ranges(kv_segment_ids, nk)
    meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    return meet.any(axis=0)


def _rows_query_major(x, g, rows):
    """A keys-major accumulator [..., D, G * rows] -> [..., G, rows, D]."""
    return jnp.moveaxis(x.reshape(x.shape[:-1] + (g, rows)), -3, -1)


def _index_blocks(blocks, i):
    """Block i of each of a tuple of blocked arrays (None stays None)."""
    return tuple(None if x is None else lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
                 for x in blocks)


def _unblock(x, axis, length):
    """Inverse of _blocks: [nblocks, ..., block, ...] -> [..., length, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:]
    return lax.slice_in_dim(x.reshape(shape), 0, length, axis=axis)


def chunked_forward(q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                    kv_segment_ids, params: StaticParams, precision=None,
                    block: Optional[int] = None, probs_dtype=None):
    q_segment_ids, kv_segment_ids = _segments(q_segment_ids, kv_segment_ids)
    q, k, v = (_to_bhld(x, params.seq_major) for x in (q, k, v))
    b, hq, lq, _ = q.shape
    hk, lk = k.shape[1], k.shape[2]
    dv_ = v.shape[-1]
    acc = _acc_dtype(q.dtype)
    v = _zero_past(v, kv_lengths)
    tiles = _packed_tiles(q_segment_ids, mask, lq, lk)
    if tiles:
        block = block or PACKED_BLOCK
    block, nk, xs, mask_per_block = _key_blocks(k, v, mask, kv_segment_ids, b, hq, lq, lk,
                                                block)
    qg = _grouped(q, hk)
    g = hq // hk
    zero = _carry_zero(acc, q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                       kv_segment_ids)

    def initial(rows):
        """The running max and sum [B, Hk, G * rows] and output O^T [B, Hk, Dv, G * rows] of
        `rows` queries before any key (keys-major blocks: _block_scores)."""
        m0 = jnp.full((b, hk, g, rows), NEG_INF, acc) + zero
        if sinks is not None:
            m0 = _sink_logits(sinks, hk, acc) + jnp.zeros((b, hk, g, rows), acc) + zero
            l0 = jnp.where(m0 == NEG_INF, jnp.zeros((), acc), jnp.ones((), acc))
        else:
            l0 = jnp.zeros((b, hk, g, rows), acc) + zero
        return (m0.reshape(b, hk, g * rows), l0.reshape(b, hk, g * rows),
                jnp.zeros((b, hk, dv_, g * rows), acc) + zero)

    def over_keys(qg_t, qseg_t, query_index, meets):
        """The online softmax of queries qg_t (all, or one block at query_index) over every
        key block; with `meets` [nk], a block whose entry is False is skipped."""
        def step(carry, xs):
            m_run, l_run, o_run = carry
            idx, kb, vb, seg_b = xs[:4]
            mb = xs[4] if mask_per_block else mask
            s, vis, _ = _block_scores(qg_t, kb, mb, idx, block, params, q_lengths, kv_lengths,
                                      qseg_t, seg_b, (b, hq, hk, lq, lk), precision, acc,
                                      query_index)
            s = jnp.where(vis, s, NEG_INF)
            m_new = jnp.maximum(m_run, jnp.max(s, axis=2))
            m_safe = _shift(m_new)
            alpha = _exp_below(m_run - m_safe)
            p = _exp_below(s - m_safe[:, :, None])
            l_new = l_run * alpha + jnp.sum(p, axis=2)
            o_new = o_run * alpha[:, :, None] + lax.dot_general(
                vb, _pv_operand(p, v.dtype, acc, probs_dtype), (((2,), (2,)), ((0, 1), (0, 1))),
                precision=precision, preferred_element_type=acc)
            return (m_new, l_new, o_new), None

        carry = initial(qg_t.shape[3])
        if meets is None:
            return lax.scan(step, carry, xs)[0]

        def step_if_meets(carry, c_meet):
            c, meet = c_meet
            # the block is sliced inside the branch: a skipped block copies nothing
            return lax.cond(meet, lambda m: step(m, _index_blocks(xs, c))[0], lambda m: m,
                            carry), None
        return lax.scan(step_if_meets, carry, (jnp.arange(nk), meets))[0]

    def query_major(state, rows):
        """(m, l [..., G * rows], O^T [..., Dv, G * rows]) -> [..., G, rows(, Dv)]."""
        m, l_, o = state
        return (m.reshape(m.shape[:-1] + (g, rows)), l_.reshape(l_.shape[:-1] + (g, rows)),
                _rows_query_major(o, g, rows))

    if not tiles:
        m_run, l_run, o_run = query_major(over_keys(qg, q_segment_ids, None, None), lq)
    else:
        nq = -(-lq // block)
        meet = _tiles_meet(q_segment_ids, kv_segment_ids, block, nq, nk)
        query_index = jnp.arange(nq * block, dtype=jnp.int32).reshape(nq, block)
        per_block = lax.map(lambda t: over_keys(*t), (
            _blocks(qg, 3, block, nq), _blocks(q_segment_ids, 1, block, nq), query_index,
            meet))
        m_run, l_run, o_run = (_unblock(x, 3, lq) for x in query_major(per_block, block))
    lse = _lse_from(_shift(m_run), l_run)
    pad = _padded_rows(q_lengths, b, lq)
    if pad is not None:
        lse = jnp.where(pad, NEG_INF, lse)
    live = _live(lse)
    out = jnp.where(live[..., None],
                    o_run / jnp.where(live, l_run, jnp.ones((), acc))[..., None],
                    jnp.zeros((), acc))
    out = out.reshape(b, hq, lq, dv_).astype(q.dtype)
    return _from_bhld(out, params.seq_major), lse.reshape(b, hq, lq).astype(jnp.float32)


def chunked_backward(q, k, v, out, lse, dout, mask, sinks, q_lengths, kv_lengths,
                     q_segment_ids, kv_segment_ids, params: StaticParams, precision=None,
                     block: Optional[int] = None, probs_dtype=None):
    q_segment_ids, kv_segment_ids = _segments(q_segment_ids, kv_segment_ids)
    del sinks
    q, k, v, out, dout = _backward_inputs(q, k, v, out, dout, q_lengths, kv_lengths, params)
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    tiles = _packed_tiles(q_segment_ids, mask, lq, lk)
    if tiles:
        block = block or PACKED_BLOCK
    block, nblocks, xs, mask_per_block = _key_blocks(k, v, mask, kv_segment_ids, b, hq, lq,
                                                     lk, block)
    qg, dout_g = _grouped(q, hk), _grouped(dout, hk)
    lse_g = _grouped(lse.astype(acc), hk)[..., None]
    delta = jnp.sum(dout_g.astype(acc) * _grouped(out, hk).astype(acc), axis=-1,
                    keepdims=True)
    scale = jnp.asarray(params.scale, acc)
    zero = _carry_zero(acc, q, k, v, out, lse, dout, mask, q_lengths, kv_lengths,
                       q_segment_ids, kv_segment_ids)

    def tile(kxs, qxs):
        """dQ^T [B, Hk, D, G * rows] of queries qxs (all, or one block) from key block kxs,
        and that block's dK, dV contributions (float acc), all keys major."""
        idx, kb, vb, seg_b = kxs[:4]
        mb = kxs[4] if mask_per_block else mask
        qg_t, dout_t, lse_t, delta_t, qseg_t, query_index = qxs
        rows = qg_t.shape[2] * qg_t.shape[3]
        s, vis, slope = _block_scores(qg_t, kb, mb, idx, block, params, q_lengths, kv_lengths,
                                      qseg_t, seg_b, (b, hq, hk, lq, lk), precision, acc,
                                      query_index)
        q_rows = qg_t.reshape(b, hk, rows, d)
        dout_rows = dout_t.reshape(b, hk, rows, dout_t.shape[-1])
        batch = ((0, 1), (0, 1))
        dp = lax.dot_general(vb, dout_rows, (((3,), (3,)), batch), precision=precision,
                             preferred_element_type=acc)
        p, _, ds = _probs_dscores_block(s, vis, lse_t.reshape(b, hk, 1, rows), dp,
                                        delta_t.reshape(b, hk, 1, rows), slope, acc)
        p, ds = _probs_operand(p, probs_dtype), _probs_operand(ds, probs_dtype)
        by_rows = (((3,), (2,)), batch)
        dkb = lax.dot_general(ds, q_rows, by_rows, precision=precision,
                              preferred_element_type=acc) * scale
        dvb = lax.dot_general(p, dout_rows, by_rows, precision=precision,
                              preferred_element_type=acc)
        dq_t = lax.dot_general(kb, ds, (((2,), (2,)), batch), precision=precision,
                               preferred_element_type=acc) * scale
        return dq_t, dkb, dvb

    if not tiles:
        def step(dq, kxs):
            dq_b, dkb, dvb = tile(kxs, (qg, dout_g, lse_g, delta, q_segment_ids, None))
            return dq + dq_b, (dkb.astype(k.dtype), dvb.astype(v.dtype))

        dq_t0 = jnp.zeros((b, hk, d, hq // hk * lq), acc) + zero
        dq_t, (dk_blocks, dv_blocks) = lax.scan(step, dq_t0, xs)
        dq = _rows_query_major(dq_t, hq // hk, lq)
    else:
        # Outer loop over key blocks (each emits its dK, dV), inner over query blocks; a
        # pair whose segments can't meet is skipped.
        nq = -(-lq // block)
        meet = _tiles_meet(q_segment_ids, kv_segment_ids, block, nq, nblocks)
        qxs = tuple(_blocks(x, 3, block, nq) for x in (qg, dout_g, lse_g, delta)) + (
            _blocks(q_segment_ids, 1, block, nq),
            jnp.arange(nq * block, dtype=jnp.int32).reshape(nq, block))
        dkv0 = (jnp.zeros((b, hk, block, d), acc) + zero,
                jnp.zeros((b, hk, block, v.shape[-1]), acc) + zero)

        def key_step(dq_blocks, kxs_meets):
            kxs, meets = kxs_meets

            def query_step(carry, t_meet):
                t, meet_t = t_meet

                def run(carry):
                    (dk_acc, dv_acc), dq_blocks = carry
                    # the query block is sliced inside the branch: a skipped pair copies
                    # nothing, and its dQ block is updated in place
                    dq_t, dkb, dvb = tile(kxs, _index_blocks(qxs, t))
                    dq_cur = lax.dynamic_index_in_dim(dq_blocks, t, 0, keepdims=False)
                    dq_blocks = lax.dynamic_update_index_in_dim(dq_blocks, dq_cur + dq_t, t, 0)
                    return (dk_acc + dkb, dv_acc + dvb), dq_blocks
                return lax.cond(meet_t, run, lambda c: c, carry), None

            (dkv, dq_blocks), _ = lax.scan(query_step, (dkv0, dq_blocks),
                                           (jnp.arange(nq), meets))
            return dq_blocks, (dkv[0].astype(k.dtype), dkv[1].astype(v.dtype))

        dq_blocks0 = jnp.zeros((nq, b, hk, d, hq // hk * block), acc) + zero
        dq_blocks, (dk_blocks, dv_blocks) = lax.scan(key_step, dq_blocks0, (xs, meet.T))
        dq = _unblock(_rows_query_major(dq_blocks, hq // hk, block), 3, lq)

    dk, dv = _unblock(dk_blocks, 2, lk), _unblock(dv_blocks, 2, lk)
    dq = dq.reshape(b, hq, lq, d).astype(q.dtype)
    return tuple(_from_bhld(x, params.seq_major) for x in (dq, dk, dv))
