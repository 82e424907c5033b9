"""A small GPT-style decoder in Flax nnx whose attention runs on jax_sdpa.

- pre-norm blocks: RMSNorm, grouped-query attention with rotary embeddings, GELU MLP;
- full-sequence attention (training, prefill) through `jax_sdpa.flax.make_attention_fn
  (is_causal=True)` -- the same function a `nnx.MultiHeadAttention` takes;
- training on packed sequences: several documents per row, `segment_ids` [B, T] saying
  which document each token belongs to; attention stays within a document (the ids reach
  the attention function through a `jax_sdpa.flax.segment_ids` block), rotary positions
  restart at each document and no token is trained to predict the next document's first;
- autoregressive decoding against a fixed-size KV cache under `jit`: the cache is the
  whole buffer `[layers, B, Hk, max_len, head_dim]`, each row's length is data, and a
  step calls `jax_sdpa.scaled_dot_product_attention(..., mask="causal",
  key_value_seq_lengths=lengths)` (bottom-right causal: the new token sees its row's
  cache);
- `attention="flax"` builds the same model on Flax's default attention
  (`nnx.dot_product_attention` with causal/length masks): the reference it must match.

    cfg = GPTConfig()
    model = GPT(cfg, rngs=nnx.Rngs(0))
    tokens, lengths = encode(["hello", "jax"], cfg.max_len)
    out = generate(model, tokens, lengths, steps=16)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sdpa
import jax_sdpa.flax
from jax_sdpa.flax import make_attention_fn

ATTENTIONS = ("jax_sdpa", "flax")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    d_model: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention
    n_layers: int = 2
    max_len: int = 256  # KV cache capacity
    mlp_ratio: int = 4
    rope_base: float = 10000.0
    dtype: Any = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _rope(x, positions, base):
    """Rotary embedding; x [B, T, N, H], positions [B, T]."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, half]
    cos, sin = jnp.cos(angles)[:, :, None], jnp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _write_rows(cache, new, positions):
    """cache [B, Hk, Lmax, D] <- new [B, Hk, T, D] at each row's own position."""
    return jax.vmap(lambda c, x, p: jax.lax.dynamic_update_slice(c, x, (0, p, 0)))(
        cache, new.astype(cache.dtype), positions)


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, attention: str, implementation: Optional[str],
                 rngs: nnx.Rngs):
        d, h, hk, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        lin = functools.partial(nnx.Linear, use_bias=False, dtype=cfg.dtype, rngs=rngs)
        self.wq, self.wk, self.wv = lin(d, h * hd), lin(d, hk * hd), lin(d, hk * hd)
        self.wo = lin(h * hd, d)
        self.cfg = cfg
        self.attention = attention
        self.implementation = implementation

    def _qkv(self, x, positions):
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).reshape(b, t, cfg.n_heads, cfg.head_dim)
        k = self.wk(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        v = self.wv(x).reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
        return _rope(q, positions, cfg.rope_base), _rope(k, positions, cfg.rope_base), v

    def __call__(self, x, positions, segment_ids=None):
        """Causal self-attention over the whole sequence (within each segment when
        `segment_ids` [B, T] are given); returns (out, k, v)."""
        q, k, v = self._qkv(x, positions)
        if self.attention == "flax":
            mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
            if segment_ids is not None:
                same = segment_ids[:, :, None] == segment_ids[:, None, :]
                mask = mask.astype(bool) & same[:, None]
            o = nnx.dot_product_attention(q, k, v, mask=mask)
        else:
            attend = make_attention_fn(is_causal=True, implementation=self.implementation)
            packing = (contextlib.nullcontext() if segment_ids is None
                       else jax_sdpa.flax.segment_ids(segment_ids))
            with packing:
                o = attend(q, k, v)
        return self.wo(o.reshape(x.shape[:2] + (-1,))), k, v

    def decode(self, x, positions, cache_k, cache_v, lengths):
        """New tokens x [B, T, d] at `positions` [B, T] against the cache [B, Hk, Lmax, D]
        holding `lengths` [B] tokens per row; returns (out, cache_k, cache_v)."""
        q, k, v = self._qkv(x, positions)
        cache_k = _write_rows(cache_k, jnp.swapaxes(k, 1, 2), lengths)
        cache_v = _write_rows(cache_v, jnp.swapaxes(v, 1, 2), lengths)
        new_lengths = lengths + x.shape[1]
        if self.attention == "flax":
            keys = jnp.arange(cache_k.shape[2])
            visible = keys[None, None, :] <= positions[:, :, None]  # [B, T, Lmax]
            o = nnx.dot_product_attention(q, jnp.swapaxes(cache_k, 1, 2),
                                          jnp.swapaxes(cache_v, 1, 2),
                                          mask=visible[:, None])
        else:
            o = jax_sdpa.scaled_dot_product_attention(
                jnp.swapaxes(q, 1, 2), cache_k, cache_v, mask="causal",
                key_value_seq_lengths=new_lengths, implementation=self.implementation)
            o = jnp.swapaxes(o, 1, 2)
        return self.wo(o.reshape(x.shape[:2] + (-1,))), cache_k, cache_v


class Block(nnx.Module):
    def __init__(self, cfg, attention, implementation, rngs):
        d = cfg.d_model
        self.norm1 = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
        self.attn = Attention(cfg, attention, implementation, rngs)
        self.norm2 = nnx.RMSNorm(d, dtype=cfg.dtype, rngs=rngs)
        self.up = nnx.Linear(d, cfg.mlp_ratio * d, dtype=cfg.dtype, rngs=rngs)
        self.down = nnx.Linear(cfg.mlp_ratio * d, d, dtype=cfg.dtype, rngs=rngs)

    def _mlp(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x, positions, segment_ids=None):
        a, k, v = self.attn(self.norm1(x), positions, segment_ids)
        return self._mlp(x + a), k, v

    def decode(self, x, positions, cache_k, cache_v, lengths):
        a, cache_k, cache_v = self.attn.decode(self.norm1(x), positions, cache_k, cache_v,
                                               lengths)
        return self._mlp(x + a), cache_k, cache_v


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, attention: str = "jax_sdpa",
                 implementation: Optional[str] = None):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        blocks = [Block(cfg, attention, implementation, rngs) for _ in range(cfg.n_layers)]
        self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks
        self.norm = nnx.RMSNorm(cfg.d_model, dtype=cfg.dtype, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, dtype=cfg.dtype,
                               rngs=rngs)

    def _forward(self, tokens, segment_ids=None):
        b, t = tokens.shape
        positions = (jnp.broadcast_to(jnp.arange(t), (b, t)) if segment_ids is None
                     else segment_positions(segment_ids))
        x = self.embed(tokens)
        ks, vs = [], []
        for block in self.blocks:
            x, k, v = block(x, positions, segment_ids)
            ks.append(k)
            vs.append(v)
        return self.head(self.norm(x)), ks, vs

    def __call__(self, tokens, segment_ids=None):
        """Logits [B, T, vocab] of a causal pass over tokens [B, T]; with `segment_ids`
        [B, T] (packed documents, each a contiguous run of one id) every document is its
        own sequence."""
        return self._forward(tokens, segment_ids)[0]

    def prefill(self, tokens, lengths, cache_len: Optional[int] = None):
        """Runs the (right-padded) prompts tokens [B, T] with `lengths` [B] real tokens;
        returns (logits [B, T, vocab], cache). Padding positions only hold garbage that
        the lengths mask out later."""
        cache_len = cache_len or self.cfg.max_len
        logits, ks, vs = self._forward(tokens)
        b, t = tokens.shape

        def to_cache(xs):
            x = jnp.stack([jnp.swapaxes(a, 1, 2) for a in xs])  # [layers, B, Hk, T, D]
            pad = [(0, 0)] * 3 + [(0, cache_len - t), (0, 0)]
            return jnp.pad(x, pad)

        cache = {"k": to_cache(ks), "v": to_cache(vs),
                 "lengths": jnp.asarray(lengths, jnp.int32)}
        return logits, cache

    def decode_step(self, tokens, cache):
        """tokens [B, T] appended after each row's cached tokens (T = 1 when generating);
        returns (logits [B, T, vocab], cache)."""
        lengths = cache["lengths"]
        positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None]
        x = self.embed(tokens)
        new_k, new_v = [], []
        for i, block in enumerate(self.blocks):
            x, ck, cv = block.decode(x, positions, cache["k"][i], cache["v"][i], lengths)
            new_k.append(ck)
            new_v.append(cv)
        cache = {"k": jnp.stack(new_k), "v": jnp.stack(new_v),
                 "lengths": lengths + tokens.shape[1]}
        return self.head(self.norm(x)), cache


