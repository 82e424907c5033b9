"""Benchmark harness behind `jax-sdpa bench`: every available jax_sdpa implementation beside
`jax.nn.dot_product_attention` peers, on selectable suites.

Per (case, implementation, direction): median time over repeats of a jitted function
(`block_until_ready`), TFLOP/s (forward `4·B·Hq·Lq·Lk·D`, halved for causal; forward+backward
3.5x), GB/s for decode (q, k, v, out counted once; K dependent calls inside one jitted
`fori_loop`, divided by K, K chosen so a run lasts ~30 ms: the run's fixed cost must not
land on each call), and the compiled program's temporary
bytes (`compiled.memory_analysis()`). Results as a table, JSON and a PNG plot.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import platform as _platform
import statistics
import sys
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import jax_sdpa
from jax_sdpa import api, dispatch
from jax_sdpa.config import Config, StaticParams

PEERS = ("jax.nn:xla", "jax.nn:cudnn")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    b: int
    hq: int
    hk: int
    lq: int
    lk: int
    d: int
    dtype: str = "float32"
    causal: bool = False
    decode: bool = False  # few queries: report GB/s, time K dependent calls

    @property
    def flops_fwd(self) -> float:
        f = 4.0 * self.b * self.hq * self.lq * self.lk * self.d
        return f / 2 if self.causal and self.lq == self.lk else f

    @property
    def io_bytes(self) -> int:
        item = np.dtype(jnp.dtype(self.dtype)).itemsize
        return item * (2 * self.b * self.hq * self.lq * self.d + 2 * self.b * self.hk * self.lk * self.d)


def _sweep(prefix, lengths, **kw):
    return [Case(f"{prefix} L{n}", lq=n, lk=n, **kw) for n in lengths]


SUITES = {
    # for the tests: seconds
    "tiny": (_sweep("B1 H2 D32", (64, 128), b=1, hq=2, hk=2, d=32), ("fwd", "fwd+bwd")),
    # default: about a minute on a 2-core CPU
    "cpu-small": (_sweep("B1 H8 D64", (256, 512, 1024, 2048, 4096), b=1, hq=8, hk=8, d=64),
                  ("fwd", "fwd+bwd")),
    "cpu-causal": (_sweep("B1 H8 D64 causal", (256, 512, 1024, 2048, 4096), b=1, hq=8, hk=8,
                          d=64, causal=True), ("fwd", "fwd+bwd")),
    # long sequences on a CPU: forward to 16k, forward+backward to 8k (minutes)
    "cpu-long": (_sweep("B1 H4 D64", (1024, 2048, 4096, 8192), b=1, hq=4, hk=4, d=64),
                 ("fwd",)),
    # the O(L)-memory implementations only: unfused XLA needs >= 4 GiB of scores here
    "cpu-16k": (_sweep("B1 H4 D64", (16384,), b=1, hq=4, hk=4, d=64), ("fwd", "fwd+bwd")),
    "cpu-long-train": (_sweep("B1 H4 D64", (1024, 2048, 4096, 8192), b=1, hq=4, hk=4, d=64),
                       ("fwd+bwd",)),
    "cpu-long-bf16": (_sweep("B1 H4 D64 bf16", (1024, 4096, 8192), b=1, hq=4, hk=4,
                             d=64, dtype="bfloat16"), ("fwd", "fwd+bwd")),
    # GPU rows (benchmarks/gpu_peers.py times the same shapes beside every peer)
    "prefill": ([
        Case("B4 H32 L4096 D128", 4, 32, 32, 4096, 4096, 128, "bfloat16"),
        Case("B4 H32 L4096 D128 causal", 4, 32, 32, 4096, 4096, 128, "bfloat16", True),
        Case("B1 H16 L16384 D128 causal", 1, 16, 16, 16384, 16384, 128, "bfloat16", True),
        Case("B2 H32/KV8 L8192 D128 causal", 2, 32, 8, 8192, 8192, 128, "bfloat16", True),
        Case("B4 H16 L4096 D64", 4, 16, 16, 4096, 4096, 64, "bfloat16"),
        Case("B2 H16 L4096 D256 causal", 2, 16, 16, 4096, 4096, 256, "bfloat16", True),
    ], ("fwd", "fwd+bwd")),
    "sd3": ([
        Case("SD3 B2 H38 L4250 D64 fp16", 2, 38, 38, 4250, 4250, 64, "float16"),
        Case("SD3 B2 H38 L4250 D64 fp32", 2, 38, 38, 4250, 4250, 64, "float32"),
    ], ("fwd", "fwd+bwd")),
    "decode": ([
        Case("B8 H32/KV8 Lk8192 D128", 8, 32, 8, 1, 8192, 128, "bfloat16", True, True),
        Case("B1 H32/KV8 Lk32768 D128", 1, 32, 8, 1, 32768, 128, "bfloat16", True, True),
        Case("B1 H32/KV4 Lk8192 D512", 1, 32, 4, 1, 8192, 512, "bfloat16", True, True),
        Case("B1 H32/KV4 Lk1024 D512 fp16", 1, 32, 4, 1, 1024, 512, "float16", True, True),
    ], ("fwd",)),
    "decode-cpu": ([
        Case(f"B1 H8/KV2 Lk{n} D64", 1, 8, 2, 1, n, 64, "float32", True, True)
        for n in (1024, 4096, 16384)
    ], ("fwd",)),
}
DEFAULT_SUITE = "cpu-small"


def default_platform() -> str:
    return api.trace_platform()


def _config(case: Case) -> Config:
    params = StaticParams(scale=1.0 / math.sqrt(case.d), window_right=0 if case.causal else -1,
                          bottom_right=case.causal)
    return Config.from_shapes((case.b, case.hq, case.lq, case.d), (case.b, case.hk, case.lk, case.d),
                              (case.b, case.hk, case.lk, case.d), jnp.dtype(case.dtype),
                              None, None, False, False, False, params)


def available_implementations(platform: Optional[str] = None, include_emulator=False):
    """Named jax_sdpa implementations that can run on this platform at all."""
    platform = platform or default_platform()
    names = []
    for name in dispatch.IMPLEMENTATIONS:
        if name in dispatch.FUSED_PLATFORMS:
            if dispatch.FUSED_PLATFORMS[name] != platform or not dispatch.installed(name):
                continue
            if name == "metal" and sys.platform != "darwin" and not include_emulator:
                continue  # the Linux Metal emulator is for testing, not timing
        names.append(name)
    return names


def peers(platform: Optional[str] = None):
    platform = platform or default_platform()
    return ["jax.nn:xla"] + (["jax.nn:cudnn"] if platform == "cuda" else [])


def _serves(impl: str, case: Case, direction: str, platform: str):
    """(ok, reason) before running anything."""
    if impl.startswith("jax.nn:"):
        if impl == "jax.nn:cudnn":
            if case.dtype not in ("float16", "bfloat16"):
                return False, "cuDNN in jax.nn needs float16/bfloat16"
            if case.d > 256:
                return False, "cuDNN in jax.nn: head dim > 256"
        return True, ""
    cfg = _config(case)
    ok, reason = dispatch.supports(impl, cfg, "fwd", platform)
    if ok and direction != "fwd":
        ok, reason = dispatch.supports(impl, cfg, "bwd", platform)
    return ok, reason


def _inputs(case: Case, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    dt = jnp.dtype(case.dtype)
    q = jax.random.normal(ks[0], (case.b, case.hq, case.lq, case.d), dt)
    k = jax.random.normal(ks[1], (case.b, case.hk, case.lk, case.d), dt)
    v = jax.random.normal(ks[2], (case.b, case.hk, case.lk, case.d), dt)
    do = jax.random.normal(ks[3], (case.b, case.hq, case.lq, case.d), dt)
    return q, k, v, do


def attention_fn(impl: str, case: Case) -> Callable:
    """(q, k, v) [B, H, L, D] -> out, for one implementation (ours or a jax.nn peer)."""
    mask = "causal" if case.causal else None
    if impl.startswith("jax.nn:"):
        which = impl.split(":", 1)[1]

        def fn(q, k, v):
            t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
            # bottom-right causal == top-left when Lq == Lk; decode: lengths do it
            causal = case.causal and case.lq == case.lk
            out = jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=causal,
                                               implementation=which)
            return t(out)

        return fn

    def fn(q, k, v):
        return jax_sdpa.scaled_dot_product_attention(q, k, v, mask=mask, implementation=impl)

    return fn


DECODE_UNROLL = 16  # decode calls unrolled per while-loop trip


def build(impl: str, case: Case, direction: str, decode_calls: int = DECODE_UNROLL):
    """(jitted function, args, calls per run). Decode: `decode_calls` dependent calls in
    one jit, a while loop with DECODE_UNROLL calls per trip."""
    q, k, v, do = _inputs(case)
    fn = attention_fn(impl, case)
    if direction == "fwd" and case.decode:
        def loop(q, k, v):  # K dependent calls: amortize dispatch
            return jax.lax.fori_loop(0, decode_calls, lambda i, x: fn(x, k, v).astype(x.dtype),
                                     q, unroll=max(1, min(DECODE_UNROLL, decode_calls)))

        return jax.jit(loop), (q, k, v), decode_calls
    if direction == "fwd":
        return jax.jit(fn), (q, k, v), 1

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    return jax.jit(fwd_bwd), (q, k, v, do), 1


def temp_bytes(jitted, args) -> Optional[int]:
    try:
        stats = jitted.lower(*args).compile().memory_analysis()
        return None if stats is None else int(stats.temp_size_in_bytes)
    except Exception:  # some backends have no memory analysis
        return None


def time_fn(jitted, args, min_time=0.3, max_reps=10, min_reps=2) -> float:
    """Median seconds per run (after one warm-up run that compiles)."""
    jax.block_until_ready(jitted(*args))
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps
                                     or time.perf_counter() - start < min_time):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - t0)
        if len(times) >= 1 and times[0] > 5 * min_time:  # slow case: one timed run is enough
            break
    return statistics.median(times)


def run_one(impl: str, case: Case, direction: str, platform: str, min_time=0.3) -> dict:
    row = dict(case=case.name, impl=impl, direction=direction, b=case.b, hq=case.hq,
               hk=case.hk, lq=case.lq, lk=case.lk, d=case.d, dtype=case.dtype,
               causal=case.causal, decode=case.decode, time_s=None, tflops=None, gbps=None,
               temp_bytes=None, error=None)
    ok, reason = _serves(impl, case, direction, platform)
    if not ok:
        row["error"] = f"refused: {reason}"
        return row
    try:
        jitted, args, calls = build(impl, case, direction)
        if case.decode and direction == "fwd":
            # A run's fixed cost (dispatch, the wait for the result: ~0.3 ms on a GPU) must
            # be a small part of each call's share: runs of ~30 ms, up to 1024 calls.
            per_call = time_fn(jitted, args, min_time=0, max_reps=1, min_reps=1) / calls
            want = min(1024, int(0.03 / max(per_call, 1e-7)) // DECODE_UNROLL * DECODE_UNROLL)
            if want > calls:
                jitted, args, calls = build(impl, case, direction, decode_calls=want)
        t = time_fn(jitted, args, min_time=min_time) / calls
        row["temp_bytes"] = temp_bytes(jitted, args)  # after the call: a cache hit
    except Exception as e:  # a failing peer or OOM must not stop the run
        msg = str(e).strip().splitlines()
        row["error"] = f"{type(e).__name__}: {msg[0][:160] if msg else ''}"
        return row
    row["time_s"] = t
    flops = case.flops_fwd * (3.5 if direction == "fwd+bwd" else 1.0)
    row["tflops"] = flops / t / 1e12
    if case.decode:
        row["gbps"] = case.io_bytes / t / 1e9
    return row


class _Progress:
    """rich's progress bar when rich is installed, else a line per step."""

    def __init__(self, total, description, out=None, enabled=True):
        self.total, self.done, self.out = total, 0, out or sys.stderr
        self._rich = None
        if not enabled:
            self.out = None
            return
        try:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn)

            self._rich = Progress(TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  console=Console(file=self.out), transient=True)
            self._task = self._rich.add_task(description, total=total)
            self._rich.start()
        except ImportError:
            self._rich = None

    def step(self, what):
        self.done += 1
        if self._rich is not None:
            self._rich.update(self._task, advance=1, description=what)
        elif self.out is not None:
            print(f"[{self.done}/{self.total}] {what}", file=self.out, flush=True)

    def close(self):
        if self._rich is not None:
            self._rich.stop()


