"""Awaiting the worker from request handlers: disconnects cancel the work, errors map to 4xx.

Non-streaming requests race the work against the client's disconnect. Streaming requests
first await the first event of their requests (so a bad request still gets a proper 4xx
status), then stream the rest as server-sent events; when the client goes away Starlette
cancels the stream and the `finally` cancels the requests, which the scheduler drops
before their next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from ragkv.api.errors import ApiError, ClientGone, as_api_error, error_body, request_id_of
from ragkv.app.errors import RequestCancelled
from ragkv.app.request import RequestOutput
from ragkv.app.server import RequestStream, StreamEvent, Task

log = logging.getLogger("ragkv.api")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Headers of every server-sent event stream: no caching, no proxy buffering."""


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the request body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _client_error(error: BaseException) -> BaseException:
    mapped = as_api_error(error)
    if mapped is not None:
        return mapped
    if isinstance(error, RequestCancelled):
        return ApiError(503, "cancelled", "the request was cancelled (server shutting down?)")
    return error  # unexpected: the 500 handler logs it


async def _race(request: Request, awaitable) -> Any:
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientGone()
    return task.result()


async def _awaited(request: Request, work: Task | RequestStream) -> Any:
    try:
        return await _race(request, work.wait())
    except (ClientGone, asyncio.CancelledError):
        work.cancel()
        raise
    except Exception as error:
        raise _client_error(error) from None


async def run_task(request: Request, task: Task) -> Any:
    """The submitted task's result; the task is cancelled if the client disconnects first."""
    return await _awaited(request, task)


async def run_requests(request: Request, stream: RequestStream) -> list[RequestOutput]:
    """The submitted stream's completions; its requests are cancelled if the client
    disconnects first."""
    return await _awaited(request, stream)


class EventStream:
    """A submitted request stream whose first event has arrived; iterate `rest()` for the others."""

    def __init__(self, stream: RequestStream, iterator: AsyncIterator[StreamEvent], first: StreamEvent | None):
        self.stream = stream
        self._iterator = iterator
        self.first = first

    @classmethod
    async def start(cls, request: Request, stream: RequestStream) -> EventStream:
        """Await the first event of a submitted stream."""
        iterator = stream.events().__aiter__()
        try:
            first = await _race(request, iterator.__anext__())
        except StopAsyncIteration:
            return cls(stream, iterator, None)
        except (ClientGone, asyncio.CancelledError):
            stream.cancel()
            raise
        except Exception as error:
            raise _client_error(error) from None
        return cls(stream, iterator, first)

    async def rest(self) -> AsyncIterator[StreamEvent]:
        async for event in self._iterator:
            yield event

    @property
    def completions(self) -> list[RequestOutput]:
        return self.stream.completions

    def cancel(self) -> None:
        self.stream.cancel()


def sse(data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class StreamRenderer:
    """How one endpoint's answer streams; the endpoint's serving module subclasses it, and
    `stream_response` is the one way every endpoint streams. Each event is a protocol model
    (the endpoint's stream chunk), written by `encode`."""

    done_marker = True
    """End the stream with `data: [DONE]` (OpenAI's chat and completions, ragkv's query)."""

    def opening(self, first: StreamEvent | None) -> list[BaseModel]:
        """Events before the first token; `first` is the stream's first event (the retrieval)."""
        return []

    def render(self, event: StreamEvent) -> list[BaseModel]:
        """Events for one event of the requests (a token, a logprob)."""
        return []

    def finish(self, completions: list[RequestOutput]) -> list[BaseModel]:
        """The last events, once every request has finished."""
        return []

    async def settle(self, completions: list[RequestOutput]) -> None:
        """Awaited before the final events (a chat turn's context reaching the shared store)."""

    def encode(self, event: BaseModel) -> str:
        return sse(event.model_dump(mode="json"))


def stream_response(
    request: Request, stream: EventStream, renderer: StreamRenderer, headers: dict[str, str] | None = None
) -> StreamingResponse:
    """The server-sent events of a started stream, as `renderer` writes them."""

    async def events() -> AsyncIterator[str]:
        try:
            for event in renderer.opening(stream.first):
                yield renderer.encode(event)
            async for item in _sse_events(request, stream, renderer):
                yield item
        finally:
            stream.cancel()  # no-op when it finished; frees the worker when the client left

    return StreamingResponse(events(), media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


async def _sse_events(request: Request, stream: EventStream, renderer: StreamRenderer) -> AsyncIterator[str]:
    """The events after the first; an error mid-stream becomes one error event (the status
    line is already sent)."""
    try:
        async for item in stream.rest():
            for event in renderer.render(item):
                yield renderer.encode(event)
        await renderer.settle(stream.completions)
        for event in renderer.finish(stream.completions):
            yield renderer.encode(event)
        if renderer.done_marker:
            yield sse("[DONE]")
    except asyncio.CancelledError:
        raise
    except Exception as error:
        yield _error_event(request, error)


def _error_event(request: Request, error: Exception) -> str:
    mapped = _client_error(error)
    request_id = request_id_of(request)
    if isinstance(mapped, ApiError):
        return sse(error_body(mapped.status, mapped.code, mapped.message, request_id))
    log.error("stream %s failed", request_id, exc_info=error)
    return sse(
        error_body(500, "internal_error", f"internal error; quote request id {request_id} to the operator", request_id)
    )