def segment_positions(segment_ids):
    """Each token's position within its segment ([B, T]; segments are contiguous runs)."""
    t = segment_ids.shape[1]
    index = jnp.broadcast_to(jnp.arange(t), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def with_attention(model: GPT, attention: str, implementation: Optional[str] = None) -> GPT:
    """The same model (same parameters) on another attention."""
    twin = nnx.eval_shape(lambda: GPT(model.cfg, rngs=nnx.Rngs(0), attention=attention,
                                      implementation=implementation))
    nnx.update(twin, nnx.state(model))
    return twin


# ---------------------------------------------------------------------------
# jitted entry points (graphdef static, state as data)

@functools.partial(jax.jit, static_argnums=(0, 4))
def _prefill(graphdef, state, tokens, lengths, cache_len):
    return nnx.merge(graphdef, state).prefill(tokens, lengths, cache_len)


@functools.partial(jax.jit, static_argnums=(0,))
def _decode(graphdef, state, tokens, cache):
    return nnx.merge(graphdef, state).decode_step(tokens, cache)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, state, tokens, lengths, steps, cache_len):
    model = nnx.merge(graphdef, state)
    logits, cache = model.prefill(tokens, lengths, cache_len)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    first = jnp.argmax(last, -1).astype(tokens.dtype)

    def step(carry, _):
        token, cache = carry
        logits, cache = model.decode_step(token[:, None], cache)
        nxt = jnp.argmax(logits[:, 0], -1).astype(token.dtype)
        return (nxt, cache), token

    (_, cache), out = jax.lax.scan(step, (first, cache), None, length=steps)
    return jnp.swapaxes(out, 0, 1), cache


