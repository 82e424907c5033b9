"""Attention over a paged KV cache (inference), and the page writer.

    out = jax_sdpa.paged_attention(q, k_pages, v_pages, page_indices, kv_lengths,
                                   mask="causal")
    k_pages, v_pages = jax_sdpa.paged_kv_write(k_pages, v_pages, page_indices, kv_lengths,
                                               k_new, v_new)

The cache is a pool of fixed-size pages shared by every sequence; row b's logical page j is
the physical page `page_indices[b, j]`, and its keys are positions `j * S ... j * S + S - 1`
(S = page size). Two page layouts (`kv_layout`):

- "PHSD": `[num_pages, Hk, page_size, D]`, head-major pages (kv_layout 0 on the wire);
- "PSHD": `[num_pages, page_size, Hk, D]`, the order of vLLM and FlashAttention-3 (1).

Safety: a physical page index outside `[0, num_pages)` makes that page's keys invisible (it is
never read); keys at or past `kv_lengths[b]` are never read and never influence the output;
the writer drops writes that fall outside the row's pages or into such a page.

One primitive, `sdpa_paged_fwd_p(q, k_pages, v_pages, page_indices, kv_lengths, sinks) ->
(out, lse)`, lowered to a backend's FFI target `jax_sdpa_<backend>_paged_fwd` where its module
registers one (docs/ffi_contract.md), else to the pure-JAX reference (a gather of the pages,
then `reference.exact_forward`). Forward only: asking for a gradient is an error.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_sdpa import api, checks, dispatch, primitives, reference, sharding
from jax_sdpa.config import Config, StaticParams

__all__ = ["paged_attention", "paged_kv_write", "explain", "KV_LAYOUTS"]

# kv_layout names -> the FFI attribute's value.
KV_LAYOUTS = {"PHSD": 0, "PSHD": 1}


# ---------------------------------------------------------------------------
# shapes

@dataclasses.dataclass(frozen=True)
class PagedShape:
    """The pool's extents under one layout."""

    num_pages: int
    heads_kv: int
    page_size: int
    head_dim: int

    @staticmethod
    def of(pages_shape, kv_layout: int) -> "PagedShape":
        p, a, b, d = pages_shape
        return PagedShape(p, a, b, d) if kv_layout == 0 else PagedShape(p, b, a, d)


def _check_kv_layout(kv_layout) -> int:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {sorted(KV_LAYOUTS)} ('PHSD': pages "
                         f"[num_pages, Hk, page_size, D], 'PSHD': [num_pages, page_size, Hk, "
                         f"D]), got {kv_layout!r}")
    return KV_LAYOUTS[kv_layout]


def _layout_text(kv_layout: int, dim="D") -> str:
    return ("[num_pages, Hk, page_size, " if kv_layout == 0 else
            "[num_pages, page_size, Hk, ") + dim + "]"


def _check_pages(k_pages, v_pages, kv_layout: int):
    """(k_pages, v_pages, PagedShape of k, value head dim), or a clear error."""
    k_pages, v_pages = checks.as_array(k_pages, "k_pages"), checks.as_array(v_pages, "v_pages")
    for x, name, dim in ((k_pages, "k_pages", "D"), (v_pages, "v_pages", "Dv")):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 {_layout_text(kv_layout, dim)}, got "
                             f"shape {x.shape}")
        checks.check_float(x, name)
    ks, vs = PagedShape.of(k_pages.shape, kv_layout), PagedShape.of(v_pages.shape, kv_layout)
    if (ks.num_pages, ks.heads_kv, ks.page_size) != (vs.num_pages, vs.heads_kv, vs.page_size):
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must agree in "
                         f"num_pages, Hk and page_size ({_layout_text(kv_layout)})")
    if ks.heads_kv == 0:
        raise ValueError(f"k_pages has no kv heads: {k_pages.shape} "
                         f"({_layout_text(kv_layout)})")
    return k_pages, v_pages, ks, vs.head_dim


