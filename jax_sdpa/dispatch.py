"""Which implementation serves a call: one `Plan` per lowering.

`plan(cfg, platform, direction, implementation)` decides once what a lowering emits: the
implementation, its FFI target, the bytes of workspace the target takes and why. Each
implementation has a rule returning (ok, reason); the platform's preference order is walked
and the first that serves wins (the pure-JAX ones always do), so `implementation=None` never
fails for want of a kernel; a named implementation that can't serve raises
`NotImplementedError` with its reason. Every verdict of one call is computed once (`_Call`,
`_PagedCall`). An entry point that names an implementation makes the plan at trace time (its
error raised there) and carries it to the lowering in the primitive's params; the lowering
takes it where it was made for the very call it lowers (`lowering_plan`), else plans anew.

What the native code owns is asked from its module, never re-derived here: from
`_sdpa_cuda` the decode kernels' workspace bytes, default kernel and refusals, the flash
kernels' refusals and wgmma availability, cuDNN's band alignment and the refusals of our
cuDNN graphs; from `_sdpa_cpu` the CPU kernel's head-dim refusal. The measured crossovers
between implementations are rows of `jax_sdpa/tuning.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Optional

import numpy as np

from jax_sdpa import _ext, flash_attn3, tuning
from jax_sdpa.config import (FP32_PRECISION_HIGHEST, MASK_ADDITIVE, MASK_BOOL, MASK_NONE,
                             Config)

IMPLEMENTATIONS = ("cudnn", "cuda", "flash_attn3", "metal", "cpu", "xla", "xla_chunked")
FUSED_PLATFORMS = {"cudnn": "cuda", "cuda": "cuda", "flash_attn3": "cuda", "metal": "cpu",
                   "cpu": "cpu"}

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype("bfloat16"))

Verdict = tuple  # (ok: bool, reason: str)


def _ok(reason="serves this call"):
    return True, reason


def _no(reason):
    return False, reason


def _platform_check(name, platform):
    want = FUSED_PLATFORMS[name]
    if platform != want:
        where = {"cuda": "a CUDA GPU (jax platform 'cuda')",
                 "cpu": "the CPU platform"}[want]
        return _no(f"'{name}' needs {where}; this call lowers for platform '{platform}'")
    return None


def installed(name: str) -> bool:
    """Whether implementation `name`'s kernels are present here at all (a compiled module
    of ours, or for "flash_attn3" the flash-attn3-jax package); the pure-JAX ones always."""
    if name not in FUSED_PLATFORMS:
        return True
    if name == "flash_attn3":
        return flash_attn3.installed()
    return _ext.has_backend(name)


def _backend_missing(backend: str) -> str:
    """Why a backend's module is not here (not built, or failed to load) and the fix."""
    return _ext.unavailable_reason(backend) or "its FFI targets are not registered"


_FEATURE_TEXT = {"segment_ids": "segment ids (packed sequences)",
                 "logits_soft_cap": "logits_soft_cap"}


def _unserved_features(cfg: Config, target: str, label: str) -> Optional[Verdict]:
    """A refusal naming the contract features the call uses that FFI target `target`'s
    kernels don't serve (the set its handler registered, ffi/registry.h); None if none."""
    missing = sorted(cfg.features - _ext.served_features(target))
    if missing:
        return _no(f"{label} ({target}) does not serve "
                   + " or ".join(_FEATURE_TEXT[m] for m in missing))
    return None


def _common_fused_checks(cfg: Config):
    if cfg.dtype not in _FLOAT_DTYPES:
        return _no(f"dtype {cfg.dtype} is not float32, float16 or bfloat16")
    return None


# ---- one rule per implementation -------------------------------------------

def supports_xla(cfg: Config, direction: str, platform: str) -> Verdict:
    return _ok("exact einsum softmax in XLA (materializes the scores)")


def supports_xla_chunked(cfg: Config, direction: str, platform: str) -> Verdict:
    return _ok("online softmax over key blocks in XLA (O(L) memory)")


def supports_cpu(cfg: Config, direction: str, platform: str) -> Verdict:
    if (r := _platform_check("cpu", platform)) is not None:
        return r
    native = _ext.module("_sdpa_cpu")
    if not _ext.has_backend("cpu") or native is None:
        return _no(f"the native CPU kernel: {_backend_missing('cpu')}")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if why := native.unsupported_reason(*_shape_args(cfg)):
        return _no(why)
    if (r := _unserved_features(cfg, f"jax_sdpa_cpu_{direction}", "the CPU kernel")):
        return r
    return _ok("native flash-attention kernel: faster than xla on every CPU shape measured "
               "(benchmarks/results/cpu_2core/), O(L) memory")


def supports_metal(cfg: Config, direction: str, platform: str) -> Verdict:
    """Metal kernels (metal/): on macOS the GPU, on Linux the CPU emulator of the same
    kernels (tests only). The shapes they refuse (head dims, lengths) come from the
    `_sdpa_metal` module (metal/host/host_plan.h: unsupported_reason); every mask form,
    sinks, lengths, windows, GQA."""
    if (r := _platform_check("metal", platform)) is not None:
        return r
    mod = _ext.module("_sdpa_metal")
    if not _ext.has_backend("metal") or mod is None:
        return _no(f"the Metal backend: {_backend_missing('metal')}")
    if not mod.available():
        return _no(f"no Metal device: {mod.describe()}")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if why := mod.unsupported_reason(*_shape_args(cfg)):
        return _no(f"the Metal kernels: {why}")
    if (r := _unserved_features(cfg, f"jax_sdpa_metal_{direction}", "the Metal kernels")):
        return r
    if sys.platform != "darwin":
        return _ok("serves this call on the CPU emulator of the Metal kernels (a test tool: "
                   "used only when named)")
    return _ok("our Metal kernels on the GPU")


