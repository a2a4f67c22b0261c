"""OpenAI's Responses API for text: POST /v1/responses, plain and streamed.

A response is a chat turn (the same request as /v1/chat/completions, with the same reuse
of a cached prefix and the same `rag` and `session_id` extensions): `instructions` is a
system message, `input` the user's text or the conversation as message items. The answer
is one `message` output item holding one `output_text` part; `status` is "incomplete"
with `incomplete_details.reason` "max_output_tokens" when the token limit cut it.

With stream: true the events are OpenAI's, each with its `type` as the SSE event name and
a `sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per piece of text),
response.output_text.done, response.content_part.done, response.output_item.done,
response.completed (or response.incomplete). Responses are not stored: there is no
GET /v1/responses/{id} and no previous_response_id.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from ragkv.api.auth import tenant_of
from ragkv.api.errors import ApiError
from ragkv.api.openapi import errors, sse_or
from ragkv.api.protocol.responses import OutputText, ResponseObject
from ragkv.api.response_schemas import ResponseRequest
from ragkv.api.responses import SafeJSONResponse
from ragkv.api.routes.query import SSE_HEADERS
from ragkv.api.schemas import DEFAULT_MAX_TOKENS, ChatRag, chat_turn, generation_config, query_config
from ragkv.api.serving.responses import final_status, output_message, response_object
from ragkv.api.sessions import check_session_id, settle_shared
from ragkv.api.state import app_state
from ragkv.api.streaming import EventStream, run_requests, sse_events
from ragkv.app.contexts import new_context_id
from ragkv.app.request import RequestOutput

router = APIRouter(tags=["openai"], default_response_class=SafeJSONResponse)


def _text_part(text: str) -> dict:
    return OutputText(text=text).model_dump(mode="json")


def _named_sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


@router.post(
    "/v1/responses",
    response_model=ResponseObject,
    responses={
        **sse_or(
            ResponseObject, "the response, or with stream: true its events (response.created ... response.completed)"
        ),
        **errors(400, 401, 404, 409, 413, 503),
    },
)
async def create_response(request: Request, response: Response, body: ResponseRequest):
    state = app_state(request)
    tenant = tenant_of(request)
    body.refuse_unsupported()
    state.check_model(body.model)
    messages = body.messages()
    rag = body.rag or ChatRag()
    if body.session_id and rag.session_id and body.session_id != rag.session_id:
        raise ApiError(400, "conflicting_session_id", "session_id and rag.session_id differ", param="session_id")
    named = body.session_id or rag.session_id
    session_id = check_session_id(named) if named else new_context_id()
    max_tokens = body.max_output_tokens or DEFAULT_MAX_TOKENS
    generation = generation_config(max_tokens, body.temperature, body.top_p, body.seed, None, state.config)
    config = query_config(rag, generation, state.config)
    work = state.work.chat_stream(
        chat_turn(tenant, messages, session_id if named else None, config, rag.enabled, body, state.config), session_id
    )
    response_id = "resp_" + uuid.uuid4().hex
    message_id = "msg_" + uuid.uuid4().hex
    created = int(time.time())
    headers = {"X-Session-Id": session_id}

    async def settle(outcome: RequestOutput) -> None:  # the context reaches other replicas before the answer ends
        await settle_shared(state.sessions, tenant, session_id, outcome, state.config.shared_publish_wait_s)

    def envelope(status: str, output: list, completion: RequestOutput | None = None) -> dict:
        built = response_object(response_id, created, state.model_id, body, session_id, status, output, completion)
        return built.model_dump(mode="json")

    def message(text: str, status: str) -> dict:
        return output_message(message_id, text, status).model_dump(mode="json")

    if not body.stream:
        [outcome] = await run_requests(request, state.worker, work)
        await settle(outcome)
        status = final_status(outcome)
        response.headers.update(headers)
        output = [output_message(message_id, outcome.text, status)]
        return response_object(response_id, created, state.model_id, body, session_id, status, output, outcome)

    stream = await EventStream.start(request, state.worker, work)
    sequence = itertools.count()
    pieces: list[str] = []
    where = {"item_id": message_id, "output_index": 0, "content_index": 0}

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(sequence), **fields}

    def opening() -> list[dict]:
        started = envelope("in_progress", [])
        return [
            event("response.created", response=started),
            event("response.in_progress", response=started),
            event("response.output_item.added", output_index=0, item=message("", "in_progress")),
            event("response.content_part.added", **where, part=_text_part("")),
        ]

    def render(item):
        if item.kind != "token":
            return []
        pieces.append(item.value)
        return [event("response.output_text.delta", **where, delta=item.value, logprobs=[])]

    def finish(completions: list[RequestOutput]):
        [outcome] = completions
        # The answer as the plain response gives it (stripped); the deltas are what was decoded.
        text = outcome.text
        status = final_status(outcome)
        item = message(text, "completed" if status == "completed" else status)
        return [
            event("response.output_text.done", **where, text=text, logprobs=[]),
            event("response.content_part.done", **where, part=_text_part(text)),
            event("response.output_item.done", output_index=0, item=item),
            event(f"response.{status}", response=envelope(status, [item], outcome)),
        ]

    async def events():
        try:
            for item in opening():
                yield _named_sse(item)
            async for item in sse_events(
                request, stream, render, finish, encode=_named_sse, done=False, settle=lambda done: settle(done[0])
            ):
                yield item
        finally:
            stream.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