def _check_page_indices(page_indices, batch):
    page_indices = checks.as_array(page_indices, "page_indices")
    if not jnp.issubdtype(page_indices.dtype, jnp.integer):
        raise TypeError(f"page_indices must be an int32 array [B, pages_per_seq], got dtype "
                        f"{page_indices.dtype}")
    if page_indices.dtype != jnp.int32:
        raise ValueError(f"page_indices dtype should be int32, got {page_indices.dtype}")
    if page_indices.ndim != 2 or (batch is not None and page_indices.shape[0] != batch):
        raise ValueError(f"page_indices must have shape [B, pages_per_seq] with B = {batch}, "
                         f"got {page_indices.shape}")
    return page_indices


# ---------------------------------------------------------------------------
# the public functions

def paged_attention(q, k_pages, v_pages, page_indices, kv_lengths, *,
                    scale: Optional[float] = None, mask: Optional[str] = None, sinks=None,
                    logits_soft_cap: Optional[float] = None, local_window_size=None,
                    kv_layout: str = "PHSD", implementation: Optional[str] = None):
    """Attention of q against each row's keys in a paged KV cache (forward only).

    q [B, Hq, Lq, D]; k_pages / v_pages: the page pool, [num_pages, Hk, page_size, D / Dv]
    (kv_layout "PHSD") or [num_pages, page_size, Hk, D / Dv] ("PSHD"); page_indices int32
    [B, pages_per_seq]: row b's logical page j is physical page page_indices[b, j];
    kv_lengths int32 [B]: row b's valid keys, the Lq new ones included (clamped to
    [0, pages_per_seq * page_size]). Returns [B, Hq, Lq, Dv] in q's dtype.

    `mask`: None or "causal", bottom-right against kv_lengths (row b's queries are positions
    kv_lengths[b] - Lq ... kv_lengths[b] - 1); `local_window_size` w or (left, right), aligned
    the same way; `sinks` [Hq]; `logits_soft_cap` c > 0; `scale` default 1/sqrt(D);
    `implementation` None (a fused backend where one serves paged calls, else "xla") or one
    of jax_sdpa.IMPLEMENTATIONS. Pages past a row's length and out-of-range page indices are
    never read (module doc).
    """
    args = _canonicalize(q, k_pages, v_pages, page_indices, kv_lengths, scale, mask, sinks,
                         logits_soft_cap, local_window_size, kv_layout, implementation)
    q, k_pages, v_pages, page_indices, kv_lengths, sinks, params, layout = args
    # A named implementation is planned here: one that can't serve says why at trace time,
    # and the lowering takes the plan.
    plan = None if implementation is None else dispatch.plan_paged(
        _config_of(*args), api.trace_platform(), implementation)
    b, hq, lq, _ = q.shape
    if b == 0 or lq == 0:
        dv = PagedShape.of(v_pages.shape, layout).head_dim
        return jnp.zeros((b, hq, lq, dv), q.dtype)
    return _paged(q, k_pages, v_pages, page_indices, kv_lengths, sinks, params=params,
                  kv_layout=layout, plan=plan)


