"""Public entry points: validate, canonicalize, and call the differentiable op.

- `scaled_dot_product_attention`: MLX's contract (layout [B, H, L, D], bottom-right
  causal, bool or additive masks, sinks).
- `dot_product_attention`: a drop-in for `jax.nn.dot_product_attention` (layout
  [B, T, N, H], top-left causal, bias + bool mask, windows, its handling of
  fully masked rows), plus `sinks=`.
- `explain`: which implementation serves a call, and why not the others.

Everything here runs at trace time; errors name the argument and the shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa import checks, dispatch, vjp
from jax_sdpa.config import Config, StaticParams

def trace_platform():
    """The platform a call traced now runs on (the default backend; a GPU is "cuda" or
    "rocm")."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = getattr(jax.devices()[0].client, "platform_version", "").lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def _named_plan(implementation, q, k, v, mask, sinks, q_lengths, kv_lengths, params,
                q_segment_ids=None, kv_segment_ids=None) -> Optional[dispatch.Plan]:
    """The forward's plan of a named implementation, made at trace time so that one that
    can't serve raises NotImplementedError here; the lowering takes it (dispatch.
    lowering_plan). None for implementation=None: the lowering decides."""
    if implementation is None:
        return None
    cfg = _config(q, k, v, mask, sinks, q_lengths, kv_lengths, params, q_segment_ids,
                  kv_segment_ids)
    return dispatch.plan(cfg, trace_platform(), "fwd", implementation)


def _config(q, k, v, mask, sinks, q_lengths, kv_lengths, params, q_segment_ids=None,
            kv_segment_ids=None) -> Config:
    return Config.from_shapes(
        q.shape, k.shape, v.shape, q.dtype,
        None if mask is None else mask.shape, None if mask is None else mask.dtype,
        sinks is not None, q_lengths is not None, kv_lengths is not None, params,
        sinks_batch=1 if sinks is None else sinks.shape[0],
        has_segment_ids=q_segment_ids is not None)


# Zero features stand in for a head dim of 0 (every score is then 0, plus the masks):
# a multiple of 8, which every kernel takes.
_EMPTY_DIM_STANDIN = 8


def _run(q, k, v, mask, sinks, q_lengths, kv_lengths, params, q_segment_ids=None,
         kv_segment_ids=None, plan=None):
    """(out, lse) through the differentiable op; handles empty sequences and head dims.
    `plan`: the forward's plan made at trace time (`_named_plan`), or None."""
    segments = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, plan=plan)
    len_q, len_kv = (q.shape[1], k.shape[1]) if params.seq_major else (q.shape[2], k.shape[2])
    b = q.shape[0]
    hq = q.shape[2] if params.seq_major else q.shape[1]
    if len_q == 0 or len_kv == 0 or b == 0:
        out = jnp.zeros(q.shape[:3] + (v.shape[3],), q.dtype)
        return out, jnp.full((b, hq, len_q), -jnp.inf, jnp.float32)
    if q.shape[3] == 0:
        q = jnp.zeros(q.shape[:3] + (_EMPTY_DIM_STANDIN,), q.dtype)
        k = jnp.zeros(k.shape[:3] + (_EMPTY_DIM_STANDIN,), k.dtype)
    if v.shape[3] == 0:
        standin = jnp.zeros(v.shape[:3] + (_EMPTY_DIM_STANDIN,), v.dtype)
        out, lse = vjp.attention(q, k, standin, mask, sinks, q_lengths, kv_lengths, params,
                                 **segments)
        return out[..., :0], lse
    return vjp.attention(q, k, v, mask, sinks, q_lengths, kv_lengths, params, **segments)


@functools.partial(jax.jit, static_argnames=("params", "plan"))
def _attend(q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids,
            params, plan=None):
    """The MLX entry's computation, jitted: eager calls then expose only its result to
    debug_nans / debug_infs (the lse of an empty row is -inf by contract)."""
    return _run(q, k, v, mask, sinks, q_lengths, kv_lengths, params, q_segment_ids,
                kv_segment_ids, plan)[0]


