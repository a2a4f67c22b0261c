"""OpenAI completions: POST /v1/completions.

/v1/completions continues the prompt as it is: OpenAI's semantics, what LlamaIndex's
non-chat mode and other RAG tools expect when they put the retrieved context in the
prompt themselves. With the extension `rag: {"enabled": true, ...}` the prompt (one
question, a string) is instead answered over the tenant's documents exactly as /v1/query
answers it, and the choice carries `rag.citations`.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from ragkv.api.auth import tenant_of
from ragkv.api.common.conversion import generation_config, prompt_spans_of, query_config, sent_or_capped
from ragkv.api.common.render import RenderedPrompt, rendered_prompt
from ragkv.api.completions.protocol import (
    Completion,
    CompletionRequest,
)
from ragkv.api.completions.serving import CompletionAnswer, CompletionStream
from ragkv.api.errors import ApiError
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors, sse_or
from ragkv.api.state import AppState, app_state
from ragkv.api.streaming import EventStream, run_requests, stream_response
from ragkv.app.request_types import GenerationConfig

router = APIRouter(tags=["openai"], default_response_class=SafeJSONResponse)


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _question(body: CompletionRequest) -> str:
    """The question of a prompt answered from documents (rag.enabled): one string."""
    prompts = _prompts(body.prompt)
    if len(prompts) != 1 or not isinstance(prompts[0], str):
        raise ApiError(
            400, "unsupported_prompt", "with rag.enabled the prompt is one question, as a string", param="prompt"
        )
    return prompts[0]


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise ApiError(
            400, "unsupported_parameter", "echo is not supported: the answer holds only the completion", param="echo"
        )
    for name in ("suffix",):
        if getattr(body, name) is not None:
            raise ApiError(400, "unsupported_parameter", f"{name} is not supported by this server", param=name)


def _generation(body: CompletionRequest, state: AppState) -> GenerationConfig:
    max_tokens = sent_or_capped(body, "max_tokens", state.config.max_new_tokens)
    return generation_config(
        max_tokens, body.temperature, body.top_p, body.seed, body.stop, state.config, logprobs=body.logprobs
    )


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={
        **sse_or(Completion, "the completion, or with stream: true text_completion chunks then [DONE]"),
        **errors(400, 401, 404, 413, 503),
    },
)
async def completions(request: Request, body: CompletionRequest):
    """OpenAI completions: the prompt is continued as it is (no chat template), or with
    rag.enabled answered from the tenant's documents."""
    state = app_state(request)
    tenant = tenant_of(request)
    _refuse_unsupported(body)
    state.check_model(body.model)
    prompts = _prompts(body.prompt)
    generation = _generation(body, state)
    rag = body.rag
    config = query_config(rag, generation, state.config) if rag is not None else None  # validated even when disabled
    with_citations = rag is not None and rag.enabled
    if with_citations:
        work = state.client.query(_question(body), tenant, config)
    else:
        work = state.client.complete(
            prompts,
            generation,
            tenant,
            config.fusion if config is not None else None,
            prompt_spans_of(body, state.config),
        )
    answer = CompletionAnswer(
        "cmpl-" + uuid.uuid4().hex[:24], int(time.time()), state.model_id, with_citations, body.logprobs
    )
    if not body.stream:
        return answer.whole(await run_requests(request, work))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await EventStream.start(request, work)
    return stream_response(request, stream, CompletionStream(answer, include_usage))


@router.post("/v1/completions/render", response_model=list[RenderedPrompt], responses=errors(400, 401, 404, 413))
async def render_completion(request: Request, body: CompletionRequest):
    """vLLM's render call: one entry per prompt, the token ids it would prefill (a text
    tokenized as /v1/completions tokenizes it, ids as given), checked as the request would
    be, with no model work. With rag.enabled, the question's prompt without the documents
    retrieval puts in it (retrieval embeds the question and reads the store)."""
    state = app_state(request)
    tenant_of(request)
    _refuse_unsupported(body)
    state.check_model(body.model)
    generation = _generation(body, state)
    config = query_config(body.rag, generation, state.config) if body.rag is not None else None
    if config is not None and body.rag.enabled:
        all_ids = [state.client.render_question(_question(body), config)]
    else:
        all_ids = state.client.render_prompts(_prompts(body.prompt), generation)
    return [rendered_prompt("cmpl", ids, body, generation, body.stream, body.stream_options) for ids in all_ids]
