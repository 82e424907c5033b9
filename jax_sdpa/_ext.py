"""Loads the compiled backend modules and registers their FFI targets with XLA.

Each module (`_sdpa_cpu`, `_sdpa_cuda`, `_sdpa_metal`) exposes `registrations()`,
a dict {target name: capsule}, and `served_features()`, {target name: [contract features
its kernels serve]} (ffi/registry.h); targets are named
`jax_sdpa_<implementation>_<fwd|bwd>`.
Registration is deferred by JAX until the platform's plugin loads, so importing
this on a machine without a GPU is fine. A module that is missing or fails to
load only makes its implementations unavailable (dispatch says why).
"""

from __future__ import annotations

import importlib
from typing import Optional

import jax

from jax_sdpa import build_info

# module -> XLA platform name its handlers run on
_MODULES = {"_sdpa_cpu": "cpu", "_sdpa_metal": "cpu", "_sdpa_cuda": "CUDA"}

_targets: dict[str, str] = {}  # target name -> module
_features: dict[str, frozenset] = {}  # target name -> features its kernels serve
_modules: dict[str, object] = {}
_load_errors: dict[str, str] = {}
_loaded = False


def _load():
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:  # registration is deferred until a platform starts: start them, so that a handler
        jax.devices()  # the running jaxlib refuses fails here, where it is caught
    except Exception:  # noqa: BLE001 - no usable platform: registration stays deferred
        pass
    for module_name, platform in _MODULES.items():
        try:
            module = importlib.import_module(f"jax_sdpa.{module_name}")
        except ImportError as e:
            _load_errors[module_name] = str(e)
            continue
        served = module.served_features()
        try:
            for target, capsule in module.registrations().items():
                jax.ffi.register_ffi_target(target, capsule, platform=platform)
                _targets[target] = module_name
                _features[target] = frozenset(served[target])
        except Exception as e:  # noqa: BLE001 - e.g. handlers of a newer XLA FFI API
            for target in [t for t, m in _targets.items() if m == module_name]:
                del _targets[target], _features[target]
            _load_errors[module_name] = str(e).splitlines()[0] if str(e) else type(e).__name__
            continue
        _modules[module_name] = module


def has_backend(implementation: str) -> bool:
    _load()
    return f"jax_sdpa_{implementation}_fwd" in _targets


def served_features(target: str) -> frozenset:
    """The contract features ("segment_ids", "logits_soft_cap") FFI target `target`'s
    kernels serve, as its handler registered them (empty for an unknown target)."""
    _load()
    return _features.get(target, frozenset())


def ffi_targets() -> list:
    """Names of every FFI target registered from the compiled modules, sorted."""
    _load()
    return sorted(_targets)


def module(name: str):
    _load()
    return _modules.get(name)


def unavailable_reason(backend: str) -> Optional[str]:
    """Why backend `backend` ("cpu", "cuda", "metal") can't run here, with the command that
    fixes it; None when its module is loaded."""
    _load()
    name = build_info.MODULES[backend]
    if name in _modules:
        return None
    if not build_info.backend(backend).get("built"):
        return "not built: " + build_info.not_built_reason(backend)
    error = _load_errors.get(name, "?")
    fix = ""
    if backend == "cuda" and "undefined symbol" in error and "libcudnn" in error:
        # built against newer cuDNN headers than the libcudnn found
        fix = f"; to fix: {build_info.cudnn_upgrade_fix()}"
    elif backend == "cuda" and "libcudnn" in error:
        fix = f"; to fix: {build_info.cuda_runtime_fix()}"
    elif "API version" in error:
        # compiled against a newer jaxlib's XLA FFI headers than the jaxlib running
        fix = ("; to fix: upgrade jax, or build jax_sdpa against the installed one: "
               "pip install --force-reinstall --no-deps --no-build-isolation jax_sdpa")
    return f"built, but failed to load ({error}){fix}"


def status() -> dict:
    """What is built: {module: 'loaded: targets' | why not, and the fix}."""
    _load()
    out = {}
    for backend, name in build_info.MODULES.items():
        if name in _modules:
            out[name] = "loaded: " + ", ".join(
                sorted(t for t, m in _targets.items() if m == name))
        else:
            out[name] = unavailable_reason(backend)
    return out
