"""Shapes several endpoints share: errors, citations, token usage, deletions."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


def omitted_when_none(description: str | None = None) -> Any:
    """A field left out of the body, not sent as null, when it has no value."""
    return Field(None, exclude_if=lambda value: value is None, description=description)


class ErrorDetail(BaseModel):
    message: str = Field(description="what is wrong, for a person")
    type: str = Field(
        description="invalid_request_error, authentication_error, not_found_error, conflict_error, "
        "overloaded_error or api_error"
    )
    code: str | None = Field(description="short machine-readable reason")
    param: str | None = Field(None, description="the request field at fault, when there is one")


class ErrorResponse(BaseModel):
    """Every error, 4xx or 5xx, in the OpenAI shape."""

    error: ErrorDetail
    request_id: str | None = Field(None, description="quote it to the operator (also the X-Request-Id header)")


class Citation(BaseModel):
    """A retrieved chunk the answer was fused from."""

    document_id: str = Field(description="the document's id")
    name: str = Field(description="the document's name")
    chunk_index: int = Field(description="the chunk's position in its document")
    char_start: int = Field(description="where the chunk starts in the document's text")
    char_end: int = Field(description="where it ends (exclusive)")
    score: float = Field(description="retrieval score: higher is more relevant")
    text: str = Field(description="the chunk's text")
    page: int | None = Field(
        None, description="1-based page where the chunk starts (PDF); null for formats without pages"
    )
    page_end: int | None = Field(
        None,
        description="1-based page where the chunk ends (PDF; a chunk may span pages page..page_end); "
        "null for formats without pages",
    )


class Usage(BaseModel):
    """Token counts of one answer (ragkv.app.usage defines each)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = Field(description="prompt tokens whose KV was read, not computed (stored chunks, a session)")
    computed_tokens: int = Field(description="prompt tokens whose KV was computed for this request")
    recomputed_tokens: int = Field(
        description="document tokens computed: selective recompute and chunks the store "
        "could not give (miss, corrupt blob)"
    )
    document_tokens: int = Field(description="prompt tokens of retrieved chunks")


class CachedTokens(BaseModel):
    cached_tokens: int


class OpenAIUsage(Usage):
    """OpenAI's usage object, ragkv's counts beside it."""

    prompt_tokens_details: CachedTokens = Field(description="OpenAI's form of cached_tokens")


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool
