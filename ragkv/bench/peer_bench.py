"""`ragkv serve bench --target URL`: ragkv and another OpenAI-compatible server (llama.cpp's
`llama-server`, vLLM) on the same RAG workload, side by side.

The workload: dev questions with their passages. ragkv has the passages ingested (one
document each, chunk KV computed once) and answers each question over that example's
documents (`rag.document_ids`, every passage retrieved); the target gets the same passages
in the prompt, as a server without chunk caching must. Both through streamed
`/v1/chat/completions`, greedy, the same `max_tokens`, at each concurrency level. Measured
at the client for both: requests/s, TTFT p50/p99 (request sent -> first content chunk),
decode ms/token (first to last content chunk over the chunks between) and latency.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from ragkv.bench.datasets import load_examples

SYSTEM = "Answer the question using the documents given."


@dataclass(frozen=True)
class PeerBenchConfig:
    dataset: Path
    examples: int = 16
    """Examples in the workload; no prompt repeats while the levels' requests fit in it."""
    passages: int = 3
    clients: tuple[int, ...] = (1, 4, 8)
    requests: int | None = None
    """Requests per level; None: max(4, clients)."""
    max_tokens: int = 32
    shape: str | None = None
    """The pasted workload's prompt shape (ragkv.bench.prompt_shapes); None: the documents
    joined by blank lines in the user message (the figures before shapes)."""

    def __post_init__(self) -> None:
        if self.examples < 1 or self.passages < 1 or self.max_tokens < 2 or not self.clients:
            raise ValueError("examples and passages >= 1, max_tokens >= 2, and at least one client level")
        from ragkv.bench.prompt_shapes import SHAPES

        if self.shape is not None and self.shape not in SHAPES:
            raise ValueError(f"unknown prompt shape {self.shape!r}; known: {', '.join(SHAPES)}")


@dataclass(frozen=True)
class Work:
    question: str
    passages: list[str]
    document_ids: list[str]


def ingest_workload(http: httpx.Client, config: PeerBenchConfig, progress: Callable[[str], None]) -> list[Work]:
    """Every example's passages as ragkv documents (each passage one document)."""
    work = []
    for number, example in enumerate(load_examples(config.dataset, config.examples, config.passages)):
        ids = []
        for index, passage in enumerate(example.passages):
            body = {"text": passage.strip(), "name": f"peer-bench-{number}-{index}.txt", "background": False}
            response = http.post("/v1/documents", json=body)
            response.raise_for_status()
            ids.append(response.json()["document"]["id"])
        work.append(Work(example.question, [p.strip() for p in example.passages], ids))
    progress(f"ingested {sum(len(w.document_ids) for w in work)} passages of {len(work)} examples into ragkv")
    return work


