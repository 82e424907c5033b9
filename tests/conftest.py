"""Test setup shared by every test file (the shared case base is tests/sdpa_testing.py)."""

import os

# Handlers poison their outputs (NaN) before running: unwritten elements fail tests.
os.environ.setdefault("JAX_SDPA_POISON_OUTPUTS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _has_gpu():
    try:
        return jax.default_backend() == "gpu"
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the H200 machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """Fresh random inputs every run; the seed is printed when a test fails, and
    JAX_SDPA_TEST_SEED replays it."""
    seed = int(os.environ.get("JAX_SDPA_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"[{request.node.name}] numpy seed = {seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def cuda_module():
    """The `_sdpa_cuda` module, whose bindings dispatch asks for the CUDA kernels' facts
    (workspace bytes, head dims, refusals). Skips where it is not built, unless
    JAX_SDPA_EXPECT_CUDA=1 (CI builds it without a GPU) makes that a failure."""
    from jax_sdpa import _ext

    module = _ext.module("_sdpa_cuda")
    if module is None:
        if os.environ.get("JAX_SDPA_EXPECT_CUDA") == "1":
            pytest.fail("the CUDA module is not built but JAX_SDPA_EXPECT_CUDA=1")
        pytest.skip("the CUDA module is not built into this installation")
    return module
