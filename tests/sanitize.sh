#!/usr/bin/env bash
# The shared suite for the CPU kernel and the Metal emulator under AddressSanitizer + UBSan:
#
#   bash tests/sanitize.sh [extra pytest arguments]
#
# Builds the native modules with JAX_SDPA_SANITIZE=ON and clang (the emulated Metal kernels
# need clang, and one ASan runtime has to serve both modules) into build/sanitize, installs
# the package into build/sanitize/site, and runs every test that names the cpu or metal
# implementation, plus the FFI boundary cases, with clang's ASan runtime preloaded (Python
# itself is not instrumented; leak detection is off: Python's own allocations). Any ASan or
# UBSan report aborts the process, which fails the test.
#   JAX_SDPA_SANITIZE_CLANG: the clang++ to use (default: clang++-19, else clang++)
set -euo pipefail
cd "$(dirname "$0")/.."
CLANGXX="${JAX_SDPA_SANITIZE_CLANG:-$(command -v clang++-19 || command -v clang++)}"
RUNTIME="$("$CLANGXX" -print-file-name=libclang_rt.asan-x86_64.so)"
if [[ ! -f "$RUNTIME" ]]; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then  # Debian: compiler-rt
    version="$("$CLANGXX" -dumpversion | cut -d. -f1)"
    apt-get install -y -qq --no-install-recommends "libclang-rt-${version}-dev" >/dev/null
    RUNTIME="$("$CLANGXX" -print-file-name=libclang_rt.asan-x86_64.so)"
  fi
  [[ -f "$RUNTIME" ]] || { echo "no ASan runtime for $CLANGXX (libclang-rt-NN-dev)" >&2; exit 1; }
fi
SITE="$PWD/build/sanitize/site"
rm -rf "$SITE"
CMAKE_ARGS="-DCMAKE_CXX_COMPILER=$CLANGXX -DJAX_SDPA_SANITIZE=ON -DJAX_SDPA_CUDA=OFF \
-DJAX_SDPA_METAL_EMULATOR=ON" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
  pip install -q --no-deps --target "$SITE" -C build-dir=build/sanitize .

export LD_PRELOAD="$RUNTIME"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0"
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" JAX_PLATFORMS=cpu SANITIZED_SITE="$SITE"
unset JAX_SDPA_EXPECT_CUDA  # this build has no CUDA backend
# From inside build/: the repository root on sys.path would shadow the installed package.
cd build/sanitize
python - <<'PY'
import os
import jax_sdpa
from jax_sdpa import _ext
assert jax_sdpa.__file__.startswith(os.environ["SANITIZED_SITE"]), jax_sdpa.__file__
assert _ext.has_backend("cpu") and _ext.has_backend("metal"), _ext.status()
print("sanitized build:", jax_sdpa.__file__)
PY
T=../../tests
python -m pytest -p no:cacheprovider -k "cpu or metal" "$@" \
  $T/test_contract.py $T/test_transforms.py $T/test_jax_nn_contract.py $T/test_mlx_parity.py \
  $T/test_numerics.py $T/test_forward_mode.py $T/test_flax.py $T/test_dropin_gaps.py \
  $T/test_memory.py $T/test_ffi_boundary.py
