"""POST /v1/chat/completions, /v1/models, /v1/sessions."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ragkv.api.protocol.common import Citation, OpenAIUsage, omitted_when_none


class SessionSummary(BaseModel):
    id: str
    turns: int
    tokens: int
    chunks: int
    created: float
    updated: float
    shared: bool | None = omitted_when_none("another replica can continue it by its id (a chat answer's session)")


class SessionList(BaseModel):
    object: str = "list"
    data: list[SessionSummary]


class RagExtension(BaseModel):
    """ragkv's `rag` object beside an OpenAI answer."""

    session_id: str
    turn: int
    strategy: str
    new_chunks: int = Field(description="chunks fused for this turn (not held by the context it started from)")
    context_tokens: int = Field(description="prompt rows taken from a cached context")
    citations: list[Citation]
    timings: dict[str, float]
    session: SessionSummary | None = Field(description="the context the turn left")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]
    refusal: str | None = None


class ChatMessageOut(BaseModel):
    role: str
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: str = Field(description="stop or length")
    logprobs: ChatLogprobs | None = Field(None, description="with logprobs: true")


class ChatCompletion(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage
    session_id: str = Field(description="ragkv: the session to continue (also the X-Session-Id header)")
    rag: RagExtension


class FusionDefault(BaseModel):
    """The fusion requests that name none get."""

    strategy: str
    ratio: float | None
    calibrated: bool = Field(description="the ratio was calibrated for this model (`ragkv calibrate fusion`)")


class Model(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    fusion: FusionDefault | None = omitted_when_none("ragkv: the default fusion (the generation model only)")


class ModelList(BaseModel):
    object: str = "list"
    data: list[Model]
