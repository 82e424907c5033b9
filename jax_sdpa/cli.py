"""The `jax-sdpa` command line.

    jax-sdpa info                 versions, devices, built backends, who serves what and why
    jax-sdpa demo [--steps N]     the example GPT: prefill, N decode steps, a training step,
                                  each beside Flax's default attention
    jax-sdpa check [--quick]      every available implementation against the float64 oracle
    jax-sdpa bench [--suite S] [--json PATH] [--plot PATH]

Works with or without native backends built (the pure-JAX implementations always run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def _print(*a, file=None):
    print(*a, file=file or sys.stdout, flush=True)


# ---------------------------------------------------------------------------
# info

def _sample_explains():
    """explain() for a few typical calls on the default platform."""
    import jax_sdpa

    f32 = jnp.float32
    sds = jax.ShapeDtypeStruct
    samples = [
        ("prefill B1 H8 L1024 D64 fp32 causal",
         dict(q=sds((1, 8, 1024, 64), f32), k=sds((1, 8, 1024, 64), f32),
              v=sds((1, 8, 1024, 64), f32), mask="causal")),
        ("decode B4 H8/KV2 Lk4096 D128 bf16 with lengths",
         dict(q=sds((4, 8, 1, 128), jnp.bfloat16), k=sds((4, 2, 4096, 128), jnp.bfloat16),
              v=sds((4, 2, 4096, 128), jnp.bfloat16), mask="causal",
              key_value_seq_lengths=sds((4,), jnp.int32))),
    ]
    out = []
    for title, kw in samples:
        q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
        for direction in (("fwd",) if "decode" in title else ("fwd", "bwd")):
            out.append((f"{title} [{direction}]",
                        jax_sdpa.explain(q, k, v, direction=direction, **kw)))
    return out


def _cudnn_line() -> Optional[str]:
    """The libcudnn this process loaded, beside the headers the CUDA module was built with."""
    from jax_sdpa import _ext, dispatch

    module = _ext.module("_sdpa_cuda")
    if module is None:
        return None
    version = int(module.cudnn_version())
    path = _loaded_library("libcudnn.so") or "?"
    loaded = dispatch._cudnn_version_str(version) if version > 0 else "unknown"
    return (f"cuDNN: {loaded} loaded from {path} (built against headers "
            f"{dispatch._cudnn_version_str(dispatch.cudnn_header_version())})")


def _loaded_library(stem: str) -> Optional[str]:
    """Path of the shared library named `stem`* mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith(stem):
                    return path
    except OSError:
        pass
    return None


def cmd_info(args) -> int:
    import jax_sdpa
    from jax_sdpa import _ext, bench, build_info

    v = bench.versions()
    _print(f"jax_sdpa {v['jax_sdpa']}   jax {v['jax']}   jaxlib {v['jaxlib']}   "
           f"flax {v['flax'] or 'not installed'}   python {v['python']}")
    _print(f"default backend: {jax.default_backend()}   devices: "
           + ", ".join(f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices()))
    _print("built backends:")
    for name, state in _ext.status().items():
        _print(f"  {name:12s} {state}")
    for line in build_info.lines():
        _print(f"  {line}")
    cudnn = _cudnn_line()
    if cudnn:
        _print(f"  {cudnn}")
    from jax_sdpa import flash_attn3
    _print(f"  {'flash_attn3':12s} {flash_attn3.load_error() or 'flash-attn3-jax imported'}")
    _print(f"implementations: {', '.join(jax_sdpa.IMPLEMENTATIONS)}")
    for title, ex in _sample_explains():
        _print(f"\n{title}")
        _print(str(ex))
    return 0


# ---------------------------------------------------------------------------
# check

def _check_cases(quick: bool):
    # (name, B, Hq, Hk, Lq, Lk, D, Dv, dtype, options)
    cases = [
        ("basic", 2, 4, 4, 33, 33, 32, 32, "float32", {}),
        ("causal Lq<Lk gqa", 1, 4, 2, 17, 40, 64, 64, "float32", {"mask": "causal"}),
        ("lengths", 2, 4, 2, 29, 29, 32, 32, "float32", {"lengths": True}),
        ("bool mask", 2, 2, 2, 16, 24, 32, 32, "float32", {"mask": "bool"}),
        ("additive mask + sinks", 2, 4, 4, 20, 20, 32, 32, "float32",
         {"mask": "additive", "sinks": True}),
        ("decode lengths", 2, 8, 2, 1, 100, 64, 64, "float32",
         {"mask": "causal", "lengths": True}),
        ("Dv != D", 1, 2, 2, 12, 18, 32, 48, "float32", {}),
        ("bf16 causal", 1, 4, 4, 64, 64, 64, 64, "bfloat16", {"mask": "causal"}),
    ]
    if quick:
        cases = [cases[1], cases[2], cases[4]]
    return cases


