"""The FFI boundary: every CPU-platform handler (jax_sdpa_cpu_fwd/bwd, jax_sdpa_metal_fwd/bwd,
and their paged targets jax_sdpa_<backend>_paged_fwd where the module registers them)
called directly through jax.ffi.ffi_call with wrong shapes, dtypes, sizes, attributes and
placeholder misuse returns a readable error naming what is wrong, and never crashes; odd
but valid calls (empty dims, lengths outside [0, L], a real operand behind a false flag)
succeed with every output written (conftest poisons outputs).

The cases run in a child process (this file run as a script), so that a crash fails the
case instead of killing pytest; after a crash the child is restarted on the cases left.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np

HANDLERS = ("cpu", "metal")


# ---------------------------------------------------------------------------
# the cases (built in the child; a case returns (operands, results, attrs))

def _attrs(**over):
    a = dict(scale=0.35, window_left=-1, window_right=-1, bottom_right=False, seq_major=False,
             has_mask=False, has_sinks=False, has_q_lengths=False, has_kv_lengths=False,
             fp32_precision=np.int64(0), logits_soft_cap=0.0, has_segment_ids=False,
             kv_layout=np.int64(0))
    a.update(over)
    return {k: v for k, v in a.items() if v is not _DROP}


_DROP = object()  # an attribute left out


def _arr(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(0, 5, size=shape).astype(dtype)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.7
    import jax.numpy as jnp
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype))


def _spec(shape, dtype=np.float32):
    import jax
    return jax.ShapeDtypeStruct(shape, dtype)


def _fwd(b=1, hq=2, hk=1, lq=5, lk=7, d=8, dv=8, dtype=np.float32, out=None, lse=None,
         mask=None, sinks=None, ql=None, kvl=None, q=None, k=None, v=None, **attrs):
    q = _arr((b, hq, lq, d), dtype, 1) if q is None else q
    k = _arr((b, hk, lk, d), dtype, 2) if k is None else k
    v = _arr((b, hk, lk, dv), dtype, 3) if v is None else v
    ph_f, ph_i = np.zeros((0,), np.float32), np.zeros((0,), np.int32)
    operands = [q, k, v, ph_f if mask is None else mask, ph_f if sinks is None else sinks,
                ph_i if ql is None else ql, ph_i if kvl is None else kvl, ph_i, ph_i]
    flags = dict(has_mask=mask is not None, has_sinks=sinks is not None,
                 has_q_lengths=ql is not None, has_kv_lengths=kvl is not None)
    flags.update(attrs)
    results = [out or _spec(q.shape[:3] + (v.shape[3],), q.dtype),
               lse or _spec(_rows(q.shape, flags), np.float32)]
    return operands, results, _attrs(**flags)


def _rows(q_shape, attrs):
    """lse's shape [B, Hq, Lq] in either layout."""
    if attrs.get("seq_major") is True and len(q_shape) == 4:
        return (q_shape[0], q_shape[2], q_shape[1])
    return tuple(q_shape[:3])


def _bwd(b=1, hq=2, hk=1, lq=5, lk=7, d=8, dv=8, dtype=np.float32, results=None, lse=None,
         dout=None, out=None, **kw):
    operands, _, attrs = _fwd(b, hq, hk, lq, lk, d, dv, dtype, **kw)
    q, k, v = operands[:3]
    out = _arr(q.shape[:3] + (v.shape[3],), q.dtype, 4) if out is None else out
    lse = _arr(_rows(q.shape, attrs), np.float32, 5) if lse is None else lse
    dout = _arr(q.shape[:3] + (v.shape[3],), q.dtype, 6) if dout is None else dout
    operands = [q, k, v, out, lse, dout] + operands[3:]
    results = results or [_spec(q.shape, q.dtype), _spec(k.shape, k.dtype),
                          _spec(v.shape, v.dtype)]
    return operands, results, attrs


def _f32(shape):
    return _arr(shape, np.float32)


def _without_last_operand(call):
    operands, results, attrs = call
    return operands[:-1], results, attrs


def _with_extra_result(call):
    operands, results, attrs = call
    return operands, [*results, _spec((16,), np.uint8)], attrs


