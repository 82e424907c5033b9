"""Multi-device checks for tests/test_sharding.py, run in a subprocess:

    python tests/sharding_checks.py {partition|ring} {xla|cpu}

JAX must see 8 CPU devices, which has to be set before it initializes, and pytest's
process has initialized it long before; so the test runs this script with XLA_FLAGS set.
Prints one line per check: `CHECK <name> ok|FAIL <detail>`.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import oracle  # noqa: E402
from jax_sdpa import ring as ring_mod  # noqa: E402

IMPL = "xla"
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all",
               "reduce-scatter")
_rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


def normal(*shape):
    return jnp.asarray(_rng.standard_normal(shape), jnp.float32)


def mesh(shape, names):
    return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


def collectives(compiled_text):
    return sorted(set(re.findall("|".join(COLLECTIVES), compiled_text)))


# Two float32 runs of one call: the tolerance policy's named case for them.
TOL = oracle.tolerance("float32", case="fp32_agreement")


def close(got, want, what, tol=TOL):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        err = oracle.max_rel_error(g, w)
        if not np.isfinite(np.asarray(g, np.float64)).all() or err > tol:
            raise AssertionError(f"{what}[{i}]: max error {err:.3g} > {tol}")


def value_and_grads(f, argnums):
    """(out, grads) of a scalar loss that weights every output element differently."""
    def loss(*a):
        out = f(*a)
        return jnp.sum(jnp.sin(out.astype(jnp.float32) * 1.7)), out

    def run(*a):
        (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*a)
        return out, grads

    return run


def check_partitioned(f, args, shardings, argnums, *, allowed_fwd=(), allowed_grad=(),
                      kernel_shape=None):
    """f under jit on sharded args equals the unsharded call, forward and grads, and the
    compiled programs contain only the allowed collectives."""
    want = jax.jit(value_and_grads(f, argnums))(*args)
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    lowered = jax.jit(f).lower(*placed)
    assert "CustomSPMDPartitioning" in lowered.as_text(), "the primitive was not partitioned"
    fwd = lowered.compile()  # compiled once: run it and read its HLO
    close(fwd(*placed), want[0], "out")
    text = fwd.as_text()
    bad = [c for c in collectives(text) if c not in allowed_fwd]
    assert not bad, f"forward has {bad}"
    fused = IMPL not in ("xla", "xla_chunked")
    if kernel_shape is not None and fused:
        calls = [ln for ln in text.splitlines() if f"jax_sdpa_{IMPL}_fwd" in ln]
        assert calls and all(kernel_shape in ln for ln in calls), \
            f"kernel not called per shard ({kernel_shape}): {calls[:1]}"
    grad = jax.jit(value_and_grads(f, argnums)).lower(*placed).compile()
    close(grad(*placed), want, "grads")
    text = grad.as_text()
    bad = [c for c in collectives(text) if c not in allowed_grad]
    assert not bad, f"grad has {bad}"
    if kernel_shape is not None and fused:
        assert f"jax_sdpa_{IMPL}_bwd" in text, "backward kernel not in the program"


# ---------------------------------------------------------------------------
# partitioning of the primitives

def sdpa(**kw):
    return lambda q, k, v, *rest: jax_sdpa.scaled_dot_product_attention(
        q, k, v, implementation=IMPL, **kw)


def p_gqa_batch_heads():
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(4, 8, 16, 8), normal(4, 4, 16, 8), normal(4, 4, 16, 8)
    s = NamedSharding(m, P("b", "h"))
    check_partitioned(sdpa(mask="causal"), (q, k, v), (s, s, s), (0, 1, 2),
                      kernel_shape="f32[2,2,16,8]")


def p_batch_mask_sinks_lengths():
    m = mesh((8,), ("b",))
    q, k, v = normal(8, 2, 12, 8), normal(8, 2, 20, 8), normal(8, 2, 20, 4)
    mask = normal(8, 1, 12, 20)
    sinks = normal(2)
    lengths = jnp.asarray(_rng.integers(1, 21, 8), jnp.int32)

    def f(q, k, v, mask, sinks, lengths):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=sinks, key_value_seq_lengths=lengths,
            implementation=IMPL)

    sb, rep = NamedSharding(m, P("b")), NamedSharding(m, P())
    check_partitioned(f, (q, k, v, mask, sinks, lengths), (sb, sb, sb, sb, rep, sb),
                      (0, 1, 2, 3, 4), kernel_shape="f32[1,2,12,8]",
                      # the sinks gradient sums over the batch shards
                      allowed_grad=("all-reduce",))


def _segments_impl():
    """IMPL where it serves segment ids and soft-capping both ways, else xla (the checks
    below then test the partitioning of the reference)."""
    from jax_sdpa import _ext

    if IMPL in ("xla", "xla_chunked"):
        return IMPL
    features = {"segment_ids", "logits_soft_cap"}
    served = all(features <= _ext.served_features(f"jax_sdpa_{IMPL}_{d}")
                 for d in ("fwd", "bwd"))
    return IMPL if served else "xla"


def sorted_ids(b, length, segments=4):
    return jnp.asarray(np.sort(_rng.integers(0, segments, (b, length)), axis=1), jnp.int32)


def p_batch_heads_segments_soft_cap():
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(4, 8, 16, 8), normal(4, 4, 16, 8), normal(4, 4, 16, 8)
    ids = sorted_ids(4, 16)
    impl = _segments_impl()

    def f(q, k, v, ids):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask="causal", q_segment_ids=ids, logits_soft_cap=3.0,
            implementation=impl)

    s = NamedSharding(m, P("b", "h"))
    check_partitioned(f, (q, k, v, ids), (s, s, s, NamedSharding(m, P("b"))), (0, 1, 2),
                      kernel_shape="f32[2,2,16,8]")


def dispatch_paged_target(name):
    from jax_sdpa import dispatch

    return dispatch.paged_target(name)


def p_paged_kv_heads_and_batch():
    """paged_attention under jit with q and the page pool split over kv heads (and q's
    batch over a second axis): equal to the unsharded call, no all-gather, the kernel per
    shard where a paged target serves it."""
    m = mesh((2, 4), ("b", "h"))
    b, hq, hk, d, s, pps, num_pages = 4, 8, 4, 8, 8, 3, 14
    for layout, pool_spec in (("PHSD", P(None, "h")), ("PSHD", P(None, None, "h"))):
        shape = (num_pages, hk, s, d) if layout == "PHSD" else (num_pages, s, hk, d)
        q, kp, vp = normal(b, hq, 2, d), normal(*shape), normal(*shape)
        idx = jnp.asarray(_rng.permutation(num_pages)[:b * pps].reshape(b, pps), jnp.int32)
        lengths = jnp.asarray(_rng.integers(1, pps * s + 1, b), jnp.int32)
        sinks = normal(hq)

        def f(q, kp, vp, idx, lengths, sinks):
            return jax_sdpa.paged_attention(q, kp, vp, idx, lengths, mask="causal",
                                            sinks=sinks, kv_layout=layout)

        want = jax.jit(f)(q, kp, vp, idx, lengths, sinks)
        shardings = (NamedSharding(m, P("b", "h")), NamedSharding(m, pool_spec),
                     NamedSharding(m, pool_spec), NamedSharding(m, P("b")),
                     NamedSharding(m, P("b")), NamedSharding(m, P("h")))
        placed = [jax.device_put(a, sh) for a, sh in
                  zip((q, kp, vp, idx, lengths, sinks), shardings)]
        lowered = jax.jit(f).lower(*placed)
        assert "CustomSPMDPartitioning" in lowered.as_text(), "the primitive was not partitioned"
        compiled = lowered.compile()
        close(compiled(*placed), want, f"paged {layout}")
        bad = collectives(compiled.as_text())
        assert not bad, f"paged {layout} has {bad}"
        if IMPL not in ("xla", "xla_chunked") and \
                dispatch_paged_target(IMPL) in jax_sdpa._ext.ffi_targets():
            calls = [ln for ln in compiled.as_text().splitlines()
                     if dispatch_paged_target(IMPL) in ln]
            assert calls and all("f32[2,2,2,8]" in ln for ln in calls), calls[:1]


def p_heads_full_mask_sinks_qlengths():
    # a per-head bool mask and the sinks are split with the query heads
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 8, 12, 8), normal(2, 4, 12, 8), normal(2, 4, 12, 8)
    mask = jnp.asarray(_rng.random((2, 8, 12, 12)) < 0.7)
    sinks = normal(8)
    lengths = jnp.asarray([12, 7], jnp.int32)

    def f(q, k, v, mask, sinks, lengths):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=sinks, query_seq_lengths=lengths,
            implementation=IMPL)

    s = NamedSharding(m, P("b", "h"))
    check_partitioned(f, (q, k, v, mask, sinks, lengths),
                      (s, s, s, s, NamedSharding(m, P("h")), NamedSharding(m, P("b"))),
                      (0, 1, 2, 4), kernel_shape="f32[1,2,12,8]",
                      allowed_grad=("all-reduce",))  # the sinks gradient sums over b


def p_explicit_mesh():
    if not hasattr(jax, "set_mesh") or not hasattr(jax.sharding, "AxisType"):
        return  # an older jax: no explicit sharding mode
    explicit = jax.sharding.AxisType.Explicit
    m = jax.make_mesh((2, 4), ("b", "h"), axis_types=(explicit, explicit),
                      devices=jax.devices()[:8])
    q, k, v = normal(2, 8, 16, 8), normal(2, 4, 16, 8), normal(2, 4, 16, 8)
    s = NamedSharding(m, P("b", "h"))
    with jax.set_mesh(m):
        check_partitioned(sdpa(mask="causal"), (q, k, v), (s, s, s), (0, 1, 2),
                          kernel_shape="f32[1,2,16,8]")


def p_scan_checkpoint():
    # the primitive inside a rematerialized scan body (a layer stack) is partitioned too
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 8, 16, 8), normal(2, 4, 16, 8), normal(2, 4, 16, 8)
    att = sdpa(mask="causal")

    def f(q, k, v):
        def layer(x, _):
            return jax.checkpoint(att)(x, k, v) + x, None
        return jax.lax.scan(layer, q, None, length=2)[0]

    s = NamedSharding(m, P("b", "h"))
    check_partitioned(f, (q, k, v), (s, s, s), (0, 1, 2), kernel_shape="f32[1,2,16,8]")


def p_seq_major_jax_nn():
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 16, 8, 8), normal(2, 16, 4, 8), normal(2, 16, 4, 8)

    def f(q, k, v):
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation=IMPL)

    s = NamedSharding(m, P("b", None, "h"))
    check_partitioned(f, (q, k, v), (s, s, s), (0, 1, 2), kernel_shape="f32[1,16,2,8]")


def p_mqa_heads():
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 8, 16, 8), normal(2, 1, 16, 8), normal(2, 1, 16, 8)
    sq, skv = NamedSharding(m, P("b", "h")), NamedSharding(m, P("b"))
    # dk/dv of a kv head shared by the head shards are summed: one all-reduce
    check_partitioned(sdpa(mask="causal"), (q, k, v), (sq, skv, skv), (0, 1, 2),
                      allowed_grad=("all-reduce",), kernel_shape="f32[1,2,16,8]")


def _resharded(spec_dims, shape_q, shape_kv):
    m = mesh((8,), ("x",))
    q, k, v = normal(*shape_q), normal(*shape_kv), normal(*shape_kv)
    s = NamedSharding(m, P(*spec_dims))
    anything = COLLECTIVES  # correctness only: XLA reshards to a supported layout
    check_partitioned(sdpa(mask="causal"), (q, k, v), (s, s, s), (0, 1, 2),
                      allowed_fwd=anything, allowed_grad=anything)


def p_sequence_sharded_to_heads():
    # the devices splitting the sequence get heads (all-to-all), not a replicated call
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 8, 16, 8), normal(2, 4, 16, 8), normal(2, 4, 16, 8)
    s = NamedSharding(m, P("b", None, "h"))
    moves = ("all-to-all", "collective-permute")
    check_partitioned(sdpa(mask="causal"), (q, k, v), (s, s, s), (0, 1, 2),
                      allowed_fwd=moves, allowed_grad=moves, kernel_shape="f32[1,2,16,8]")


def p_sequence_sharded():
    _resharded((None, None, "x"), (2, 4, 32, 8), (2, 2, 32, 8))


def p_head_dim_sharded():
    _resharded((None, None, None, "x"), (2, 4, 16, 16), (2, 2, 16, 16))


def p_more_head_shards_than_kv_heads():
    # 4 head shards, 2 kv heads: each kv head split over the 2 shards that use it. k/v
    # are replicated over "h" here, so their gradients must end up replicated too:
    # dk/dv are summed over each pair (all-reduce) and gathered over the pairs
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 8, 16, 8), normal(2, 2, 16, 8), normal(2, 2, 16, 8)
    s, skv = NamedSharding(m, P("b", "h")), NamedSharding(m, P("b"))
    check_partitioned(sdpa(mask="causal"), (q, k, v), (s, skv, skv), (0, 1, 2),
                      allowed_grad=("all-reduce", "all-gather"),
                      kernel_shape="f32[1,2,16,8]")


def p_indivisible_heads():
    # 3 kv heads over 4 head shards: no consistent split, heads are gathered (correct)
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 12, 16, 8), normal(2, 3, 16, 8), normal(2, 3, 16, 8)
    s, skv = NamedSharding(m, P("b", "h")), NamedSharding(m, P("b"))
    check_partitioned(sdpa(mask="causal"), (q, k, v), (s, skv, skv), (0, 1, 2),
                      allowed_fwd=COLLECTIVES, allowed_grad=COLLECTIVES)


def p_gspmd_partitioner():
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        p_gqa_batch_heads()
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def p_vmap_under_jit():
    m = mesh((2, 4), ("b", "h"))
    q, k, v = normal(2, 4, 4, 16, 8), normal(2, 4, 4, 16, 8), normal(2, 4, 4, 16, 8)
    f = jax.vmap(sdpa(mask="causal"))
    s = NamedSharding(m, P(None, "b", "h"))
    check_partitioned(f, (q, k, v), (s, s, s), (0, 1, 2), allowed_fwd=COLLECTIVES,
                      allowed_grad=COLLECTIVES)


PARTITION = [p_gqa_batch_heads, p_batch_mask_sinks_lengths, p_heads_full_mask_sinks_qlengths,
             p_explicit_mesh, p_scan_checkpoint, p_seq_major_jax_nn, p_mqa_heads,
             p_sequence_sharded_to_heads, p_sequence_sharded, p_head_dim_sharded,
             p_more_head_shards_than_kv_heads, p_indivisible_heads, p_gspmd_partitioner,
             p_vmap_under_jit, p_batch_heads_segments_soft_cap, p_paged_kv_heads_and_batch]


# ---------------------------------------------------------------------------
# ring attention

def check_ring(n, shape_q, shape_kv, *, mask, layout, sinks=False, batch_axis=None,
               check_vma=True, auto_batch=False, segments=False, soft_cap=None):
    names = ("sp",) if batch_axis is None else ("dp", "sp")
    m = mesh((n,) if batch_axis is None else (batch_axis, n), names)
    q, k, v = normal(*shape_q), normal(*shape_kv), normal(*shape_kv)
    s = normal(shape_q[1]) if sinks else None
    spec = P(None if batch_axis is None else "dp", None, "sp")
    ids_spec = P(None if batch_axis is None else "dp", "sp")
    impl = _segments_impl() if segments or soft_cap else IMPL
    ids = ((sorted_ids(shape_q[0], shape_q[2], 5), sorted_ids(shape_kv[0], shape_kv[2], 5))
           if segments else (None, None))

    def full(q, k, v, s):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask=mask, sinks=s, q_segment_ids=ids[0], kv_segment_ids=ids[1],
            logits_soft_cap=soft_cap, implementation=impl)

    def local(q, k, v, s, q_ids, kv_ids):
        return jax_sdpa.ring_attention(q, k, v, axis_name="sp", mask=mask, sinks=s,
                                       layout=layout, q_segment_ids=q_ids,
                                       kv_segment_ids=kv_ids, logits_soft_cap=soft_cap,
                                       implementation=impl)

    zig = layout == "zigzag"
    perm = (lambda x, axis=2: ring_mod.to_zigzag(x, n, axis)) if zig else (lambda x, axis=2: x)
    unperm = (lambda x: ring_mod.from_zigzag(x, n)) if zig else (lambda x: x)
    kw = {}
    if auto_batch:  # only "sp" manual: the batch stays split over the automatic "dp"
        kw["axis_names"] = {"sp"}
        spec = P(None, None, "sp")
        ids_spec = P(None, "sp")
    sm = jax.shard_map(local, mesh=m,
                       in_specs=(spec, spec, spec, P(), ids_spec if segments else P(),
                                 ids_spec if segments else P()),
                       out_specs=spec, check_vma=check_vma, **kw)

    def ringed(q, k, v, s):
        if auto_batch:
            dp = NamedSharding(m, P("dp", None, "sp"))
            q, k, v = (jax.lax.with_sharding_constraint(x, dp) for x in (q, k, v))
        q_ids, kv_ids = (None, None) if not segments else (perm(ids[0], 1), perm(ids[1], 1))
        return unperm(sm(perm(q), perm(k), perm(v), s, q_ids, kv_ids))

    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    want = jax.jit(value_and_grads(full, argnums))(q, k, v, s)
    step = jax.jit(value_and_grads(ringed, argnums)).lower(q, k, v, s).compile()
    close(step(q, k, v, s), want, "ring (out, grads)")
    text = step.as_text()
    assert "collective-permute" in text, "no ring passing in the program"
    if auto_batch:
        assert "all-gather" not in text, "the automatic batch axis was gathered"
    if impl not in ("xla", "xla_chunked"):
        assert f"jax_sdpa_{IMPL}_fwd" in text and f"jax_sdpa_{IMPL}_bwd" in text, \
            "the ring steps do not run the fused kernel"


def r_causal_contiguous_gqa_sinks():
    check_ring(4, (2, 4, 32, 8), (2, 2, 32, 8), mask="causal", layout=None, sinks=True)


def r_causal_zigzag():
    check_ring(4, (1, 2, 32, 8), (1, 2, 32, 8), mask="causal", layout="zigzag")


def r_noncausal_cross_lengths():
    check_ring(4, (2, 2, 16, 8), (2, 1, 32, 8), mask=None, layout=None)


def r_zigzag_with_batch_axis_no_vma():
    check_ring(4, (2, 2, 16, 8), (2, 2, 16, 8), mask="causal", layout="zigzag",
               sinks=True, batch_axis=2, check_vma=False)


def r_partially_manual_shard_map():
    check_ring(4, (2, 2, 16, 8), (2, 2, 16, 8), mask="causal", layout=None,
               batch_axis=2, auto_batch=True)


def r_causal_contiguous_segments_soft_cap():
    check_ring(4, (2, 4, 32, 8), (2, 2, 32, 8), mask="causal", layout=None, sinks=True,
               segments=True, soft_cap=2.5)


def r_causal_zigzag_segments():
    check_ring(4, (1, 2, 32, 8), (1, 2, 32, 8), mask="causal", layout="zigzag",
               segments=True)


def r_noncausal_cross_segments_batch_axis():
    check_ring(4, (2, 2, 16, 8), (2, 1, 32, 8), mask=None, layout=None, segments=True,
               batch_axis=2)


def r_zigzag_helpers_roundtrip():
    x = normal(1, 1, 24, 2)
    z = ring_mod.to_zigzag(x, 3)
    np.testing.assert_array_equal(ring_mod.from_zigzag(z, 3), x)
    chunks = np.asarray(z).reshape(6, 4, 2)  # device i: chunks i and 2n-1-i
    order = ring_mod.zigzag_order(3)
    np.testing.assert_array_equal(order, [0, 5, 1, 4, 2, 3])
    np.testing.assert_array_equal(chunks[1], np.asarray(x).reshape(6, 4, 2)[5])


RING = [r_causal_contiguous_gqa_sinks, r_causal_zigzag, r_noncausal_cross_lengths,
        r_zigzag_with_batch_axis_no_vma, r_partially_manual_shard_map,
        r_zigzag_helpers_roundtrip, r_causal_contiguous_segments_soft_cap,
        r_causal_zigzag_segments, r_noncausal_cross_segments_batch_axis]


def main():
    global IMPL
    group, IMPL = sys.argv[1], sys.argv[2]
    assert len(jax.devices()) >= 8, jax.devices()
    checks = {"partition": PARTITION, "ring": RING, "all": PARTITION + RING}[group]
    only = sys.argv[3:]
    for check in checks:
        if only and check.__name__ not in only:
            continue
        start = time.time()
        try:
            check()
            print(f"CHECK {check.__name__} ok {time.time() - start:.1f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - report every check
            detail = f"{type(e).__name__}: {e}".replace("\n", " | ")[:2000]
            print(f"CHECK {check.__name__} FAIL {detail}", flush=True)
            traceback.print_exc(file=sys.stderr)


if __name__ == "__main__":
    main()