def versions() -> dict:
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "jax_sdpa": jax_sdpa.__version__, "python": _platform.python_version()}
    try:
        import flax

        out["flax"] = flax.__version__
    except ImportError:
        out["flax"] = None
    return out


def device_description() -> str:
    d = jax.devices()[0]
    kind = getattr(d, "device_kind", d.platform)
    return f"{len(jax.devices())}x {kind} ({d.platform})"


def run_suite(suite: str = DEFAULT_SUITE, implementations=None, directions=None,
              min_time=0.3, progress=True, out=None) -> dict:
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}; choose from {sorted(SUITES)}")
    cases, suite_dirs = SUITES[suite]
    platform = default_platform()
    impls = list(implementations or (available_implementations(platform) + peers(platform)))
    dirs = [d for d in (directions or suite_dirs) if d in suite_dirs]
    jobs = [(c, d, i) for c in cases for d in dirs for i in impls]
    bar = _Progress(len(jobs), f"bench {suite}", out=out, enabled=progress)
    rows = []
    try:
        for case, direction, impl in jobs:
            bar.step(f"{case.name} {direction} {impl}")
            rows.append(run_one(impl, case, direction, platform, min_time=min_time))
    finally:
        bar.close()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "suite": suite, "device": device_description(), "platform": platform,
            "versions": versions(), "implementations": impls, "results": rows}


