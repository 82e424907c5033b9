"""What the native build of this installation holds.

CMake writes `_build_info.json` beside this file (cmake/JaxSdpaBuildInfo.cmake): for each
backend, whether it was built and, if not, why and the command that builds it; and the
toolchain it was built with (jaxlib, compiler, nvcc, cuDNN and cudnn-frontend headers).
"""

from __future__ import annotations

import functools
import json
import os

# backend -> its compiled module
MODULES = {"cpu": "_sdpa_cpu", "cuda": "_sdpa_cuda", "metal": "_sdpa_metal"}

_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build_info.json")


@functools.lru_cache(maxsize=None)
def read() -> dict:
    """The whole record; {} where jax_sdpa was not installed by its CMake build (a source
    checkout on sys.path)."""
    try:
        with open(_FILE, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def backend(name: str) -> dict:
    """{"built": bool, "detail" | "reason", "fix"} of one backend ("cpu", "cuda", "metal")."""
    record = read().get("backends", {}).get(name)
    if record is None:
        return {"built": False, "fix": "pip install .",
                "reason": "no build record (_build_info.json): this jax_sdpa was not "
                          "installed by its own build"}
    return record


def not_built_reason(name: str) -> str:
    """Why backend `name` is not in this installation, and the command that builds it."""
    record = backend(name)
    fix = record.get("fix")
    return record.get("reason", "not built") + (f"; to build it: {fix}" if fix else "")


def cuda_major() -> str:
    """The CUDA major version the CUDA backend was built for ("13", "12"), or ""."""
    return read().get("cuda", {}).get("cuda_major", "")


def cuda_runtime_fix() -> str:
    """The install command that brings the CUDA backend's run-time libraries (libcudnn)."""
    return f"pip install 'jax_sdpa[cuda{cuda_major() or '13'}]'"


def cudnn_upgrade_fix() -> str:
    """The command that brings a libcudnn at least as new as the headers the module was
    built against (an older one lacks symbols it links)."""
    headers = read().get("cuda", {}).get("cudnn_headers", "")
    floor = f">={headers}" if headers else ""
    return f"pip install -U 'nvidia-cudnn-cu{cuda_major() or '13'}{floor}'"


def lines() -> list:
    """Human-readable lines for `jax-sdpa info`."""
    info = read()
    if not info:
        return [backend("cpu")["reason"]]
    out = []
    build = info.get("build", {})
    if build:
        out.append("built with " + ", ".join(f"{k} {v}" for k, v in build.items()))
    cuda = info.get("cuda", {})
    if cuda.get("nvcc_version"):
        out.append(f"cuda: nvcc {cuda['nvcc_version']} ({cuda.get('nvcc_source', '?')}), "
                   f"architectures {cuda.get('architectures', '?')}, cuDNN headers "
                   f"{cuda.get('cudnn_headers', '?')}, cudnn-frontend "
                   f"{cuda.get('cudnn_frontend', '?')}")
    return out
