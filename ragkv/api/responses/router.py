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

import time
import uuid

from fastapi import APIRouter, Request, Response

from ragkv.api.auth import tenant_of
from ragkv.api.common.conversion import chat_turn, generation_config, query_config
from ragkv.api.common.protocol import DEFAULT_MAX_TOKENS, ChatRag
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors, sse_or
from ragkv.api.responses.protocol import ResponseObject, ResponseRequest
from ragkv.api.responses.serving import ResponseStream, final_status, output_message, response_object
from ragkv.api.sessions import ChatTurnAnswer
from ragkv.api.state import app_state
from ragkv.api.streaming import EventStream, run_requests, stream_response

router = APIRouter(tags=["openai"], default_response_class=SafeJSONResponse)


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
    turn = ChatTurnAnswer.of(body.session_id, rag.session_id, state.client, tenant)
    max_tokens = body.max_output_tokens or min(DEFAULT_MAX_TOKENS, state.config.max_new_tokens)
    generation = generation_config(max_tokens, body.temperature, body.top_p, body.seed, None, state.config)
    config = query_config(rag, generation, state.config)
    work = state.client.chat(
        chat_turn(tenant, messages, turn.named, config, rag.enabled, body, state.config), turn.session_id
    )
    response_id = "resp_" + uuid.uuid4().hex
    message_id = "msg_" + uuid.uuid4().hex
    created = int(time.time())
    if not body.stream:
        [outcome] = await run_requests(request, work)
        await turn.settle(outcome)
        status = final_status(outcome)
        response.headers.update(turn.headers)
        output = [output_message(message_id, outcome.text, status)]
        return response_object(response_id, created, state.model_id, body, turn.session_id, status, output, outcome)
    stream = await EventStream.start(request, work)
    renderer = ResponseStream(response_id, message_id, created, state.model_id, body, turn)
    return stream_response(request, stream, renderer, turn.headers)
