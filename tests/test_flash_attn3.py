"""implementation="flash_attn3": FlashAttention-3 through flash-attn3-jax (jax_sdpa/flash_attn3.py).

On the CPU: what the rule serves and refuses, and where implementation=None takes it, with
the package's presence faked on a faked H200. On an H200 with flash-attn3-jax installed
(gpu): forward and gradients against the float64 oracle (jax_sdpa.oracle) on odd shapes,
causal and not, GQA, Lq < Lk bottom-right; its forward feeding cuDNN's backward and the
reverse; the shapes where flash-attn3-jax's own `flash_mha` returns NaN gradients.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_sdpa
from jax_sdpa import flash_attn3, oracle, tuning


def _cfg(dtype="bfloat16", b=2, hq=8, hk=2, lq=1024, lk=None, d=128, dv=None,
         seq_major=True, **kw):
    from jax_sdpa.config import Config, StaticParams
    lk = lq if lk is None else lk
    dt = jnp.dtype(dtype)
    shape = (lambda h, l, e: (b, l, h, e)) if seq_major else (lambda h, l, e: (b, h, l, e))
    return Config.from_shapes(shape(hq, lq, d), shape(hk, lk, d), shape(hk, lk, dv or d), dt,
                              None, None, False, False, False,
                              StaticParams(scale=0.125, seq_major=seq_major, **kw))


@pytest.fixture
def fa3_on_h200(monkeypatch, cuda_module):
    """Every backend built and flash-attn3-jax importable, cuDNN 9.19 on compute
    capability 9.0."""
    from jax_sdpa import _ext, dispatch
    monkeypatch.setattr(_ext, "has_backend", lambda name: True)
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, (9, 0)))
    monkeypatch.setattr(flash_attn3, "load_error", lambda: None)
    return dispatch


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(dtype="float32"), "float16 or bfloat16"),
    (dict(d=64), "head dim 128 only"),
    (dict(d=128, dv=64), "head dim 128 only"),
    (dict(seq_major=False), r"\[B, H, L, D\]"),
    (dict(window_left=16, window_right=0), "not a window"),
    (dict(lq=512, lk=1024, window_right=0), "bottom-right"),  # top-left causal, Lq < Lk
    (dict(lq=1024, lk=512, window_right=0, bottom_right=True), "every query row"),
    (dict(logits_soft_cap=30.0), "logits_soft_cap"),
])
def test_refusals_say_why(fa3_on_h200, kwargs, pattern):
    ok, why = fa3_on_h200.supports("flash_attn3", _cfg(**kwargs), "fwd", "cuda")
    assert not ok and re.search(pattern, why), why


def test_refuses_other_gpus_and_features(fa3_on_h200, monkeypatch):
    dispatch = fa3_on_h200
    cfg = _cfg(window_right=0)
    assert dispatch.supports("flash_attn3", cfg, "bwd", "cuda")[0]
    for extra in (dict(has_sinks=True), dict(has_kv_lengths=True),
                  dict(mask_kind="bool", mask_shape=(2, 1, 1, 1), mask_dtype=np.dtype(bool))):
        ok, why = dispatch.supports("flash_attn3", dataclasses.replace(cfg, **extra), "fwd",
                                    "cuda")
        assert not ok and "not given" in why, (extra, why)
    assert "a CUDA GPU" in dispatch.supports("flash_attn3", cfg, "fwd", "cpu")[1]
    monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (91900, (10, 0)))
    ok, why = dispatch.supports("flash_attn3", cfg, "fwd", "cuda")
    assert not ok and "sm_90" in why and "10.0" in why


def test_packed_calls_take_the_varlen_kernels(fa3_on_h200):
    """Segment ids of self-attention rows are served (checked when the call runs), None
    takes them where the row FLASH_ATTN3_PACKED says; cross-attention lengths are not."""
    from jax_sdpa import tuning
    dispatch = fa3_on_h200
    for direction in ("fwd", "bwd"):
        cfg = dataclasses.replace(_cfg(window_right=0), has_segment_ids=True)
        ok, why = dispatch.supports("flash_attn3", cfg, direction, "cuda")
        assert ok and "varlen" in why and "runs" in why, why
        want = "flash_attn3" if tuning.FLASH_ATTN3_PACKED["prefer"] else "cudnn"
        assert dispatch.plan(cfg, "cuda", direction).implementation == want
        assert dispatch.plan(cfg, "cuda", direction,
                             without=("flash_attn3",)).implementation == "cudnn"
    cross = dataclasses.replace(_cfg(lq=512, lk=1024), has_segment_ids=True)
    ok, why = dispatch.supports("flash_attn3", cross, "fwd", "cuda")
    assert not ok and "Lq = Lk" in why, why


def _runs_numpy(q_ids, kv_ids, cap):
    """sequence_runs' answer by loops: run boundaries, and whether each id is one run."""
    b, length = q_ids.shape
    cu, contiguous = [0], True
    for row in range(b):
        seen = set()
        for i in range(length):
            if i > 0 and q_ids[row, i] == q_ids[row, i - 1]:
                continue
            if i > 0:
                cu.append(row * length + i)
            contiguous &= q_ids[row, i] not in seen
            seen.add(q_ids[row, i])
        cu.append((row + 1) * length)
    runs = len(cu) - 1
    ok = contiguous and runs <= cap and bool((q_ids == kv_ids).all())
    padded = (cu + [b * length] * (cap + 1))[:cap + 1]
    return np.asarray(padded), runs, max(np.diff(cu)), ok


