"""The build record (jax_sdpa/_build_info.json, written by CMake) and what reads it."""

import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jax_sdpa
from jax_sdpa import _ext, build_info

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_the_record_covers_every_backend():
    info = build_info.read()
    assert info, (f"{build_info._FILE} is missing: is {jax_sdpa.__file__} a source checkout "
                  f"on sys.path (`python -m pytest` from it) rather than the installed package?")
    assert set(info["backends"]) == set(build_info.MODULES)
    for name, record in info["backends"].items():
        assert isinstance(record["built"], bool), (name, record)
        assert record.get("detail" if record["built"] else "reason"), (name, record)
    assert info["build"]["jaxlib"] and info["build"]["python"]


def test_the_record_matches_the_modules():
    for backend, module in build_info.MODULES.items():
        built = build_info.backend(backend)["built"]
        try:
            importlib.import_module(f"jax_sdpa.{module}")
            imported = True
        except ImportError as e:
            imported = False
            error = str(e)
        if built and not imported:  # only a run-time library may be missing then
            assert "cannot open shared object file" in error, error
            assert _ext.unavailable_reason(backend).startswith("built, but failed to load")
        else:
            assert built == imported, (backend, build_info.backend(backend))
            assert (_ext.unavailable_reason(backend) is None) == built


def test_cuda_record_says_what_it_was_built_with():
    if not build_info.backend("cuda")["built"]:
        pytest.skip("the CUDA backend is not built here: " + build_info.not_built_reason("cuda"))
    cuda = build_info.read()["cuda"]
    assert cuda["cuda_major"] in ("12", "13") and cuda["nvcc_version"].startswith(
        cuda["cuda_major"] + ".")
    module = _ext.module("_sdpa_cuda")
    if module is not None:  # the facts CMake read agree with the compiled headers
        v = module.cudnn_compiled_version()
        assert cuda["cudnn_headers"] == f"{v // 10000}.{(v // 100) % 100}.{v % 100}"
        fe = module.cudnn_frontend_version()
        assert cuda["cudnn_frontend"] == f"{fe // 10000}.{(fe // 100) % 100}.{fe % 100}"


def test_explain_names_the_reason_and_the_fix_for_a_missing_backend():
    s = jax.ShapeDtypeStruct((1, 2, 8, 16), jnp.float16)
    missing = [b for b in build_info.MODULES if _ext.unavailable_reason(b)]
    if not missing:
        pytest.skip("every backend is built and loaded here")
    impl = {"cpu": ["cpu"], "metal": ["metal"], "cuda": ["cudnn", "cuda"]}
    platform = {"cpu": "cpu", "metal": "cpu", "cuda": "cuda"}
    for backend in missing:
        ex = jax_sdpa.explain(s, s, s, platform=platform[backend])
        for name in impl[backend]:
            ok, reason = ex.verdicts[name]
            assert not ok and _ext.unavailable_reason(backend) in reason, (name, reason)


def _cmake():
    exe = shutil.which("cmake")
    if exe is None or subprocess.run([exe, "--version"], capture_output=True).returncode:
        pytest.skip("no cmake on PATH")
    return exe


def test_cmake_writes_valid_json_whatever_the_text(tmp_path):
    """cmake/JaxSdpaBuildInfo.cmake escapes quotes, backslashes, newlines and keeps ';'."""
    (tmp_path / "CMakeLists.txt").write_text(f'''
cmake_minimum_required(VERSION 3.24)
project(probe NONE)
list(APPEND CMAKE_MODULE_PATH "{ROOT / 'cmake'}")
include(JaxSdpaBuildInfo)
jax_sdpa_backend_built(cpu "a kernel; with a semicolon")
jax_sdpa_backend_skipped(cuda "no \\"nvcc\\" in C:\\\\cuda" "pip install '.[cuda13]' -Cjax_sdpa.cuda=13")
jax_sdpa_build_fact(cuda architectures "80;90")
jax_sdpa_write_build_info()
''')
    build = tmp_path / "build"
    subprocess.run([_cmake(), "-S", str(tmp_path), "-B", str(build)], check=True,
                   capture_output=True)
    info = json.loads((build / "_build_info.json").read_text())
    assert info["backends"]["cpu"] == {"built": True, "detail": "a kernel; with a semicolon"}
    assert info["backends"]["cuda"] == {"built": False, "reason": 'no "nvcc" in C:\\cuda',
                                        "fix": "pip install '.[cuda13]' -Cjax_sdpa.cuda=13"}
    assert info["cuda"] == {"architectures": "80;90"}