def ragkv_body(work: Work, max_tokens: int) -> dict:
    return {
        "model": "ragkv",
        "messages": [{"role": "user", "content": work.question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "rag": {"document_ids": work.document_ids, "top_k": len(work.document_ids) * 2},
    }


def target_body(work: Work, model: str, max_tokens: int, shape: str | None = None) -> dict:
    return {
        "model": model,
        "messages": _messages(work, shape),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def _messages(work: Work, shape: str | None) -> list[dict]:
    if shape is not None:
        from ragkv.bench.prompt_shapes import SHAPES, Passage

        passages = [Passage(text, " ".join(text.split()[:4]), n) for n, text in enumerate(work.passages, 1)]
        return SHAPES[shape].messages(passages, work.question)
    documents = "\n\n".join(work.passages)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Documents:\n{documents}\n\nQuestion: {work.question}"},
    ]


async def _one(http: httpx.AsyncClient, body: dict) -> dict | None:
    """Client-side timings of one streamed chat completion; None on an error."""
    started = time.perf_counter()
    stamps = []
    usage = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter() - started)
    except httpx.TransportError:
        return None
    if not stamps:
        return None
    decode = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft": stamps[0],
        "latency": time.perf_counter() - started,
        "chunks": len(stamps),
        "decode": decode,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


async def _level(url: str, bodies: list[dict], clients: int, requests: int, headers: dict) -> dict:
    results: list[dict] = []
    errors = 0
    counter = iter(range(requests))
    # a connection per request: a server closing a kept-alive connection between two requests
    # (llama-server does) would otherwise fail the second
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=1800, limits=limits) as http:

        async def client_loop() -> None:
            nonlocal errors
            for index in counter:
                result = await _one(http, bodies[index % len(bodies)])
                if result is None:
                    errors += 1
                else:
                    results.append(result)

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(clients)))
        wall = time.perf_counter() - started
    ttfts = [r["ttft"] for r in results]
    decodes = [r["decode"] for r in results if r["decode"] is not None]
    reported = [r for r in results if r["prompt_tokens"] and r["cached_tokens"] is not None]
    cached = sum(r["cached_tokens"] for r in reported) / sum(r["prompt_tokens"] for r in reported) if reported else None
    return {
        "cached_share": round(cached, 4) if cached is not None else None,
        "clients": clients,
        "requests": requests,
        "errors": errors,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 4),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "decode_ms_per_token": round(statistics.median(decodes) * 1000, 2) if decodes else None,
        "latency_p50_s": _percentile([r["latency"] for r in results], 50),
    }


def target_model(url: str, headers: dict) -> str:
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        response = http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def run_peer_bench(
    ragkv_url: str,
    target_url: str,
    config: PeerBenchConfig,
    progress: Callable[[str], None],
    headers: dict | None = None,
    target_headers: dict | None = None,
) -> dict:
    headers, target_headers = headers or {}, target_headers or {}
    with httpx.Client(base_url=ragkv_url, headers=headers, timeout=1800) as http:
        work = ingest_workload(http, config, progress)
    model = target_model(target_url, target_headers)
    sides = {
        "ragkv": (ragkv_url, [ragkv_body(w, config.max_tokens) for w in work], headers),
        "target": (target_url, [target_body(w, model, config.max_tokens) for w in work], target_headers),
    }
    warm_up = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2, "stream": True}
    asyncio.run(_level(ragkv_url, [{**warm_up, "model": "ragkv", "rag": {"enabled": False}}], 1, 1, headers))
    asyncio.run(_level(target_url, [{**warm_up, "model": model}], 1, 1, target_headers))  # none of the prompts
    rows = []
    used = 0  # requests sent so far: each level starts past them, so no prompt repeats
    for clients in config.clients:
        requests = config.requests or max(4, clients)
        row = {"clients": clients}
        offset = used % len(work)
        used += requests
        if used > len(work):
            progress(f"note: {used} requests over {len(work)} examples: prompts repeat (raise --examples)")
        for name, (url, bodies, side_headers) in sides.items():
            rotated = bodies[offset:] + bodies[:offset]
            row[name] = asyncio.run(_level(url, rotated, clients, requests, side_headers))
            figures = row[name]
            progress(
                f"{clients} clients, {name}: {figures['requests_per_s']:.3f} req/s, TTFT p50 {figures['ttft_p50_s']} s "
                f"p99 {figures['ttft_p99_s']} s, decode {figures['decode_ms_per_token']} ms/token, "
                f"{figures['errors']} errors"
            )
        ours, theirs = row["ragkv"], row["target"]
        row["requests_per_s_ratio"] = (
            round(ours["requests_per_s"] / theirs["requests_per_s"], 2) if theirs["requests_per_s"] else None
        )
        if ours["ttft_p50_s"] and theirs["ttft_p50_s"]:
            row["ttft_p50_ratio"] = round(theirs["ttft_p50_s"] / ours["ttft_p50_s"], 2)
        rows.append(row)
    return {
        "ragkv": ragkv_url,
        "target": target_url,
        "target_model": model,
        "examples": len(work),
        "passages": config.passages,
        "max_tokens": config.max_tokens,
        "levels": rows,
    }
