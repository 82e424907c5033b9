"""A small continuous-batching server on a paged KV cache, for the example GPT.

Requests (prompts of different lengths, each wanting some new tokens) arrive over time; the
server keeps up to `max_batch` of them in flight. Every iteration is one call of one jitted
step over all slots: a prefilling request feeds the next chunk of its prompt (chunked
prefill), a decoding one its last generated token, an empty slot nothing. The step writes
the new keys and values into the pages (`jax_sdpa.paged_kv_write`) and attends over each
row's pages in place (`jax_sdpa.paged_attention`, bottom-right causal against the row's
length). Pages come from a free list when a row's length crosses a page boundary and go back
when its request finishes; a request is admitted only when the pages it can ever need are
free, so no request waits for another mid-flight.

    model = gpt.GPT(gpt.GPTConfig(), rngs=nnx.Rngs(0))
    server = Server(model, max_batch=4, num_pages=64, page_size=16)
    server.submit(prompt_tokens, max_new_tokens=16, arrival=0)
    results = server.run()      # {request id: Finished(tokens, logits)}
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_sdpa
from jax_sdpa.examples import gpt


# ---------------------------------------------------------------------------
# the jitted step: all slots, T new tokens each (T = 1 when nobody prefills)

def _step_fn(model: gpt.GPT, k_pages, v_pages, page_table, lengths, tokens, implementation):
    """tokens [B, T] at positions lengths[b] ... of each row; pages [layers, P, Hk, S, D]
    (kv_layout "PHSD"); rows whose page table is all -1 are idle (writes dropped, nothing
    attended). Returns (logits [B, T, vocab], k_pages, v_pages)."""
    b, t = tokens.shape
    positions = lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    x = model.embed(tokens)
    for i, block in enumerate(model.blocks):
        attn = block.attn
        q, k, v = attn._qkv(block.norm1(x), positions)  # [B, T, N, H]
        kp, vp = jax_sdpa.paged_kv_write(k_pages[i], v_pages[i], page_table, lengths,
                                         jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2))
        o = jax_sdpa.paged_attention(jnp.swapaxes(q, 1, 2), kp, vp, page_table, lengths + t,
                                     mask="causal", implementation=implementation)
        x = block._mlp(x + attn.wo(jnp.swapaxes(o, 1, 2).reshape(b, t, -1)))
        k_pages, v_pages = k_pages.at[i].set(kp), v_pages.at[i].set(vp)
    return model.head(model.norm(x)), k_pages, v_pages


@functools.partial(jax.jit, static_argnums=(0, 7), donate_argnums=(2, 3))
def _step(graphdef, state, k_pages, v_pages, page_table, lengths, tokens, implementation):
    return _step_fn(nnx.merge(graphdef, state), k_pages, v_pages, page_table, lengths,
                    tokens, implementation)


# ---------------------------------------------------------------------------
# the host loop

@dataclasses.dataclass
class Request:
    rid: int
    prompt: np.ndarray  # int32 [Lp]
    max_new_tokens: int
    arrival: int  # the iteration it arrives at


@dataclasses.dataclass
class Finished:
    tokens: np.ndarray  # int32 [max_new_tokens] generated (greedy)
    logits: np.ndarray  # float32 [Lp + max_new_tokens - 1, vocab]: at every fed position
    admitted: int
    finished: int


@dataclasses.dataclass
class _Slot:
    request: Request
    pages: list  # physical pages, in logical order
    reserved: int  # pages it may still take from the free list
    length: int = 0  # tokens in the cache
    fed_prompt: int = 0
    generated: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    admitted: int = 0


class Server:
    """Continuous batching over a paged KV cache (see the module doc)."""

    def __init__(self, model: gpt.GPT, *, max_batch: int = 4, num_pages: int = 64,
                 page_size: int = 16, prefill_chunk: int = 8,
                 implementation: Optional[str] = None):
        cfg = model.cfg
        self.model, self.cfg = model, cfg
        self.max_batch, self.page_size, self.prefill_chunk = max_batch, page_size, prefill_chunk
        self.num_pages = num_pages
        self.pages_per_seq = -(-cfg.max_len // page_size)
        shape = (cfg.n_layers, num_pages, cfg.n_kv_heads, page_size, cfg.head_dim)
        self.k_pages = jnp.zeros(shape, cfg.dtype)
        self.v_pages = jnp.zeros(shape, cfg.dtype)
        self.free = list(range(num_pages))[::-1]  # a stack of free physical pages
        self.reserved = 0  # pages promised to admitted requests, not yet taken
        self.slots: list = [None] * max_batch
        self.requests: dict = {}  # every submitted request, by id
        self.waiting: list = []
        self.finished: dict = {}
        self.events: list = []  # (iteration, text)
        self.iteration = 0
        self.implementation = implementation
        self._graphdef, self._state = nnx.split(model)
        self.steps_run = {"prefill": 0, "decode": 0}

    def submit(self, prompt, max_new_tokens: int, arrival: int = 0) -> int:
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        if prompt.size == 0 or max_new_tokens < 1:
            raise ValueError("a request needs a non-empty prompt and max_new_tokens >= 1")
        if prompt.size + max_new_tokens > self.cfg.max_len:
            raise ValueError(f"prompt + max_new_tokens = {prompt.size + max_new_tokens} "
                             f"exceeds the model's max_len {self.cfg.max_len}")
        if self._pages_needed(prompt.size, max_new_tokens) > self.num_pages:
            raise ValueError("the request needs more pages than the pool holds")
        rid = len(self.requests)
        self.requests[rid] = Request(rid, prompt, int(max_new_tokens), int(arrival))
        self.waiting.append(self.requests[rid])
        return rid

    def _pages_needed(self, prompt_len, max_new):
        # the last generated token is never fed back: it needs no cache slot
        return -(-(prompt_len + max_new - 1) // self.page_size)

    def _admit(self):
        for request in sorted(self.waiting, key=lambda r: (r.arrival, r.rid)):
            if request.arrival > self.iteration:
                continue
            free_slot = next((i for i, s in enumerate(self.slots) if s is None), None)
            need = self._pages_needed(request.prompt.size, request.max_new_tokens)
            if free_slot is None or len(self.free) - self.reserved < need:
                break  # first come, first served
            self.waiting.remove(request)
            self.reserved += need
            self.slots[free_slot] = _Slot(request, [], need, admitted=self.iteration)
            self.events.append((self.iteration, f"admit request {request.rid} (prompt "
                                f"{request.prompt.size}, {request.max_new_tokens} new) "
                                f"into slot {free_slot}"))

    def _plan(self, chunk):
        """The tokens each slot feeds this iteration, taking pages as lengths grow."""
        tokens = np.zeros((self.max_batch, chunk), np.int32)
        n_new = np.zeros(self.max_batch, np.int32)
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            prompt = slot.request.prompt
            if slot.fed_prompt < prompt.size:
                feed = prompt[slot.fed_prompt:slot.fed_prompt + chunk]
            else:
                feed = np.asarray(slot.generated[-1:], np.int32)
            tokens[i, :feed.size] = feed
            n_new[i] = feed.size
            while len(slot.pages) * self.page_size < slot.length + feed.size:
                slot.pages.append(self.free.pop())
                slot.reserved -= 1
                self.reserved -= 1
        return tokens, n_new

    def _tables(self):
        table = np.full((self.max_batch, self.pages_per_seq), -1, np.int32)
        lengths = np.zeros(self.max_batch, np.int32)
        for i, slot in enumerate(self.slots):
            if slot is not None:
                table[i, :len(slot.pages)] = slot.pages
                lengths[i] = slot.length
        return table, lengths

    def step(self):
        """One iteration: admit, run the jitted step once, sample, retire."""
        self._admit()
        active = [s for s in self.slots if s is not None]
        if not active:
            self.iteration += 1
            return
        prefilling = any(s.fed_prompt < s.request.prompt.size for s in active)
        chunk = self.prefill_chunk if prefilling else 1
        tokens, n_new = self._plan(chunk)
        table, lengths = self._tables()
        logits, self.k_pages, self.v_pages = _step(
            self._graphdef, self._state, self.k_pages, self.v_pages, jnp.asarray(table),
            jnp.asarray(lengths), jnp.asarray(tokens), self.implementation)
        self.steps_run["prefill" if prefilling else "decode"] += 1
        logits = np.asarray(logits, np.float32)
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            n = int(n_new[i])
            slot.logits.append(logits[i, :n])
            slot.length += n
            prompt_len = slot.request.prompt.size
            was_prefilling = slot.fed_prompt < prompt_len
            if was_prefilling:
                slot.fed_prompt += n
            if slot.fed_prompt >= prompt_len:  # the last fed position predicts a token
                slot.generated.append(int(np.argmax(logits[i, n - 1])))
            if len(slot.generated) == slot.request.max_new_tokens:
                self._retire(i)
        self.iteration += 1

    def _retire(self, i):
        slot = self.slots[i]
        self.free.extend(slot.pages[::-1])
        self.reserved -= slot.reserved
        rid = slot.request.rid
        self.finished[rid] = Finished(np.asarray(slot.generated, np.int32),
                                      np.concatenate(slot.logits),
                                      slot.admitted, self.iteration)
        self.slots[i] = None
        self.events.append((self.iteration, f"finish request {rid}: {len(slot.generated)} "
                            f"tokens, its {len(slot.pages)} pages back to the free list"))

    def run(self, max_iterations: int = 100000) -> dict:
        while (self.waiting or any(s is not None for s in self.slots)) and \
                self.iteration < max_iterations:
            self.step()
        return self.finished


# ---------------------------------------------------------------------------
# the demo

def demo(*, requests: int = 8, max_batch: int = 4, page_size: int = 16, seed: int = 0,
         small: bool = False, implementation: Optional[str] = None, out=print):
    """Random prompts arriving over time; prints the events and the throughput, and checks
    every request's logits against a full causal recompute of its own tokens. Returns
    (server, that largest difference)."""
    cfg = (gpt.GPTConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=64)
           if small else gpt.GPTConfig())
    model = gpt.GPT(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    num_pages = max_batch * -(-cfg.max_len // page_size) // 2 + 2  # fewer than all slots
    server = Server(model, max_batch=max_batch, num_pages=num_pages, page_size=page_size,
                    implementation=implementation)
    for i in range(requests):
        prompt_len = int(rng.integers(1, cfg.max_len // 3))
        new = int(rng.integers(1, cfg.max_len // 4))
        server.submit(rng.integers(0, cfg.vocab, prompt_len), new, arrival=int(i * 2))
    start = time.perf_counter()
    results = server.run()
    seconds = time.perf_counter() - start
    for iteration, text in server.events:
        out(f"[iteration {iteration:3d}] {text}")
    generated = sum(r.tokens.size for r in results.values())
    out(f"{len(results)} requests, {generated} tokens generated in {server.iteration} "
        f"iterations ({server.steps_run['prefill']} with prefill chunks, "
        f"{server.steps_run['decode']} decode-only) in {seconds:.2f} s on "
        f"{jax.devices()[0].platform}; pool {num_pages} pages of {page_size} "
        f"(max batch {max_batch})")
    worst = max_recompute_error(model, server)
    out(f"max |logits - full recompute| over every request: {worst:.2e}")
    return server, worst


def max_recompute_error(model: gpt.GPT, server: Server) -> float:
    """The largest difference between a request's served logits and the model's causal
    pass over the same tokens (prompt + generated, without a cache)."""
    full = nnx.jit(lambda m, x: m(x))
    worst = 0.0
    for request in server.requests.values():
        result = server.finished[request.rid]
        seq = np.concatenate([request.prompt, result.tokens[:-1]])[None]
        want = np.asarray(full(model, jnp.asarray(seq)), np.float32)[0]
        worst = max(worst, float(np.max(np.abs(result.logits - want))))
    return worst


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="continuous batching on a paged KV cache")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--small", action="store_true")
    p.add_argument("--implementation", default=None)
    args = p.parse_args(argv)
    demo(requests=args.requests, max_batch=args.max_batch, page_size=args.page_size,
         small=args.small, implementation=args.implementation)


if __name__ == "__main__":
    main()