def _paged(b=2, hq=4, hk=2, lq=3, d=8, dv=8, page_size=4, pps=3, num_pages=7, layout=0,
           q=None, k_pages=None, v_pages=None, idx=None, kvl=None, sinks=None, out=None,
           lse=None, **attrs):
    """A paged forward call (docs/ffi_contract.md, "Paged KV"): operands, results, attrs."""
    from jax_sdpa import paged

    pool = (num_pages, hk, page_size) if layout == 0 else (num_pages, page_size, hk)
    q = _arr((b, hq, lq, d), np.float32, 1) if q is None else q
    k_pages = _arr(pool + (d,), np.float32, 2) if k_pages is None else k_pages
    v_pages = _arr(pool + (dv,), np.float32, 3) if v_pages is None else v_pages
    rng = np.random.default_rng(4)
    idx = (rng.integers(0, num_pages, (b, pps)).astype(np.int32) if idx is None else idx)
    kvl = np.full((b,), pps * page_size - 1, np.int32) if kvl is None else kvl
    sinks_operand, a = paged.paged_ffi_call_args(scale=0.35, sinks=sinks,
                                                 kv_layout=("PHSD", "PSHD")[layout])
    a = {k: v for k, v in dict(a, **attrs).items() if v is not _DROP}
    results = [out or _spec(q.shape[:3] + (v_pages.shape[3],), q.dtype),
               lse or _spec(q.shape[:3], np.float32)]
    return [q, k_pages, v_pages, idx, kvl, np.asarray(sinks_operand)], results, a


# Cases of the paged targets: (builder of the call, expectation).
PAGED_CASES = {
    "ok": (lambda: _paged(), "ok"),
    "ok_slot_major": (lambda: _paged(layout=1), "ok"),
    "ok_sinks_gqa_decode": (lambda: _paged(lq=1, hq=8, sinks=_f32((1, 8))), "ok"),
    "ok_out_of_range_pages": (lambda: _paged(idx=np.array([[-1, 3, 7], [2**31 - 1, -9, 0]],
                                                          np.int32)), "ok"),
    "ok_lengths_out_of_range": (lambda: _paged(kvl=np.array([-5, 2**31 - 1], np.int32)),
                                "ok"),
    "ok_window_soft_cap": (lambda: _paged(window_left=np.int64(3), window_right=np.int64(0),
                                          logits_soft_cap=2.0), "ok|does not serve"),
    "has_mask": (lambda: _paged(has_mask=True), r"no mask, q_lengths or segment ids"),
    "has_segment_ids": (lambda: _paged(has_segment_ids=True), r"no mask"),
    "no_kv_lengths": (lambda: _paged(has_kv_lengths=False), r"needs kv_lengths"),
    "seq_major": (lambda: _paged(seq_major=True), r"bottom_right = true, seq_major = false"),
    "top_left": (lambda: _paged(bottom_right=False), r"bottom-right"),
    "kv_layout_2": (lambda: _paged(kv_layout=np.int64(2)), r"kv_layout must be 0 .* or 1"),
    "k_pages_rank_3": (lambda: _paged(k_pages=_f32((7, 2, 4))), r"rank 4"),
    "pools_disagree": (lambda: _paged(v_pages=_f32((6, 2, 4, 8))), r"must agree"),
    "empty_pool": (lambda: _paged(num_pages=0, idx=np.zeros((2, 3), np.int32)),
                   r"at least one slot"),
    "heads_not_multiple": (lambda: _paged(hq=3), r"heads"),
    "head_dims_differ": (lambda: _paged(k_pages=_f32((7, 2, 4, 16))), r"head dims differ"),
    "q_int32": (lambda: _paged(q=_arr((2, 4, 3, 8), np.int32)), r"q must be float32"),
    "pages_dtype": (lambda: _paged(v_pages=_arr((7, 2, 4, 8), np.float16)),
                    r"same dtype"),
    "page_indices_uint32": (lambda: _paged(idx=np.zeros((2, 3), np.uint32)),
                            r"page_indices must be int32 .*got uint32"),
    "page_indices_batch": (lambda: _paged(idx=np.zeros((3, 3), np.int32)),
                           r"page_indices must be int32 \[B=2"),
    "no_pages_per_seq": (lambda: _paged(idx=np.zeros((2, 0), np.int32)),
                         r"pages_per_seq >= 1"),
    "kv_lengths_float": (lambda: _paged(kvl=np.zeros(2, np.float32)),
                         r"kv_lengths must be int32"),
    "sinks_shape": (lambda: _paged(sinks=_f32((1, 3))), r"sinks must be float32"),
    "sinks_placeholder_behind_true_flag": (lambda: _paged(has_sinks=True),
                                           r"sinks must be float32"),
    "out_shape": (lambda: _paged(out=_spec((2, 4, 3, 16))), r"out has shape"),
    "lse_shape": (lambda: _paged(lse=_spec((2, 4, 2))), r"lse must be float32"),
    "soft_cap_nan": (lambda: _paged(logits_soft_cap=float("nan")), r"logits_soft_cap"),
    "scale_inf": (lambda: _paged(scale=float("inf")), r"scale must be finite"),
    "attribute_missing": (lambda: _paged(kv_layout=_DROP), r"(?i)attr|kv_layout"),
}


