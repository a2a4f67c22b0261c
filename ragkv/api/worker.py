"""The model worker: one thread owns the engine and runs everything that touches it.

Two kinds of work, two types on the event loop's side:
  requests  queries, chat turns and completions: application `Request`s that the
            `Scheduler` (ragkv.app.scheduler) holds, waiting then running: it prepares
            one at a time and decodes all running ones in one batched forward pass per
            step. It alone bounds the waiting requests (full: 503 with Retry-After). The
            event loop awaits them through a `RequestStream` (api.request_stream).
  tasks     deletions, embeddings and ingestion: generator bodies (api.task.Task), one
            `next()` per unit of work; at most `max_queued` wait.

Each round of the worker steps the interactive tasks once and the scheduler once.
Background tasks (ingestion) run one at a time when nothing interactive is waiting or
running; the scheduler's idle work (live fidelity samples) runs only when nothing else
does, one piece per round; while one runs, its progress callback calls `checkpoint()`, which serves the
interactive work first (for up to `checkpoint_budget_s` between two chunks).

Cancelled work raises RequestCancelled: the scheduler drops a cancelled request (and its
cache) before its next step; a task's generator is closed before its next step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from ragkv.api.errors import QueueFullError
from ragkv.api.request_stream import RequestStream
from ragkv.api.task import Task
from ragkv.app.scheduler import QueueFull, Scheduler

log = logging.getLogger("ragkv.api.worker")


class ModelWorker:
    def __init__(
        self,
        scheduler: Scheduler | None = None,
        *,
        max_active: int = 4,
        max_queued: int = 64,
        checkpoint_budget_s: float = 5.0,
        on_finished: Callable[[Task], None] | None = None,
    ):
        """`max_active`: interactive tasks stepped in turn; `max_queued`: tasks waiting
        (requests wait in the scheduler, bounded by its `max_waiting`); `on_finished`:
        called with each task that ended."""
        self.scheduler = scheduler
        self.max_active = max_active
        self.max_queued = max_queued
        self.checkpoint_budget_s = checkpoint_budget_s
        self._on_finished = on_finished
        self._cond = threading.Condition()
        self._interactive: deque[Task] = deque()
        self._background: deque[Task] = deque()
        self._active: list[Task] = []
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
        between parallel regions, which makes each decode step several times slower."""
        self._thread = threading.current_thread()
        self._run()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            for task in itertools.chain(self._interactive, self._background, self._active):
                task.cancel()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, task: Task) -> Task:
        with self._cond:
            waiting = len(self._interactive) + len(self._background)
            if self._stopping:
                raise QueueFullError(0)
            if waiting >= self.max_queued:
                raise QueueFullError(waiting)
            (self._interactive if task.interactive else self._background).append(task)
            self._cond.notify_all()
        return task

    def submit_requests(self, stream: RequestStream) -> RequestStream:
        """Hand a stream's requests to the scheduler (all or none)."""
        if self.scheduler is None:
            raise RuntimeError("this worker has no scheduler")
        with self._cond:
            if self._stopping:
                raise QueueFullError(0)
            try:
                self.scheduler.add(*stream.requests)
            except QueueFull as full:
                raise QueueFullError(full.waiting) from None
            self._cond.notify_all()
        return stream

    @property
    def queued(self) -> int:
        """Requests and tasks waiting."""
        with self._cond:
            scheduled = len(self.scheduler.waiting) if self.scheduler is not None else 0
            return len(self._interactive) + len(self._background) + scheduled

    @property
    def active(self) -> int:
        with self._cond:
            running = len(self.scheduler.running) if self.scheduler is not None else 0
            return len(self._active) + running + (1 if self._in_background else 0)

    def _scheduler_busy(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_work

    def _scheduler_idle_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_idle_work

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- worker thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopping
                    or self._interactive
                    or self._background
                    or self._active
                    or self._scheduler_busy()
                    or self._scheduler_idle_work()
                ):
                    self._cond.wait()
                stopping = self._stopping
            if stopping and self.scheduler is not None:
                self.scheduler.abort("the server is stopping")
            with self._cond:
                if self._stopping and not (
                    self._active or self._interactive or self._background or self._scheduler_busy()
                ):
                    return
                self._admit()
                idle = not self._active and not self._scheduler_busy()
                background = self._background.popleft() if idle and self._background else None
            if background is not None:
                self._run_background(background)
            else:
                self._round()

    def _admit(self) -> None:
        """Move interactive tasks from the queue to the active set (caller holds the lock)."""
        while self._interactive and len(self._active) < self.max_active:
            self._active.append(self._interactive.popleft())

    def _round(self) -> None:
        for task in list(self._active):
            if not task.step():
                with self._cond:
                    self._active.remove(task)
                self._finished(task)
        idle_work = not self._active and not self._in_background and self._scheduler_idle_work()
        if self._scheduler_busy() or idle_work:
            try:
                self.scheduler.step()
            except Exception:  # a scheduler bug must not kill the worker; the step's requests got their errors
                log.exception("scheduler step failed")

    def _run_background(self, task: Task) -> None:
        self._in_background = True
        try:
            while task.step():
                pass
        finally:
            self._in_background = False
        self._finished(task)

    def _finished(self, task: Task) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(task)
            except Exception:
                log.exception("task-finished hook failed")

    def checkpoint(self) -> None:
        """Serve interactive work now; called by a background task between its chunks, on
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
