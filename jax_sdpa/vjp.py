"""Differentiation rules of the attention primitives, to any order and in both modes.

Reverse mode keeps the fused backward; forward mode and higher orders run through the
reference's own differentiation (jax_sdpa/reference.py, exact or chunked as the call's
size asks):

- `sdpa_fwd_p`'s JVP is the fused (out, lse) plus (out_t, lse_t) from
  `sdpa_fwd_tangent_p`, a primitive linear in the tangents of q, k, v (and of an additive
  mask and of sinks, when those are perturbed). It lowers to `jax.jvp` of the reference
  forward. Its transpose binds `sdpa_bwd_p` on the saved (q, k, v, out, lse): `jax.grad`,
  `jax.vjp` and `jax.linear_transpose` run the fused backward and never that lowering. The
  gradients of sinks and of an additive mask are computed here in JAX, only for perturbed
  inputs. An lse cotangent (the entry points stop lse's gradient, like jax.nn; only
  higher-order programs produce one) goes through the reference's VJP.
- `sdpa_bwd_p`'s JVP and `sdpa_fwd_tangent_p`'s own JVP are `jax.jvp` of the reference
  (traced inline, so their transposes are JAX's): grad-of-grad, hessian, jacfwd-of-jacrev
  and jvp-of-grad run the fused first-order kernels plus reference code for the rest.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_sdpa import dispatch, primitives, reference
from jax_sdpa.config import StaticParams


def attention(q, k, v, mask, sinks, q_lengths, kv_lengths, params: StaticParams,
              q_segment_ids=None, kv_segment_ids=None, plan=None):
    """(out, lse) through `sdpa_fwd_p`; differentiable in q, k, v, an additive mask and
    sinks (lse too: its tangent and cotangent are handled, the entry points stop it).
    `plan`: the forward's dispatch.Plan made at trace time, or None."""
    return primitives.fwd(q, k, v, mask, sinks, q_lengths, kv_lengths, params,
                          q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                          plan=plan)


# ---------------------------------------------------------------------------
# the reference functions that forward mode and higher orders differentiate

def _is_zero(t):
    return type(t) is ad.Zero


def _zero_tangent(x):
    aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)
    return ad.Zero(aval.to_tangent_aval())


