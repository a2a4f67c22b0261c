"""POST /v1/completions and POST /v1/embeddings."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ragkv.api.protocol.common import CachedTokens, Citation, omitted_when_none


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionCitations(BaseModel):
    citations: list[Citation]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None = Field(description="stop or length; null on a streamed chunk before the last")
    logprobs: CompletionLogprobs | None = Field(None, description="with logprobs: N")
    rag: CompletionCitations | None = omitted_when_none("ragkv: with rag.enabled, the citations")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens = Field(
        description="cached_tokens: prompt rows whose KV was not computed for this request (passages reused)"
    )


class Completion(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = omitted_when_none("absent on streamed chunks but the usage chunk")


class Embedding(BaseModel):
    object: str = "embedding"
    index: int
    embedding: list[float] | str = Field(description="floats, or base64 of little-endian float32 (encoding_format)")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: str = "list"
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