def _cudnn_facts():
    """(loaded cuDNN version, (major, minor) of the weakest visible GPU), cached.
    (-1, (0, 0)) when they can't be read."""
    global _CUDNN_FACTS
    if _CUDNN_FACTS is None:
        version, cc = -1, (0, 0)
        try:
            version = int(_ext.module("_sdpa_cuda").cudnn_version())
        except Exception:
            pass
        try:
            import jax
            caps = [tuple(int(x) for x in str(d.compute_capability).split("."))
                    for d in jax.devices("gpu")]
            cc = min(caps) if caps else (0, 0)
        except Exception:
            pass
        _CUDNN_FACTS = (version, cc)
    return _CUDNN_FACTS


_CUDNN_FACTS = None


def _cudnn_version_str(v):
    return f"{v // 10000}.{(v // 100) % 100}.{v % 100}"


def _native():
    """The `_sdpa_cuda` module (None when it is not built): the native facts."""
    return _ext.module("_sdpa_cuda")


def _shape_args(cfg: Config):
    return (cfg.dtype.name, cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.len_q, cfg.len_kv,
            cfg.head_dim, cfg.head_dim_v)


def cudnn_header_version() -> int:
    """CUDNN_VERSION of the headers the CUDA module was built with (-1: no module)."""
    native = _native()
    return -1 if native is None else int(native.cudnn_compiled_version())


def segments_as_mask(cfg: Config) -> Optional[Config]:
    """The call with its segment ids as a dense additive mask [B, 1, Lq, Lk] of the input
    dtype (0 where the ids match, -inf elsewhere): how our cuDNN graphs serve packed
    sequences (the lowering builds that mask from the ids). None when the call has no
    segment ids, has a mask of its own, or the mask would exceed
    tuning.CUDNN_SEGMENT_MASK_MAX_BYTES."""
    if not cfg.has_segment_ids or cfg.mask_kind != MASK_NONE:
        return None
    if cfg.batch * cfg.len_q * cfg.len_kv * cfg.dtype.itemsize > \
            tuning.CUDNN_SEGMENT_MASK_MAX_BYTES:
        return None
    return dataclasses.replace(cfg, has_segment_ids=False, mask_kind=MASK_ADDITIVE,
                               mask_shape=(cfg.batch, 1, cfg.len_q, cfg.len_kv),
                               mask_dtype=cfg.dtype)


def _supports_cudnn(call: "_Call") -> Verdict:
    """What our cuDNN graphs (cuda/cudnn/cudnn_sdpa.cc) serve; cuDNN's own support check
    still runs when the graph is built and its message is raised if it refuses. Segment
    ids are served as the mask `segments_as_mask` describes."""
    cfg, direction = call.cfg, call.direction
    if cfg.has_segment_ids and (masked := segments_as_mask(cfg)) is not None:
        ok, reason = _Call(masked, direction, call.platform).cudnn
        return (ok, f"segment ids as a [B, 1, Lq, Lk] mask; {reason}") if ok else (ok, reason)
    if (r := _platform_check("cudnn", call.platform)) is not None:
        return r
    native = _native()
    if not _ext.has_backend("cudnn") or native is None:
        return _no(f"the CUDA backend (cuDNN graphs): {_backend_missing('cuda')}")
    if cfg.dtype not in (np.dtype(np.float16), np.dtype("bfloat16")):
        return _no(f"cuDNN SDPA needs float16 or bfloat16, got {cfg.dtype}")
    version, cc = _cudnn_facts()
    if version < 90000:
        return _no("cuDNN >= 9.0 is needed, the loaded one is "
                   + ("unknown" if version < 0 else _cudnn_version_str(version)))
    headers = cudnn_header_version()
    if headers > 0 and version // 10000 != headers // 10000:
        return _no(f"the loaded cuDNN {_cudnn_version_str(version)} is not of the major "
                   f"version this module was built against ({_cudnn_version_str(headers)})")
    if cc < (8, 0):
        return _no(f"cuDNN SDPA needs compute capability >= 8.0 (Ampere), this GPU is "
                   f"{cc[0]}.{cc[1]}")
    d, dv = cfg.head_dim, cfg.head_dim_v
    if d % 8 or dv % 8:
        return _no(f"head dims ({d}, {dv}) must be multiples of 8 for cuDNN")
    limit = 256 if cc[0] == 9 else 128  # Hopper: 256; Ampere/Ada/Blackwell: 128
    if max(d, dv) > limit and not (cc[0] >= 10 and (d, dv) == (192, 128)):
        return _no(f"head dims ({d}, {dv}) above cuDNN's {limit} on compute capability "
                   f"{cc[0]}.{cc[1]}")
    p = cfg.params
    aligned_br = bool(native.cudnn_bottom_right_aligned(
        cfg.len_q, cfg.len_kv, p.window_left, p.window_right, p.bottom_right,
        cfg.has_q_lengths or cfg.has_kv_lengths))
    if aligned_br and version < 90600:
        return _no("bottom-right aligned causal/window needs cuDNN >= 9.6, the loaded one is "
                   + _cudnn_version_str(version))
    if p.window_left >= 0 and version < 91002:
        if p.window_right < 0 or cfg.mask_kind != MASK_NONE:
            return _no("a left window without a right bound, or with a mask, needs "
                       "cuDNN >= 9.10.2, the loaded one is " + _cudnn_version_str(version))
    if cfg.has_sinks and version < 91300:
        return _no("attention sinks need cuDNN >= 9.13, the loaded one is " + _cudnn_version_str(version))
    soft_cap_from = tuning.CUDNN_SOFT_CAP_MIN_VERSION
    if p.logits_soft_cap > 0 and (cc < (9, 0) or version < soft_cap_from):
        return _no("soft-capping runs as cuDNN's score modifier (a flexible graph), which "
                   "needs compute capability >= 9.0 and is validated from cuDNN "
                   f"{_cudnn_version_str(soft_cap_from)}; here {cc[0]}.{cc[1]}, "
                   "cuDNN " + _cudnn_version_str(version))
    # what the handlers refuse (cuda/cudnn/cudnn_sdpa.cc unsupported_reason): soft-capping
    # with lengths, per-batch sinks
    if why := native.cudnn_unsupported_reason(
            cfg.batch, p.logits_soft_cap, cfg.has_q_lengths or cfg.has_kv_lengths,
            cfg.has_sinks and cfg.sinks_batch > 1):
        return _no(why)
    if aligned_br and cfg.mask_kind != MASK_NONE:
        # cuDNN 9.19: "Bottom right causal mask is only supported with is_bias=False"
        # (forward and backward); a bool mask is passed as a bias too.
        return _no("cuDNN does not combine a bottom-right aligned causal/window "
                   "(Lq != Lk or lengths) with a mask or bias")
    if direction == "bwd" and cfg.len_q == 1 and cfg.len_kv == 1:
        return _no("cuDNN's backward has no kernel for Lq = Lk = 1")
    if (r := _unserved_features(cfg, f"jax_sdpa_cudnn_{direction}", "our cuDNN graphs")):
        return r
    what = "fused flash attention"
    if cfg.mask_kind == MASK_BOOL:
        what += " (the bool mask becomes an additive -inf bias)"
    return _ok(f"{what}, cuDNN {_cudnn_version_str(version)} loaded (built against "
               f"{_cudnn_version_str(headers)})")


