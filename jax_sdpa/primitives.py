"""The two primitives every implementation lowers:

    sdpa_fwd_p(q, k, v, *optional) -> (out, lse)
    sdpa_bwd_p(q, k, v, out, lse, dout, *optional) -> (dq, dk, dv)

with optional = (mask, sinks, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids).

Operands and semantics are those of docs/ffi_contract.md; absent optional
operands are zero-sized placeholders plus a `has_*` flag. Each primitive has an
abstract eval, a batching rule (vmapped axes are folded into the batch), the
pure-JAX reference as the default lowering, and per-platform lowerings that emit the
call's plan (implementation, FFI target, workspace): the one the `plan` param carries when
it was made for this call (an entry point that named the implementation made it at trace
time), else one `dispatch` makes there.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_sdpa import dispatch, flash_attn3, reference, sharding
from jax_sdpa.config import Config, StaticParams

try:
    from jax._src.dispatch import apply_primitive as _apply_primitive
except ImportError:  # pragma: no cover - a future jax moved it
    _apply_primitive = None

sdpa_fwd_p = Primitive("jax_sdpa_fwd")
sdpa_fwd_p.multiple_results = True
sdpa_bwd_p = Primitive("jax_sdpa_bwd")
sdpa_bwd_p.multiple_results = True

# The optional operands, in the contract's order, and the flag that says each is present
# (the two segment-id operands share one flag: both or neither).
OPTIONAL = ("mask", "sinks", "q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")
OPTIONAL_FLAGS = ("has_mask", "has_sinks", "has_q_lengths", "has_kv_lengths",
                  "has_segment_ids", "has_segment_ids")
FLAGS = tuple(dict.fromkeys(OPTIONAL_FLAGS))


# --------------------------------------------------------------------------
# binding

def _placeholder(dtype):
    return jnp.zeros((0,), dtype)


def _optional_operands(mask, sinks, q_lengths, kv_lengths, q_segment_ids=None,
                       kv_segment_ids=None):
    """The optional operands (placeholders for absent ones) and their has_* flags."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids are given together or not at all")
    given = (mask, sinks, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids)
    placeholder_dtypes = (jnp.float32, jnp.float32, jnp.int32, jnp.int32, jnp.int32,
                          jnp.int32)
    operands = tuple(_placeholder(t) if x is None else x
                     for x, t in zip(given, placeholder_dtypes))
    flags = {flag: x is not None for x, flag in zip(given, OPTIONAL_FLAGS)}
    return operands, flags


def _static_kwargs(params: StaticParams):
    return dataclasses.asdict(params)


def fwd(q, k, v, mask, sinks, q_lengths, kv_lengths, params: StaticParams,
        q_segment_ids=None, kv_segment_ids=None, plan=None):
    """Binds sdpa_fwd_p. The optional operands may be None; `plan`: the dispatch.Plan made
    for this call at trace time (None: the lowering makes it). Returns (out, lse)."""
    optional, flags = _optional_operands(mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                                         kv_segment_ids)
    out, lse = sdpa_fwd_p.bind(q, k, v, *optional, **flags, **_static_kwargs(params),
                               plan=plan)
    return out, lse


def bwd(q, k, v, out, lse, dout, mask, sinks, q_lengths, kv_lengths, params: StaticParams,
        q_segment_ids=None, kv_segment_ids=None):
    """Binds sdpa_bwd_p. Returns (dq, dk, dv)."""
    optional, flags = _optional_operands(mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                                         kv_segment_ids)
    return tuple(sdpa_bwd_p.bind(q, k, v, out, lse, dout, *optional, **flags,
                                 **_static_kwargs(params)))


def ffi_call_args(*, scale, window_left=-1, window_right=-1, bottom_right=False,
                  seq_major=False, mask=None, sinks=None, q_lengths=None, kv_lengths=None,
                  q_segment_ids=None, kv_segment_ids=None, fp32_precision=0,
                  logits_soft_cap=0.0):
    """(optional operands, attributes) of a direct `jax.ffi.ffi_call` of a contract target
    (docs/ffi_contract.md): call(q, k, v[, out, lse, dout], *operands, **attrs). For tests
    and benchmarks that call a handler without the primitives; the lowering uses the same
    two pieces."""
    operands, flags = _optional_operands(mask, sinks, q_lengths, kv_lengths, q_segment_ids,
                                         kv_segment_ids)
    params = StaticParams(scale=float(scale), window_left=int(window_left),
                          window_right=int(window_right), bottom_right=bool(bottom_right),
                          seq_major=bool(seq_major), fp32_precision=int(fp32_precision),
                          logits_soft_cap=float(logits_soft_cap))
    return operands, ffi_attrs(params, flags)


