#!/usr/bin/env bash
# The product harness on the GPU machine, in one go (repo root):
#   bash benchmarks/gpu_run.sh [steps]      steps: any of wheel build tests shared sanitize
#                                           api peers bench quick decode decode_check
#                                           decode_bench decode_crossover flash flash_check
#                                           flash_highest flash_wgmma
#                                           (default: build tests bench)
# - installs the carried wheels (.whl/: the nvidia-cudnn-frontend headers wheel;
#   the machine has no network),
# - builds and installs the package with the system g++ (the image's CXX is a GCC
#   whose C++ headers don't match the system libstdc++), through pip and CMake only,
# - or, with `wheel` in place of `build`: installs the carried release wheel
#   (.whl/ours/jax_sdpa-*.whl, tools/build_wheel.sh) on its own, with no CUDA toolkit on PATH,
#   and runs every later step against it,
# - runs the GPU tests (pytest -m gpu), compute-sanitizer's four tools over small calls of
#   every CUDA path (benchmarks/gpu_sanitize.py), our kernels' float64 checks and the
#   benchmarks (peers: benchmarks/gpu_peers.py, every peer in one run).
# Tuning and profiling runs (kernel variants, Nsight Compute, cuDNN's plans) are
# benchmarks/tuning/run.sh's, after this script's build.
# Logs and JSON go to $OUT (default /tmp/jax_sdpa_out). Env knobs: TEST_TIMEOUT
# (seconds for the whole pytest run), TEST_PATHS (default tests), PYTEST_ARGS,
# BENCH_ARGS, BENCH_TIMEOUT; build options LINEINFO=1 (line tables in the kernels, for
# Nsight's CUDA source view) and TUNING=1 (-DJAX_SDPA_TUNING=ON: the kernel variants, their
# knobs and the tuning tools, for benchmarks/tuning/run.sh).
set -o pipefail
cd "$(dirname "$0")/.."
# -P below: never import the source tree's jax_sdpa (no compiled modules) from the cwd.
OUT=${OUT:-/tmp/jax_sdpa_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-build tests bench}
[[ " $steps " == *" decode "* ]] && steps="$steps decode_check decode_bench"
has() { [[ " $steps " == *" $1 "* ]]; }
repo=$(pwd)
say() { echo "== $(date -u +%T) $*"; }
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
  [ "${LINEINFO:-0}" = 1 ] && CMAKE_ARGS="$CMAKE_ARGS -DJAX_SDPA_CUDA_LINEINFO=ON"
  [ "${TUNING:-0}" = 1 ] && CMAKE_ARGS="$CMAKE_ARGS -DJAX_SDPA_TUNING=ON"
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -40 || rc=1
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

# The decode pieces (decode = decode_check + decode_bench; the check under the kernel
# variants' knobs is benchmarks/tuning/run.sh decode_check_knobs).
if has api; then
  say "public API smoke: one call + grad per GPU implementation"
  (cd /tmp && timeout 150 python3 -P $repo/benchmarks/gpu_api_smoke.py 2>&1 | tail -8) || rc=1
fi
if has decode_check; then
  say "decode check"
  (cd /tmp && timeout 240 python3 -P $repo/benchmarks/gpu_decode.py --only check \
     --out "$OUT" 2>&1 | tail -6) || rc=1
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
  # The bar for fp32 under "highest": the tolerance policy's "cuda_3xtf32" case (outputs
  # and grads within 1e-5 of float64).
  say "our CUDA flash kernels: correctness under 3xTF32"
  (cd /tmp && JAX_SDPA_CUDA_FP32=highest timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only check \
     --out "$OUT" 2>&1 | grep -E "fp32|check:|Error|error" | tail -${FLASH_TAIL:-70}) || rc=1
fi

if has flash; then
  say "our CUDA flash kernels: correctness (TF32, then 3xTF32), then timing"
  (cd /tmp && timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P $repo/benchmarks/gpu_flash_check.py \
     --only check --out "$OUT" 2>&1 | tail -${FLASH_TAIL:-70}) || rc=1
  (cd /tmp && JAX_SDPA_CUDA_FP32=highest timeout "${FLASH_CHECK_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only check --out "$OUT" 2>&1 \
     | grep -E "fp32|check:" | tail -${FLASH_TAIL:-70}) || rc=1
  (cd /tmp && JAX_SDPA_POISON_OUTPUTS=0 timeout "${FLASH_BENCH_TIMEOUT:-200}" python3 -P \
     $repo/benchmarks/gpu_flash_check.py --only bench --out "$OUT/bench" ${FLASH_BENCH_ARGS:-} 2>&1 | tail -20) || rc=1
fi

if has bench || has quick; then
  say "benchmarks"
  q=""; has quick && q="--quick"
  timeout "${BENCH_TIMEOUT:-420}" python3 benchmarks/bench_gpu.py --out "$OUT/bench_cudnn.json" $q ${BENCH_ARGS:-} \
    2>&1 | grep -v '^{"case"' | tail -60 || rc=1
fi
say "done rc=$rc"
exit $rc
