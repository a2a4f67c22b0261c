"""POST /v1/chat/completions, /v1/models, /v1/sessions: the request models and the bodies sent."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
)

from ragkv.api.common.protocol import (
    DEFAULT_MAX_TOKENS,
    SESSION_ID_PATTERN,
    STOP_DESCRIPTION,
    ChatRag,
    GenerationRequest,
    Integer,
    OpenAIObject,
    OpenAIUsage,
    RagExtension,
    SessionSummary,
    Stop,
    StreamOptions,
    joined_text,
    omitted_when_none,
)
from ragkv.api.errors import ApiError
from ragkv.app.request_types import (
    MAX_LOGPROBS,
)


class SessionList(BaseModel):
    object: str = "list"
    data: list[SessionSummary]


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


class ChatCompletion(OpenAIObject):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: OpenAIUsage
    session_id: str = Field(description="ragkv: the session to continue (also the X-Session-Id header)")
    rag: RagExtension


class ChatDelta(BaseModel):
    role: str | None = omitted_when_none("'assistant' in the first chunk")
    content: str | None = omitted_when_none("the next piece of the answer")


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(OpenAIObject):
    """One server-sent event of a streamed chat completion: the role, then the answer's
    pieces, then the finish reason with the session and the `rag` extension, then (with
    stream_options.include_usage) the usage with no choices."""

    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    session_id: str | None = omitted_when_none("ragkv: the session to continue (first and last chunks)")
    rag: RagExtension | None = omitted_when_none("ragkv: citations, timings and the session (last chunk)")
    usage: OpenAIUsage | None = omitted_when_none("with stream_options.include_usage: the last chunk's usage")


class FusionDefault(BaseModel):
    """The fusion requests that name none get."""

    strategy: str
    ratio: float | None
    calibrated: bool = Field(description="the ratio was calibrated for this model (`ragkv calibrate fusion`)")
    refresh_ratio: float = Field(0.0, description="the probe's answer refresh (0 = none)")


class Model(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    fusion: FusionDefault | None = omitted_when_none("ragkv: the default fusion (the generation model only)")


class ModelList(BaseModel):
    object: str = "list"
    data: list[Model]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(json_schema_extra={"enum": ["text"]}, description="only text parts are served")
    text: str = Field(description="the part's text")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return joined_text(self.content, ("text",), "messages", "message content parts", "text")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(
        json_schema_extra={"enum": ["text"]},
        description="'text' is served; 'json_object' and 'json_schema' are refused with 400 "
        "(the server does not constrain decoding to JSON)",
    )


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(
        min_length=1,
        description="the conversation; the last message must be the "
        "user's. With a session only the last message is new: earlier ones are "
        "already in the session's KV",
    )
    max_tokens: Integer | None = Field(
        None,
        ge=1,
        description=f"tokens to generate at most (default {DEFAULT_MAX_TOKENS}; "
        "the server caps it, see --max-new-tokens)",
    )
    max_completion_tokens: Integer | None = Field(
        None, ge=1, description="the same as max_tokens (OpenAI's newer name); wins when both are given"
    )
    stop: Stop = Field(None, description=STOP_DESCRIPTION)
    stream: StrictBool = Field(
        False, description="answer as server-sent events (chat.completion.chunk objects, then [DONE])"
    )
    stream_options: StreamOptions | None = Field(None, description="streaming options: include_usage")
    n: Integer = Field(1, ge=1, le=1, description="choices per request: only 1 is served")
    logprobs: StrictBool | None = Field(
        None, description="true: return each answer token's log-probability (choices[].logprobs)"
    )
    top_logprobs: Integer | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="with logprobs: also the N most likely tokens at each position (without logprobs: ignored)",
    )
    response_format: ResponseFormat | None = Field(None, description="only {'type': 'text'} is served")
    rag: ChatRag | None = Field(None, description="ragkv extension: retrieval, fusion and session options")
    sources: StrictBool = Field(
        False,
        description="ragkv extension: end the message content with numbered source markers, "
        "a 'Sources:' block and the session id (for clients that read only the text)",
    )
    session_id: str | None = Field(
        None,
        pattern=SESSION_ID_PATTERN,
        description="ragkv extension: continue this chat session (its KV is kept "
        "server-side); a new id is made when absent and returned as session_id",
    )

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if extra.get(name):
                raise ApiError(400, "unsupported_parameter", f"{name} are not supported by this server", param=name)
        refuse_response_format(self.response_format)

    @property
    def logprobs_count(self) -> int | None:
        """GenerationConfig.logprobs: None = off, else the alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


def refuse_response_format(response_format: ResponseFormat | None) -> None:
    if response_format is not None and response_format.type != "text":
        raise ApiError(
            400,
            "unsupported_parameter",
            f"response_format {response_format.type!r} is not supported: this "
            "server does not constrain decoding to JSON; send {'type': 'text'} or leave it out",
            param="response_format",
        )