def _make_check_inputs(case, seed):
    name, b, hq, hk, lq, lk, d, dv, dtype, opt = case
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, lq, d))
    k = rng.standard_normal((b, hk, lk, d))
    v = rng.standard_normal((b, hk, lk, dv))
    do = rng.standard_normal((b, hq, lq, dv))
    kw = {}
    if opt.get("mask") == "causal":
        kw["mask"] = "causal"
    elif opt.get("mask") == "bool":
        kw["mask"] = rng.random((b, 1, lq, lk)) < 0.7
    elif opt.get("mask") == "additive":
        kw["mask"] = rng.standard_normal((1, hq, lq, lk)).astype(np.float32)
    if opt.get("sinks"):
        kw["sinks"] = rng.standard_normal((hq,)).astype(np.float32)
    if opt.get("lengths"):
        kw["key_value_seq_lengths"] = np.maximum(1, rng.integers(lk // 2, lk + 1, b)).astype(
            np.int32)
        if lq > 1:
            kw["query_seq_lengths"] = rng.integers(lq // 2, lq + 1, b).astype(np.int32)
    return q, k, v, do, kw


def _oracle_f64(q, k, v, do, kw):
    """out and (dq, dk, dv) from the float64 oracle (jax_sdpa.oracle)."""
    from jax_sdpa import oracle

    args = dict(mask=kw.get("mask"), sinks=kw.get("sinks"),
                q_lengths=kw.get("query_seq_lengths"), kv_lengths=kw.get("key_value_seq_lengths"))
    out, _ = oracle.forward(q, k, v, **args)
    grads = oracle.backward(q, k, v, do, **args)
    return out, [grads["dq"], grads["dk"], grads["dv"]]


def _tolerance(impl, dtype, xla_err):
    """jax_sdpa.oracle's policy, its gradient bound for both directions (a case's forward
    and backward are judged alike); fp32 on NVIDIA GPUs may run on TF32 tensor cores."""
    from jax_sdpa import oracle
    from jax_sdpa.config import FP32_PRECISION_HIGHEST, current_fp32_precision

    tf32 = (jax.default_backend() == "gpu"
            and current_fp32_precision() != FP32_PRECISION_HIGHEST)
    return oracle.tolerance(dtype, impl, grad=True, xla_error=xla_err, tf32=tf32)


def run_checks(implementations=None, quick=False, seed=None, out=None) -> int:
    """Prints one line per implementation x case x direction; returns the failure count
    (1 when every check was skipped: nothing was shown to work)."""
    import jax_sdpa
    from jax_sdpa import bench, dispatch, oracle

    out = out or sys.stdout
    platform = bench.default_platform()
    _check_names(implementations or ())
    impls = implementations or bench.available_implementations(platform,
                                                               include_emulator=True)
    seed = int(np.random.default_rng().integers(2**31)) if seed is None else seed
    _print(f"check on platform {platform}: implementations {', '.join(impls)} "
           f"(seed {seed}; oracle: jax_sdpa.oracle in float64)", file=out)
    failures = ran = 0
    for ci, case in enumerate(_check_cases(quick)):
        name, b, hq, hk, lq, lk, d, dv, dtype, _ = case
        q, k, v, do, kw = _make_check_inputs(case, seed + ci)
        ref_out, ref_grads = _oracle_f64(q, k, v, do, kw)
        dt = jnp.dtype(dtype)
        args = [jnp.asarray(x, dt) for x in (q, k, v, do)]
        call_kw = {key: (val if isinstance(val, str) else jnp.asarray(val))
                   for key, val in kw.items()}
        xla_err = {}
        for impl in (["xla"] if "xla" not in impls else []) + list(impls):
            report = impl in impls
            ex = jax_sdpa.explain(*args[:3], **call_kw, platform=platform)
            for direction in ("fwd", "bwd"):
                ok, reason = dispatch.supports(impl, ex.config, direction, platform)
                label = f"{impl:12s} {name:24s} {direction}"
                if not ok:
                    if report:
                        _print(f"SKIP {label}  ({reason})", file=out)
                    continue
                try:
                    def f(q, k, v):
                        return jax_sdpa.scaled_dot_product_attention(
                            q, k, v, implementation=impl, **call_kw)

                    if direction == "fwd":
                        got = [jax.jit(f)(*args[:3])]
                        want = [ref_out]
                    else:
                        got = jax.jit(lambda q, k, v, g: jax.vjp(f, q, k, v)[1](g))(*args)
                        want = ref_grads
                    err = max(oracle.max_rel_error(g, w) for g, w in zip(got, want))
                    finite = all(bool(np.all(np.isfinite(np.asarray(g, np.float32))))
                                 for g in got)
                except Exception as e:  # report, don't stop
                    if report:
                        failures += 1
                        ran += 1
                        msg = (str(e).strip().splitlines() or [""])[0][:200]
                        _print(f"FAIL {label}  {type(e).__name__}: {msg}", file=out)
                    continue
                if impl == "xla":
                    xla_err[direction] = err
                if not report:
                    continue
                ran += 1
                tol = _tolerance(impl, dtype, xla_err.get(direction))
                good = finite and err <= tol
                failures += not good
                _print(f"{'ok  ' if good else 'FAIL'} {label}  max rel err {err:.2e} "
                       f"(tol {tol:.0e}){'' if finite else ', non-finite values'}", file=out)
    if failures:
        _print(f"{failures} FAILED", file=out)
    elif not ran:
        _print("no check ran: every case was skipped", file=out)
        return 1
    else:
        _print("all passed", file=out)
    return failures


def cmd_check(args) -> int:
    from jax_sdpa import bench

    impls = args.implementation or None
    try:
        missing = _unavailable(impls or (), bench.default_platform())
    except ValueError as e:
        _print(f"jax-sdpa check: {e}", file=sys.stderr)
        return 2
    if missing:
        for name, why in missing.items():
            _print(f"jax-sdpa check: {name} can't run here: {why}", file=sys.stderr)
        return 2
    failures = run_checks(impls, quick=args.quick, seed=args.seed)
    return 1 if failures else 0


def _unavailable(names, platform) -> dict:
    """{name: why} for the named implementations that can't run on this platform at all
    (not built, or another platform's); ValueError for a name that is no implementation."""
    import jax_sdpa
    from jax_sdpa import bench, dispatch

    _check_names(names)
    here = bench.available_implementations(platform, include_emulator=True)
    missing = [n for n in names if n not in here]
    if not missing:
        return {}
    # the verdict on a small float32 call says why (not built, or another platform's)
    s = jax.ShapeDtypeStruct((1, 2, 8, 32), jnp.float32)
    cfg = jax_sdpa.explain(s, s, s, platform=platform).config
    return {n: dispatch.supports(n, cfg, "fwd", platform)[1] for n in missing}


def _check_names(names):
    from jax_sdpa import dispatch

    for name in names:
        if name not in dispatch.IMPLEMENTATIONS:
            raise ValueError(f"unknown implementation {name!r}; the implementations are: "
                             + ", ".join(dispatch.IMPLEMENTATIONS))


# ---------------------------------------------------------------------------
# bench

def cmd_bench(args) -> int:
    from jax_sdpa import bench

    if args.list:
        for name, (cases, dirs) in bench.SUITES.items():
            _print(f"{name:12s} {len(cases)} cases, {'/'.join(dirs)}: "
                   + "; ".join(c.name for c in cases))
        return 0
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before minutes of timing)
        except ImportError:
            _print("jax-sdpa bench: --plot needs matplotlib: pip install 'jax_sdpa[bench]'",
                   file=sys.stderr)
            return 2
    impls = args.implementation or None
    report = bench.run_suite(args.suite, implementations=impls,
                             directions=args.direction or None, min_time=args.min_time,
                             progress=not args.no_progress)
    header, rows = bench.table_rows(report)
    bench.print_table(header, rows, title=f"jax-sdpa bench {report['suite']} on "
                                          f"{report['device']} ({report['date']})")
    if args.json:
        bench.write_json(report, args.json)
        _print(f"wrote {args.json}")
    if args.plot:
        try:
            bench.plot(report, args.plot, metric=args.metric)
        except RuntimeError as e:
            _print(f"error: {e}", file=sys.stderr)
            return 2
        _print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------
# demo

def _demo_config(platform, small):
    from jax_sdpa.examples import gpt

    if small:
        cfg = gpt.GPTConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=1, max_len=128)
        batch, prompt = 2, 48
    elif platform == "cuda":
        cfg = gpt.GPTConfig(d_model=1024, n_heads=16, n_kv_heads=4, n_layers=4,
                            max_len=8192, dtype=jnp.bfloat16)
        batch, prompt = 4, 4096
    else:
        cfg = gpt.GPTConfig(d_model=256, n_heads=8, n_kv_heads=2, n_layers=2, max_len=1024)
        batch, prompt = 2, 512
    return cfg, batch, prompt