def prefill(model: GPT, tokens, lengths, cache_len: Optional[int] = None):
    graphdef, state = nnx.split(model)
    return _prefill(graphdef, state, tokens, lengths, cache_len or model.cfg.max_len)


def decode_step(model: GPT, tokens, cache):
    graphdef, state = nnx.split(model)
    return _decode(graphdef, state, tokens, cache)


def generate(model: GPT, tokens, lengths, steps: int, cache_len: Optional[int] = None):
    """Greedy decoding under one jit: prefill, then `steps` single-token steps against the
    fixed-size cache. Returns (generated tokens [B, steps], final cache)."""
    cache_len = cache_len or model.cfg.max_len
    if int(np.max(np.asarray(lengths))) + steps > cache_len:
        raise ValueError(f"prompt length + steps exceeds the cache ({cache_len})")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, tokens, jnp.asarray(lengths, jnp.int32), steps,
                     cache_len)


# ---------------------------------------------------------------------------
# training

def loss_fn(model: GPT, tokens, segment_ids=None):
    """Mean next-token cross-entropy over tokens [B, T]; with packed `segment_ids` only
    over the pairs within one document."""
    inputs = None if segment_ids is None else segment_ids[:, :-1]
    logits = model(tokens[:, :-1], inputs).astype(jnp.float32)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
    if segment_ids is None:
        return jnp.mean(nll)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]).astype(nll.dtype)
    return jnp.sum(nll * same) / jnp.maximum(jnp.sum(same), 1)