# name -> (direction, builder, expectation): "ok" or a regex the error must match.
CASES = {
    # valid calls
    "ok": ("both", lambda d: d(), "ok"),
    "ok_seq_major": ("both", lambda d: d(q=_f32((1, 5, 2, 8)), k=_f32((1, 7, 1, 8)),
                                           v=_f32((1, 7, 1, 8)), seq_major=True), "ok"),
    "ok_all_optional": ("both", lambda d: d(mask=_arr((1, 2, 5, 7), np.bool_),
                                            sinks=_f32((1, 2)), ql=np.array([4], np.int32),
                                            kvl=np.array([6], np.int32)), "ok"),
    "ok_lengths_out_of_range": ("both", lambda d: d(ql=np.array([-7], np.int32),
                                                    kvl=np.array([2**31 - 1], np.int32)),
                                "ok"),
    "ok_real_operand_behind_false_flag": (
        "both", lambda d: d(mask=_f32((3, 3)), sinks=_f32((9,)), has_mask=False,
                            has_sinks=False), "ok"),
    "ok_empty_batch": ("both", lambda d: d(b=0), "ok"),
    "ok_empty_query_heads": ("both", lambda d: d(hq=0), "ok"),
    "ok_empty_lengths": ("both", lambda d: d(lq=0, lk=0), "ok"),
    "ok_empty_keys": ("both", lambda d: d(lk=0), "ok"),
    "ok_additive_f16_mask_broadcast": (
        "both", lambda d: d(mask=_arr((1, 1, 1, 7), np.float16)), "ok"),
    "ok_window_huge": ("both", lambda d: d(window_left=2**62, window_right=2**62), "ok"),
    # shapes
    "q_rank_3": ("both", lambda d: d(q=_f32((2, 5, 8))), r"q must have rank 4"),
    "k_rank_5": ("both", lambda d: d(k=_f32((1, 1, 1, 7, 8))), r"k must have rank 4"),
    "batch_mismatch": ("both", lambda d: d(k=_f32((2, 1, 7, 8)), v=_f32((2, 1, 7, 8))),
                       r"batch sizes differ"),
    "heads_not_multiple": ("both", lambda d: d(hq=3, hk=2), r"heads"),
    "kv_heads_differ": ("both", lambda d: d(v=_f32((1, 2, 7, 8))), r"heads"),
    "head_dims_differ": ("both", lambda d: d(k=_f32((1, 1, 7, 16))),
                         r"head dims differ: q \[1, 2, 5, 8\], k \[1, 1, 7, 16\]"),
    "kv_lengths_differ": ("both", lambda d: d(v=_f32((1, 1, 6, 8))), r"lengths differ"),
    "head_dim_zero": ("both", lambda d: d(d=0), r"head dims must be positive, got D=0"),
    "value_dim_zero": ("both", lambda d: d(dv=0), r"head dims must be positive, got D=8, Dv=0"),
    "out_shape": ("fwd", lambda d: d(out=_spec((1, 2, 5, 16))), r"out has shape"),
    "out_dtype": ("fwd", lambda d: d(out=_spec((1, 2, 5, 8), np.float16)),
                  r"out has dtype float16, q float32"),
    "lse_shape": ("fwd", lambda d: d(lse=_spec((1, 2, 6))), r"lse must be float32"),
    "lse_dtype": ("fwd", lambda d: d(lse=_spec((1, 2, 5), np.float16)),
                  r"lse must be float32 .*got float16"),
    "bwd_lse_operand": ("bwd", lambda d: d(lse=_f32((1, 2))), r"lse must be float32"),
    "bwd_dout_shape": ("bwd", lambda d: d(dout=_f32((1, 2, 5, 4))), r"dout has shape"),
    "bwd_out_dtype": ("bwd", lambda d: d(out=_arr((1, 2, 5, 8), np.float16)),
                      r"out has dtype float16"),
    "bwd_dq_shape": ("bwd", lambda d: d(results=[_spec((1, 2, 5, 4)), _spec((1, 1, 7, 8)),
                                                 _spec((1, 1, 7, 8))]), r"dq has shape"),
    "bwd_dv_dtype": ("bwd", lambda d: d(results=[_spec((1, 2, 5, 8)), _spec((1, 1, 7, 8)),
                                                 _spec((1, 1, 7, 8), np.float16)]),
                     r"dv has dtype float16, v float32"),
    # the number of buffers
    "operand_missing": ("both", lambda d: _without_last_operand(d()),
                        r"takes (9|12) operands and (2|3) results \(docs/ffi_contract.md\), "
                        r"got (8|11) and (2|3)"),
    "result_extra": ("both", lambda d: _with_extra_result(d()),
                     r"takes (9|12) operands and (2|3) results .*got (9|12) and (3|4)"),
    # dtypes
    "q_int32": ("both", lambda d: d(dtype=np.int32),
                r"q must be float32, float16 or bfloat16, got int32"),
    "k_dtype_differs": ("both", lambda d: d(k=_arr((1, 1, 7, 8), np.float16)),
                        r"same dtype, got float32, float16, float32"),
    # the optional operands
    "mask_rank_2": ("both", lambda d: d(mask=_arr((5, 7), np.bool_)), r"mask must have rank 4"),
    "mask_not_broadcast": ("both", lambda d: d(mask=_arr((1, 2, 3, 7), np.bool_)),
                           r"does not broadcast"),
    "mask_int32": ("both", lambda d: d(mask=_arr((1, 1, 5, 7), np.int32)),
                   r"mask must be bool.*got int32"),
    "mask_placeholder_behind_true_flag": ("both", lambda d: d(has_mask=True),
                                          r"mask must have rank 4"),
    "sinks_shape": ("both", lambda d: d(sinks=_f32((1, 3))), r"sinks must be float32"),
    "sinks_batch": ("both", lambda d: d(b=3, sinks=_f32((2, 2))), r"sinks must be float32"),
    "sinks_f16": ("both", lambda d: d(sinks=_arr((1, 2), np.float16)),
                  r"sinks must be float32 .*got float16 \[1, 2\]"),
    "sinks_placeholder_behind_true_flag": ("both", lambda d: d(has_sinks=True),
                                           r"sinks must be float32"),
    "q_lengths_uint32": ("both", lambda d: d(ql=np.array([3], np.uint32)),
                         r"q_lengths must be int32 .*got uint32"),
    "kv_lengths_float": ("both", lambda d: d(kvl=np.array([3.0], np.float32)),
                         r"kv_lengths must be int32 .*got float32"),
    "kv_lengths_shape": ("both", lambda d: d(kvl=np.array([3, 4], np.int32)),
                         r"kv_lengths must be int32"),
    "lengths_placeholder_behind_true_flag": ("both", lambda d: d(has_q_lengths=True),
                                             r"q_lengths must be int32"),
    # attributes
    "scale_nan": ("both", lambda d: d(scale=float("nan")), r"scale must be finite"),
    "scale_inf": ("both", lambda d: d(scale=float("inf")), r"scale must be finite"),
    "window_negative": ("both", lambda d: d(window_left=-5), r"window sizes"),
    "fp32_precision_bad": ("both", lambda d: d(fp32_precision=np.int64(7)), r"fp32_precision"),
    "attribute_missing": ("both", lambda d: d(fp32_precision=_DROP), r"(?i)attr|fp32_precision"),
    "attribute_extra": ("both", lambda d: d(surplus=np.int64(1)), r"(?i)attr"),
    "attribute_wrong_type": ("both", lambda d: d(scale=np.int64(1)),
                             r"decode .*expected F64 but got S64"),
    "flag_wrong_type": ("both", lambda d: d(has_mask=np.int64(1)),
                        r"decode .*expected PRED but got S64"),
    "seq_major_shapes_swapped": ("both", lambda d: d(seq_major=True), r"(?i)heads|differ|shape"),
    # what the Metal kernels refuse (the CPU kernel serves it)
    "metal_head_dim_12": ("both", lambda d: d(d=12, dv=12), "ok|metal.*multiples of 8"),
    "metal_head_dim_520": ("both", lambda d: d(d=520, dv=8), "ok|metal.*above 512"),
}


