"""FlashAttention-3 (the flash-attn3-jax package) as an optional implementation.

flash-attn3-jax registers FlashAttention-3's Hopper kernels as the XLA FFI targets
`flash_mha_fwd` / `flash_mha_bwd` when it is imported; its PyPI wheels (0.2.3: CPython 3.12,
Linux x86_64) hold sm_90 kernels for head dim 128 in fp16 / bf16. This module says whether
those targets can serve a call and emits them from our primitives' lowerings, so that the
call keeps our API, our VJP, batching and sharding, and a forward of one implementation
feeds a backward of another (lse is the natural-log [B, Hq, Lq] of docs/ffi_contract.md
in both).

The backward's two float32 side results (dsoftmax sums and log2 lse, [B, Hq, rows]) are
written by the handler with rows = Lq rounded up to its own tile (80 query rows for the
non-causal D128 kernel); flash-attn3-jax's own `flash_mha` sizes them for 128-row tiles,
which overruns them when the 80-row rounding is larger and gives NaN or wrong gradients
(benchmarks/results/h200/fa3_check.jsonl). We size them for any tile.

Packed sequences (segment ids) run its varlen kernels: the [B, L] rows are one stream of
B*L tokens cut where the id changes (and at every row's start), cu_seqlens built in XLA
next to the call. That answers the contract only where each id's tokens are one run and
the query's ids are the key's; the lowering checks both when the call runs and otherwise
takes the `fallback` it is given (what implementation=None runs without this package).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import numpy as np

from jax_sdpa import tuning
from jax_sdpa.config import MASK_NONE, Config

PACKAGE = "flash_attn3_jax"
# The version whose FFI targets (operands, attributes, side results) our lowering was checked
# against on an H200; pyproject's `flash-attn3` extra pins the same one.
VERSION = "0.2.3"
INSTALL = f"pip install flash-attn3-jax=={VERSION}"
FWD_TARGET, BWD_TARGET = "flash_mha_fwd", "flash_mha_bwd"
HEAD_DIMS = (128,)  # the head dims its wheels build kernels for
COMPUTE_CAPABILITY = (9, 0)  # sm_90 kernels only
# The largest query tile of the backward kernels the handler picks from; the side results
# get this many rows beyond Lq, enough for Lq rounded up to any of its tiles.
_BWD_MAX_TILE_ROWS = 128

_16BIT = (np.dtype(np.float16), np.dtype("bfloat16"))


@functools.lru_cache(maxsize=1)
def load_error() -> Optional[str]:
    """Why flash-attn3-jax can't run here (None: imported, its targets registered)."""
    if importlib.util.find_spec(PACKAGE) is None:
        return f"flash-attn3-jax is not installed ({INSTALL})"
    from importlib import metadata
    try:
        version = metadata.version("flash-attn3-jax")
    except metadata.PackageNotFoundError:
        version = "?"
    if version != VERSION:
        return (f"flash-attn3-jax {version} is installed; our lowering is checked against "
                f"{VERSION} only ({INSTALL})")
    try:
        importlib.import_module(PACKAGE)  # registers flash_mha_fwd / flash_mha_bwd
    except Exception as e:  # noqa: BLE001 - a wheel for another Python / CUDA / jax
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"flash-attn3-jax failed to import ({first})"
    return None


def installed() -> bool:
    return load_error() is None


