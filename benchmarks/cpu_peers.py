"""jax_sdpa on the CPU beside the CPU attention operators of its peers, in one run:
jax.nn.dot_product_attention (xla), torch's F.scaled_dot_product_attention (its CPU flash
kernel) and MLX's mx.fast.scaled_dot_product_attention on the CPU, with this machine's read
bandwidth measured in the same run (decode rows report GB/s of K and V read).

The peers are not dependencies: run it from a benchmark venv that has them, e.g.
  python3.11 -m venv --system-site-packages /tmp/bench && /tmp/bench/bin/pip install torch
(mlx[cpu] comes with the test extras) with jax_sdpa importable. Each row times its peers in
interleaved bursts: three rounds, in each a burst of calls of every peer in turn, each after a
50 ms pause and with its first call untimed (another library's worker threads may still spin
on every core right after its own calls, and a pool waking up is the burst's first call alone). Median over the
timed calls; the load average is recorded per row.
  python benchmarks/cpu_peers.py [--quick] [--json out.json] [--plot out.png]
  python benchmarks/cpu_peers.py --plot out.png --from out.json   # plot a saved run
  python benchmarks/cpu_peers.py --busy 2 ...   # with a competing load: stress-ng on 2 cores

--busy N runs every row twice, quiet and with `stress-ng --cpu N` running (Debian's stress-ng),
and reports each peer's slowdown (busy / quiet median).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from jax_sdpa import _ext

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - optional peer
    torch = None
try:
    import mlx.core as mx
except ImportError:  # pragma: no cover - optional peer
    mx = None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def read_bandwidth_gbs(mib=512, reps=5):
    """This machine's read bandwidth now: numpy's max over a buffer far above the caches, on
    every core (one thread a core through numpy's own threading is not given, so each core
    reads its part in a thread)."""
    import threading

    a = np.ones(mib * 1024 * 1024 // 4, np.float32)
    parts = np.array_split(a, os.cpu_count() or 1)
    best = float("inf")
    for _ in range(reps):
        th = [threading.Thread(target=p.max) for p in parts]
        t0 = time.perf_counter()
        for t in th:
            t.start()
        for t in th:
            t.join()
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9


def _jax_fn(impl, causal, grad):
    def attn(q, k, v):
        if impl == "jax.nn:xla":
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        return jax_sdpa.dot_product_attention(q, k, v, is_causal=causal)

    if not grad:
        return jax.jit(attn)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2)))


def _row_fns(row, rng):
    """{peer: zero-argument callable that runs one call and waits for it}."""
    b, hq, hk, lq, lk, d, dtype, causal, grad = (row[x] for x in (
        "b", "hq", "hk", "lq", "lk", "d", "dtype", "causal", "grad"))
    # jax.nn's layout: [B, L, H, D]
    qn = rng.standard_normal((b, lq, hq, d)).astype(np.float32)
    kn = rng.standard_normal((b, lk, hk, d)).astype(np.float32)
    vn = rng.standard_normal((b, lk, hk, d)).astype(np.float32)
    jdt = jnp.dtype(dtype)
    jq, jk, jv = (jnp.asarray(x, jdt) for x in (qn, kn, vn))
    fns = {}
    for peer in ("jax_sdpa", "jax.nn:xla"):
        if peer == "jax.nn:xla" and row.get("skip_xla"):
            continue
        f = _jax_fn(peer, causal, grad)
        fns[peer] = (lambda f=f: jax.block_until_ready(f(jq, jk, jv)))
    if torch is not None:
        tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        tq, tk, tv = (torch.from_numpy(x.transpose(0, 2, 1, 3).copy()).to(tdt)
                      for x in (qn, kn, vn))
        if grad:
            tq, tk, tv = (x.requires_grad_() for x in (tq, tk, tv))

            def t_run():
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                     enable_gqa=hq != hk)
                out.sum().backward()
        else:
            def t_run():
                with torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                   enable_gqa=hq != hk)
        fns["torch"] = t_run
    if mx is not None and lq * lk <= 2048 * 2048:  # MLX's CPU path: tens of seconds past that
        mdt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
        mq, mk, mv = (mx.array(x.transpose(0, 2, 1, 3)).astype(mdt) for x in (qn, kn, vn))
        scale = 1.0 / np.sqrt(d)
        kw = dict(scale=scale, mask="causal") if causal else dict(scale=scale)

        def m_attn(q, k, v):
            return mx.fast.scaled_dot_product_attention(q, k, v, **kw)

        if grad:
            g = mx.grad(lambda q, k, v: m_attn(q, k, v).sum(), argnums=(0, 1, 2))
            fns["mlx"] = lambda: mx.eval(g(mq, mk, mv))
        else:
            fns["mlx"] = lambda: mx.eval(m_attn(mq, mk, mv))
        mx.set_default_device(mx.cpu)
    return fns


def _timed_bursts(fns, min_time):
    """{peer: call times}: one round a peer, each a burst of every peer's calls in turn (about
    min_time / rounds seconds, at least one call) after a 50 ms pause; a burst's first call is
    untimed. Each round starts with another peer, so that none always runs first (right after
    the competing load starts, or right after a peer that leaves its workers spinning)."""
    times = {p: [] for p in fns}
    peers = list(fns)
    rounds = len(peers)
    for r in range(rounds):
        for p in peers[r:] + peers[:r]:
            f = fns[p]
            time.sleep(0.05)  # the previous library's spinning workers park
            f()
            start = time.perf_counter()
            n = 0
            while n < 1 or (time.perf_counter() - start < min_time / rounds and n < 100):
                t0 = time.perf_counter()
                f()
                times[p].append(time.perf_counter() - t0)
                n += 1
    return times


class _competing_load:
    """`stress-ng --cpu n` for the duration of a with-block (a CPU-bound process a core)."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        import subprocess
        self.proc = subprocess.Popen(["stress-ng", "--cpu", str(self.n), "--quiet"])
        time.sleep(1.0)  # its workers running
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        time.sleep(0.5)


