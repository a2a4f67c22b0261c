"""POST /v1/completions: the request (a prompt continued, or a question with rag) and the bodies sent."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StrictBool

from ragkv.api.common.protocol import (
    STOP_DESCRIPTION,
    CachedTokens,
    Citation,
    GenerationRequest,
    Integer,
    OpenAIObject,
    RetrievalOptions,
    Stop,
    StreamOptions,
    omitted_when_none,
)
from ragkv.app.request_types import MAX_LOGPROBS


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


class Completion(OpenAIObject):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = omitted_when_none("absent on streamed chunks but the usage chunk")


MAX_PROMPTS = 16

TokenIds = Annotated[list[Annotated[Integer, Field(ge=0)]], Field(min_length=1)]

Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
)


class CompletionRag(RetrievalOptions):
    """Answer each prompt as a question over the tenant's documents (like /v1/query)."""

    enabled: StrictBool = Field(
        False,
        description="true: answer the prompt from the tenant's documents, with citations; "
        "false (default): continue the prompt as it is",
    )


class CompletionRequest(GenerationRequest):
    prompt: Prompt = Field(
        description=f"a string, a list of up to {MAX_PROMPTS} strings (one choice each), or token ids"
    )
    max_tokens: Integer = Field(16, ge=1, description="tokens to generate at most per prompt (OpenAI's default 16)")
    stop: Stop = Field(None, description=STOP_DESCRIPTION)
    stream: StrictBool = Field(False, description="answer as server-sent events (text_completion chunks, then [DONE])")
    stream_options: StreamOptions | None = Field(None, description="streaming options: include_usage")
    n: Integer = Field(1, ge=1, le=1, description="choices per prompt: only 1 is served")
    best_of: Integer | None = Field(None, ge=1, le=1, description="only 1 is served")
    echo: StrictBool = Field(False, json_schema_extra={"enum": [False]}, description="echoing the prompt is not served")
    logprobs: Integer | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="return each token's log-probability "
        "and those of the N most likely tokens at each position (choices[].logprobs)",
    )
    suffix: str | None = Field(
        None, json_schema_extra={"type": "null"}, description="insertion (a suffix) is not served"
    )
    rag: CompletionRag | None = Field(None, description="ragkv extension: answer from the tenant's documents")