@pytest.mark.parametrize("case", ["sorted", "padding_last", "shuffled_runs", "interleaved",
                                  "cross", "too_many", "one_id", "ids_across_rows"])
def test_sequence_runs_against_loops(case):
    rng = np.random.default_rng()
    b, length, cap = 3, int(rng.integers(40, 300)), 24
    cuts = lambda n: np.sort(rng.choice(np.arange(1, length), n, replace=False))  # noqa: E731
    ids = np.zeros((b, length), np.int32)
    for row in range(b):
        bounds = np.concatenate([[0], cuts(int(rng.integers(1, 6))), [length]])
        for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            ids[row, lo:hi] = j + 1
    kv = ids.copy()
    if case == "padding_last":  # MaxText's convention: 0 after the last sequence
        ids[:, -7:] = 0
        kv = ids.copy()
    elif case == "shuffled_runs":  # one run per id, ids in no order
        ids = rng.permutation(50)[ids].astype(np.int32)
        kv = ids.copy()
    elif case == "interleaved":  # id 1 twice in a row: not one run
        ids[0, :4], ids[0, 4:8] = 1, 2
        ids[0, 8:12] = 1
        kv = ids.copy()
    elif case == "cross":
        kv[1, 5] += 1
    elif case == "too_many":
        ids = (np.arange(length, dtype=np.int32)[None] // 3).repeat(b, 0)
        kv = ids.copy()
    elif case == "one_id":
        ids[:] = 7
        kv = ids.copy()
    elif case == "ids_across_rows":  # the same id ends one row and starts the next
        ids[0, -5:] = 9
        ids[1, :5] = 9
        kv = ids.copy()
    cu, runs, longest, ok = jax.jit(flash_attn3.sequence_runs, static_argnums=2)(
        jnp.asarray(ids), jnp.asarray(kv), cap)
    want_cu, want_runs, want_longest, want_ok = _runs_numpy(ids, kv, cap)
    assert bool(ok) == want_ok, case
    if want_runs <= cap:
        np.testing.assert_array_equal(np.asarray(cu), want_cu)
        assert int(runs) == want_runs and int(longest) == want_longest
    assert case not in ("sorted", "padding_last", "shuffled_runs", "one_id",
                        "ids_across_rows") or want_ok, case


def test_backward_buckets_hold_every_call():
    assert flash_attn3._buckets(2, 128) == [2, 4, 8, 16, 32, 64, 128]
    assert flash_attn3._buckets(128, 1000) == [128, 256, 512, 1000]
    assert flash_attn3._buckets(77, 77) == [77]


def test_long_rows_hand_short_documents_to_the_varlen_kernels():
    """100-token documents in L8192 rows (82 runs a row) fit the cap: measured 12-15x faster
    through the varlen kernels than through cuDNN's mask (h200/packed_cap_20261207.json);
    the forward is told the cap, so L8192 rows stay within 128 a row (told 256 for B2
    cost it 3 us), and short rows keep 64."""
    b, length = 2, 8192
    cap = flash_attn3.max_sequences(b, length)
    assert cap <= b * 128
    documents = lambda tokens: jnp.asarray(np.broadcast_to(  # noqa: E731
        np.arange(length, dtype=np.int32) // tokens, (b, length)))
    runs_of = jax.jit(flash_attn3.sequence_runs, static_argnums=2)
    _, runs, longest, ok = runs_of(documents(100), documents(100), cap)
    assert bool(ok) and int(runs) == 2 * 82 and int(longest) == 100
    assert not bool(runs_of(documents(50), documents(50), cap)[3])  # 164 a row: past it
    assert flash_attn3.max_sequences(16, 512) == 16 * 64
    assert flash_attn3.max_sequences(1, 32768) == 256


@pytest.mark.parametrize("kwargs, direction, chosen", [
    (dict(window_right=0), "fwd", "flash_attn3"),
    (dict(window_right=0), "bwd", "flash_attn3"),
    (dict(lq=512, lk=2048, window_right=0, bottom_right=True), "fwd", "flash_attn3"),
    (dict(), "bwd", "flash_attn3"),
    (dict(), "fwd", "flash_attn3"),
    (dict(lq=512), "fwd", "cudnn"),  # FLASH_ATTN3_FIRST: unbanded from 1024 keys
    (dict(lq=512), "bwd", "flash_attn3"),
    (dict(lq=512, window_right=0), "fwd", "flash_attn3"),
    (dict(seq_major=False, window_right=0), "fwd", "cudnn"),
    (dict(d=64, window_right=0), "bwd", "cudnn"),
    (dict(lq=1, lk=8192, b=8, hq=32, hk=8), "fwd", "cuda"),  # decode: the decode rows
])
def test_none_takes_it_where_the_table_says(fa3_on_h200, kwargs, direction, chosen):
    dispatch = fa3_on_h200
    cfg = _cfg(**kwargs)
    plan = dispatch.plan(cfg, "cuda", direction)
    assert plan.implementation == chosen, (plan, dispatch.explain_choice(cfg, "cuda", direction))
    if chosen == "flash_attn3":
        assert plan.target == ("flash_mha_fwd" if direction == "fwd" else "flash_mha_bwd")
        assert plan.workspace_bytes == 0
        assert dispatch.ffi_target("flash_attn3", direction) == plan.target


def test_absent_package_is_a_clear_refusal():
    """Here (no flash-attn3-jax on the CI machine, or no GPU): named, it raises with the
    reason; explain lists it; None never picks it."""
    from jax_sdpa import dispatch
    x = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    e = jax_sdpa.explain(x, x, x, mask="causal")
    assert "flash_attn3" in e.verdicts and e.chosen != "flash_attn3"
    if flash_attn3.load_error() is not None:
        assert flash_attn3.INSTALL in flash_attn3.load_error()
        assert not dispatch.installed("flash_attn3")
    if not _fa3_runs_here():
        with pytest.raises(NotImplementedError, match="flash_attn3"):
            jax.eval_shape(lambda q: jax_sdpa.dot_product_attention(
                q, q, q, implementation="flash_attn3"), x)


def test_the_extra_pins_the_checked_version():
    import tomllib
    from pathlib import Path
    pyproject = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    (pin,) = pyproject["project"]["optional-dependencies"]["flash-attn3"]
    assert pin.startswith(f"flash-attn3-jax=={flash_attn3.VERSION};"), pin


# ---------------------------------------------------------------------------
# on the H200

def _fa3_runs_here():
    try:
        if jax.default_backend() != "gpu" or not flash_attn3.installed():
            return False
        cc = jax.devices("gpu")[0].compute_capability
        return tuple(int(x) for x in str(cc).split(".")) == flash_attn3.COMPUTE_CAPABILITY
    except Exception:  # noqa: BLE001
        return False


needs_fa3 = pytest.mark.skipif(not _fa3_runs_here(),
                               reason="needs flash-attn3-jax on an sm_90 GPU")

DT = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _inputs(rng, b, lq, lk, hq, hk, dtype, d=128):
    shapes = dict(q=(b, lq, hq, d), k=(b, lk, hk, d), v=(b, lk, hk, d), do=(b, lq, hq, d))
    arrays = {n: jnp.asarray(rng.standard_normal(s), jnp.float32).astype(DT[dtype])
              for n, s in shapes.items()}
    f64 = {n: np.asarray(a.astype(jnp.float32), np.float64) for n, a in arrays.items()}
    return arrays, f64


def _params(impl, causal, bottom_right=False, d=128):
    from jax_sdpa.config import StaticParams
    return StaticParams(scale=1.0 / np.sqrt(d), window_right=0 if causal else -1,
                        bottom_right=bottom_right, seq_major=True, implementation=impl)


def _run(arrays, fwd_impl, bwd_impl, causal, bottom_right):
    """out, lse and the gradients through the primitives, the forward by one
    implementation and the backward by another."""
    from jax_sdpa import primitives

    def go(q, k, v, do):
        out, lse = primitives.fwd(q, k, v, None, None, None, None,
                                  _params(fwd_impl, causal, bottom_right))
        grads = primitives.bwd(q, k, v, out, lse, do, None, None, None, None,
                               _params(bwd_impl, causal, bottom_right))
        return out, lse, grads

    return jax.jit(go)(arrays["q"], arrays["k"], arrays["v"], arrays["do"])


def _check(arrays, f64, got, causal, bottom_right, what):
    out, lse, (dq, dk, dv) = got
    kw = dict(scale=1.0 / np.sqrt(128), window_right=0 if causal else -1,
              bottom_right=bottom_right, seq_major=True)
    want_out, want_lse = oracle.forward(f64["q"], f64["k"], f64["v"], **kw)
    want = oracle.backward(f64["q"], f64["k"], f64["v"], f64["do"], **kw)
    # the bound: 2x the error of XLA's computation in the same dtype, plus the floor
    xla = jax.nn.dot_product_attention(arrays["q"], arrays["k"], arrays["v"],
                                       is_causal=causal and not bottom_right,
                                       implementation="xla") if not bottom_right else None
    dtype = np.dtype(arrays["q"].dtype).name
    xla_err = None if xla is None else oracle.max_rel_error(xla, want_out)
    for name, x, w in (("out", out, want_out), ("dq", dq, want["dq"]), ("dk", dk, want["dk"]),
                       ("dv", dv, want["dv"])):
        arr = np.asarray(x.astype(jnp.float32))
        assert np.isfinite(arr).all(), f"{what}: {name} is not finite"
        err = oracle.max_rel_error(arr, w)
        bound = (oracle.tolerance(dtype, xla_error=xla_err) if name == "out" else
                 oracle.tolerance(dtype, grad=True, case="flash_attn3"))
        assert err <= bound, f"{what}: {name} error {err:.3g} > {bound:.3g}"
    err = oracle.lse_error(lse, want_lse)
    assert err <= oracle.lse_tolerance(dtype, case="flash_attn3"), f"{what}: lse error {err:.3g}"


SHAPES = [  # (B, Lq, Lk, Hq, Hk, causal, bottom_right); flash_mha's NaN shapes first
    (2, 96, 96, 4, 4, False, False), (2, 96, 96, 4, 2, False, False),
    (2, 128, 128, 4, 4, False, False), (2, 256, 256, 4, 4, False, False),
    (1, 1000, 1000, 8, 8, False, False), (1, 4096, 4096, 8, 8, False, False),
    (2, 96, 96, 4, 4, True, False), (1, 1000, 1000, 8, 2, True, False),
    (2, 200, 333, 4, 2, True, True), (1, 77, 77, 2, 1, False, False),
]


@needs_fa3
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}q{}k{}h{}k{}{}{}".format(
    *s[:5], "-causal" if s[5] else "", "-br" if s[6] else ""))