def _run_case(handler, direction, name):
    import jax
    import jax_sdpa  # noqa: F401  registers the targets
    from jax_sdpa import _ext

    _ext._load()
    if direction == "paged":
        operands, results, attrs = PAGED_CASES[name][0]()
        target = f"jax_sdpa_{handler}_paged_fwd"
    else:
        _, build, _ = CASES[name]
        operands, results, attrs = build(_fwd if direction == "fwd" else _bwd)
        target = f"jax_sdpa_{handler}_{direction}"
    call = jax.ffi.ffi_call(target, results)
    try:
        outs = jax.jit(lambda *a: call(*a, **attrs))(*operands)
        outs = [np.asarray(o) for o in outs]
    except Exception as e:  # noqa: BLE001 - the message is the result
        return "error " + f"{type(e).__name__}: {e}".replace("\n", " | ")[:800]
    if any(np.isnan(o.astype(np.float32)).any() for o in outs if o.size):
        return "unwritten: an output holds the NaN poison"
    return "ok"


def _units(handler=None):
    """name:direction of every case; the paged ones where `handler`'s module registers its
    paged target."""
    units = [f"{name}:{d}" for name, (direction, _, _) in CASES.items()
             for d in ("fwd", "bwd") if direction in ("both", d)]
    if handler is not None:
        from jax_sdpa import _ext
        if f"jax_sdpa_{handler}_paged_fwd" in _ext.ffi_targets():
            units += [f"{name}:paged" for name in PAGED_CASES]
    return units


