"""An optional backend: FlashAttention-3 through the public `flash_mha` of the
flash-attn3-jax package, when that package is installed beside jax_sdpa.

`flash_mha(q, k, v, softmax_scale, is_causal, window_size)` takes [B, L, H, D] (the jax.nn
entry's layout), GQA, bottom-right aligned causal/window (top-left when Lq == Lk) and has
its own custom_vjp: a call routed here runs its forward and its backward, none of our
primitives. Its wheels serve sm90 and head dim 128 only, and it takes no masks, bias,
sinks, lengths, segment ids or soft cap, and returns no lse.
"""

from __future__ import annotations

import importlib

import numpy as np

from jax_sdpa.config import MASK_NONE, Config, StaticParams

PACKAGE = "flash_attn3_jax"
INSTALL_HINT = "pip install flash-attn3-jax (its wheels serve sm90 GPUs, head dim 128)"
HEAD_DIM = 128
_DTYPES = (np.dtype(np.float16), np.dtype("bfloat16"))


def module():
    """The flash_attn3_jax module, or None when it is not importable."""
    try:
        return importlib.import_module(PACKAGE)
    except Exception:  # noqa: BLE001 - a broken install (missing .so, einops) is "absent"
        return None


def importable() -> bool:
    return module() is not None


def serves(cfg: Config, platform: str, needs_lse: bool = False):
    """(ok, reason): whether flash_attn3_jax's flash_mha computes this call exactly as our
    contract does. `needs_lse`: the call returns the residual (flash_mha returns no lse)."""
    if platform != "cuda":
        return False, (f"'flash_attn3' needs a CUDA GPU (jax platform 'cuda'); this call "
                       f"lowers for platform '{platform}'")
    if not importable():
        return False, f"the flash_attn3_jax package is not importable: {INSTALL_HINT}"
    from jax_sdpa import dispatch  # dispatch imports this module

    caps = dispatch.gpu_capabilities()
    if not caps or any(cc != (9, 0) for cc in caps):
        shown = ", ".join(f"{a}.{b}" for a, b in caps) or "unknown"
        return False, (f"flash_attn3_jax's kernels serve compute capability 9.0 (sm90) "
                       f"only; the visible GPUs are {shown}")
    p = cfg.params
    if not p.seq_major:
        return False, ("flash_mha takes [B, L, H, D]; the MLX entry's [B, H, L, D] would need "
                       "transposes of q, k, v and the output: use "
                       "jax_sdpa.dot_product_attention (the jax.nn entry)")
    if cfg.dtype not in _DTYPES:
        return False, f"flash_mha needs float16 or bfloat16, got {cfg.dtype}"
    if (cfg.head_dim, cfg.head_dim_v) != (HEAD_DIM, HEAD_DIM):
        return False, (f"flash_attn3_jax's wheels serve head dim {HEAD_DIM} only (D = Dv = "
                       f"{HEAD_DIM}), got D = {cfg.head_dim}, Dv = {cfg.head_dim_v}")
    if min(cfg.batch, cfg.len_q, cfg.len_kv) == 0:
        return False, "an empty batch or sequence (our own paths return the empty result)"
    if cfg.heads_kv == 0 or cfg.heads_q % cfg.heads_kv:
        return False, (f"query heads ({cfg.heads_q}) must be a multiple of kv heads "
                       f"({cfg.heads_kv})")
    unserved = [what for what, used in (
        ("mask or bias", cfg.mask_kind != MASK_NONE),
        ("sinks", cfg.has_sinks),
        ("query lengths", cfg.has_q_lengths),
        ("key/value lengths", cfg.has_kv_lengths),
        ("segment ids", cfg.has_segment_ids),
        ("logits_soft_cap", p.logits_soft_cap > 0)) if used]
    if unserved:
        return False, "flash_mha takes no " + ", ".join(unserved)
    banded = p.window_left >= 0 or p.window_right >= 0
    if banded and cfg.len_q != cfg.len_kv and not p.bottom_right:
        return False, (f"flash_mha aligns causal/window bottom-right, the jax.nn entry "
                       f"top-left: they agree only when Lq == Lk (Lq = {cfg.len_q}, "
                       f"Lk = {cfg.len_kv})")
    if needs_lse:
        return False, "return_residual=True needs the lse, which flash_mha does not return"
    return True, "FlashAttention-3 (flash_attn3_jax.flash_mha, its own backward)"


def flash_mha_arguments(params: StaticParams) -> dict:
    """Our scale and band as flash_mha's keyword arguments: causal is window_right == 0
    with no left bound; any other band is its window_size (left, right), -1 unbounded."""
    left, right = params.window_left, params.window_right
    causal = right == 0 and left < 0
    return dict(softmax_scale=float(params.scale), is_causal=causal,
                window_size=(-1, -1) if causal else (int(left), int(right)))


def attend(q, k, v, params: StaticParams):
    """out [B, Lq, Hq, Dv] of q [B, Lq, Hq, D], k / v [B, Lk, Hk, D] through flash_mha
    (a call `serves` accepted)."""
    return module().flash_mha(q, k, v, **flash_mha_arguments(params))