# ---------------------------------------------------------------------------
# MLX contract

def _canonicalize_mlx(q, k, v, scale, mask, sinks, query_seq_lengths, key_value_seq_lengths,
                      implementation, q_segment_ids=None, kv_segment_ids=None,
                      logits_soft_cap=None, local_window_size=None):
    """The MLX entry's validated, canonical arguments: (q, k, v, mask, sinks, q_lengths,
    kv_lengths, params, q_segment_ids, kv_segment_ids)."""
    q, k, v = checks.as_array(q, "q"), checks.as_array(k, "k"), checks.as_array(v, "v")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 [B, H, L, D], got shape {x.shape}")
        checks.check_float(x, name)
    checks.check_implementation(implementation)
    b, hq, lq, d = q.shape
    _, hk, lk, _ = k.shape
    if not (k.shape[0] == b and v.shape[0] == b):
        raise ValueError(f"batch sizes differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if v.shape[1] != hk:
        raise ValueError(f"k and v must have the same number of heads: k {k.shape}, "
                         f"v {v.shape}")
    if hk == 0 or hq % hk != 0:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number "
                         f"of key/value heads ({hk}): q {q.shape}, k {k.shape}")
    if k.shape[3] != d:
        raise ValueError(f"q and k must have the same head dim: q {q.shape}, k {k.shape}")
    if v.shape[2] != lk:
        raise ValueError(f"k and v must have the same length: k {k.shape}, v {v.shape}")
    dtype = jnp.result_type(q, k, v)
    q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)

    # A band (window and/or causal) is aligned bottom-right, as MLX's causal mask.
    window_left, window_right = checks.check_window(local_window_size)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got the string {mask!r}")
        window_right, mask = (0 if window_right < 0 else min(window_right, 0)), None
    elif mask is not None:
        mask = checks.canonical_mask_dtype(checks.as_array(mask, "mask"), "mask")
        mask = checks.broadcast_mask(mask, "mask", (b, hq, lq, lk))

    sinks = checks.check_sinks(sinks, hq, "Hq", out_dtype=dtype)

    q_lengths = checks.check_lengths(query_seq_lengths, "query_seq_lengths", b, lq)
    kv_lengths = checks.check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, lk)
    q_ids, kv_ids = checks.check_segment_ids(q_segment_ids, kv_segment_ids, b, lq, lk)
    scale = checks.check_scale(scale, d, "D")
    params = StaticParams(scale=scale, window_left=window_left, window_right=window_right,
                          bottom_right=window_left >= 0 or window_right >= 0, seq_major=False,
                          implementation=implementation,
                          logits_soft_cap=checks.check_soft_cap(logits_soft_cap), lse_used=False)
    return q, k, v, mask, sinks, q_lengths, kv_lengths, params, q_ids, kv_ids


def scaled_dot_product_attention(q, k, v, *, scale: Optional[float] = None, mask=None,
                                 sinks=None, query_seq_lengths=None,
                                 key_value_seq_lengths=None, q_segment_ids=None,
                                 kv_segment_ids=None, logits_soft_cap: Optional[float] = None,
                                 local_window_size=None,
                                 implementation: Optional[str] = None):
    """Attention with MLX's `mx.fast.scaled_dot_product_attention` semantics.

    q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] -> [B, Hq, Lq, Dv].
    `mask`: None, "causal" (bottom-right aligned), a bool array (True = attend) or an
    additive float array broadcastable to [B, Hq, Lq, Lk]. `sinks`: [Hq] logits.
    `query_seq_lengths` / `key_value_seq_lengths`: int [B] valid lengths.
    `q_segment_ids` / `kv_segment_ids`: int32 [B, Lq] / [B, Lk] (packed sequences: a query
    sees a key only where their ids are equal; `q_segment_ids` alone serves as both).
    `logits_soft_cap`: None or c > 0: logits become c * tanh(scale * q.k / c) before the
    mask is added (sinks are not capped).
    `local_window_size`: None, w or (left, right): query i sees keys i+offset-left ...
    i+offset+right, bottom-right aligned like "causal" (offset = Lk - Lq, per row with
    lengths); with mask="causal" right becomes min(right, 0).
    `implementation`: None (fastest that serves) or one of
    "cudnn", "cuda", "metal", "cpu", "xla", "xla_chunked".
    """
    args = _canonicalize_mlx(q, k, v, scale, mask, sinks, query_seq_lengths,
                             key_value_seq_lengths, implementation, q_segment_ids,
                             kv_segment_ids, logits_soft_cap, local_window_size)
    plan = _named_plan(implementation, *args)
    return _attend(*args[:7], *args[8:], params=args[7], plan=plan)


