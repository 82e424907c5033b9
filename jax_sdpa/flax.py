"""Flax attention functions backed by jax_sdpa.

    import jax_sdpa.flax
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=jax_sdpa.flax.attention_fn)
    nnx.MultiHeadAttention(..., attention_fn=jax_sdpa.flax.make_attention_fn(is_causal=True))

Both follow Flax's `dot_product_attention` convention: `(query, key, value, bias, mask,
broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision, module, ...)`,
layout `[batch..., L, N, H]` (any number of leading batch dims, or none), masks
multiplicative (bool or numbers, nonzero = attend), bias additive, causal top-left (as
`flax.nnx.make_causal_mask` and `jax.nn.dot_product_attention(is_causal=True)`).
Key/value may have fewer heads than the query (GQA, as `nnx.MultiHeadAttention(num_kv_heads=)`).

What cannot run fused is computed exactly the way Flax's `dot_product_attention` computes
it (softmax in the computation dtype, in float32 with `force_fp32_for_softmax`), on an XLA
path that materializes the attention weights (and is therefore only chosen when needed):
- dropout on the attention weights (`dropout_rate > 0` and not `deterministic`): the same
  Bernoulli draws as Flax's own for the same `dropout_rng`, so the results are Flax's;
- `module=` (Flax sows the attention weights into the module's intermediates);
- custom einsums (`qk_attn_weights_einsum`/`attn_weights_value_einsum`, `einsum_dot_general`);
- complex inputs (Flax attends over them; the kernels take real floats);
- a non-default `precision` other than HIGHEST off CPU (XLA:CPU multiplies float32 exactly
  anyway). `precision=HIGHEST` runs fused, in the kernels' full-float32 mode (as under
  `jax.default_matmul_precision("highest")`: the fp32_precision attribute).
With a named fused `implementation` those cases raise `NotImplementedError` instead.
The fused softmax is always float32; with `force_fp32_for_softmax` and 16-bit inputs the
result is float32, as Flax's is (its float32 weights promote the weighted sum).

Packed sequences: Flax's attention modules pass no segment ids to their `attention_fn`, so
a model sets them for the calls it traces inside a `segment_ids` block:

    def loss_fn(model, tokens, ids):           # ids: int32 [batch..., L]
        with jax_sdpa.flax.segment_ids(ids):    # every jax_sdpa attention_fn call inside
            logits = model(tokens)              # attends within its segment only
        ...

The ids are read when the attention function is traced, so the block belongs inside the
function that is jitted (or differentiated), around the model call.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_sdpa import api, checks

__all__ = ["attention_fn", "make_attention_fn", "segment_ids"]

# (q ids, kv ids or None) of the enclosing `segment_ids` block, None outside one.
_SEGMENT_IDS = contextvars.ContextVar("jax_sdpa_flax_segment_ids", default=None)


@contextlib.contextmanager
def segment_ids(q_segment_ids, kv_segment_ids=None):
    """Packed sequences for the jax_sdpa attention functions called (traced) inside the
    block: int32 ids [batch..., T] of the queries and [batch..., S] of the keys (None: the
    queries' own, for self-attention); a query attends a key only where the ids are equal."""
    token = _SEGMENT_IDS.set((q_segment_ids, kv_segment_ids))
    try:
        yield
    finally:
        _SEGMENT_IDS.reset(token)


def _current_segment_ids(batch_shape, len_q, len_kv):
    """The enclosing block's ids as [prod(batch), L] (None, None outside one)."""
    ids = _SEGMENT_IDS.get()
    if ids is None:
        return None, None
    b = math.prod(batch_shape)
    q_ids, kv_ids = (None if x is None else jnp.asarray(x) for x in ids)
    for x, name, length in ((q_ids, "q_segment_ids", len_q), (kv_ids, "kv_segment_ids", len_kv)):
        if x is not None and x.shape != tuple(batch_shape) + (length,):
            raise ValueError(f"jax_sdpa.flax.segment_ids: {name} must have shape "
                             f"[batch..., L] = {list(batch_shape) + [length]}, got {x.shape}")
    return (q_ids.reshape(b, len_q),
            None if kv_ids is None else kv_ids.reshape(b, len_kv))

_EXACT_OK = (None, "xla")  # implementations under which the exact XLA path may be used


def _flax_promote(arrays, dtype):
    """Flax's promote_dtype: a common (inexact) dtype, or `dtype` when given."""
    if dtype is None:
        dtype = jnp.result_type(*arrays)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    return tuple(jnp.asarray(x, dtype) for x in arrays)


def _precision_is_default(precision) -> bool:
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)):
        return all(_precision_is_default(p) for p in precision)
    if isinstance(precision, str):
        return precision.lower() in ("default", "bfloat16", "fastest")
    return precision == jax.lax.Precision.DEFAULT


