"""POST /v1/query's answer and its retrieval event, from a scheduler RequestOutput."""

from __future__ import annotations

import time

from ragkv.api.common.serving import citations_of, usage_of
from ragkv.api.query.protocol import QueryDoneEvent, QueryResponse, QueryRetrievalEvent, QueryTokenEvent
from ragkv.api.streaming import StreamRenderer
from ragkv.app.query import Answer
from ragkv.app.request import RequestOutput, Started


def query_response(query_id: str, completion: RequestOutput, total_s: float) -> QueryResponse:
    """`total_s`: seconds from the request's arrival to its answer."""
    return QueryResponse(
        id=query_id,
        answer=completion.text,
        finish_reason=completion.finish_reason.value,
        strategy=completion.strategy,
        citations=citations_of(completion.citations),
        usage=usage_of(completion.usage),
        timings={**completion.timings.to_dict(), "total": round(total_s, 4)},
    )


def retrieval_event(query_id: str, started: Started) -> QueryRetrievalEvent:
    return QueryRetrievalEvent(
        id=query_id,
        citations=citations_of(started.citations),
        strategy=started.strategy,
        timings=started.timings.to_dict(),
    )


def answer_fields(answer: Answer) -> dict:
    """An answer of `ragkv ask` with /v1/query's field names (it has no request id)."""
    body = QueryResponse(
        id="",
        answer=answer.text,
        finish_reason=answer.finish_reason.value,
        strategy=answer.strategy,
        citations=citations_of(answer.citations),
        usage=usage_of(answer.usage),
        timings=answer.timings,
    )
    return body.model_dump(mode="json", exclude={"id"})


class QueryStream(StreamRenderer):
    """A streamed query's events: the retrieval, a token event per piece, the answer."""

    def __init__(self, query_id: str, started_s: float):
        self.query_id = query_id
        self.started_s = started_s

    def opening(self, first) -> list[QueryRetrievalEvent]:
        return [retrieval_event(self.query_id, first.value)]

    def render(self, event) -> list[QueryTokenEvent]:
        return [QueryTokenEvent(text=event.value)] if event.kind == "token" else []

    def finish(self, completions: list[RequestOutput]) -> list[QueryDoneEvent]:
        result = query_response(self.query_id, completions[0], time.perf_counter() - self.started_s)
        return [QueryDoneEvent(**result.model_dump(mode="json"))]
