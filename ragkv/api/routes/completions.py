"""OpenAI completions and embeddings: POST /v1/completions, POST /v1/embeddings.

/v1/completions continues the prompt as it is: OpenAI's semantics, what LlamaIndex's
non-chat mode and other RAG tools expect when they put the retrieved context in the
prompt themselves. With the extension `rag: {"enabled": true, ...}` the prompt (one
question, a string) is instead answered over the tenant's documents exactly as /v1/query
answers it, and the choice carries `rag.citations`.

/v1/embeddings embeds with the packaged all-MiniLM-L6-v2 (the retrieval embedder).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ragkv.api.auth import tenant_of
from ragkv.api.completion_schemas import CompletionRequest, EmbeddingRequest
from ragkv.api.errors import ApiError
from ragkv.api.openapi import errors, sse_or
from ragkv.api.protocol.completions import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionUsage,
    EmbeddingList,
)
from ragkv.api.responses import SafeJSONResponse
from ragkv.api.routes.query import SSE_HEADERS
from ragkv.api.schemas import generation_config, prompt_spans_of, query_config
from ragkv.api.serving.common import openai_finish_reason
from ragkv.api.serving.completions import completion_choice, completion_usage, embedding_list
from ragkv.api.serving.logprobs import completion_logprobs
from ragkv.api.state import app_state
from ragkv.api.streaming import EventStream, run_requests, run_task, sse_events
from ragkv.api.task import Task
from ragkv.app.request import RequestOutput

router = APIRouter(tags=["openai"], default_response_class=SafeJSONResponse)

EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise ApiError(
            400, "unsupported_parameter", "echo is not supported: the answer holds only the completion", param="echo"
        )
    for name in ("suffix",):
        if getattr(body, name) is not None:
            raise ApiError(400, "unsupported_parameter", f"{name} is not supported by this server", param=name)


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
    generation = generation_config(
        body.max_tokens, body.temperature, body.top_p, body.seed, body.stop, state.config, logprobs=body.logprobs
    )
    rag = body.rag
    config = query_config(rag, generation, state.config) if rag is not None else None  # validated even when disabled
    with_citations = rag is not None and rag.enabled
    if with_citations:
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise ApiError(
                400, "unsupported_prompt", "with rag.enabled the prompt is one question, as a string", param="prompt"
            )
        work = state.work.query_stream(prompts[0], tenant, config)
    else:
        work = state.work.completion_stream(
            prompts,
            generation,
            tenant,
            config.fusion if config is not None else None,
            prompt_spans_of(body, state.config),
        )
    completion_id = "cmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def envelope(choices: list[CompletionChoice], usage: CompletionUsage | None = None) -> Completion:
        return Completion(id=completion_id, created=created, model=state.model_id, choices=choices, usage=usage)

    def citations(completion: RequestOutput) -> list | None:
        return completion.citations if with_citations else None

    if not body.stream:
        completions = await run_requests(request, state.worker, work)
        return envelope(
            [
                completion_choice(
                    i,
                    c.text,
                    openai_finish_reason(c.finish_reason),
                    citations(c),
                    completion_logprobs(c.logprobs) if c.logprobs is not None else None,
                )
                for i, c in enumerate(completions)
            ],
            completion_usage(completions),
        )

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await EventStream.start(request, state.worker, work)

    pending: dict[int, list] = {}  # per prompt: logprob entries of tokens whose text is not sent yet
    offsets: dict[int, int] = {}  # per prompt: characters of the entries sent so far

    def logprobs_of(index: int) -> CompletionLogprobs | None:
        entries = pending.pop(index, [])
        if body.logprobs is None or not entries:
            return None
        out = completion_logprobs(entries, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + sum(len(e.text) for e in entries)
        return out

    def render(event):
        if event.kind == "logprob":
            pending.setdefault(event.index, []).append(event.value)
        if event.kind != "token":
            return []
        choice = completion_choice(event.index, event.value, None, logprobs=logprobs_of(event.index))
        return [envelope([choice]).model_dump(mode="json")]

    def finish(completions: list[RequestOutput]):
        events = [
            envelope(
                [
                    completion_choice(
                        i,
                        "",
                        openai_finish_reason(c.finish_reason),
                        citations(c),  # a stop string's tokens: never sent
                        logprobs=logprobs_of(i),
                    )
                ]
            )
            for i, c in enumerate(completions)
        ]
        if include_usage:
            events.append(envelope([], completion_usage(completions)))
        return [event.model_dump(mode="json") for event in events]

    async def events():
        try:
            async for item in sse_events(request, stream, render, finish):
                yield item
        finally:
            stream.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/embeddings", response_model=EmbeddingList, responses=errors(400, 401, 404, 413, 503))
async def embeddings(request: Request, body: EmbeddingRequest):
    """OpenAI embeddings from the packaged all-MiniLM-L6-v2: unit vectors."""
    state = app_state(request)
    tenant_of(request)
    if body.model != EMBEDDING_MODEL_ID:
        raise ApiError(
            404,
            "model_not_found",
            f"the embedding model {body.model!r} does not exist; this server serves {EMBEDDING_MODEL_ID!r}",
            param="model",
        )
    dimension = state.runtime.embedder.dimension
    if body.dimensions is not None and body.dimensions != dimension:
        raise ApiError(
            400,
            "unsupported_parameter",
            f"dimensions must be {dimension} (or absent): this model's vectors are not truncated",
            param="dimensions",
        )
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    vectors, tokens = await run_task(request, state.worker, Task("embedding", state.work.embeddings_body(texts)))

    return embedding_list(EMBEDDING_MODEL_ID, vectors, tokens, body.encoding_format == "base64")
