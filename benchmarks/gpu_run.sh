#!/usr/bin/env bash
# Everything the H200 machine does for the cuDNN path, in one go (repo root):
#   bash benchmarks/gpu_run.sh [steps]      steps: any of wheel build tests shared sanitize peers
#                                           decode flash probe
#                                           bench quick decode_check decode_bench decode_sweep
#                                           decode_profile decode_ncu decode_ncu_source
#                                           decode_crossover flash_check flash_highest flash_wgmma
#                                           flash_ncu api cudnn_plans fa3_check wide_bwd
#                                           xla_hlo
#                                           (default: build tests probe bench)
# - installs the carried wheels (.whl/: the nvidia-cudnn-frontend headers wheel;
#   the machine has no network),
# - builds and installs the package with the system g++ (the image's CXX is a GCC
#   whose C++ headers don't match the system libstdc++),
# - or, with `wheel` in place of `build`: installs the carried release wheel
#   (.whl/ours/jax_sdpa-*.whl, tools/build_wheel.sh) on its own, with no CUDA toolkit on PATH,
#   and runs every later step against it,
# - runs the GPU tests (pytest -m gpu), compute-sanitizer's four tools over small calls of
#   every CUDA path (benchmarks/gpu_sanitize.py), the raw-cuDNN probe and the benchmarks
#   (peers: benchmarks/gpu_peers.py, every peer in one run).
# Logs and JSON go to $OUT (default /tmp/jax_sdpa_out). Env knobs: TEST_TIMEOUT
# (seconds for the whole pytest run), TEST_PATHS (default tests), PYTEST_ARGS,
# BENCH_ARGS, BENCH_TIMEOUT.
set -o pipefail
cd "$(dirname "$0")/.."
# -P below: never import the source tree's jax_sdpa (no compiled modules) from the cwd.
OUT=${OUT:-/tmp/jax_sdpa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-build tests probe bench}
[[ " $steps " == *" decode "* ]] && steps="$steps decode_check decode_bench"
has() { [[ " $steps " == *" $1 "* ]]; }
repo=$(pwd)
say() { echo "== $(date -u +%T) $*"; }
# A knob setting "A=1+B=2" (or "-": none) as env assignments JAX_SDPA_CUDA_DECODE_A=1 ...
knob_env() { [ "$1" = "-" ] || echo "$1" | tr '+' '\n' | sed 's/^/JAX_SDPA_CUDA_DECODE_/'; }
rc=0

say "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
python3 -m pip list 2>/dev/null | grep -i -E "^(nvidia-cudnn|nanobind|scikit-build|jax)" || true

if has wheel || has build; then
  say "carried wheels"
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || rc=1
  fi
fi

if has wheel; then
  # The release wheel alone: its own site folder ahead of everything, no nvcc on PATH and
  # no CUDA toolkit libraries on the loader's path, for every step after this one.
  say "release wheel, no CUDA toolkit"
  path=""; IFS=: read -ra dirs <<< "$PATH"
  for d in "${dirs[@]}"; do [[ -e "$d/nvcc" ]] || path="${path:+$path:}$d"; done
  export PATH="$path"
  export LD_LIBRARY_PATH=$(echo "${LD_LIBRARY_PATH:-}" | tr ':' '\n' | grep -v -i cuda | paste -sd: -)
  unset CUDA_HOME CUDA_PATH CUDACXX
  rm -rf /tmp/wheel_site
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/wheel_site .whl/ours/jax_sdpa-*.whl || rc=1
  export PYTHONPATH=/tmp/wheel_site${PYTHONPATH:+:$PYTHONPATH}
  echo "nvcc on PATH: $(command -v nvcc || echo none)"
  (cd /tmp && python3 -P -m jax_sdpa.cli info 2>&1 | tail -25) || rc=1
  (cd /tmp && python3 -P -c "
import jax, jax.numpy as jnp, jax_sdpa
print('jax_sdpa from', jax_sdpa.__file__)
q = jnp.ones((1, 4, 64, 64), jnp.bfloat16)
jax.block_until_ready(jax_sdpa.scaled_dot_product_attention(q, q, q, implementation='cudnn'))
print('libcudnn loaded:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libcudnn.so' in l}))
") || rc=1
fi

