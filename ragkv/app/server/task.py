"""A task: work of the model worker that is not a scheduler request (deleting a document,
embedding texts, ingesting a document), run as a generator body on the worker thread, one
`next()` per unit of work.

Created on the event loop thread, which awaits what the body yields, then its return value
or its error. A cancelled task's body gets RequestCancelled at the step it stopped at and
is closed, so a long body (ingestion) yields between units of work and ends there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

from ragkv.app.request import RequestCancelled

log = logging.getLogger("ragkv.app.server.task")

_ITEM, _DONE, _ERROR = "item", "done", "error"
_ids = itertools.count(1)


class Task:
    def __init__(self, kind: str, body: Callable[[Task], Generator[Any, None, Any]], *, interactive: bool = True):
        """`interactive`: served beside the requests (a deletion, embeddings); False: a
        background task (ingestion), started when nothing interactive waits or runs and
        then stepped between the interactive work (ModelWorker)."""
        self.id = next(_ids)
        self.kind = kind
        self.interactive = interactive
        self._body = body
        self._generator: Generator[Any, None, Any] | None = None
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.started_at: float | None = None
        self.done = False
        self.outcome: str | None = None
        """ok, error or cancelled, once the task ended."""

    # -- event loop side -----------------------------------------------------------

    def cancel(self) -> None:
        """Ask the worker to stop this task at its next step (thread-safe, idempotent)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    async def items(self) -> AsyncIterator[Any]:
        """What the body yields, in order; raises what the body raised. The body's return
        value is left in `self.result`."""
        while True:
            kind, value = await self._events.get()
            if kind == _ITEM:
                yield value
            elif kind == _DONE:
                self.result = value
                return
            else:
                raise value

    async def wait(self) -> Any:
        """Run to the end, discarding yielded items; the body's return value."""
        async for _ in self.items():
            pass
        return self.result

    # -- worker side ---------------------------------------------------------------

    def step(self) -> bool:
        """Advance one unit of work (on the worker thread); False when the task ended."""
        if self._cancelled.is_set():
            error = RequestCancelled(f"{self.kind} task {self.id} was cancelled")
            self._throw(error)
            self._finish("cancelled", _ERROR, error)
            return False
        try:
            if self._generator is None:
                self.started_at = time.perf_counter()
                self._generator = self._body(self)
            item = next(self._generator)
        except StopIteration as stop:
            self._finish("ok", _DONE, stop.value)
            return False
        except RequestCancelled as error:
            self._finish("cancelled", _ERROR, error)
            return False
        except BaseException as error:  # handed to the awaiting request, which maps it
            self._finish("error", _ERROR, error)
            return False
        self._emit(_ITEM, item)
        return True

    def _throw(self, error: RequestCancelled) -> None:
        """Raise the cancellation inside a started body, at the step it stopped at, so its
        handlers see it (a background ingestion's job record says cancelled)."""
        if self._generator is None:
            return
        try:
            self._generator.throw(error)
        except (RequestCancelled, StopIteration):
            pass
        except BaseException:  # a body that fails while cancelled must not kill the worker
            log.exception("%s task %d failed while cancelled", self.kind, self.id)

    def _emit(self, kind: str, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _finish(self, outcome: str, kind: str, value: Any) -> None:
        if self._generator is not None:
            try:
                self._generator.close()  # runs the body's finally blocks, drops its tensors
            except BaseException:  # a body that fails while closing must not kill the worker
                log.exception("%s task %d failed while closing", self.kind, self.id)
        self._generator = None
        self.done = True
        self.outcome = outcome
        self._emit(kind, value)