def _split_kwargs(kw):
    flags = {name: kw[name] for name in FLAGS}
    params = StaticParams(**{f.name: kw[f.name] for f in dataclasses.fields(StaticParams)})
    return flags, params


def _real(optional, flags):
    """Placeholders -> None."""
    return tuple(x if flags[key] else None for x, key in zip(optional, OPTIONAL_FLAGS))


# --------------------------------------------------------------------------
# abstract evaluation

def _fwd_abstract(q, k, v, *optional, **kw):
    flags, params = _split_kwargs(kw)
    # lse is [B, Hq, Lq] in both layouts
    lse_axes = (0, 2, 1) if params.seq_major else (0, 1, 2)
    out = _derived_aval(q, q.shape[:3] + (v.shape[3],), q.dtype, (0, 1, 2, None))
    lse = _derived_aval(q, tuple(q.shape[a] for a in lse_axes), np.dtype(np.float32),
                        lse_axes)
    return out, lse


def _derived_aval(like, shape, dtype, axes):
    """A result aval made from operand `like`: its varying manual axes kept (shard_map),
    and under an explicit-sharding mesh its sharding on the axes the result takes from it
    (`axes[i]`: the axis of `like` that result axis i is, None for a new one)."""
    sharding = getattr(like, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return like.update(shape=shape, dtype=dtype)
    spec = tuple(spec) + (None,) * (len(like.shape) - len(spec))
    new_spec = jax.sharding.PartitionSpec(*(None if a is None else spec[a] for a in axes))
    return like.update(shape=shape, dtype=dtype,
                       sharding=jax.sharding.NamedSharding(sharding.mesh, new_spec))


def _bwd_abstract(q, k, v, out, lse, dout, *optional, **kw):
    return (q.update(shape=q.shape, dtype=q.dtype), k.update(shape=k.shape, dtype=k.dtype),
            v.update(shape=v.shape, dtype=v.dtype))


sdpa_fwd_p.def_abstract_eval(_fwd_abstract)
sdpa_bwd_p.def_abstract_eval(_bwd_abstract)


# --------------------------------------------------------------------------
# reference implementation (eager evaluation and the default lowering)

def _reference_fwd(q, k, v, *optional, params, chunked, probs_dtype=None):
    fn = reference.chunked_forward if chunked else reference.exact_forward
    return fn(q, k, v, *optional, params, probs_dtype=probs_dtype)


def _reference_bwd(q, k, v, out, lse, dout, *optional, params, chunked, probs_dtype=None):
    fn = reference.chunked_backward if chunked else reference.exact_backward
    return fn(q, k, v, out, lse, dout, *optional, params, probs_dtype=probs_dtype)


def _fwd_impl(q, k, v, *optional, **kw):
    return mlir_free_call(sdpa_fwd_p, (q, k, v) + optional, kw)


def _bwd_impl(*args, **kw):
    return mlir_free_call(sdpa_bwd_p, args, kw)


def mlir_free_call(prim, args, kw):
    """Eager evaluation: compile the primitive alone (dispatch happens at lowering). JAX's own
    apply_primitive where there is one: it also runs where jit is disabled (the re-run of
    debug_nans / debug_infs), which a jax.jit of the bind would turn into a recursion."""
    if _apply_primitive is not None:
        return _apply_primitive(prim, *args, **kw)
    return _jitted(prim, tuple(sorted(kw.items())))(*args)  # pragma: no cover


@functools.lru_cache(maxsize=256)
def _jitted(prim, kw_items):
    kw = dict(kw_items)
    return jax.jit(lambda *a: prim.bind(*a, **kw))


sdpa_fwd_p.def_impl(_fwd_impl)
sdpa_bwd_p.def_impl(_bwd_impl)


# --------------------------------------------------------------------------
# lowering

def _config_from_avals(avals, flags, params) -> Config:
    q, k, v, mask, sinks = avals
    return Config.from_shapes(
        q.shape, k.shape, v.shape, q.dtype,
        mask.shape if flags["has_mask"] else None,
        mask.dtype if flags["has_mask"] else None,
        flags["has_sinks"], flags["has_q_lengths"], flags["has_kv_lengths"], params,
        sinks_batch=sinks.shape[0] if flags["has_sinks"] else 1,
        has_segment_ids=flags["has_segment_ids"])


def ffi_attrs(params: StaticParams, flags):
    """The FFI attributes of docs/ffi_contract.md (every handler binds all of them)."""
    return dict(scale=float(params.scale), window_left=int(params.window_left),
                window_right=int(params.window_right), bottom_right=bool(params.bottom_right),
                seq_major=bool(params.seq_major), **{k: bool(v) for k, v in flags.items()},
                fp32_precision=np.int64(params.fp32_precision),
                logits_soft_cap=float(params.logits_soft_cap), kv_layout=np.int64(0))


def _lower(direction, platform):
    """Lowering rule for one primitive direction ('fwd'/'bwd') on one platform
    (None: the default rule, used by every platform without its own)."""
    ref = _reference_fwd if direction == "fwd" else _reference_bwd
    n_fixed = 3 if direction == "fwd" else 6
    prim = sdpa_fwd_p if direction == "fwd" else sdpa_bwd_p

    def rule(ctx, *args, **kw):
        # Multi-device jit: partition over batch/heads per shard (jax_sdpa/sharding.py).
        if sharding.needs_partitioning(ctx):
            return sharding.lower_partitioned(ctx, prim, direction, args, kw)
        flags, params = _split_kwargs(kw)
        avals = ctx.avals_in
        # The optional operands start after q, k, v (fwd) or q, k, v, out, lse, dout (bwd).
        cfg = _config_from_avals([avals[0], avals[1], avals[2], avals[n_fixed],
                                  avals[n_fixed + 1]], flags, params)
        plan = dispatch.lowering_plan(cfg, platform or platform_of(ctx), direction,
                                      kw.get("plan"))
        if plan.target is None:  # xla / xla_chunked
            chunked = plan.implementation == "xla_chunked"

            def fn(*a):
                fixed, optional = a[:n_fixed], _real(a[n_fixed:], flags)
                return ref(*fixed, *optional, params=params, chunked=chunked,
                           probs_dtype=plan.probs_dtype)

            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        if plan.implementation == "flash_attn3":
            if plan.fallback is None:
                return flash_attn3.lower(ctx, direction, args, params)
            # Packed calls whose ids the varlen kernels can't take run the plan's fallback
            # (taken when the call runs): the primitive with that implementation named.
            fallback = functools.partial(prim.bind, **dict(
                kw, implementation=plan.fallback.implementation, plan=plan.fallback))
            return flash_attn3.lower(ctx, direction, args, params, packed=True,
                                     fallback=fallback)
        if plan.segments_as_mask:
            return _lower_segments_as_mask(ctx, plan, n_fixed, args, flags, params)
        attrs = ffi_attrs(params, flags)
        results = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out]
        return mlir.lower_fun(lambda *a: call_target(plan, a, results, attrs),
                              multiple_results=True)(ctx, *args)

    return rule


