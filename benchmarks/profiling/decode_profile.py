"""Where a decode call's time goes on the GPU: wall time per call (K dependent calls
in one jit, as gpu_decode.py times them) against the device-side picture
from the JAX profiler (CUPTI): the kernels each call launches, their summed busy time
and the span from the first kernel's start to the last one's end. busy << span means
the GPU waits for the host between calls (per-call host work or a synchronization);
span ~ busy means the kernels themselves are the cost.

    python3 -P benchmarks/profiling/decode_profile.py [--rows 0,1] [--out DIR]

Knob settings (JAX_SDPA_CUDA_DECODE_*) are applied per variant; the FFI target is the
installed jax_sdpa._sdpa_cuda module's.
"""
import argparse
import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import gpu_decode as gd  # noqa: E402

ROWS = gd.BENCH_ROWS[:5]
KNOB = "JAX_SDPA_CUDA_DECODE_"


# Knob settings per row (JAX_SDPA_CUDA_DECODE_*; {} = the defaults), then the peers.
VARIANTS = {  # knob settings (JAX_SDPA_CUDA_DECODE_*) timed per row besides the default
    0: [{}],
    1: [{}],
    2: [{}, {"WIDE_TMA": "off"}],  # the wide kernel fed by TMA (default) and by cp.async
    3: [{}, {"WIDE_TMA": "off"}],
    4: [{}],
}


def _variants(row_index, dt, D):
    v = [("ours" + "".join(f" {k}={x}" for k, x in knobs.items()), knobs)
         for knobs in VARIANTS.get(row_index, [{}])]
    v.append(("xla", None))
    if dt != "fp32" and D <= 256:
        v.append(("cudnn", None))
    return v


def _fn(name):
    if name.startswith("ours"):
        return lambda q, k, v: gd.ours(q, k, v)[0]
    impl = "xla" if name == "xla" else "cudnn"
    # jax.nn takes [B, L, H, D]: the arguments are swapped before the call.
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)


def _device_events(trace_dir):
    from jax.profiler import ProfileData

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return []
    pd = ProfileData.from_file(sorted(paths)[-1])
    events = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Stream lines hold kernels and memcpys; skip XLA's op/module summary lines.
            if "Stream" not in line.name and "stream" not in line.name:
                continue
            for ev in line.events:
                events.append((ev.start_ns, ev.end_ns, ev.name, line.name))
    return events


def profile_one(name, fn, args, K, reps=3):
    f = gd._loop_fn(fn, K)
    hlo = f.lower(*args).compile().as_text()
    # One while loop of K trips, one call each (no unrolling).
    rolled_us = gd._time_compiled(gd._loop_fn(fn, K, unroll=1), args, K) * 1e6
    wall = gd._time_compiled(f, args, K)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(f(*args))
        ev = _device_events(d)
    rec = dict(wall_us=wall * 1e6, rolled_wall_us=rolled_us, events=len(ev),
               command_buffers=hlo.count("command_buffer"))
    if ev:
        ev.sort()
        busy = sum(e - s for s, e, _, _ in ev)
        span = ev[-1][1] - ev[0][0]
        kinds = {}
        for s, e, n, _ in ev:
            k = kinds.setdefault(n[:70], [0, 0.0])
            k[0] += 1
            k[1] += (e - s) / 1e3
        rec.update(busy_us=busy / 1e3 / (reps * K), span_us=span / 1e3 / (reps * K),
                   kernels={n: dict(count_per_call=c / (reps * K), mean_us=t / c)
                            for n, (c, t) in sorted(kinds.items(), key=lambda x: -x[1][1])[:6]})
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--host", action="store_true", help="also gpu_decode.HOST_ROWS (host cost a call)")
    args = ap.parse_args()
    gd.register()
    picked = range(len(ROWS)) if not args.rows else [int(i) for i in args.rows.split(",")]
    results = dict(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), jax=jax.__version__,
                   device=str(jax.devices()[0]), rows=[])
    # Pure dispatch: the same loop around a tiny XLA op.
    x = jnp.ones((8, 32, 1, 128), jnp.bfloat16)
    tiny = profile_one("tiny", lambda q, k, v: q * 2, (x, x, x), args.K)
    print("tiny op loop:", json.dumps(tiny)[:400], flush=True)
    results["tiny"] = tiny
    todo = [(i, ROWS[i]) for i in picked]
    if args.host:
        todo += [(None, r) for r in gd.HOST_ROWS]
    for row_index, (name, dt, B, Hq, Hk, Lk, D) in todo:
        q, k, v = gd._row_inputs(dt, B, Hq, Hk, Lk, D)
        esz = jnp.dtype(gd.DTYPES[dt]).itemsize
        nbytes = esz * (2 * B * Hq * D + 2 * B * Hk * Lk * D)
        row = dict(case=name, bytes=nbytes, variants={})
        for vname, knobs in _variants(row_index, dt, D):
            for key in list(os.environ):
                if key.startswith(KNOB):
                    del os.environ[key]
            for kk, vv in (knobs or {}).items():
                os.environ[KNOB + kk] = vv
            try:
                args_ = (q, k, v) if knobs is not None else tuple(
                    jnp.swapaxes(x, 1, 2) for x in (q, k, v))
                rec = profile_one(vname, _fn(vname), args_, args.K)
                rec["GBps_wall"] = nbytes / (rec["wall_us"] * 1e-6) / 1e9
                if rec.get("busy_us"):
                    rec["GBps_busy"] = nbytes / (rec["busy_us"] * 1e-6) / 1e9
            except Exception as e:  # noqa: BLE001
                rec = dict(error=str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            row["variants"][vname] = rec
            short = {k2: (round(v2, 1) if isinstance(v2, float) else v2)
                     for k2, v2 in rec.items() if k2 != "kernels"}
            print(f"{name:<30} {vname:<14} {short}", flush=True)
            for kn, kv in rec.get("kernels", {}).items():
                print(f"      {kv['count_per_call']:.2f}x {kv['mean_us']:8.2f} us  {kn}", flush=True)
        results["rows"].append(row)
        for key in list(os.environ):
            if key.startswith(KNOB):
                del os.environ[key]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "decode_profile.json")
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
