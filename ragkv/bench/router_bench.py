"""Which router in front of two replicas: the same conversations through each.

    python -m ragkv.bench.router_bench --router "sglang:/venv/bin/sglang-router" \
        --router "vllm:/venv/bin/vllm-router" [--conversations 4] [--json out.json]

Two `ragkv serve` replicas over one redis-server (as ragkv.bench.replicas), and, one after
the other, each router (`name:binary`, the PyPI packages sglang-router and vllm-router
install one each) in front of them with --policy round_robin and --policy cache_aware.
Through each: N conversations of two turns, as an OpenAI client sends them (no session id,
the whole history resent), each with a system prompt of its own (~1.5K tokens). Reported
per router and policy: follow-up TTFT (client), its cached share, and how many follow-ups
another replica served (they fetch the context from Redis: ragkv_shared_context_hits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from ragkv.bench.redis_process import RedisServer
from ragkv.bench.replica_followup_bench import shared_context_hits
from ragkv.bench.replicas import replica, start_all
from ragkv.bench.router_chats_bench import Turn, stream_turn
from ragkv.bench.router_process import RouterDidNotStart, RouterProcess

_TOPICS = ["ferries", "lighthouses", "orchards", "observatories", "mills", "bridges", "libraries", "cranes"]


def _turn(url: str, messages: list[dict]) -> dict:
    turn = Turn(0, 0)
    text = stream_turn(url, messages, 8, turn)
    if turn.error is not None:
        raise RuntimeError(f"chat completion failed: {turn.error}")
    return {"ttft_s": turn.ttft_s, "text": text, "prompt": turn.prompt_tokens, "cached": turn.cached_tokens}


def _through(router: str, binary: str, policy: str, workers: list[str], conversations: int, round_: int) -> dict:
    try:
        with RouterProcess(binary, policy, workers) as front:
            return _conversations(front.url, router, policy, workers, conversations, round_)
    except RouterDidNotStart:
        return {"error": "the router did not answer /health"}


def _conversations(url: str, router: str, policy: str, workers: list[str], conversations: int, round_: int) -> dict:
    hits_before = shared_context_hits(workers)
    follow_ups = []
    for n in range(conversations):
        topic = _TOPICS[n % len(_TOPICS)]
        system = f"[{router} {policy} {round_}.{n}] You answer questions about {topic}. " * 120
        history = [{"role": "system", "content": system}, {"role": "user", "content": f"Name one of the {topic}."}]
        first = _turn(url, history)
        history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Why that one?"}]
        follow_ups.append(_turn(url, history))
    return {
        "follow_up_ttft_s_median": round(statistics.median(t["ttft_s"] for t in follow_ups), 3),
        "follow_up_cached_share": round(sum(t["cached"] for t in follow_ups) / sum(t["prompt"] for t in follow_ups), 4),
        "follow_ups_on_the_other_replica": int(shared_context_hits(workers) - hits_before),
        "conversations": conversations,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", action="append", required=True, help="name:binary")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    redis = RedisServer()
    redis.start()
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-router-bench-")
    servers = [replica(Path(scratch.name), name, redis.url) for name in ("a", "b")]
    results = {}
    try:
        start_all(servers)
        workers = [server.url for server in servers]
        for round_, spec in enumerate(args.router):
            name, binary = spec.split(":", 1)
            for policy in ("round_robin", "cache_aware"):
                results[f"{name} {policy}"] = result = _through(
                    name, binary, policy, workers, args.conversations, round_
                )
                print(name, policy, json.dumps(result), flush=True)
    finally:
        for server in servers:
            server.stop()
        redis.cleanup()
        scratch.cleanup()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