def _precision_is_highest(precision) -> bool:
    """Flax's precision asks for full float32 accuracy (what the fused kernels give under
    `jax.default_matmul_precision("highest")`: the fp32_precision attribute)."""
    if isinstance(precision, (tuple, list)):
        return bool(precision) and all(_precision_is_highest(p) for p in precision)
    if isinstance(precision, str):
        return precision.lower() in ("highest", "float32")
    return precision == jax.lax.Precision.HIGHEST


def _dropout_active(dropout_rate, deterministic) -> bool:
    try:
        return (not bool(deterministic)) and float(dropout_rate) > 0.0
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError("jax_sdpa.flax: dropout_rate and deterministic must be static Python "
                        "values (they decide which computation runs)") from e


def _validate(query, key, value):
    if not (query.ndim == key.ndim == value.ndim) or query.ndim < 3:
        raise ValueError(f"query, key and value must have the same rank >= 3 "
                         f"[batch..., L, N, H], got shapes {query.shape}, {key.shape}, "
                         f"{value.shape}")
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise ValueError(f"query, key and value batch dims must match, got shapes "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if key.shape[-3] != value.shape[-3] or key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value must have the same length and heads, got "
                         f"{key.shape} and {value.shape}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key depths must match, got {query.shape} and {key.shape}")
    if key.shape[-2] == 0 or query.shape[-2] % key.shape[-2]:
        raise ValueError(f"query heads ({query.shape[-2]}) must be a multiple of key/value "
                         f"heads ({key.shape[-2]})")


def _bool_mask(mask):
    mask = jnp.asarray(mask)
    return mask if mask.dtype == jnp.bool_ else mask != 0  # Flax: nonzero = attend


def _to_4d(x, batch_shape, name):
    """A mask/bias broadcastable to [batch..., N, T, S] -> rank 4 with one batch dim
    (kept 1 when it does not vary over the batch)."""
    nb = len(batch_shape)
    if x.ndim > nb + 3:
        raise ValueError(f"{name} of shape {x.shape} has more dims than [batch..., N, T, S] "
                         f"with batch dims {batch_shape}")
    x = x.reshape((1,) * (nb + 3 - x.ndim) + x.shape)
    lead, tail = x.shape[:nb], x.shape[nb:]
    if all(d == 1 for d in lead):
        return x.reshape((1,) + tail)
    try:
        x = jnp.broadcast_to(x, tuple(batch_shape) + tail)
    except ValueError as e:
        raise ValueError(f"{name} of shape {x.shape} is not broadcastable to the batch dims "
                         f"{batch_shape}") from e
    return x.reshape((math.prod(batch_shape),) + tail)


def _sow(module, weights):
    from flax import nnx  # only reached when a module asks for its weights

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def _softmax_dtype(dtype, force_fp32_for_softmax):
    """Flax's rule: the weights are computed (and kept) in float32 only when asked for and
    the computation dtype is not float32 already."""
    return jnp.float32 if force_fp32_for_softmax and dtype != jnp.float32 else None