def _canonicalize(q, k_pages, v_pages, page_indices, kv_lengths, scale, mask, sinks,
                  logits_soft_cap, local_window_size, kv_layout, implementation):
    """paged_attention's validated, canonical arguments: (q, k_pages, v_pages,
    page_indices, kv_lengths, sinks, params, layout)."""
    layout = _check_kv_layout(kv_layout)
    q = checks.as_array(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must have rank 4 [B, Hq, Lq, D], got shape {q.shape}")
    checks.check_float(q, "q")
    checks.check_implementation(implementation)
    k_pages, v_pages, ks, _ = _check_pages(k_pages, v_pages, layout)
    b, hq, _, d = q.shape
    if ks.head_dim != d:
        raise ValueError(f"q and k_pages must have the same head dim: q {q.shape}, k_pages "
                         f"{k_pages.shape} ({_layout_text(layout)})")
    if hq % ks.heads_kv:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number "
                         f"of kv heads ({ks.heads_kv}): q {q.shape}, k_pages {k_pages.shape}")
    page_indices = _check_page_indices(page_indices, b)
    len_kv = page_indices.shape[1] * ks.page_size
    if kv_lengths is None:
        raise TypeError("kv_lengths must be an int32 array of shape (B,), got None")
    kv_lengths = checks.check_lengths(kv_lengths, "kv_lengths", b, len_kv, int32_only=True)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None or 'causal', got the string {mask!r}")
    elif mask is not None:
        raise ValueError(f"paged_attention takes mask=None or 'causal' (bottom-right against "
                         f"kv_lengths), not an array (got {type(mask).__name__})")
    dtype = jnp.result_type(q, k_pages, v_pages)
    q, k_pages, v_pages = q.astype(dtype), k_pages.astype(dtype), v_pages.astype(dtype)
    sinks = checks.check_sinks(sinks, hq, "Hq", out_dtype=dtype)
    window_left, window_right = checks.check_window(local_window_size)
    if mask == "causal":
        window_right = 0 if window_right < 0 else min(window_right, 0)
    params = StaticParams(scale=checks.check_scale(scale, d, "D"), window_left=window_left,
                          window_right=window_right, bottom_right=True, seq_major=False,
                          implementation=implementation,
                          logits_soft_cap=checks.check_soft_cap(logits_soft_cap))
    return q, k_pages, v_pages, page_indices, kv_lengths, sinks, params, layout


def _config_of(q, k_pages, v_pages, page_indices, kv_lengths, sinks, params, layout):
    return paged_config(q.shape, k_pages.shape, v_pages.shape, q.dtype, page_indices.shape,
                        sinks is not None, params, layout)


def explain(q, k_pages, v_pages, page_indices, kv_lengths, *, scale=None, mask=None,
            sinks=None, logits_soft_cap=None, local_window_size=None, kv_layout="PHSD",
            platform: Optional[str] = None) -> api.Explanation:
    """Same arguments as `paged_attention` (arrays or jax.ShapeDtypeStruct): which
    implementation `implementation=None` runs on `platform` (default: the default backend)
    and, for every implementation, whether it serves the paged call and why not."""
    captured = {}
    mask_string = mask if isinstance(mask, str) else None

    def trace(q, k_pages, v_pages, page_indices, kv_lengths, mask_array, sinks):
        args = _canonicalize(q, k_pages, v_pages, page_indices, kv_lengths, scale,
                             mask_string or mask_array, sinks, logits_soft_cap,
                             local_window_size, kv_layout, None)
        captured["cfg"] = _config_of(*args)
        return jnp.zeros(())

    jax.eval_shape(trace, q, k_pages, v_pages, page_indices, kv_lengths,
                   None if mask_string else mask, sinks)
    cfg = captured["cfg"]
    platform = platform or api.trace_platform()
    chosen, verdicts = dispatch.explain_paged_choice(cfg, platform)
    return api.Explanation(chosen=chosen, platform=platform, direction="paged fwd",
                           verdicts=verdicts, config=cfg)


@functools.partial(jax.jit, static_argnames=("params", "kv_layout", "plan"))
def _paged(q, k_pages, v_pages, page_indices, kv_lengths, sinks, params, kv_layout, plan):
    return paged_fwd(q, k_pages, v_pages, page_indices, kv_lengths, sinks, params,
                     kv_layout, plan)[0]


