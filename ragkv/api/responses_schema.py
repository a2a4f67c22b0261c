"""Response bodies as the OpenAPI document declares them.

These models document what the routes send; they do not filter it (the routes build
plain dicts). Objects allow extra fields so a client generated from the schema keeps
working when a field is added.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- errors ---------------------------------------------------------------------------------------


class ErrorDetail(_Open):
    message: str = Field(description="what is wrong, for a person")
    type: str = Field(
        description="invalid_request_error, authentication_error, not_found_error, conflict_error, "
        "overloaded_error or api_error"
    )
    code: str | None = Field(description="short machine-readable reason")
    param: str | None = Field(None, description="the request field at fault, when there is one")


class ErrorResponse(_Open):
    """Every error, 4xx or 5xx, in the OpenAI shape."""

    error: ErrorDetail
    request_id: str | None = Field(None, description="quote it to the operator (also the X-Request-Id header)")


# -- system ---------------------------------------------------------------------------------------


class Health(_Open):
    status: str = Field(description="ok, degraded (a fallback is in use: Redis unreachable) or unavailable")
    problems: list[str]
    model: str
    fingerprint: str
    uptime_s: float
    store: dict[str, Any]
    sessions: dict[str, Any]
    worker: dict[str, Any]


# -- documents and jobs ---------------------------------------------------------------------------


class DocumentSummary(_Open):
    id: str
    name: str
    tokens: int
    chunks: int
    created: float
    metadata: dict[str, Any]


class DocumentChunk(_Open):
    index: int
    tokens: int
    char_start: int
    char_end: int


class DocumentDetail(_Open):
    id: str
    name: str
    tokens: int
    created: float
    metadata: dict[str, Any]
    fingerprint: str = Field(description="the model fingerprint the document's chunks were computed for")
    chunks: list[DocumentChunk]
    text: str | None = Field(None, description="the document's text (include_text=true)")


class DocumentList(_Open):
    object: str = "list"
    data: list[DocumentSummary]


class IngestSummary(_Open):
    chunks: int
    tokens: int
    computed_chunks: int = Field(description="chunks whose KV was computed by this ingestion")
    reused_chunks: int = Field(description="chunks whose KV the store already held")
    seconds: float
    duplicate_of_existing: bool
    replaced: bool = Field(False, description="the document was a new version of one with this id (PUT)")
    encode_tokens_per_second: float = Field(0.0, description="tokens of computed chunks per second of model time")


class DocumentCreated(_Open):
    document: DocumentSummary
    ingest: IngestSummary


class JobProgress(_Open):
    chunks_done: int
    chunks_total: int | None
    fraction: float | None


class JobStatus(_Open):
    id: str
    object: str = "job"
    kind: str
    name: str | None
    status: str = Field(description="queued, running, succeeded, failed or cancelled")
    progress: JobProgress
    result: DocumentCreated | None
    error: dict[str, Any] | None
    created: float
    started: float | None
    finished: float | None


class JobAccepted(_Open):
    job: JobStatus
    status_url: str


class JobList(_Open):
    object: str = "list"
    data: list[JobStatus]


class Deleted(_Open):
    id: str
    object: str
    deleted: bool


# -- questions ------------------------------------------------------------------------------------


class Citation(_Open):
    document_id: str
    name: str
    chunk_index: int
    char_start: int
    char_end: int
    score: float
    text: str
    page: int | None = Field(
        None, description="1-based page where the chunk starts (PDF); null for formats without pages"
    )


class RagUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int | None = Field(
        None,
        description="prompt tokens whose KV was read, not computed (stored "
        "chunks, a session); also prompt_tokens_details.cached_tokens",
    )
    reused_tokens: int | None = Field(None, description="the same count under its earlier name (chat)")
    document_tokens: int | None = Field(None, description="prompt tokens of retrieved chunks")
    prompt_tokens_details: dict[str, int] | None = Field(None, description="OpenAI's form: cached_tokens")
    computed_tokens: int = Field(description="prompt tokens whose KV was computed for this request")
    recomputed_tokens: int = Field(
        description="document tokens computed: selective recompute and chunks the store "
        "could not give (miss, corrupt blob)"
    )


class QueryResponse(_Open):
    id: str
    object: str = "query"
    answer: str
    finish_reason: str = Field(description="eos, stop or length")
    strategy: str
    citations: list[Citation]
    usage: RagUsage
    timings: dict[str, float]


# -- OpenAI-compatible ----------------------------------------------------------------------------


class Model(_Open):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class ModelList(_Open):
    object: str = "list"
    data: list[Model]


class ChatMessageOut(_Open):
    role: str
    content: str


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    finish_reason: str = Field(description="stop or length")
    logprobs: dict[str, Any] | None = Field(
        None, description="with logprobs: true, {content: [{token, logprob, bytes, top_logprobs}]}"
    )


class ChatCompletion(_Open):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: RagUsage
    session_id: str = Field(description="ragkv: the session to continue (also the X-Session-Id header)")
    rag: dict[str, Any] = Field(description="ragkv: citations, timings, turn, strategy, session")


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str = Field(description="stop or length")
    logprobs: dict[str, Any] | None = Field(
        None, description="with logprobs: N, {tokens, token_logprobs, top_logprobs, text_offset}"
    )


class CompletionUsage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Completion(_Open):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class Embedding(_Open):
    object: str = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 (encoding_format)")


class EmbeddingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Open):
    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class SessionSummary(_Open):
    id: str
    turns: int
    tokens: int
    chunks: int
    created: float
    updated: float


class SessionList(_Open):
    object: str = "list"
    data: list[SessionSummary]


class ResponseOutputText(_Open):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []


class ResponseOutputMessage(_Open):
    type: str = "message"
    id: str
    status: str
    role: str = "assistant"
    content: list[ResponseOutputText]


class ResponseUsage(_Open):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(description="cached_tokens: prompt tokens whose KV was reused")


class ResponseObject(_Open):
    id: str
    object: str = "response"
    created_at: int
    status: str = Field(description="completed, or incomplete when max_output_tokens cut the answer")
    model: str
    output: list[ResponseOutputMessage]
    incomplete_details: dict[str, str] | None = None
    usage: ResponseUsage | None = None
    session_id: str = Field(description="ragkv: the session to continue (also the X-Session-Id header)")
    rag: dict[str, Any] | None = Field(None, description="ragkv: citations, timings, turn, strategy, session")
