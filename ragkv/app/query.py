"""A RAG question as a scheduler request: fetch = retrieve, read the chunks' stored K/V
(no model); prepare = recompute what the store lacked, fuse; then decode.

The API's /v1/query and `ragkv ask` both build their request here, and both submit it
through the engine client (ragkv.app.server); `Answer` is what `ragkv ask` prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ragkv.app.limits import check_context_length
from ragkv.app.rag import Citation, QueryConfig, QueryInputs, RagPipeline
from ragkv.app.request import (
    Fetched,
    FinishReason,
    Prepared,
    Request,
    RequestInfo,
    RequestOutput,
    RequestSink,
    fused_prompt_ids,
)
from ragkv.app.usage import TokenUsage
from ragkv.engine import Engine
from ragkv.errors import InputError
from ragkv.sparse.codebook import A2ATSCodebook
from ragkv.sparse.wiring import sparse_attention

CHUNK_TOKENS_ESTIMATE = 512
"""KV rows one retrieved chunk is assumed to take when a request is admitted."""


@dataclass
class QueryInfo(RequestInfo):
    chunk_hashes: list[str] = field(default_factory=list)
    """Token hashes of the fused chunks, in prompt order."""
    missing_chunks: int = 0
    """Chunks the store could not give (computed for this request)."""


@dataclass
class QueryFetch(Fetched):
    inputs: QueryInputs | None = None


def check_input_tokens(engine: Engine, text: str, limit: int | None, what: str) -> int:
    count = len(engine.tokenize(text))
    if limit is not None and count > limit:
        raise InputError("too_many_tokens", f"{what} is {count} tokens; the limit is {limit} (--max-input-tokens)")
    return count


def check_sparse(codebook: A2ATSCodebook | None, config: QueryConfig) -> None:
    """A selector that needs the model's A2ATS codebook is refused when there is none."""
    if config.sparse is not None and config.sparse.options.needs_codebook and codebook is None:
        raise InputError(
            "no_codebook",
            f"the {config.sparse.name} selector needs an A2ATS codebook for this model, "
            "and there is none (run `ragkv calibrate`); choose another selector",
        )


def question_prompt_ids(
    rag: RagPipeline, question: str, config: QueryConfig, max_input_tokens: int | None
) -> list[int]:
    """The ids of a question's prompt, checked as `query_request` checks it, without the
    chunks retrieval puts between its prefix and its question segment."""
    engine = rag.engine
    check_input_tokens(engine, question, max_input_tokens, "the question")
    check_sparse(rag.calibrated.codebook, config)
    segments = engine.prompt.rag_segments(question)
    ids = segments.prefix_ids + segments.question_ids
    check_context_length(engine, len(ids), config.generation.max_new_tokens, "the prompt", "lower max_tokens")
    return ids


def query_request(
    rag: RagPipeline,
    question: str,
    tenant: str,
    config: QueryConfig,
    sink: RequestSink | None = None,
    *,
    max_input_tokens: int | None = None,
    arrival: float | None = None,
    on_finished: Callable[[Request, RequestOutput], None] | None = None,
) -> Request:
    engine = rag.engine
    question_tokens = check_input_tokens(engine, question, max_input_tokens, "the question")
    check_sparse(rag.calibrated.codebook, config)

    def fetch(request: Request) -> QueryFetch:
        inputs = rag.fetch(question, tenant, config)
        return QueryFetch(inputs.nbytes, inputs)

    def prepare(request: Request) -> Prepared:
        prepared = rag.compute(request.fetched.inputs, config)
        fusion = prepared.fusion
        request.timings.retrieve = prepared.timings["retrieve"]
        request.timings.load = prepared.timings["load"]
        request.timings.fuse = prepared.timings["fuse"]
        attention = sparse_attention(engine, rag.calibrated.codebook, config.sparse, fusion, prepared.chunk_codes)
        usage = TokenUsage.of_fusion(fusion, recomputed_chunks=prepared.recomputed_chunks)
        return Prepared(
            fusion.cache,
            fusion.logits,
            usage,
            prepared.strategy,
            prepared.citations,
            attention,
            QueryInfo(prepared.chunk_hashes, len(prepared.recomputed_chunks)),
            fused_prompt_ids(fusion),
        )

    estimate = len(engine.chunk_prefix_ids) + question_tokens + config.top_k * CHUNK_TOKENS_ESTIMATE
    return Request(
        "query",
        prepare,
        config.generation,
        sink,
        estimated_tokens=estimate,
        arrival=arrival,
        on_finished=on_finished,
        fetch=fetch,
    )


@dataclass
class Answer:
    text: str
    finish_reason: FinishReason
    citations: list[Citation]
    usage: TokenUsage
    timings: dict[str, float]
    strategy: str

    @classmethod
    def of(cls, done: RequestOutput) -> Answer:
        """The answer of a finished query request."""
        return cls(done.text, done.finish_reason, done.citations, done.usage, done.timings.to_dict(), done.strategy)
