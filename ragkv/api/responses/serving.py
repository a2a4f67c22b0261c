"""POST /v1/responses bodies (the response object and its output message) from a chat turn."""

from __future__ import annotations

import itertools
import json

from ragkv.api.common.serving import rag_extension_of
from ragkv.api.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseObject,
    ResponseRequest,
    ResponseStreamEvent,
    ResponseUsage,
)
from ragkv.api.sessions import ChatTurnAnswer
from ragkv.api.streaming import StreamRenderer
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


class ResponseStream(StreamRenderer):
    """The events of a streamed response (ResponseStreamEvent, each named by its type):
    created, in progress, the output item and its text part opened, a delta per piece,
    then the text, part and item done and the response completed (or incomplete)."""

    done_marker = False

    def __init__(self, response_id: str, message_id: str, created: int, model: str, body, turn: ChatTurnAnswer):
        self.response_id, self.message_id, self.created, self.model = response_id, message_id, created, model
        self.body = body
        self.turn = turn
        self.sequence = itertools.count()
        self.where = {"item_id": message_id, "output_index": 0, "content_index": 0}

    def event(self, kind: str, **fields) -> ResponseStreamEvent:
        return ResponseStreamEvent(type=kind, sequence_number=next(self.sequence), **fields)

    def envelope(self, status: str, output: list, completion: RequestOutput | None = None) -> dict:
        built = response_object(
            self.response_id, self.created, self.model, self.body, self.turn.session_id, status, output, completion
        )
        return built.model_dump(mode="json")

    def message(self, text: str, status: str) -> dict:
        return output_message(self.message_id, text, status).model_dump(mode="json")

    def opening(self, first) -> list[ResponseStreamEvent]:
        started = self.envelope("in_progress", [])
        return [
            self.event("response.created", response=started),
            self.event("response.in_progress", response=started),
            self.event("response.output_item.added", output_index=0, item=self.message("", "in_progress")),
            self.event("response.content_part.added", **self.where, part=_text_part("")),
        ]

    def render(self, event) -> list[ResponseStreamEvent]:
        if event.kind != "token":
            return []
        return [self.event("response.output_text.delta", **self.where, delta=event.value, logprobs=[])]

    async def settle(self, completions: list[RequestOutput]) -> None:
        await self.turn.settle(completions[0])

    def finish(self, completions: list[RequestOutput]) -> list[ResponseStreamEvent]:
        [outcome] = completions
        # The answer as the plain response gives it (stripped); the deltas are what was decoded.
        text = outcome.text
        status = final_status(outcome)
        item = self.message(text, "completed" if status == "completed" else status)
        return [
            self.event("response.output_text.done", **self.where, text=text, logprobs=[]),
            self.event("response.content_part.done", **self.where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=0, item=item),
            self.event(f"response.{status}", response=self.envelope(status, [item], outcome)),
        ]

    def encode(self, event: ResponseStreamEvent) -> str:
        payload = event.model_dump(mode="json")
        return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _text_part(text: str) -> dict:
    return OutputText(text=text).model_dump(mode="json")
