"""POST /v1/responses bodies (the response object and its output message) from a chat turn."""

from __future__ import annotations

from ragkv.api.protocol.responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponseUsage,
)
from ragkv.api.response_schemas import ResponseRequest
from ragkv.api.serving.common import rag_extension_of
from ragkv.app.request import FinishReason, RequestOutput
from ragkv.app.usage import TokenUsage


def final_status(completion: RequestOutput) -> str:
    return "incomplete" if completion.finish_reason is FinishReason.LENGTH else "completed"


def response_usage(usage: TokenUsage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
        output_tokens=usage.completion_tokens,
        output_tokens_details=OutputTokensDetails(),
        total_tokens=usage.total_tokens,
    )


def output_message(message_id: str, text: str, status: str) -> OutputMessage:
    return OutputMessage(
        id=message_id, status=status, content=[OutputText(text=text)] if status != "in_progress" else []
    )


def response_object(
    response_id: str,
    created: int,
    model: str,
    body: ResponseRequest,
    session_id: str,
    status: str,
    output: list[OutputMessage],
    completion: RequestOutput | None = None,
) -> ResponseObject:
    """The response as it stands: in progress (no `completion` yet) or finished."""
    incomplete = completion is not None and completion.finish_reason is FinishReason.LENGTH
    return ResponseObject(
        id=response_id,
        created_at=created,
        status=status,
        model=model,
        output=output,
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature if body.temperature is not None else 0.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        usage=response_usage(completion.usage) if completion is not None else None,
        session_id=session_id,
        rag=rag_extension_of(completion, session_id) if completion is not None else None,
    )