def supports_cudnn(cfg: Config, direction: str, platform: str) -> Verdict:
    return _Call(cfg, direction, platform).cudnn


# Our decode kernels' default kernel (as the native plan names it) -> what explain says.
_DECODE_KERNEL_TEXT = {
    "decode_simt_kernel": "fp32 exact, on CUDA cores",
    "decode_wide_f32_kernel": ("fp32 exact, on CUDA cores, the warps split the head dims, "
                               "cuda/decode/decode_wide_f32.cuh"),
    "decode_tc_kernel": "tensor cores",
    "decode_wide_kernel": "tensor cores",
    "decode_tma_kernel": "tensor cores, K/V fed by TMA on sm_90+, cuda/decode/decode_tma.cuh",
    "decode_wide_tma_kernel": ("tensor cores, the warps split the head dims, K/V fed by TMA "
                               "on sm_90+, cuda/decode/decode_wide_tma.cuh"),
}

# The FFI targets of our CUDA kernels: the decode kernels (forward only) and the flash
# kernels.
CUDA_DECODE_TARGET = "jax_sdpa_cuda_fwd"
# cuDNN's forward for a call whose lse nobody reads: no softmax stats, lse filled with NaN.
CUDNN_FWD_NO_LSE_TARGET = "jax_sdpa_cudnn_fwd_no_lse"
CUDNN_BWD_TARGET = "jax_sdpa_cudnn_bwd"
CUDNN_TARGETS = frozenset({"jax_sdpa_cudnn_fwd", CUDNN_FWD_NO_LSE_TARGET, CUDNN_BWD_TARGET})


def _cuda_target(kernel: str, direction: str) -> str:
    return CUDA_DECODE_TARGET if kernel == "decode" else f"jax_sdpa_cuda_flash_{direction}"


def _native_refusal(cfg: Config, family: str, label: str) -> Optional[Verdict]:
    """The native refusal of one of our kernel families ("decode" | "flash"), None if it
    serves the shapes."""
    native = _native()
    if native is None:
        return _no("our CUDA kernels are not built into this installation")
    why = getattr(native, f"{family}_unsupported_reason")(*_shape_args(cfg))
    return _no(f"{label}: {why}") if why else None


def _decode_verdict(call: "_Call") -> Verdict:
    cfg = call.cfg
    if call.direction == "bwd":
        return _no("the decode kernel has no backward")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if not cfg.is_decode:
        return _no("the decode kernel serves few-query (decode) shapes only "
                   f"(Lq = {cfg.len_q}, {cfg.group} query heads per kv head)")
    if (r := _native_refusal(cfg, "decode", "the decode kernel")) is not None:
        return r
    if (r := _unserved_features(cfg, CUDA_DECODE_TARGET, "the decode kernel")):
        return r
    kernel = _native().decode_default_kernel(*_shape_args(cfg))
    return _ok(f"our decode kernel (split-K over the kv cache; "
               f"{_DECODE_KERNEL_TEXT.get(kernel, kernel)})")


