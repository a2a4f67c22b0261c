"""POST /v1/responses (the body it reads is api.response_schemas.ResponseRequest)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from ragkv.api.protocol.chat import RagExtension
from ragkv.api.protocol.common import omitted_when_none


class OutputText(BaseModel):
    type: str = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(BaseModel):
    type: str = "message"
    id: str
    status: str
    role: str = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens whose KV was reused")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class TextFormat(BaseModel):
    type: str = "text"


class TextConfig(BaseModel):
    format: TextFormat = TextFormat()


class ResponseObject(BaseModel):
    id: str
    object: str = "response"
    created_at: int
    status: str = Field(description="completed, or incomplete when max_output_tokens cut the answer")
    model: str
    output: list[OutputMessage]
    error: None = None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = []
    text: TextConfig = TextConfig()
    metadata: dict[str, str] = {}
    usage: ResponseUsage | None
    session_id: str = Field(description="ragkv: the session to continue (also the X-Session-Id header)")
    rag: RagExtension | None = omitted_when_none("ragkv: citations, timings, turn, strategy, session")
