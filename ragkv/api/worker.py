"""The model worker: one thread owns the engine; requests reach it through a queue.

Two kinds of work, both seen by the event loop as a `Job` (an asyncio queue of what the
work yields, then its result or error):
  model requests  queries and chat turns: an application `Request` run by the
                  `Scheduler` (ragkv.app.scheduler), which prepares one request at a time
                  and decodes all running ones in one batched forward pass per step; the
                  job is the request's sink.
  job bodies      deletions and ingestion: a generator function run on the worker
                  thread, one `next()` per unit of work.

Each round of the worker steps the interactive job bodies once and the scheduler once.
Background jobs (ingestion) run one at a time when nothing interactive is waiting or
running; while one runs, its progress callback calls `checkpoint()`, which serves the
interactive work first (for up to `checkpoint_budget_s` between two chunks).

A job whose client went away is cancelled: the scheduler drops its request (and cache)
before its next step; a job body's generator is closed before its next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator
from typing import Any

from ragkv.api.errors import QueueFullError
from ragkv.app.request import Completion, Request, RequestCancelled
from ragkv.app.scheduler import Scheduler

log = logging.getLogger("ragkv.api.worker")

_ITEM, _DONE, _ERROR = "item", "done", "error"
_ids = itertools.count(1)


class JobCancelled(Exception):
    """Raised inside a job body (or into its awaiter) when the job was cancelled."""


class Job:
    """One unit of work for the worker, created on the event loop thread."""

    def __init__(self, kind: str, body: Callable[["Job"], Generator[Any, None, Any]] | None = None, *,
                 interactive: bool = True, request: Request | None = None):
        if (body is None) == (request is None):
            raise ValueError("a job runs either a body or a model request")
        self.id = next(_ids)
        self.request = request
        if request is not None:
            request.sink = self
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
        self._on_end: Callable[["Job"], None] | None = None

    # -- event loop side -----------------------------------------------------------

    def cancel(self) -> None:
        """Ask the worker to stop this job at its next step (thread-safe, idempotent)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def queue_seconds(self) -> float:
        return (self.started_at or time.perf_counter()) - self.submitted

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

    def _emit(self, kind: str, value: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _step(self) -> bool:
        """Advance one unit of work on the worker thread; False when the job ended."""
        if self._cancelled.is_set():
            self._finish("cancelled", _ERROR, JobCancelled(f"{self.kind} job {self.id} was cancelled"))
            return False
        try:
            if self._generator is None:
                self.started_at = time.perf_counter()
                self._generator = self._body(self)
            item = next(self._generator)
        except StopIteration as stop:
            self._finish("ok", _DONE, stop.value)
            return False
        except JobCancelled as error:
            self._finish("cancelled", _ERROR, error)
            return False
        except BaseException as error:  # handed to the awaiting request, which maps it
            self._finish("error", _ERROR, error)
            return False
        self._emit(_ITEM, item)
        return True

    def _finish(self, outcome: str, kind: str, value: Any) -> None:
        if self._generator is not None:
            try:
                self._generator.close()  # runs the body's finally blocks, drops its tensors
            except BaseException:  # a body that fails while closing must not kill the worker
                log.exception("%s job %d failed while closing", self.kind, self.id)
        self._generator = None
        self.done = True
        self.outcome = outcome
        self._emit(kind, value)

    # -- worker side, as a scheduler request's sink ----------------------------------

    def started(self, info: dict) -> None:
        self._emit(_ITEM, ("prepared", info))

    def token(self, text: str) -> None:
        self._emit(_ITEM, ("token", text))

    def logprob(self, entry) -> None:
        self._emit(_ITEM, ("logprob", entry))

    def finished(self, completion: Completion) -> None:
        self._end("ok", _DONE, completion)

    def failed(self, error: BaseException) -> None:
        if isinstance(error, RequestCancelled):
            self._end("cancelled", _ERROR, JobCancelled(str(error)))
        else:
            self._end("error", _ERROR, error)

    def _end(self, outcome: str, kind: str, value: Any) -> None:
        self.done = True
        self.outcome = outcome
        self._emit(kind, value)
        if self._on_end is not None:
            self._on_end(self)

    def check_cancelled(self) -> None:
        """For long bodies (ingestion) to call between units of work."""
        if self._cancelled.is_set():
            raise JobCancelled(f"{self.kind} job {self.id} was cancelled")


class ModelWorker:
    def __init__(self, scheduler: Scheduler | None = None, *, max_active: int = 4, max_queued: int = 64,
                 checkpoint_budget_s: float = 5.0, on_finished: Callable[[Job], None] | None = None):
        self.scheduler = scheduler
        self.max_active = max_active
        self.max_queued = max_queued
        self.checkpoint_budget_s = checkpoint_budget_s
        self._on_finished = on_finished
        self._cond = threading.Condition()
        self._interactive: deque[Job] = deque()
        self._background: deque[Job] = deque()
        self._active: list[Job] = []
        self._inbox: list[Request] = []
        self._requests: list[Job] = []
        self._stopping = False
        self._in_background = False
        self._thread: threading.Thread | None = None

    # -- any thread ----------------------------------------------------------------

    def start(self) -> None:
        """Run the worker loop on a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="ragkv-model-worker", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the worker loop on the calling thread until `stop`. The server calls it on
        the thread that built the engine: OpenMP keeps a thread pool per thread that runs
        parallel work, and with a second pool on a 2-core machine libgomp stops spinning
        between parallel regions, which made each decode step 2-3x slower."""
        self._thread = threading.current_thread()
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for job in itertools.chain(self._interactive, self._background, self._active, self._requests):
                job.cancel()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, job: Job) -> Job:
        if job.request is not None:
            return self._submit_request(job)
        with self._cond:
            if self._stopping:
                raise QueueFullError(0)
            waiting = self._waiting()
            if waiting >= self.max_queued:
                raise QueueFullError(waiting)
            (self._interactive if job.interactive else self._background).append(job)
            self._cond.notify_all()
        return job

    def _submit_request(self, job: Job) -> Job:
        """Hand a job's model request to the scheduler; the job is its sink."""
        if self.scheduler is None:
            raise RuntimeError("this worker has no scheduler")
        with self._cond:
            waiting = self._waiting()
            if self._stopping:
                raise QueueFullError(0)
            if waiting >= self.max_queued:
                raise QueueFullError(waiting)
            job.started_at = time.perf_counter()
            job._on_end = self._request_ended
            self._requests.append(job)
            self._inbox.append(job.request)
            self._cond.notify_all()
        return job

    def _request_ended(self, job: Job) -> None:
        with self._cond:
            self._requests.remove(job)
        self._finished(job)

    def _waiting(self) -> int:
        scheduled = len(self.scheduler.waiting) if self.scheduler is not None else 0
        return len(self._interactive) + len(self._background) + len(self._inbox) + scheduled

    @property
    def queued(self) -> int:
        with self._cond:
            return self._waiting()

    @property
    def active(self) -> int:
        with self._cond:
            running = len(self.scheduler.running) if self.scheduler is not None else 0
            return len(self._active) + running + (1 if self._in_background else 0)

    def _scheduler_busy(self) -> bool:
        return self.scheduler is not None and (self.scheduler.has_work or bool(self._inbox))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- worker thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._interactive or self._background or self._active
                           or self._scheduler_busy()):
                    self._cond.wait()
                if self._stopping and not (self._active or self._interactive or self._background
                                           or self._scheduler_busy()):
                    return
                self._admit()
                idle = not self._active and not self._scheduler_busy()
                background = self._background.popleft() if idle and self._background else None
            if background is not None:
                self._run_background(background)
            else:
                self._round()

    def _admit(self) -> None:
        """Move interactive jobs from the queue to the active set and new requests to the
        scheduler (caller holds the lock)."""
        while self._interactive and len(self._active) < self.max_active:
            self._active.append(self._interactive.popleft())
        for request in self._inbox:
            self.scheduler.add(request)
        self._inbox.clear()

    def _round(self) -> None:
        for job in list(self._active):
            if not job._step():
                with self._cond:
                    self._active.remove(job)
                self._finished(job)
        if self.scheduler is not None and self.scheduler.has_work:
            try:
                self.scheduler.step()
            except Exception:  # a scheduler bug must not kill the worker; the step's requests got their errors
                log.exception("scheduler step failed")

    def _run_background(self, job: Job) -> None:
        self._in_background = True
        try:
            while job._step():
                pass
        finally:
            self._in_background = False
        self._finished(job)

    def _finished(self, job: Job) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(job)
            except Exception:
                log.exception("job-finished hook failed")

    def checkpoint(self) -> None:
        """Serve interactive jobs now; called by a background job between its chunks, on
        the worker thread. Returns when none is left or the time budget is spent."""
        if threading.current_thread() is not self._thread:
            return
        deadline = time.perf_counter() + self.checkpoint_budget_s
        while time.perf_counter() < deadline:
            with self._cond:
                self._admit()
                if not self._active and not self._scheduler_busy():
                    return
            self._round()