def _temp_bytes(jitted, *args):
    try:
        stats = jitted.lower(*args).compile().memory_analysis()
        return None if stats is None else int(stats.temp_size_in_bytes)
    except Exception:
        return None


def _timed(fn, *args, reps=3):
    out = jax.block_until_ready(fn(*args))  # compile + warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, float(np.median(times))


def _max_abs_diff(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(la, lb))


def _demo_rows(platform, cfg, batch, length):
    """(label, attention, implementation) rows: jax_sdpa's choice, every other fused
    implementation that can run here, and Flax's default attention (jax.nn xla)."""
    from jax_sdpa import bench

    rows = [("jax_sdpa (auto)", "jax_sdpa", None)]
    for name in bench.available_implementations(platform):
        # named fused rows beside auto, unless auto already is that one everywhere
        if name not in ("xla", "xla_chunked") and any(
                _explain_phase(cfg, batch, length, phase, None, platform) != name
                for phase in ("prefill", "decode", "train")):
            rows.append((f"jax_sdpa {name}", "jax_sdpa", name))
    rows.append(("jax_sdpa xla_chunked", "jax_sdpa", "xla_chunked"))
    rows.append(("flax default (jax.nn)", "flax", None))
    return rows


def _explain_phase(cfg, batch, length, phase, implementation, platform):
    import jax_sdpa

    if implementation is not None:
        return implementation
    sds = jax.ShapeDtypeStruct
    dt = cfg.dtype
    hd = cfg.head_dim
    if phase == "decode":
        q = sds((batch, cfg.n_heads, 1, hd), dt)
        kv = sds((batch, cfg.n_kv_heads, cfg.max_len, hd), dt)
        ex = jax_sdpa.explain(q, kv, kv, mask="causal",
                              key_value_seq_lengths=sds((batch,), jnp.int32),
                              platform=platform)
        return ex.chosen
    q = sds((batch, cfg.n_heads, length, hd), dt)
    kv = sds((batch, cfg.n_kv_heads, length, hd), dt)
    fwd = jax_sdpa.explain(q, kv, kv, mask="causal", platform=platform).chosen
    if phase == "train":
        bwd = jax_sdpa.explain(q, kv, kv, mask="causal", platform=platform,
                               direction="bwd").chosen
        return fwd if fwd == bwd else f"{fwd} / bwd {bwd}"
    return fwd


