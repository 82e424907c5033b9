"""Which implementation serves a call.

Each implementation has a `supports_<name>(cfg, direction)` rule returning
(ok, reason). `choose` walks the platform's preference order and returns the
first that serves (the pure-JAX ones always do), so `implementation=None` never
fails for want of a kernel; a named implementation that can't serve raises
`NotImplementedError` with its reason.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import numpy as np

from jax_sdpa import _ext
from jax_sdpa.config import FP32_PRECISION_HIGHEST, MASK_BOOL, Config

IMPLEMENTATIONS = ("cudnn", "cuda", "metal", "cpu", "xla", "xla_chunked")
FUSED_PLATFORMS = {"cudnn": "cuda", "cuda": "cuda", "metal": "cpu", "cpu": "cpu"}

# Above this many bytes of float32 scores the exact reference switches to the
# chunked one (XLA would otherwise materialize them, several times over in the
# backward).
XLA_CHUNKED_SCORE_BYTES = 256 << 20

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
    if not _ext.has_backend("cpu"):
        return _no("the native CPU kernel is not built into this installation")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if max(cfg.head_dim, cfg.head_dim_v) > 512:
        return _no(f"head dim {max(cfg.head_dim, cfg.head_dim_v)} > 512")
    return _ok("native flash-attention kernel: faster than xla on every CPU shape measured "
               "(benchmarks/results/cpu_*), O(L) memory")


def supports_metal(cfg: Config, direction: str, platform: str) -> Verdict:
    """Metal kernels (metal_shaders/): on macOS the GPU, on Linux the CPU emulator of the same
    kernels (tests only). Head dims: any multiple of 8 up to 512 (instantiated for buckets
    64/128/256/512 of max(D, Dv)); every mask form, sinks, lengths, windows, GQA."""
    if (r := _platform_check("metal", platform)) is not None:
        return r
    if not _ext.has_backend("metal"):
        return _no("the Metal backend is not built into this installation "
                   "(macOS with Metal, or Linux with JAX_SDPA_METAL_EMULATOR)")
    mod = _ext.module("_sdpa_metal")
    if mod is not None and hasattr(mod, "available") and not mod.available():
        return _no(f"no Metal device: {mod.describe()}")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    d, dv = cfg.head_dim, cfg.head_dim_v
    if max(d, dv) > 512:
        return _no(f"head dim {max(d, dv)} > 512")
    if d % 8 or dv % 8:
        return _no(f"head dims must be multiples of 8 for the Metal kernels (D={d}, Dv={dv})")
    if max(cfg.len_q, cfg.len_kv) >= 1 << 30:
        return _no("sequence length >= 2**30")
    if sys.platform != "darwin":
        return _ok("serves this call on the CPU emulator of the Metal kernels (a test tool: "
                   "used only when named)")
    return _ok("our Metal kernels on the GPU")


def _cudnn_facts():
    """(runtime cuDNN version, (major, minor) of the weakest visible GPU), cached.
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