def _floating(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def _chunked(optional, flags, params, q, k, v) -> bool:
    """Whether the chunked (O(L) memory) reference serves this call's derivatives: when it
    is the implementation asked for, or when `implementation=None` on XLA would pick it."""
    cfg = primitives._config_from_avals([q, k, v, optional[0], optional[1]], flags, params)
    name = params.implementation
    if name not in ("xla", "xla_chunked"):
        name = dispatch.xla_choice(cfg)
    return name == "xla_chunked"


def _reference_forward(q, k, v, *optional, flags, params):
    """The reference (out, lse) of a call's primitive operands (placeholders included)."""
    fn = (reference.chunked_forward if _chunked(optional, flags, params, q, k, v)
          else reference.exact_forward)
    return fn(q, k, v, *primitives._real(optional, flags), params)


def _reference_backward(q, k, v, out, lse, dout, *optional, flags, params):
    fn = (reference.chunked_backward if _chunked(optional, flags, params, q, k, v)
          else reference.exact_backward)
    return fn(q, k, v, out, lse, dout, *primitives._real(optional, flags), params)


def _restricted(fn, primals, positions):
    """fn as a function of the primals at `positions` only (the others closed over)."""
    def restricted(*xs):
        args = list(primals)
        for i, x in zip(positions, xs):
            args[i] = x
        return fn(*args)

    return restricted


def _jvp_over(fn, primals, tangents, positions):
    """jax.jvp of fn over the primals at `positions` whose tangent is not a symbolic zero.
    Returns (primal outputs, tangents) or None."""
    live = [i for i in positions if not _is_zero(tangents[i])]
    if not live:
        return None
    return jax.jvp(_restricted(fn, primals, live), [primals[i] for i in live],
                   [tangents[i] for i in live])


# Operand positions of sdpa_fwd_p (and the first nine of sdpa_fwd_tangent_p).
_Q, _K, _V, _MASK, _SINKS = 0, 1, 2, 3, 4
_N_FWD = 3 + len(primitives.OPTIONAL)  # q, k, v and the optional operands


def _fwd_differentiable(primals, flags):
    """Positions of sdpa_fwd_p operands that carry tangents: q, k, v, a float mask, sinks."""
    positions = [_Q, _K, _V]
    if flags["has_mask"] and _floating(primals[_MASK]):
        positions.append(_MASK)
    if flags["has_sinks"]:
        positions.append(_SINKS)
    return positions


# ---------------------------------------------------------------------------
# the tangent primitive:
#   sdpa_fwd_tangent_p(q, k, v, mask, sinks, q_lengths, kv_lengths, q_segment_ids,
#                      kv_segment_ids, out, lse, mask_neg_inf, lse_neg_inf,
#                      tq, tk, tv, tmask, tsinks) -> (out_t, lse_t)
# linear in tq, tk, tv, tmask, tsinks (tmask / tsinks are placeholders unless
# tangent_mask / tangent_sinks). out and lse are kept for the transpose. A float mask and
# lse travel without their -inf (0 there, and a bool of where it was): an eager jax.grad
# hands them from its forward jit to its backward one as outputs, which debug_infs checks.

sdpa_fwd_tangent_p = Primitive("jax_sdpa_fwd_tangent")
sdpa_fwd_tangent_p.multiple_results = True

_OUT, _LSE, _MASK_NEG_INF, _LSE_NEG_INF = _N_FWD, _N_FWD + 1, _N_FWD + 2, _N_FWD + 3
_N_PRIMAL = _N_FWD + 4
_TANGENT_FLAGS = ("tangent_mask", "tangent_sinks")


def _without_neg_inf(x):
    """(x with 0 for -inf, where x was -inf)."""
    neg_inf = x == -jnp.inf
    return jnp.where(neg_inf, jnp.zeros((), x.dtype), x), neg_inf


def _with_neg_inf(finite, neg_inf):
    if neg_inf.size == 0:  # a placeholder: nothing was taken out
        return finite
    return jnp.where(neg_inf, jnp.asarray(-jnp.inf, finite.dtype), finite)


def _split_tangent_kwargs(kw):
    kw = dict(kw)
    tangent_mask, tangent_sinks = (kw.pop(name) for name in _TANGENT_FLAGS)
    flags, params = primitives._split_kwargs(kw)
    return flags, params, tangent_mask, tangent_sinks, kw


def _tangent_primals(args):
    """(q, k, v, *optional, out, lse) with their -inf back."""
    primal = list(args[:_N_FWD + 2])
    primal[_MASK] = _with_neg_inf(args[_MASK], args[_MASK_NEG_INF])
    primal[_LSE] = _with_neg_inf(args[_LSE], args[_LSE_NEG_INF])
    return primal


def _over_differentiable(fn, operands, **kw):
    """fn(q, k, v, mask, sinks) with the other operands (lengths, segment ids) closed over."""
    rest = tuple(operands[5:])
    return lambda q, k, v, mask, sinks: fn(q, k, v, mask, sinks, *rest, **kw)


def _forward_tangent(operands, tq, tk, tv, tmask, tsinks, *, flags, params, tangent_mask,
                     tangent_sinks):
    """(out_t, lse_t) by jax.jvp of the reference forward."""
    primals = list(operands[:5])
    tangents = [tq, tk, tv, tmask if tangent_mask else ad.Zero(None),
                tsinks if tangent_sinks else ad.Zero(None)]
    fn = _over_differentiable(_reference_forward, operands, flags=flags, params=params)
    _, (out_t, lse_t) = _jvp_over(fn, primals, tangents, range(5))
    return out_t, lse_t


def _tangent_rule_fn(**kw):
    """sdpa_fwd_tangent_p's operands -> (out_t, lse_t), for the lowering and its JVP."""
    flags, params, tangent_mask, tangent_sinks, _ = _split_tangent_kwargs(kw)

    def fn(*args):
        operands = _tangent_primals(args)[:_N_FWD]
        # out and lse: the reference recomputes them
        return _forward_tangent(operands, *args[_N_PRIMAL:], flags=flags, params=params,
                                tangent_mask=tangent_mask, tangent_sinks=tangent_sinks)

    return fn


def _tangent_abstract(*avals, **kw):
    out, lse = avals[_OUT], avals[_LSE]  # the tangents are shaped like the primal results
    return (out.update(shape=out.shape, dtype=out.dtype),
            lse.update(shape=lse.shape, dtype=lse.dtype))


def _tangent_transpose(cts, *args, **kw):
    """Cotangents of the linear operands: the fused backward for out's cotangent (plus sinks
    and mask gradients in JAX), the reference's VJP for lse's."""
    flags, params, tangent_mask, tangent_sinks, _ = _split_tangent_kwargs(kw)
    primal = _tangent_primals(args)
    operands, (out, lse) = primal[:_N_FWD], primal[_N_FWD:]
    q, k, v = operands[:3]
    linear = args[_N_PRIMAL:]
    undefined = [ad.is_undefined_primal(x) for x in linear]
    wanted = undefined[:3] + [undefined[3] and tangent_mask, undefined[4] and tangent_sinks]
    ct_out, ct_lse = cts
    grads = [None] * 5
    real = primitives._real(operands[3:], flags)
    real_mask, real_sinks, real_ql, real_kvl, real_qseg, real_kvseg = real
    if not _is_zero(ct_out):
        dout = ct_out.astype(out.dtype)
        if any(wanted[:3]):
            grads[:3] = primitives.bwd(q, k, v, out, lse, dout, *real[:4], params,
                                       q_segment_ids=real_qseg, kv_segment_ids=real_kvseg)
        if wanted[3]:
            grads[3] = _mask_grad(q, k, v, out, lse, dout, real_mask, real_ql, real_kvl,
                                  real_qseg, real_kvseg, params)
        if wanted[4]:
            grads[4] = _sinks_grad(out, lse, dout, real_sinks, params)
    if not _is_zero(ct_lse) and any(wanted):
        extra = _lse_cotangent_grads(operands, ct_lse, out, flags, params, wanted)
        grads = [g if e is None else (e if g is None else g + e) for g, e in zip(grads, extra)]
    return [None] * _N_PRIMAL + [g if w else None for g, w in zip(grads, wanted)]


def _lse_cotangent_grads(operands, ct_lse, out, flags, params, wanted):
    """Cotangents of (q, k, v, mask, sinks) for a cotangent of lse alone, through the
    reference's VJP (None where not wanted)."""
    positions = [i for i, w in enumerate(wanted) if w]
    fn = _over_differentiable(_reference_forward, operands, flags=flags, params=params)
    primals = list(operands[:5])
    _, pullback = jax.vjp(_restricted(fn, primals, positions),
                          *[primals[i] for i in positions])
    cts = pullback((jnp.zeros(out.shape, out.dtype), ct_lse.astype(jnp.float32)))
    grads = [None] * 5
    for i, ct in zip(positions, cts):
        grads[i] = ct
    return grads


def _tangent_jvp(primals, tangents, **kw):
    """The tangent primitive's own derivative, through the reference (forward over forward,
    and the linearization that reverse over forward transposes)."""
    outs = sdpa_fwd_tangent_p.bind(*primals, **kw)
    flags, _, tangent_mask, tangent_sinks, _ = _split_tangent_kwargs(kw)
    positions = _fwd_differentiable(primals, flags)
    positions += [_N_PRIMAL + i for i in (0, 1, 2)]
    if tangent_mask:
        positions.append(_N_PRIMAL + 3)
    if tangent_sinks:
        positions.append(_N_PRIMAL + 4)
    res = _jvp_over(_tangent_rule_fn(**kw), list(primals), list(tangents), positions)
    if res is None:
        return outs, [_zero_tangent(o) for o in outs]
    return outs, list(res[1])


def _fold_together(args, dims, idx, size, batch, present):
    """Operands that must keep one shape (a broadcastable mask or sinks, and what goes with
    it: its -inf flags, its tangent), folded alike: all keep a batch of 1 when none varies,
    else all are materialized per (vmapped, batch) pair. Placeholders pass through."""
    idx = [i for i, real in zip(idx, present) if real]
    if all(dims[i] is None for i in idx) and args[idx[0]].shape[0] == 1:
        return {i: args[i] for i in idx}
    return {i: primitives._fold(args[i], dims[i], size, batch) for i in idx}


def _tangent_batch(args, dims, **kw):
    flags, _, tangent_mask, tangent_sinks, _ = _split_tangent_kwargs(kw)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    q, qd = args[0], dims[0]
    batch = int(q.shape[0] if qd is None else np.delete(np.array(q.shape), qd)[0])
    new = list(args)  # placeholders are made inside our rules: never batched
    t = _N_PRIMAL
    for i in (0, 1, 2, _OUT, _LSE, _LSE_NEG_INF, t, t + 1, t + 2):  # q-, k-, v-, lse-shaped
        new[i] = primitives._fold(args[i], dims[i], size, batch)
    for i, key in enumerate(primitives.OPTIONAL_FLAGS[2:], start=5):  # lengths, segment ids
        if flags[key]:
            new[i] = primitives._fold(args[i], dims[i], size, batch)
    if flags["has_mask"]:
        group = _fold_together(args, dims, [_MASK, _MASK_NEG_INF, t + 3], size, batch,
                               [True, args[_MASK_NEG_INF].size > 0, tangent_mask])
        for i, x in group.items():
            new[i] = x
    if flags["has_sinks"]:
        for i, x in _fold_together(args, dims, [_SINKS, t + 4], size, batch,
                                   [True, tangent_sinks]).items():
            new[i] = x
    outs = sdpa_fwd_tangent_p.bind(*new, **kw)
    return [o.reshape((size, batch) + o.shape[1:]) for o in outs], [0, 0]


sdpa_fwd_tangent_p.def_impl(
    lambda *args, **kw: primitives.mlir_free_call(sdpa_fwd_tangent_p, args, kw))
sdpa_fwd_tangent_p.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(
    sdpa_fwd_tangent_p,
    lambda ctx, *args, **kw: mlir.lower_fun(_tangent_rule_fn(**kw), multiple_results=True)(
        ctx, *args))
ad.primitive_jvps[sdpa_fwd_tangent_p] = _tangent_jvp
ad.primitive_transposes[sdpa_fwd_tangent_p] = _tangent_transpose
batching.primitive_batchers[sdpa_fwd_tangent_p] = _tangent_batch


# ---------------------------------------------------------------------------
# JVP rules of the two contract primitives

def _placeholder_like(x):
    return jnp.zeros((0,), x.dtype if _floating(x) else jnp.float32)


def _fwd_jvp(primals, tangents, **kw):
    kw = dict(kw, lse_used=True)  # the tangent and the backward read lse
    out, lse = primitives.sdpa_fwd_p.bind(*primals, **kw)
    flags, _ = primitives._split_kwargs(kw)
    positions = _fwd_differentiable(primals, flags)
    if all(_is_zero(tangents[i]) for i in positions):
        return (out, lse), [_zero_tangent(out), _zero_tangent(lse)]
    tangent_mask = _MASK in positions and not _is_zero(tangents[_MASK])
    tangent_sinks = _SINKS in positions and not _is_zero(tangents[_SINKS])
    tq, tk, tv = (ad.instantiate_zeros(tangents[i]) for i in (_Q, _K, _V))
    tmask = tangents[_MASK] if tangent_mask else _placeholder_like(primals[_MASK])
    tsinks = tangents[_SINKS] if tangent_sinks else _placeholder_like(primals[_SINKS])
    operands = list(primals)
    mask_neg_inf = jnp.zeros((0,), jnp.bool_)
    if flags["has_mask"] and _floating(primals[_MASK]):
        operands[_MASK], mask_neg_inf = _without_neg_inf(primals[_MASK])
    lse_finite, lse_neg_inf = _without_neg_inf(lse)
    out_t, lse_t = sdpa_fwd_tangent_p.bind(*operands, out, lse_finite, mask_neg_inf,
                                           lse_neg_inf, tq, tk, tv, tmask, tsinks,
                                           tangent_mask=tangent_mask,
                                           tangent_sinks=tangent_sinks, **kw)
    return (out, lse), (out_t, lse_t)


def _bwd_jvp(primals, tangents, **kw):
    outs = primitives.sdpa_bwd_p.bind(*primals, **kw)
    flags, params = primitives._split_kwargs(kw)
    # q, k, v, out, lse, dout and a float mask; sinks enter the backward only through lse.
    positions = [0, 1, 2, 3, 4, 5]
    if flags["has_mask"] and _floating(primals[6]):
        positions.append(6)
    fn = functools.partial(_reference_backward, flags=flags, params=params)
    res = _jvp_over(lambda *a: fn(*a), list(primals), list(tangents), positions)
    if res is None:
        return outs, [_zero_tangent(o) for o in outs]
    return outs, list(res[1])


ad.primitive_jvps[primitives.sdpa_fwd_p] = _fwd_jvp
ad.primitive_jvps[primitives.sdpa_bwd_p] = _bwd_jvp


# ---------------------------------------------------------------------------
# gradients of sinks and of an additive mask (in JAX)

def _sinks_grad(out, lse, dout, sinks, params):
    """d loss / d sink[h] = -sum_{b, i} P_sink(b, h, i) * (dout_i . out_i)."""
    if params.seq_major:
        out, dout = jnp.swapaxes(out, 1, 2), jnp.swapaxes(dout, 1, 2)
    delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1)  # [B,H,L]
    live = lse != -jnp.inf  # a NaN row stays NaN
    s = sinks.astype(jnp.float32)[:, :, None]  # [sB, Hq, 1]
    zero = jnp.zeros((), jnp.float32)
    p_sink = jnp.where(live, jnp.exp(jnp.minimum(s - jnp.where(live, lse, zero), zero)), zero)
    grad = -jnp.sum(jnp.where(live, p_sink * delta, zero), axis=2)  # [B, Hq]
    if sinks.shape[0] == 1:
        grad = jnp.sum(grad, axis=0, keepdims=True)
    return grad.astype(sinks.dtype)


def _mask_grad(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths, q_segment_ids,
               kv_segment_ids, params):
    """dS summed over the mask's broadcast dimensions."""
    ds = reference.dscores(q, k, v, out, lse, dout, mask, q_lengths, kv_lengths,
                           q_segment_ids, kv_segment_ids, params,
                           precision=jax.lax.Precision.HIGHEST)
    axes = tuple(i for i in range(4) if mask.shape[i] == 1 and ds.shape[i] != 1)
    if axes:
        ds = jnp.sum(ds, axis=axes, keepdims=True)
    return ds.astype(mask.dtype)