_REFUSED = "refused: "  # a demo cell's text for an implementation that can't serve its call


def _demo_error(e):
    msg = (str(e).strip().splitlines() or [""])[0]
    if isinstance(e, NotImplementedError):
        return _REFUSED + msg.split("can't serve this call: ")[-1][:100]
    if "can't serve this attention call" in msg:  # a cuDNN graph refused when it was built
        return _REFUSED + msg.split("jax_sdpa: ")[-1][:100]
    return f"{type(e).__name__}: {msg[:100]}"


def run_demo(steps=16, small=False, out=None):
    """The README's main job; returns the table rows and the rows that raised (a refusal,
    an implementation saying why it can't serve the call, is not one of them)."""
    from flax import nnx

    from jax_sdpa import bench
    from jax_sdpa.examples import gpt

    out = out or sys.stdout
    platform = bench.default_platform()
    cfg, batch, prompt_len = _demo_config(platform, small)
    steps = max(1, min(steps, cfg.max_len - prompt_len))
    _print(f"jax-sdpa demo on {bench.device_description()}: GPT d_model {cfg.d_model}, "
           f"{cfg.n_layers} layers, {cfg.n_heads} heads / {cfg.n_kv_heads} kv heads, "
           f"{jnp.dtype(cfg.dtype).name}; batch {batch}, prompt {prompt_len}, "
           f"{steps} decode steps, KV cache {cfg.max_len}", file=out)
    base = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, (batch, prompt_len)), jnp.int32)
    lengths = jnp.asarray([prompt_len] + [max(1, prompt_len - 7 * i)
                                          for i in range(1, batch)], jnp.int32)
    train_tokens = jnp.asarray(rng.integers(0, cfg.vocab, (batch, prompt_len + 1)), jnp.int32)
    decode_tokens = jnp.asarray(rng.integers(0, cfg.vocab, (steps, batch, 1)), jnp.int32)
    valid = np.arange(prompt_len)[None] < np.asarray(lengths)[:, None]

    rows_spec = _demo_rows(platform, cfg, batch, prompt_len)
    bar = bench._Progress(3 * len(rows_spec) + 1, "demo", enabled=True)
    results = {}
    table, failed = [], []
    try:
        # a cache to decode from for rows whose own prefill can't run (e.g. decode-only
        # kernels); the Flax model's jitted prefill is reused by its own row below
        bar.step("reference prefill")
        ref_model = gpt.with_attention(base, "flax")
        _, base_cache = gpt._prefill(*nnx.split(ref_model), tokens, lengths, cfg.max_len)
        for label, attention, impl in rows_spec:
            model = gpt.with_attention(base, attention, impl)
            graphdef, state = nnx.split(model)
            res = {}
            cache = base_cache
            # one implementation (or phase) failing must not hide the others
            bar.step(f"{label}: prefill")
            try:
                (logits, cache), t = _timed(gpt._prefill, graphdef, state, tokens, lengths,
                                            cfg.max_len)
                mem = _temp_bytes(gpt._prefill, graphdef, state, tokens, lengths, cfg.max_len)
                res["prefill"] = (np.asarray(logits, np.float32)[valid], t, mem)
            except Exception as e:
                res["prefill"] = _demo_error(e)
            # N decode steps, teacher-forced with the same tokens for every row
            bar.step(f"{label}: {steps} decode steps")
            try:
                jax.block_until_ready(gpt._decode(graphdef, state, decode_tokens[0], cache))
                step_logits = []
                t0 = time.perf_counter()
                c = cache
                for i in range(steps):
                    lg, c = gpt._decode(graphdef, state, decode_tokens[i], c)
                    step_logits.append(lg)
                jax.block_until_ready(c)
                t = (time.perf_counter() - t0) / steps
                mem = _temp_bytes(gpt._decode, graphdef, state, decode_tokens[0], cache)
                res["decode"] = (np.stack([np.asarray(x, np.float32) for x in step_logits]),
                                 t, mem)
            except Exception as e:
                res["decode"] = _demo_error(e)
            # one training step: loss and gradients
            bar.step(f"{label}: train step")
            try:
                g, p, r = nnx.split(model, nnx.Param, ...)
                (loss, grads), t = _timed(gpt._loss_and_grads, g, p, r, train_tokens, None)
                mem = _temp_bytes(gpt._loss_and_grads, g, p, r, train_tokens, None)
                res["train"] = ((loss, grads), t, mem)
            except Exception as e:
                res["train"] = _demo_error(e)
            results[label] = (attention, impl, res)
    finally:
        bar.close()

    ref = results["flax default (jax.nn)"][2]
    for label, (attention, impl, res) in results.items():
        for phase in ("prefill", "decode", "train"):
            if isinstance(res[phase], str):
                table.append([phase, label, impl or "-", res[phase], "-", "-"])
                if not res[phase].startswith(_REFUSED):
                    failed.append(table[-1])
                continue
            value, t, mem = res[phase]
            used = ("jax.nn xla (flax)" if attention == "flax" else
                    _explain_phase(cfg, batch, prompt_len, phase, impl, platform))
            delta = "-"
            if attention == "flax":
                delta = "(reference)"
            elif not isinstance(ref[phase], str):
                delta = f"{_max_abs_diff(value, ref[phase][0]):.2e}"
            per = " / step" if phase == "decode" else ""
            table.append([phase, label, used, f"{t * 1e3:.2f} ms{per}",
                          bench._fmt_bytes(mem), delta])
    table.sort(key=lambda r: ("prefill", "decode", "train").index(r[0]))
    bench.print_table(["phase", "attention", "implementation", "time", "temp memory",
                       "max |Δ| vs flax"], table, title="jax-sdpa demo", file=out)
    return table, failed


