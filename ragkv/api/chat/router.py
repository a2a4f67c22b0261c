"""OpenAI-compatible chat: POST /v1/chat/completions (plain and SSE), GET /v1/models,
and the session routes.

Messages keep their roles through the model's chat template (a system message replaces
the default system prompt). A client that resends the whole history, as OpenAI clients
do, reuses the longest cached prefix of it: only new tokens are computed, and
`usage.prompt_tokens_details.cached_tokens` says how many were not (see ragkv.app.chat.turn).

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

from ragkv.api.auth import tenant_of
from ragkv.api.chat.protocol import ChatCompletion, ChatRequest, Model, ModelList, SessionList
from ragkv.api.chat.serving import ChatStream, chat_completion, model_entry, session_list
from ragkv.api.common.conversion import chat_turn, checked_conversation, generation_config, query_config
from ragkv.api.common.protocol import DEFAULT_MAX_TOKENS, EMBEDDING_MODEL_ID, SESSION_ID_PATTERN, ChatRag, Deleted
from ragkv.api.common.render import RenderedPrompt, rendered_prompt
from ragkv.api.errors import ApiError
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors, sse_or
from ragkv.api.sessions import ChatTurnAnswer, check_session_id
from ragkv.api.state import AppState, app_state
from ragkv.api.streaming import EventStream, run_requests, stream_response
from ragkv.app.request_types import GenerationConfig

router = APIRouter(tags=["chat"], default_response_class=SafeJSONResponse)


def _messages(body: ChatRequest) -> list[dict[str, str]]:
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    return checked_conversation(messages)


def _generation(body: ChatRequest, state: AppState) -> GenerationConfig:
    if body.max_tokens and body.max_completion_tokens:  # the newer name wins; the other is still checked
        generation_config(body.max_tokens, None, None, None, None, state.config)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS, state.config.max_new_tokens)
    return generation_config(
        max_tokens, body.temperature, body.top_p, body.seed, body.stop, state.config, logprobs=body.logprobs_count
    )


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
    turn = ChatTurnAnswer.of(body.session_id, rag.session_id, state.client, tenant, with_sources=body.sources)
    config = query_config(rag, _generation(body, state), state.config)
    work = state.client.chat(
        chat_turn(tenant, messages, turn.named, config, rag.enabled, body, state.config), turn.session_id
    )
    completion_id = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if not body.stream:
        [outcome] = await run_requests(request, work)
        await turn.settle(outcome)
        content = outcome.text + (turn.sources(outcome) if body.sources else "")
        response.headers.update(turn.headers)
        return chat_completion(
            completion_id, created, state.model_id, outcome, content, turn.session_id, logprobs=bool(body.logprobs)
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await EventStream.start(request, work)
    renderer = ChatStream(completion_id, created, state.model_id, turn, include_usage)
    return stream_response(request, stream, renderer, turn.headers)


@router.post("/v1/chat/completions/render", response_model=RenderedPrompt, responses=errors(400, 401, 404, 413))
async def render_chat_completion(request: Request, body: ChatRequest):
    """vLLM's render call: the token ids this chat request would prefill (the messages in
    the model's chat template), checked as the request would be, with no model work. The
    documents a turn retrieves (`rag`) are not among them: retrieval embeds the question and
    reads the store, and any replica reads the same chunks from it; a cached conversation
    is found by these ids."""
    state = app_state(request)
    tenant = tenant_of(request)
    body.refuse_unsupported()
    state.check_model(body.model)
    generation = _generation(body, state)
    rag = body.rag or ChatRag()
    config = query_config(rag, generation, state.config)
    turn = chat_turn(tenant, _messages(body), None, config, rag.enabled, body, state.config)
    ids = state.client.render_chat(turn)
    return rendered_prompt("chatcmpl", ids, body, generation, body.stream, body.stream_options)


def _model(state: AppState, model_id: str) -> Model:
    fusion = state.client.default_fusion() if model_id == state.model_id else None
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
    return session_list(state.client.sessions_of(tenant_of(request)))


@router.delete("/v1/sessions/{session_id}", response_model=Deleted, responses=errors(400, 401, 404, 409))
def delete_session(request: Request, session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN)]):
    state = app_state(request)
    if not state.client.delete_session(tenant_of(request), check_session_id(session_id)):
        raise ApiError(404, "session_not_found", f"no session {session_id!r}")
    return Deleted(id=session_id, object="session", deleted=True)