def _fmt_bytes(n):
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def table_rows(report: dict):
    header = ["case", "dir", "implementation", "time", "TFLOP/s", "GB/s", "temp mem"]
    rows = []
    for r in report["results"]:
        if r["error"]:
            rows.append([r["case"], r["direction"], r["impl"], r["error"], "", "", ""])
            continue
        t = r["time_s"]
        time_s = f"{t * 1e3:.3f} ms" if t >= 1e-4 else f"{t * 1e6:.1f} us"
        rows.append([r["case"], r["direction"], r["impl"], time_s, f"{r['tflops']:.3f}",
                     f"{r['gbps']:.1f}" if r["gbps"] is not None else "-",
                     _fmt_bytes(r["temp_bytes"])])
    return header, rows


def print_table(header, rows, title=None, file=None):
    file = file or sys.stdout
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, overflow="fold")
        for r in rows:
            table.add_row(*[str(x) for x in r])
        Console(file=file, width=max(120, Console(file=file).width)).print(table)
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        if title:
            print(title, file=file)
        for r in [header] + rows:
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)), file=file)


def write_json(report: dict, path: str):
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _shape_label(r: dict) -> str:
    """"B1 H8 D64 float32" (with /KVn for GQA, "causal") of one result row."""
    heads = f"H{r['hq']}" + (f"/KV{r['hk']}" if r["hk"] != r["hq"] else "")
    return f"B{r['b']} {heads} D{r['d']} {r['dtype']}" + (" causal" if r["causal"] else "")