if has build; then
  say "build + install (system g++)"
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
  export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
  # sm_90 only here (the H200); the default build (CI, wheels) targets sm_80 and sm_90.
  export CMAKE_ARGS="-DJAX_SDPA_CUDA=ON -DJAX_SDPA_METAL_EMULATOR=OFF -DCMAKE_CUDA_ARCHITECTURES=90 ${CMAKE_ARGS:-}"
  # LINEINFO=1: line tables in the kernels, for decode_ncu_source's CUDA view.
  [ "${LINEINFO:-0}" = 1 ] && CMAKE_ARGS="$CMAKE_ARGS -DJAX_SDPA_CUDA_LINEINFO=ON"
  # TUNING=1: the sweep variants and their knobs (decode_sweep, probe, benchmarks/tuning/).
  [ "${TUNING:-0}" = 1 ] && CMAKE_ARGS="$CMAKE_ARGS -DJAX_SDPA_TUNING=ON"
  start=$(date +%s)
  if ! python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -40; then
    # Another backend's work in progress must not block the cuDNN run: retry with
    # only the cuDNN sources of the CUDA module and no other backend.
    say "full build failed; retrying with the cuDNN module alone"
    rm -rf /tmp/jax_sdpa_min && mkdir -p /tmp/jax_sdpa_min
    tar --exclude=./build --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C /tmp/jax_sdpa_min
    rm -f /tmp/jax_sdpa_min/cpu/CMakeLists.txt /tmp/jax_sdpa_min/metal/CMakeLists.txt
    sed -i '/decode/d' /tmp/jax_sdpa_min/cuda/CMakeLists.txt
    (cd /tmp/jax_sdpa_min && python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -40) || rc=1
  fi
  say "build took $(( $(date +%s) - start )) s"
  python3 -P -c "
from jax_sdpa import _ext; print(_ext.status())
m = _ext.module('_sdpa_cuda')
print('cuDNN runtime', m.cudnn_version(), 'headers', m.cudnn_compiled_version(), 'frontend', m.cudnn_frontend_version())" || rc=1
fi

if has tests; then
  say "GPU tests"
  # Several workers share the GPU (no preallocation, each grows as it needs); many
  # because cuDNN compiles each new attention kernel at run time, on the CPU.
  # Run from /tmp: a worker started in the repo root would import the source tree's
  # jax_sdpa (no compiled modules) instead of the installed one.
  paths=""; for t in ${TEST_PATHS:-tests}; do paths="$paths $repo/$t"; done
  (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false \
    timeout -s INT "${TEST_TIMEOUT:-300}" python3 -P -m pytest $paths -c "$repo/pyproject.toml" \
      --rootdir "$repo" -m gpu -q -p no:cacheprovider -n ${TEST_WORKERS:-12} --timeout=120 -rfEx --tb=short \
      --junitxml="$OUT/pytest_gpu.xml" ${PYTEST_ARGS:-} 2>&1 | grep -v -i "benchmark" | tail -300) || rc=1
fi

if has shared; then
  say "shared test suite with the GPU implementations (cudnn, cuda)"
  (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest \
    timeout -s INT "${SHARED_TIMEOUT:-240}" python3 -P -m pytest \
      $repo/tests/test_contract.py $repo/tests/test_jax_nn_contract.py $repo/tests/test_transforms.py \
      $repo/tests/test_numerics.py $repo/tests/test_forward_mode.py $repo/tests/test_dropin_gaps.py \
      $repo/tests/test_strict_modes.py $repo/tests/test_ffi_boundary.py \
      $repo/tests/test_segments_softcap.py $repo/tests/test_paged.py \
      -c "$repo/pyproject.toml" --rootdir "$repo" -k "cudnn or cuda" -q -p no:cacheprovider \
      -n ${TEST_WORKERS:-12} --timeout=120 -rfEs --tb=short --junitxml="$OUT/pytest_shared.xml" \
      2>&1 | tail -120) || rc=1
fi

if has sanitize; then
  # memcheck, racecheck, initcheck, synccheck over small calls of every CUDA path. Each tool
  # runs twice: restricted to our kernels (their names hold "jax_sdpa": these must be clean)
  # and over every kernel (cuDNN's and XLA's too: their reports are counted, not ours to
  # fix). One log file for all of it ($OUT/sanitize.txt).
  log="$OUT/sanitize.txt"; : > "$log"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    scopes=${SANITIZE_SCOPES:-ours all}
    # initcheck over every kernel only: a kernel left out by the filter is not tracked, so
    # what it writes would look uninitialized to ours; the per-kernel count tells ours apart.
    # Device accesses only: its host-API check flags XLA's own copies of buffers it never
    # wrote.
    [ $tool = initcheck ] && scopes=all
    for scope in $scopes; do
      filt=""; [ $scope = ours ] && filt="--kernel-name kns=jax_sdpa"
      [ $tool = initcheck ] && filt="$filt --check-api-memory-access no"
      say "compute-sanitizer --tool $tool ($scope kernels)"
      echo "===== $tool $scope" >> "$log"
      (cd /tmp && timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool $tool $filt --show-backtrace no \
         --print-limit ${SANITIZE_PRINT_LIMIT:-100000} --error-exitcode 3 \
         python3 -P $repo/benchmarks/gpu_sanitize.py > /tmp/sanitize_one.txt 2>&1); s=$?
      # the first reports in full, then a count of reports per kernel
      head -c ${SANITIZE_LOG_BYTES:-6000} /tmp/sanitize_one.txt >> "$log"
      echo "--- reports per kernel:" >> "$log"
      grep -oE "^=========     at [^(+]{1,120}" /tmp/sanitize_one.txt | sed 's/^=* *at //' \
        | sort | uniq -c | sort -rn | head -15 >> "$log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases" /tmp/sanitize_one.txt | tail -3 >> "$log"
      echo "exit $s" >> "$log"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases|FAIL|refused|not supported" \
        /tmp/sanitize_one.txt | head -6
      echo "compute-sanitizer $tool ($scope) exit $s"
      [ $s = 0 ] || [ $scope = all ] || rc=1
    done
  done
