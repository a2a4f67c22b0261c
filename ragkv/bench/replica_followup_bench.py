"""`ragkv serve followup --replicas`: a follow-up resent whole to the other replica.

Two `ragkv serve` processes share one redis-server (chunk tier, registry and sessions, as
replicas on two hosts would), the way an OpenAI client behind a round-robin load balancer
meets them: no session id, the whole history every turn. Over one MuSiQue sample's passages
as a document (~6K tokens):
  turn 1  [user q1] on replica A, whose answer ends once its context is in Redis;
  turn 2  [user q1, assistant a1, user q2] on B the moment turn 1 ends: the follow-up on the
          other replica;
  turn 2' the same history on A: the same-replica follow-up, the reference (A's own context
          covers all but the new message, so A does not fetch B's);
  turn 2" [user q2] alone on B, naming the id turn 1's answer gave (a second turn 1 on A
          first, so B holds nothing of it).
Reported: client TTFT, total time and the wait between the last token and the end of each
turn (what publishing costs turn 1), prompt and cached tokens, and B's shared-context
counters. `publish_wait_s` is passed to the replicas (0: the answer does not wait, as before).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import httpx

from ragkv.bench.followup_bench import FOLLOW_UP, _ingest, _openai_turn, _samples
from ragkv.bench.replicas import replica, start_all


def metric_value(http: httpx.Client, name: str) -> float | None:
    """A sample's value on the server's /metrics, or None when it is not exported."""
    found = re.search(rf"^{name} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else None


def shared_context_hits(urls: list[str]) -> float:
    """Follow-ups that took their context from Redis, summed over the replicas at `urls`."""
    total = 0.0
    for url in urls:
        with httpx.Client(base_url=url, timeout=30) as http:
            total += metric_value(http, "ragkv_shared_context_hits_total") or 0.0
    return total


def _counter(http: httpx.Client, name: str) -> float:
    return metric_value(http, name) or 0.0


def run_replica_followup(
    dataset: Path, max_tokens: int, progress: Callable[[str], None] = print, publish_wait_s: float | None = None
) -> dict:
    import openai

    from ragkv.bench.redis_process import RedisServer

    redis = RedisServer()
    redis.start()
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-replica-followup-")
    servers = {}
    try:
        extra = () if publish_wait_s is None else ("--shared-publish-wait-s", str(publish_wait_s))
        servers = {name: replica(Path(scratch.name), name, redis.url, extra) for name in ("a", "b")}
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
        other = _openai_turn(client_b, history, rag, max_tokens)  # at once: no wait for A's publisher
        same = _openai_turn(client_a, history, rag, max_tokens)
        again = _openai_turn(client_a, [{"role": "user", "content": question + " "}], rag, max_tokens)
        try:
            named = {**rag, "session_id": again["session_id"]}
            by_id = _openai_turn(client_b, [{"role": "user", "content": FOLLOW_UP}], named, max_tokens)
        except openai.NotFoundError as error:  # the id not (yet) known to B
            by_id = {"error": f"404 {error.code or 'session_not_found'}"}
        with httpx.Client(base_url=a, timeout=60) as http:
            published = _counter(http, "ragkv_shared_context_published_total")
            publish_seconds = _counter(http, "ragkv_shared_context_publish_seconds_total")
        with httpx.Client(base_url=b, timeout=60) as http:
            hits = _counter(http, "ragkv_shared_context_hits_total")
            loaded = _counter(http, "ragkv_shared_context_loaded_total")
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
    for turn in (same, other, by_id):
        if "error" in turn:
            continue
        turn["cached_fraction"] = round(turn["cached_tokens"] / turn["prompt_tokens"], 4)
    return {
        "max_tokens": max_tokens,
        "publish_wait_s": publish_wait_s,
        "turn_1_on_a": first,
        "turn_2_on_a": same,
        "turn_2_on_b": other,
        "turn_1_again_on_a": again,
        "turn_2_on_b_by_id": by_id,
        "published_by_a": published,
        "publish_seconds_on_a": round(publish_seconds, 4),
        "shared_context_hits_on_b": hits,
        "shared_context_loaded_on_b": loaded,
    }