def supports_cudnn(cfg: Config, direction: str, platform: str) -> Verdict:
    """What our cuDNN graphs (cuda/cudnn_sdpa.cc) serve; cuDNN's own support check
    still runs when the graph is built and its message is raised if it refuses."""
    from jax_sdpa.config import MASK_NONE
    if (r := _platform_check("cudnn", platform)) is not None:
        return r
    if not _ext.has_backend("cudnn"):
        return _no("the cuDNN backend is not built into this installation")
    if cfg.dtype not in (np.dtype(np.float16), np.dtype("bfloat16")):
        return _no(f"cuDNN SDPA needs float16 or bfloat16, got {cfg.dtype}")
    version, cc = _cudnn_facts()
    if version < 90000:
        return _no("cuDNN >= 9.0 is needed, found "
                   + ("none" if version < 0 else _cudnn_version_str(version)))
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
    lengths = cfg.has_q_lengths or cfg.has_kv_lengths
    p = cfg.params
    banded = p.window_left >= 0 or p.window_right >= 0
    # Bottom-right alignment only matters off the square diagonal or with lengths.
    aligned_br = banded and p.bottom_right and (lengths or cfg.len_q != cfg.len_kv)
    if aligned_br and version < 90600:
        return _no("bottom-right aligned causal/window needs cuDNN >= 9.6, found "
                   + _cudnn_version_str(version))
    if p.window_left >= 0 and version < 91002:
        if p.window_right < 0 or cfg.mask_kind != MASK_NONE:
            return _no("a left window without a right bound, or with a mask, needs "
                       "cuDNN >= 9.10.2, found " + _cudnn_version_str(version))
    if cfg.has_sinks and version < 91300:
        return _no("attention sinks need cuDNN >= 9.13, found " + _cudnn_version_str(version))
    if cfg.has_sinks and cfg.batch > 1 and getattr(cfg, "sinks_batch", 1) > 1:
        return _no("cuDNN takes one sink logit per head; per-batch sinks [B, Hq] are "
                   "not supported")
    if aligned_br and cfg.mask_kind != MASK_NONE:
        # cuDNN 9.19: "Bottom right causal mask is only supported with is_bias=False"
        # (forward and backward); a bool mask is passed as a bias too.
        return _no("cuDNN does not combine a bottom-right aligned causal/window "
                   "(Lq != Lk or lengths) with a mask or bias")
    if direction == "bwd" and cfg.len_q == 1 and cfg.len_kv == 1:
        return _no("cuDNN's backward has no kernel for Lq = Lk = 1")
    what = "fused flash attention"
    if cfg.mask_kind == MASK_BOOL:
        what += " (the bool mask becomes an additive -inf bias)"
    return _ok(f"cuDNN {_cudnn_version_str(version)} {what}")


# Instantiated in cuda/decode_attention*.cu.
CUDA_DECODE_HEAD_DIMS = frozenset(
    [(d, d) for d in (64, 72, 80, 96, 128, 192, 256, 512)] + [(192, 128), (96, 64)])

# Our CUDA flash kernels' limits (mirrors unsupported_reason in cuda/flash_attention.cu).
CUDA_FLASH_MAX_HEAD_DIM = 512
CUDA_FLASH_MAX_GRID = 65535  # batch and query heads are grid dimensions
CUDA_FLASH_MAX_LEN = 1 << 30


def cuda_decode_serves(cfg: Config, direction: str) -> Verdict:
    """Our decode kernel (target jax_sdpa_cuda_fwd, cuda/decode_attention*): forward only,
    few-query shapes, the instantiated head dims."""
    if direction == "bwd":
        return _no("the decode kernel has no backward")
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    if not cfg.is_decode:
        return _no("the decode kernel serves few-query (decode) shapes only "
                   f"(Lq = {cfg.len_q}, {cfg.group} query heads per kv head)")
    dims = (cfg.head_dim, cfg.head_dim_v)
    if dims not in CUDA_DECODE_HEAD_DIMS:
        return _no(f"the decode kernel is built for head dims (D, Dv) in "
                   f"{sorted(CUDA_DECODE_HEAD_DIMS)}, not {dims}")
    if cfg.dtype == np.dtype(np.float32):
        if dims == (512, 512):
            return _ok("our decode kernel (split-K over the kv cache; fp32 exact, on CUDA "
                       "cores, the warps split the head dims, cuda/decode_wide_f32.cuh)")
        return _ok("our decode kernel (split-K over the kv cache; fp32 exact, on CUDA cores)")
    if dims in ((128, 128), (256, 256)) and cfg.group * cfg.len_q <= 8:
        return _ok("our decode kernel (split-K over the kv cache; tensor cores, K/V fed by TMA "
                   "on sm_90+, cuda/decode_tma.cuh)")
    if dims == (512, 512):
        return _ok("our decode kernel (split-K over the kv cache; tensor cores, the warps split "
                   "the head dims, K/V fed by TMA on sm_90+, cuda/decode_wide_tma.cuh)")
    return _ok("our decode kernel (split-K over the kv cache; tensor cores)")


# The decode kernel's FFI target (forward only) and the flash kernels' targets.
CUDA_DECODE_TARGET = "jax_sdpa_cuda_fwd"


