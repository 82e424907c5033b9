"""What packing (segment ids) and logit soft-capping cost, beside the same call without them.

    python benchmarks/cpu_packing.py [--json benchmarks/results/cpu_2core/packing_softcap.json]

Rows (B1 H8 D64 float32, L = 4096, forward and forward+backward), for every implementation
here that serves the feature (served_features()), xla_chunked always:
- "full": no ids, not causal (unpacked full attention);
- "packed 8": 8 equal segments of 512 (each query sees its own 512 keys: 1/8 of the work);
- "full causal" / "packed 8 causal": the same under a causal mask;
- "soft cap": "full" with logits_soft_cap=30.
Median time over repeats (jax_sdpa.bench.time_fn), temporaries from memory_analysis.
"""

from __future__ import annotations

import argparse
import datetime
import json

import jax
import jax.numpy as jnp

import jax_sdpa
from jax_sdpa import _ext, bench

B, H, L, D = 1, 8, 4096, 64
SEGMENTS = 8


def _served(impl, features):
    if impl in ("xla", "xla_chunked"):
        return True
    return all(set(features) <= _ext.served_features(f"jax_sdpa_{impl}_{d}")
               for d in ("fwd", "bwd"))


ROWS = {
    "full": dict(),
    "packed 8": dict(segments=True),
    "full causal": dict(causal=True),
    "packed 8 causal": dict(segments=True, causal=True),
    "soft cap": dict(cap=30.0),
}


def _fn(impl, segments=False, causal=False, cap=None):
    ids = jnp.repeat(jnp.arange(SEGMENTS, dtype=jnp.int32), L // SEGMENTS)[None]

    def f(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(
            q, k, v, mask="causal" if causal else None,
            q_segment_ids=ids if segments else None, logits_soft_cap=cap,
            implementation=impl)

    return f


def run(min_time=1.0):
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(key, (B, H, L, D), jnp.float32) for key in ks)
    impls = [i for i in ("cpu", "xla_chunked") if i == "xla_chunked" or _ext.has_backend(i)]
    results = []
    for impl in impls:
        for row, kw in ROWS.items():
            features = (["segment_ids"] if kw.get("segments") else []) + \
                (["logits_soft_cap"] if kw.get("cap") else [])
            for direction in ("fwd", "fwd+bwd"):
                entry = dict(row=row, impl=impl, direction=direction, b=B, h=H, l=L, d=D,
                             dtype="float32", segments=SEGMENTS if kw.get("segments") else 1,
                             time_s=None, temp_bytes=None, error=None)
                results.append(entry)
                if not _served(impl, features):
                    entry["error"] = f"{impl} does not serve {features} in this build"
                    print(f"{impl:12s} {row:16s} {direction:8s} not served")
                    continue
                f = _fn(impl, **kw)
                if direction == "fwd":
                    jitted, args = jax.jit(f), (q, k, v)
                else:
                    def loss(q, k, v, do, f=f):
                        return jnp.sum(f(q, k, v) * do)

                    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                    args = (q, k, v, do)
                entry["temp_bytes"] = bench.temp_bytes(jitted, args)
                entry["time_s"] = bench.time_fn(jitted, args, min_time=min_time)
                print(f"{impl:12s} {row:16s} {direction:8s} {entry['time_s'] * 1e3:9.1f} ms")
    return results


def ratios(results):
    """{impl direction: {packed / full, packed causal / full causal, soft cap / full}}."""
    t = {(r["impl"], r["direction"], r["row"]): r["time_s"] for r in results}
    out = {}
    for impl, direction, _ in t:
        key = f"{impl} {direction}"
        if key in out:
            continue
        get = lambda row: t.get((impl, direction, row))  # noqa: E731
        pairs = {"packed 8 / full": ("packed 8", "full"),
                 "packed 8 causal / full causal": ("packed 8 causal", "full causal"),
                 "soft cap / full": ("soft cap", "full")}
        out[key] = {name: (get(a) / get(b) if get(a) and get(b) else None)
                    for name, (a, b) in pairs.items()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--min-time", type=float, default=1.0)
    args = p.parse_args()
    results = run(args.min_time)
    summary = ratios(results)
    for key, vals in summary.items():
        print(key, {k: (None if v is None else round(v, 3)) for k, v in vals.items()})
    if args.json:
        report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), suite="packing_softcap", device=bench.device_description(),
            platform=bench.default_platform(), versions=bench.versions(), results=results,
            ratios=summary)
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
