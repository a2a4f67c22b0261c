"""`ragkv serve followup --replicas --router BIN`: many clients' multi-turn chats before two replicas.

Two `ragkv serve` replicas over one redis-server (as ragkv.bench.replicas), and `clients`
OpenAI-style clients at once, each holding one chat of `turns` turns: a system message with
`passages` passages of a dataset sample pasted in, the sample's question, then follow-ups,
the whole history resent every turn (no session id, as LangChain or Open WebUI send it).
The same workload runs through three front doors, one after the other, each with chats of
its own (no front finds another's contexts), `rounds` times, every other round in reverse
order so that a drift in the machine's load does not favour one front:
  pinned       client i talks to replica i mod 2 directly: every follow-up on the replica
               that holds its context (the same-replica reference);
  round_robin  vllm-router --policy round_robin: follow-ups alternate replicas, so about
               half fetch their context from Redis;
  cache_aware  vllm-router --policy cache_aware: the router's prefix tree sends a
               follow-up where its earlier turns went.
Reported per front: follow-up TTFT p50/p90 (client-side, from the request to the first
content token), turn-1 TTFT p50, the follow-ups' cached share, how many follow-ups took their
context from Redis (ragkv_shared_context_hits_total: a replica that does not hold it),
requests and computed prompt tokens per replica, errors, and the follow-up p50 over the
pinned front's: the routing's cost.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ragkv.bench.redis_process import RedisServer
from ragkv.bench.replica_followup_bench import shared_context_hits
from ragkv.bench.replicas import replica, start_all
from ragkv.bench.router_process import RouterProcess

FRONTS = ("pinned", "round_robin", "cache_aware")
FOLLOW_UPS = (
    "Can you say that in one short sentence?",
    "Which of the passages says so?",
    "What else do the passages say about it?",
    "Are you sure? Answer again in a few words.",
)
SYSTEM = "Answer the user's questions from these passages only.\n\n"


@dataclass(frozen=True)
class RouterChatsConfig:
    dataset: Path
    router: str
    """The vllm-router binary (ragkv.bench.router_process.find_router)."""
    clients: int = 8
    turns: int = 3
    passages: int = 3
    """Passages of a sample pasted into each chat's system message."""
    max_tokens: int = 16
    rounds: int = 1

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not 2 <= self.turns <= 1 + len(FOLLOW_UPS):
            raise ValueError(f"turns must be in [2, {1 + len(FOLLOW_UPS)}], got {self.turns}")
        if self.passages < 1:
            raise ValueError(f"passages must be >= 1, got {self.passages}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class Chat:
    system: str
    questions: tuple[str, ...]


@dataclass
class Turn:
    client: int
    turn: int
    ttft_s: float | None = None
    total_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class FrontResult:
    front: str
    turns: list[Turn] = field(default_factory=list)
    context_fetches: int = 0
    wall_s: float = 0.0
    requests_per_replica: list[int] = field(default_factory=list)
    computed_tokens_per_replica: list[int] = field(default_factory=list)
    """Prompt tokens each replica computed (not found cached): how the front spread the
    heavy work, the first turns' prefills."""

    @classmethod
    def pooled(cls, front: str, results: list[FrontResult]) -> FrontResult:
        """One result over several rounds of the same front (wall time summed)."""
        pooled = cls(front, wall_s=sum(result.wall_s for result in results))
        pooled.turns = [turn for result in results for turn in result.turns]
        pooled.context_fetches = sum(result.context_fetches for result in results)
        pooled.requests_per_replica = [sum(split) for split in zip(*(r.requests_per_replica for r in results))]
        pooled.computed_tokens_per_replica = [
            sum(split) for split in zip(*(r.computed_tokens_per_replica for r in results))
        ]
        return pooled

    def summary(self) -> dict:
        done = [turn for turn in self.turns if turn.error is None and turn.ttft_s is not None]
        follow = [turn for turn in done if turn.turn > 1]
        firsts = [turn.ttft_s for turn in done if turn.turn == 1]
        ttfts = sorted(turn.ttft_s for turn in follow)
        return {
            "follow_up_ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "follow_up_ttft_p90_s": round(ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))], 3) if ttfts else None,
            "turn_1_ttft_p50_s": round(statistics.median(firsts), 3) if firsts else None,
            "follow_up_cached_share": round(
                sum(turn.cached_tokens for turn in follow) / max(1, sum(turn.prompt_tokens for turn in follow)), 4
            ),
            "follow_ups": len(follow),
            "context_fetches": self.context_fetches,
            "requests_per_replica": self.requests_per_replica,
            "computed_tokens_per_replica": self.computed_tokens_per_replica,
            "errors": sum(turn.error is not None for turn in self.turns),
            "wall_s": round(self.wall_s, 2),
        }


def chats_for(dataset: Path, count: int, offset: int, config: RouterChatsConfig) -> list[Chat]:
    """`count` chats from samples offset.. of a MuSiQue-style JSON (ctxs, question)."""
    samples = json.loads(dataset.read_text())[offset : offset + count]
    if len(samples) < count:
        raise SystemExit(f"{dataset} has too few samples for {count} chats from sample {offset}")
    questions = FOLLOW_UPS[: config.turns - 1]
    return [
        Chat(
            SYSTEM + "\n\n".join(ctx["text"] for ctx in sample["ctxs"][: config.passages]),
            (sample["question"], *questions),
        )
        for sample in samples
    ]


def stream_turn(url: str, messages: list[dict], max_tokens: int, turn: Turn) -> str:
    """One streamed chat completion; fills `turn` and returns the answer's text."""
    body = {"model": "ragkv", "messages": messages, "max_tokens": max_tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started, text = time.perf_counter(), []
    with httpx.Client(timeout=900) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            turn.error = f"{response.status_code} {response.text[:200]}"
            return ""
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                turn.prompt_tokens = event["usage"]["prompt_tokens"]
                turn.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in event.get("choices") or []:
                content = choice.get("delta", {}).get("content")
                if content:
                    if turn.ttft_s is None:
                        turn.ttft_s = round(time.perf_counter() - started, 4)
                    text.append(content)
    turn.total_s = round(time.perf_counter() - started, 4)
    return "".join(text)


def _converse(url: str, client: int, chat: Chat, max_tokens: int, start: threading.Barrier) -> list[Turn]:
    messages = [{"role": "system", "content": chat.system}]
    turns = []
    start.wait()
    for number, question in enumerate(chat.questions, start=1):
        messages.append({"role": "user", "content": question})
        turn = Turn(client, number)
        turns.append(turn)
        try:
            answer = stream_turn(url, messages, max_tokens, turn)
        except httpx.HTTPError as error:
            turn.error = f"{type(error).__name__}: {error}"
        if turn.error is not None:
            break
        messages.append({"role": "assistant", "content": answer})
    return turns


def _served(url: str) -> tuple[int, int]:
    """(requests finished, prompt tokens computed) so far on a replica, from vLLM's counters
    (summed over their labels; computed = prefix-cache queries - hits)."""
    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        samples = re.findall(rf"^vllm:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
        return sum(float(value) for value in samples)

    return int(total("request_success_total")), int(
        total("prefix_cache_queries_total") - total("prefix_cache_hits_total")
    )


def run_front(front: str, urls: list[str], workers: list[str], chats: list[Chat], max_tokens: int) -> FrontResult:
    """Every chat at once, client i through urls[i mod len(urls)]."""
    result = FrontResult(front)
    hits_before, served_before = shared_context_hits(workers), [_served(url) for url in workers]
    start = threading.Barrier(len(chats))
    outcomes: list[list[Turn]] = [[] for _ in chats]

    def client(index: int) -> None:
        outcomes[index] = _converse(urls[index % len(urls)], index, chats[index], max_tokens, start)

    threads = [threading.Thread(target=client, args=(index,)) for index in range(len(chats))]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result.wall_s = time.perf_counter() - began
    result.turns = [turn for turns in outcomes for turn in turns]
    result.context_fetches = int(shared_context_hits(workers) - hits_before)
    served = [_served(url) for url in workers]
    result.requests_per_replica = [after[0] - before[0] for before, after in zip(served_before, served)]
    result.computed_tokens_per_replica = [after[1] - before[1] for before, after in zip(served_before, served)]
    return result


def run_router_chats(config: RouterChatsConfig, progress: Callable[[str], None] = print) -> dict:
    redis = RedisServer()
    redis.start()
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-router-chats-")
    root = Path(scratch.name)
    servers = []
    rounds: dict[str, list[FrontResult]] = {}
    try:
        servers = [replica(root, name, redis.url) for name in ("a", "b")]
        start_all(servers)
        workers = [server.url for server in servers]
        progress(f"replicas {workers} over redis {redis.url}")
        warm = chats_for(config.dataset, 1, 0, config)
        run_front("warm-up", workers, workers, warm * 2, config.max_tokens)
        for round_ in range(config.rounds):
            order = FRONTS if round_ % 2 == 0 else tuple(reversed(FRONTS))
            for front in order:
                offset = 1 + (round_ * len(FRONTS) + FRONTS.index(front)) * config.clients
                chats = chats_for(config.dataset, config.clients, offset, config)
                if front == "pinned":
                    result = run_front(front, workers, workers, chats, config.max_tokens)
                else:
                    log = root / f"router-{front}.log"
                    with RouterProcess(config.router, front, workers, log_path=log) as router:
                        result = run_front(front, [router.url], workers, chats, config.max_tokens)
                rounds.setdefault(front, []).append(result)
                progress(f"round {round_ + 1} {front}: {json.dumps(result.summary())}")
    finally:
        for server in servers:
            server.stop()
        redis.cleanup()
        scratch.cleanup()
    fronts = {front: FrontResult.pooled(front, results) for front, results in rounds.items()}
    summaries = {front: result.summary() for front, result in fronts.items()}
    pinned = summaries.get("pinned", {}).get("follow_up_ttft_p50_s")
    for summary in summaries.values():
        p50 = summary["follow_up_ttft_p50_s"]
        summary["follow_up_p50_over_pinned"] = round(p50 / pinned, 3) if pinned and p50 else None
    return {
        "config": {**asdict(config), "dataset": str(config.dataset)},
        "fronts": summaries,
        "rounds": {front: [result.summary() for result in results] for front, results in rounds.items()},
        "turns": {front: [asdict(turn) for turn in result.turns] for front, result in fronts.items()},
    }
