"""Awaiting worker jobs from request handlers: disconnects cancel the job, errors map to 4xx.

Non-streaming requests race the job against the client's disconnect. Streaming requests
first await the job's first item (so a bad request still gets a proper 4xx status), then
stream the rest as server-sent events; when the client goes away Starlette cancels the
stream and the `finally` cancels the job, which the worker drops before its next token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from ragkv.api.errors import ApiError, ClientGone, as_api_error, error_body, request_id_of
from ragkv.api.worker import Job, JobCancelled, ModelWorker

log = logging.getLogger("ragkv.api")


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
    if isinstance(error, JobCancelled):
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


async def run_job(request: Request, worker: ModelWorker, job: Job) -> Any:
    """Submit `job` and return its result; cancel it if the client disconnects first."""
    worker.submit(job)
    try:
        return await _race(request, job.wait())
    except ClientGone:
        job.cancel()
        raise
    except asyncio.CancelledError:
        job.cancel()
        raise
    except Exception as error:
        raise _client_error(error) from None


class JobStream:
    """A submitted job whose first item has arrived; iterate `rest()` for the others."""

    def __init__(self, job: Job, iterator: AsyncIterator[Any], first: Any):
        self.job = job
        self._iterator = iterator
        self.first = first

    @classmethod
    async def start(cls, request: Request, worker: ModelWorker, job: Job) -> "JobStream":
        worker.submit(job)
        iterator = job.items().__aiter__()
        try:
            first = await _race(request, iterator.__anext__())
        except StopAsyncIteration:
            return cls(job, iterator, None)
        except (ClientGone, asyncio.CancelledError):
            job.cancel()
            raise
        except Exception as error:
            raise _client_error(error) from None
        return cls(job, iterator, first)

    async def rest(self) -> AsyncIterator[Any]:
        async for item in self._iterator:
            yield item

    @property
    def result(self) -> Any:
        return getattr(self.job, "result", None)


def sse(data: Any) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


async def sse_events(request: Request, stream: JobStream, render: Callable[[str, Any], list[Any]],
                     finish: Callable[[Any], list[Any]], encode: Callable[[Any], str] = sse,
                     done: bool = True) -> AsyncIterator[str]:
    """SSE body: `render(kind, value)` for each item, `finish(result)` at the end, then
    [DONE] (unless `done` is false). An error mid-stream becomes one error event (the status
    line is already sent). `encode` writes one event (the Responses API names its events)."""
    try:
        async for kind, value in stream.rest():
            for event in render(kind, value):
                yield encode(event)
        for event in finish(stream.result):
            yield encode(event)
        if done:
            yield sse("[DONE]")
    except asyncio.CancelledError:
        raise
    except Exception as error:
        mapped = _client_error(error)
        request_id = request_id_of(request)
        if isinstance(mapped, ApiError):
            yield sse(error_body(mapped.status, mapped.code, mapped.message, request_id))
        else:
            log.error("stream %s failed", request_id, exc_info=error)
            yield sse(error_body(500, "internal_error", f"internal error; quote request id {request_id} to the operator", request_id))
    finally:
        stream.job.cancel()  # no-op when it finished; frees the worker when the client left