def _exact(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
           dropout, dtype, precision, module, einsum_dot_general, qk_einsum, wv_einsum,
           is_causal, sinks, force_fp32_for_softmax, logits_soft_cap, segments):
    """Flax's own computation (attention weights materialized, softmax in `dtype` or in
    float32 with force_fp32_for_softmax), generalized to GQA and sinks. Works on the
    original [batch..., L, N, H] layout so that dropout draws exactly Flax's random bits."""
    group = query.shape[-2] // key.shape[-2]
    if group > 1:
        key, value = jnp.repeat(key, group, axis=-2), jnp.repeat(value, group, axis=-2)
    if qk_einsum is None:
        dot = {} if einsum_dot_general is None else {"_dot_general": einsum_dot_general}
        qk_einsum = lambda s, a, b: jnp.einsum(s, a, b, precision=precision, **dot)  # noqa: E731
        wv_einsum = qk_einsum
    depth = query.shape[-1]
    query = query / jnp.sqrt(depth).astype(dtype)
    w = qk_einsum("...qhd,...khd->...hqk", query, key)
    if logits_soft_cap:
        w = logits_soft_cap * jnp.tanh(w / logits_soft_cap)
    if bias is not None:
        w = w + bias
    masks = [] if mask is None else [_bool_mask(mask)]
    if is_causal:
        t, s = w.shape[-2:]
        masks.append(jnp.tril(jnp.ones((t, s), jnp.bool_)))
    if segments[0] is not None:
        q_ids = segments[0].reshape(query.shape[:-2])
        kv_ids = q_ids if segments[1] is None else segments[1].reshape(key.shape[:-2])
        masks.append((q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :])
    if masks:
        keep = masks[0]
        for m in masks[1:]:
            keep = jnp.logical_and(keep, m)
        w = jnp.where(keep, w, jnp.finfo(dtype).min)
    weights_dtype = _softmax_dtype(dtype, force_fp32_for_softmax)
    if weights_dtype is not None:
        w = w.astype(weights_dtype)
    if sinks is not None:
        sink_col = jnp.broadcast_to(jnp.asarray(sinks, w.dtype).reshape(-1, 1, 1),
                                    w.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([w, sink_col], axis=-1), axis=-1)[..., :-1]
    else:
        w = jax.nn.softmax(w, axis=-1)
    if weights_dtype is None:
        w = w.astype(dtype)
    if module is not None:
        _sow(module, w)
    if dropout:
        if dropout_rng is None:
            raise ValueError("jax_sdpa.flax: dropout is active (dropout_rate > 0 and not "
                             "deterministic) but no dropout_rng was given")
        keep_prob = 1.0 - dropout_rate
        if broadcast_dropout:  # shared across batch and heads, as in Flax
            shape = (1,) * (key.ndim - 2) + w.shape[-2:]
        else:
            shape = w.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        w = w * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
    return wv_einsum("...hqk,...khd->...qhd", w, value)


