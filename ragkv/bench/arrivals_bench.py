"""Running answers while long prompts arrive: `ragkv bench arrivals`.

`clients` clients stream short RAG answers back to back; in a second phase of the same
length, a new pasted prompt of `arrival_passages` passages (~6K tokens, never seen: a cold
prefill and store writes) arrives every `interval_s` as well. The chunk store is a real
redis-server behind a proxy that delays every reply by `redis_latency_ms` (a Redis tier
across a network). What counts is what the running clients see: the inter-token latency
(gaps between streamed tokens) p50/p99 with and without arrivals, and their requests/s;
beside them, the arrivals' time to first token.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx
import numpy as np

from ragkv.bench.datasets import Example, load_examples
from ragkv.bench.prompt_shapes import SHAPES, Passage


@dataclass(frozen=True)
class ArrivalsConfig:
    dataset: Path
    clients: int = 8
    interval_s: float = 4.0
    phase_s: float = 60.0
    max_tokens: int = 64
    """Tokens each running client's answer streams."""
    arrival_passages: int = 10
    arrival_max_tokens: int = 8
    redis_latency_ms: float = 5.0
    serve_options: tuple[str, ...] = ()
    """`ragkv serve` options (e.g. a prefill token budget)."""

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError(f"clients must be >= 1, got {self.clients}")
        if not self.interval_s > 0 or not self.phase_s > 0:
            raise ValueError("interval_s and phase_s must be > 0")
        if self.max_tokens < 2 or self.arrival_max_tokens < 1:
            raise ValueError("max_tokens must be >= 2 (an inter-token gap needs two tokens), arrival_max_tokens >= 1")
        if self.redis_latency_ms < 0:
            raise ValueError(f"redis_latency_ms must be >= 0, got {self.redis_latency_ms}")


@dataclass
class Stream:
    """One streamed answer as the client saw it."""

    ttft_s: float
    gaps_s: list[float]
    ok: bool = True


@dataclass
class Phase:
    name: str
    wall_s: float
    requests: int
    errors: int
    requests_per_s: float
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    ttft_p50_s: float | None
    arrivals: int = 0
    arrival_errors: int = 0
    arrival_ttft_p50_s: float | None = None
    arrival_ttft_max_s: float | None = None


@dataclass
class ArrivalsResult:
    config: dict
    phases: list[Phase] = field(default_factory=list)

    def to_json(self) -> dict:
        steady, loaded = (self.phases + [None, None])[:2]
        ratio = None
        if steady and loaded and steady.itl_p99_ms and loaded.itl_p99_ms:
            ratio = round(loaded.itl_p99_ms / steady.itl_p99_ms, 3)
        rps = None
        if steady and loaded and steady.requests_per_s:
            rps = round(loaded.requests_per_s / steady.requests_per_s, 3)
        return {
            "config": self.config,
            "phases": [asdict(phase) for phase in self.phases],
            "itl_p99_ratio": ratio,
            "requests_per_s_ratio": rps,
        }


def _percentile(values: list[float], q: float, scale: float = 1.0, digits: int = 3) -> float | None:
    return round(float(np.percentile(values, q)) * scale, digits) if values else None


def _body(messages: list[dict], max_tokens: int) -> dict:
    return {"model": "ragkv", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}


def _messages(example: Example, passages: int) -> list[dict]:
    chosen = [Passage(text.strip(), f"passage {i}", i) for i, text in enumerate(example.passages[:passages])]
    return SHAPES["blank_lines"].messages(chosen, example.question)


async def _stream(http: httpx.AsyncClient, body: dict) -> Stream:
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Stream(0.0, [], ok=False)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    except httpx.TransportError:
        return Stream(0.0, [], ok=False)
    if not stamps:
        return Stream(0.0, [], ok=False)
    return Stream(stamps[0] - started, [b - a for a, b in zip(stamps, stamps[1:])])


