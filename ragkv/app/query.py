"""A RAG question as a scheduler request: prepare = retrieve, load, fuse; then decode.

The API's /v1/query and `ragkv ask` both build their request here; `ask` runs it on a
scheduler of its own, alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ragkv.app.rag import Citation, QueryConfig, RagPipeline
from ragkv.app.request import Completion, Prepared, Request, RequestSink
from ragkv.app.scheduler import Scheduler
from ragkv.app.usage import Usage
from ragkv.engine import Engine
from ragkv.ingest.errors import InputError
from ragkv.sparse.wiring import sparse_attention

CHUNK_TOKENS_ESTIMATE = 512
"""KV rows one retrieved chunk is assumed to take when a request is admitted."""


def check_input_tokens(engine: Engine, text: str, limit: int | None, what: str) -> int:
    count = len(engine.tokenize(text))
    if limit is not None and count > limit:
        raise InputError("too_many_tokens", f"{what} is {count} tokens; the limit is {limit}")
    return count


def check_sparse(engine: Engine, config: QueryConfig) -> None:
    if config.sparse is not None and config.sparse.options.needs_codebook and engine.codebook is None:
        raise InputError("no_codebook", f"the {config.sparse.name} selector needs an A2ATS codebook for this model, "
                         "and there is none (run `ragkv calibrate`); choose another selector")


def query_request(rag: RagPipeline, question: str, tenant: str, config: QueryConfig, sink: RequestSink | None = None, *,
                  max_input_tokens: int | None = None, arrival: float | None = None,
                  on_finished: Callable[[Request, Completion], None] | None = None) -> Request:
    engine = rag.engine
    question_tokens = check_input_tokens(engine, question, max_input_tokens, "the question")
    check_sparse(engine, config)

    def prepare(request: Request) -> Prepared:
        prepared = rag.prepare(question, tenant, config)
        fusion = prepared.fusion
        request.timings.retrieve = prepared.timings["retrieve"]
        request.timings.load = prepared.timings["load"]
        request.timings.fuse = prepared.timings["fuse"]
        attention = sparse_attention(engine, config.sparse, fusion, prepared.chunk_codes)
        usage = Usage.of_fusion(fusion, recomputed_chunks=prepared.recomputed_chunks)
        return Prepared(fusion.cache, fusion.logits, usage, prepared.strategy, prepared.citations, attention,
                        {"chunk_hashes": prepared.chunk_hashes, "missing_chunks": len(prepared.recomputed_chunks)})

    estimate = len(engine.chunk_prefix_ids) + question_tokens + config.top_k * CHUNK_TOKENS_ESTIMATE
    return Request("query", prepare, config.generation, sink, estimated_tokens=estimate, arrival=arrival,
                   on_finished=on_finished)


class CollectingSink:
    """A sink that keeps the completion (for callers that run a scheduler themselves)."""

    cancelled = False

    def __init__(self):
        self.completion: Completion | None = None
        self.error: BaseException | None = None

    def started(self, info: dict) -> None:
        pass

    def token(self, text: str) -> None:
        pass

    def finished(self, completion: Completion) -> None:
        self.completion = completion

    def failed(self, error: BaseException) -> None:
        self.error = error


@dataclass
class Answer:
    text: str
    finish_reason: str
    citations: list[Citation]
    usage: Usage
    timings: dict[str, float]
    strategy: str

    def to_dict(self) -> dict:
        """The fields and names of the API's /v1/query answer."""
        return {"object": "query", "answer": self.text, "finish_reason": self.finish_reason, "strategy": self.strategy,
                "citations": [citation.to_dict() for citation in self.citations], "usage": self.usage.to_dict(),
                "timings": self.timings}


def ask(rag: RagPipeline, question: str, tenant: str = "default", config: QueryConfig = QueryConfig()) -> Answer:
    """Answer one question through the same scheduler path the server uses."""
    engine = rag.engine
    sink = CollectingSink()
    scheduler = Scheduler(engine.model, engine.tokenizer, engine.eos_token_ids)
    scheduler.add(query_request(rag, question, tenant, config, sink))
    scheduler.run_until_done()
    if sink.error is not None:
        raise sink.error
    done = sink.completion
    return Answer(done.text, done.finish_reason, done.citations, done.usage, done.timings.to_dict(), done.strategy)
