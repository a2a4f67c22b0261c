"""The event loop's side of scheduler requests: the requests of one front-end request (one, or
one per prompt of a /v1/completions call), their events in order of arrival, then their
completions.

The scheduler reports to each request's sink on the worker thread; the sink hands every
event to the event loop (thread-safe). Cancelling the stream (the client went away, or a
sibling request failed) makes each sink report `cancelled`, and the scheduler drops the
requests, and frees their caches, before its next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from ragkv.app.logprobs import TokenLogprob
from ragkv.app.request import Request, RequestCancelled, RequestOutput, Started

OK, ERROR, CANCELLED = "ok", "error", "cancelled"


@dataclass(frozen=True)
class StreamEvent:
    kind: Literal["started", "logprob", "token"]
    index: int
    """Which of the stream's requests (the prompt's index)."""
    value: Started | TokenLogprob | str
    """`Started` for "started", a token's log-probabilities for "logprob" (before the
    "token" that carries its text; only when the generation asks for logprobs), a piece
    of text for "token"."""


class RequestStream:
    """Created on the event loop thread; its sinks are called on the worker thread."""

    def __init__(self, kind: str, requests: list[Request], on_end: Callable[[RequestStream], None] | None = None):
        """`on_end`: called (on the worker thread) once every request ended, `outcome` set."""
        if not requests:
            raise ValueError("a request stream needs at least one request")
        self.kind = kind
        self.requests = requests
        self.completions: list[RequestOutput | None] = [None] * len(requests)
        self.outcome: str | None = None
        """ok, error or cancelled, once every request ended."""
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self._cancelled = threading.Event()
        self._open = len(requests)
        self._outcomes: list[str] = []
        self._on_end = on_end
        for index, request in enumerate(requests):
            request.sink = _Sink(self, index)

    # -- event loop side -----------------------------------------------------------

    def cancel(self) -> None:
        """Drop every request of the stream at the scheduler's next step (thread-safe, idempotent)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def events(self) -> AsyncIterator[StreamEvent]:
        """Each request's "started", "logprob" and "token" events as they come; returns when every
        request finished (their completions in `completions`), raises the first failure
        (and cancels the other requests)."""
        remaining = len(self.requests)
        while remaining:
            kind, index, value = await self._events.get()
            if kind == "finished":
                self.completions[index] = value
                remaining -= 1
            elif kind == "failed":
                self.cancel()
                raise value
            else:
                yield StreamEvent(kind, index, value)

    async def wait(self) -> list[RequestOutput]:
        """Every request's completion, in the order of the requests."""
        async for _ in self.events():
            pass
        return self.completions

    # -- worker side ---------------------------------------------------------------

    def _emit(self, kind: str, index: int, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, index, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _ended(self, outcome: str) -> None:
        self._outcomes.append(outcome)
        self._open -= 1
        if self._open:
            return
        self.outcome = next((o for o in (ERROR, CANCELLED) if o in self._outcomes), OK)
        if self._on_end is not None:
            self._on_end(self)


class _Sink:
    """One request's sink (ragkv.app.request.RequestSink), tagged with its index."""

    def __init__(self, stream: RequestStream, index: int):
        self.stream = stream
        self.index = index

    @property
    def cancelled(self) -> bool:
        return self.stream.cancelled

    def started(self, started: Started) -> None:
        self.stream._emit("started", self.index, started)

    def logprob(self, entry: TokenLogprob) -> None:
        self.stream._emit("logprob", self.index, entry)

    def token(self, text: str) -> None:
        self.stream._emit("token", self.index, text)

    def finished(self, completion: RequestOutput) -> None:
        self.stream._emit("finished", self.index, completion)
        self.stream._ended(OK)

    def failed(self, error: BaseException) -> None:
        self.stream._emit("failed", self.index, error)
        self.stream._ended(CANCELLED if isinstance(error, RequestCancelled) else ERROR)
