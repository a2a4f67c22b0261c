"""POST /v1/responses (OpenAI's Responses API, text in and text out): the request and the bodies sent."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ragkv.api.common.conversion import checked_conversation
from ragkv.api.common.protocol import (
    NOT_BLANK_SCHEMA,
    SESSION_ID_PATTERN,
    ApiObject,
    ChatRag,
    GenerationRequest,
    Integer,
    RagExtension,
    joined_text,
    omitted_when_none,
)
from ragkv.api.errors import ApiError


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


class ResponseObject(ApiObject):
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


class ResponseStreamEvent(BaseModel):
    """One server-sent event of a streamed response, named by its `type` (response.created,
    response.output_text.delta, ..., response.completed); the fields after `sequence_number`
    are the type's own (OpenAI's Responses API streaming events)."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(
        json_schema_extra={"enum": ["input_text", "output_text", "text"]}, description="only text parts are served"
    )
    text: str = Field(description="the part's text")


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return joined_text(
            self.content, ("input_text", "output_text", "text"), "input", "input content parts", "input_text"
        )


class ResponseRequest(GenerationRequest):
    # fields whose meaning cannot be honoured are refused in `refuse_unsupported`
    input: (
        Annotated[str, Field(json_schema_extra=NOT_BLANK_SCHEMA)] | Annotated[list[InputMessage], Field(min_length=1)]
    ) = Field(description="the user's text, or the conversation as message items (the last one the user's)")
    instructions: str | None = Field(None, description="a system message placed before the input")
    max_output_tokens: Integer | None = Field(None, ge=1, description="tokens to generate at most (the server caps it)")
    stream: StrictBool = Field(
        False,
        description="answer as server-sent events (response.created, "
        "response.output_text.delta, ..., response.completed)",
    )
    rag: ChatRag | None = Field(None, description="ragkv extension: retrieval, fusion and session options, as on chat")
    session_id: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="ragkv extension: continue this chat session"
    )

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in ("tools", "tool_choice"):
            if extra.get(name):
                raise ApiError(400, "unsupported_parameter", f"{name} are not supported by this server", param=name)
        if extra.get("previous_response_id"):
            raise ApiError(
                400,
                "unsupported_parameter",
                "previous_response_id is not supported: responses are not "
                "stored; resend the conversation as input (its cached prefix is reused) or continue a "
                "session with rag.session_id",
                param="previous_response_id",
            )
        text = extra.get("text")
        output_format = text.get("format") if isinstance(text, dict) else None
        if isinstance(output_format, dict) and output_format.get("type") not in (None, "text"):
            raise ApiError(
                400, "unsupported_parameter", "only text output is served (text.format.type 'text')", param="text"
            )

    def messages(self) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": item.role, "content": item.text()} for item in self.input]
        return checked_conversation(messages)
