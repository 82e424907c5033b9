"""Argument checks shared by the public entry points (api.py, paged.py, ring.py, flax.py).

Each runs at trace time and raises a TypeError / ValueError that names the argument and the
shapes; each returns the argument in the canonical form the entries pass on.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_sdpa import dispatch


def as_array(x, name):
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    try:
        return jnp.asarray(x)
    except TypeError as e:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from e


def check_float(x, name):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float16, bfloat16, float32 or "
                        f"float64), got {x.dtype}")


def check_sinks(sinks, heads, dim, out_dtype=None):
    """sinks of shape (heads,) (`dim` names that axis in messages) as float32 [1, heads].
    With `out_dtype` (the MLX entry), MLX's rule: the sinks' dtype must promote to it."""
    if sinks is None:
        return None
    sinks = as_array(sinks, "sinks")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must have shape ({dim},) = ({heads},), got {sinks.shape}")
    check_float(sinks, "sinks")
    if out_dtype is not None and jnp.promote_types(sinks.dtype, out_dtype) != out_dtype:
        raise ValueError(f"sinks of dtype {sinks.dtype} must promote to the output dtype "
                         f"{jnp.dtype(out_dtype)} (as in MLX): cast them to {jnp.dtype(out_dtype)}")
    return sinks.astype(jnp.float32).reshape(1, heads)


def is_int(x):
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_scale(scale, head_dim, dim):
    """scale as a finite Python float: it is a static attribute of the kernels. `dim` names
    the head dim in messages (the default is 1/sqrt of it)."""
    if scale is None:
        if head_dim == 0:
            raise ValueError(f"the default scale 1/sqrt({dim}) is undefined for a head dim "
                             f"{dim} = 0: pass scale=")
        return 1.0 / math.sqrt(head_dim)
    what = f"{type(scale).__name__} {scale!r}"[:80]
    if isinstance(scale, (str, bytes, bool, np.bool_)):
        raise TypeError(f"scale must be a real number, got {what}")
    try:
        value = np.asarray(scale)
    except Exception as e:  # noqa: BLE001 - a traced value (jit argument) lands here
        raise TypeError(f"scale must be a static Python number (the kernels take it as an "
                        f"attribute), got {what}") from e
    if value.ndim != 0:
        raise TypeError(f"scale must be a scalar, got an array of shape {value.shape}")
    if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
        raise TypeError(f"scale must be a real number, got {what} of dtype {value.dtype}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


def check_lengths(x, name, batch, full, int32_only=False):
    """Valid lengths as int32 [B], clamped to [0, full] before any narrowing (an int64
    2**32 + 3 must mean "all", not 3). `int32_only`: jax.nn's rule, the dtype JAX would
    give the array must be int32."""
    if x is None:
        return None
    if isinstance(x, jax.Array):
        arr = x
        dtype = arr.dtype
    else:  # numpy, lists, scalars: clamp in numpy, before JAX narrows them to int32
        arr = np.asarray(x)
        dtype = jax.dtypes.canonicalize_dtype(arr.dtype) if arr.dtype != object else arr.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array of shape ({batch},), got dtype "
                        f"{dtype}")
    if int32_only and dtype != jnp.int32:
        raise ValueError(f"{name} dtype should be int32, got {dtype}")
    if arr.shape != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {arr.shape}")
    if isinstance(arr, np.ndarray):
        return jnp.asarray(np.clip(arr, 0, full).astype(np.int32))
    if arr.dtype != jnp.int32:
        arr = jnp.clip(arr, 0, full).astype(jnp.int32)
    return arr


def check_window(local_window_size):
    """(left, right) from None, an int or a pair of non-negative ints; -1 = unbounded."""
    if local_window_size is None:
        return -1, -1
    if is_int(local_window_size):
        pair = (local_window_size, local_window_size)
    elif isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size must be an int or a (left, right) pair, got "
                             f"{local_window_size!r}")
        pair = tuple(local_window_size)
    else:
        raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, "
                        f"got {type(local_window_size).__name__} {local_window_size!r}")
    if not all(is_int(w) for w in pair):
        raise TypeError(f"local_window_size must hold ints, got {local_window_size!r}")
    left, right = (int(w) for w in pair)
    if left < 0 or right < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size}")
    return left, right


def check_soft_cap(logits_soft_cap):
    """logits_soft_cap as a static float > 0, or 0.0 (off) for None."""
    if logits_soft_cap is None:
        return 0.0
    what = f"{type(logits_soft_cap).__name__} {logits_soft_cap!r}"[:80]
    if isinstance(logits_soft_cap, (str, bytes, bool, np.bool_)):
        raise TypeError(f"logits_soft_cap must be None or a positive number, got {what}")
    try:
        value = np.asarray(logits_soft_cap)
    except Exception as e:  # noqa: BLE001 - a traced value lands here
        raise TypeError(f"logits_soft_cap must be a static Python number (the kernels take "
                        f"it as an attribute), got {what}") from e
    if value.ndim != 0 or not (np.issubdtype(value.dtype, np.floating)
                               or np.issubdtype(value.dtype, np.integer)):
        raise TypeError(f"logits_soft_cap must be None or a positive number, got {what}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"logits_soft_cap must be None or a finite number > 0, got {value}")
    return value


def check_segment_ids(q_segment_ids, kv_segment_ids, batch, len_q, len_kv, dims=("Lq", "Lk"),
                       rank1_ok=False):
    """(q ids int32 [B, Lq], kv ids int32 [B, Lk]) or (None, None); kv_segment_ids None
    means the query's own (then Lq must equal Lk). `rank1_ok`: [L] stands for [1, L] (the
    jax.nn entry's unbatched inputs)."""
    if q_segment_ids is None:
        if kv_segment_ids is not None:
            raise ValueError("kv_segment_ids needs q_segment_ids (the ids of the queries)")
        return None, None

    def check(x, name, length, dim):
        x = as_array(x, name)
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name} must be an int32 array of shape [B, {dim}] = "
                            f"[{batch}, {length}], got dtype {x.dtype}")
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} dtype should be int32, got {x.dtype}")
        if rank1_ok and x.ndim == 1 and batch == 1:
            x = x[None]
        if x.shape != (batch, length):
            raise ValueError(f"{name} must have shape [B, {dim}] = [{batch}, {length}], got "
                             f"{x.shape}")
        return x

    q_ids = check(q_segment_ids, "q_segment_ids", len_q, dims[0])
    if kv_segment_ids is None:
        if len_q != len_kv:
            raise ValueError(f"q_segment_ids alone stands for the keys' ids too, which needs "
                             f"equal query and key lengths ({dims[0]} = {len_q}, "
                             f"{dims[1]} = {len_kv}): pass kv_segment_ids")
        return q_ids, q_ids
    return q_ids, check(kv_segment_ids, "kv_segment_ids", len_kv, dims[1])


def check_bool(x, name):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def check_implementation(implementation):
    if implementation is not None and implementation not in dispatch.IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {dispatch.IMPLEMENTATIONS}, "
                         f"got {implementation!r}")


def broadcast_mask(mask, name, full_shape):
    """Left-pads a mask to rank 4 and checks each dim is 1 or the full size."""
    if mask.ndim > 4:
        raise ValueError(f"{name} must have rank <= 4, got shape {mask.shape}")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    for got, want in zip(mask.shape, full_shape):
        if got != 1 and got != want:
            raise ValueError(f"{name} of shape {mask.shape} is not broadcastable to "
                             f"[B, Hq, Lq, Lk] = {list(full_shape)}")
    return mask


def canonical_mask_dtype(mask, name):
    if mask.dtype == jnp.bool_:
        return mask
    if not jnp.issubdtype(mask.dtype, jnp.floating):
        raise TypeError(f"{name} must be boolean (True = attend) or floating (additive), got "
                        f"{mask.dtype}")
    if mask.dtype == jnp.float64 and not jax.config.jax_enable_x64:
        return mask.astype(jnp.float32)
    return mask
