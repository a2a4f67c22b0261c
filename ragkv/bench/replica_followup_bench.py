"""`ragkv serve followup --replicas`: a follow-up resent whole to the other replica.

Two `ragkv serve` processes share one redis-server (chunk tier, registry and sessions, as
replicas on two hosts would), the way an OpenAI client behind a round-robin load balancer
meets them: no session id, the whole history every turn. Over one MuSiQue sample's passages
as a document (~6K tokens):
  turn 1  [user q1] on replica A, which then publishes its context to Redis;
  turn 2  [user q1, assistant a1, user q2] on B: the follow-up on the other replica;
  turn 2' the same history on A: the same-replica follow-up, the reference (A's own context
          covers all but the new message, so A does not fetch B's).
Reported: client TTFT, prompt and cached tokens of each turn, and B's shared-context hits.
"""

from __future__ import annotations

import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ragkv.bench.followup_bench import FOLLOW_UP, _ingest, _openai_turn, _samples
from ragkv.bench.replicas import replica, start_all


def metric_value(http: httpx.Client, name: str) -> float | None:
    """A sample's value on the server's /metrics, or None when it is not exported."""
    found = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else None


def _counter(http: httpx.Client, name: str) -> float:
    return metric_value(http, name) or 0.0


def run_replica_followup(dataset: Path, max_tokens: int, progress: Callable[[str], None] = print) -> dict:
    import openai

    from ragkv.bench.redis_process import RedisServer

    redis = RedisServer()
    redis.start()
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-replica-followup-")
    servers = {}
    try:
        servers = {name: replica(Path(scratch.name), name, redis.url) for name in ("a", "b")}
        start_all(list(servers.values()))
        a, b = servers["a"].url, servers["b"].url
        progress(f"replicas a {a} and b {b} over redis {redis.url}")
        text, question = _samples(dataset, 1)[0]
        with httpx.Client(base_url=a, timeout=600) as http:
            doc_id, chunks = _ingest(http, text, "musique-0.txt")
        rag = {"document_ids": [doc_id], "top_k": chunks}
        client_a = openai.OpenAI(base_url=a + "/v1", api_key="unused", max_retries=0, timeout=600)
        client_b = openai.OpenAI(base_url=b + "/v1", api_key="unused", max_retries=0, timeout=600)
        first = _openai_turn(client_a, [{"role": "user", "content": question}], rag, max_tokens)
        history = [
            {"role": "user", "content": question},
            {"role": "assistant", "content": first["answer"]},
            {"role": "user", "content": FOLLOW_UP},
        ]
        with httpx.Client(base_url=a, timeout=60) as http:  # A publishes after the turn, off its path
            deadline = time.monotonic() + 60
            while _counter(http, "ragkv_shared_context_published_total") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            published = _counter(http, "ragkv_shared_context_published_total")
        other = _openai_turn(client_b, history, rag, max_tokens)
        same = _openai_turn(client_a, history, rag, max_tokens)
        with httpx.Client(base_url=b, timeout=60) as http:
            hits = _counter(http, "ragkv_shared_context_hits_total")
        progress(
            f"turn 1 on A {first['client_ttft_s']} s; turn 2 on B {other['client_ttft_s']} s "
            f"({other['cached_tokens']}/{other['prompt_tokens']} cached); on A {same['client_ttft_s']} s "
            f"({same['cached_tokens']}/{same['prompt_tokens']} cached)"
        )
    finally:
        for server in servers.values():
            server.stop()
        redis.cleanup()
        scratch.cleanup()
    for turn in (same, other):
        turn["cached_fraction"] = round(turn["cached_tokens"] / turn["prompt_tokens"], 4)
    return {
        "max_tokens": max_tokens,
        "turn_1_on_a": first,
        "turn_2_on_a": same,
        "turn_2_on_b": other,
        "published_by_a": published,
        "shared_context_hits_on_b": hits,
    }