def unsupported_reason(cfg: Config, direction: str, compute_capability) -> Optional[str]:
    """Why its kernels can't serve this call ('' / None: they can). Dense calls only:
    16-bit, D = Dv in HEAD_DIMS, the [B, L, H, D] layout, no mask, sinks, lengths, segment
    ids or soft cap, and either no band or a causal band with a key for every query row
    (Lq = Lk, or bottom-right aligned with Lq <= Lk: its causal mask is bottom-right)."""
    if tuple(compute_capability) != COMPUTE_CAPABILITY:
        cc = ".".join(str(x) for x in compute_capability)
        return f"flash-attn3-jax's kernels are built for sm_90 (Hopper) only, this GPU is {cc}"
    if cfg.dtype not in _16BIT:
        return f"flash-attn3-jax needs float16 or bfloat16, got {cfg.dtype}"
    if cfg.head_dim != cfg.head_dim_v or cfg.head_dim not in HEAD_DIMS:
        return (f"flash-attn3-jax's wheels build head dim {HEAD_DIMS[0]} only "
                f"(D={cfg.head_dim}, Dv={cfg.head_dim_v})")
    if not cfg.params.seq_major:
        return ("flash-attn3-jax takes [B, L, H, D] operands; this call is [B, H, L, D] "
                "(it would need transposes)")
    used = [name for name, on in (
        ("a mask", cfg.mask_kind != MASK_NONE), ("sinks", cfg.has_sinks),
        ("sequence lengths", cfg.has_q_lengths or cfg.has_kv_lengths),
        ("logits_soft_cap", cfg.params.logits_soft_cap > 0)) if on]
    if used:
        return "flash-attn3-jax is not given " + ", ".join(used) + " here"
    if cfg.has_segment_ids and cfg.len_q != cfg.len_kv:
        return ("flash-attn3-jax's varlen call serves segment ids of packed self-attention "
                f"rows (Lq = Lk), not Lq={cfg.len_q}, Lk={cfg.len_kv}")
    p = cfg.params
    if p.window_left < 0 and p.window_right < 0:
        return None
    if p.window_left >= 0 or p.window_right != 0:
        return "flash-attn3-jax serves no band or a causal band here, not a window"
    if cfg.len_q != cfg.len_kv and not (p.bottom_right and cfg.len_q < cfg.len_kv):
        return ("flash-attn3-jax's causal band is bottom-right aligned and needs a key for "
                f"every query row (Lq={cfg.len_q}, Lk={cfg.len_kv}, "
                f"bottom_right={p.bottom_right})")
    return None


def _band_attrs(params):
    causal = params.window_right == 0
    return dict(is_causal=causal, window_size_left=-1, window_size_right=0 if causal else -1)


def _forward(q, k, v, *, params):
    import jax
    import jax.numpy as jnp

    b, lq, hq, d = q.shape
    lk = k.shape[1]
    empty = jnp.zeros((0,), q.dtype)
    empty_i32 = jnp.zeros((0,), jnp.int32)
    empty_f32 = jnp.zeros((0,), jnp.float32)
    results = [jax.ShapeDtypeStruct((b, lq, hq, d), q.dtype),
               jax.ShapeDtypeStruct((b, hq, lq), jnp.float32),
               jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),  # split accumulators,
               jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)]  # unused at one split
    # q, k, v, then what it is not given: k_new, v_new, q_v, cu_seqlens_q, cu_seqlens_k,
    # cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k,
    # rotary_cos, rotary_sin, seqlens_rotary, q/k/v descale, scheduler_metadata
    absent = ([empty] * 3 + [empty_i32] * 8 + [empty] * 2 + [empty_i32] + [empty_f32] * 3
              + [empty_i32])
    out, lse, _, _ = jax.ffi.ffi_call(FWD_TARGET, results)(
        q, k, v, *absent,
        max_seqlen_q=lq, max_seqlen_q_has_value=True, max_seqlen_k=lk,
        max_seqlen_k_has_value=True, softmax_scale_val=float(params.scale),
        softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
        attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, num_splits=1,
        sm_margin=0, **_band_attrs(params))
    return out, lse


def _backward(q, k, v, out, lse, dout, *, params):
    import jax
    import jax.numpy as jnp

    b, lq, hq, _ = q.shape
    lk = k.shape[1]
    side_rows = lq + _BWD_MAX_TILE_ROWS
    results = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype),
               jax.ShapeDtypeStruct((b, hq, side_rows), jnp.float32),  # dsoftmax sums
               jax.ShapeDtypeStruct((b, hq, side_rows), jnp.float32)]  # log2 lse
    empty_i32 = jnp.zeros((0,), jnp.int32)  # cu_seqlens_q/k, seqused_q/k: not given
    dq, dk, dv, _, _ = jax.ffi.ffi_call(BWD_TARGET, results)(
        dout, q, k, v, out, lse, *[empty_i32] * 4,
        max_seqlen_q_val=lq, max_seqlen_q_has_value=True, max_seqlen_k_val=lk,
        max_seqlen_k_has_value=True, softmax_scale_val=float(params.scale),
        softmax_scale_has_value=True, softcap=0.0, deterministic=False, sm_margin=0,
        **_band_attrs(params))
    return dq, dk, dv