def plot(report: dict, path: str, metric: str = "time"):
    """PNG: time (or TFLOP/s) per case, one line per implementation, a panel per
    direction. Sequence length on the x axis when the suite sweeps it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'jax_sdpa[bench]'") from e
    results = report["results"]
    dirs = list(dict.fromkeys(r["direction"] for r in results))
    cases = list(dict.fromkeys(r["case"] for r in results))
    by_case = {r["case"]: r for r in results}
    lengths = [by_case[c]["lk"] for c in cases]
    sweep = len(set(lengths)) == len(cases) and len({
        (by_case[c]["b"], by_case[c]["hq"], by_case[c]["d"], by_case[c]["dtype"]) for c in cases}) == 1
    fig, axes = plt.subplots(1, len(dirs), figsize=(6 * len(dirs), 4.5), squeeze=False)
    for ax, direction in zip(axes[0], dirs):
        for impl in report["implementations"]:
            xs, ys = [], []
            for i, c in enumerate(cases):
                r = next((r for r in results if r["case"] == c and r["impl"] == impl
                          and r["direction"] == direction and r["time_s"]), None)
                if r is None:
                    continue
                xs.append(by_case[c]["lk"] if sweep else i)
                ys.append(r["time_s"] * 1e3 if metric == "time" else r["tflops"])
            if xs:
                style = "--" if impl.startswith("jax.nn") else "-"
                ax.plot(xs, ys, style, marker="o", label=impl)
        if sweep:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (Lq = Lk)" if by_case[cases[0]]["lq"] > 1
                          else "kv length (Lq = 1)")
            shape = _shape_label(by_case[cases[0]])
        else:
            ax.set_xticks(range(len(cases)))
            ax.set_xticklabels([f"{c} {by_case[c]['dtype']}" for c in cases], rotation=30,
                               ha="right", fontsize=7)
            shape = "shapes on the x axis"
        if metric == "time":
            ax.set_yscale("log")
            ax.set_ylabel("median time (ms)")
        else:
            ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{report['suite']} {direction}: {shape}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"jax_sdpa {report['versions']['jax_sdpa']} on {report['device']}, "
                 f"jax {report['versions']['jax']}, {report['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
