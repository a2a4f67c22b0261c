"""POST /v1/embeddings: the request and the embedding list."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragkv.api.common.protocol import Integer, UnicodeText


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


MAX_EMBEDDING_INPUTS = 256  # OpenAI takes 2048; one request must not hold the CPU worker long

MINILM_DIMENSION = 384


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