def cuda_decode_serves(cfg: Config, direction: str) -> Verdict:
    """Our decode kernels (target jax_sdpa_cuda_fwd, cuda/decode/): forward only, few-query
    shapes, the head dims the module is built for."""
    return _Call(cfg, direction, "cuda").decode


def cuda_decode_workspace_bytes_for(batch: int, heads_q: int, heads_kv: int, len_q: int,
                                    len_kv: int, head_dim_v: int) -> int:
    """Bytes of the decode target's workspace result for these shapes, as the native
    planner sizes it (cuda/decode/decode_attention.h: split-K partials + counters for the
    most splits it can choose; >= 256, never an empty buffer)."""
    native = _native()
    if native is None:
        raise NotImplementedError("jax_sdpa: our CUDA kernels are not built into this "
                                  "installation")
    return int(native.decode_workspace_bytes(batch, heads_q, heads_kv, len_q, len_kv,
                                             head_dim_v))


def cuda_decode_workspace_bytes(cfg: Config) -> int:
    """`cuda_decode_workspace_bytes_for` of a call's config."""
    return cuda_decode_workspace_bytes_for(cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.len_q,
                                           cfg.len_kv, cfg.head_dim_v)


def ffi_workspace_bytes(target: str, cfg: Config) -> int:
    """Bytes of the extra uint8 workspace result that FFI target `target` takes after its
    contract results, where the config alone sizes it (our decode kernel); 0 for a target
    without one, and for the cuDNN targets, whose workspace the lowering sizes
    (`workspace_bytes_at_lowering`)."""
    return cuda_decode_workspace_bytes(cfg) if target == CUDA_DECODE_TARGET else 0


def workspace_bytes_at_lowering(plan: "Plan", operands, results, attrs) -> int:
    """Bytes of the uint8 workspace result of `plan`'s target for a call of these operand
    and result avals (the target's order) and attribute dictionary (0: the target has none).
    A cuDNN target's is sized by the native code (cudnn::scratch_bytes: the workspace of the
    call's cuDNN plan, built now on the current device and kept for the call, plus the
    clamped lengths, converted mask and zeroed copies the graphs read), so the call takes no
    scratch of XLA's and XLA may capture it into a CUDA graph."""
    if plan.target not in CUDNN_TARGETS:
        return plan.workspace_bytes
    if _native() is None:  # no module, so no cuDNN target to call
        return 0
    shaped = lambda avals: tuple((tuple(int(d) for d in a.shape), np.dtype(a.dtype).name)
                                 for a in avals)
    plain = tuple(sorted((k, v.item() if isinstance(v, np.generic) else v)
                         for k, v in attrs.items()))
    return _cudnn_workspace_bytes(plan.target == CUDNN_BWD_TARGET,
                                  plan.target != CUDNN_FWD_NO_LSE_TARGET, shaped(operands),
                                  shaped(results), plain)


@functools.lru_cache(maxsize=1024)
def _cudnn_workspace_bytes(backward, lse_wanted, operands, results, attrs) -> int:
    """Where the native code can't size the workspace (e.g. no GPU visible), one piece's
    alignment: the handler then takes what it lacks from XLA's scratch allocator, which only
    a call not being captured into a CUDA graph may use."""
    native = _native()
    unsized = int(native.cudnn_scratch_alignment)
    try:
        n, why = native.cudnn_workspace_bytes(backward, lse_wanted, list(operands),
                                              list(results), dict(attrs))
    except Exception:  # a call the binding can't read (it says why)
        return unsized
    return int(n) if not why else unsized


def _flash_verdict(call: "_Call") -> Verdict:
    cfg = call.cfg
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if (r := _native_refusal(cfg, "flash", "the flash kernels")) is not None:
        return r
    if (r := _unserved_features(cfg, _cuda_target("flash", call.direction),
                                "the flash kernels")):
        return r
    if cfg.dtype == np.dtype(np.float32):
        precision = ("3xTF32, ~fp32 accurate (matmul precision 'highest')"
                     if cfg.params.fp32_precision == FP32_PRECISION_HIGHEST else
                     "TF32 tensor cores (JAX's default matmul precision; "
                     "use jax.default_matmul_precision('highest') for full fp32)")
        return _ok(f"our flash kernels, fp32 as {precision}")
    return _ok("our flash kernels")


def cuda_flash_serves(cfg: Config, direction: str) -> Verdict:
    """Our flash kernels (targets jax_sdpa_cuda_flash_{fwd,bwd}, cuda/flash/): forward and
    backward, every mask form, sinks, lengths, windows, GQA, both layouts."""
    return _Call(cfg, direction, "cuda").flash


def _cuda_kernel(call: "_Call"):
    decode_ok, decode_why = call.decode
    if decode_ok:
        return "decode", f"{decode_why} [{_cuda_target('decode', call.direction)}]"
    flash_ok, flash_why = call.flash
    if flash_ok:
        return "flash", (f"{flash_why} [{_cuda_target('flash', call.direction)}]; not the "
                         f"decode kernel: {decode_why}")
    return None, f"{flash_why}; and {decode_why}"


def cuda_kernel(cfg: Config, direction: str):
    """Which of our CUDA kernels `implementation="cuda"` runs: ("decode" | "flash" | None,
    reason naming the kernel, its FFI target and why). The decode kernel takes the forward
    of every decode-shaped call it serves; the flash kernels everything else they serve
    (and every backward)."""
    return _Call(cfg, direction, "cuda").cuda_kernel


