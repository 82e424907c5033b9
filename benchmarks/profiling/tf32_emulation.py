"""What TF32 alone does to one case of the CUDA flash check, on the CPU (no GPU needed).

Our fp32 flash kernels at TF32 (JAX's default precision) round every product's operands to
TF32 (cvt.rna: 10 mantissa bits). This emulates that in float64 for a case of
benchmarks/gpu_flash_check.py, on the check's own inputs (its generator, seed and case order),
and prints the errors against the float64 oracle that such rounding alone gives:
  - the forward: q, k, v and P rounded;
  - the backward handed the reference's out and lse (the check's 16-bit and 3xTF32 cases);
  - the backward handed the TF32 forward's own out and lse (the check's TF32 cases, and a
    training step).
A kernel whose errors match these to a few digits has no error of its own beyond TF32's.

    python benchmarks/profiling/tf32_emulation.py ["fp32 D8/Dv8"]
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import jax.numpy as jnp  # noqa: E402

from jax_sdpa import oracle  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "gpu_flash_check", os.path.join(ROOT, "benchmarks", "gpu_flash_check.py"))
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def tf32(x):
    """float32 -> TF32, round to nearest with ties away from zero (cvt.rna), as float64."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32).astype(np.float64)


def check_inputs(name):
    """The check's case `name` (a prefix) with its inputs and dout, drawn as the check draws
    them (every earlier case consumes the generator too)."""
    rng = np.random.default_rng(0)
    for c in check.cases():
        (q, k, v), kw = check.make_inputs(c, rng)
        ref_o, ref_l = oracle.forward(q, k, v, **check._oracle_kw(kw))
        dout = np.asarray(jnp.asarray(rng.standard_normal(ref_o.shape), check.DTYPES[c["dt"]])
                          .astype(jnp.float32))
        if c["name"].startswith(name):
            return c, (q, k, v), kw, dout, ref_o, ref_l
    raise SystemExit(f"no check case starts with {name!r}")


def main():
    name = sys.argv[1] if len(sys.argv) > 1 else "fp32 D8/Dv8"
    c, (q, k, v), kw, dout, ref_o, ref_l = check_inputs(name)
    if kw.get("mask") is not None or kw.get("qlen") is not None or kw.get("kvlen") is not None \
            or kw["wl"] >= 0 or kw["wr"] >= 0:
        raise SystemExit("this emulation covers dense cases (sinks allowed), not masks or bands")
    group = c["Hq"] // c["Hk"]
    scale = kw["scale"]
    Q, dO = np.asarray(q, np.float64), np.asarray(dout, np.float64)
    K, V = (np.repeat(np.asarray(x, np.float64), group, axis=1) for x in (k, v))
    sinks = kw.get("sinks")
    sink = None if sinks is None else np.asarray(sinks, np.float64).reshape(1, -1, 1, 1)
    truth = oracle.backward(q, k, v, dout, **check._oracle_kw(kw))

    s = np.einsum("bhqd,bhkd->bhqk", tf32(Q), tf32(K)) * scale
    m = s.max(-1, keepdims=True) if sink is None else np.maximum(s.max(-1, keepdims=True), sink)
    e = np.exp(s - m)
    l_sum = e.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink - m))
    lse = (m + np.log(l_sum))[..., 0]
    out = np.einsum("bhqk,bhkd->bhqd", tf32(e), tf32(V)) / l_sum
    print(c["name"])
    print(f"forward: out {oracle.max_rel_error(out, ref_o):.3e} "
          f"lse {np.max(np.abs(lse - ref_l)):.3e}")

    def backward(out_given, lse_given):
        p = np.exp(s - lse_given[..., None])
        dp = np.einsum("bhqd,bhkd->bhqk", tf32(dO), tf32(V))
        ds = tf32(p * (dp - np.sum(dO * out_given, -1, keepdims=True)))
        dq = np.einsum("bhqk,bhkd->bhqd", ds, tf32(K)) * scale
        fold = lambda x: x.reshape(x.shape[0], -1, group, *x.shape[2:]).sum(2)  # noqa: E731
        dk = fold(np.einsum("bhqk,bhqd->bhkd", ds, tf32(Q)) * scale)
        dv = fold(np.einsum("bhqk,bhqd->bhkd", tf32(p), tf32(dO)))
        return "  ".join(f"{n} {oracle.max_rel_error(g, truth[n]):.3e}"
                         for n, g in (("dq", dq), ("dk", dk), ("dv", dv)))

    reference_out = np.asarray(jnp.asarray(ref_o, jnp.float32), np.float64)
    print("backward from the reference's out / lse:", backward(reference_out, ref_l))
    print("backward from the TF32 forward's own:   ", backward(out, lse))


if __name__ == "__main__":
    main()
