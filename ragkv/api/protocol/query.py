"""POST /v1/query."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ragkv.api.protocol.common import Citation, Usage


class QueryResponse(BaseModel):
    id: str
    object: str = "query"
    answer: str
    finish_reason: str = Field(description="eos, stop or length")
    strategy: str
    citations: list[Citation]
    usage: Usage
    timings: dict[str, float] = Field(description="seconds per stage (ragkv.app.usage.Timings) and total")


class QueryRetrievalEvent(BaseModel):
    """The first server-sent event of a streamed query: what the answer is fused from."""

    type: str = "retrieval"
    id: str
    citations: list[Citation]
    strategy: str
    timings: dict[str, float]