def paged_kv_write(k_pages, v_pages, page_indices, kv_lengths, k_new, v_new, *,
                   kv_layout: str = "PHSD"):
    """Writes k_new / v_new [B, Hk, Lnew, D / Dv] into each row's pages at positions
    kv_lengths[b] ... kv_lengths[b] + Lnew - 1 and returns (k_pages, v_pages).

    Functional (a scatter): under `jax.jit` with the pages donated it updates them in place.
    Positions past the row's pages (>= pages_per_seq * page_size) and positions whose page
    index is outside [0, num_pages) are dropped. After the write, the row's length for
    `paged_attention` is kv_lengths[b] + Lnew. Rows must not share the pages they write to
    (two writes to one slot: either wins)."""
    layout = _check_kv_layout(kv_layout)
    k_pages, v_pages, ks, dv = _check_pages(k_pages, v_pages, layout)
    k_new, v_new = checks.as_array(k_new, "k_new"), checks.as_array(v_new, "v_new")
    for x, name, label, dim in ((k_new, "k_new", "D", ks.head_dim),
                                (v_new, "v_new", "Dv", dv)):
        if x.ndim != 4 or x.shape[1] != ks.heads_kv or x.shape[3] != dim:
            raise ValueError(f"{name} must have shape [B, Hk, Lnew, {label}] = [B, "
                             f"{ks.heads_kv}, Lnew, {dim}] (from the pages), got {x.shape}")
    if k_new.shape[:3] != v_new.shape[:3]:
        raise ValueError(f"k_new {k_new.shape} and v_new {v_new.shape} must agree in B, Hk "
                         f"and Lnew")
    b, hk, lnew = k_new.shape[:3]
    page_indices = _check_page_indices(page_indices, b)
    kv_lengths = checks.as_array(kv_lengths, "kv_lengths")
    if not jnp.issubdtype(kv_lengths.dtype, jnp.integer) or kv_lengths.shape != (b,):
        raise ValueError(f"kv_lengths must be an int32 array of shape (B,) = ({b},), got "
                         f"{kv_lengths.dtype} {kv_lengths.shape}")
    return _write(k_pages, v_pages, page_indices, kv_lengths.astype(jnp.int32),
                  k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype), layout)


@functools.partial(jax.jit, static_argnums=(6,))
def _write(k_pages, v_pages, page_indices, kv_lengths, k_new, v_new, kv_layout):
    shape = PagedShape.of(k_pages.shape, kv_layout)
    b, hk, lnew = k_new.shape[:3]
    pps = page_indices.shape[1]
    pos = kv_lengths[:, None] + jnp.arange(lnew, dtype=jnp.int32)[None]  # [B, Lnew]
    logical = pos // shape.page_size
    slot = pos % shape.page_size
    inside = (pos >= 0) & (logical < pps)
    page = jnp.take_along_axis(page_indices, jnp.clip(logical, 0, max(pps - 1, 0)), axis=1)
    valid = inside & (page >= 0) & (page < shape.num_pages)
    page = jnp.where(valid, page, shape.num_pages)  # out of range: dropped by the scatter
    heads = jnp.arange(hk)[None, :, None]
    page, slot = page[:, None, :], slot[:, None, :]  # broadcast to [B, Hk, Lnew]
    index = (page, heads, slot) if kv_layout == 0 else (page, slot, heads)
    return (k_pages.at[index].set(k_new, mode="drop"),
            v_pages.at[index].set(v_new, mode="drop"))


# ---------------------------------------------------------------------------
# the primitive

sdpa_paged_fwd_p = Primitive("jax_sdpa_paged_fwd")
sdpa_paged_fwd_p.multiple_results = True


def paged_fwd(q, k_pages, v_pages, page_indices, kv_lengths, sinks, params: StaticParams,
              kv_layout: int, plan=None):
    """Binds sdpa_paged_fwd_p (sinks may be None; `plan`: the dispatch.Plan made for this
    call at trace time, None: the lowering makes it). Returns (out, lse)."""
    has_sinks = sinks is not None
    sinks = sinks if has_sinks else jnp.zeros((0,), jnp.float32)
    return tuple(sdpa_paged_fwd_p.bind(q, k_pages, v_pages, page_indices, kv_lengths, sinks,
                                       has_sinks=has_sinks, kv_layout=int(kv_layout),
                                       **dataclasses.asdict(params), plan=plan))


def _split(kw):
    """(has_sinks, kv_layout, params, carried plan) of the primitive's params."""
    kw = dict(kw)
    has_sinks, kv_layout, plan = kw.pop("has_sinks"), kw.pop("kv_layout"), kw.pop("plan", None)
    return has_sinks, kv_layout, StaticParams(**kw), plan