def _supports_cuda(call: "_Call") -> Verdict:
    if (r := _platform_check("cuda", call.platform)) is not None:
        return r
    if not _ext.has_backend("cuda") or _native() is None:
        return _no(f"the CUDA backend (our kernels): {_backend_missing('cuda')}")
    kernel, why = call.cuda_kernel
    return (kernel is not None), why


def supports_cuda(cfg: Config, direction: str, platform: str) -> Verdict:
    return _Call(cfg, direction, platform).verdict("cuda")


def _supports_flash_attn3(call: "_Call") -> Verdict:
    """FlashAttention-3's Hopper kernels through flash-attn3-jax (jax_sdpa/flash_attn3.py)."""
    if (r := _platform_check("flash_attn3", call.platform)) is not None:
        return r
    if (why := flash_attn3.load_error()) is not None:
        return _no(why)
    if (why := flash_attn3.unsupported_reason(call.cfg, call.direction,
                                              _cudnn_facts()[1])):
        return _no(why)
    target = flash_attn3.FWD_TARGET if call.direction == "fwd" else flash_attn3.BWD_TARGET
    if call.cfg.has_segment_ids:
        cap = flash_attn3.max_sequences(1, call.cfg.len_q)
        return _ok(f"FlashAttention-3's varlen kernels (flash-attn3-jax) [{target}] over the "
                   f"runs of equal segment ids, checked when the call runs: each id one run, "
                   f"the key's ids the query's, <= {cap} runs a row; else what "
                   f"implementation=None runs without flash-attn3-jax")
    return _ok(f"FlashAttention-3's Hopper kernels (flash-attn3-jax) [{target}]")


_RULES = {
    "cudnn": _supports_cudnn,
    "cuda": _supports_cuda,
    "flash_attn3": _supports_flash_attn3,
    "metal": lambda call: supports_metal(call.cfg, call.direction, call.platform),
    "cpu": lambda call: supports_cpu(call.cfg, call.direction, call.platform),
    "xla": lambda call: supports_xla(call.cfg, call.direction, call.platform),
    "xla_chunked": lambda call: supports_xla_chunked(call.cfg, call.direction, call.platform),
}


class _Call:
    """One call's verdicts, each computed at most once (a lowering asks several questions
    of the same rules: the preference order, the choice, the target)."""

    def __init__(self, cfg: Config, direction: str, platform: str):
        self.cfg, self.direction, self.platform = cfg, direction, platform
        self._verdicts = {}

    def verdict(self, name: str) -> Verdict:
        if name not in self._verdicts:
            self._verdicts[name] = _RULES[name](self)
        return self._verdicts[name]

    @property
    def cudnn(self) -> Verdict:
        return self.verdict("cudnn")

    @functools.cached_property
    def decode(self) -> Verdict:
        return _decode_verdict(self)

    @functools.cached_property
    def flash(self) -> Verdict:
        return _flash_verdict(self)

    @functools.cached_property
    def cuda_kernel(self):
        return _cuda_kernel(self)


def supports(name: str, cfg: Config, direction: str, platform: str) -> Verdict:
    return _Call(cfg, direction, platform).verdict(name)


# ---- the choice ---------------------------------------------------------------


def _decode_pick(call: "_Call") -> Optional[str]:
    """Where our decode kernel ("cuda") or our own XLA path ("xla") beat cuDNN, as the rows
    of jax_sdpa/tuning.py say (R = Lq * Hq/Hk query rows per kv head; K + V bytes); None:
    the usual order (cuDNN where it serves)."""
    cfg = call.cfg
    rows = cfg.len_q * cfg.group
    dmax = max(cfg.head_dim, cfg.head_dim_v)
    kv_bytes = (cfg.batch * cfg.heads_kv * cfg.len_kv * (cfg.head_dim + cfg.head_dim_v)
                * cfg.dtype.itemsize)
    big = kv_bytes >= tuning.CUDA_DECODE_MIN_KV_BYTES
    if call.cudnn[0]:
        if (cfg.has_kv_lengths or cfg.has_q_lengths) and \
                tuning.CUDA_DECODE_OVER_CUDNN_WITH_LENGTHS:
            return "cuda"
        few_rows, many_rows = tuning.CUDA_DECODE_OVER_CUDNN_ROWS
        if rows <= few_rows and cfg.head_dim == cfg.head_dim_v:
            pick = tuning.CUDA_DECODE_FEW_ROWS.get(cfg.head_dim, (None, None))[0 if big else 1]
            if pick is not None:
                return pick
        return "cuda" if few_rows < rows <= many_rows else None
    if cfg.dtype == np.dtype(np.float32):
        return None
    if dmax > 256:
        return ("cuda" if rows <= tuning.CUDA_DECODE_WIDE_MAX_ROWS
                and kv_bytes >= tuning.CUDA_DECODE_WIDE_MIN_KV_BYTES else None)
    return "cuda" if big else None


def _wgmma_flash_runs(cfg: Config, direction: str) -> bool:
    """Whether our wgmma flash kernel of this direction serves the call on this GPU: the
    native rule (cuda/flash/flash_attention.h: wgmma_serves)."""
    native = _native()
    if native is None:
        return False
    cc = _cudnn_facts()[1]
    return bool(native.flash_wgmma_serves(direction == "bwd", cfg.dtype.name, cfg.head_dim,
                                          cfg.head_dim_v, cc[0], cc[1]))


