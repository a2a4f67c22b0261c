"""Request schemas of the OpenAI completions and embeddings endpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool

from ragkv.api.schemas import (
    STOP_DESCRIPTION,
    GenerationRequest,
    Integer,
    RetrievalOptions,
    Stop,
    StreamOptions,
    UnicodeText,
)
from ragkv.app.request_types import MAX_LOGPROBS

MAX_PROMPTS = 16
MAX_EMBEDDING_INPUTS = 256  # OpenAI takes 2048; one request must not hold the CPU worker long
MINILM_DIMENSION = 384

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


class EmbeddingRequest(UnicodeText):
    model_config = ConfigDict(extra="allow")
    model: str = Field(
        min_length=1, examples=["all-MiniLM-L6-v2"], description="the embedding model's id (GET /v1/models)"
    )
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    ) = Field(
        description=f"a non-empty string or a list of up to {MAX_EMBEDDING_INPUTS}; long texts are embedded as the "
        "mean of their windows (MiniLM reads 256 word pieces at a time)"
    )
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="floats, or base64 of little-endian float32"
    )
    dimensions: Integer | None = Field(
        None,
        json_schema_extra={"anyOf": [{"type": "integer", "enum": [MINILM_DIMENSION]}, {"type": "null"}]},
        description=f"{MINILM_DIMENSION} or absent (vectors are not truncated)",
    )
    user: str | None = Field(None, description="ignored")
