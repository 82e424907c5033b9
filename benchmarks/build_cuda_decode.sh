#!/usr/bin/env bash
# Builds our CUDA decode kernels + FFI handler into one plain shared library
# (no nanobind, no cuDNN) that benchmarks/gpu_decode.py loads with ctypes and
# registers via jax.ffi.pycapsule. The package build uses cuda/CMakeLists.txt.
#   benchmarks/build_cuda_decode.sh [outdir]   (default build/decode)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/decode}
mkdir -p "$out"
CXX=${CXX_FOR_DECODE:-/usr/bin/g++}
[ -x "$CXX" ] || CXX=g++
PY=${PYTHON:-python3}
ffi_inc=$("$PY" -c "import jax.ffi; print(jax.ffi.include_dir())")
cuda_inc=""
for d in "${CUDA_HOME:-/nonexistent}/include" "$(dirname "$(command -v nvcc)")/../include" \
         /usr/local/cuda/include /usr/local/cuda-*/include; do
  if [ -f "$d/cuda_runtime_api.h" ]; then cuda_inc=$d; break; fi
done
[ -n "$cuda_inc" ] || { echo "cuda_runtime_api.h not found (set CUDA_HOME)"; exit 1; }
gencode=${DECODE_GENCODE:--gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a}
pids=()
for tu in decode_attention decode_attention_f16 decode_attention_bf16; do
  nvcc -std=c++17 -O3 --threads 0 -Xcompiler -fPIC -ccbin "$CXX" -I. -Icuda --expt-relaxed-constexpr \
    $gencode -Xptxas -v -c cuda/$tu.cu -o "$out/$tu.o" 2> "$out/ptxas_$tu.txt" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || { cat "$out"/ptxas_*.txt | grep -i error; exit 1; }; done
"$CXX" -std=c++17 -O2 -fPIC -I. -I"$ffi_inc" -I"$cuda_inc" \
  -c ffi/cuda_decode_handler.cc -o "$out/cuda_decode_handler.o"
nvcc -shared -ccbin "$CXX" -cudart static "$out/decode_attention.o" "$out/decode_attention_f16.o" \
  "$out/decode_attention_bf16.o" "$out/cuda_decode_handler.o" \
  -o "$out/libjax_sdpa_cuda_decode.so"
echo "built $out/libjax_sdpa_cuda_decode.so"
