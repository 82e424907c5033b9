"""SPMD partitioning of the attention primitives (batch and head sharding).

Under `jax.jit` over several devices, XLA knows nothing about our primitives: a bare
FFI custom call (or the reference lowering's reshapes) gets replicated, i.e. every
operand is all-gathered. `primitives._lower` therefore hands a multi-device lowering (and
the primitive itself: this module imports none of ours) to `lower_partitioned`, which wraps
the same primitive in
`jax.experimental.custom_partitioning`:

- a Shardy `sharding_rule` (einsum-like, GQA heads as `(k g)`) drives propagation, with
  the sequence and head-dim factors marked need-replication; GSPMD gets the equivalent
  `infer_sharding_from_operands` callback;
- the `partition` callback picks the supported layout from the operands' shardings:
  the batch split like q's batch dim; the heads split like q's head dim when the kv
  heads can follow consistently (query heads are contiguous groups per kv head):
  `Hk % n == 0` (each shard holds whole kv heads) or `n % Hk == 0` (more head shards
  than kv heads, MQA included: each kv head is split over the n/Hk shards whose query
  heads use it, and their dk/dv are psum'd). Devices that split the sequence or the
  head dim are given heads instead (XLA reshards with an all-to-all, as in Ulysses
  sequence parallelism) or else batch; only when neither divides is the call
  replicated over them (an all-gather before it): slower, never wrong;
- per shard, the primitive is bound again on the local shapes (a fully manual context),
  so the platform lowering chooses the kernel (FFI or the pure-JAX reference) for the
  shard's shapes.

Inside `shard_map` the primitive sees per-shard shapes over the manual axes; axes left
automatic (`axis_names=`) are partitioned the same way, except that splits needing a
psum (more head shards than kv heads) are not used there. Programs lowered without a
device assignment fall back to the plain lowering (correct, replicated).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:  # private, but the only way to know what kind of program we are lowering
    from jax._src.sharding_impls import ShardingContext, SPMDAxisContext
except ImportError:  # pragma: no cover - a future jax moved them: never partition
    ShardingContext = SPMDAxisContext = ()

_NO_MESH = jax.sharding.AbstractMesh((), ())


def register_primitives(*prims):
    """Make jit pass the device assignment when lowering programs that use `prims`
    (custom_partitioning needs it; jax's own cuDNN attention does the same)."""
    try:
        from jax._src import dispatch as jax_dispatch
        jax_dispatch.prim_requires_devices_during_lowering.update(prims)
    except (ImportError, AttributeError):  # pragma: no cover - then we never partition
        pass


def needs_partitioning(ctx) -> bool:
    """True when lowering for an automatically partitioned multi-device program."""
    ac = ctx.module_context.axis_context
    if ShardingContext and isinstance(ac, ShardingContext):
        return ac.num_devices > 1 and ac.device_assignment is not None
    if SPMDAxisContext and isinstance(ac, SPMDAxisContext):
        # shard_map: fully manual means per-shard shapes already; axes left automatic
        # (axis_names=...) are partitioned like a jit's
        mesh = ac.mesh
        return any(mesh.shape[a] > 1 for a in mesh.axis_names if a not in ac.manual_axes)
    return False  # pmap, single device


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static shapes of one primitive call (operand positions per docs/ffi_contract.md)."""

    direction: str  # "fwd" | "bwd"
    seq_major: bool
    batch: int
    heads_q: int
    heads_kv: int
    shapes: tuple  # every operand's shape

    @property
    def n_fixed(self):
        return 3 if self.direction == "fwd" else 6

    @property
    def head_axis(self):
        return 2 if self.seq_major else 1

    @staticmethod
    def from_avals(direction, avals, seq_major):
        q, k = avals[0].shape, avals[1].shape
        h = 2 if seq_major else 1
        return _Layout(direction, bool(seq_major), int(q[0]), int(q[h]), int(k[h]),
                       tuple(tuple(a.shape) for a in avals))


# ---------------------------------------------------------------------------
# the split: which devices split batch and heads
#
# The partition callback gets raw shardings (decode_shardings=False): under an
# Auto-mode jit without `with mesh:` there is no mesh to decode them against. So we
# read q's (else k's) tile assignment and build a mesh of our own whose axes are its
# batch tiles, its head tiles and everything else; operands and results are then
# NamedShardings on that mesh, with the sequence and head-dim tiles folded into the
# "rest" axis, i.e. replicated.

_B, _HK, _HG, _REST = "sdpa_batch", "sdpa_kv_heads", "sdpa_head_group", "sdpa_rest"
_AXES = (_B, _HK, _HG, _REST)


def _tile_devices(sharding, ndim):
    """Devices shaped [tiles of dim 0..ndim-1, replication], or None if not tiled."""
    try:
        hs = sharding._to_xla_hlo_sharding(ndim)
        devices = np.asarray(sharding._device_assignment, dtype=object)
    except Exception:  # noqa: BLE001 - an exotic sharding: treat as replicated
        return None
    if hs.is_replicated() or hs.is_maximal() or not hs.is_tiled():
        return None
    dims = list(hs.tile_assignment_dimensions())
    if len(dims) > ndim and not hs.replicate_on_last_tile_dim() and any(
            "REPLICATED" not in str(t) for t in hs.subgroup_types()):
        return None  # manual/unreduced subgroups: not ours to split
    ids = np.asarray(hs.tile_assignment_devices())
    return devices[ids].reshape(dims[:ndim] + [math.prod(dims[ndim:])])


@dataclasses.dataclass(frozen=True)
class _Split:
    mesh: Mesh  # axes (_B, _HK, _HG, _REST)
    batch_axes: tuple  # split the batch
    head_axes: tuple  # split the query heads: (_HK, _HG)
    kv_head_axes: tuple  # split the kv heads: (_HK,)
    reduce_axes: tuple  # hold the same kv head: dk/dv are partial sums over these


def _split(layout: _Layout, shardings, allow_reduce: bool = True) -> _Split:
    h = layout.head_axis
    tiles = _tile_devices(shardings[0], 4)
    if tiles is None:
        tiles = _tile_devices(shardings[1], 4)
    if tiles is None:
        devices = np.asarray(shardings[0]._device_assignment, dtype=object)
        return _Split(Mesh(devices.reshape(1, 1, 1, -1), _AXES), (), (), (), ())
    hq, hk = layout.heads_q, layout.heads_kv

    def heads_ok(n):
        # The n head shards hold contiguous query heads: each holds whole kv heads
        # (Hk % n == 0), or n/Hk consecutive shards share one kv head (n % Hk == 0).
        return n > 1 and hq % n == 0 and (hk % n == 0 or (n % hk == 0 and allow_reduce))

    other = [i for i in (1, 2, 3) if i != h]  # sequence and head dim
    tb, th = tiles.shape[0], tiles.shape[h]
    t_other = math.prod(tiles.shape[i] for i in other)
    # Devices that split the sequence (or head dim) would otherwise all compute the
    # same replicated call: give them heads instead (an all-to-all, as in Ulysses
    # sequence parallelism), else batch; only without either do they replicate.
    if t_other > 1 and heads_ok(th * t_other):
        devices = tiles.transpose([0, h] + other + [4]).reshape(tb, th * t_other, -1)
    elif t_other > 1 and layout.batch % (tb * t_other) == 0:
        devices = tiles.transpose([0] + other + [h, 4]).reshape(tb * t_other, th, -1)
    else:
        devices = tiles.transpose([0, h] + other + [4]).reshape(tb, th, -1)
    tb, th = devices.shape[:2]
    batch = (_B,) if tb > 1 and layout.batch % tb == 0 else ()
    if heads_ok(th) and hk % th == 0:
        t_kv, t_group = th, 1
    elif heads_ok(th):
        t_kv, t_group = hk, th // hk
    else:  # no consistent split: the head tiles are folded into the replicated rest
        t_kv = t_group = 1
    mesh = Mesh(devices.reshape(tb, t_kv, t_group, -1), _AXES)
    heads = tuple(a for a, t in ((_HK, t_kv), (_HG, t_group)) if t > 1)
    return _Split(mesh, batch, heads, (_HK,) if t_kv > 1 else (),
                 (_HG,) if t_group > 1 else ())


def _axes(t):
    return None if not t else (t[0] if len(t) == 1 else t)


def _specs(layout: _Layout, split: _Split):
    """(operand specs, result specs) for a split."""
    b, h, kvh = _axes(split.batch_axes), _axes(split.head_axes), _axes(split.kv_head_axes)

    def seq(bb, hh):  # a [B, H, L, D] / [B, L, H, D] tensor
        return P(bb, None, hh, None) if layout.seq_major else P(bb, hh, None, None)

    q_spec, kv_spec, lse_spec = seq(b, h), seq(b, kvh), P(b, h, None)
    specs = [q_spec, kv_spec, kv_spec]
    if layout.direction == "bwd":
        specs += [q_spec, lse_spec, q_spec]
    mask_s, sinks_s, ql_s, kvl_s, qseg_s, kvseg_s = layout.shapes[layout.n_fixed:]
    specs.append(P(None) if len(mask_s) != 4 else
                 P(b if mask_s[0] == layout.batch else None,
                   h if mask_s[1] == layout.heads_q else None, None, None))
    specs.append(P(None) if len(sinks_s) != 2 else
                 P(b if sinks_s[0] == layout.batch else None, h))
    for s in (ql_s, kvl_s):
        specs.append(P(b) if s[0] == layout.batch and s[0] > 0 else P(None))
    for s in (qseg_s, kvseg_s):  # [B, L] (the sequence stays whole on each shard)
        specs.append(P(b, None) if len(s) == 2 else P(None))
    results = [q_spec, lse_spec] if layout.direction == "fwd" else [q_spec, kv_spec, kv_spec]
    return specs, results


# ---------------------------------------------------------------------------
# the Shardy rule

def _sharding_rule(layout: _Layout):
    """Einsum-like rule and the factors that must stay replicated."""
    hq, hk = layout.heads_q, layout.heads_kv
    if hk == hq:
        qh, kh = "k", "k"
    elif hk == 1:
        qh, kh = "g", "k"
    else:
        qh, kh = "(k g)", "k"

    def seq(hh, last, length):
        dims = ["b", length, hh, last] if layout.seq_major else ["b", hh, length, last]
        return " ".join(dims)

    q, k, v = seq(qh, "d", "t"), seq(kh, "d", "s"), seq(kh, "e", "s")
    out, lse = seq(qh, "e", "t"), f"b {qh} t"
    operands = [q, k, v]
    if layout.direction == "bwd":
        operands += [out, lse, out]
    mask_s, sinks_s, ql_s, kvl_s, qseg_s, kvseg_s = layout.shapes[layout.n_fixed:]
    full = {0: layout.batch, 1: hq, 2: layout.shapes[0][1 if layout.seq_major else 2],
            3: layout.shapes[1][1 if layout.seq_major else 2]}
    if len(mask_s) == 4:
        names = ("b", qh, "t", "s")
        operands.append(" ".join(names[i] if mask_s[i] == full[i] else f"m{i}"
                                 for i in range(4)))
    else:
        operands.append("zmask")
    if len(sinks_s) == 2:
        operands.append(("b" if sinks_s[0] == layout.batch else "sb") + f" {qh}")
    else:
        operands.append("zsinks")
    operands.append("b" if ql_s[0] == layout.batch and ql_s[0] > 0 else "zql")
    operands.append("b" if kvl_s[0] == layout.batch and kvl_s[0] > 0 else "zkvl")
    operands.append("b t" if len(qseg_s) == 2 else "zqseg")
    operands.append("b s" if len(kvseg_s) == 2 else "zkvseg")
    results = [out, lse] if layout.direction == "fwd" else [q, k, v]
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    factors = {"g": hq // hk} if qh == "(k g)" else {}
    return rule, ("t", "d", "s", "e"), factors  # in order of appearance (sdy wants it)


# ---------------------------------------------------------------------------
# the wrapped call

def lower_partitioned(ctx, prim, direction, args, kw):
    """Lowering of `prim` (sdpa_fwd_p or sdpa_bwd_p, as `direction` says) as a
    custom_partitioning op (see module doc)."""
    layout = _Layout.from_avals(direction, ctx.avals_in, kw["seq_major"])
    # Inside a partially manual shard_map the callback sees only the automatic axes'
    # devices: fine for independent shards, but a psum's replica groups would be wrong,
    # so splits that need one (kv heads shared by head shards) are not used there.
    allow_reduce = not (SPMDAxisContext and isinstance(ctx.module_context.axis_context,
                                                       SPMDAxisContext))

    def body(*xs):
        return tuple(prim.bind(*xs, **kw))

    def partition(mesh, arg_shapes, result_shape):
        del mesh  # empty without `with mesh:`; ours comes from the operands
        split = _split(layout, [a.sharding for a in arg_shapes], allow_reduce)
        specs, results = _specs(layout, split)

        def per_shard(*xs):
            # Per-shard code is manual: bound with no mesh in context. Under jax.set_mesh
            # with Explicit axes, jax 0.12 would annotate its ops with the outer mesh's
            # shardings, left in the partitioned program as `Sharding` custom calls that
            # no backend runs.
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                outs = tuple(prim.bind(*xs, **kw))
            if direction == "bwd" and split.reduce_axes:
                # several head shards use the same kv head: their dk/dv are partial sums
                outs = (outs[0],) + tuple(lax.psum(o, split.reduce_axes) for o in outs[1:])
            return outs

        named = lambda ss: tuple(NamedSharding(split.mesh, s) for s in ss)  # noqa: E731
        return split.mesh, per_shard, named(results), named(specs)

    def infer(mesh, arg_shapes, result_shape):  # GSPMD (jax_use_shardy_partitioner=False)
        split = _split(layout, [a.sharding for a in arg_shapes], allow_reduce)
        return tuple(NamedSharding(split.mesh, s) for s in _specs(layout, split)[1])

    op = custom_partitioning(body)
    rule, replicated, factors = _sharding_rule(layout)
    try:
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         decode_shardings=False, sharding_rule=rule,
                         need_replication_factors=replicated, **factors)
    except TypeError:  # a jax without need_replication_factors: propagation may
        # suggest sequence shardings, which `partition` then reshards away
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         decode_shardings=False, sharding_rule=rule, **factors)
    return mlir.lower_fun(lambda *xs: op(*xs), multiple_results=True)(ctx, *args)



# ---------------------------------------------------------------------------
# the paged forward (jax_sdpa/paged.py): split over batch and kv heads

def _paged_split(q_shape, heads_kv, q_sharding):
    """(mesh with axes (_B, _HK, _REST), batch axes, head axes) from q's sharding: its batch
    tiles split the batch, its head tiles the kv heads when each shard then holds whole kv
    heads (and their pages' head slices); anything else is replicated."""
    tiles = _tile_devices(q_sharding, 4)
    if tiles is None:
        devices = np.asarray(q_sharding._device_assignment, dtype=object)
        return Mesh(devices.reshape(1, 1, -1), (_B, _HK, _REST)), (), ()
    devices = tiles.reshape(tiles.shape[0], tiles.shape[1], -1)  # sequence, head dim: rest
    tb, th = devices.shape[:2]
    batch = (_B,) if tb > 1 and q_shape[0] % tb == 0 else ()
    heads = (_HK,) if th > 1 and heads_kv % th == 0 else ()
    return Mesh(devices, (_B, _HK, _REST)), batch, heads


def lower_paged_partitioned(ctx, prim, args, kw):
    """Lowering of sdpa_paged_fwd_p as a custom_partitioning op: per shard the primitive
    runs on its batch rows and kv heads (the page pool split on its head axis, page
    indices and lengths on the batch), so the pages are never gathered."""
    q_shape, k_shape = ctx.avals_in[0].shape, ctx.avals_in[1].shape
    sinks_shape = ctx.avals_in[5].shape
    kv_layout, has_sinks = kw["kv_layout"], kw["has_sinks"]
    hq = q_shape[1]
    hk = k_shape[1] if kv_layout == 0 else k_shape[2]

    def body(*xs):
        return tuple(prim.bind(*xs, **kw))

    def specs(batch, heads):
        b, h = _axes(batch), _axes(heads)
        pages = P(None, h, None, None) if kv_layout == 0 else P(None, None, h, None)
        sinks = (P(b if sinks_shape[0] == q_shape[0] and q_shape[0] > 1 else None, h)
                 if has_sinks else P(None))
        operands = [P(b, h, None, None), pages, pages, P(b, None), P(b), sinks]
        return operands, [P(b, h, None, None), P(b, h, None)]

    def partition(mesh, arg_shapes, result_shape):
        del mesh
        m, batch, heads = _paged_split(q_shape, hk, arg_shapes[0].sharding)
        operand_specs, result_specs = specs(batch, heads)

        def per_shard(*xs):
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                return tuple(prim.bind(*xs, **kw))

        named = lambda ss: tuple(NamedSharding(m, s) for s in ss)  # noqa: E731
        return m, per_shard, named(result_specs), named(operand_specs)

    def infer(mesh, arg_shapes, result_shape):
        m, batch, heads = _paged_split(q_shape, hk, arg_shapes[0].sharding)
        return tuple(NamedSharding(m, s) for s in specs(batch, heads)[1])

    qh = "k" if hk == hq else ("g" if hk == 1 else "(k g)")
    pages = "p k s d" if kv_layout == 0 else "p s k d"
    sinks = (("b" if sinks_shape[0] == q_shape[0] else "sb") + f" {qh}" if has_sinks
             else "zsinks")
    rule = (f"b {qh} t d, {pages}, {pages.replace(' d', ' e')}, b n, b, {sinks} -> "
            f"b {qh} t e, b {qh} t")
    factors = {"g": hq // hk} if qh == "(k g)" else {}
    op = custom_partitioning(body)
    try:
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         decode_shardings=False, sharding_rule=rule,
                         need_replication_factors=("t", "d", "p", "s", "e", "n"), **factors)
    except TypeError:  # a jax without need_replication_factors
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         decode_shardings=False, sharding_rule=rule, **factors)
    return mlir.lower_fun(lambda *xs: op(*xs), multiple_results=True)(ctx, *args)