def _rows(quick):
    """Prefill L 1k-16k, causal and not, D 64 and 128, GQA, float32 and bfloat16, forward and
    forward+backward; an SD3-like shape; decode Lk 1k-32k, B 1-8, GQA 4 and 8."""
    rows = []

    def add(name, **kw):
        base = dict(b=1, hq=8, hk=8, lq=1, lk=1, d=64, dtype="float32", causal=False, grad=False)
        base.update(kw)
        base["name"] = name
        rows.append(base)

    def both(name, **kw):  # forward and forward+backward
        for grad in (False, True):
            add(f"{name} {'fwd+bwd' if grad else 'fwd'}", grad=grad, **kw)

    if quick:
        both("prefill B1 H8 D64 L1024", lq=1024, lk=1024)
        for lk in (1024, 4096):
            add(f"decode B1 H32/KV8 D128 Lk{lk}", hq=32, hk=8, d=128, lk=lk)
        return rows
    for length, causal in ((1024, False), (4096, False), (4096, True)):
        both(f"prefill B1 H8 D64 L{length}{' causal' if causal else ''}", lq=length,
             lk=length, causal=causal)
    # jax.nn's xla materializes 8 GiB of scores a head group at L16384: ours and torch only
    add("prefill B1 H8 D64 L16384 causal fwd", lq=16384, lk=16384, causal=True, skip_xla=True)
    both("prefill B1 H8/KV2 D128 L2048 GQA causal", hk=2, d=128, lq=2048, lk=2048, causal=True)
    add("prefill B1 H8/KV2 D128 L8192 GQA fwd", hk=2, d=128, lq=8192, lk=8192,
        skip_xla=True)
    both("prefill B1 H8 D64 L2048 bf16", lq=2048, lk=2048, dtype="bfloat16")
    both("prefill B1 H8/KV2 D128 L4096 GQA causal bf16", hk=2, d=128, lq=4096, lk=4096,
         causal=True, dtype="bfloat16")
    add("SD3-like B1 H24 D64 L4096 fwd", hq=24, hk=24, lq=4096, lk=4096)
    for lk, b in ((1024, 1), (4096, 1), (16384, 1), (32768, 1), (4096, 8)):
        add(f"decode B{b} H32/KV8 D128 Lk{lk}", b=b, hq=32, hk=8, d=128, lk=lk)
    add("decode B4 H32/KV4 D128 Lk8192 GQA8", b=4, hq=32, hk=4, d=128, lk=8192)
    add("decode B1 H32/KV8 D128 Lk16384 bf16", hq=32, hk=8, d=128, lk=16384,
        dtype="bfloat16")
    add("decode B8 H32/KV8 D128 Lk4096 bf16", b=8, hq=32, hk=8, d=128, lk=4096,
        dtype="bfloat16")
    add("decode B1 H8/KV2 D64 Lk1024", hq=8, hk=2, d=64, lk=1024)
    return rows