# ---------------------------------------------------------------------------
# jax.nn contract

def _ensure_4d(x):
    return x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: Optional[float] = None, is_causal: bool = False,
                          query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation: Optional[str] = None,
                          return_residual: bool = False, sinks=None, q_segment_ids=None,
                          kv_segment_ids=None, logits_soft_cap: Optional[float] = None):
    """A drop-in for `jax.nn.dot_product_attention` (same arguments, layout [B, T, N, H] or
    [T, N, H], top-left causal, same results as its 'xla' implementation), plus
    `sinks` ([N] logits), `q_segment_ids` / `kv_segment_ids` (int32 [B, T] / [B, S]; a query
    sees a key only where their ids are equal, `q_segment_ids` alone serves as both),
    `logits_soft_cap` (c > 0: logits become c * tanh(scale * q.k / c) before bias and mask)
    and the implementations of `scaled_dot_product_attention`. A query row that sees no key
    averages the values uniformly, as jax.nn's does for a fully masked row."""
    query, key, value = (checks.as_array(x, n) for x, n in
                         ((query, "query"), (key, "key"), (value, "value")))
    output_shape = query.shape
    if query.ndim not in (3, 4):
        raise ValueError(f"query must have shape [B, T, N, H] or [T, N, H], got {query.shape}")
    for x, n in ((key, "key"), (value, "value")):
        if x.ndim != query.ndim:
            raise ValueError(f"{n} must have the same rank as query: query {query.shape}, "
                             f"{n} {x.shape}")
    checks.check_implementation(implementation)
    query, key, value = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    for x, n in ((query, "query"), (key, "key"), (value, "value")):
        checks.check_float(x, n)
    b, s, nk, h = key.shape
    _, t, n, _ = query.shape
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(f"value shape {value.shape} must match key shape {key.shape} in "
                         f"B, S, K")
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype should be {key.dtype}, but got {value.dtype}")
    if query.shape[0] != b or query.shape[3] != h:
        raise ValueError(f"query shape should be [{b}, T, N, {h}] like key {key.shape}, but "
                         f"got {query.shape}")
    if query.dtype != key.dtype:
        raise ValueError(f"query dtype should be {key.dtype}, but got {query.dtype}")
    if n % nk != 0:
        raise ValueError(f"The number of query heads must be a multiple of key/value heads, "
                         f"but got {n} vs {nk}")
    full = (b, n, t, s)
    if bias is not None:
        bias = _ensure_4d(checks.as_array(bias, "bias"))
        checks.check_float(bias, "bias")
        bias = checks.broadcast_mask(checks.canonical_mask_dtype(bias, "bias"), "bias", full)
    if mask is not None:
        mask = _ensure_4d(checks.as_array(mask, "mask"))
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask dtype should be bool, but got {mask.dtype}")
        mask = checks.broadcast_mask(mask, "mask", full)
    q_lengths = checks.check_lengths(query_seq_lengths, "query_seq_lengths", b, t, int32_only=True)
    kv_lengths = checks.check_lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s,
                                int32_only=True)
    window_left, window_right = checks.check_window(local_window_size)
    if checks.check_bool(is_causal, "is_causal"):
        window_right = 0 if window_right < 0 else min(window_right, 0)
    return_residual = checks.check_bool(return_residual, "return_residual")
    sinks = checks.check_sinks(sinks, n, "N")
    q_ids, kv_ids = checks.check_segment_ids(q_segment_ids, kv_segment_ids, b, t, s, ("T", "S"),
                                       rank1_ok=output_shape != query.shape)
    scale = checks.check_scale(scale, h, "H")
    params = StaticParams(scale=scale, window_left=window_left, window_right=window_right,
                          bottom_right=False, seq_major=True, implementation=implementation,
                          logits_soft_cap=checks.check_soft_cap(logits_soft_cap))
    has_mask = bias is not None or mask is not None or q_ids is not None
    empty_by_length_only = (kv_lengths is not None and not has_mask and sinks is None
                            and window_left < 0 and window_right < 0 and s > 0)
    # q_segment_ids alone are the keys' ids too (Lq = Lk): each query keeps its own key
    may_be_empty = (not empty_by_length_only and _rows_may_be_empty(
        bias is not None or mask is not None or kv_segment_ids is not None, kv_lengths,
        window_left, t, s))
    # lse is read for the residual and by _jax_nn_empty_rows
    params = dataclasses.replace(
        params, lse_used=return_residual or may_be_empty or q_lengths is not None)
    present = [x for x in (bias, mask) if x is not None]
    combined = None if not present else jax.ShapeDtypeStruct(  # what _attend_jax_nn passes
        jnp.broadcast_shapes(*(x.shape for x in present)), present[0].dtype)
    plan = _named_plan(implementation, query, key, value, combined, sinks, q_lengths,
                       kv_lengths, params, q_ids, kv_ids)
    out, residual = _attend_jax_nn(query, key, value, bias, mask, sinks, q_lengths, kv_lengths,
                                   q_ids, kv_ids, params=params, may_be_empty=may_be_empty,
                                   empty_by_length_only=empty_by_length_only, plan=plan)
    out = out.reshape(output_shape)
    if return_residual:
        residual = jax.lax.stop_gradient(residual).astype(key.dtype)
        return out, residual.reshape(output_shape[:-1])
    return out