def paged_config(q_shape, k_pages_shape, v_pages_shape, dtype, page_indices_shape,
                 has_sinks, params: StaticParams, kv_layout: int,
                 sinks_batch: int = 1) -> Config:
    """The Config of the contiguous call a paged one stands for (Lk = pages_per_seq * S)."""
    ks = PagedShape.of(k_pages_shape, kv_layout)
    dv = PagedShape.of(v_pages_shape, kv_layout).head_dim
    b = q_shape[0]
    lk = page_indices_shape[1] * ks.page_size
    return Config.from_shapes(q_shape, (b, ks.heads_kv, lk, ks.head_dim),
                              (b, ks.heads_kv, lk, dv), dtype, None, None, has_sinks, False,
                              True, params, sinks_batch=sinks_batch)


def _abstract(q, k_pages, v_pages, page_indices, kv_lengths, sinks, **kw):
    dv = PagedShape.of(v_pages.shape, kw["kv_layout"]).head_dim
    return (q.update(shape=q.shape[:3] + (dv,), dtype=q.dtype),
            q.update(shape=q.shape[:3], dtype=np.dtype(np.float32)))


def reference_paged(q, k_pages, v_pages, page_indices, kv_lengths, sinks, *, params,
                    kv_layout, chunked=False, probs_dtype=None):
    """The pure-JAX paged forward: the pages gathered into a contiguous [B, Hk, Lk, D] cache
    (keys of out-of-range pages zeroed and hidden by a key mask), then the reference."""
    shape = PagedShape.of(k_pages.shape, kv_layout)
    valid = (page_indices >= 0) & (page_indices < shape.num_pages)  # [B, pps]
    safe = jnp.where(valid, page_indices, 0)

    def gather(pages):
        g = jnp.take(pages, safe, axis=0)  # [B, pps, Hk, S, D] or [B, pps, S, Hk, D]
        if kv_layout == 1:
            g = jnp.swapaxes(g, 2, 3)
        g = jnp.where(valid[:, :, None, None, None], g, jnp.zeros((), g.dtype))
        g = jnp.moveaxis(g, 1, 2)  # [B, Hk, pps, S, D]
        return g.reshape(g.shape[:2] + (-1, g.shape[-1]))

    k, v = gather(k_pages), gather(v_pages)
    key_mask = jnp.repeat(valid, shape.page_size, axis=1)[:, None, None, :]  # [B,1,1,Lk]
    fn = reference.chunked_forward if chunked else reference.exact_forward
    return fn(q, k, v, key_mask, sinks, None, kv_lengths, None, None, params,
              probs_dtype=probs_dtype)


def _lower(platform):
    def rule(ctx, *args, **kw):
        has_sinks, kv_layout, params, carried = _split(kw)
        if sharding.needs_partitioning(ctx):
            return sharding.lower_paged_partitioned(ctx, sdpa_paged_fwd_p, args, kw)
        q, k_pages, v_pages, page_indices, _, sinks = ctx.avals_in
        cfg = paged_config(q.shape, k_pages.shape, v_pages.shape, q.dtype, page_indices.shape,
                           has_sinks, params, kv_layout,
                           sinks.shape[0] if has_sinks else 1)
        plan = dispatch.paged_lowering_plan(cfg, platform or primitives.platform_of(ctx),
                                            carried)
        if plan.target is None:
            chunked = plan.implementation == "xla_chunked"

            def fn(q, kp, vp, idx, kvl, s):
                return reference_paged(q, kp, vp, idx, kvl, s if has_sinks else None,
                                       params=params, kv_layout=kv_layout, chunked=chunked,
                                       probs_dtype=plan.probs_dtype)

            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        attrs = paged_ffi_attrs(params, has_sinks, kv_layout)
        if plan.workspace_bytes:
            return primitives.lower_with_workspace(ctx, plan.target, args, attrs,
                                                   plan.workspace_bytes)
        return jax.ffi.ffi_lowering(plan.target)(ctx, *args, **attrs)

    return rule


def paged_ffi_attrs(params: StaticParams, has_sinks: bool, kv_layout: int) -> dict:
    """The attributes of a paged target (docs/ffi_contract.md): the contract's struct with
    no mask, q lengths or segment ids, kv lengths present, bottom-right, head-major q."""
    flags = dict(has_mask=False, has_sinks=bool(has_sinks), has_q_lengths=False,
                 has_kv_lengths=True, has_segment_ids=False)
    attrs = primitives.ffi_attrs(dataclasses.replace(params, bottom_right=True,
                                                      seq_major=False), flags)
    attrs["kv_layout"] = np.int64(kv_layout)
    return attrs