def _fake_wheel(root, files, dists):
    for rel in files:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    for name, version in dists:
        meta = root / f"{name.replace('-', '_')}-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_wheel_probe_finds_pips_cuda_packages(tmp_path):
    """cmake/find_cuda_wheels.py, on a folder laid out as the CUDA 13 wheels install."""
    site = tmp_path / "site"
    _fake_wheel(site, ["nvidia/cu13/bin/nvcc", "nvidia/cu13/include/nvrtc.h",
                       "nvidia/cudnn/include/cudnn.h", "include/cudnn_frontend.h"],
                [("nvidia-cuda-nvcc", "13.0.88"), ("nvidia-nvvm", "13.5.37"),
                 ("nvidia-cudnn-cu13", "9.28.1.4"), ("nvidia-cudnn-frontend", "1.32.0")])
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, str(ROOT / "cmake" / "find_cuda_wheels.py")],
                         env=env, check=True, capture_output=True, text=True).stdout
    found = json.loads(out)
    assert found["nvcc13"]["path"] == str(site / "nvidia/cu13/bin/nvcc")
    assert found["nvcc13"]["wheel"] == "nvidia-cuda-nvcc 13.0.88"
    assert found["nvcc13"]["nvvm"] == "nvidia-nvvm 13.5.37"  # newer: CMake refuses it
    assert found["cudnn"]["wheel"] == "nvidia-cudnn-cu13 9.28.1.4"
    assert found["cudnn_frontend"]["wheel"] == "nvidia-cudnn-frontend 1.32.0"
    assert found["nvrtc13"]["path"] == str(site / "nvidia/cu13/include/nvrtc.h")
    assert found["nvcc12"] is None and found["nvrtc12"] is None
    import tempfile
    under_tmp = str(tmp_path).startswith(os.path.realpath(tempfile.gettempdir()))
    assert found["cudnn"]["temporary"] is under_tmp  # never a run-time search path then


def test_cudnn_verdicts_check_the_loaded_version(monkeypatch):
    """Each cuDNN feature against the loaded libcudnn (facts faked: no GPU in CI)."""
    from jax_sdpa import dispatch
    if _ext.module("_sdpa_cuda") is None:  # the rule also asks the module's bound facts
        pytest.skip("the CUDA module is not built here: " + build_info.not_built_reason("cuda"))
    monkeypatch.setattr(_ext, "has_backend", lambda name: True)
    monkeypatch.setattr(dispatch, "cudnn_header_version", lambda: 92801)
    s = jax.ShapeDtypeStruct
    q, kv = s((2, 8, 64, 64), jnp.bfloat16), s((2, 2, 64, 64), jnp.bfloat16)

    def verdict(version, **kw):
        monkeypatch.setattr(dispatch, "_CUDNN_FACTS", (version, (9, 0)))
        return jax_sdpa.explain(q, kv, kv, platform="cuda", **kw).verdicts["cudnn"]

    ok, why = verdict(91900)
    assert ok and "cuDNN 9.19.0 loaded (built against 9.28.1)" in why
    ok, why = verdict(91200, sinks=s((8,), jnp.bfloat16))  # MLX: sinks promote to the output dtype
    assert not ok and "sinks need cuDNN >= 9.13, the loaded one is 9.12.0" in why
    ok, why = verdict(91900, sinks=s((8,), jnp.bfloat16))
    assert ok
    ok, why = verdict(90500, mask="causal", key_value_seq_lengths=s((2,), jnp.int32))
    assert not ok and "needs cuDNN >= 9.6, the loaded one is 9.5.0" in why
    ok, why = verdict(81000)
    assert not ok and "the loaded one is 8.10.0" in why
    monkeypatch.setattr(dispatch, "cudnn_header_version", lambda: 100100)
    ok, why = verdict(91900)
    assert not ok and "not of the major version this module was built against (10.1.0)" in why