fi

if has peers; then
  say "every peer in one run (benchmarks/gpu_peers.py)"
  (cd /tmp && timeout "${PEERS_TIMEOUT:-300}" python3 -P $repo/benchmarks/gpu_peers.py \
     --out "$OUT/peers.json" --plot "$OUT/peers.png" ${PEERS_ARGS:-} 2>&1 \
     | grep -v '^{"row"' | tail -60) || rc=1
fi

# The decode pieces (decode = decode_check + decode_bench). decode_check runs the check
# again under each knob setting in DECODE_CHECK_KNOBS, e.g. "L2=132 WIDE=4,4 TMA=off
# WIDE_TMA=8,6,2+SPLITS=3" (JAX_SDPA_CUDA_DECODE_<setting>, '+' joins settings of one run:
# the kernel variants of docs/cuda_decode.md).
if has api; then
  say "public API smoke: one call + grad per GPU implementation"
  (cd /tmp && timeout 150 python3 -P $repo/benchmarks/gpu_api_smoke.py 2>&1 | tail -8) || rc=1
fi
if has decode_check; then
  say "decode check (default kernels, then: ${DECODE_CHECK_KNOBS:-no variants})"
  (cd /tmp && timeout 150 python3 -P $repo/benchmarks/gpu_decode.py --only check \
     --out "$OUT" 2>&1 | tail -6) || rc=1
  for knob in ${DECODE_CHECK_KNOBS:-}; do
    say "decode check, JAX_SDPA_CUDA_DECODE_$knob"
    (cd /tmp && env $(knob_env "$knob") timeout 150 python3 -P \
       $repo/benchmarks/gpu_decode.py --only check --out /tmp 2>&1 \
       | grep -E "^FAIL|^ERR|check:" | tail -12) || rc=1
  done
fi
if has decode_bench; then
  say "decode bench (rows beside jax.nn xla / cudnn)"
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${DECODE_BENCH_TIMEOUT:-240}" python3 -P \
     $repo/benchmarks/gpu_decode.py --only bench --out "$OUT" 2>&1 | tail -30) || rc=1
fi
if has decode_crossover; then
  say "decode crossover vs cuDNN (B, Lk, query rows per kv head)"
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout 200 python3 -P $repo/benchmarks/gpu_decode.py \
     --only crossover --crossover-dims "${CROSSOVER_DIMS:-128}" --out "$OUT" 2>&1 \
     | grep -E "^crossover" | tail -30) || rc=1
fi
if has decode_sweep; then
  say "decode sweep (knob settings per row)"
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${DECODE_SWEEP_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_decode.py --only sweep --sweep-rows "${SWEEP_ROWS:-}" --out "$OUT" 2>&1 \
     | grep -E "^sweep" | tail -60) || rc=1
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

if has flash_check; then
  say "our CUDA flash kernels: correctness (TF32)"
  (cd /tmp && timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P $repo/benchmarks/gpu_flash_check.py \
     --only check --out "$OUT" 2>&1 | grep -E "FAIL|check:|Error|error" | tail -20) || rc=1
fi

if has flash_wgmma; then
  # The wgmma kernels (16-bit head dims in (256, 512], sm_90a: cuda/flash/flash_fwd_wgmma.cu,
  # cuda/flash/flash_bwd_wgmma.cu; the defaults on this GPU): the check's wide-head cases with
  # them and with the wide kernels (JAX_SDPA_FLASH_WGMMA=0 / _BWD=0), then the D512 bench
  # row both ways, the first beside what jax_sdpa.dot_product_attention runs (--api).
  say "wgmma flash kernels: correctness on the wide-head cases, then D512 timing"
  for off in 0 1; do
    env=""; [ $off = 1 ] && env="JAX_SDPA_FLASH_WGMMA=0 JAX_SDPA_FLASH_WGMMA_BWD=0"
    (cd /tmp && env $env timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P \
       $repo/benchmarks/gpu_flash_check.py --only check --cases "D320,D384,D512" \
       --out "$OUT/wgmma_off$off" 2>&1 | grep -E "^(ok|FAIL)|check:|rror" | grep -v "^ok   fp32" \
       | tail -30) || rc=1
  done
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout 200 python3 -P $repo/benchmarks/gpu_flash_check.py \
     --only bench --rows D512 --api --out "$OUT/wgmma_bench" 2>&1 | tail -2) || rc=1
  (cd /tmp && JAX_SDPA_FLASH_WGMMA=0 JAX_SDPA_FLASH_WGMMA_BWD=0 JAX_SDPA_POISON_OUTPUTS=0 \
     timeout 200 python3 -P $repo/benchmarks/gpu_flash_check.py --only bench --rows D512 \
     --no-peers --out "$OUT/wide_bench" 2>&1 | tail -2) || rc=1
