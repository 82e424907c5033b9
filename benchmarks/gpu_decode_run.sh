#!/usr/bin/env bash
# One device call for our decode kernels: load (or rebuild) the library, the
# correctness matrix (fused and kernel combine), then timing + crossover.
#   OUT=... bash benchmarks/gpu_decode_run.sh [check] [check2] [bench] [crossover]
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/decode_out}; mkdir -p "$OUT"
steps=${*:-check check2 bench crossover}
has() { [[ " $steps " == *" $1 "* ]]; }
say() { echo "== $(date -u +%T) $*"; }
lib=build/decode/libjax_sdpa_cuda_decode.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if ! python3 -c "import ctypes,sys; ctypes.cdll.LoadLibrary(sys.argv[1])" "$lib"; then
  say "prebuilt library does not load: building here (sm_90a)"
  DECODE_GENCODE='-gencode=arch=compute_90a,code=sm_90a' CXX_FOR_DECODE=/usr/bin/g++ \
    benchmarks/build_cuda_decode.sh /tmp/decode_build || exit 1
  lib=/tmp/decode_build/libjax_sdpa_cuda_decode.so
fi
rc=0
if has check; then
  say check; timeout ${CHECK_TIMEOUT:-150} python3 benchmarks/gpu_decode.py --lib $lib --only check --out "$OUT" || rc=1
fi
if has check2; then
  say "check: separate combine kernel, 3 forced splits"
  JAX_SDPA_CUDA_DECODE_COMBINE=kernel JAX_SDPA_CUDA_DECODE_SPLITS=3 timeout ${CHECK_TIMEOUT:-100} \
    python3 benchmarks/gpu_decode.py --lib $lib --only check --quick --tag _kernel3 --out "$OUT" || rc=1
fi
if has bench; then
  say bench; timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/gpu_decode.py --lib $lib --only bench --out "$OUT" || rc=1
fi
if has crossover; then
  say crossover; timeout ${CROSS_TIMEOUT:-100} python3 benchmarks/gpu_decode.py --lib $lib --only crossover --out "$OUT" || rc=1
fi
if has benchkernel; then
  say "bench rows 1-3 with the separate combine kernel"
  JAX_SDPA_CUDA_DECODE_COMBINE=kernel timeout 80 python3 benchmarks/gpu_decode.py --lib $lib --only bench --rows 1,2,3 --tag _kernel --out "$OUT" || rc=1
fi
say "done rc=$rc"; exit $rc
