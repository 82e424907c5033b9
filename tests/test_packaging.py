"""The installed distribution's metadata: what pip sees."""

import re
from importlib import metadata

import pytest

DIST = metadata.distribution("jax_sdpa")


def _requires(extra=None):
    out = []
    for req in DIST.requires or []:
        marker = re.search(r'extra == "([^"]+)"', req)
        if (marker.group(1) if marker else None) == extra:
            out.append(req.split(";")[0].strip())
    return out


def test_python_and_license():
    assert DIST.metadata["Requires-Python"] == ">=3.11"
    assert DIST.metadata["License-Expression"] == "Apache-2.0"
    assert any(str(f).endswith("LICENSE") for f in DIST.files)
    assert "Apache License" in next(f for f in DIST.files
                                    if str(f).endswith("LICENSE")).read_text()
    classifiers = DIST.metadata.get_all("Classifier")
    for version in ("3.11", "3.12"):
        assert f"Programming Language :: Python :: {version}" in classifiers


def test_the_cpu_install_pulls_no_cuda_packages():
    base = _requires()
    assert any(r.startswith("jax") for r in base)
    assert not [r for r in base if "nvidia" in r or "cuda" in r], base


def test_jax_range_is_the_tested_one():
    jax_req = next(r for r in _requires() if re.match(r"jax\b", r) and not r.startswith("jax["))
    assert ">=0.10" in jax_req and "<0.13" in jax_req, jax_req


@pytest.mark.parametrize("extra, wants", [
    ("cuda13", ["jax[cuda13]", "nvidia-cudnn-cu13"]),
    ("cuda12", ["jax[cuda12]", "nvidia-cudnn-cu12"]),
    ("flax", ["flax"]),
    ("bench", ["matplotlib"]),
    ("test", ["pytest", "flax", "flatbuffers"]),
])
def test_extras(extra, wants):
    assert extra in DIST.metadata.get_all("Provides-Extra")
    got = _requires(extra)
    for want in wants:
        assert any(r.startswith(want) for r in got), (extra, got)