def cmd_demo(args) -> int:
    try:
        import flax  # noqa: F401
    except ImportError:
        _print("jax-sdpa demo needs flax: pip install 'jax_sdpa[flax]'", file=sys.stderr)
        return 2
    _, failed = run_demo(steps=args.steps, small=args.small)
    for r in failed:
        _print(f"jax-sdpa demo: {r[0]} with {r[1]} failed: {r[3]}", file=sys.stderr)
    return 1 if failed else 0


def cmd_serve_demo(args) -> int:
    try:
        import flax  # noqa: F401
    except ImportError:
        _print("jax-sdpa serve-demo needs flax: pip install 'jax_sdpa[flax]'", file=sys.stderr)
        return 2
    from jax_sdpa import oracle
    from jax_sdpa.examples import serve

    _, worst = serve.demo(requests=args.requests, max_batch=args.max_batch,
                          page_size=args.page_size, small=args.small,
                          implementation=args.implementation, out=_print)
    return 0 if worst < oracle.SERVED_LOGITS_ATOL else 1  # the served logits are the model's


# ---------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from jax_sdpa import bench

    p = argparse.ArgumentParser(prog="jax-sdpa", description="jax_sdpa: fused scaled-dot-"
                                "product attention for JAX")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="versions, devices, built backends, dispatch decisions")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("demo", help="the example GPT beside Flax's default attention")
    s.add_argument("--steps", type=_positive_int, default=16, help="decode steps (default 16)")
    s.add_argument("--small", action="store_true", help="a tiny model (seconds)")
    s.set_defaults(fn=cmd_demo)

    s = sub.add_parser("serve-demo", help="continuous batching of the example GPT on a paged "
                                          "KV cache (jax_sdpa.examples.serve)")
    s.add_argument("--requests", type=_positive_int, default=8)
    s.add_argument("--max-batch", type=_positive_int, default=4)
    s.add_argument("--page-size", type=_positive_int, default=16)
    s.add_argument("--small", action="store_true", help="a tiny model (seconds)")
    s.add_argument("--implementation", "-i", default=None,
                   help="paged_attention's implementation (default: the fastest that serves)")
    s.set_defaults(fn=cmd_serve_demo)

    s = sub.add_parser("check", help="every available implementation vs the float64 "
                                     "oracle; non-zero exit on failure")
    s.add_argument("--quick", action="store_true", help="three cases only")
    s.add_argument("--implementation", "-i", action="append",
                   help="check only this implementation (repeatable)")
    s.add_argument("--seed", type=int, default=None,
                   help="seed of the random inputs (default: a fresh one, printed)")
    s.set_defaults(fn=cmd_check)

    s = sub.add_parser("bench", help="benchmark suites beside jax.nn")
    s.add_argument("--suite", default=bench.DEFAULT_SUITE, choices=sorted(bench.SUITES),
                   metavar="SUITE",
                   help=f"which cases to time (default {bench.DEFAULT_SUITE}; --list shows "
                        f"each suite's shapes): {', '.join(sorted(bench.SUITES))}")
    s.add_argument("--list", action="store_true", help="list the suites and exit")
    s.add_argument("--implementation", "-i", action="append",
                   help="only these (repeatable; jax.nn peers as 'jax.nn:xla', "
                        "'jax.nn:cudnn')")
    s.add_argument("--direction", action="append", choices=["fwd", "fwd+bwd"],
                   help="time only the forward, or forward + backward (repeatable; default: "
                        "the suite's)")
    s.add_argument("--min-time", type=float, default=0.3,
                   help="seconds of repeats per measurement (default 0.3)")
    s.add_argument("--json", metavar="PATH", help="write the results as JSON")
    s.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    s.add_argument("--metric", choices=["time", "tflops"], default="time",
                   help="what the plot shows (default time)")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=cmd_bench)
    return p


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
