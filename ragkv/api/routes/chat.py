"""OpenAI-compatible chat: POST /v1/chat/completions (plain and SSE), GET /v1/models,
and the session routes.

Messages keep their roles through the model's chat template (a system message replaces
the default system prompt). A client that resends the whole history, as OpenAI clients
do, reuses the longest cached prefix of it: only new tokens are computed, and
`usage.prompt_tokens_details.cached_tokens` says how many were not (see ragkv.app.chat).

Extensions (the openai client sends them with `extra_body=`):
  rag         {"enabled", "top_k", "document_ids", "strategy", "ratio", "session_id"}
  session_id  continue this session (also rag.session_id): 404 session_not_found when it
              is unknown or expired. With a session the client may send only the new
              message. Every answer names the context it left as `session_id` (and the
              X-Session-Id header); continuing with that id makes it a session. The answer
              carries a `rag` object (citations, timings, turn, context_tokens: prompt
              rows taken from a cached context).
  sources     true: the message content ends with numbered source markers, a
              "Sources:" block and the session id (api.sources), for clients that
              read only the text (LangChain).
temperature defaults to 0 (greedy) when not given.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import StreamingResponse

from ragkv.api.auth import tenant_of
from ragkv.api.errors import ApiError
from ragkv.api.openapi import errors, sse_or
from ragkv.api.protocol.chat import ChatCompletion, Model, ModelList, SessionList
from ragkv.api.protocol.common import Deleted
from ragkv.api.responses import SafeJSONResponse
from ragkv.api.routes.completions import EMBEDDING_MODEL_ID
from ragkv.api.routes.query import SSE_HEADERS
from ragkv.api.schemas import (
    DEFAULT_MAX_TOKENS,
    SESSION_ID_PATTERN,
    ChatRag,
    ChatRequest,
    chat_turn,
    generation_config,
    query_config,
)
from ragkv.api.serving.chat import chat_completion, model_entry, session_list
from ragkv.api.serving.common import citations_of, openai_finish_reason, openai_usage_of, rag_extension_of
from ragkv.api.serving.logprobs import chat_logprobs
from ragkv.api.sessions import check_session_id, settle_shared
from ragkv.api.sources import sources_block
from ragkv.api.state import AppState, app_state
from ragkv.api.streaming import EventStream, run_requests, sse, sse_events
from ragkv.app.contexts import new_context_id
from ragkv.app.request import RequestOutput

router = APIRouter(tags=["chat"], default_response_class=SafeJSONResponse)


def _messages(body: ChatRequest) -> list[dict[str, str]]:
    messages = []
    for message in body.messages:
        role = "system" if message.role == "developer" else message.role
        messages.append({"role": role, "content": message.text()})
    if messages[-1]["role"] != "user":
        raise ApiError(400, "last_message_not_user", "the last message must have role 'user'", param="messages")
    if not messages[-1]["content"].strip():
        raise ApiError(400, "empty_message", "the last user message is empty", param="messages")
    return messages


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={
        **sse_or(ChatCompletion, "the completion, or with stream: true chat.completion.chunk events then [DONE]"),
        **errors(400, 401, 404, 409, 413, 503),
    },
)
async def chat_completions(request: Request, response: Response, body: ChatRequest):
    state = app_state(request)
    tenant = tenant_of(request)
    body.refuse_unsupported()
    state.check_model(body.model)
    messages = _messages(body)
    rag = body.rag or ChatRag()
    if body.session_id and rag.session_id and body.session_id != rag.session_id:
        raise ApiError(400, "conflicting_session_id", "session_id and rag.session_id differ", param="session_id")
    named = body.session_id or rag.session_id
    session_id = check_session_id(named) if named else new_context_id()
    max_tokens = body.max_completion_tokens or body.max_tokens or DEFAULT_MAX_TOKENS
    generation = generation_config(
        max_tokens, body.temperature, body.top_p, body.seed, body.stop, state.config, logprobs=body.logprobs_count
    )
    config = query_config(rag, generation, state.config)
    work = state.work.chat_stream(
        chat_turn(tenant, messages, session_id if named else None, config, rag.enabled, body, state.config), session_id
    )
    completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    headers = {"X-Session-Id": session_id}

    async def settle(outcome: RequestOutput) -> None:  # the context reaches other replicas before the answer ends
        await settle_shared(state.sessions, tenant, session_id, outcome, state.config.shared_publish_wait_s)

    def sources(outcome: RequestOutput) -> str:
        return sources_block(citations_of(outcome.citations), session_id)

    if not body.stream:
        [outcome] = await run_requests(request, state.worker, work)
        await settle(outcome)
        content = outcome.text + (sources(outcome) if body.sources else "")
        response.headers.update(headers)
        return chat_completion(
            completion_id, created, state.model_id, outcome, content, session_id, logprobs=bool(body.logprobs)
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await EventStream.start(request, state.worker, work)

    pending_logprobs: list = []  # entries of tokens whose text has not been sent yet

    def chunk(delta: dict, finish_reason: str | None = None, **extra) -> dict:
        logprobs = None
        if pending_logprobs and "content" in delta:
            logprobs = chat_logprobs(pending_logprobs).model_dump(mode="json")
            pending_logprobs.clear()
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}],
            **extra,
        }

    def render(event):
        if event.kind == "logprob":
            pending_logprobs.append(event.value)
        return [chunk({"content": event.value})] if event.kind == "token" else []

    def finish(completions: list[RequestOutput]):
        [outcome] = completions
        events = [chunk({"content": sources(outcome)})] if body.sources else []
        if pending_logprobs:  # tokens of a stop string: never sent as text
            events.append(chunk({"content": ""}))
        events += [
            chunk(
                {},
                openai_finish_reason(outcome.finish_reason),
                session_id=session_id,
                rag=rag_extension_of(outcome, session_id).model_dump(mode="json"),
            )
        ]
        if include_usage:
            events.append(
                {
                    "id": completion_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": state.model_id,
                    "choices": [],
                    "usage": openai_usage_of(outcome.usage).model_dump(),
                }
            )
        return events

    async def events():
        try:
            yield sse(chunk({"role": "assistant", "content": ""}, session_id=session_id))
            async for item in sse_events(request, stream, render, finish, settle=lambda done: settle(done[0])):
                yield item
        finally:
            stream.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


def _model(state: AppState, model_id: str) -> Model:
    fusion = state.runtime.default_fusion() if model_id == state.model_id else None
    return model_entry(model_id, state.started, fusion)


@router.get("/v1/models", response_model=ModelList, responses=errors(401))
def list_models(request: Request):
    state = app_state(request)
    tenant_of(request)
    return ModelList(data=[_model(state, model_id) for model_id in (state.model_id, EMBEDDING_MODEL_ID)])


@router.get("/v1/models/{model_id}", response_model=Model, responses=errors(401, 404))
def get_model(request: Request, model_id: str):
    state = app_state(request)
    tenant_of(request)
    if model_id not in (state.model_id, "ragkv", EMBEDDING_MODEL_ID):
        raise ApiError(404, "model_not_found", f"the model {model_id!r} does not exist")
    return _model(state, EMBEDDING_MODEL_ID if model_id == EMBEDDING_MODEL_ID else state.model_id)


@router.get("/v1/sessions", response_model=SessionList, responses=errors(401))
def list_sessions(request: Request):
    """Sessions of this tenant held in this process's memory."""
    state = app_state(request)
    return session_list(state.sessions.list(tenant_of(request)))


@router.delete("/v1/sessions/{session_id}", response_model=Deleted, responses=errors(400, 401, 404, 409))
def delete_session(request: Request, session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN)]):
    state = app_state(request)
    if not state.sessions.delete(tenant_of(request), check_session_id(session_id)):
        raise ApiError(404, "session_not_found", f"no session {session_id!r}")
    return Deleted(id=session_id, object="session", deleted=True)