def paged_ffi_call_args(*, scale, window_left=-1, window_right=-1, sinks=None,
                        fp32_precision=0, logits_soft_cap=0.0, kv_layout="PHSD"):
    """(sinks operand, attributes) of a direct `jax.ffi.ffi_call` of a paged target:
    call(q, k_pages, v_pages, page_indices, kv_lengths, sinks_operand, **attrs). For tests
    and benchmarks that call a handler without the primitive."""
    params = StaticParams(scale=float(scale), window_left=int(window_left),
                          window_right=int(window_right), bottom_right=True,
                          fp32_precision=int(fp32_precision),
                          logits_soft_cap=float(logits_soft_cap))
    operand = jnp.zeros((0,), jnp.float32) if sinks is None else sinks
    return operand, paged_ffi_attrs(params, sinks is not None, _check_kv_layout(kv_layout))


def _impl(*args, **kw):
    return primitives.mlir_free_call(sdpa_paged_fwd_p, args, kw)


def _no_gradient(primals, tangents, **kw):
    raise NotImplementedError(
        "jax_sdpa.paged_attention is forward only (inference): it has no gradient. To "
        "differentiate, gather the cache and call jax_sdpa.scaled_dot_product_attention "
        "with key_value_seq_lengths.")


def _batch(args, dims, **kw):
    """vmap: q, page_indices, kv_lengths (and per-call sinks) fold into the batch; a vmapped
    page pool is folded into one pool of size * num_pages pages, each call's page indices
    offset into its own (out-of-range ones stay out of range)."""
    has_sinks, kv_layout, *_ = _split(kw)
    q, k_pages, v_pages, page_indices, kv_lengths, sinks = args
    qd, kd, vd, idxd, lend, sd = dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batch = int(q.shape[0] if qd is None else np.delete(np.array(q.shape), qd)[0])
    q = primitives._fold(q, qd, size, batch)
    page_indices = primitives._fold(page_indices, idxd, size, batch)
    kv_lengths = primitives._fold(kv_lengths, lend, size, batch)
    if kd is not None or vd is not None:
        k_pages = _move_or_broadcast(k_pages, kd, size)
        v_pages = _move_or_broadcast(v_pages, vd, size)
        num_pages = k_pages.shape[1]
        offset = jnp.repeat(jnp.arange(size, dtype=jnp.int32) * num_pages, batch)[:, None]
        valid = (page_indices >= 0) & (page_indices < num_pages)
        page_indices = jnp.where(valid, page_indices + offset, -1)
        k_pages = k_pages.reshape((size * num_pages,) + k_pages.shape[2:])
        v_pages = v_pages.reshape((size * num_pages,) + v_pages.shape[2:])
    if has_sinks:
        sinks = primitives._fold_broadcastable(sinks, sd, size, batch)
    out, lse = sdpa_paged_fwd_p.bind(q, k_pages, v_pages, page_indices, kv_lengths, sinks,
                                     **kw)
    return ([out.reshape((size, batch) + out.shape[1:]),
             lse.reshape((size, batch) + lse.shape[1:])], [0, 0])


def _move_or_broadcast(x, bdim, size):
    if bdim is None:
        return jnp.broadcast_to(x[None], (size,) + x.shape)
    return jnp.moveaxis(x, bdim, 0)


sdpa_paged_fwd_p.def_abstract_eval(_abstract)
sdpa_paged_fwd_p.def_impl(_impl)
ad.primitive_jvps[sdpa_paged_fwd_p] = _no_gradient
batching.primitive_batchers[sdpa_paged_fwd_p] = _batch
mlir.register_lowering(sdpa_paged_fwd_p, _lower(None))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(sdpa_paged_fwd_p, _lower(_platform), platform=_platform)
sharding.register_primitives(sdpa_paged_fwd_p)
