#!/usr/bin/env bash
# Runs a command as on a machine without a CUDA toolkit, so that only CUDA packages from pip
# can be found: no folder holding nvcc on PATH, no CUDA_HOME / CUDA_PATH / CUDACXX, and, where
# mount namespaces work (root), every /usr/local/cuda* folder mounted over by an empty one.
#   tools/without_system_cuda.sh pip install '.[cuda13]' -Cjax_sdpa.cuda=13
set -euo pipefail
path=""
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  [[ -e "$d/nvcc" ]] || path="${path:+$path:}$d"
done
export PATH="$path"
unset CUDA_HOME CUDA_PATH CUDA_ROOT CUDACXX CUDAToolkit_ROOT
if [[ $(id -u) == 0 ]] && unshare -m --propagation private true 2>/dev/null; then
  exec unshare -m --propagation private bash -c '
    for d in /usr/local/cuda*; do
      if [[ -d "$d" && ! -L "$d" ]]; then mount -t tmpfs none "$d"; fi
    done
    exec "$@"' bash "$@"
fi
exec "$@"