@functools.partial(jax.jit, static_argnames=("params", "may_be_empty", "empty_by_length_only",
                                             "plan"))
def _attend_jax_nn(query, key, value, bias, mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                   kv_segment_ids, params, may_be_empty, empty_by_length_only=False,
                   plan=None):
    """The jax.nn entry's computation, jitted (see `_attend`): (out, residual lse B T N)."""
    combined = bias
    if mask is not None:  # both: one additive mask (masked entries can never be seen)
        combined = mask if bias is None else jnp.where(
            mask, bias, jnp.asarray(-jnp.inf, bias.dtype))
    no_keys = None
    if empty_by_length_only:
        # Only a kv length <= 0 empties a row, and jax.nn then averages every value
        # uniformly: such batch rows attend to all keys with zero scores (q = 0), which is
        # that average, rather than a mean of V on the side (a second read of V per call).
        no_keys = kv_lengths <= 0
        query = jnp.where(no_keys[:, None, None, None], jnp.zeros((), query.dtype), query)
        kv_lengths = jnp.where(no_keys, key.shape[1], kv_lengths)
    out, lse = _run(query, key, value, combined, sinks, q_lengths, kv_lengths, params,
                    q_segment_ids, kv_segment_ids, plan)
    t, n = query.shape[1], query.shape[2]
    if may_be_empty or q_lengths is not None:
        out, lse = _jax_nn_empty_rows(out, lse, value, q_lengths, t, n, may_be_empty)
    if no_keys is not None:
        lse = jnp.where(no_keys[:, None, None], _JAX_NN_EMPTY_LSE, lse)
    return out, jnp.swapaxes(lse, 1, 2)  # B N T -> B T N


# jax.nn's masked logit, and so the lse of a row with nothing visible
_JAX_NN_EMPTY_LSE = -0.7 * float(np.finfo(np.float32).max)