def _cuda_target(kernel: str, direction: str) -> str:
    return CUDA_DECODE_TARGET if kernel == "decode" else f"jax_sdpa_cuda_flash_{direction}"


# The decode kernel's workspace (the third, uint8 result of CUDA_DECODE_TARGET: split-K
# partials + the fused combine's counters, allocated by XLA so that the call can be
# captured in a CUDA graph). Mirrors make_plan / choose_splits in cuda/decode_attention.cu,
# whose split count is at most min(256, len_kv / min_keys, 2 * slots / units + 2) with
# min_keys >= 32 (one 16-key tile per warp, >= 2 warps) and slots <= SMs x resident
# blocks; make_plan lowers the count to what fits when a workspace is smaller.
CUDA_DECODE_MAX_SPLITS = 256
CUDA_DECODE_SLOTS_BOUND = 160 * 4  # a generous bound on SMs x resident blocks per SM
CUDA_DECODE_MIN_SPLIT_KEYS = 16  # a lower bound on make_plan's min_keys (itself >= 32)
_WORKSPACE_ALIGN = 256


def _pad(nbytes: int) -> int:
    return -(-nbytes // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN


def cuda_decode_workspace_bytes_for(batch: int, heads_q: int, heads_kv: int, len_q: int,
                                    len_kv: int, head_dim_v: int) -> int:
    """Bytes of the decode kernel's workspace result for these shapes (>= 256, never an
    empty buffer). Layout (cuda/decode_attention.h, docs/ffi_contract.md), for n splits and
    rows = B * Hq * Lq: [partial out: n * rows * Dv float32, padded to 256 bytes]
    [partial lse: n * rows float32, padded to 256][counters: units int32, padded to 256],
    units = B * Hk * ceil(G * Lq / rows_per_block). Sized for the largest n the C++
    heuristic can choose: n_max = min(256, 2 * SLOTS_BOUND // units + 2, max(1, Lk // 16)),
    with units at 16 rows per block there (the fewest units, so the most splits), and the
    counters at 8 rows per block (the most units)."""
    rows = batch * heads_q * len_q
    if rows <= 0 or heads_kv <= 0:
        return _WORKSPACE_ALIGN
    group_rows = (heads_q // heads_kv) * len_q
    units_fewest = batch * heads_kv * -(-group_rows // 16)
    units_most = batch * heads_kv * -(-group_rows // 8)
    n_max = min(CUDA_DECODE_MAX_SPLITS, 2 * CUDA_DECODE_SLOTS_BOUND // max(1, units_fewest) + 2,
                max(1, len_kv // CUDA_DECODE_MIN_SPLIT_KEYS))
    if n_max <= 1:
        return _WORKSPACE_ALIGN
    total = (_pad(n_max * rows * head_dim_v * 4) + _pad(n_max * rows * 4)
             + _pad(units_most * 4))
    return max(_WORKSPACE_ALIGN, total)


def cuda_decode_workspace_bytes(cfg: Config) -> int:
    """`cuda_decode_workspace_bytes_for` of a call's config."""
    return cuda_decode_workspace_bytes_for(cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.len_q,
                                           cfg.len_kv, cfg.head_dim_v)


def ffi_workspace_bytes(target: str, cfg: Config) -> int:
    """Bytes of the extra uint8 workspace result that FFI target `target` takes after its
    contract results (0: none). Only our decode kernel has one."""
    return cuda_decode_workspace_bytes(cfg) if target == CUDA_DECODE_TARGET else 0


def cuda_flash_serves(cfg: Config, direction: str) -> Verdict:
    """Our flash kernels (targets jax_sdpa_cuda_flash_{fwd,bwd}, cuda/flash_attention*):
    forward and backward, every mask form, sinks, lengths, windows, GQA, both layouts."""
    if (r := _common_fused_checks(cfg)) is not None:
        return r
    d, dv = cfg.head_dim, cfg.head_dim_v
    if d % 8 or dv % 8:
        return _no(f"head dims must be multiples of 8 for the flash kernels (D={d}, Dv={dv})")
    if max(d, dv) > CUDA_FLASH_MAX_HEAD_DIM:
        return _no(f"head dims above {CUDA_FLASH_MAX_HEAD_DIM} are not supported by the flash "
                   f"kernels (D={d}, Dv={dv})")
    if cfg.batch > CUDA_FLASH_MAX_GRID or cfg.heads_q > CUDA_FLASH_MAX_GRID:
        return _no(f"batch and query heads must each be <= {CUDA_FLASH_MAX_GRID} for the flash "
                   f"kernels (B={cfg.batch}, Hq={cfg.heads_q})")
    if max(cfg.len_q, cfg.len_kv) >= CUDA_FLASH_MAX_LEN:
        return _no("sequence lengths must be < 2**30 for the flash kernels")
    if cfg.dtype == np.dtype(np.float32):
        precision = ("3xTF32, ~fp32 accurate (matmul precision 'highest')"
                     if cfg.params.fp32_precision == FP32_PRECISION_HIGHEST else
                     "TF32 tensor cores (JAX's default matmul precision; "
                     "use jax.default_matmul_precision('highest') for full fp32)")
        return _ok(f"our flash kernels, fp32 as {precision}")
    return _ok("our flash kernels")


def cuda_kernel(cfg: Config, direction: str):
    """Which of our CUDA kernels `implementation="cuda"` runs: ("decode" | "flash" | None,
    reason naming the kernel, its FFI target and why). The decode kernel takes the forward
    of every decode-shaped call it serves; the flash kernels everything else they serve
    (and every backward)."""
    decode_ok, decode_why = cuda_decode_serves(cfg, direction)
    if decode_ok:
        return "decode", f"{decode_why} [{_cuda_target('decode', direction)}]"
    flash_ok, flash_why = cuda_flash_serves(cfg, direction)
    if flash_ok:
        return "flash", (f"{flash_why} [{_cuda_target('flash', direction)}]; not the decode "
                         f"kernel: {decode_why}")
    return None, f"{flash_why}; and {decode_why}"


def supports_cuda(cfg: Config, direction: str, platform: str) -> Verdict:
    if (r := _platform_check("cuda", platform)) is not None:
        return r
    if not _ext.has_backend("cuda"):
        return _no("our CUDA kernels are not built into this installation")
    kernel, why = cuda_kernel(cfg, direction)
    return (kernel is not None), why


_RULES = {
    "cudnn": supports_cudnn,
    "cuda": supports_cuda,
    "metal": supports_metal,
    "cpu": supports_cpu,
    "xla": supports_xla,
    "xla_chunked": supports_xla_chunked,
}


def supports(name: str, cfg: Config, direction: str, platform: str) -> Verdict:
    return _RULES[name](cfg, direction, platform)


# ---- the choice ---------------------------------------------------------------

# Where cuDNN can't serve a 16-bit decode call (sinks, ...): ours from this many bytes of
# K + V on (the measured rows, 134-537 MB, all won; small calls are xla's).
CUDA_DECODE_MIN_KV_BYTES = 32 << 20
# ... and at head dims > 256 (the wide kernels: 8 query rows a block) from this many, at up
# to 8 query rows per kv head (docs/cuda_decode.md, eleventh session).
CUDA_DECODE_WIDE_MIN_KV_BYTES = 64 << 20


def _decode_pick(cfg: Config, direction: str, platform: str) -> Optional[str]:
    """Where our decode kernel ("cuda") or our own XLA path ("xla") beat cuDNN on the H200
    (docs/cuda_decode.md; K = 64..1024 dependent calls per timed execution, 2026-11-30);
    None: the usual order (cuDNN where it serves). With R = Lq * Hq/Hk query rows per kv
    head, cuDNN re-reads K/V per query head once Lq > 1, so ours wins for 4 < R <= 32 (B8
    H32/KV8 Lk4096 D128: 2.2x at R 8, 1.8x at 16, 1.2x at 32, 0.94x at 64; D192 / D256:
    1.4-2.6x at R 8-32, gpu_decode_crossover_20261130T2010.json). Plain decode (R <= 4):
    at D128 cuDNN was as fast or faster (1.0-1.2x), so cuDNN; at D = Dv in {192, 256} it
    was the slowest of ours, cuDNN and our XLA path at 10 of 12 points (H32/KV8 B1-B32
    Lk2048-8192; at B1 Lk2048 ours was): ours from CUDA_DECODE_MIN_KV_BYTES of K + V
    (1.11-1.41x cuDNN at D192, 1.19-1.31x at D256 there), our XLA path below
    (B1 Lk2048: 11.3 / 10.7 us vs cuDNN 12.7 / 13.1, ours 19.7 / 13.6; T2010).
    Where cuDNN can't serve: XLA matched or beat ours on every fp32 row (1.0-1.36x, the
    1.36x at D512 with decode_wide_f32_kernel); 16-bit at D <= 256 ours matched or beat XLA
    (B8 Lk8192 1.0x, B1 Lk32768 1.1x, B64 1.04x) from CUDA_DECODE_MIN_KV_BYTES. 16-bit at
    D512 (decode_wide_tma_kernel) the choice is between ours and our own XLA path (jax.nn's
    xla, faster still on small calls, is not ours to pick): ours from
    CUDA_DECODE_WIDE_MIN_KV_BYTES at up to 8 query rows per kv head (bf16 H32/KV8 plain
    decode, 1.02-1.12x our XLA path from B1 Lk8192 / B8 Lk1024, 128 MiB, to B32 Lk8192, and
    1.08x at 8 rows; B1 H32/KV4 Lk8192, 64 MiB, 1.07x; below 64 MiB mixed: B1 Lk2048 our
    XLA path 1.13x, B1 Lk1024 ours 1.15x, B1 H32/KV4 Lk1024 fp16 our XLA path 1.17x; 16 and
    32 rows per kv head re-read K/V per 8-row chunk: our XLA path 1.25x / 2.2x;
    gpu_decode_crossover_20261201T0334.json, gpu_decode_bench_20261201T0333.json)."""
    rows = cfg.len_q * cfg.group
    dmax = max(cfg.head_dim, cfg.head_dim_v)
    kv_bytes = (cfg.batch * cfg.heads_kv * cfg.len_kv * (cfg.head_dim + cfg.head_dim_v)
                * cfg.dtype.itemsize)
    big = kv_bytes >= CUDA_DECODE_MIN_KV_BYTES
    if supports_cudnn(cfg, direction, platform)[0]:
        if rows <= 4 and cfg.head_dim == cfg.head_dim_v and cfg.head_dim in (192, 256):
            return "cuda" if big else "xla"
        return "cuda" if 4 < rows <= 32 else None
    if cfg.dtype == np.dtype(np.float32):
        return None
    if dmax > 256:
        return "cuda" if rows <= 8 and kv_bytes >= CUDA_DECODE_WIDE_MIN_KV_BYTES else None
    return "cuda" if big else None


_WGMMA_KNOBS = {"fwd": "JAX_SDPA_FLASH_WGMMA", "bwd": "JAX_SDPA_FLASH_WGMMA_BWD"}


def _wgmma_flash_runs(direction: str) -> bool:
    """Whether our wgmma flash kernel of this direction (cuda/flash_fwd_wgmma.cu,
    cuda/flash_bwd_wgmma.cu: 16-bit D, Dv in (256, 512]) runs here: they exist as sm_90a code
    only (compute capability 9.0: H100 / H200), and JAX_SDPA_FLASH_WGMMA=0 /
    JAX_SDPA_FLASH_WGMMA_BWD=0 turn them off (the wide-head kernels run then)."""
    return (_cudnn_facts()[1] == (9, 0)
            and os.environ.get(_WGMMA_KNOBS[direction], "1") != "0")


def _cuda_flash_preferred(cfg: Config, direction: str = "fwd") -> bool:
    """Whether `implementation=None` should run our CUDA flash kernels in this direction on
    a call that cuDNN cannot serve (asked only then), rather than xla / xla_chunked. The
    forward and the backward are separate primitives, each lowered with its own choice: the
    backward takes out and lse, whichever implementation made them.

    Measured on the H200 (2026-11-30, benchmarks/results/flash_tc_*, flash_bench_api_*):
    fp32 SD3 B2 H38 L4250 D64 ours 92-96 / 85-88 TFLOP/s fwd / fwd+bwd vs xla 39-41 / 51-52,
    1.2 MiB / 78 MiB vs 10.2 / 15.3 GiB of temporaries; fp32 B1 H16 L8192 D128 ours
    113-117 / 100-101 vs xla 97-107 / 124-127 (xla's backward is faster there, with 12 GiB
    of scores: we keep O(L) memory). 16-bit at head dims > 256, D512 bf16 causal, with the
    wgmma kernels (H100 / H200; T2352): B1 H16 L4096 ours 166-198 / 138-143 vs our XLA path
    84-93 / 114-121 (4 GiB) and xla_chunked 47 / 60; B4 H8 L1024 (128 MiB of scores) ours
    90 / 92 (through the API) vs ours forward + our XLA backward 82 and our XLA path 77: ours
    in both directions. Without them (other GPUs, or the knobs): the wide-head kernels,
    114-119 / 94 vs xla 130 / 173, so only where xla would materialize more scores than
    XLA_CHUNKED_SCORE_BYTES. Never for decode shapes (the decode kernel and its crossover,
    `_decode_pick`, own those).
    """
    if cfg.is_decode:
        return False
    dmax = max(cfg.head_dim, cfg.head_dim_v)
    if cfg.dtype == np.dtype(np.float32):
        return dmax <= 128
    if dmax <= 256:
        return False
    if min(cfg.head_dim, cfg.head_dim_v) > 256 and _wgmma_flash_runs(direction):
        return True
    return cfg.score_bytes > XLA_CHUNKED_SCORE_BYTES


def _preference(cfg: Config, platform: str, direction: str):
    """Fused implementations to try, fastest first, on this platform."""
    if platform == "cuda":
        if cfg.is_decode and cuda_decode_serves(cfg, direction)[0]:
            pick = _decode_pick(cfg, direction, platform)
            if pick == "cuda":
                return ["cuda", "cudnn"]
            if pick == "xla":
                return []  # our XLA path (_xla_choice)
        if (not supports_cudnn(cfg, direction, platform)[0]
                and _cuda_flash_preferred(cfg, direction)):
            return ["cuda"]
        return ["cudnn"]
    if platform == "cpu":
        # The Metal emulator on Linux is for testing only: never chosen implicitly.
        metal = ["metal"] if sys.platform == "darwin" else []
        return metal + ["cpu"]
    return []


def _xla_choice(cfg: Config) -> str:
    return "xla_chunked" if cfg.score_bytes > XLA_CHUNKED_SCORE_BYTES else "xla"


def choose(cfg: Config, platform: str, direction: str = "fwd",
           implementation: Optional[str] = None) -> str:
    """The implementation that runs this call (raises NotImplementedError when a
    named one can't)."""
    if implementation is not None:
        ok, reason = supports(implementation, cfg, direction, platform)
        if not ok:
            raise NotImplementedError(
                f"jax_sdpa: implementation={implementation!r} can't serve this call: {reason}")
        return implementation
    for name in _preference(cfg, platform, direction):
        if supports(name, cfg, direction, platform)[0]:
            return name
    return _xla_choice(cfg)


def explain_choice(cfg: Config, platform: str, direction: str = "fwd"):
    """(chosen, {name: (ok, reason)}) for every implementation."""
    verdicts = {name: supports(name, cfg, direction, platform) for name in IMPLEMENTATIONS}
    return choose(cfg, platform, direction), verdicts


def ffi_target(name: str, direction: str, cfg: Optional[Config] = None) -> str:
    """The FFI target of implementation `name`. "cuda" is two kernels: the decode kernel
    (`jax_sdpa_cuda_fwd`) or the flash kernels (`jax_sdpa_cuda_flash_{fwd,bwd}`), as
    `cuda_kernel` decides from the call's config."""
    if name == "cuda":
        if cfg is None:
            raise ValueError("ffi_target('cuda', ...) needs the call's config")
        kernel, why = cuda_kernel(cfg, direction)
        if kernel is None:
            raise NotImplementedError(f"jax_sdpa: implementation='cuda' can't serve this "
                                      f"call: {why}")
        return _cuda_target(kernel, direction)
    return f"jax_sdpa_{name}_{direction}"
