"""POST /v1/query: one RAG question, answered with citations, token usage and timings."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from ragkv.api.auth import tenant_of
from ragkv.api.common.conversion import generation_config, query_config, sent_or_capped
from ragkv.api.json_response import SafeJSONResponse
from ragkv.api.openapi import errors, sse_or
from ragkv.api.query.protocol import QueryRequest, QueryResponse
from ragkv.api.query.serving import QueryStream, query_response
from ragkv.api.state import app_state
from ragkv.api.streaming import EventStream, run_requests, stream_response

router = APIRouter(tags=["query"], default_response_class=SafeJSONResponse)


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
    max_tokens = sent_or_capped(body, "max_tokens", limits.max_new_tokens)
    generation = generation_config(max_tokens, body.temperature, body.top_p, body.seed, body.stop, limits)
    config = query_config(body, generation, limits)
    query_id = "q_" + uuid.uuid4().hex[:20]
    work = state.client.query(body.question, tenant, config)
    started = time.perf_counter()
    if not body.stream:
        [outcome] = await run_requests(request, work)
        return query_response(query_id, outcome, time.perf_counter() - started)

    stream = await EventStream.start(request, work)
    return stream_response(request, stream, QueryStream(query_id, started))
