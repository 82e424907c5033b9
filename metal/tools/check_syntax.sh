#!/usr/bin/env bash
# Type-checks every .metal file of metal/kernels/ as C++ with msl_emulator.h in check mode:
# `device`, `constant` and `threadgroup` are distinct clang address spaces, so mixing them is a
# compile error, as in MSL. Then proves the check has teeth: each metal/tests/*.metal must fail in
# check mode yet compile in run mode (address spaces erased), so only its address spaces are wrong.
# Usage: metal/tools/check_syntax.sh [clang++]   (default: $CLANGXX, clang++-19, clang++)
set -u
here="$(cd "$(dirname "$0")" && pwd)"
metal="$(dirname "$here")"
kernels="$metal/kernels" tests="$metal/tests" emulator="$metal/host/msl_emulator.h"
cxx="${1:-${CLANGXX:-}}"
if [ -z "$cxx" ]; then
  for c in clang++-19 clang++-20 clang++-18 clang++-17 clang++-16 clang++; do
    if command -v "$c" >/dev/null 2>&1; then cxx="$c"; break; fi
  done
fi
if [ -z "$cxx" ]; then echo "check_syntax: no clang++ found" >&2; exit 2; fi
flags=(-std=c++20 -fsyntax-only -DMSL_EMU_CHECK -Wall -Wno-unknown-attributes
       -Wno-unused-variable -Werror -I"$kernels" -x c++ -include "$emulator")
status=0
for f in "$kernels"/*.metal; do
  if "$cxx" "${flags[@]}" "$f"; then
    echo "ok      $(basename "$f")"
  else
    echo "FAILED  $(basename "$f")" >&2; status=1
  fi
done
run_flags=(-std=c++20 -fsyntax-only -Wno-unknown-attributes -I"$kernels" -x c++
           -include "$emulator")
for f in "$tests"/*.metal; do
  if "$cxx" "${flags[@]}" "$f" 2>/dev/null; then
    echo "FAILED  $(basename "$f") was accepted; the check must reject it" >&2; status=1
  elif ! "$cxx" "${run_flags[@]}" "$f"; then
    echo "FAILED  $(basename "$f") has errors besides address spaces" >&2; status=1
  else
    echo "ok      $(basename "$f") rejected as expected"
  fi
done
# Attributes (buffer indices, thread-position arguments) are invisible to the emulator.
if command -v python3 >/dev/null 2>&1; then
  # The single source macOS compiles at run time (local includes inlined by embed_sources.py).
  tmp="$(mktemp -d)"
  if python3 "$here/embed_sources.py" "$tmp/src.cc" "$tmp/sdpa_all.metal" \
       "$kernels/sdpa_forward.metal" "$kernels/sdpa_decode.metal" "$kernels/sdpa_backward.metal" &&
     "$cxx" "${flags[@]}" "$tmp/sdpa_all.metal"; then
    echo "ok      embedded single-source kernels (what macOS compiles)"
  else
    echo "FAILED  embedded single-source kernels" >&2; status=1
  fi
  rm -rf "$tmp"
  if python3 "$here/lint_kernels.py" "$kernels"/*.metal; then
    echo "ok      kernel signatures (buffer indices, thread-position attributes)"
  else
    echo "FAILED  kernel signatures" >&2; status=1
  fi
  if python3 "$here/lint_kernels.py" "$tests"/lint/*.metal 2>/dev/null; then
    echo "FAILED  metal/tests/lint/*.metal were accepted by lint_kernels.py" >&2; status=1
  else
    echo "ok      metal/tests/lint/*.metal rejected as expected"
  fi
else
  echo "skip    kernel signature lint (no python3)"
fi
exit $status
