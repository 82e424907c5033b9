"""The static description of one attention call.

`api.py` builds a `Config` from the (validated, canonical) arguments; `dispatch.py`
decides from it which implementation serves the call; `primitives.py` rebuilds it
from abstract values at lowering time. Only static facts live here: shapes,
dtypes, flags. No arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

MASK_NONE = "none"
MASK_BOOL = "bool"
MASK_ADDITIVE = "additive"

# StaticParams.fp32_precision (the FFI attribute of the same name).
FP32_PRECISION_DEFAULT = 0  # fp32 inputs may use TF32 tensor cores (JAX's GPU default)
FP32_PRECISION_HIGHEST = 1  # full fp32 accuracy

# Values of `jax_default_matmul_precision` that ask for (at least) fp32 accuracy of
# float32 matmuls: the legacy names and the dot-algorithm presets that are fp32-exact
# or emulate it (3xTF32, 6/9xBF16). Everything else (None, "default", "high",
# "tensorfloat32", "bfloat16", ...) is the default.
_HIGHEST_MATMUL_PRECISIONS = frozenset({
    "highest", "float32", "F32_F32_F32", "F64_F64_F64", "TF32_TF32_F32_X3",
    "BF16_BF16_F32_X6", "BF16_BF16_F32_X9"})


def current_fp32_precision() -> int:
    """FP32_PRECISION_HIGHEST when JAX's *current* default matmul precision asks for full
    float32 accuracy, else FP32_PRECISION_DEFAULT.

    Reads `jax.config.jax_default_matmul_precision`, which resolves the thread-local value
    of a `with jax.default_matmul_precision(...)` block before the global one (set by
    `jax.config.update` or the JAX_DEFAULT_MATMUL_PRECISION environment variable), on
    jax 0.10 and 0.11 alike. The value is also part of jit's cache key, so a function
    traced under one precision is retraced under another."""
    import jax

    value = getattr(jax.config, "jax_default_matmul_precision", None)
    if value is None:
        return FP32_PRECISION_DEFAULT
    # A string normally; tolerate a lax.Precision / DotAlgorithmPreset enum member.
    name = getattr(value, "name", None) or str(value)
    name = name.split(".")[-1]
    highest = name in _HIGHEST_MATMUL_PRECISIONS or name.lower() in _HIGHEST_MATMUL_PRECISIONS
    return FP32_PRECISION_HIGHEST if highest else FP32_PRECISION_DEFAULT


@dataclasses.dataclass(frozen=True)
class StaticParams:
    """The primitives' static parameters (they become the FFI attributes)."""

    scale: float
    window_left: int = -1  # -1: unbounded
    window_right: int = -1  # -1: unbounded; causal is 0
    bottom_right: bool = False
    seq_major: bool = False  # False: [B, H, L, D]; True: [B, L, H, D]
    implementation: Optional[str] = None  # None: chosen per platform at lowering
    # FP32_PRECISION_DEFAULT (TF32 allowed for fp32 inputs) or FP32_PRECISION_HIGHEST;
    # unless given, JAX's default matmul precision when the params are made (trace time).
    fp32_precision: int = dataclasses.field(default_factory=current_fp32_precision)
    # Logit soft-capping: logits = cap * tanh(scale * q.k / cap) before masks; 0.0 = off.
    logits_soft_cap: float = 0.0
    # Whether anything reads the forward's lse: False lets the cuDNN forward skip its softmax
    # stats (the entry points without return_residual; differentiation binds True).
    lse_used: bool = True

    @property
    def causal(self) -> bool:
        return self.window_right == 0


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything an implementation needs to know to say whether it can serve a call."""

    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_kv: int
    head_dim: int
    head_dim_v: int
    dtype: np.dtype
    mask_kind: str  # MASK_NONE | MASK_BOOL | MASK_ADDITIVE
    mask_shape: tuple
    mask_dtype: Optional[np.dtype]
    has_sinks: bool
    has_q_lengths: bool
    has_kv_lengths: bool
    params: StaticParams
    sinks_batch: int = 1  # sinks are [sinks_batch, Hq]: 1 (shared) or B (per batch row)
    has_segment_ids: bool = False  # q_segment_ids / kv_segment_ids (packed sequences)

    @property
    def features(self) -> frozenset:
        """The contract features beyond the base call that this call uses (the names the
        native modules' `served_features()` use)."""
        used = set()
        if self.has_segment_ids:
            used.add("segment_ids")
        if self.params.logits_soft_cap > 0:
            used.add("logits_soft_cap")
        return frozenset(used)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def causal(self) -> bool:
        return self.params.causal

    @property
    def score_bytes(self) -> int:
        """Bytes of float32 scores an unfused implementation materializes."""
        return 4 * self.batch * self.heads_q * self.len_q * self.len_kv

    @property
    def is_decode(self) -> bool:
        """Few queries per kv head: the shape of autoregressive decoding."""
        return self.len_q * self.group <= 64 and self.len_q <= 16

    @staticmethod
    def from_shapes(q_shape, k_shape, v_shape, dtype, mask_shape, mask_dtype,
                    has_sinks, has_q_lengths, has_kv_lengths,
                    params: StaticParams, sinks_batch: int = 1,
                    has_segment_ids: bool = False) -> "Config":
        axes = (0, 2, 1, 3) if params.seq_major else (0, 1, 2, 3)  # b, h, l, d
        b, hq, lq, d = (_concrete(q_shape[a], f"q.shape[{a}] ({what})")
                        for a, what in zip(axes, ("batch", "query heads", "query length",
                                                  "head dim")))
        hk, lk = (_concrete(k_shape[a], f"k.shape[{a}] ({what})")
                  for a, what in zip(axes[1:3], ("kv heads", "kv length")))
        _concrete(v_shape[-1], f"v.shape[{len(v_shape) - 1}] (value head dim)")
        if mask_shape is None:
            kind, mdtype = MASK_NONE, None
        else:
            mdtype = np.dtype(mask_dtype)
            kind = MASK_BOOL if mdtype == np.dtype(bool) else MASK_ADDITIVE
        return Config(
            batch=int(b), heads_q=int(hq), heads_kv=int(hk), len_q=int(lq),
            len_kv=int(lk), head_dim=int(d), head_dim_v=int(v_shape[-1]),
            dtype=np.dtype(dtype), mask_kind=kind,
            mask_shape=tuple(mask_shape) if mask_shape is not None else (),
            mask_dtype=mdtype, has_sinks=bool(has_sinks),
            has_q_lengths=bool(has_q_lengths), has_kv_lengths=bool(has_kv_lengths),
            params=params, sinks_batch=int(sinks_batch),
            has_segment_ids=bool(has_segment_ids))


def _concrete(dim, what: str) -> int:
    """A shape entry as an int; a symbolic dimension (jax.export shape polymorphism) raises,
    naming it: the kernels, their launch shapes and the choice among them need sizes."""
    if isinstance(dim, (int, np.integer)):
        return int(dim)
    raise NotImplementedError(
        f"jax_sdpa: {what} is the symbolic dimension {str(dim)!r}; jax_sdpa needs concrete "
        f"shapes (its kernels and the choice among them depend on them): export with a "
        f"concrete size, one export per size")
