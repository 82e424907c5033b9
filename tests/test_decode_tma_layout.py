"""decode_tma_kernel's shared-memory layout, checked on the host (no GPU needed).

tests/cuda/decode_tma_layout_check.cu includes cuda/decode/decode_tma.cuh and enumerates every
16-byte fragment load of a warp: the head-dim order, the dv order and the key-row
permutation must be bijections (else the kernel silently reads the wrong elements) and
no load may have a bank conflict under the 128-byte TMA swizzle. Needs nvcc; CI has it
(JAX_SDPA_EXPECT_CUDA=1 there turns a missing nvcc into a failure)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "cuda" / "decode_tma_layout_check.cu"


def _nvcc():
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    if found is None:
        if os.environ.get("JAX_SDPA_EXPECT_CUDA") == "1":
            pytest.fail("nvcc not found but JAX_SDPA_EXPECT_CUDA=1")
        pytest.skip("nvcc not found")
    return found


def test_decode_tma_layout_is_bijective_and_conflict_free(tmp_path):
    exe = tmp_path / "decode_tma_layout_check"
    build = subprocess.run([_nvcc(), "-std=c++17", f"-I{ROOT}", "-o", str(exe), str(SOURCE)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok (0 failures)"), run.stdout
