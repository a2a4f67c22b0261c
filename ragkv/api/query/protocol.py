"""POST /v1/query: the request, the answer and its retrieval event."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
)

from ragkv.api.common.protocol import (
    DEFAULT_MAX_TOKENS,
    NOT_BLANK_SCHEMA,
    STOP_DESCRIPTION,
    ApiObject,
    Citation,
    Integer,
    NotBlank,
    RetrievalOptions,
    SparseOptions,
    Stop,
    Usage,
    seed_field,
)


class QueryResponse(ApiObject):
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


class QueryTokenEvent(BaseModel):
    """A server-sent event per piece of a streamed answer."""

    type: str = "token"
    text: str


class QueryDoneEvent(BaseModel):
    """The last server-sent event of a streamed query (before [DONE]): `type` "done", then
    the fields of the plain answer (QueryResponse)."""

    model_config = ConfigDict(extra="allow")
    type: str = "done"


class QueryRequest(RetrievalOptions, SparseOptions):
    question: NotBlank = Field(
        min_length=1,
        max_length=100_000,
        json_schema_extra=NOT_BLANK_SCHEMA,
        description="the question, answered from the tenant's documents",
    )
    max_tokens: Integer = Field(DEFAULT_MAX_TOKENS, ge=1, description="tokens to generate at most (the server caps it)")
    temperature: float = Field(0.0, ge=0, le=10, description="0: greedy decoding; above 0: sampling")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass (with temperature > 0)")
    seed: Integer | None = seed_field("seed of the sampler (64 bits); greedy ignores it")
    stop: Stop = Field(None, description=STOP_DESCRIPTION)
    stream: StrictBool = Field(False, description="answer as server-sent events: retrieval, token..., done, [DONE]")