def _cuda_flash_preferred(cfg: Config, direction: str = "fwd") -> bool:
    """Whether `implementation=None` should run our CUDA flash kernels in this direction on
    a call that cuDNN cannot serve (asked only then), rather than xla / xla_chunked: the
    rows of jax_sdpa/tuning.py. The forward and the backward are separate primitives, each
    lowered with its own choice: the backward takes out and lse, whichever implementation
    made them. Never for decode shapes (the decode kernel's crossover owns those)."""
    if cfg.is_decode:
        return False
    dmax = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.dtype == np.dtype(np.float32):
        return dmax <= tuning.CUDA_FLASH_FP32_MAX_HEAD_DIM
    if dmax <= 256:
        # cuDNN refuses it for a feature (segment ids, soft cap): each feature the call uses
        # must be one our kernels beat the XLA path on in this direction.
        return bool(cfg.features) and all(
            direction in tuning.CUDA_FLASH_FOR_FEATURES.get(f, ()) for f in cfg.features)
    if _wgmma_flash_runs(cfg, direction):
        return True
    return cfg.score_bytes > tuning.XLA_CHUNKED_SCORE_BYTES


def _wide_in_xla_bounds(cfg: Config) -> bool:
    """A 16-bit prefill call at head dims > 256 (which cuDNN can't serve) within the score
    budget of XLA's materialized form, XLA_WIDE_BWD_MAX_SCORE_BYTES: where the two rows
    below may run it in XLA."""
    return (not cfg.is_decode and cfg.dtype != np.dtype(np.float32)
            and max(cfg.head_dim, cfg.head_dim_v) > 256
            and cfg.score_bytes <= tuning.XLA_WIDE_BWD_MAX_SCORE_BYTES)


def _wide_backward_in_xla(cfg: Config, direction: str) -> bool:
    """Whether `implementation=None` runs such a backward as XLA's materialized backward
    rather than our flash backward: the row XLA_WIDE_BWD_MAX_SCORE_BYTES of
    jax_sdpa/tuning.py."""
    return direction == "bwd" and _wide_in_xla_bounds(cfg)


def _wide_forward_in_xla(cfg: Config, direction: str) -> bool:
    """Whether `implementation=None` runs such a forward with no band (not causal, no
    window) and no contract feature as XLA's materialized forward rather than our flash
    forward: the row XLA_WIDE_FWD_UNBANDED of jax_sdpa/tuning.py."""
    p = cfg.params
    return (tuning.XLA_WIDE_FWD_UNBANDED and direction == "fwd" and _wide_in_xla_bounds(cfg)
            and p.window_left < 0 and p.window_right < 0 and not cfg.features)


def _flash_attn3_preferred(cfg: Config, direction: str) -> bool:
    """Whether `implementation=None` tries FlashAttention-3 before cuDNN (where it serves):
    prefill, in the directions and bands of the row FLASH_ATTN3_FIRST of jax_sdpa/tuning.py,
    from its key count (the backward takes out and lse from whichever forward ran)."""
    if cfg.has_segment_ids and not tuning.FLASH_ATTN3_PACKED["prefer"]:
        return False
    band = "causal" if cfg.params.window_right == 0 else "none"
    min_keys = tuning.FLASH_ATTN3_FIRST.get(direction, {}).get(band)
    return not cfg.is_decode and min_keys is not None and cfg.len_kv >= min_keys


def _preference(call: "_Call"):
    """Fused implementations to try, fastest first, on this platform."""
    cfg, platform, direction = call.cfg, call.platform, call.direction
    if platform == "cuda":
        if cfg.is_decode and call.decode[0]:
            pick = _decode_pick(call)
            if pick == "cuda":
                return ["cuda", "cudnn"]
            if pick == "xla":
                return []  # our XLA path (xla_choice)
        if not call.cudnn[0] and (_wide_backward_in_xla(cfg, direction)
                                  or _wide_forward_in_xla(cfg, direction)):
            return ["xla"]
        if not call.cudnn[0] and _cuda_flash_preferred(cfg, direction):
            return ["cuda"]
        if _flash_attn3_preferred(cfg, direction):
            return ["flash_attn3", "cudnn"]
        return ["cudnn"]
    if platform == "cpu":
        # The Metal emulator on Linux is for testing only: never chosen implicitly.
        metal = ["metal"] if sys.platform == "darwin" else []
        return metal + ["cpu"]
    return []


def xla_choice(cfg: Config) -> str:
    """Our XLA path's form for this call: the chunked online softmax above
    XLA_CHUNKED_SCORE_BYTES of float32 scores (jax_sdpa/tuning.py), else the exact one."""
    return "xla_chunked" if cfg.score_bytes > tuning.XLA_CHUNKED_SCORE_BYTES else "xla"


