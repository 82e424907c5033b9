"""Checks a jax_sdpa wheel built by tools/build_wheel.sh; prints what it holds.

    python tools/check_wheel.py dist/cuda13/jax_sdpa-*.whl --cuda 13 [--pip-nvcc]
        [--load-with SITE_PACKAGES]

Fails (exit 1) unless: the platform tag is manylinux; the CPU and CUDA modules are in it and
its build record says the CUDA backend was built for that CUDA major (with --pip-nvcc: by
pip's nvcc); no libcudnn is bundled; the CUDA module needs libcudnn.so.9, finds it through
$ORIGIN/../nvidia/cudnn/lib, links cudart statically and names no build-time folder. With
--load-with (a site-packages holding an nvidia-cudnn wheel), the CUDA module is also loaded, as
installed beside that libcudnn, by this Python (the wheel's): every symbol must resolve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile


def _dynamic_section(path):
    text = subprocess.run(["readelf", "-d", path], check=True, capture_output=True,
                          text=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", text)
    rpath = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library (?:rpath|runpath): \[([^\]]*)\]", text)
    return needed, (rpath[0].split(":") if rpath else [])


def _load(wheel: str, module: str, site_packages: str):
    """Loads `module` from the wheel unpacked into a site-packages whose nvidia/cudnn is the
    one in `site_packages`; returns an error message or None."""
    with tempfile.TemporaryDirectory() as site:
        with zipfile.ZipFile(wheel) as z:
            z.extract(module, site)
        os.makedirs(os.path.join(site, "nvidia"))
        os.symlink(os.path.abspath(os.path.join(site_packages, "nvidia", "cudnn")),
                   os.path.join(site, "nvidia", "cudnn"))
        code = f"import ctypes; ctypes.CDLL({os.path.join(site, module)!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        return proc.stderr.strip().splitlines()[-1] if proc.returncode else None


def check(wheel: str, cuda: str, pip_nvcc: bool, load_with=None) -> list:
    problems = []
    name = os.path.basename(wheel)
    if not re.search(r"-manylinux_\d+_\d+_x86_64\.whl$", name):
        problems.append(f"{name}: not a manylinux x86_64 wheel")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        cuda_modules = [n for n in names if re.fullmatch(r"jax_sdpa/_sdpa_cuda\..*\.so", n)]
        cpu_modules = [n for n in names if re.fullmatch(r"jax_sdpa/_sdpa_cpu\..*\.so", n)]
        if len(cuda_modules) != 1:
            problems.append(f"expected one CUDA module, found {cuda_modules}")
        if len(cpu_modules) != 1:
            problems.append(f"expected one CPU module, found {cpu_modules}")
        bundled = [n for n in names if "libcudnn" in os.path.basename(n)]
        if bundled:
            problems.append(f"libcudnn is bundled: {bundled}")
        grafted = [n for n in names if ".libs/" in n]
        try:
            info = json.loads(z.read("jax_sdpa/_build_info.json"))
        except KeyError:
            info = {}
            problems.append("no jax_sdpa/_build_info.json")
        with tempfile.TemporaryDirectory() as tmp:
            needed, rpath = [], []
            if cuda_modules:
                z.extract(cuda_modules[0], tmp)
                needed, rpath = _dynamic_section(os.path.join(tmp, cuda_modules[0]))
    cuda_info = info.get("cuda", {})
    if not info.get("backends", {}).get("cuda", {}).get("built"):
        problems.append(f"build record: CUDA backend not built: {info.get('backends')}")
    if cuda_info.get("cuda_major") != cuda:
        problems.append(f"build record: CUDA {cuda_info.get('cuda_major')}, expected {cuda}")
    if pip_nvcc and not cuda_info.get("nvcc_source", "").startswith("pip wheel"):
        problems.append(f"nvcc was not pip's: {cuda_info.get('nvcc')} "
                        f"({cuda_info.get('nvcc_source')})")
    if "libcudnn.so.9" not in needed:
        problems.append(f"the CUDA module does not need libcudnn.so.9: {needed}")
    if any(n.startswith("libcudart") for n in needed):
        problems.append(f"cudart is linked dynamically: {needed}")
    if "$ORIGIN/../nvidia/cudnn/lib" not in rpath:
        problems.append(f"RPATH lacks $ORIGIN/../nvidia/cudnn/lib: {rpath}")
    foreign = [p for p in rpath if not p.startswith("$ORIGIN")]
    if foreign:
        problems.append(f"RPATH names build-time folders: {foreign}")

    if load_with and cuda_modules:
        error = _load(wheel, cuda_modules[0], load_with)
        if error:
            problems.append(f"the CUDA module does not load: {error}")
        else:
            print(f"  the CUDA module loads beside {load_with}/nvidia/cudnn")

    size = os.path.getsize(wheel)
    print(f"{name}: {size / 2**20:.1f} MiB, {len(names)} files")
    print(f"  modules: {', '.join(os.path.basename(m) for m in cpu_modules + cuda_modules)}")
    print(f"  CUDA module needs {', '.join(needed)}; RPATH {':'.join(rpath)}")
    print(f"  grafted libraries: {', '.join(grafted) or 'none'}")
    for key in ("nvcc", "nvcc_version", "nvcc_source", "architectures", "cudnn_headers",
                "cudnn_frontend"):
        print(f"  {key}: {cuda_info.get(key)}")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("--cuda", required=True, choices=["12", "13"])
    p.add_argument("--pip-nvcc", action="store_true",
                   help="require that pip's nvcc (nvidia-cuda-nvcc) built it")
    p.add_argument("--load-with", metavar="SITE_PACKAGES",
                   help="also load the CUDA module beside this site-packages' nvidia/cudnn")
    args = p.parse_args(argv)
    problems = check(args.wheel, args.cuda, args.pip_nvcc, args.load_with)
    for problem in problems:
        print(f"FAIL {problem}")
    print("wheel ok" if not problems else f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