def _lower_segments_as_mask(ctx, plan, n_fixed, args, flags, params):
    """The custom call with the segment ids passed as the additive mask [B, 1, Lq, Lk] of
    dispatch.segments_as_mask (0 where q_segment_ids[b, i] == kv_segment_ids[b, j], -inf
    elsewhere; the call has no mask of its own), built in XLA next to the call."""
    ids_at = OPTIONAL.index("q_segment_ids")
    masked_flags = dict(flags, has_mask=True, has_segment_ids=False)
    attrs = ffi_attrs(params, masked_flags)
    results = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ctx.avals_out]

    def fn(*a):
        fixed, optional = a[:n_fixed], list(a[n_fixed:])
        q_ids, kv_ids = optional[ids_at], optional[ids_at + 1]
        same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
        optional[OPTIONAL.index("mask")] = jnp.where(same, 0.0, -jnp.inf).astype(fixed[0].dtype)
        optional[ids_at] = optional[ids_at + 1] = _placeholder(jnp.int32)
        return call_target(plan, (*fixed, *optional), results, attrs)

    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def call_target(plan, operands, results, attrs):
    """The plan's FFI target called on `operands` (inside a lowered function) for the
    primitive's `results`: with the target's uint8 workspace result appended and dropped
    (dispatch.workspace_bytes_at_lowering), and for the no-lse cuDNN target, which returns
    f32 [0] in lse's place, lse as NaN (XLA drops it, since nothing reads it)."""
    no_lse = plan.target == dispatch.CUDNN_FWD_NO_LSE_TARGET
    called = list(results)
    if no_lse:
        called[1] = jax.ShapeDtypeStruct((0,), jnp.float32)
    workspace = dispatch.workspace_bytes_at_lowering(plan, operands, called, attrs)
    extra = [jax.ShapeDtypeStruct((workspace,), np.uint8)] if workspace else []
    out = list(jax.ffi.ffi_call(plan.target, [*called, *extra])(*operands, **attrs))
    out = out[:len(results)]
    if no_lse:
        out[1] = jnp.full(results[1].shape, jnp.nan, jnp.float32)
    return out