def _attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
               deterministic, dtype, precision, module, einsum_dot_general,
               qk_attn_weights_einsum, attn_weights_value_einsum, promote_dtype, is_causal,
               implementation, sinks, force_fp32_for_softmax, logits_soft_cap=None):
    if (qk_attn_weights_einsum is None) != (attn_weights_value_einsum is None):
        raise ValueError("qk_attn_weights_einsum and attn_weights_value_einsum must be "
                         "specified together")
    if (precision is not None or einsum_dot_general is not None) and (
            qk_attn_weights_einsum is not None):
        raise ValueError("precision/einsum_dot_general and qk_attn_weights_einsum/"
                         "attn_weights_value_einsum are mutually exclusive (as in Flax): "
                         "specify only one of them")
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        query, key, value = _flax_promote((query, key, value), dtype)
    dtype = query.dtype
    _validate(query, key, value)
    dropout = _dropout_active(dropout_rate, deterministic)
    batch_shape = query.shape[:-3]
    segments = _current_segment_ids(batch_shape, query.shape[-3], key.shape[-3])

    reasons = []
    if dropout:
        reasons.append(f"dropout (rate {dropout_rate}) on the attention weights")
    if module is not None:
        reasons.append("module= (sowing the attention weights)")
    if qk_attn_weights_einsum is not None or einsum_dot_general is not None:
        reasons.append("custom einsums")
    if jnp.issubdtype(dtype, jnp.complexfloating):
        reasons.append(f"complex inputs ({jnp.dtype(dtype)})")
    # precision: XLA:CPU multiplies float32 exactly anyway; elsewhere HIGHEST runs the fused
    # kernels in their full-accuracy mode, other non-default precisions the exact path.
    fp32_exact = False
    if not _precision_is_default(precision) and api.trace_platform() != "cpu":
        if _precision_is_highest(precision):
            fp32_exact = True
        else:
            reasons.append(f"precision={precision!r}")
    if reasons:
        if implementation not in _EXACT_OK:
            raise NotImplementedError(
                f"jax_sdpa.flax: implementation={implementation!r} can't serve this call: "
                f"{', '.join(reasons)} needs the exact XLA path (implementation=None or 'xla')")
        return _exact(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                      dropout_rate, dropout, dtype, precision, module, einsum_dot_general,
                      qk_attn_weights_einsum, attn_weights_value_einsum, is_causal, sinks,
                      force_fp32_for_softmax, logits_soft_cap, segments)

    b = math.prod(batch_shape)
    q4, k4, v4 = (x.reshape((b,) + x.shape[-3:]) for x in (query, key, value))
    bias4 = None
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(jnp.promote_types(dtype, jnp.float32))
        bias4 = _to_4d(bias, batch_shape, "bias")
    mask4 = None if mask is None else _to_4d(_bool_mask(mask), batch_shape, "mask")
    with (jax.default_matmul_precision("highest") if fp32_exact
          else contextlib.nullcontext()):
        out = api.dot_product_attention(q4, k4, v4, bias=bias4, mask=mask4,
                                        is_causal=is_causal, implementation=implementation,
                                        sinks=sinks, q_segment_ids=segments[0],
                                        kv_segment_ids=segments[1],
                                        logits_soft_cap=logits_soft_cap)
    weights_dtype = _softmax_dtype(dtype, force_fp32_for_softmax)
    if weights_dtype is not None:  # Flax's float32 weights make its result float32
        out = out.astype(jnp.promote_types(out.dtype, weights_dtype))
    return out.reshape(batch_shape + out.shape[1:])


def make_attention_fn(is_causal: bool = False, implementation: Optional[str] = None,
                      sinks=None, logits_soft_cap: Optional[float] = None
                      ) -> Callable[..., Any]:
    """An `attention_fn` for Flax with fixed options.

    is_causal: add a top-left causal mask (Flax's `make_causal_mask`); a call's own
      `is_causal=True` (nnx passes one) also applies.
    implementation: as in `jax_sdpa.dot_product_attention` (None: the fastest that serves).
    sinks: optional `[num_heads]` attention-sink logits (gpt-oss).
    logits_soft_cap: None or c > 0: logits become c * tanh(logit / c) before bias and mask
      (Gemma 2).
    Segment ids (packed sequences) come from an enclosing `segment_ids` block.
    """
    checks.check_implementation(implementation)
    logits_soft_cap = checks.check_soft_cap(logits_soft_cap) or None
    configured_causal = bool(is_causal)

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                     dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                     dtype=None, precision=None, module=None,
                     force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                     qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                     promote_dtype=None, is_causal: bool = False):
        """Flax-compatible attention; see `jax_sdpa.flax`."""
        return _attention(query, key, value, bias, mask, broadcast_dropout, dropout_rng,
                          dropout_rate, deterministic, dtype, precision, module,
                          einsum_dot_general, qk_attn_weights_einsum,
                          attn_weights_value_einsum, promote_dtype,
                          configured_causal or bool(is_causal), implementation, sinks,
                          bool(force_fp32_for_softmax), logits_soft_cap)

    attention_fn.__qualname__ = attention_fn.__name__ = "attention_fn"
    attention_fn.__module__ = __name__
    return attention_fn


attention_fn = make_attention_fn()
attention_fn.__doc__ = """Flax-compatible attention backed by jax_sdpa (the defaults of
`make_attention_fn()`): `(query, key, value, bias=None, mask=None, broadcast_dropout=True,
dropout_rng=None, dropout_rate=0., deterministic=False, dtype=None, precision=None,
module=None, ..., is_causal=False)` with layout [batch..., L, N, H]."""