def test_against_the_oracle(shape, dtype):
    b, lq, lk, hq, hk, causal, br = shape
    rng = np.random.default_rng()
    arrays, f64 = _inputs(rng, b, lq, lk, hq, hk, dtype)
    _check(arrays, f64, _run(arrays, "flash_attn3", "flash_attn3", causal, br), causal, br,
           "flash_attn3")


@needs_fa3
@pytest.mark.gpu
@pytest.mark.parametrize("fwd_impl, bwd_impl", [("cudnn", "flash_attn3"),
                                                ("flash_attn3", "cudnn")])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_with_cudnn(fwd_impl, bwd_impl, causal):
    """The forward of one implementation feeds the backward of the other (out and the
    natural-log lse of the contract)."""
    rng = np.random.default_rng()
    arrays, f64 = _inputs(rng, 2, 300, 300, 8, 2, "bfloat16")
    _check(arrays, f64, _run(arrays, fwd_impl, bwd_impl, causal, False), causal, False,
           f"{fwd_impl} -> {bwd_impl}")


@needs_fa3
@pytest.mark.gpu
def test_public_api_grad_vmap_and_none():
    rng = np.random.default_rng()
    arrays, f64 = _inputs(rng, 2, 512, 512, 8, 2, "bfloat16")
    q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]
    def loss(q, k, v, impl):
        out = jax_sdpa.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3).lower(
        q, k, v, None).as_text()
    assert "flash_mha_fwd" in text and "flash_mha_bwd" in text
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(q, k, v, "flash_attn3")
    want = oracle.backward(f64["q"], f64["k"], f64["v"], f64["do"], scale=1 / np.sqrt(128),
                           window_right=0, seq_major=True)
    for name, g in zip(("dq", "dk", "dv"), got):
        assert oracle.max_rel_error(g, want[name]) <= oracle.tolerance(
            "bfloat16", grad=True, case="flash_attn3"), name
    # vmap over a leading axis folds into the batch
    many = jnp.stack([q, q[::-1]])
    out = jax.vmap(lambda q: jax_sdpa.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation="flash_attn3"))(many)
    one = jax_sdpa.dot_product_attention(q[::-1], k, v, is_causal=True,
                                         implementation="flash_attn3")
    assert oracle.max_rel_error(out[1], np.asarray(one.astype(jnp.float32))) <= oracle.tolerance(
        "bfloat16", case="same_library")


