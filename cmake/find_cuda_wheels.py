"""Prints, as JSON, where the PyPI wheels of the CUDA toolchain and cuDNN are in the Python
environment that CMake builds for (cmake/JaxSdpaCudaToolchain.cmake reads it).

Searched: this interpreter's sys.path (under pip's build isolation: the build environment,
with the `build.requires` of `-Cjax_sdpa.cuda=13`), then the site-packages of the
environment being installed into (what `pip install jax[cuda13]` put there).

Layouts: CUDA 13 wheels share site-packages/nvidia/cu13/{bin,include,lib,nvvm}; CUDA 12
wheels each have their own folder (nvidia/cuda_nvcc, nvidia/cuda_runtime, nvidia/cuda_nvrtc).
cuDNN: nvidia/cudnn/{include,lib}; cudnn-frontend: site-packages/include.
"""

import json
import os
import site
import sys
import sysconfig
import tempfile


def _target_site_dirs():
    paths = sysconfig.get_paths()
    dirs = [paths.get("purelib"), paths.get("platlib")]
    try:
        dirs += site.getsitepackages()
    except AttributeError:  # some virtualenv versions
        pass
    return [d for d in dirs if d]


def _roots():
    roots = []
    for p in sys.path + _target_site_dirs():
        if p and os.path.isdir(p):
            p = os.path.realpath(p)
            if p not in roots:
                roots.append(p)
    return roots


def _dist(root, names):
    """"name version" of the first distribution in `names` installed in `root`, or ""."""
    from importlib import metadata

    for dist in metadata.distributions(path=[root]):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in names:
            return f"{name} {dist.version}"
    return ""


def _first(roots, rel, dists=()):
    """{path, wheel ("name version"), root} of the first root holding `rel`, or None."""
    for root in roots:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            return {"path": path, "wheel": _dist(root, dists) if dists else "", "root": root}
    return None


def main():
    roots = _roots()
    found = {
        # nvcc: CUDA 13 wheels; a CUDA 12 nvcc is not on PyPI (nvidia-cuda-nvcc-cu12 holds
        # ptxas only), the cu12 layout is looked at in case a later wheel ships one
        "nvcc13": _first(roots, "nvidia/cu13/bin/nvcc", ("nvidia-cuda-nvcc",)),
        "nvcc12": _first(roots, "nvidia/cuda_nvcc/bin/nvcc", ("nvidia-cuda-nvcc-cu12",)),
        "cudnn": _first(roots, "nvidia/cudnn/include/cudnn.h",
                        ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")),
        "cudnn_frontend": _first(roots, "include/cudnn_frontend.h", ("nvidia-cudnn-frontend",)),
        "nvrtc13": _first(roots, "nvidia/cu13/include/nvrtc.h"),
        "nvrtc12": _first(roots, "nvidia/cuda_nvrtc/include/nvrtc.h"),
    }
    nvcc13 = found["nvcc13"]
    if nvcc13:
        # cicc (nvidia-nvvm) newer than ptxas (nvidia-cuda-nvcc) writes PTX that ptxas
        # refuses ("Unsupported .version"); pip does not keep the two in step
        nvcc13["nvvm"] = _dist(nvcc13["root"], ("nvidia-nvvm",))
    # pip's and `python -m build`'s isolated build environments live in the temporary folder
    # and are gone after the build: never a run-time search path
    temporary = os.path.realpath(tempfile.gettempdir()) + os.sep
    for item in found.values():
        if item:
            item["temporary"] = item.pop("root").startswith(temporary)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