def plot(report, path):
    """Per row: the best peer's median time / jax_sdpa's (above 1: jax_sdpa is faster)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels, speedups, names = [], [], []
    for r in report["rows"]:
        med = r["median_s"]
        best = min((t, p) for p, t in med.items() if p != "jax_sdpa")
        labels.append(r["name"])
        speedups.append(best[0] / med["jax_sdpa"])
        names.append(best[1])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(labels) + 1.6))
    ax.barh(range(len(labels)), speedups,
            color=["tab:green" if x >= 1 else "tab:red" for x in speedups])
    for i, (x, n) in enumerate(zip(speedups, names)):
        ax.text(x, i, f" {x:.2f}x {n}", va="center", fontsize=7)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(speedups) * 1.25)
    meta = report["meta"]
    ax.set_xlabel("best peer's time / jax_sdpa's (implementation=None), same run")
    ax.set_title(f"{meta['cpus']}-core {meta['machine']} ({meta['isa']}), jax {meta['jax']}, "
                 f"torch {meta['torch']}, MLX {meta['mlx']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per row and peer")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="write a PNG: the best peer's time / ours per row")
    ap.add_argument("--from", dest="from_json", help="plot this saved run instead of measuring")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="also time every row with stress-ng --cpu N running")
    ap.add_argument("--rows", default="", help="substrings of row names (comma-separated)")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            plot(json.load(f), a.plot)
        return
    rng = np.random.default_rng(0)
    cpu = _ext.module("_sdpa_cpu")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=platform.machine(), cpu_model=_cpu_model(), cpus=os.cpu_count(),
                isa=cpu.isa() if cpu else None, amx=cpu.amx() if cpu else None,
                threads=cpu.num_threads() if cpu else None,
                jax=jax.__version__, torch=getattr(torch, "__version__", None),
                torch_threads=torch.get_num_threads() if torch else None,
                mlx=getattr(mx, "__version__", None), load_start=os.getloadavg())
    meta["read_bandwidth_gbs_start"] = read_bandwidth_gbs()
    print(f"read bandwidth {meta['read_bandwidth_gbs_start']:.1f} GB/s, load "
          f"{meta['load_start'][0]:.1f}", flush=True)
    results = []
    wanted = [w for w in a.rows.split(",") if w]
    for row in _rows(a.quick):
        if wanted and not any(w in row["name"] for w in wanted):
            continue
        fns = _row_fns(row, rng)
        for f in fns.values():
            f()  # compile / warm
        load0 = os.getloadavg()[0]
        times = _timed_bursts(fns, a.min_time)
        med = {p: statistics.median(t) for p, t in times.items()}
        item = 2 if row["dtype"] == "bfloat16" else 4
        kv_bytes = 2 * row["b"] * row["hk"] * row["lk"] * row["d"] * item
        out = dict(row, median_s=med, calls={p: len(t) for p, t in times.items()}, load=load0)
        if a.busy:
            with _competing_load(a.busy):
                busy = {p: statistics.median(t) for p, t in _timed_bursts(fns, a.min_time).items()}
            out["busy_median_s"] = busy
            out["busy_slowdown"] = {p: busy[p] / med[p] for p in med}
        if row["lq"] == 1:
            out["kv_read_gbs"] = {p: kv_bytes / t / 1e9 for p, t in med.items()}
        results.append(out)
        best_peer = min((t, p) for p, t in med.items() if p != "jax_sdpa")
        print(f"{row['name']:48s} " + "  ".join(f"{p} {t * 1e3:8.3f} ms" for p, t in med.items())
              + f"  | jax_sdpa / best peer ({best_peer[1]}) {med['jax_sdpa'] / best_peer[0]:.2f}"
              f"  (load {load0:.1f})", flush=True)
        if a.busy:
            print(f"{'  busy: slowdown':48s} " + "  ".join(
                f"{p} {x:5.2f}x" for p, x in out["busy_slowdown"].items()), flush=True)
    meta["read_bandwidth_gbs_end"] = read_bandwidth_gbs()
    meta["load_end"] = os.getloadavg()
    report = dict(meta=meta, rows=results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        plot(report, a.plot)


if __name__ == "__main__":
    main()