def lower_with_workspace(ctx, target, args, attrs, workspace_bytes):
    """The custom call with an extra 1-D uint8 result of `workspace_bytes`, dropped: the
    primitive's results are the call's first ones. Our CUDA decode kernel's target returns
    such a workspace besides out and lse (split-K partials + counters, allocated by XLA so
    that the call is CUDA-graph capturable; docs/ffi_contract.md)."""
    n_out = len(ctx.avals_out)
    workspace = jax.core.ShapedArray((int(workspace_bytes),), np.dtype(np.uint8))
    wide = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    results = jax.ffi.ffi_lowering(target)(wide, *args, **attrs)
    return list(results)[:n_out]


def platform_of(ctx):
    """The platform a lowering without a rule of its own emits code for."""
    platforms = getattr(ctx.module_context, "platforms", None) or ["cpu"]
    return platforms[0]


for _direction, _prim in (("fwd", sdpa_fwd_p), ("bwd", sdpa_bwd_p)):
    mlir.register_lowering(_prim, _lower(_direction, None))
    for _platform in ("cpu", "cuda"):
        mlir.register_lowering(_prim, _lower(_direction, _platform), platform=_platform)
sharding.register_primitives(sdpa_fwd_p, sdpa_bwd_p)  # multi-device lowering needs devices


# --------------------------------------------------------------------------
# batching: fold the vmapped axis into the batch dimension

def _fold(x, bdim, size, batch):
    """x with vmapped axis `bdim` (or None) -> leading batch of size*batch."""
    if bdim is None:
        x = jnp.broadcast_to(x[None], (size,) + x.shape)
    else:
        x = jnp.moveaxis(x, bdim, 0)
    if x.shape[1] != batch:
        x = jnp.broadcast_to(x, (size, batch) + x.shape[2:])
    return x.reshape((size * batch,) + x.shape[2:])


def _fold_broadcastable(x, bdim, size, batch):
    """A mask/sinks operand whose batch dim may be 1 (broadcast): keep it 1 when
    nothing about it varies, else materialize it per (vmapped, batch) pair."""
    if bdim is None and x.shape[0] == 1:
        return x
    return _fold(x, bdim, size, batch)


def _batch_rule(prim, n_fixed):
    def rule(args, dims, **kw):
        flags, _ = _split_kwargs(kw)
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        q, qd = args[0], dims[0]
        batch = q.shape[0] if qd is None else np.delete(np.array(q.shape), qd)[0]
        batch = int(batch)
        new_args = [_fold(a, d, size, batch) for a, d in zip(args[:n_fixed], dims[:n_fixed])]
        for a, d, key in zip(args[n_fixed:], dims[n_fixed:], OPTIONAL_FLAGS):
            if not flags[key]:
                new_args.append(a)  # placeholder: never batched (made inside our code)
                assert d is None
            elif key in ("has_mask", "has_sinks"):
                new_args.append(_fold_broadcastable(a, d, size, batch))
            else:
                new_args.append(_fold(a, d, size, batch))
        outs = prim.bind(*new_args, **kw)
        outs = [o.reshape((size, batch) + o.shape[1:]) for o in outs]
        return outs, [0] * len(outs)

    return rule


batching.primitive_batchers[sdpa_fwd_p] = _batch_rule(sdpa_fwd_p, 3)
batching.primitive_batchers[sdpa_bwd_p] = _batch_rule(sdpa_bwd_p, 6)
