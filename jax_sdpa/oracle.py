"""The independent float64 oracle of the attention contract, and the one tolerance policy.

Written in numpy from docs/ffi_contract.md alone (no code of the implementations under test):
the tests, `jax-sdpa check` and the benchmarks' correctness checks all compare against
`forward` / `backward` here and judge the difference with `tolerance`.

Numerics (the contract's):
- a query row whose visible logits include a NaN is NaN (out, lse and its gradients);
- keys excluded by the lengths, the band or a mask never reach an output or a gradient,
  whatever they hold (NaN and inf included);
- a row with nothing to attend (and padded query rows) gives out = 0 and lse = -inf (the
  sink's logit when there are sinks), and no gradient;
- segment ids: query i sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j];
- logits_soft_cap c: the scaled logit x = scale * q.k becomes c * tanh(x / c) before the
  additive mask; sinks are not capped.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

# ---------------------------------------------------------------------------
# the oracle


def _as4(x):
    x = np.asarray(x)
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _matmul(a, b):
    """a @ b over the last two axes (same leading dims), each element as IEEE arithmetic
    gives it: BLAS over the finite rows of a and columns of b, einsum for each row or column
    holding a NaN or an inf (a BLAS may skip the products of zero factors)."""
    bad_a = ~np.isfinite(a).all(axis=-1)  # [..., I]
    bad_b = ~np.isfinite(b).all(axis=-2)  # [..., K]
    out = np.matmul(np.where(bad_a[..., None], 0.0, a), np.where(bad_b[..., None, :], 0.0, b))
    for *lead, i in np.argwhere(bad_a):
        lead = tuple(lead)
        out[lead + (i,)] = np.einsum("j,jk->k", a[lead + (i,)], b[lead])
    for *lead, k in np.argwhere(bad_b):
        lead = tuple(lead)
        out[lead + (slice(None), k)] = np.einsum("ij,j->i", a[lead], b[lead + (slice(None), k)])
    return out


def _masked_contract(w, visible, x):
    """sum_j w[b, h, i, j] * x[b, h, j, :] over the visible j only: a non-finite x at an
    invisible j never reaches the result (0 * NaN would). w, visible [B, H, I, J]; x
    [B, H, J, D]."""
    w = np.where(visible, w, 0.0)
    finite = np.isfinite(x)
    out = _matmul(w, np.where(finite, x, 0.0))
    bad = np.argwhere(~finite.all(axis=-1))  # (b, h, j) rows holding a NaN / inf
    for b, h, j in bad:
        extra = np.where(finite[b, h, j], 0.0, x[b, h, j])  # [D]
        col = visible[b, h, :, j]
        out[b, h] += np.where(col[:, None], w[b, h, :, j, None] * extra[None, :], 0.0)
    return out


def _visibility(b, hq, lq, lk, mask, q_lengths, kv_lengths, window_left, window_right,
                bottom_right, q_segment_ids=None, kv_segment_ids=None):
    """(visible [B, Hq, Lq, Lk] bool, additive [.., Lq, Lk] float64 or None, padded [B, Lq])."""
    qlen = np.full(b, lq) if q_lengths is None else np.clip(np.asarray(q_lengths), 0, lq)
    kvlen = np.full(b, lk) if kv_lengths is None else np.clip(np.asarray(kv_lengths), 0, lk)
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    visible = np.zeros((b, 1, lq, lk), bool)
    for bi in range(b):
        offset = kvlen[bi] - qlen[bi] if bottom_right else 0
        dd = j - (i + offset)
        vis = (i < qlen[bi]) & (j < kvlen[bi])
        if window_left >= 0:
            vis &= dd >= -window_left
        if window_right >= 0:
            vis &= dd <= window_right
        if q_segment_ids is not None:
            qs = np.asarray(q_segment_ids)[bi]
            ks = np.asarray(kv_segment_ids if kv_segment_ids is not None
                            else q_segment_ids)[bi]
            vis &= qs[:, None] == ks[None, :]
        visible[bi, 0] = vis
    visible = np.broadcast_to(visible, (b, hq, lq, lk)).copy()
    additive = None
    if mask is not None:
        m = _as4(mask)
        if m.dtype == np.bool_:
            visible &= np.broadcast_to(m, visible.shape)
        else:
            additive = np.broadcast_to(m.astype(np.float64), visible.shape)
            visible &= ~np.isneginf(additive)  # -inf masks a key; NaN stays a (NaN) logit
    padded = np.arange(lq)[None, :] >= qlen[:, None]
    return visible, additive, padded


def _sinks_f64(sinks, b, hq):
    if sinks is None:
        return None
    s = np.asarray(sinks, np.float64)
    s = s.reshape((1, hq)) if s.ndim == 1 else s
    return np.broadcast_to(s, (b, hq))[:, :, None]  # [B, Hq, 1]


def _canonical(q, k, v, mask, window_right, bottom_right, seq_major):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if seq_major:  # [B, L, H, D] -> [B, H, L, D]
        q, k, v = (np.swapaxes(x, 1, 2) for x in (q, k, v))
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask must be None, 'causal' or an array, got {mask!r}")
        mask, window_right, bottom_right = None, 0, True
    return q, k, v, mask, window_right, bottom_right


def _probabilities(q, k, *, scale, mask, sinks, q_lengths, kv_lengths, window_left,
                   window_right, bottom_right, q_segment_ids, kv_segment_ids,
                   logits_soft_cap):
    """(P, visible, lse, scale, sinks [B, Hq, 1], cap slope d logit / d (scale q.k))."""
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(d) if scale is None else float(scale)
    visible, additive, padded = _visibility(b, hq, lq, lk, mask, q_lengths, kv_lengths,
                                            window_left, window_right, bottom_right,
                                            q_segment_ids, kv_segment_ids)
    k_full = np.repeat(k, hq // hk, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        # each logit is its own dot product: a non-finite key only reaches its own column,
        # which the visibility below drops where the key is not visible
        logits = _matmul(q, np.swapaxes(k_full, -1, -2))
        logits = logits * scale
        slope = None
        if logits_soft_cap:
            cap = float(logits_soft_cap)
            t = np.tanh(logits / cap)
            logits, slope = cap * t, 1.0 - t * t
        if additive is not None:
            logits = logits + additive
        logits = np.where(visible, logits, -np.inf)
        sink = _sinks_f64(sinks, b, hq)
        m = logits.max(axis=-1, keepdims=True)  # NaN wherever a visible logit is NaN
        if sink is not None:
            m = np.maximum(m, sink[..., None])
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(logits - m_safe)
        total = p.sum(axis=-1, keepdims=True)
        if sink is not None:
            total = total + np.exp(sink[..., None] - m_safe)
        nan_row = np.isnan(m)
        lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        lse = np.where(nan_row, np.nan, lse)
        prob = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
        prob = np.where(nan_row, np.nan, prob)
    pad = padded[:, None, :, None]
    prob = np.where(pad, 0.0, prob)
    visible = visible & ~pad
    lse = np.where(pad, -np.inf, lse)[..., 0]
    return prob, visible, lse, scale, sink, slope


def forward(q, k, v, *, scale: Optional[float] = None, mask=None, sinks=None,
            q_lengths=None, kv_lengths=None, window_left: int = -1, window_right: int = -1,
            bottom_right: bool = False, seq_major: bool = False, q_segment_ids=None,
            kv_segment_ids=None, logits_soft_cap: Optional[float] = None):
    """(out, lse) in float64. q [B, Hq, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv]
    ([B, L, H, D] with seq_major; out follows q's layout, lse is [B, Hq, Lq]). mask: None,
    "causal" (bottom-right, = window_right 0 + bottom_right), a bool (True = attend) or an
    additive array broadcastable to [B, Hq, Lq, Lk]; sinks [Hq] or [1 or B, Hq]; lengths
    int [B]; windows as the contract's (-1: unbounded); segment ids int [B, Lq] / [B, Lk]
    (kv_segment_ids None: the query's); logits_soft_cap None or > 0."""
    q, k, v, mask, window_right, bottom_right = _canonical(q, k, v, mask, window_right,
                                                           bottom_right, seq_major)
    prob, visible, lse, _, _, _ = _probabilities(
        q, k, scale=scale, mask=mask, sinks=sinks, q_lengths=q_lengths,
        kv_lengths=kv_lengths, window_left=window_left, window_right=window_right,
        bottom_right=bottom_right, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap)
    v_full = np.repeat(v, q.shape[1] // k.shape[1], axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        out = _masked_contract(prob, visible, v_full)
    if seq_major:
        out = np.swapaxes(out, 1, 2)
    return out, lse


def backward(q, k, v, dout, *, scale: Optional[float] = None, mask=None, sinks=None,
             q_lengths=None, kv_lengths=None, window_left: int = -1, window_right: int = -1,
             bottom_right: bool = False, seq_major: bool = False, q_segment_ids=None,
             kv_segment_ids=None, logits_soft_cap: Optional[float] = None, out=None):
    """Gradients of sum(out * dout) in float64, from the forward's probabilities (not by
    differentiating code under test): {"dq", "dk", "dv"} in the inputs' layout, plus
    "dmask" (the additive mask's gradient, summed over its broadcast dims) and "dsinks"
    (shaped like `sinks`) when those are given. Arguments as `forward`; `out`: the forward
    output a backward kernel is handed, whose rowsum(dout * out) then stands for the exact
    one (as in flash backwards), so a 16-bit output's rounding is not charged to the
    backward."""
    additive_mask = (mask is not None and not isinstance(mask, str)
                     and np.asarray(mask).dtype != np.bool_)
    mask_shape = None if not additive_mask else np.asarray(mask).shape
    q, k, v, mask, window_right, bottom_right = _canonical(q, k, v, mask, window_right,
                                                           bottom_right, seq_major)
    dout = np.asarray(dout, np.float64)
    if seq_major:
        dout = np.swapaxes(dout, 1, 2)
    prob, visible, lse, scale, sink, slope = _probabilities(
        q, k, scale=scale, mask=mask, sinks=sinks, q_lengths=q_lengths,
        kv_lengths=kv_lengths, window_left=window_left, window_right=window_right,
        bottom_right=bottom_right, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, logits_soft_cap=logits_soft_cap)
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    k_full, v_full = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        dp = _matmul(dout, np.swapaxes(v_full, -1, -2))  # per pair: dropped where invisible
        dp = np.where(visible, dp, 0.0)
        if out is None:
            delta = np.sum(np.where(visible, prob * dp, 0.0), axis=-1, keepdims=True)
        else:
            out = np.asarray(out, np.float64)
            out = np.swapaxes(out, 1, 2) if seq_major else out
            delta = np.sum(dout * out, axis=-1, keepdims=True)
        ds = np.where(visible, prob * (dp - delta), 0.0)
        # through the cap: d logit / d (scale q.k) = 1 - tanh^2 (the mask's gradient is ds)
        ds_dots = ds if slope is None else np.where(visible, ds * slope, 0.0)
        dq = scale * _masked_contract(ds_dots, visible, k_full)
        tr = (0, 1, 3, 2)
        dk_full = scale * _masked_contract(ds_dots.transpose(tr), visible.transpose(tr), q)
        dv_full = _masked_contract(prob.transpose(tr), visible.transpose(tr), dout)
    b, _, lk, d = k.shape
    dk = dk_full.reshape(b, hk, g, lk, d).sum(axis=2)
    dv = dv_full.reshape(b, hk, g, lk, v.shape[-1]).sum(axis=2)
    if seq_major:
        dq, dk, dv = (np.swapaxes(x, 1, 2) for x in (dq, dk, dv))
    grads = {"dq": dq, "dk": dk, "dv": dv}
    if additive_mask:
        dmask = _as4(ds)
        full = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
        axes = tuple(i for i in range(4) if full[i] == 1 and dmask.shape[i] != 1)
        if axes:
            dmask = dmask.sum(axis=axes, keepdims=True)
        grads["dmask"] = dmask.reshape(mask_shape)
    if sinks is not None:
        with np.errstate(invalid="ignore", over="ignore"):
            finite = np.isfinite(lse)
            p_sink = np.where(finite, np.exp(sink - np.where(finite, lse, 0.0)), 0.0)
            dsink = -np.sum(p_sink * delta[..., 0], axis=2)  # [B, Hq]
        shape = np.asarray(sinks).shape
        if len(shape) == 1 or shape[0] == 1:
            dsink = dsink.sum(axis=0, keepdims=True)
        grads["dsinks"] = dsink.reshape(shape)
    return grads


# ---------------------------------------------------------------------------
# the tolerance policy
#
# An output or gradient's error is max_rel_error (relative to max(max |oracle|, 1); inputs
# are unit normals); an lse's is lse_error, absolute: the lse is the log of the softmax's
# sum, so a relative error of the sum is an absolute error of the lse.

# float32 against the oracle.
FP32_RTOL = 1e-5
FP32_GRAD_RTOL = 2e-5
# TF32 tensor cores (fp32 matmuls at JAX's default precision on an NVIDIA GPU).
TF32_RTOL = 2e-3
TF32_GRAD_RTOL = 2e-3
# 16-bit: at most twice the same-dtype XLA computation's error, plus this floor.
LOW_PRECISION_FLOOR = {"float16": 2e-3, "bfloat16": 1.6e-2}
# lse, every dtype: scores are float32 sums of exact products (16-bit inputs are widened).
LSE_ATOL = 1e-5
# lse of the GPU kernels (ours, cuDNN): float32 exponentials on the special function unit
# (ex2.approx) over rows of up to 32k keys; our decode kernels measure up to 1.3e-6 of |lse|.
GPU_LSE_ATOL = 1e-4
GPU_KERNEL_IMPLEMENTATIONS = frozenset({"cuda", "cudnn"})
# lse of fp32 calls on TF32 tensor cores: the scores carry TF32's 2^-11 rounding.
TF32_LSE_ATOL = 4e-3

# A model's served logits (a paged cache, continuous batching) against its full causal
# recompute of the same tokens, absolute: one float32 model computed in two orders
# (`jax-sdpa serve-demo`).
SERVED_LOGITS_ATOL = 1e-3

# max_rel_error's floor for a check relative to the oracle's own magnitude, tighter than the
# policy's 1 where that magnitude is below 1 (outputs of many keys, small gradients).
OWN_MAGNITUDE = 1e-6

# Implementations whose fp32 matmuls may round to TF32 at JAX's default matmul precision on
# an NVIDIA GPU: our CUDA flash kernels (cuDNN refuses fp32) and XLA's own dots.
TF32_IMPLEMENTATIONS = frozenset({"cuda", "xla", "xla_chunked"})

# Named cases that differ from the rule above, each for the reason given (the `case`
# argument of `tolerance` and `lse_tolerance`): {dtype: (output, gradient, lse)} bounds,
# None where the case has no such check.
NAMED_CASES = {
    # Our CUDA kernels at fp32_precision 1 (3xTF32): each step's products are summed with
    # fp32 adds (cuda/common/mma_helpers.cuh), so gradients are as exact as the outputs.
    "cuda_3xtf32": {"float32": (FP32_RTOL, FP32_RTOL, LSE_ATOL)},
    # Direct FFI calls of the GPU kernels with no same-dtype XLA run beside them: the
    # kernel's own roundings (16-bit P and outputs) of the oracle's rounded inputs; fp32 at
    # fp32_precision 1 on soft-capped logits up to 3x larger than unit normals give.
    "ffi_direct": {"float32": (2e-5, 4e-5, 1e-4), "float16": (6e-3, 1.2e-2, 2e-3),
                   "bfloat16": (3e-2, 6e-2, 2e-3)},
    # The CPU kernel's bfloat16 calls (bf16 products on x86-64-v4-bf16, else widened):
    # the output's own rounding to bfloat16 (2^-9) and P's, tighter than the 16-bit floor.
    "cpu_bfloat16": {"bfloat16": (6e-3, 8e-3, LSE_ATOL)},
    # cuDNN with a float32 additive bias on 16-bit inputs: it adds the bias in the inputs'
    # dtype, whose rounding (2^-9 / 2^-12 relative of a unit-normal bias) moves lse by up to
    # 4.3e-3 / 4.3e-4 on the tests' shapes (H200, pytest_gpu.xml).
    "cudnn_f32_bias": {"float16": (None, None, 5e-3), "bfloat16": (None, None, 2e-2)},
    # One kernel's two float32 calls doing the same visible work (a hidden key zeroed,
    # key blocks skipped, a cap of 1e4): the same sums, split differently at most.
    "fp32_same_work": {"float32": (2e-7, 1e-5, None)},
    # Two float32 runs of one call (sharded or not, under a transform or not): they differ
    # by their summation orders alone.
    "fp32_agreement": {"float32": (3e-5, 3e-5, None)},
    # A tuning sweep's kernel variant against the default kernel on one call, relative to
    # the default's own magnitude (OWN_MAGNITUDE): the same roundings summed in other orders.
    "kernel_variant": {"float32": (1e-3, 1e-3, 1e-3), "float16": (1e-2, 1e-2, 1e-3),
                       "bfloat16": (1e-2, 1e-2, 1e-3)},
    # Two runs of one 16-bit call by one library (ours and jax.nn's cuDNN, vmapped or not):
    # its plans alone.
    "same_library": {"float16": (1e-2, None, None), "bfloat16": (1e-2, None, None)},
    # flash-attn3-jax: no same-dtype XLA gradients beside it (twice the 16-bit floor); its
    # lse from its exp2 softmax with the scale folded into the exponent.
    "flash_attn3": {"float16": (None, 2 * LOW_PRECISION_FLOOR["float16"], 2e-2),
                    "bfloat16": (None, 2 * LOW_PRECISION_FLOOR["bfloat16"], 2e-2)},
}


def max_rel_error(got, want, floor: float = 1.0) -> float:
    """max |got - want| / max(max |want|, floor), in float64 (0 for empty arrays). The floor
    of 1 keeps an all-zero oracle (a row that sees one key has dq = 0) from turning rounding
    noise into a huge relative error; it is then an absolute bound. floor=OWN_MAGNITUDE:
    relative to the oracle's own magnitude (for arrays that are never all zero)."""
    got = np.asarray(got).astype(np.float32).astype(np.float64)  # bf16 / f16 exactly
    want = np.asarray(want, np.float64)
    if want.size == 0:
        return 0.0
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), floor))


