"""POST /v1/query: one RAG question, answered with citations, token usage and timings."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from ragkv.api.auth import tenant_of
from ragkv.api.openapi import errors, sse_or
from ragkv.api.protocol.query import QueryResponse
from ragkv.api.responses import SafeJSONResponse
from ragkv.api.schemas import QueryRequest, generation_config, query_config
from ragkv.api.serving.query import query_response, retrieval_event
from ragkv.api.state import app_state
from ragkv.api.streaming import EventStream, run_requests, sse, sse_events
from ragkv.app.request import RequestOutput

router = APIRouter(tags=["query"], default_response_class=SafeJSONResponse)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post(
    "/v1/query",
    response_model=QueryResponse,
    responses={
        **sse_or(QueryResponse, "the answer, or with stream: true server-sent events"),
        **errors(400, 401, 404, 413, 503),
    },
)
async def query(request: Request, body: QueryRequest):
    """Retrieve, fuse and answer. With `stream: true` the answer comes as server-sent events:
    {"type": "retrieval", citations, timings}, then {"type": "token", "text"} per token, then
    {"type": "done", answer, usage, timings, ...}, then [DONE]."""
    state = app_state(request)
    tenant = tenant_of(request)
    limits = state.config
    generation = generation_config(body.max_tokens, body.temperature, body.top_p, body.seed, body.stop, limits)
    config = query_config(body, generation, limits)
    query_id = "q_" + uuid.uuid4().hex[:20]
    work = state.work.query_stream(body.question, tenant, config)
    started = time.perf_counter()
    if not body.stream:
        [outcome] = await run_requests(request, state.worker, work)
        return query_response(query_id, outcome, time.perf_counter() - started)

    stream = await EventStream.start(request, state.worker, work)

    def render(event):
        if event.kind == "token":
            return [{"type": "token", "text": event.value}]
        return []

    def finish(completions: list[RequestOutput]):
        result = query_response(query_id, completions[0], time.perf_counter() - started)
        return [{"type": "done", **result.model_dump(mode="json")}]

    async def events():
        try:
            yield sse(retrieval_event(query_id, stream.first.value).model_dump(mode="json"))
            async for chunk in sse_events(request, stream, render, finish):
                yield chunk
        finally:
            stream.cancel()

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
