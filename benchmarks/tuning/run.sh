#!/usr/bin/env bash
# Tuning and profiling on the GPU machine (repo root), after a build by the product harness
# (benchmarks/gpu_run.sh): TUNING=1 for the kernel variants, their knobs and cudnn_plans
# (-DJAX_SDPA_TUNING=ON), LINEINFO=1 for Nsight's CUDA source view:
#   TUNING=1 bash benchmarks/gpu_run.sh build && bash benchmarks/tuning/run.sh STEPS
# steps: any of
#   tune                the sweeps side by side, then the flash check with the winners
#                       (benchmarks/tuning/gpu_tune.sh)
#   decode_check_knobs  the decode check under each setting in DECODE_CHECK_KNOBS
#   decode_sweep        benchmarks/tuning/decode_sweep.py (SWEEP_ROWS: row substrings)
#   paged_sweep         benchmarks/tuning/paged_sweep.py (SWEEP_ROWS: row substrings)
#   decode_profile      benchmarks/profiling/decode_profile.py (DECODE_PROFILE_ARGS)
#   decode_ncu          Nsight Compute on decode calls (NCU_KNOBS, NCU_PEERS, NCU_ROWS)
#   decode_ncu_source   Nsight's stall sampling per instruction (NCU_KERNEL, NCU_SOURCE_VIEW)
#   flash_ncu           Nsight Compute on one flash row (NCU_KERNEL, NCU_FLASH_ROW)
#   cudnn_plans         every cuDNN plan timed (benchmarks/tuning/cudnn_plans.cc)
#   xla_hlo wide_bwd fa3_check probe
#                       benchmarks/tuning/xla_hlo.py, wide_bwd.py, fa3_check.py and
#                       cudnn_probe.py (what cuDNN writes without our fix-ups)
# Logs and JSON go to $OUT (default /tmp/jax_sdpa_out).
set -o pipefail
cd "$(dirname "$0")/../.."
# -P below: never import the source tree's jax_sdpa (no compiled modules) from the cwd.
OUT=${OUT:-/tmp/jax_sdpa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=" $* "
[ -n "${*}" ] || { sed -n '2,20p' "$0"; exit 2; }
has() { [[ "$steps" == *" $1 "* ]]; }
repo=$(pwd)
say() { echo "== $(date -u +%T) $*"; }
# A knob setting "A=1+B=2" (or "-": none) as env assignments JAX_SDPA_CUDA_DECODE_A=1 ...
knob_env() { [ "$1" = "-" ] || echo "$1" | tr '+' '\n' | sed 's/^/JAX_SDPA_CUDA_DECODE_/'; }
rc=0

if has tune; then
  say "the sweeps, then the flash check with their winners (benchmarks/tuning/gpu_tune.sh)"
  bash benchmarks/tuning/gpu_tune.sh || rc=1
fi

if has decode_check_knobs; then
  # The decode check under each knob setting in DECODE_CHECK_KNOBS, e.g. "L2=132 WIDE=4,4
  # TMA=off WIDE_TMA=8,6,2+SPLITS=3" (JAX_SDPA_CUDA_DECODE_<setting>, '+' joins settings of
  # one run: the kernel variants of docs/cuda_decode.md).
  for knob in ${DECODE_CHECK_KNOBS:-}; do
    say "decode check, JAX_SDPA_CUDA_DECODE_$knob"
    (cd /tmp && env $(knob_env "$knob") timeout 150 python3 -P \
       $repo/benchmarks/gpu_decode.py --only check --out /tmp 2>&1 \
       | grep -E "^FAIL|^ERR|check:" | tail -12) || rc=1
  done
fi

if has decode_sweep; then
  say "decode sweep (knob settings per row)"
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${DECODE_SWEEP_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/tuning/decode_sweep.py --rows "${SWEEP_ROWS:-}" --out "$OUT" 2>&1 \
     | grep -E "^sweep" | tail -60) || rc=1
fi

if has paged_sweep; then
  say "paged decode sweep (kernels and page layouts per row)"
  (cd /tmp && timeout "${DECODE_SWEEP_TIMEOUT:-300}" python3 -P \
     $repo/benchmarks/tuning/paged_sweep.py --rows "${SWEEP_ROWS:-}" --out "$OUT" 2>&1 \
     | grep -E "^paged|wrote" | tail -80) || rc=1
fi

if has decode_profile; then
  say "decode profile (device busy / span per call)"
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${DECODE_PROFILE_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/profiling/decode_profile.py --out "$OUT" ${DECODE_PROFILE_ARGS:-} 2>&1 \
     | grep -v "^      " | tail -40) || rc=1
fi

if has decode_ncu; then
  # NCU_KNOBS: our kernels under each knob setting ("-" = the defaults; '+' joins the
  # settings of one run, as DECODE_CHECK_KNOBS); NCU_PEERS: jax.nn implementations
  # profiled beside them (first setting only; "xla" crashed ncu's process once, T1646);
  # NCU_EXTRA: more ncu arguments, e.g. "--section SourceCounters" (stall sampling per
  # source line: where the warps wait).
  say "Nsight Compute: our decode kernel (settings: ${NCU_KNOBS:--}) beside ${NCU_PEERS-cudnn} on rows ${NCU_ROWS:-0} (real clocks)"
  peers=${NCU_PEERS-cudnn}
  for knob in ${NCU_KNOBS:--}; do
    echo "=== setting $knob" >> "$OUT/decode_ncu.txt"
    (cd /tmp && env $(knob_env "$knob") \
     timeout "${NCU_TIMEOUT:-200}" /usr/local/cuda/bin/ncu --clock-control none \
     -k regex:'decode_|flash|sdpa|combine|gemm|fusion' --section SpeedOfLight --section LaunchStats \
     --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
     --section SchedulerStats ${NCU_EXTRA:-} python3 -P $repo/benchmarks/profiling/decode_ncu.py --rows ${NCU_ROWS:-0} \
     --peers "$peers" >> "$OUT/decode_ncu.txt" 2>&1) || rc=1
    peers=""
  done
  grep -E "^=== setting|^  [a-zA-Z_ ]*(void|sdpa|cudnn|flash|gemm|fusion|loop)|Duration|DRAM Through|L2 Hit|Registers Per|Elapsed Cycles|SM Active Cycles" \
     "$OUT/decode_ncu.txt" | head -150
fi

if has decode_ncu_source; then
  # Stall sampling per SASS instruction (NCU_SOURCE_VIEW=cuda: per CUDA line, with a
  # LINEINFO=1 build) of our kernels matching NCU_KERNEL on NCU_ROWS: where the warps wait
  # (benchmarks/profiling/ncu_source_top.py prints the top instructions / lines).
  say "Nsight Compute source page: ${NCU_KERNEL:-decode_} on rows ${NCU_ROWS:-0}"
  (cd /tmp && timeout "${NCU_TIMEOUT:-200}" /usr/local/cuda/bin/ncu --clock-control none \
     -k regex:"${NCU_KERNEL:-decode_}" --section SourceCounters --section WarpStateStats \
     --warp-sampling-interval 0 --page source --csv --print-source ${NCU_SOURCE_VIEW:-sass} \
     python3 -P $repo/benchmarks/profiling/decode_ncu.py --rows ${NCU_ROWS:-0} --peers "" \
     > "$OUT/decode_ncu_source.csv" 2>&1) || rc=1
  lines=""; [[ "${NCU_SOURCE_VIEW:-sass}" == cuda* ]] && lines="--lines"
  python3 benchmarks/profiling/ncu_source_top.py "$OUT/decode_ncu_source.csv" --top ${NCU_TOP:-30} $lines \
     > "$OUT/decode_ncu_source_top.txt" 2>&1 || rc=1
  head -c 12000 "$OUT/decode_ncu_source_top.txt"
fi


if has flash_ncu; then
  # Nsight Compute on one launch of the kernels matching NCU_KERNEL (default the wgmma
  # backward) in a fwd + bwd call of the flash bench row NCU_FLASH_ROW (default D512):
  # throughput, memory, stall reasons, then the stall sampling per SASS instruction.
  say "Nsight Compute: ${NCU_KERNEL:-flash_bwd_wgmma} on flash row ${NCU_FLASH_ROW:-D512}"
  (cd /tmp && timeout "${NCU_TIMEOUT:-200}" /usr/local/cuda/bin/ncu --clock-control none \
     -k regex:"${NCU_KERNEL:-flash_bwd_wgmma}" -c 1 --section SpeedOfLight --section LaunchStats \
     --section Occupancy --section MemoryWorkloadAnalysis --section WarpStateStats \
     --section SchedulerStats python3 -P $repo/benchmarks/profiling/flash_ncu.py --row "${NCU_FLASH_ROW:-D512}" \
     > "$OUT/flash_ncu.txt" 2>&1) || rc=1
  grep -v "^==PROF==" "$OUT/flash_ncu.txt" | grep -E "Duration|Through|Hit|Cycles|Stall|Warp Cycles|Issued|Eligible|Registers|Pipe|Bandwidth|Busy" | head -60
  (cd /tmp && timeout "${NCU_TIMEOUT:-200}" /usr/local/cuda/bin/ncu --clock-control none \
     -k regex:"${NCU_KERNEL:-flash_bwd_wgmma}" -c 1 --section SourceCounters --section WarpStateStats \
     --warp-sampling-interval 0 --page source --csv --print-source sass \
     python3 -P $repo/benchmarks/profiling/flash_ncu.py --row "${NCU_FLASH_ROW:-D512}" \
     > "$OUT/flash_ncu_source.csv" 2>&1) || rc=1
  python3 benchmarks/profiling/ncu_source_top.py "$OUT/flash_ncu_source.csv" --top ${NCU_TOP:-30} \
     > "$OUT/flash_ncu_source_top.txt" 2>&1 || rc=1
  head -c 8000 "$OUT/flash_ncu_source_top.txt"
fi


if has cudnn_plans; then
  # Every plan cuDNN offers for the D128 training rows, each timed, with and without the
  # forward's stats (benchmarks/tuning/cudnn_plans.cc, built by the tuning build's CMake):
  # what the heuristic's first choice leaves on the table.
  say "cuDNN plans, each timed (CUDNN_PLANS_SHAPES: ${CUDNN_PLANS_SHAPES:-the D128 rows})"
  plans=$(ls build/*/cuda/cudnn_plans 2>/dev/null | head -1)
  if [ -z "$plans" ]; then
    echo "no build/*/cuda/cudnn_plans: run TUNING=1 bash benchmarks/gpu_run.sh build first"; rc=1
  fi
  for shape in ${plans:+${CUDNN_PLANS_SHAPES:-4,32,4096,128,0 4,32,4096,128,1 1,16,16384,128,1 4,16,4096,64,0}}; do
    timeout 120 "$plans" ${shape//,/ } 20 | tee -a "$OUT/cudnn_plans.jsonl" || rc=1
  done
fi

if has xla_hlo; then
  say "our XLA path's optimized HLO beside jax.nn's (benchmarks/tuning/xla_hlo.py)"
  (cd /tmp && timeout "${XLA_HLO_TIMEOUT:-150}" python3 -P $repo/benchmarks/tuning/xla_hlo.py \
     --out-dir "$OUT/hlo" ${XLA_HLO_ARGS:-} 2>&1 | tail -20) || rc=1
fi
if has wide_bwd; then
  say "16-bit backward at head dims > 256, formulation by formulation (benchmarks/tuning/wide_bwd.py)"
  (cd /tmp && timeout "${WIDE_BWD_TIMEOUT:-240}" python3 -P $repo/benchmarks/tuning/wide_bwd.py \
     --out "$OUT/wide_bwd.json" ${WIDE_BWD_ARGS:-} 2>&1 | tail -40) || rc=1
fi
if has fa3_check; then
  say "flash-attn3-jax's flash_mha against a float32 reference beside jax_sdpa"
  (cd /tmp && timeout 200 python3 -P $repo/benchmarks/tuning/fa3_check.py ${FA3_CHECK_ARGS:-} 2>&1 \
     | tee "$OUT/fa3_check.jsonl" | tail -20) || rc=1
fi

if has probe; then
  say "what cuDNN writes without our fix-ups"
  JAX_SDPA_CUDNN_RAW=1 JAX_SDPA_POISON_OUTPUTS=1 timeout 120 python3 benchmarks/tuning/cudnn_probe.py 2>&1 | tail -30 || rc=1
fi

say "done rc=$rc"
exit $rc
