"""Sharded and multi-device attention on 8 virtual CPU devices.

The checks live in tests/sharding_checks.py and run in a subprocess: the device count
(`--xla_force_host_platform_device_count=8`) must be set before JAX initializes, and
pytest's process initialized it already. One subprocess per implementation runs every
check and the test reports every failing one.

- partitioning (jax_sdpa/sharding.py): under jit with NamedShardings over batch and/or
  heads (GQA, MQA, seq-major, masks, sinks, lengths, vmap, Shardy and GSPMD) the results
  equal the unsharded call, forward and gradients, and the compiled HLO has no
  all-gather (MQA's dk/dv and the sinks' gradient need one all-reduce); a sequence split
  becomes a head split (all-to-all), other sequence or head-dim shardings are resharded
  and stay correct; the fused kernel runs per shard.
- ring attention (jax_sdpa/ring.py): inside shard_map it equals full attention, causal and
  not, contiguous and zig-zag, with sinks and GQA, forward and gradients, also with the
  batch on an automatic axis of a partially manual shard_map (no all-gather).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import jax_sdpa
from jax_sdpa import _ext

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "sharding_checks.py"
CHECKS = re.findall(r"^def ([pr]_\w+)\(\):", SCRIPT.read_text(), flags=re.M)
IMPLS = ["xla"] + (["cpu"] if _ext.has_backend("cpu") else [])
_results: dict = {}


def _run(impl):
    if impl in _results:
        return _results[impl]
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # the subprocess must test the jax_sdpa this process imported
    package_root = str(pathlib.Path(jax_sdpa.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, str(SCRIPT), "all", impl], env=env,
                          capture_output=True, text=True, timeout=600)
    lines = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"CHECK (\w+) (ok|FAIL)\s*(.*)", line)
        if m:
            lines[m.group(1)] = (m.group(2) == "ok", m.group(3))
    _results[impl] = (lines, proc)
    return _results[impl]


# One test per implementation (not per check): under pytest-xdist every worker would
# otherwise start its own subprocess.
@pytest.mark.parametrize("impl", IMPLS)
def test_multi_device(impl):
    lines, proc = _run(impl)
    missing = [c for c in CHECKS if c not in lines]
    failed = {c: d for c, (ok, d) in lines.items() if not ok}
    report = "\n".join(f"  {c}: {d}" for c, d in failed.items())
    if missing:
        report += (f"\n  did not report: {missing} (exit {proc.returncode})\n"
                   f"{proc.stderr[-6000:]}")
    print(proc.stdout)  # per-check timings, shown with -s or on failure
    assert not failed and not missing, f"[{impl}] multi-device checks failed:\n{report}"


def test_checks_found():
    assert len(CHECKS) >= 10, CHECKS