def xla_probs_dtype(cfg: Config, platform: str) -> Optional[str]:
    """The dtype our XLA path's P and dS take into their matmuls: a 16-bit input dtype on
    a GPU (the row XLA_GPU_PROBS_IN_INPUT_DTYPE of jax_sdpa/tuning.py), else None (the
    float32 accumulation dtype)."""
    if (platform in ("cuda", "rocm") and tuning.XLA_GPU_PROBS_IN_INPUT_DTYPE
            and cfg.dtype in (np.dtype(np.float16), np.dtype("bfloat16"))):
        return cfg.dtype.name
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one lowering emits, decided once."""

    implementation: str
    target: Optional[str]  # the FFI custom-call target; None for the pure-JAX ones
    workspace_bytes: int  # bytes of the target's extra uint8 workspace result (0: none)
    reason: str
    # the pure-JAX ones: the dtype P and dS take into their matmuls (None: float32)
    probs_dtype: Optional[str] = None
    # cuDNN with segment ids: the lowering passes them as the mask `segments_as_mask` says
    segments_as_mask: bool = False
    # flash_attn3 with segment ids: the plan of what runs a call whose ids its varlen kernels
    # can't take (checked when the call runs): what implementation=None runs without
    # flash-attn3-jax, named
    fallback: Optional["Plan"] = None
    # (config, platform, direction) of the call the plan was made for (`lowering_plan`)
    call: tuple = dataclasses.field(default=(), repr=False)

    def made_for(self, cfg: Config, platform: str, direction: str) -> bool:
        return self.call == (cfg, platform, direction)


def _choose(call: "_Call", implementation: Optional[str], without=()) -> str:
    if implementation is not None:
        ok, reason = call.verdict(implementation)
        if not ok:
            raise NotImplementedError(
                f"jax_sdpa: implementation={implementation!r} can't serve this call: {reason}")
        return implementation
    for name in _preference(call):
        if name not in without and call.verdict(name)[0]:
            return name
    return xla_choice(call.cfg)


def _target(call: "_Call", name: str) -> str:
    if name == "cuda":
        kernel, why = call.cuda_kernel
        if kernel is None:
            raise NotImplementedError(f"jax_sdpa: implementation='cuda' can't serve this "
                                      f"call: {why}")
        return _cuda_target(kernel, call.direction)
    if name == "cudnn" and call.direction == "fwd" and not call.cfg.params.lse_used:
        return CUDNN_FWD_NO_LSE_TARGET
    if name == "flash_attn3":
        return flash_attn3.FWD_TARGET if call.direction == "fwd" else flash_attn3.BWD_TARGET
    return f"jax_sdpa_{name}_{call.direction}"


def _plan_of(call: "_Call", name: str, cfg: Config) -> Plan:
    """The plan that runs `call` with implementation `name` (one that serves it), made for
    `cfg` (the call's config, its `implementation` as the primitive carries it)."""
    reason = call.verdict(name)[1]
    made_for = (cfg, call.platform, call.direction)
    if name in ("xla", "xla_chunked"):
        return Plan(name, None, 0, reason, xla_probs_dtype(cfg, call.platform), call=made_for)
    target = _target(call, name)
    fallback = None
    if name == "flash_attn3" and cfg.has_segment_ids:
        other = _choose(call, None, without=("flash_attn3",))
        fallback = _plan_of(call, other, dataclasses.replace(
            cfg, params=dataclasses.replace(cfg.params, implementation=other)))
    return Plan(name, target, ffi_workspace_bytes(target, cfg), reason,
                segments_as_mask=name == "cudnn" and cfg.has_segment_ids, fallback=fallback,
                call=made_for)


def plan(cfg: Config, platform: str, direction: str = "fwd",
         implementation: Optional[str] = None, without=()) -> Plan:
    """The implementation, FFI target and workspace of this call (raises
    NotImplementedError when a named implementation can't serve it); `without`: names
    implementation=None passes over."""
    call = _Call(cfg, direction, platform)
    return _plan_of(call, _choose(call, implementation, without), cfg)


def lowering_plan(cfg: Config, platform: str, direction: str,
                  carried: Optional[Plan] = None) -> Plan:
    """The plan a lowering of this call emits: `carried` (made at trace time by the entry
    point that named the implementation, in the primitive's params) where it was made for
    this very call, else a plan of `cfg.params.implementation`. A batched, sharded,
    differentiated or cross-platform lowering sees another call and plans anew."""
    if carried is not None and carried.made_for(cfg, platform, direction):
        return carried
    return plan(cfg, platform, direction, cfg.params.implementation)


def choose(cfg: Config, platform: str, direction: str = "fwd",
           implementation: Optional[str] = None) -> str:
    """The implementation that runs this call (raises NotImplementedError when a
    named one can't)."""
    return _choose(_Call(cfg, direction, platform), implementation)


def explain_choice(cfg: Config, platform: str, direction: str = "fwd"):
    """(chosen, {name: (ok, reason)}) for every implementation."""
    call = _Call(cfg, direction, platform)
    verdicts = {name: call.verdict(name) for name in IMPLEMENTATIONS}
    return _choose(call, None), verdicts


def ffi_target(name: str, direction: str, cfg: Optional[Config] = None) -> str:
    """The FFI target of implementation `name`. "cuda" is two kernels: the decode kernel
    (`jax_sdpa_cuda_fwd`) or the flash kernels (`jax_sdpa_cuda_flash_{fwd,bwd}`), as
    `cuda_kernel` decides from the call's config."""
    if name == "cuda" and cfg is None:
        raise ValueError("ffi_target('cuda', ...) needs the call's config")
    if name == "flash_attn3":
        return flash_attn3.FWD_TARGET if direction == "fwd" else flash_attn3.BWD_TARGET
    if name != "cuda":
        return f"jax_sdpa_{name}_{direction}"
    return _target(_Call(cfg, direction, "cuda"), name)


# ---- paged KV (jax_sdpa/paged.py) -----------------------------------------------

def paged_target(name: str) -> str:
    """The FFI target of implementation `name`'s paged forward."""
    return f"jax_sdpa_{name}_paged_fwd"


def _without_features(cfg: Config) -> Config:
    """The call without segment ids and soft-capping: what the base rules judge (the paged
    target's own served features are checked separately)."""
    return dataclasses.replace(cfg, has_segment_ids=False, params=dataclasses.replace(
        cfg.params, logits_soft_cap=0.0))


def _paged_rule(call: "_PagedCall", name: str) -> Verdict:
    """Whether implementation `name` serves a paged call (`call.cfg` describes the
    contiguous call it stands for): its module registers the paged target, its kernels serve
    the shapes (the rules of the contiguous forward; on CUDA, our decode kernel's) and the
    target declares the features the call uses."""
    cfg, platform = call.cfg, call.platform
    if name in ("xla", "xla_chunked"):
        return _ok("gathers the pages into a contiguous cache, then "
                   + ("the online softmax over key blocks" if name == "xla_chunked"
                      else "the exact einsum softmax"))
    if (r := _platform_check(name, platform)) is not None:
        return r
    if name == "flash_attn3":
        return _no("flash-attn3-jax is not used for paged calls (our paged targets and the "
                   "XLA gather serve them)")
    target = paged_target(name)
    if target not in _ext.ffi_targets():
        return _no(f"this build's {name} module registers no paged target ({target})")
    ok, why = call.base.decode if name == "cuda" else call.base.verdict(name)
    if not ok:
        return _no(why)
    if (r := _unserved_features(cfg, target, f"the {name} paged kernel")):
        return r
    if name == "cuda":
        why = call.decode_refusal
        kernel = ("our decode kernel through the page table" if not why else
                  f"the flash forward's feature kernel ({why} rules out the paged decode "
                  "kernel)")
        return _ok(f"reads the pages in place with {kernel} [{target}]")
    return _ok(f"reads the pages in place [{target}]")


class _PagedCall:
    """One paged call's verdicts, each computed at most once."""

    def __init__(self, cfg: Config, platform: str):
        self.cfg, self.platform = cfg, platform
        self._verdicts = {}

    def verdict(self, name: str) -> Verdict:
        if name not in self._verdicts:
            self._verdicts[name] = _paged_rule(self, name)
        return self._verdicts[name]

    @functools.cached_property
    def base(self) -> _Call:
        """The contiguous forward without features, which the base rules judge."""
        return _Call(_without_features(self.cfg), "fwd", self.platform)

    @functools.cached_property
    def decode_refusal(self) -> str:
        """Why our CUDA paged target runs the flash feature kernel rather than the paged
        decode kernel for this call ('' when the decode kernel reads the pages), as the
        CUDA module says."""
        if self.cfg.features:
            return "soft-capping"
        return _native().paged_decode_unsupported_reason(*_shape_args(self.cfg))

    def preferred(self, name: str) -> bool:
        """Whether implementation=None takes `name` for the call where it serves: our CUDA
        target only where the paged decode kernel reads the pages
        (CUDA_PAGED_FLASH_FOR_NONE of jax_sdpa/tuning.py), else the XLA gather."""
        return (name != "cuda" or tuning.CUDA_PAGED_FLASH_FOR_NONE
                or not self.decode_refusal)


def _paged_preference(platform: str):
    if platform == "cuda":
        return ["cuda", "cudnn"]
    if platform == "cpu":
        return (["metal"] if sys.platform == "darwin" else []) + ["cpu"]
    return []


def _plan_paged(call: _PagedCall, implementation: Optional[str]) -> Plan:
    cfg, platform = call.cfg, call.platform
    if implementation is None:
        name = next((n for n in _paged_preference(platform)
                     if call.verdict(n)[0] and call.preferred(n)), None) or xla_choice(cfg)
    else:
        name = implementation
    ok, reason = call.verdict(name)
    if not ok:
        raise NotImplementedError(f"jax_sdpa: implementation={name!r} can't serve this paged "
                                  f"call: {reason}")
    made_for = (cfg, platform, "paged")
    if name in ("xla", "xla_chunked"):
        return Plan(name, None, 0, reason, xla_probs_dtype(cfg, platform), call=made_for)
    target = paged_target(name)
    workspace = cuda_decode_workspace_bytes(cfg) if name == "cuda" else 0
    return Plan(name, target, workspace, reason, call=made_for)


def plan_paged(cfg: Config, platform: str, implementation: Optional[str] = None) -> Plan:
    """The plan of a paged forward: a named implementation runs or raises
    NotImplementedError with its reason; None takes the first fused one whose module serves
    paged calls, else xla / xla_chunked (never fails for want of a kernel)."""
    return _plan_paged(_PagedCall(cfg, platform), implementation)


def paged_lowering_plan(cfg: Config, platform: str, carried: Optional[Plan] = None) -> Plan:
    """`lowering_plan` of a paged forward."""
    if carried is not None and carried.made_for(cfg, platform, "paged"):
        return carried
    return plan_paged(cfg, platform, cfg.params.implementation)


def explain_paged_choice(cfg: Config, platform: str):
    """(chosen, {name: (ok, reason)}) for every implementation of a paged call."""
    call = _PagedCall(cfg, platform)
    verdicts = {name: call.verdict(name) for name in IMPLEMENTATIONS}
    return _plan_paged(call, None).implementation, verdicts