async def _phase(url: str, config: ArrivalsConfig, running: list[dict], arrivals: list[dict] | None) -> Phase:
    limits = httpx.Limits(max_connections=config.clients + 4, max_keepalive_connections=0)
    streams: list[Stream] = []
    arrived: list[Stream] = []
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        deadline = time.perf_counter() + config.phase_s

        async def client(number: int) -> None:
            index = number
            while time.perf_counter() < deadline:
                streams.append(await _stream(http, running[index % len(running)]))
                index += config.clients

        async def arrive() -> None:
            pending = []
            for body in arrivals or []:
                if time.perf_counter() >= deadline:
                    break
                pending.append(asyncio.ensure_future(_stream(http, body)))
                await asyncio.sleep(config.interval_s)
            arrived.extend(await asyncio.gather(*pending))

        started = time.perf_counter()
        await asyncio.gather(arrive(), *(client(n) for n in range(config.clients)))
        wall = time.perf_counter() - started
    done = [s for s in streams if s.ok]
    gaps = [gap for s in done for gap in s.gaps_s]
    ttfts = [s.ttft_s for s in arrived if s.ok]
    return Phase(
        name="arrivals" if arrivals else "steady",
        wall_s=round(wall, 2),
        requests=len(done),
        errors=len(streams) - len(done),
        requests_per_s=round(len(done) / wall, 4),
        itl_p50_ms=_percentile(gaps, 50, 1000, 1),
        itl_p99_ms=_percentile(gaps, 99, 1000, 1),
        ttft_p50_s=_percentile([s.ttft_s for s in done], 50),
        arrivals=len(arrived),
        arrival_errors=sum(not s.ok for s in arrived),
        arrival_ttft_p50_s=_percentile(ttfts, 50),
        arrival_ttft_max_s=round(max(ttfts), 3) if ttfts else None,
    )


def run_arrivals(config: ArrivalsConfig, progress: Callable[[str], None]) -> ArrivalsResult:
    from ragkv.api.launcher import ServerProcess
    from ragkv.bench.latency_proxy import LatencyProxy
    from ragkv.bench.redis_process import RedisServer

    examples = load_examples(config.dataset)
    if len(examples) < 2:
        raise ValueError(f"{config.dataset} holds {len(examples)} examples; the benchmark needs at least 2")
    # the running clients: one passage and a question each, answered at length, from the first
    # half of the set; the arrivals' passages from the other half, so each arrives cold
    half = len(examples) // 2
    running = [_body(_messages(example, 1), config.max_tokens) for example in examples[:half]]
    arrivals = [_body(_messages(e, config.arrival_passages), config.arrival_max_tokens) for e in examples[half:]]
    result = ArrivalsResult(config={**asdict(config), "dataset": str(config.dataset)})
    redis = RedisServer()
    redis.start()
    proxy = LatencyProxy(redis.port, config.redis_latency_ms / 1000).start()
    scratch = tempfile.TemporaryDirectory(prefix="ragkv-arrivals-")
    options = ["--data-dir", scratch.name, "--store", proxy.url, "--max-queued", "256", *config.serve_options]
    server = ServerProcess(options, log_path=Path(scratch.name) / "serve.log")
    try:
        progress(f"starting ragkv serve over redis (+{config.redis_latency_ms} ms per reply) ...")
        server.start(timeout_s=900)
        asyncio.run(_phase(server.url, replace(config, phase_s=1.0, clients=1), running[-1:], None))  # warm-up
        for name, arriving in (("steady", None), ("arrivals", arrivals)):
            progress(f"{name}: {config.clients} clients for {config.phase_s:.0f} s ...")
            phase = asyncio.run(_phase(server.url, config, running, arriving))
            progress(json.dumps(asdict(phase)))
            result.phases.append(phase)
    finally:
        server.stop()
        proxy.stop()
        redis.cleanup()
        scratch.cleanup()
    return result