def _packed_ids(rng, b, length, case):
    """[B, L] segment ids: 'runs' (sorted runs of odd lengths, 0 as trailing padding in
    row 0), 'interleaved' (an id in two runs), 'many' (more runs than max_sequences)."""
    ids = np.zeros((b, length), np.int32)
    for row in range(b):
        cuts = np.sort(rng.choice(np.arange(1, length), int(rng.integers(2, 7)), replace=False))
        for j, (lo, hi) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, length])):
            ids[row, lo:hi] = j + 1
    if case == "runs":
        ids[0, -9:] = 0
    elif case == "interleaved":
        ids[0, : length // 3] = ids[0, -1]
    elif case == "many":
        ids[:] = np.arange(length, dtype=np.int32)[None] // 2
    return ids


@needs_fa3
@pytest.mark.gpu
@pytest.mark.parametrize("case", ["runs", "interleaved", "many", "cross"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("impl", [None, "flash_attn3"])
def test_packed_against_the_oracle(case, causal, impl):
    """Segment ids through the varlen kernels ('runs') or the fallback the lowering takes
    when the call runs ('interleaved', 'many', 'cross': kv ids that differ), forward and
    gradients against float64, GQA, odd lengths."""
    rng = np.random.default_rng()
    b, length, hq, hk = 2, int(rng.integers(300, 700)), 8, 2
    arrays, f64 = _inputs(rng, b, length, length, hq, hk, "bfloat16")
    q_ids = _packed_ids(rng, b, length, "runs" if case == "cross" else case)
    kv_ids = q_ids.copy()
    if case == "cross":  # one key (not its segment's first) in no query's segment
        starts = np.flatnonzero(np.r_[True, q_ids[1, 1:] != q_ids[1, :-1]])
        kv_ids[1, starts[np.argmax(np.diff(np.r_[starts, length]))] + 1] = 999
    q, k, v, do = arrays["q"], arrays["k"], arrays["v"], arrays["do"]

    def loss(q, k, v):
        out = jax_sdpa.dot_product_attention(
            q, k, v, is_causal=causal, q_segment_ids=jnp.asarray(q_ids),
            kv_segment_ids=jnp.asarray(kv_ids), implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    text = grad.lower(q, k, v).as_text()
    # None: FlashAttention-3 goes first from the keys its tuning row gives per direction and
    # band (a shorter forward runs cuDNN, here with the ids as its mask).
    first = tuning.FLASH_ATTN3_FIRST
    band = "causal" if causal else "none"
    assert ("flash_mha_fwd" in text) == (impl == "flash_attn3" or length >= first["fwd"][band])
    assert "flash_mha_bwd" in text
    (dq, dk, dv), out = grad(q, k, v)
    kw = dict(scale=1 / np.sqrt(128), window_right=0 if causal else -1, seq_major=True,
              q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    want_out, _ = oracle.forward(f64["q"], f64["k"], f64["v"], **kw)
    want = oracle.backward(f64["q"], f64["k"], f64["v"], f64["do"], **kw)
    for name, x, w, scale in (("out", out, want_out, 1), ("dq", dq, want["dq"], 2),
                              ("dk", dk, want["dk"], 2), ("dv", dv, want["dv"], 2)):
        arr = np.asarray(x.astype(jnp.float32))
        assert np.isfinite(arr).all(), f"{case}: {name} is not finite"
        err = oracle.max_rel_error(arr, w)
        assert err <= scale * oracle.tolerance("bfloat16"), f"{case}: {name} error {err:.3g}"
