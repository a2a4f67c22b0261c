"""RagkvConnector inside a real vLLM server (vLLM's CPU build, a tiny random Llama).

One server with the connector over a fresh LMDB store; vLLM's prefix cache is reset before
every request, so each answer is either vLLM's own computation or the connector's rows:

- a prompt vLLM computed, sent again, loads vLLM's own stored rows: the same greedy answer
  token for token;
- the same passages in another order, fused by the connector with strategy `full` (every
  row recomputed on ragkv's engine, written into vLLM's paged cache), answers as vLLM's
  full prefill of that prompt does (`kv_transfer_params: {"ragkv": "off"}` asks vLLM
  alone); with the default strategy the stored spans are placed and the probe's rows
  recomputed (the fidelity of that on a real model is `ragkv bench vllm-connector`'s).

Skipped when no vLLM environment is found (RAGKV_VLLM_PYTHON, default
~/.cache/ragkv-vllm-peer/venv/bin/python, made by ../shared/tools/vllm-peer-setup.sh).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import httpx
import pytest
from tiny_models import make_tiny_model

from ragkv.bench.vllm_connector_bench import complete, first_token_kl, prompt_ids
from ragkv.bench.vllm_server import DEFAULT_PYTHON, VllmServer, vllm_available

pytestmark = pytest.mark.slow

PYTHON = Path(os.environ.get("RAGKV_VLLM_PYTHON", DEFAULT_PYTHON))
WORDS = "river stone garden lantern copper violet harbor meadow signal orchard thunder canvas".split()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    reason = vllm_available(PYTHON)
    if reason is not None:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm-connector")
    # head_dim 32: the smallest the CPU attention backend takes
    (root / "model").mkdir()
    model = make_tiny_model("llama-sparse", root / "model", tokenizer=True, head_dim=32)
    # float32 recompute (on bf16 CPUs "auto" would pick bfloat16): the `full` strategy is then
    # vLLM's own prefill up to kernel rounding, which the reordered-passage check relies on
    connector = {
        "store_url": f"lmdb://{root / 'store'}",
        "min_prefix_tokens": 16,
        "engine": {"prefill_weights": "float32", "kv_cache_dtype": "float32"},
    }
    with VllmServer(
        PYTHON, model, root / "vllm.log", connector=connector, max_model_len=2048, extra_args=("--enforce-eager",)
    ) as running:
        running.tokenizer_dir = model
        yield running


def _passages(count: int) -> list[str]:
    return [
        f"Note {i}: " + " ".join(f"{WORDS[(i * 7 + j) % len(WORDS)]} {i}{j}" for j in range(40)) + "."
        for i in range(count)
    ]


def _external_hits(server: VllmServer) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _ask(server: VllmServer, ids: list[int], **kv_transfer_params) -> dict:
    """A greedy answer (8 tokens, top-5 logprobs) with vLLM's prefix cache emptied first."""
    server.reset_prefix_cache()
    return complete(server.url, ids, 8, 5, kv_transfer_params)


def test_repeated_prompt_and_reordered_passages(server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.tokenizer_dir)
    passages = _passages(4)
    seen = prompt_ids(tokenizer, passages, "Which note holds copper 12?")
    shuffled = prompt_ids(tokenizer, [passages[i] for i in (2, 0, 3, 1)], "Which note holds copper 12?")
    assert len(seen) > 300

    hits = _external_hits(server)
    computed = _ask(server, seen)  # vLLM computes it; the connector stores its spans and rows
    assert _external_hits(server) == hits

    repeated = _ask(server, seen)  # the connector provides every row but the last
    assert _external_hits(server) == hits + len(seen) - 1
    assert repeated["tokens"] == computed["tokens"]
    for token, logprob in computed["first"].items():
        assert repeated["first"][token] == pytest.approx(logprob, abs=1e-4)

    reference = _ask(server, shuffled, ragkv="off")  # vLLM alone
    fused_full = _ask(server, shuffled, ragkv_strategy="full")
    assert _external_hits(server) == hits + 2 * (len(seen) - 1)
    assert fused_full["tokens"] == reference["tokens"]
    for token, logprob in reference["first"].items():
        assert fused_full["first"][token] == pytest.approx(logprob, abs=2e-3)

    fused = _ask(server, shuffled)  # the default strategy: stored spans placed, the probe's rows recomputed
    assert _external_hits(server) == hits + 3 * (len(seen) - 1)
    kl, _ = first_token_kl(reference["first"], fused["first"])
    assert math.isfinite(kl) and len(fused["tokens"]) == 8
    log = server.log_text()
    assert re.search(r"fuse wrote rows \[0, \d+\) .*'strategy': 'full', 'hits': 4, 'misses': 0", log)
    assert re.search(r"fuse wrote rows \[0, \d+\) .*'strategy': 'probe', 'hits': 4, 'misses': 0", log)
    assert f"saved {{'prefix': {len(seen) - 1}, 'spans': 4}}" in log
