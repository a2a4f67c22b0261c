"""Request body of POST /v1/responses (OpenAI's Responses API, text in and text out)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ragkv.api.errors import ApiError
from ragkv.api.schemas import NOT_BLANK_SCHEMA, SESSION_ID_PATTERN, ChatRag, GenerationRequest, Integer


class InputPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = Field(
        json_schema_extra={"enum": ["input_text", "output_text", "text"]}, description="only text parts are served"
    )
    text: str | None = None


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for part in self.content:
            if part.type not in ("input_text", "output_text", "text") or part.text is None:
                raise ApiError(
                    400,
                    "unsupported_content",
                    f"input content parts of type {part.type!r} are not supported; send input_text",
                    param="input",
                )
            pieces.append(part.text)
        return "".join(pieces)


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
            for item in self.input:
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": item.text()})
        if not messages or messages[-1]["role"] != "user":
            raise ApiError(400, "last_message_not_user", "the input must end with a user message", param="input")
        if not messages[-1]["content"].strip():
            raise ApiError(400, "empty_message", "the last user message is empty", param="input")
        return messages
