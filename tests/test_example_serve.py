"""The continuous-batching example (jax_sdpa.examples.serve): every request's served logits
equal a full causal pass of the model over the same tokens; pages return to the free list;
the CLI command runs it."""

import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from jax_sdpa import cli  # noqa: E402
from jax_sdpa.examples import gpt, serve  # noqa: E402

CFG = gpt.GPTConfig(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_len=48)


@pytest.mark.parametrize("page_size", [8, 16])
def test_served_logits_equal_a_recompute_and_pages_come_back(page_size):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    model = gpt.GPT(CFG, rngs=nnx.Rngs(seed))
    server = serve.Server(model, max_batch=3, num_pages=9, page_size=page_size,
                          prefill_chunk=5)
    # more requests than slots: the first three fill every slot for at least 11 steps, the
    # other three arrive while they run, so some must wait
    for i in range(6):
        server.submit(rng.integers(0, CFG.vocab, int(rng.integers(1, 20))),
                      11 if i < 3 else int(rng.integers(1, 12)), arrival=max(0, i - 2))
    results = server.run()
    assert sorted(results) == list(range(6))
    for rid, request in server.requests.items():
        assert results[rid].tokens.shape == (request.max_new_tokens,)
        assert results[rid].logits.shape[0] == request.prompt.size + request.max_new_tokens - 1
    assert serve.max_recompute_error(model, server) < 1e-4, f"seed {seed}"
    assert sorted(server.free) == list(range(9)) and server.reserved == 0
    assert server.steps_run["prefill"] > 0 and server.steps_run["decode"] > 0
    waits = [results[r].admitted - server.requests[r].arrival for r in results]
    assert max(waits) > 0


def test_submit_checks():
    server = serve.Server(gpt.GPT(CFG, rngs=nnx.Rngs(0)), max_batch=2, num_pages=4,
                          page_size=8)
    with pytest.raises(ValueError, match="max_len"):
        server.submit(np.zeros(40, np.int32), 20)
    with pytest.raises(ValueError, match="pages"):
        server.submit(np.zeros(30, np.int32), 10)
    with pytest.raises(ValueError, match="non-empty"):
        server.submit(np.zeros(0, np.int32), 3)


def test_cli_serve_demo(capsys):
    assert cli.main(["serve-demo", "--small", "--requests", "3", "--max-batch", "2",
                     "--page-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "admit request 2" in out and "finish request 2" in out
    assert "max |logits - full recompute|" in out
