"""The float64 oracle (jax_sdpa.oracle, the one the whole suite uses) in the argument names
of the GPU tests of our CUDA kernels and cuDNN (tests/test_cuda_features.py,
tests/test_cuda_paged.py, tests/test_cudnn.py), and their comparison with the contract's NaN
rules: NaN exactly where the oracle has NaN; bounds from jax_sdpa.oracle's policy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_sdpa import oracle as _oracle


def oracle(q, k, v, dout=None, *, scale, cap=0.0, qseg=None, kvseg=None, ql=None, kvl=None,
           wl=-1, wr=-1, br=False, sinks=None, key_ok=None):
    """(out, lse[, dq, dk, dv]) in float64 from jax_sdpa.oracle. wl / wr / br: the
    contract's window and bottom-right alignment; key_ok [B, Lk] bool: False hides a key from
    every row (a paged cache's invalid page), as a bool mask."""
    mask = None if key_ok is None else np.asarray(key_ok, bool)[:, None, None, :]
    kw = dict(scale=scale, mask=mask, sinks=sinks, q_lengths=ql, kv_lengths=kvl,
              window_left=wl, window_right=wr, bottom_right=br, q_segment_ids=qseg,
              kv_segment_ids=kvseg, logits_soft_cap=cap if cap and cap > 0 else None)
    out, lse = _oracle.forward(q, k, v, **kw)
    if dout is None:
        return out, lse
    grads = _oracle.backward(q, k, v, dout, **kw)
    return out, lse, grads["dq"], grads["dk"], grads["dv"]


# The callers run the kernels' FFI targets directly, with no same-dtype XLA run beside them:
# the tolerance policy's named case for that.
POLICY_CASE = "ffi_direct"


def tol(dtype, grad=False):
    """The output (gradient) bound of jax_sdpa.oracle's policy for these direct calls."""
    return _oracle.tolerance(dtype, grad=grad, case=POLICY_CASE)


def lse_tol(dtype):
    """The lse bound of jax_sdpa.oracle's policy for these direct calls."""
    return _oracle.lse_tolerance(dtype, case=POLICY_CASE)


def as_f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def assert_matches(got, want, tol, what):
    """NaN exactly where the oracle has NaN (and -inf where it has -inf); elsewhere
    jax_sdpa.oracle.max_rel_error within tol."""
    got = as_f64(got)
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    assert np.array_equal(nan_got, nan_want), (
        f"{what}: NaN at {np.argwhere(nan_got != nan_want)[:8].tolist()} "
        f"(got NaN {nan_got.sum()}, oracle NaN {nan_want.sum()})")
    ok = ~nan_want
    inf_want = np.isinf(want) & ok
    assert np.array_equal(got[inf_want], want[inf_want]), f"{what}: infinities differ"
    fin = ok & ~inf_want
    if fin.any():
        err = _oracle.max_rel_error(got[fin], want[fin])
        assert err <= tol, f"{what}: max rel error {err:.3g} > {tol}"


def assert_lse_matches(got, want, tol, what="lse"):
    """NaN and -inf exactly where the oracle has them; elsewhere jax_sdpa.oracle.lse_error
    within tol."""
    err = _oracle.lse_error(as_f64(got), want)
    assert err <= tol, f"{what}: lse error {err:.3g} > {tol} (inf: NaN / -inf pattern differs)"