def _expectation(unit):
    name, direction = unit.split(":")
    return PAGED_CASES[name][1] if direction == "paged" else CASES[name][2]


def child(handler, units):
    for unit in units:
        name, direction = unit.split(":")
        print(f"START {unit}", flush=True)
        print(f"RESULT {unit} {_run_case(handler, direction, name)}", flush=True)


# ---------------------------------------------------------------------------
# the test

def _run_child(handler, units):
    """{unit: result}; a unit during which the child died is 'crash ...', and the child is
    started again on the units after it."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SDPA_POISON_OUTPUTS="1")
    import jax_sdpa
    roots = [str(pathlib.Path(jax_sdpa.__file__).resolve().parent.parent),
             str(pathlib.Path(__file__).resolve().parent)]
    env["PYTHONPATH"] = os.pathsep.join(roots + [env.get("PYTHONPATH", "")])
    results, todo = {}, list(units)
    while todo:
        proc = subprocess.run([sys.executable, __file__, handler, *todo], env=env,
                              capture_output=True, text=True, timeout=600)
        started = None
        for line in proc.stdout.splitlines():
            if line.startswith("START "):
                started = line.split()[1]
            elif line.startswith("RESULT "):
                _, unit, result = line.split(" ", 2)
                results[unit] = result
                started = None
        if started is None:
            if proc.returncode != 0:
                results["child"] = f"exit {proc.returncode}: {proc.stderr[-2000:]}"
            break
        results[started] = f"crash (exit {proc.returncode}): {proc.stderr[-1500:]}"
        todo = todo[todo.index(started) + 1:]
    return results


def _as_expected(handler, expect, got):
    if expect == "ok":
        return got == "ok"
    if expect == "ok|does not serve":  # a feature the paged target may not serve yet
        return got == "ok" or (got.startswith("error") and "does not serve" in got)
    if expect.startswith("ok|"):  # the CPU kernel serves it, the Metal kernels refuse it
        if handler != "metal":
            return got == "ok"
        expect = expect[3:]
    return got.startswith("error") and re.search(expect, got) is not None


def test_cpu_and_metal_handlers_never_crash_and_say_what_is_wrong():
    import pytest
    from jax_sdpa import _ext
    handlers = [h for h in HANDLERS if _ext.has_backend(h)]
    if not handlers:
        pytest.skip("no CPU-platform handler built")
    problems = []
    for handler in handlers:
        results = _run_child(handler, _units(handler))
        assert "child" not in results, results["child"]
        for unit in _units(handler):
            expect = _expectation(unit)
            got = results.get(unit, "missing")
            if not _as_expected(handler, expect, got):
                problems.append(f"{handler} {unit}: expected {expect!r}, got {got}")
    assert not problems, "\n".join(problems)


if __name__ == "__main__":
    if sys.argv[1] == "--print":  # a look at every message: --print cpu|metal
        for unit in _units(sys.argv[2]):
            name, direction = unit.split(":")
            print(unit, "->", _run_case(sys.argv[2], direction, name))
    else:
        child(sys.argv[1], sys.argv[2:])
