"""OpenAI completions and embeddings: POST /v1/completions, POST /v1/embeddings.

/v1/completions continues the prompt as it is: OpenAI's semantics, what LlamaIndex's
non-chat mode and other RAG tools expect when they put the retrieved context in the
prompt themselves. With the extension `rag: {"enabled": true, ...}` the prompt (one
question, a string) is instead answered over the tenant's documents exactly as /v1/query
answers it, and the choice carries `rag.citations`.

/v1/embeddings embeds with the packaged all-MiniLM-L6-v2 (the retrieval embedder).
"""

from __future__ import annotations

import base64
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ragkv.api.auth import tenant_of
from ragkv.api.completion_jobs import CompletionOutcome, embeddings_body, plain_completions_body
from ragkv.api.completion_schemas import CompletionRequest, EmbeddingRequest
from ragkv.api.errors import ApiError
from ragkv.api.logprobs import completion_logprobs
from ragkv.api.openapi import errors, sse_or
from ragkv.api.responses_schema import Completion, EmbeddingList
from ragkv.api.routes.query import SSE_HEADERS
from ragkv.api.schemas import generation_config, query_config
from ragkv.api.state import app_state
from ragkv.api.streaming import JobStream, run_job, sse_events
from ragkv.api.worker import Job
from ragkv.app.request import Completion as QueryCompletion

router = APIRouter(tags=["openai"])

EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.echo:
        raise ApiError(400, "unsupported_parameter", "echo is not supported: the answer holds only the completion",
                       param="echo")
    for name in ("suffix",):
        if getattr(body, name) is not None:
            raise ApiError(400, "unsupported_parameter", f"{name} is not supported by this server", param=name)


def _outcomes(result: list[CompletionOutcome] | QueryCompletion) -> list[CompletionOutcome]:
    """A plain job's outcomes, or the one of a /v1/query request (rag.enabled)."""
    if isinstance(result, list):
        return result
    return [CompletionOutcome(result.text, result.finish_reason, result.usage.prompt_tokens, result.usage.completion_tokens,
                              [citation.to_dict() for citation in result.citations], result.logprobs)]


def _usage(outcomes: list[CompletionOutcome]) -> dict:
    prompt = sum(o.prompt_tokens for o in outcomes)
    completion = sum(o.completion_tokens for o in outcomes)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@router.post("/v1/completions", responses={
    **sse_or(Completion, "the completion, or with stream: true text_completion chunks then [DONE]"),
    **errors(400, 401, 404, 413, 503)})
async def completions(request: Request, body: CompletionRequest):
    """OpenAI completions: the prompt is continued as it is (no chat template), or with
    rag.enabled answered from the tenant's documents."""
    state = app_state(request)
    tenant = tenant_of(request)
    _refuse_unsupported(body)
    if body.model not in (state.model_id, "ragkv"):
        raise ApiError(404, "model_not_found", f"the model {body.model!r} does not exist; this server serves {state.model_id!r}",
                       param="model")
    prompts = _prompts(body.prompt)
    generation = generation_config(body.max_tokens, body.temperature, body.top_p, body.seed, body.stop, state.config,
                                   logprobs=body.logprobs)
    rag = body.rag
    config = query_config(rag, generation, state.config) if rag is not None else None  # validated even when disabled
    with_citations = rag is not None and rag.enabled
    if with_citations:
        if len(prompts) != 1 or not isinstance(prompts[0], str):
            raise ApiError(400, "unsupported_prompt", "with rag.enabled the prompt is one question, as a string",
                           param="prompt")
        job = state.service.query_job(prompts[0], tenant, config)
    else:
        job = Job("completion", plain_completions_body(state.runtime, prompts, generation, state.config.max_input_tokens))
    completion_id = "cmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())

    def choice(index: int, text: str, finish_reason: str | None, citations: list | None = None,
               logprobs: dict | None = None) -> dict:
        out = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
        if citations is not None:
            out["rag"] = {"citations": citations}
        return out

    def envelope(choices: list[dict], **extra) -> dict:
        return {"id": completion_id, "object": "text_completion", "created": created, "model": state.model_id,
                "choices": choices, **extra}

    if not body.stream:
        outcomes = _outcomes(await run_job(request, state.worker, job))
        return envelope([choice(i, o.text, _FINISH.get(o.finish_reason, "stop"), o.citations if with_citations else None,
                                completion_logprobs(o.logprobs) if body.logprobs is not None else None)
                         for i, o in enumerate(outcomes)], usage=_usage(outcomes))

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stream = await JobStream.start(request, state.worker, job)

    pending: dict[int, list] = {}  # per prompt: logprob entries of tokens whose text is not sent yet
    offsets: dict[int, int] = {}  # per prompt: characters of the entries sent so far

    def logprobs_of(index: int) -> dict | None:
        entries = pending.pop(index, [])
        if body.logprobs is None or not entries:
            return None
        out = completion_logprobs(entries, offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + sum(len(e.text) for e in entries)
        return out

    def render(kind: str, value):
        index, value = value if isinstance(value, tuple) else (0, value)  # a query request yields bare values
        if kind == "logprob":
            pending.setdefault(index, []).append(value)
        return [envelope([choice(index, value, None, logprobs=logprobs_of(index))])] if kind == "token" else []

    def finish(result):
        outcomes = _outcomes(result)
        events = [envelope([choice(i, "", _FINISH.get(o.finish_reason, "stop"), o.citations if with_citations else None,
                                   logprobs=logprobs_of(i))])  # tokens of a stop string: never sent as text
                  for i, o in enumerate(outcomes)]
        if include_usage:
            events.append(envelope([], usage=_usage(outcomes)))
        return events

    async def events():
        try:
            async for item in sse_events(request, stream, render, finish):
                yield item
        finally:
            stream.job.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/v1/embeddings", responses={200: {"model": EmbeddingList}, **errors(400, 401, 404, 413, 503)})
async def embeddings(request: Request, body: EmbeddingRequest):
    """OpenAI embeddings from the packaged all-MiniLM-L6-v2: unit vectors."""
    state = app_state(request)
    tenant_of(request)
    if body.model != EMBEDDING_MODEL_ID:
        raise ApiError(404, "model_not_found", f"the embedding model {body.model!r} does not exist; this server serves "
                       f"{EMBEDDING_MODEL_ID!r}", param="model")
    dimension = state.runtime.embedder.dimension
    if body.dimensions is not None and body.dimensions != dimension:
        raise ApiError(400, "unsupported_parameter", f"dimensions must be {dimension} (or absent): this model's vectors "
                       "are not truncated", param="dimensions")
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    vectors, tokens = await run_job(request, state.worker, Job("embedding", embeddings_body(state.runtime, texts)))

    def encoded(vector):
        if body.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()

    return {"object": "list", "model": EMBEDDING_MODEL_ID,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