@functools.partial(jax.jit, static_argnums=(0,))
def _loss_and_grads(graphdef, params, rest, tokens, segment_ids):
    def f(p):
        return loss_fn(nnx.merge(graphdef, p, rest), tokens, segment_ids)

    return jax.value_and_grad(f)(params)


def loss_and_grads(model: GPT, tokens, segment_ids=None):
    """(loss, grads w.r.t. the nnx.Param state), jitted."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return _loss_and_grads(graphdef, params, rest, tokens, segment_ids)


def make_train_step(model: GPT, learning_rate: float = 3e-3):
    """(step(tokens, segment_ids=None) -> loss): one jitted AdamW update of the model in
    place."""
    import optax

    tx = optax.adamw(learning_rate)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    state = {"params": params, "opt": tx.init(params)}

    @jax.jit
    def update(params, opt, rest, tokens, segment_ids):
        def f(p):
            return loss_fn(nnx.merge(graphdef, p, rest), tokens, segment_ids)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt = tx.update(grads, opt, params)
        return loss, jax.tree.map(lambda a, u: a + u, params, updates), opt

    def step(tokens, segment_ids=None):
        loss, state["params"], state["opt"] = update(state["params"], state["opt"], rest,
                                                     tokens, segment_ids)
        nnx.update(model, state["params"])
        return loss

    return step


# ---------------------------------------------------------------------------
# data: bytes of text

CORPUS = (__doc__ or "") * 4 + (jax_sdpa.__doc__ or "") * 4


def encode(texts, length: int):
    """Right-padded byte tokens [B, length] and lengths [B]."""
    rows = [list(t.encode("utf-8"))[:length] for t in texts]
    tokens = np.zeros((len(rows), length), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    return jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32)


def decode_bytes(tokens) -> str:
    return bytes(int(t) for t in np.asarray(tokens)).decode("utf-8", errors="replace")


def batches(batch: int, length: int, seed: int = 0):
    """Random windows of the corpus, forever."""
    data = np.frombuffer(CORPUS.encode("utf-8"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - length - 1, batch)
        yield jnp.asarray(np.stack([data[s:s + length] for s in starts]))


def packed_batches(batch: int, length: int, seed: int = 0, min_doc: int = 8):
    """Rows of `length` tokens packed with corpus excerpts of random lengths (documents),
    forever: (tokens [B, length], segment_ids [B, length], each document one id)."""
    data = np.frombuffer(CORPUS.encode("utf-8"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    while True:
        tokens = np.zeros((batch, length), np.int32)
        ids = np.zeros((batch, length), np.int32)
        for row in range(batch):
            pos, doc = 0, 0
            while pos < length:
                n = min(int(rng.integers(min_doc, length // 2 + 1)), length - pos)
                start = int(rng.integers(0, len(data) - n))
                tokens[row, pos:pos + n] = data[start:start + n]
                ids[row, pos:pos + n] = doc
                pos, doc = pos + n, doc + 1
        yield jnp.asarray(tokens), jnp.asarray(ids)


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="train a tiny byte-level GPT on jax_sdpa a few "
                                            "steps on packed sequences, then generate")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--implementation", default=None)
    args = p.parse_args(argv)
    cfg = GPTConfig()
    model = GPT(cfg, rngs=nnx.Rngs(0), implementation=args.implementation)
    step = make_train_step(model)
    data = packed_batches(8, 128)  # several documents per row
    for i in range(args.steps):
        loss = step(*next(data))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.3f}")
    prompts = ["jax_sdpa: fused ", "The cache is the "]
    tokens, lengths = encode(prompts, 32)
    out, _ = generate(model, tokens, lengths, args.tokens)
    for prompt, row in zip(prompts, out):
        print(repr(prompt + decode_bytes(row)))


if __name__ == "__main__":
    main()