fi

if has flash_highest; then
  # The bar for fp32 under "highest": outputs and grads within 1e-5 of float64.
  say "our CUDA flash kernels: correctness under 3xTF32, fp32 outputs and grads within 1e-5"
  (cd /tmp && JAX_SDPA_CUDA_FP32=highest timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only check --fp32-tol 1e-5 --fp32-grad-tol 1e-5 \
     --out "$OUT" 2>&1 | grep -E "fp32|check:|Error|error" | tail -${FLASH_TAIL:-70}) || rc=1
fi

if has flash; then
  say "our CUDA flash kernels: correctness (TF32, then 3xTF32), then timing"
  (cd /tmp && timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P $repo/benchmarks/gpu_flash_check.py \
     --only check --out "$OUT" 2>&1 | tail -${FLASH_TAIL:-70}) || rc=1
  (cd /tmp && JAX_SDPA_CUDA_FP32=highest timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only check --fp32-tol 1e-5 --out "$OUT" 2>&1 \
     | grep -E "fp32|check:" | tail -${FLASH_TAIL:-70}) || rc=1
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${FLASH_BENCH_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only bench --out "$OUT/bench" ${FLASH_BENCH_ARGS:-} 2>&1 | tail -20) || rc=1
fi

if has cudnn_plans; then
  # Every plan cuDNN offers for the D128 training rows, each timed, with and without the
  # forward's stats (benchmarks/tuning/cudnn_plans.cc): what the heuristic's first choice
  # leaves on the table.
  say "cuDNN plans, each timed (CUDNN_PLANS_SHAPES: ${CUDNN_PLANS_SHAPES:-the D128 rows})"
  inc=$(python3 -c "
import json, os, subprocess, sys
f = json.loads(subprocess.run([sys.executable, 'cmake/find_cuda_wheels.py'], capture_output=True, text=True).stdout)
fe, dnn = f['cudnn_frontend']['path'], f['cudnn']['path']
print(os.path.dirname(fe), os.path.dirname(dnn), os.path.join(os.path.dirname(os.path.dirname(dnn)), 'lib'))")
  read -r fe_inc dnn_inc dnn_lib <<< "$inc"
  /usr/bin/g++ -std=c++17 -O2 benchmarks/tuning/cudnn_plans.cc -I"$fe_inc" -I"$dnn_inc" \
    -I/usr/local/cuda/include -L"$dnn_lib" -Wl,-rpath,"$dnn_lib" -l:libcudnn.so.9 -L/usr/local/cuda/lib64 -lnvrtc \
    -lcudart -ldl -o /tmp/cudnn_plans || rc=1
  for shape in ${CUDNN_PLANS_SHAPES:-4,32,4096,128,0 4,32,4096,128,1 1,16,16384,128,1 4,16,4096,64,0}; do
    timeout 120 /tmp/cudnn_plans ${shape//,/ } 20 | tee -a "$OUT/cudnn_plans.jsonl" || rc=1
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
  say "flash-attn3-jax's flash_mha against a float32 reference"
  (cd /tmp && timeout 200 python3 -P $repo/benchmarks/tuning/fa3_check.py ${FA3_CHECK_ARGS:-} 2>&1 \
     | tee "$OUT/fa3_check.jsonl" | tail -20) || rc=1
fi

if has probe; then
  say "what cuDNN writes without our fix-ups"
  JAX_SDPA_CUDNN_RAW=1 JAX_SDPA_POISON_OUTPUTS=1 timeout 120 python3 benchmarks/tuning/cudnn_probe.py 2>&1 | tail -30 || rc=1
fi

if has bench || has quick; then
  say "benchmarks"
  q=""; has quick && q="--quick"
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_gpu.py --out "$OUT/bench_cudnn.json" $q ${BENCH_ARGS:-} \
    2>&1 | grep -v '^{"case"' | tail -60 || rc=1
fi
say "done rc=$rc"
exit $rc