# ---- packed sequences: the varlen kernels ----------------------------------------

def max_sequences(batch: int, length: int) -> int:
    """The most runs of equal segment ids (sequences) a packed call of `batch` rows of
    `length` tokens hands the varlen kernels; a call with more takes its fallback. Longer
    rows hold more documents, and every sequence the forward is told costs it a little
    whether it is real or padding (the row FLASH_ATTN3_PACKED of jax_sdpa/tuning.py)."""
    row = tuning.FLASH_ATTN3_PACKED["sequences_per_row"]
    return batch * min(max(length // row["tokens_each"], row["least"]), row["most"])


def _buckets(first: int, last: int):
    """first, 2 first, 4 first, ... below last, then last."""
    out = []
    while first < last:
        out.append(first)
        first *= 2
    return out + [last]


def sequence_runs(q_ids, kv_ids, cap: int):
    """The varlen description of packed [B, L] rows: (cu_seqlens [cap + 1] int32 over the
    B*L tokens, padded with B*L; sequences; the longest; whether the varlen call answers
    the contract: every id's tokens one run in its row, the key's ids the query's, at
    most `cap` runs)."""
    import jax
    import jax.numpy as jnp

    b, length = q_ids.shape
    total = b * length
    flat = q_ids.reshape(-1)
    position = jnp.arange(total)
    starts = (position % length == 0) | (flat != jnp.roll(flat, 1))
    runs = jnp.sum(starts, dtype=jnp.int32)
    first = jnp.nonzero(starts, size=cap, fill_value=total)[0].astype(jnp.int32)
    cu = jnp.concatenate([first, jnp.full((1,), total, jnp.int32)])
    longest = jnp.max(cu[1:] - cu[:-1])
    # One run per id in its row: no two runs share (row, id). Only the <= cap runs are
    # sorted, never the B*L ids; the padding entries get rows of their own.
    slot = jnp.arange(cap, dtype=jnp.int32)
    real = slot < runs
    run_row = jnp.where(real, first // length, b + slot)
    run_id = jnp.where(real, flat[jnp.minimum(first, total - 1)], 0)
    run_row, run_id = jax.lax.sort((run_row, run_id), num_keys=2)
    repeated = jnp.any((run_row[1:] == run_row[:-1]) & (run_id[1:] == run_id[:-1]))
    ok = ~repeated & (runs <= cap) & jnp.all(q_ids == kv_ids)
    return cu, runs, longest, ok


def _varlen_forward(q, k, v, cu, *, params):
    """[B, L, H, D] rows as one varlen stream: out [B, L, Hq, D], lse [B, Hq, L]."""
    import jax
    import jax.numpy as jnp

    b, length, hq, d = q.shape
    total = b * length
    flat = lambda x: x.reshape(total, *x.shape[2:])  # noqa: E731
    empty = jnp.zeros((0,), q.dtype)
    empty_i32 = jnp.zeros((0,), jnp.int32)
    empty_f32 = jnp.zeros((0,), jnp.float32)
    # varlen lse is [Hq, total tokens]
    results = [jax.ShapeDtypeStruct((total, hq, d), q.dtype),
               jax.ShapeDtypeStruct((hq, total), jnp.float32),
               jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
               jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)]
    # the operands of _forward's call, with cu_seqlens_q = cu_seqlens_k = cu
    given = ([empty] * 3 + [cu, cu] + [empty_i32] * 6 + [empty] * 2 + [empty_i32]
             + [empty_f32] * 3 + [empty_i32])
    out, lse, _, _ = jax.ffi.ffi_call(FWD_TARGET, results)(
        flat(q), flat(k), flat(v), *given,
        max_seqlen_q=length, max_seqlen_q_has_value=True, max_seqlen_k=length,
        max_seqlen_k_has_value=True, softmax_scale_val=float(params.scale),
        softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
        attention_chunk=0, softcap=0.0, is_rotary_interleaved=False, num_splits=1,
        sm_margin=0, **_band_attrs(params))
    return out.reshape(q.shape), lse.reshape(hq, b, length).transpose(1, 0, 2)


def _varlen_backward(q, k, v, out, lse, dout, cu, *, sequences, longest, params):
    """The varlen backward told `sequences` runs (cu's first sequences + 1 entries) of at
    most `longest` tokens: its grid is sequences x heads x longest / 128 blocks, so the
    lowering picks the smallest bucket that holds the call."""
    import jax
    import jax.numpy as jnp

    b, length, hq, d = q.shape
    total = b * length
    flat = lambda x: x.reshape(total, *x.shape[2:])  # noqa: E731
    # side results: [Hq, total + sequences x its query tile, rounded], sized for any tile
    side_rows = -(-(total + sequences * _BWD_MAX_TILE_ROWS) // _BWD_MAX_TILE_ROWS) \
        * _BWD_MAX_TILE_ROWS + _BWD_MAX_TILE_ROWS
    results = [jax.ShapeDtypeStruct((total, hq, d), q.dtype),
               jax.ShapeDtypeStruct(flat(k).shape, k.dtype),
               jax.ShapeDtypeStruct(flat(v).shape, v.dtype),
               jax.ShapeDtypeStruct((hq, side_rows), jnp.float32),
               jax.ShapeDtypeStruct((hq, side_rows), jnp.float32)]
    cu = cu[:sequences + 1]
    empty_i32 = jnp.zeros((0,), jnp.int32)  # seqused_q/k
    dq, dk, dv, _, _ = jax.ffi.ffi_call(BWD_TARGET, results)(
        flat(dout), flat(q), flat(k), flat(v), flat(out),
        lse.transpose(1, 0, 2).reshape(hq, total), cu, cu, empty_i32, empty_i32,
        max_seqlen_q_val=longest, max_seqlen_q_has_value=True, max_seqlen_k_val=longest,
        max_seqlen_k_has_value=True, softmax_scale_val=float(params.scale),
        softmax_scale_has_value=True, softcap=0.0, deterministic=False, sm_margin=0,
        **_band_attrs(params))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)


_Q_IDS, _KV_IDS = 4, 5  # the segment ids among the optional operands


def _packed(direction, params, fallback):
    """The lowered function of a packed call: the varlen kernels where sequence_runs says
    they answer it, else `fallback` (the same operands)."""
    import jax
    import jax.numpy as jnp

    if direction == "fwd":
        def fn(q, k, v, *optional):
            cap = max_sequences(*q.shape[:2])
            cu, _, _, ok = sequence_runs(optional[_Q_IDS], optional[_KV_IDS], cap)
            return jax.lax.cond(
                ok, lambda: _varlen_forward(q, k, v, cu, params=params),
                lambda: tuple(fallback(q, k, v, *optional)))
        return fn

    def fn(q, k, v, out, lse, dout, *optional):
        b, length = q.shape[:2]
        cap = max_sequences(b, length)
        cu, runs, longest, ok = sequence_runs(optional[_Q_IDS], optional[_KV_IDS], cap)
        counts = _buckets(b, cap)
        lengths = _buckets(min(_BWD_MAX_TILE_ROWS, length), length)
        branches = [lambda: tuple(fallback(q, k, v, out, lse, dout, *optional))]
        for n in counts:
            for m in lengths:
                branches.append(functools.partial(
                    _varlen_backward, q, k, v, out, lse, dout, cu, sequences=n, longest=m,
                    params=params))
        which_count = jnp.sum(jnp.asarray(counts[:-1]) < runs)
        which_length = jnp.sum(jnp.asarray(lengths[:-1]) < longest)
        index = jnp.where(ok, 1 + which_count * len(lengths) + which_length, 0)
        return jax.lax.switch(index, branches)
    return fn


def lower(ctx, direction: str, args, params, *, packed: bool = False, fallback=None):
    """The lowering of one of our primitives ('fwd': args q, k, v, *optional -> out, lse;
    'bwd': q, k, v, out, lse, dout, *optional -> dq, dk, dv) as flash-attn3-jax's target.
    The optional operands are placeholders (unsupported_reason refuses real ones) except
    the segment ids of a `packed` call, which runs the varlen kernels or `fallback`, a
    function of the same operands (see _packed)."""
    from jax.interpreters import mlir

    if packed:
        fn = _packed(direction, params, fallback)
    elif direction == "fwd":
        fn = lambda q, k, v, *_: _forward(q, k, v, params=params)  # noqa: E731
    else:
        fn = lambda q, k, v, o, lse, do, *_: _backward(q, k, v, o, lse, do,  # noqa: E731
                                                       params=params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