def _rows_may_be_empty(has_mask, kv_lengths, window_left, t, s):
    """Can a (non-padded) query row have no visible key under jax.nn's top-left rules?
    Causal and right windows always leave key 0 visible; a left window empties the
    rows past the keys' end; masks, segment ids of their own for the keys and key lengths
    can empty any row."""
    return (has_mask or kv_lengths is not None
            or (window_left >= 0 and t - 1 - window_left > s - 1))


def _jax_nn_empty_rows(out, lse, value, q_lengths, t, n, uniform_possible=True):
    """jax.nn masks with a large finite negative number, so a query row with no visible
    key averages all values uniformly (padded query rows are then zeroed); its lse is
    that large negative number. Reproduce both from our lse = -inf."""
    empty = jnp.isneginf(lse)  # [B, N, T]
    large_negative = _JAX_NN_EMPTY_LSE
    if not uniform_possible:  # only padded rows: their output is already 0
        return out, jnp.where(empty, large_negative, lse)
    if q_lengths is not None:
        padded = jnp.arange(t)[None, None, :] >= jnp.clip(q_lengths, 0, t)[:, None, None]
        uniform_rows = empty & ~padded
    else:
        uniform_rows = empty
    nk = value.shape[2]
    mean_v = jnp.mean(value.astype(jnp.float32), axis=1)  # [B, K, H]
    mean_v = jnp.repeat(mean_v, n // nk, axis=1)[:, None].astype(out.dtype)  # [B, 1, N, H]
    out = jnp.where(jnp.swapaxes(uniform_rows, 1, 2)[..., None], mean_v, out)
    lse = jnp.where(empty, large_negative, lse)
    return out, lse


# ---------------------------------------------------------------------------
# explain

@dataclasses.dataclass(frozen=True)
class Explanation:
    """Which implementation `implementation=None` picks, and every implementation's verdict."""

    chosen: str
    platform: str
    direction: str
    verdicts: dict  # name -> (ok, reason)
    config: Config

    def __str__(self):
        lines = [f"platform {self.platform}, {self.direction}: implementation=None -> "
                 f"{self.chosen}"]
        for name, (ok, reason) in self.verdicts.items():
            mark = "*" if name == self.chosen else ("+" if ok else "-")
            lines.append(f"  {mark} {name:12s} {reason}")
        lines.append("  (* what implementation=None runs, + can serve this call too, - can't)")
        return "\n".join(lines)


def explain(q, k, v, *, scale=None, mask=None, sinks=None, query_seq_lengths=None,
            key_value_seq_lengths=None, q_segment_ids=None, kv_segment_ids=None,
            logits_soft_cap=None, local_window_size=None, implementation=None,
            platform: Optional[str] = None, direction: str = "fwd") -> Explanation:
    """Same arguments as `scaled_dot_product_attention` (arrays or jax.ShapeDtypeStruct):
    returns which implementation `implementation=None` would choose on `platform`
    (default: the default backend) and, for every implementation, whether it can serve
    the call and why not."""
    del implementation
    captured = {}
    mask_string = mask if isinstance(mask, str) else None

    def trace(q, k, v, mask_array, sinks, ql, kvl, q_ids, kv_ids):
        args = _canonicalize_mlx(q, k, v, scale, mask_string or mask_array, sinks, ql, kvl,
                                 None, q_ids, kv_ids, logits_soft_cap, local_window_size)
        captured["cfg"] = _config(*args)
        return jnp.zeros(())

    jax.eval_shape(trace, q, k, v, None if mask_string else mask, sinks, query_seq_lengths,
                   key_value_seq_lengths, q_segment_ids, kv_segment_ids)
    cfg = captured["cfg"]
    platform = platform or trace_platform()
    chosen, verdicts = dispatch.explain_choice(cfg, platform, direction)
    return Explanation(chosen=chosen, platform=platform, direction=direction,
                       verdicts=verdicts, config=cfg)
