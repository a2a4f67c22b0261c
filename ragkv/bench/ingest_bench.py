"""`ragkv bench ingest`: ingestion throughput on real text, beside a peer server's prompt
processing of the same text.

Each dev example's passages, joined, are one document (~6K tokens at 10 passages). ragkv
ingests them into a scratch data folder: tokenise, cut into 512-token chunks, encode each
chunk's KV after the RAG prefix, store, embed, register. Figures: encode tokens/s (tokens of
computed chunks per second of model time, what ingestion costs the model) and end-to-end
tokens/s (document tokens per second of the whole ingestion).

With a peer (llama.cpp's `llama-server` on the same GGUF and cores), the same documents are
sent to its native `/completion` with one token to predict and no prompt cache, and its own
`timings` give prompt tokens/s: what a server without chunk caching spends to read a
document once. The peer reads each document as one prompt (full attention over ~6K tokens);
ragkv encodes 512-token chunks, each after the short RAG prefix: each does the work its
design needs to make a document answerable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from ragkv.bench.datasets import load_examples


@dataclass(frozen=True)
class IngestBenchConfig:
    data: Path
    limit: int = 10
    passages: int = 10
    peer: str | None = None
    """Base URL of a llama-server (http://127.0.0.1:8080), or None."""
    peer_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.limit < 1 or self.passages < 1:
            raise ValueError("--limit and --passages must be >= 1")


@dataclass
class PeerFigures:
    url: str
    prompt_tokens: int
    prompt_seconds: float
    prompt_tokens_per_second: float
    per_document: list[float] = field(default_factory=list)
    """prompt tokens/s of each document, as the peer's timings report it."""


@dataclass
class IngestBenchResult:
    documents: int
    tokens: int
    stored_tokens: int
    chunks: int
    encode_seconds: float
    total_seconds: float
    encode_tokens_per_second: float
    end_to_end_tokens_per_second: float
    bytes_per_token: float
    peer: PeerFigures | None = None
    ratio_vs_peer: float | None = None
    """ragkv encode tokens/s over the peer's prompt tokens/s."""
    machine: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def documents(config: IngestBenchConfig) -> list[tuple[str, str]]:
    """(name, text) of each example's passages joined as one document."""
    examples = load_examples(config.data, config.limit, config.passages)
    return [(f"example-{number:03d}.txt", "".join(example.passages).strip()) for number, example in enumerate(examples)]


def run_ragkv(ingestor, docs: list[tuple[str, str]], progress: Callable[[str], None]) -> IngestBenchResult:
    tokens = stored = chunks = stored_bytes = 0
    encode = total = 0.0
    for name, text in docs:
        result = ingestor.ingest_text(text, name)
        tokens += result.tokens
        stored += result.stored_tokens
        chunks += result.chunks
        stored_bytes += result.stored_bytes
        encode += result.timings.get("precompute", 0.0)
        total += result.seconds
        progress(f"ragkv  {name}: {result.tokens} tokens, {result.encode_tokens_per_second:,.0f} tokens/s encoded")
    return IngestBenchResult(
        documents=len(docs),
        tokens=tokens,
        stored_tokens=stored,
        chunks=chunks,
        encode_seconds=round(encode, 3),
        total_seconds=round(total, 3),
        encode_tokens_per_second=round(stored / encode, 1) if encode else 0.0,
        end_to_end_tokens_per_second=round(tokens / total, 1) if total else 0.0,
        bytes_per_token=round(stored_bytes / stored, 1) if stored else 0.0,
    )


def run_peer(url: str, docs: list[tuple[str, str]], timeout_s: float, progress: Callable[[str], None]) -> PeerFigures:
    """Prompt processing of each document on a llama-server (its own timings)."""
    prompt_tokens, prompt_ms, rates = 0, 0.0, []
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as http:
        for name, text in docs:
            response = http.post("/completion", json={"prompt": text, "n_predict": 1, "cache_prompt": False})
            response.raise_for_status()
            timings = response.json().get("timings")
            if not timings or "prompt_n" not in timings:
                raise ValueError(f"{url} gave no llama.cpp timings: is it a llama-server?")
            prompt_tokens += int(timings["prompt_n"])
            prompt_ms += float(timings["prompt_ms"])
            rates.append(round(float(timings["prompt_per_second"]), 1))
            progress(f"peer   {name}: {timings['prompt_n']} tokens, {rates[-1]:,.0f} tokens/s")
    seconds = prompt_ms / 1000
    return PeerFigures(url, prompt_tokens, round(seconds, 3), round(prompt_tokens / seconds, 1), rates)


def run_ingest_bench(ingestor, config: IngestBenchConfig, progress: Callable[[str], None]) -> IngestBenchResult:
    docs = documents(config)
    result = run_ragkv(ingestor, docs, progress)
    if config.peer is not None:
        result.peer = run_peer(config.peer, docs, config.peer_timeout_s, progress)
        if result.peer.prompt_tokens_per_second:
            result.ratio_vs_peer = round(result.encode_tokens_per_second / result.peer.prompt_tokens_per_second, 3)
    return result
