"""The measured thresholds `dispatch` applies between implementations, as one table.

Each row is a value with the reason it has that value and the results file it came from
(benchmarks/results/, measured on one H200 unless the row says otherwise). The kernels'
own tile choices are in their families' tables: cuda/decode/decode_tuning.h and
cuda/flash/flash_tuning.h.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Row:
    value: object
    reason: str
    results: str


ROWS = {
    "XLA_CHUNKED_SCORE_BYTES": Row(
        256 << 20,
        "above this many bytes of float32 scores our XLA path runs the chunked online "
        "softmax (O(L) memory) instead of materializing the scores, several times over in "
        "the backward (a memory bound, not a speed crossover; tests/test_memory.py holds "
        "the chunked path's temporaries far below the scores). fp32 B1 H8 D64 fwd+bwd on "
        "the 2-core CPU: 128 MiB of scores (L2048) xla 2.5 s with 512 MiB of temporaries, "
        "xla_chunked 7.7 s with 334 MiB; 512 MiB of scores (L4096) xla 9.5 s with 2.0 GiB, "
        "xla_chunked 13.6 s with 345 MiB",
        "benchmarks/results/cpu_2core/small.json"),
    "CUDA_DECODE_OVER_CUDNN_ROWS": Row(
        (4, 32),
        "where cuDNN serves a decode call, our decode kernel for 4 < R <= 32 query rows per "
        "kv head (cuDNN re-reads K/V per query head once Lq > 1): B8 H32/KV8 Lk4096 D128 "
        "2.2x at R 8, 1.8x at 16, 1.2x at 32, 0.94x at 64",
        "benchmarks/results/h200/decode_tuning/crossover_20261130T2010.json"),
    "CUDA_DECODE_FEW_ROWS": Row(
        {128: ("cuda", None), 192: ("cuda", "xla"), 256: ("cuda", "xla")},
        "where cuDNN serves a 16-bit decode call with R <= 4 query rows per kv head (the "
        "lower bound of CUDA_DECODE_OVER_CUDNN_ROWS) and "
        "D = Dv: head dim -> (what runs it from CUDA_DECODE_MIN_KV_BYTES of K + V, what runs "
        "it below), None for cuDNN; other head dims cuDNN. D128: our decode kernel B8 "
        "H32/KV8 Lk8192 3804 vs 3524 GB/s for our cuDNN graph, B1 Lk32768 3048 vs 2797, B64 "
        "Lk2048 4079 vs 4030; at D64 (B8 Lk8192) cuDNN stays ahead, 3019 vs 2215. D192 / "
        "D256: cuDNN was the slowest at 10 of 12 measured points, our decode kernel ahead "
        "from CUDA_DECODE_MIN_KV_BYTES, our XLA path below",
        "benchmarks/results/h200/peers_decode.json, "
        "benchmarks/results/h200/decode_tuning/crossover_20261130T2010.json"),
    "CUDA_DECODE_MIN_KV_BYTES": Row(
        32 << 20,
        "16-bit decode at D <= 256 that cuDNN can't serve (sinks before cuDNN 9.13, ...), "
        "and plain decode (R <= 4, CUDA_DECODE_FEW_ROWS): our decode kernel from this many "
        "bytes of K + V (1.0-1.41x cuDNN or XLA on the measured rows), our XLA path below",
        "benchmarks/results/h200/decode_tuning/crossover_20261130T2010.json"),
    "CUDA_DECODE_WIDE_MIN_KV_BYTES": Row(
        512 << 20,
        "16-bit decode at head dims > 256 (decode_wide_tma_kernel): ours from this many bytes "
        "of K + V, our XLA path below. D512 bf16 H32/KV8, R = 4: ours 1.04-1.08x our XLA "
        "path from 512 MiB (B32 Lk1024 142.7 vs 148.5 us, B8 Lk8192 265.8 vs 285.9), 0.96-0.98x "
        "at 128-256 MiB (B1 Lk8192 44.8 vs 43.3 us, B8 Lk2048 78.1 vs 76.2); B1 H32/KV4 "
        "Lk8192 (64 MiB) ours 2125 GB/s, our XLA path 2612, jax.nn's 2532 (peers_d512.json)",
        "benchmarks/results/h200/decode_crossover_d512.json, "
        "benchmarks/results/h200/peers_d512.json"),
    "CUDA_DECODE_WIDE_MAX_ROWS": Row(
        8,
        "... and at most this many query rows per kv head: 16 and 32 rows re-read K/V per "
        "8-row chunk (our XLA path 1.25x / 2.2x faster there)",
        "benchmarks/results/h200/decode_crossover.json"),
    "CUDA_DECODE_OVER_CUDNN_WITH_LENGTHS": Row(
        True,
        "decode with sequence lengths (the KV-cache call): our decode kernel, not our cuDNN "
        "graph, whose padding-mask engine ran at 0.62-0.66x jax.nn's cuDNN call (B1 H32/KV8 "
        "Lk32768 D128 1764 vs 2689 GB/s; B8 Lk8192 2122 vs 3418, peers.json); our decode "
        "kernel with lengths ran those rows at 3190 and 3765 against jax.nn cudnn's 3245 and "
        "3686 (decode.json)",
        "benchmarks/results/h200/peers.json, benchmarks/results/h200/decode.json"),
    "XLA_WIDE_BWD_MAX_SCORE_BYTES": Row(
        4 << 30,
        "16-bit backward at head dims > 256 on a GPU: XLA's materialized backward (after our "
        "flash forward) up to this many bytes of float32 scores; our wgmma flash backward "
        "ran B1 H16 L4096 D512 causal fwd+bwd at 157 TFLOP/s against 222 for jax.nn's xla "
        "(peers.json). With all three gradients, one run (wide_bwd.json): our flash "
        "forward+backward 6.24 ms, our flash forward 1.29 ms, this backward alone 2.95 ms "
        "with P and dS in bf16 (XLA_GPU_PROBS_IN_INPUT_DTYPE; 5.34 in float32), jax.nn "
        "xla's forward+backward 5.46 ms; None with this row 4.44 ms against 5.52 for "
        "jax.nn xla (217 vs 174 TFLOP/s, peers_features.json)",
        "benchmarks/results/h200/peers.json, benchmarks/results/h200/wide_bwd.json, "
        "benchmarks/results/h200/peers_features.json"),
    "XLA_WIDE_FWD_UNBANDED": Row(
        True,
        "16-bit forward at head dims > 256 with no causal band or window, on a GPU: XLA's "
        "materialized forward (within XLA_WIDE_BWD_MAX_SCORE_BYTES), not our flash forward: "
        "B1 H16 L4096 D512 non-causal, our flash forward 2.27 ms, our XLA forward 1.84, "
        "forward+backward 5.37 ms through our flash forward against 4.41 with this row; "
        "causal, our flash forward stays ahead (1.28 ms vs 1.93) and keeps the row. With "
        "the row (peers_features.json): None 1.85 ms forward (our flash forward 2.32), "
        "forward+backward 4.47 ms against 5.13 for jax.nn xla",
        "benchmarks/results/h200/wide_bwd.json, benchmarks/results/h200/peers_features.json"),
    "XLA_GPU_PROBS_IN_INPUT_DTYPE": Row(
        True,
        "16-bit calls of our XLA path on a GPU round P and dS to the input dtype before "
        "their matmuls (what cuDNN, our flash kernels and jax.nn's autodiff feed the tensor "
        "cores): the backward of B1 H16 L4096 D512 causal ran in 2.95 ms against 5.34 ms "
        "with float32 operands (non-causal 3.00 vs 5.47); with it None (our flash forward "
        "and this backward) ran that row's forward+backward in 4.44 ms against jax.nn xla's "
        "5.52 (217 vs 174 TFLOP/s, peers_features.json); on a CPU they stay float32. P V "
        "then writes the output dtype itself: our XLA forward of B1 H16 L4096 D512 1.542 -> "
        "1.506 ms, causal 2.339 -> 2.295 (one H100, processes alternated; decode rows within "
        "noise, xla_pv_out_dtype.json). On an H200 the D512 fp16 Lk1024 decode (8 us a "
        "call) read 735 / 939 / 1048 GB/s through None against 870 / 1003 / 1031 for jax.nn's "
        "xla in three runs, its optimized HLO 4 fusions like jax.nn's (decode_rows_20261207.json)",
        "benchmarks/results/h200/wide_bwd.json, benchmarks/results/h100/xla_pv_out_dtype.json, "
        "benchmarks/results/h200/decode_rows_20261207.json"),
    "CUDA_PAGED_FLASH_FOR_NONE": Row(
        False,
        "implementation=None runs a paged call on our CUDA paged target only where the paged "
        "decode kernel reads its pages (16-bit, D = Dv in {64, 128, 256}, no soft cap: B8 "
        "H32/KV8 Lk8192 D128 bf16 page 64 2558 GB/s, flash-attn3-jax 2130, our XLA gather "
        "1027); the flash feature kernel's paged path ran the fp32 row at 6.15 ms against "
        "0.43 ms for the XLA gather, so there None takes the gather",
        "benchmarks/results/h200/peers_decode.json"),
    "CUDA_FLASH_FOR_FEATURES": Row(
        {"segment_ids": ("fwd", "bwd"), "logits_soft_cap": ("fwd",)},
        "16-bit prefill with a feature cuDNN doesn't serve (segment ids with a mask of the "
        "call's own; soft-capping below cuDNN 9.19 or compute capability 9.0, or with "
        "lengths): our CUDA flash kernels in these directions, our XLA path in the others. Packed B2 H32/KV8 L8192 D128 causal, 8 "
        "segments: ours 7.3 / 40.6 ms fwd / fwd+bwd; the materialized XLA path 23 ms "
        "forward and out of memory for the backward. Soft cap 30 B4 H32 L4096 D128 causal: "
        "ours forward 21.2 ms, None's forward+backward (ours, then the chunked XLA "
        "backward) 81 ms against 117 for ours both ways; the materialized XLA path ran "
        "12.7 / 23.9 ms from 8.6 GB of scores, past XLA_CHUNKED_SCORE_BYTES",
        "benchmarks/results/h200/peers_features.json"),
    "CUDNN_SEGMENT_MASK_MAX_BYTES": Row(
        1 << 30,
        "16-bit prefill with segment ids (packed sequences) and no mask of its own: our "
        "cuDNN graphs with the ids as a dense [B, 1, Lq, Lk] additive mask, up to this many "
        "bytes of mask (a memory bound); above it our CUDA flash kernels "
        "(CUDA_FLASH_FOR_FEATURES); where flash-attn3-jax serves, FLASH_ATTN3_PACKED comes "
        "first. Packed B2 H32/KV8 L8192 D128 causal, 8 segments: through this row 3.55 / "
        "15.9 ms fwd / fwd+bwd, our flash kernels 7.03 / 39.9, jax.nn's cuDNN with the same "
        "mask as a bool array 3.69 / 16.1",
        "benchmarks/results/h200/peers_packed.json"),
    "CUDNN_SOFT_CAP_MIN_VERSION": Row(
        91900,
        "soft-capping on our cuDNN graphs (cuDNN's score modifier, a flexible graph, compute "
        "capability >= 9.0) from this cuDNN version, the one it is validated on: the float64 "
        "oracle's soft-cap cases (tests/test_segments_softcap.py "
        "test_cudnn_soft_cap_against_oracle) pass on the H200 with cuDNN 9.19; below it "
        "the other implementations serve soft-capping (CUDA_FLASH_FOR_FEATURES)",
        "benchmarks/results/h200/pytest_gpu_softcap.xml"),
    "CUDA_FLASH_FP32_MAX_HEAD_DIM": Row(
        128,
        "fp32 prefill that cuDNN refuses: our flash kernels up to this head dim (SD3 B2 H38 "
        "L4250 D64 92-96 / 85-88 TFLOP/s fwd / fwd+bwd vs xla 39-41 / 51-52, 1.2 MiB vs "
        "10.2 GiB of temporaries); above it xla",
        "benchmarks/results/h200/flash.json"),
    "FLASH_ATTN3_FIRST": Row(
        {"fwd": {"causal": 0, "none": 1024}, "bwd": {"causal": 0, "none": 0}},
        "16-bit D128 prefill in the [B, L, H, D] layout that flash-attn3-jax serves: "
        "FlashAttention-3 before cuDNN in these directions and bands (causal / none) from "
        "this many keys. TFLOP/s fwd / fwd+bwd, FlashAttention-3 through us vs our cuDNN "
        "graph (H200): B4 H32 L4096 596 / 572 vs 589 / 533, causal 545 / 525 vs 517 / 478, "
        "B1 H16 L16384 causal 579 / 581 vs 546 / 527, B2 H32/KV8 L8192 causal 574 / 550 vs "
        "541 / 500, B8 H16 L1024 causal 379 / 348 vs 353 / 311, B16 H16 L512 429 / 357 vs "
        "443 / 348. The forward with no band under 1024 keys stays with cuDNN, which leads or "
        "ties there: B16 H16 L512 forward 74.9 us for jax.nn's cuDNN call against 81.6 for "
        "flash-attn3-jax's own (one H100), 443 against 429 TFLOP/s (H200), our cuDNN graph "
        "425-434 against 431 for FlashAttention-3 through us (another H100); from B4 H32 "
        "L4096 FlashAttention-3 leads (1830 vs 1892 us for jax.nn's cuDNN, H100)",
        "benchmarks/results/h200/peers_flash_attn3_short.json, "
        "benchmarks/results/h200/peers_flash_attn3.json, benchmarks/results/h100/peers.json, "
        "benchmarks/results/h100/peers_short.json"),
    "FLASH_ATTN3_PACKED": Row(
        {"prefer": True, "sequences_per_row": {"least": 64, "most": 256, "tokens_each": 64}},
        "16-bit D128 packed self-attention (segment ids, Lq = Lk) where flash-attn3-jax "
        "serves: its varlen kernels before cuDNN's segment mask, for calls of up to one run "
        "of equal ids per tokens_each tokens of a row, at least `least` and at most `most` "
        "runs a row (jax_sdpa.flash_attn3.max_sequences). Every sequence the forward is told "
        "costs it whether real or padding (H200, B2 H32/KV8 L8192 causal, 16 real: 366 us "
        "told 128, 369 told 256, 372 told 512, 377 told 1024) and the backward's grid grows "
        "with the sequences it is told (fwd+bwd 1.57 ms told 16, 2.87 told 64, 7.26 told 256 "
        "with L as the longest; its switch tells it a bucket of the real count). 100-token "
        "documents in L8192 rows (82 runs a row) through the varlen kernels (forward told 512) "
        "0.225 / 1.325 ms fwd / fwd+bwd against 3.46 / 16.0 for cuDNN's mask, where 64 runs a "
        "row sent them; L8192 rows now tell the forward 128 a row (paired on an H100: 399 / 400 "
        "us forward against 425 / 401 at 64 a row, 1750 / 1759 against 1742 / 1749 "
        "forward+backward; 100-token documents 233 / 1587 against 3510 / 16040). "
        "Packed B2 H32/KV8 L8192 D128 causal, 8 segments: None 0.393 / 1.547 ms (0.93 / 0.97 "
        "of flash-attn3-jax's own varlen call, 0.366 / 1.494, which is told the boundaries), "
        "cuDNN with the ids as a mask 3.63 / 16.1",
        "benchmarks/results/h200/packed_cap_20261207.json, "
        "benchmarks/results/h200/peers_all.json"),
}

XLA_CHUNKED_SCORE_BYTES = ROWS["XLA_CHUNKED_SCORE_BYTES"].value
CUDNN_SEGMENT_MASK_MAX_BYTES = ROWS["CUDNN_SEGMENT_MASK_MAX_BYTES"].value
CUDA_DECODE_OVER_CUDNN_ROWS = ROWS["CUDA_DECODE_OVER_CUDNN_ROWS"].value
CUDA_DECODE_FEW_ROWS = ROWS["CUDA_DECODE_FEW_ROWS"].value
CUDA_DECODE_MIN_KV_BYTES = ROWS["CUDA_DECODE_MIN_KV_BYTES"].value
CUDA_DECODE_WIDE_MIN_KV_BYTES = ROWS["CUDA_DECODE_WIDE_MIN_KV_BYTES"].value
CUDA_DECODE_WIDE_MAX_ROWS = ROWS["CUDA_DECODE_WIDE_MAX_ROWS"].value
CUDA_FLASH_FP32_MAX_HEAD_DIM = ROWS["CUDA_FLASH_FP32_MAX_HEAD_DIM"].value
CUDNN_SOFT_CAP_MIN_VERSION = ROWS["CUDNN_SOFT_CAP_MIN_VERSION"].value
CUDA_FLASH_FOR_FEATURES = ROWS["CUDA_FLASH_FOR_FEATURES"].value
CUDA_DECODE_OVER_CUDNN_WITH_LENGTHS = ROWS["CUDA_DECODE_OVER_CUDNN_WITH_LENGTHS"].value
XLA_WIDE_BWD_MAX_SCORE_BYTES = ROWS["XLA_WIDE_BWD_MAX_SCORE_BYTES"].value
XLA_WIDE_FWD_UNBANDED = ROWS["XLA_WIDE_FWD_UNBANDED"].value
XLA_GPU_PROBS_IN_INPUT_DTYPE = ROWS["XLA_GPU_PROBS_IN_INPUT_DTYPE"].value
CUDA_PAGED_FLASH_FOR_NONE = ROWS["CUDA_PAGED_FLASH_FOR_NONE"].value
FLASH_ATTN3_FIRST = ROWS["FLASH_ATTN3_FIRST"].value
FLASH_ATTN3_PACKED = ROWS["FLASH_ATTN3_PACKED"].value
