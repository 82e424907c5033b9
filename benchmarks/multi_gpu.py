"""Multi-GPU scaling: batch-sharded prefill and ring attention (needs >= 2 GPUs).

    python3 benchmarks/multi_gpu.py [--out results.json] [--quick] [--impl cudnn]

1. Batch-sharded prefill: the same global batch on 1 GPU and split over 2 GPUs
   (NamedSharding P("batch"), jax_sdpa's custom partitioning runs the kernel per shard);
   forward and forward+backward; reports time, TFLOP/s (total and per GPU) and the
   speedup 1 -> 2 GPUs (ideal 2x), and checks the compiled program has no all-gather.
2. Ring attention (context parallelism): L = 65536 split over 2 GPUs (32768 each), causal,
   contiguous and zig-zag layouts, against full causal attention on one GPU at L = 32768
   (the same per-device length) and, when it fits, on one GPU at L = 65536.
   In units of one 32768 x 32768 block (one-GPU causal at 32768 = 0.5), the busiest
   device does 1.5 (contiguous: diagonal + one full block) or 1.0 (zig-zag: diagonal +
   two half blocks), so the ideal ring time is 3x (contiguous) or 2x (zig-zag) the
   one-GPU time at 32768, and the ideal speedup over one GPU at 65536 (2.0) is 1.33x or 2x.

Times are medians of wall-clock samples of one jitted call each, after warm-up (the
calls here take milliseconds, so dispatch is negligible). TFLOP/s count
4*B*Hq*Lq*Lk*D, halved for causal, x3.5 for forward+backward.
Not run yet: no two-GPU machine was available when this was written.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"  # never time the test-only poisoning
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jax_sdpa  # noqa: E402
from jax_sdpa import ring as ring_mod  # noqa: E402


def timeit(fn, *args, warmup=2, samples=10):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flops(b, hq, lq, lk, d, causal, backward):
    f = 4.0 * b * hq * lq * lk * d * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def fwd_bwd(f):
    """Forward+backward of sum(out): grads w.r.t. q, k, v."""
    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))


def inputs(key, b, hq, hk, length, d, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, hq, length, d), dtype),
            jax.random.normal(kk, (b, hk, length, d), dtype),
            jax.random.normal(kv, (b, hk, length, d), dtype))


def collectives(compiled):
    text = compiled.as_text()
    return sorted({c for c in ("all-gather", "all-reduce", "collective-permute",
                               "all-to-all", "reduce-scatter") if c in text})


# ---------------------------------------------------------------------------

def batch_sharded_prefill(args, devices, rows):
    b, hq, hk, length, d = args.batch, 32, 8, args.prefill_len, 128
    dtype = jnp.bfloat16
    f = lambda q, k, v: jax_sdpa.scaled_dot_product_attention(  # noqa: E731
        q, k, v, mask="causal", implementation=args.impl)
    q, k, v = inputs(jax.random.PRNGKey(0), b, hq, hk, length, d, dtype)
    for mode, fn in (("fwd", f), ("fwd+bwd", fwd_bwd(f))):
        one = [jax.device_put(x, devices[0]) for x in (q, k, v)]
        jitted = jax.jit(fn)
        t1 = timeit(jitted, *one, samples=args.samples)
        mesh = Mesh(np.array(devices[:2]), ("batch",))
        sharded = [jax.device_put(x, NamedSharding(mesh, P("batch"))) for x in (q, k, v)]
        compiled = jax.jit(fn).lower(*sharded).compile()
        t2 = timeit(compiled, *sharded, samples=args.samples)
        fl = flops(b, hq, length, length, d, True, mode != "fwd")
        row = dict(bench="batch-sharded prefill", mode=mode,
                   shape=f"B{b} H{hq}/KV{hk} L{length} D{d} causal bf16",
                   t_1gpu_ms=t1 * 1e3, t_2gpu_ms=t2 * 1e3, speedup=t1 / t2,
                   tflops_1gpu=fl / t1 / 1e12, tflops_2gpu_total=fl / t2 / 1e12,
                   tflops_2gpu_per_gpu=fl / t2 / 2e12,
                   collectives_2gpu=collectives(compiled))
        rows.append(row)
        print(f"{row['bench']:22s} {mode:8s} 1 GPU {t1 * 1e3:9.2f} ms "
              f"({row['tflops_1gpu']:6.1f} TF/s)  2 GPUs {t2 * 1e3:9.2f} ms "
              f"({row['tflops_2gpu_per_gpu']:6.1f} TF/s/GPU)  x{t1 / t2:.2f}  "
              f"collectives {row['collectives_2gpu']}", flush=True)


def ring(args, devices, rows):
    b, hq, hk, d = 1, args.ring_heads, args.ring_heads // 4, 128
    total = args.ring_len
    dtype = jnp.bfloat16
    n = 2
    mesh = Mesh(np.array(devices[:n]), ("sp",))
    spec = P(None, None, "sp")
    q, k, v = inputs(jax.random.PRNGKey(1), b, hq, hk, total, d, dtype)

    def full(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                     implementation=args.impl)

    # one GPU at the per-device length (weak scaling) and, if it fits, the full length
    singles = {}
    for length in (total // n, total):
        for mode, fn in (("fwd", full), ("fwd+bwd", fwd_bwd(full))):
            xs = [jax.device_put(x[:, :, :length], devices[0]) for x in (q, k, v)]
            try:
                t = timeit(jax.jit(fn), *xs, samples=args.samples)
            except Exception as e:  # noqa: BLE001 - out of memory at the full length
                print(f"one GPU L={length} {mode}: {type(e).__name__}: {str(e)[:200]}")
                continue
            singles[(length, mode)] = t
            fl = flops(b, hq, length, length, d, True, mode != "fwd")
            rows.append(dict(bench="single GPU full attention", mode=mode,
                             shape=f"B{b} H{hq}/KV{hk} L{length} D{d} causal bf16",
                             t_ms=t * 1e3, tflops=fl / t / 1e12))
            print(f"{'1 GPU full':22s} {mode:8s} L={length:6d} {t * 1e3:9.2f} ms "
                  f"({fl / t / 1e12:6.1f} TF/s)", flush=True)

    for layout in (None, "zigzag"):
        def local(q, k, v, layout=layout):
            return jax_sdpa.ring_attention(q, k, v, axis_name="sp", mask="causal",
                                           layout=layout, implementation=args.impl)

        sm = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        # zig-zag: permute once outside the timed region (a real model keeps the layout)
        xs = [ring_mod.to_zigzag(x, n) if layout == "zigzag" else x for x in (q, k, v)]
        xs = [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]
        for mode, fn in (("fwd", sm), ("fwd+bwd", fwd_bwd(sm))):
            compiled = jax.jit(fn).lower(*xs).compile()
            t = timeit(compiled, *xs, samples=args.samples)
            fl = flops(b, hq, total, total, d, True, mode != "fwd")
            weak = singles.get((total // n, mode))
            strong = singles.get((total, mode))
            row = dict(bench="ring attention", layout=layout or "contiguous", mode=mode,
                       shape=f"B{b} H{hq}/KV{hk} L{total} over {n} GPUs D{d} causal bf16",
                       t_ms=t * 1e3, tflops_total=fl / t / 1e12,
                       tflops_per_gpu=fl / t / n / 1e12,
                       # busiest device's work / one GPU's at L/n (see the doc)
                       ideal_vs_1gpu_half_len=float(n if layout else 2 * n - 1),
                       ratio_vs_1gpu_half_len=(t / weak) if weak else None,
                       speedup_vs_1gpu_full_len=(strong / t) if strong else None,
                       collectives=collectives(compiled))
            rows.append(row)
            print(f"{'ring ' + row['layout']:22s} {mode:8s} L={total:6d} {t * 1e3:9.2f} ms "
                  f"({row['tflops_per_gpu']:6.1f} TF/s/GPU)  vs 1 GPU L/2: "
                  f"{row['ratio_vs_1gpu_half_len'] or float('nan'):.2f}x time "
                  f"(ideal {row['ideal_vs_1gpu_half_len']:.2f})  vs 1 GPU L: "
                  f"{row['speedup_vs_1gpu_full_len'] or float('nan'):.2f}x speedup",
                  flush=True)


def correctness(args, devices):
    """Ring equals full attention at a small size on the same GPUs (a sanity check)."""
    n, length = 2, 256 if args.cpu_smoke else 2048
    mesh = Mesh(np.array(devices[:n]), ("sp",))
    spec = P(None, None, "sp")
    q, k, v = inputs(jax.random.PRNGKey(2), 1, 8, 2, length, 128, jnp.bfloat16)
    want = jax_sdpa.scaled_dot_product_attention(q, k, v, mask="causal",
                                                 implementation=args.impl)
    for layout in (None, "zigzag"):
        sm = jax.shard_map(lambda q, k, v, layout=layout: jax_sdpa.ring_attention(
            q, k, v, axis_name="sp", mask="causal", layout=layout, implementation=args.impl),
            mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        perm = (lambda x: ring_mod.to_zigzag(x, n)) if layout else (lambda x: x)
        unperm = (lambda x: ring_mod.from_zigzag(x, n)) if layout else (lambda x: x)
        got = unperm(jax.jit(sm)(perm(q), perm(k), perm(v)))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        print(f"ring {layout or 'contiguous'} vs full attention (bf16, L={length}): "
              f"max abs error {err:.3g}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--impl", default=None, help="implementation (default: fastest)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--ring-len", type=int, default=65536)
    parser.add_argument("--ring-heads", type=int, default=32)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny sizes on 2 virtual CPU devices (checks the script runs)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.prefill_len, args.ring_len, args.samples = 4, 2048, 8192, 3
    if args.cpu_smoke:
        args.batch, args.prefill_len, args.ring_len, args.samples = 2, 128, 256, 1
        args.ring_heads = 4
    devices = jax.devices()
    if len(devices) < 2 or (devices[0].platform != "gpu" and not args.cpu_smoke):
        sys.exit(f"needs two GPUs; found {devices}")
    print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}", flush=True)
    rows = []
    correctness(args, devices)
    batch_sharded_prefill(args, devices, rows)
    ring(args, devices, rows)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results",
        f"multi_gpu_{datetime.datetime.now(datetime.timezone.utc):%Y%m%d_%H%M%S}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(dict(jax=jax.__version__, devices=[str(d) for d in devices[:2]],
                       device_kind=devices[0].device_kind, rows=rows), fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
