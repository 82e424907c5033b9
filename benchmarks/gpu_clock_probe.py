"""Rate and SM clock of one prefill row in bursts of K back-to-back calls: whether short bursts
run at a higher clock, and so a higher TFLOP/s, than the sustained samples that
benchmarks/gpu_peers.py times (about 120 ms and more of calls a sample).

    python3 -P benchmarks/gpu_clock_probe.py --out clock_probe.json
        [--impls jax_sdpa,flash_attn3_jax,jaxnn_cudnn] [--bursts 8,32,128,512] [--shape B,H,L,D]

Each implementation (gpu_peers.py's: ours with implementation=None, flash-attn3-jax's own
call, jax.nn's cuDNN) and mode (forward, forward+backward) runs bursts of K calls, each after
1.5 s idle, three of each K, timed from the first call's dispatch to the last result.
nvidia-smi samples clocks.sm and power.draw every 20 ms throughout; a burst's clock and power
are the means of the samples inside it. TFLOP/s counts 4*B*H*L*L*D (x3.5 with the backward).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import jax  # noqa: E402

from bench_gpu import one_call, versions  # noqa: E402
from gpu_peers import JAX_IMPLS, inputs, row, work  # noqa: E402


class ClockLog:
    """nvidia-smi's SM clock (MHz) and power (W) every period_ms, stamped on arrival."""

    def __init__(self, period_ms=20):
        self.samples = []  # (monotonic s, sm MHz, power W)
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                 f"--loop-ms={period_ms}"], stdout=subprocess.PIPE, text=True)
        except OSError:
            self.proc = None
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                sm, pw = (float(x) for x in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((time.monotonic(), sm, pw))

    def window(self, t0, t1):
        inside = [(sm, pw) for t, sm, pw in list(self.samples) if t0 <= t <= t1]
        if not inside:
            return dict(samples=0)
        sm, pw = zip(*inside)
        return dict(samples=len(inside), sm_mhz=float(np.mean(sm)), sm_mhz_min=float(min(sm)),
                    power_w=float(np.mean(pw)))

    def close(self):
        if self.proc:
            self.proc.terminate()


def probe(r, impl, backward, bursts, log, idle_s=1.5, reps=3):
    fn, args = JAX_IMPLS[impl](r, inputs(r))
    compiled = jax.jit(one_call(fn, backward)).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    out = []
    for k in bursts:
        for _ in range(reps):
            time.sleep(idle_s)
            t0 = time.monotonic()
            res = None
            for _ in range(k):
                res = compiled(*args)
            jax.block_until_ready(res)
            t1 = time.monotonic()
            sec = (t1 - t0) / k
            out.append(dict(calls=k, ms=sec * 1e3, tflops=work(r, backward) / sec / 1e12,
                            **log.window(t0, t1)))
            print(json.dumps({"impl": impl, "mode": "fwd+bwd" if backward else "fwd", **out[-1]}),
                  flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="clock_probe.json")
    ap.add_argument("--impls", default="jax_sdpa,flash_attn3_jax,jaxnn_cudnn")
    ap.add_argument("--bursts", default="8,32,128,512")
    ap.add_argument("--shape", default="4,32,4096,128", help="B,H,L,D (bf16, not causal)")
    args = ap.parse_args()
    b, h, length, d = (int(x) for x in args.shape.split(","))
    r = row(f"B{b} H{h} L{length} D{d}", "prefill", b, h, h, length, length, d)
    bursts = [int(x) for x in args.bursts.split(",")]
    log = ClockLog()
    res = dict(info=versions(), row=r["name"], results={})
    try:
        for impl in args.impls.split(","):
            for backward in (False, True):
                key = f"{impl}/{'fwd+bwd' if backward else 'fwd'}"
                try:
                    res["results"][key] = probe(r, impl, backward, bursts, log)
                except Exception as e:  # noqa: BLE001
                    res["results"][key] = dict(refused=f"{type(e).__name__}: {str(e)[:300]}")
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1, default=str)
    finally:
        log.close()
    for key, runs in res["results"].items():
        if isinstance(runs, dict):
            print(key, runs["refused"])
            continue
        for k in bursts:
            sel = [x for x in runs if x["calls"] == k]
            print(f"{key:<28} K={k:<4} TFLOP/s {np.median([x['tflops'] for x in sel]):7.1f}  "
                  f"SM {np.median([x.get('sm_mhz', np.nan) for x in sel]):6.0f} MHz  "
                  f"power {np.median([x.get('power_w', np.nan) for x in sel]):5.0f} W", flush=True)


if __name__ == "__main__":
    main()
