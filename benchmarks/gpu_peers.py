"""Every peer on one GPU in one run: jax_sdpa (implementation=None) beside jax.nn's xla and
cudnn, FlashAttention-3 for JAX (flash-attn3-jax), FlashAttention-2 for JAX (flash-attn-jax)
and torch's SDPA backends (cudnn, flash, efficient), on the prefill and decode rows of the
README's GPU tables plus packed, soft-capped, paged and KV-cache-with-lengths rows.

    python3 -P benchmarks/gpu_peers.py --out peers.json [--plot peers.png] [--rows NAME,...]
                                       [--groups prefill,decode,packed,paged]

A peer that isn't installed, or refuses a row, is recorded as refused with its reason.
Times: median of 5 samples; calls under 1 ms run as K dependent calls in one jitted
`lax.fori_loop` (benchmarks/bench_gpu.py: measure), torch's with CUDA events over K calls
(under 1 ms, each followed by the same one-element nudge of q as the JAX loop's).
TFLOP/s counts 4*B*Hq*Lq*Lk*D of visible work (half for causal, 1/segments for packed),
x3.5 for forward+backward; decode GB/s counts q, K, V and out once. Each decode row also
gets the harness's read ceiling: K and V read once by one XLA reduction. nvidia-smi's clocks
are recorded before and after every row.

Every JAX implementation's answer is checked in the same run against the float64 oracle
(jax_sdpa.oracle) on one slice of the call: the last batch row and the last kv head with the
query heads that share it (the output, and for forward+backward the three gradients of a
fixed random cotangent). A result beyond the oracle's tolerance policy (16-bit: twice the
error of jax.nn's xla path in the same dtype on the slice, plus a floor; fp32: TF32's
bound), or not finite, is recorded as wrong and never counts as the best peer. Checked: the
rows without segments, soft cap or pages whose slice has at most CHECK_MAX_SCORES scores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ["JAX_SDPA_POISON_OUTPUTS"] = "0"  # never time the test-only poisoning
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_sdpa  # noqa: E402
from bench_gpu import decode_bytes, measure, versions  # noqa: E402
from jax_sdpa import oracle  # noqa: E402

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
CHECK_MAX_SCORES = 1 << 27  # the checked slice's scores: the float64 oracle's time on the host


def row(name, group, b, hq, hk, lq, lk, d, causal=False, dtype=BF16, segments=0, softcap=None,
        lengths=False, page_size=0, bwd=True):
    return dict(name=name, group=group, B=b, Hq=hq, Hk=hk, Lq=lq, Lk=lk, D=d, causal=causal,
                dtype=dtype, segments=segments, softcap=softcap, lengths=lengths,
                page_size=page_size, bwd=bwd and lq > 1)


ROWS = [
    row("B4 H32 L4096 D128", "prefill", 4, 32, 32, 4096, 4096, 128),
    row("B4 H32 L4096 D128 causal", "prefill", 4, 32, 32, 4096, 4096, 128, causal=True),
    row("B1 H16 L16384 D128 causal", "prefill", 1, 16, 16, 16384, 16384, 128, causal=True),
    row("B2 H32/KV8 L8192 D128 causal", "prefill", 2, 32, 8, 8192, 8192, 128, causal=True),
    row("B8 H16 L1024 D128 causal", "prefill", 8, 16, 16, 1024, 1024, 128, causal=True),
    row("B16 H16 L512 D128", "prefill", 16, 16, 16, 512, 512, 128),
    row("B4 H16 L4096 D64", "prefill", 4, 16, 16, 4096, 4096, 64),
    row("B2 H16 L4096 D256 causal", "prefill", 2, 16, 16, 4096, 4096, 256, causal=True),
    row("SD3 B2 H38 L4250 D64 fp16", "prefill", 2, 38, 38, 4250, 4250, 64, dtype=F16),
    row("SD3 B2 H38 L4250 D64 fp32", "prefill", 2, 38, 38, 4250, 4250, 64, dtype=F32),
    row("B1 H16 L4096 D512 causal", "prefill", 1, 16, 16, 4096, 4096, 512, causal=True),
    row("B1 H16 L4096 D512", "prefill", 1, 16, 16, 4096, 4096, 512),
    row("packed B2 H32/KV8 L8192 D128 causal, 8 segments", "packed", 2, 32, 8, 8192, 8192, 128,
        causal=True, segments=8),
    row("softcap 30 B4 H32 L4096 D128 causal", "packed", 4, 32, 32, 4096, 4096, 128, causal=True,
        softcap=30.0),
    row("softcap 50 B2 H16/KV8 L4096 D256 causal (Gemma 2)", "packed", 2, 16, 8, 4096, 4096, 256,
        causal=True, softcap=50.0),
    row("decode B8 H32/KV8 Lk8192 D128", "decode", 8, 32, 8, 1, 8192, 128),
    row("decode B1 H32/KV8 Lk32768 D128", "decode", 1, 32, 8, 1, 32768, 128),
    row("decode B1 H32/KV8 Lk32768 D128 lengths", "decode", 1, 32, 8, 1, 32768, 128, lengths=True),
    row("decode B8 H32/KV8 Lk8192 D128 lengths", "decode", 8, 32, 8, 1, 8192, 128, lengths=True),
    row("decode B64 H32/KV8 Lk2048 D128", "decode", 64, 32, 8, 1, 2048, 128),
    row("decode B8 H32/KV8 Lk8192 D64", "decode", 8, 32, 8, 1, 8192, 64),
    row("decode B1 H32/KV4 Lk8192 D512", "decode", 1, 32, 4, 1, 8192, 512),
    row("decode B1 H32/KV4 Lk1024 D512 fp16", "decode", 1, 32, 4, 1, 1024, 512, dtype=F16),
    row("decode B8 H32/KV8 Lk8192 D128 fp32", "decode", 8, 32, 8, 1, 8192, 128, dtype=F32),
    row("paged decode B8 H32/KV8 Lk8192 D128 page 64", "paged", 8, 32, 8, 1, 8192, 128,
        lengths=True, page_size=64),
    row("paged decode B64 H32/KV8 Lk2048 D128 page 16", "paged", 64, 32, 8, 1, 2048, 128,
        lengths=True, page_size=16),
    row("paged decode B8 H32/KV8 Lk8192 D128 fp32 page 64", "paged", 8, 32, 8, 1, 8192, 128,
        lengths=True, page_size=64, dtype=F32),
    row("paged decode B8 H32/KV8 Lk8192 D64 fp16 page 16", "paged", 8, 32, 8, 1, 8192, 64,
        lengths=True, page_size=16, dtype=F16),
]


class Refused(Exception):
    pass


def clocks():
    q = "clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        vals = [x.strip() for x in out.splitlines()[0].split(",")]
        return dict(zip(("sm_mhz", "mem_mhz", "max_sm_mhz", "power_w", "temp_c"), vals))
    except Exception as e:  # noqa: BLE001
        return {"error": str(e)}


def inputs(r, seed=0):
    """[B, T, N, H] q, k, v (jax.nn's layout)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    b, lq, lk = r["B"], r["Lq"], r["Lk"]
    shapes = ((b, lq, r["Hq"], r["D"]), (b, lk, r["Hk"], r["D"]), (b, lk, r["Hk"], r["D"]))
    return tuple(jax.random.normal(k, s, F32).astype(r["dtype"]) for k, s in zip(ks, shapes))


def segment_ids(r):
    n, lq = r["segments"], r["Lq"]
    return jnp.broadcast_to(jnp.arange(lq, dtype=jnp.int32) // -(-lq // n), (r["B"], lq))


def pages_of(k, page_size, seed=1):
    """[B, Lk, Hk, D] -> shuffled pages [P, page_size, Hk, D] and the page table [B, Lk/S]."""
    b, lk, hk, d = k.shape
    per = lk // page_size
    perm = np.random.default_rng(seed).permutation(b * per).astype(np.int32)
    pages = k.reshape(b * per, page_size, hk, d)
    pool = jnp.zeros_like(pages).at[perm].set(pages)
    return pool, jnp.asarray(perm.reshape(b, per))


# ---- the JAX implementations: each returns (fn(q, k, v), args) or raises Refused ----

def ours(r, args, implementation=None):
    q, k, v = args
    kw = {"implementation": implementation} if implementation else {}
    if r["segments"]:
        kw["q_segment_ids"] = segment_ids(r)
    if r["softcap"]:
        kw["logits_soft_cap"] = r["softcap"]
    if r["lengths"] and not r["page_size"]:  # paged_attention takes its lengths positionally
        kw["key_value_seq_lengths"] = jnp.full((r["B"],), r["Lk"], jnp.int32)
    if r["page_size"]:
        if not hasattr(jax_sdpa, "paged_attention"):
            raise Refused("jax_sdpa has no paged_attention")
        kp, table = pages_of(k, r["page_size"])
        vp, _ = pages_of(v, r["page_size"])
        lens = jnp.full((r["B"],), r["Lk"], jnp.int32)
        qh = q.transpose(0, 2, 1, 3)
        return (lambda q, kp, vp: jax_sdpa.paged_attention(
            q, kp, vp, table, lens, kv_layout="PSHD", **kw)), (qh, kp, vp)
    causal = r["causal"] and r["Lq"] > 1
    return (lambda q, k, v: jax_sdpa.dot_product_attention(q, k, v, is_causal=causal, **kw)), args


def jaxnn(impl):
    def make(r, args):
        if r["softcap"] or r["page_size"]:
            raise Refused("jax.nn has no soft-capping / paged KV")
        causal = r["causal"] and r["Lq"] > 1
        kw = {}
        if r["lengths"]:
            kw["key_value_seq_lengths"] = jnp.full((r["B"],), r["Lk"], jnp.int32)
        if r["segments"]:
            seg = segment_ids(r)
            mask = (seg[:, None, :, None] == seg[:, None, None, :])
            kw["mask"] = mask
        return (lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=impl, **kw)), args
    return make


def fa3(r, args):
    try:
        import flash_attn3_jax as fa
    except Exception as e:  # noqa: BLE001
        raise Refused(f"flash-attn3-jax not installed ({type(e).__name__})")
    if r["softcap"]:
        raise Refused("flash-attn3-jax's JAX API has no soft-capping")
    q, k, v = args
    causal = r["causal"] and r["Lq"] > 1
    if r["page_size"]:
        kp, table = pages_of(k, r["page_size"])
        vp, _ = pages_of(v, r["page_size"])
        lens = jnp.full((r["B"],), r["Lk"], jnp.int32)
        return (lambda q, kp, vp: fa.flash_mha_with_kvcache(
            q, kp, vp, cache_seqlens=lens, page_table=table)), (q, kp, vp)
    if r["Lq"] == 1:  # its KV-cache entry, its best decode path
        lens = jnp.full((r["B"],), r["Lk"], jnp.int32)
        return (lambda q, k, v: fa.flash_mha_with_kvcache(q, k, v, cache_seqlens=lens)), args
    if r["segments"]:
        b, l, n = r["B"], r["Lq"], r["segments"]
        cu = jnp.arange(0, b * l + 1, l // n, dtype=jnp.int32)
        flat = lambda x: x.reshape(b * l, *x.shape[2:])  # noqa: E731
        return (lambda q, k, v: fa.flash_mha_varlen(
            flat(q), flat(k), flat(v), cu, cu, max_seqlen_q=l // n, max_seqlen_k=l // n,
            is_causal=causal).reshape(q.shape)), args
    return (lambda q, k, v: fa.flash_mha(q, k, v, is_causal=causal)), args


def fa2(r, args):
    try:
        import flash_attn_jax as fa
    except Exception as e:  # noqa: BLE001
        raise Refused(f"flash-attn-jax not installed ({type(e).__name__})")
    if r["softcap"] or r["page_size"] or r["segments"] or r["lengths"]:
        raise Refused("not in flash-attn-jax's API")
    causal = r["causal"] and r["Lq"] > 1
    return (lambda q, k, v: fa.flash_mha(q, k, v, is_causal=causal)), args


def read_ceiling(r, args):
    if r["Lq"] != 1:
        raise Refused("decode rows only")
    _, k, v = args
    if r["page_size"]:
        k, _ = pages_of(k, r["page_size"])
        v, _ = pages_of(v, r["page_size"])
    def ceiling(q, k, v):  # scaled by an element of q, so that XLA can't hoist it out of the loop
        s = q.reshape(-1)[0].astype(jnp.float32)
        return q + (jnp.sum(k.astype(jnp.float32) * s) + jnp.sum(v.astype(jnp.float32) * s)
                    ).astype(q.dtype)
    return ceiling, (args[0], k, v)


def ours_named(implementation):
    """Our named implementations (not peers): what None chose among, paired in the run."""
    return lambda r, args: ours(r, args, implementation)


JAX_IMPLS = {"jax_sdpa": ours, "jax_sdpa_cuda": ours_named("cuda"),
             "jax_sdpa_cudnn": ours_named("cudnn"), "jax_sdpa_xla": ours_named("xla"),
             "jax_sdpa_flash_attn3": ours_named("flash_attn3"),
             "jaxnn_cudnn": jaxnn("cudnn"), "jaxnn_xla": jaxnn("xla"),
             "flash_attn3_jax": fa3, "flash_attn_jax": fa2, "read_ceiling": read_ceiling}


# ---- torch's SDPA backends ----

def torch_time(r, backend, backward, samples=5):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    if backend == "flex":  # FlexAttention: soft-capping as a score_mod, causal as a block mask
        if not r["softcap"]:
            raise Refused("measured on soft-capped rows only (torch's SDPA backends time the rest)")
        if r["page_size"] or r["segments"] or r["lengths"]:
            raise Refused("not measured through FlexAttention")
    elif r["softcap"] or r["page_size"] or r["segments"] or r["lengths"]:
        raise Refused("not in torch's SDPA API")
    dt = {BF16: torch.bfloat16, F16: torch.float16, F32: torch.float32}[r["dtype"]]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    mk = lambda h, l, d: torch.randn(r["B"], h, l, d, device=dev, dtype=dt, generator=g,  # noqa: E731
                                     requires_grad=backward)
    q, k, v = mk(r["Hq"], r["Lq"], r["D"]), mk(r["Hk"], r["Lk"], r["D"]), mk(r["Hk"], r["Lk"], r["D"])
    causal = r["causal"] and r["Lq"] > 1
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
          "efficient": SDPBackend.EFFICIENT_ATTENTION, "flex": None}[backend]
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        cap = float(r["softcap"])
        flex = torch.compile(flex_attention)
        blocks = (create_block_mask(lambda b, h, i, j: i >= j, None, None, r["Lq"], r["Lk"],
                                    device=dev) if causal else None)

        def soft_cap(score, b, h, i, j):
            return cap * torch.tanh(score / cap)

    def call():
        if backend == "flex":
            o = flex(q, k, v, score_mod=soft_cap, block_mask=blocks,
                     enable_gqa=r["Hq"] != r["Hk"])
            if backward:
                o.backward(o.detach())
            return o
        with sdpa_kernel([be]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                               enable_gqa=r["Hq"] != r["Hk"])
        if backward:
            o.backward(o.detach())
        return o

    try:
        call()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        raise Refused(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = int(min(max(0.12 / one, 2), 500))
    # Calls under 1 ms pay what the JAX loop's calls pay (bench_gpu.looped): each call's q
    # gets one element nudged by the last result, one small in-place kernel a call.
    dependent = one < 1e-3
    head = q.detach().view(-1)[:1]

    def step():
        o = call()
        if dependent:
            torch.add(head, o.detach().reshape(-1)[:1], alpha=1e-3, out=head)

    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / n)
    del q, k, v
    torch.cuda.empty_cache()
    return float(np.median(times))


def check_slice(r):
    """(batch row, query heads, kv head) of the checked slice, [B, T, N, H] indices: the
    last batch row and kv head (their offsets exercised) and the query heads sharing it."""
    group = r["Hq"] // r["Hk"]
    return r["B"] - 1, slice(r["Hq"] - group, r["Hq"]), r["Hk"] - 1


def checkable(r):
    return (not (r["segments"] or r["softcap"] or r["page_size"])
            and (r["Hq"] // r["Hk"]) * r["Lq"] * r["Lk"] <= CHECK_MAX_SCORES)


def answer(r, fn, args, backward, cotangent):
    """The checked slice of the output, or of the three gradients of <out, cotangent>, as
    float32 host arrays."""
    b, heads, kv_head = check_slice(r)
    if not backward:
        return (np.asarray(jax.jit(fn)(*args)[b, :, heads].astype(F32)),)

    def grads(*a):  # one jit: eager residuals would become constants of the backward's jit
        out, vjp = jax.vjp(fn, *a)
        dq, dk, dv = vjp(cotangent.astype(out.dtype))
        return tuple(x.astype(F32) for x in (dq[b, :, heads], dk[b, :, kv_head:kv_head + 1],
                                               dv[b, :, kv_head:kv_head + 1]))

    return tuple(np.asarray(x) for x in jax.jit(grads)(*args))


def reference_answer(r, args, backward, cotangent):
    """(the oracle's answer on the checked slice in float64, the same-dtype answer of
    jax.nn's xla path there: the error the 16-bit bound allows twice of)."""
    b, heads, kv_head = check_slice(r)
    causal = r["causal"] and r["Lq"] > 1  # jax.nn's causal: top-left
    q, k, v = args[0][b:b + 1, :, heads], *(x[b:b + 1, :, kv_head:kv_head + 1] for x in args[1:])
    f64 = [np.asarray(x.astype(F32), np.float64) for x in (q, k, v)]
    kw = dict(window_right=0 if causal else -1, seq_major=True)
    if backward:
        ct = np.asarray(cotangent[b:b + 1, :, heads].astype(r["dtype"]).astype(F32), np.float64)
        g = oracle.backward(*f64, ct, **kw)
        want = (g["dq"][0], g["dk"][0], g["dv"][0])
    else:
        want = (oracle.forward(*f64, **kw)[0][0],)
    xla = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=causal, implementation="xla")
    sub = r | dict(B=1, Hq=q.shape[2], Hk=1)
    return want, answer(sub, xla, (q, k, v), backward, cotangent[b:b + 1, :, heads])


def check(r, got, reference, backward):
    """{"rel_err": the worst oracle.max_rel_error over the arrays, "tol": that array's bound,
    "wrong": bool: an array beyond its bound or not finite}."""
    want, xla = reference
    dtype = jnp.dtype(r["dtype"]).name
    res = dict(rel_err=0.0, tol=None, wrong=False)
    for g, w, x in zip(got, want, xla):
        err = oracle.max_rel_error(g, w) if np.isfinite(g).all() else float("inf")
        # implementation "xla": fp32 peers run at JAX's default precision (TF32 may round)
        bound = oracle.tolerance(dtype, "xla", grad=backward, tf32=True,
                                 xla_error=oracle.max_rel_error(x, w))
        res["wrong"] |= not err <= bound
        if res["tol"] is None or err >= res["rel_err"]:
            res.update(rel_err=err, tol=bound)
    return res


def work(r, backward):
    f = 4.0 * r["B"] * r["Hq"] * r["Lq"] * r["Lk"] * r["D"]
    if r["causal"] and r["Lq"] > 1:
        f *= 0.5
    if r["segments"]:
        f /= r["segments"]
    return f * (3.5 if backward else 1.0)


def metric(r, sec, backward):
    if r["Lq"] == 1:
        return {"GB/s": decode_bytes(r["B"], r["Hq"], r["Hk"], 1, r["Lk"], r["D"], r["dtype"])
                / sec / 1e9}
    return {"TFLOP/s": work(r, backward) / sec / 1e12}


def run_row(r, impls, torch_backends):
    res = {k: (jnp.dtype(v).name if k == "dtype" else v) for k, v in r.items()}
    res["clocks_before"] = clocks()
    res["results"] = {}
    args = inputs(r)
    modes = ("fwd", "fwd+bwd") if r["bwd"] else ("fwd",)
    cotangent = jax.random.normal(jax.random.PRNGKey(7), args[0].shape, F32)
    references = {}
    for impl in impls:
        for mode in modes:
            backward = mode == "fwd+bwd"
            try:
                if impl == "read_ceiling" and backward:
                    continue
                fn, a = JAX_IMPLS[impl](r, args)
                sec, temp, n = measure(fn, a, backward)
                out = dict(ms=sec * 1e3, temp_gib=temp / 2**30, calls_per_sample=n,
                           **metric(r, sec, backward))
                if checkable(r) and impl != "read_ceiling":
                    if mode not in references:
                        references[mode] = reference_answer(r, args, backward, cotangent)
                    out.update(check(r, answer(r, fn, a, backward, cotangent),
                                     references[mode], backward))
            except Exception as e:  # noqa: BLE001
                msg = str(e).splitlines()[0][:300] if str(e) else ""
                out = dict(refused=f"{type(e).__name__}: {msg}")
            res["results"][f"{impl}/{mode}"] = out
            print(json.dumps({"row": r["name"], f"{impl}/{mode}": out}), flush=True)
    del args, references
    for be in torch_backends:
        for mode in modes:
            try:
                sec = torch_time(r, be, mode == "fwd+bwd")
                out = dict(ms=sec * 1e3, **metric(r, sec, mode == "fwd+bwd"))
            except Exception as e:  # noqa: BLE001
                out = dict(refused=f"{type(e).__name__}: {str(e)[:300]}")
            res["results"][f"torch_{be}/{mode}"] = out
            print(json.dumps({"row": r["name"], f"torch_{be}/{mode}": out}), flush=True)
    res["clocks_after"] = clocks()
    return res


def summary(rows):
    """Per row and mode: ours, the best peer, their ratio."""
    lines = []
    for r in rows:
        for mode in ("fwd", "fwd+bwd"):
            vals = {}
            for key, x in r["results"].items():
                impl, m = key.split("/")
                # a wrong answer never counts as a peer's (ours is shown, marked wrong)
                if (m == mode and "refused" not in x and impl != "read_ceiling"
                        and (impl == "jax_sdpa" or not x.get("wrong"))):
                    vals[impl] = x.get("TFLOP/s", x.get("GB/s"))
            if "jax_sdpa" not in vals:
                continue
            peers = {k: v for k, v in vals.items() if not k.startswith("jax_sdpa")}
            best = max(peers, key=peers.get) if peers else None
            ceil = r["results"].get("read_ceiling/fwd", {}).get("GB/s")
            wrong = sorted(key.split("/")[0] for key, x in r["results"].items()
                           if key.endswith("/" + mode) and x.get("wrong"))
            entry = dict(row=r["name"], mode=mode, ours=vals["jax_sdpa"], best_peer=best,
                         best=peers.get(best), ratio=vals["jax_sdpa"] / peers[best] if best else None,
                         read_ceiling=ceil, wrong=wrong)
            lines.append(entry)
    return lines


def plot(summ, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{s['row']} {s['mode']}" for s in summ if s["ratio"]]
    ratios = [s["ratio"] for s in summ if s["ratio"]]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(labels) + 1.5))
    ax.barh(range(len(labels)), ratios, color=["tab:green" if x >= 1 else "tab:red" for x in ratios])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("jax_sdpa (implementation=None) / best peer, same run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="peers.json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--groups", default="prefill,packed,decode,paged")
    ap.add_argument("--rows", default="", help="substrings of row names (comma-separated)")
    ap.add_argument("--impls", default=",".join(k for k in JAX_IMPLS if not k.startswith("jax_sdpa_")),
                    help="also jax_sdpa_cuda, jax_sdpa_cudnn, jax_sdpa_xla, "
                         "jax_sdpa_flash_attn3: our named implementations")
    ap.add_argument("--torch", default="cudnn,flash,efficient,flex")
    args = ap.parse_args()
    info = versions()
    info["clocks_start"] = clocks()
    for name in ("flash_attn3_jax", "flash_attn_jax", "torch"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001
            info[name] = f"absent ({type(e).__name__})"
    print(json.dumps(info), flush=True)
    groups = set(args.groups.split(","))
    wanted = [s for s in args.rows.split(",") if s]
    rows = []
    torch_backends = [t for t in args.torch.split(",") if t]
    for r in ROWS:
        if r["group"] not in groups or (wanted and not any(w in r["name"] for w in wanted)):
            continue
        rows.append(run_row(r, args.impls.split(","), torch_backends))
        summ = summary(rows)
        with open(args.out, "w") as f:  # after every row: a run cut short keeps what it measured
            json.dump(dict(info=info, rows=rows, summary=summ), f, indent=1)
    summ = summary(rows)
    for s in summ:
        ratio = f"{s['ratio']:.2f}" if s["ratio"] else "-"
        print(f"{s['row']:<50} {s['mode']:<8} ours {s['ours']:8.1f}  best {s['best_peer']} "
              f"{s['best'] or 0:8.1f}  ratio {ratio}"
              + (f"  ceiling {s['read_ceiling']:.0f}" if s["read_ceiling"] else "")
              + (f"  WRONG: {','.join(s['wrong'])}" if s["wrong"] else ""), flush=True)
    if args.plot and summ:
        plot(summ, args.plot)


if __name__ == "__main__":
    main()