def lse_error(got, want) -> float:
    """max |got - want| over the oracle's finite lse entries; inf when the entries that are
    not finite differ (NaN where the oracle has NaN, -inf where it has -inf)."""
    got = np.asarray(got).astype(np.float32).astype(np.float64)
    want = np.asarray(want, np.float64)
    fin = np.isfinite(want)
    if not (np.array_equal(np.isnan(got), np.isnan(want))
            and np.array_equal(np.isneginf(got), np.isneginf(want))):
        return float("inf")
    return float(np.max(np.abs(got[fin] - want[fin]))) if fin.any() else 0.0


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _named(case: str, dtype: str, which: int) -> float:
    bound = NAMED_CASES[case].get(dtype, (None,) * 3)[which]
    if bound is None:
        raise ValueError(f"the named tolerance case {case!r} has no such bound for {dtype}")
    return bound


def tolerance(dtype, implementation: Optional[str] = None, *, grad: bool = False,
              xla_error: Optional[float] = None, tf32: bool = False,
              case: Optional[str] = None) -> float:
    """The largest max_rel_error an implementation may have against the oracle.

    fp32: FP32_RTOL (FP32_GRAD_RTOL for gradients); TF32_RTOL / TF32_GRAD_RTOL when `tf32`
    (the call ran at JAX's default matmul precision on an NVIDIA GPU) and the implementation
    is one of TF32_IMPLEMENTATIONS. fp16 / bf16: 2x `xla_error` (the same-dtype XLA
    computation's error against the same oracle) plus LOW_PRECISION_FLOOR. `case`: one of
    NAMED_CASES instead."""
    dtype = _dtype_name(dtype)
    if case is not None:
        return _named(case, dtype, 1 if grad else 0)
    if dtype in LOW_PRECISION_FLOOR:
        return 2 * (xla_error or 0.0) + LOW_PRECISION_FLOOR[dtype]
    rtol = FP32_GRAD_RTOL if grad else FP32_RTOL
    if tf32 and implementation in TF32_IMPLEMENTATIONS:
        return max(rtol, TF32_GRAD_RTOL if grad else TF32_RTOL)
    return rtol


def lse_tolerance(dtype, implementation: Optional[str] = None, *, tf32: bool = False,
                  case: Optional[str] = None) -> float:
    """The largest lse_error an implementation may have against the oracle: LSE_ATOL,
    GPU_LSE_ATOL for GPU_KERNEL_IMPLEMENTATIONS, TF32_LSE_ATOL for fp32 on TF32 tensor cores
    (as `tolerance`); `case`: one of NAMED_CASES instead."""
    if case is not None:
        return _named(case, _dtype_name(dtype), 2)
    if tf32 and _dtype_name(dtype) == "float32" and implementation in TF32_IMPLEMENTATIONS:
        return TF32_LSE_ATOL
    return GPU_LSE_ATOL if implementation in GPU_KERNEL_IMPLEMENTATIONS else LSE_ATOL
