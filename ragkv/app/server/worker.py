"""The model worker: one thread owns the engine and runs everything that touches it, in
one loop.

Two kinds of work, two types on the event loop's side:
  requests  queries, chat turns and completions: application `Request`s that the
            `Scheduler` (ragkv.app.scheduler) holds, waiting then running: it prepares
            one at a time and decodes all running ones in one batched forward pass per
            step. It alone bounds the waiting requests (full: 503 with Retry-After). The
            event loop awaits them through a `RequestStream` (app.server.request_stream).
  tasks     deletions, embeddings and ingestion: generator bodies (app.server.task.Task), one
            `next()` per unit of work (an ingestion: one batch of chunk encodes); at most
            `max_queued` wait. Either is refused with `QueueFull` when its queue is full or
            the worker is stopping (the API answers 503 with Retry-After).

Each round of the loop is decided by `plan_round` (pure: the tasks and the scheduler's
state in, a `Round` out), then run: every active interactive task steps once, the
background task (ingestion, one at a time) steps once when nothing interactive waits or
runs, or when it has waited `background_wait_s` since its last step (so a long ingestion
goes on between decode steps and decoding requests keep their pace during it), and the
scheduler steps once; its idle work (live fidelity samples) runs only when there is no
other work. Nothing steps the loop from inside a task.

Cancelled work raises RequestCancelled: the scheduler drops a cancelled request (and its
cache) before its next step; a task's generator is closed before its next step.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ragkv.app.scheduler import QueueFull, Scheduler
from ragkv.app.server.request_stream import RequestStream
from ragkv.app.server.task import Task

log = logging.getLogger("ragkv.app.server.worker")


@dataclass(frozen=True)
class LoopState:
    """What the worker loop decides a round from (a snapshot taken under its lock)."""

    active: Sequence[Task] = ()
    """Interactive tasks admitted (at most `max_active`)."""
    background: Task | None = None
    """The background task under way (started, not ended)."""
    queued_background: Task | None = None
    """The next background task waiting to start."""
    scheduler_busy: bool = False
    """Requests wait or run."""
    scheduler_idle_work: bool = False
    """The scheduler has idle work (live fidelity samples)."""
    background_waited_s: float = 0.0
    """Seconds since the background task's last step."""


@dataclass(frozen=True)
class Round:
    """What one round of the worker loop runs."""

    tasks: tuple[Task, ...] = ()
    """Interactive tasks, each stepped once."""
    background: Task | None = None
    """The background task stepped once (started first when it was queued)."""
    scheduler: bool = False
    """One scheduler step (its requests, or its idle work)."""


def plan_round(state: LoopState, background_wait_s: float) -> Round:
    """The next round. Interactive work (tasks, requests) goes first; a background task
    starts when there is none, and once started it also steps when it has waited
    `background_wait_s`, so it ends even under steady load. Idle work runs alone."""
    interactive = bool(state.active) or state.scheduler_busy
    background = None
    if state.background is not None:
        if not interactive or state.background_waited_s >= background_wait_s:
            background = state.background
    elif state.queued_background is not None and not interactive:
        background = state.queued_background
    anything = interactive or state.background is not None or state.queued_background is not None
    return Round(tuple(state.active), background, state.scheduler_busy or (state.scheduler_idle_work and not anything))


class ModelWorker:
    def __init__(
        self,
        scheduler: Scheduler | None = None,
        *,
        max_active: int = 4,
        max_queued: int = 64,
        background_wait_s: float = 5.0,
        on_finished: Callable[[Task], None] | None = None,
    ):
        """`max_active`: interactive tasks stepped in turn; `max_queued`: tasks waiting
        (requests wait in the scheduler, bounded by its `max_waiting`); `background_wait_s`:
        the longest a started background task waits for interactive work between two of its
        steps; `on_finished`: called with each task that ended."""
        self.scheduler = scheduler
        self.max_active = max_active
        self.max_queued = max_queued
        self.background_wait_s = background_wait_s
        self._on_finished = on_finished
        self._cond = threading.Condition()
        self._interactive: deque[Task] = deque()
        self._background: deque[Task] = deque()
        self._active: list[Task] = []
        self._stopping = False
        self._current: Task | None = None
        """The background task under way."""
        self._current_stepped = 0.0
        """perf_counter() at the end of its last step."""
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
            current = [self._current] if self._current is not None else []
            for task in itertools.chain(self._interactive, self._background, self._active, current):
                task.cancel()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def submit(self, task: Task) -> Task:
        with self._cond:
            waiting = len(self._interactive) + len(self._background)
            if self._stopping:
                raise QueueFull(0)
            if waiting >= self.max_queued:
                raise QueueFull(waiting)
            (self._interactive if task.interactive else self._background).append(task)
            self._cond.notify_all()
        return task

    def submit_requests(self, stream: RequestStream) -> RequestStream:
        """Hand a stream's requests to the scheduler (all or none)."""
        if self.scheduler is None:
            raise RuntimeError("this worker has no scheduler")
        with self._cond:
            if self._stopping:
                raise QueueFull(0)
            self.scheduler.add(*stream.requests)
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
            return len(self._active) + running + (1 if self._current is not None else 0)

    def wake(self) -> None:
        """Look at the work again (a waiting request's inputs were fetched: app.server.prefetch)."""
        with self._cond:
            self._cond.notify_all()

    def _scheduler_busy(self) -> bool:
        """A scheduler step has work: requests fetched ahead are not work until fetched."""
        return self.scheduler is not None and self.scheduler.has_ready_work

    def _scheduler_idle_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_idle_work

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- worker thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._has_work() or self._scheduler_idle_work()):
                    self._cond.wait()
                stopping = self._stopping
            if stopping and self.scheduler is not None:
                self.scheduler.abort("the server is stopping")
            with self._cond:
                if self._stopping and not self._has_work():
                    return
                plan = plan_round(self._state(), self.background_wait_s)
                if plan.background is not None and plan.background is not self._current:
                    self._current = self._background.popleft()  # the queued one starts
            self._run_round(plan)

    def _has_work(self) -> bool:
        """Tasks or requests to run (caller holds the lock)."""
        queued = self._interactive or self._background or self._active
        return bool(queued) or self._current is not None or self._scheduler_busy()

    def _state(self) -> LoopState:
        """The loop's state, interactive tasks admitted first (caller holds the lock)."""
        while self._interactive and len(self._active) < self.max_active:
            self._active.append(self._interactive.popleft())
        return LoopState(
            tuple(self._active),
            self._current,
            self._background[0] if self._background else None,
            self._scheduler_busy(),
            self._scheduler_idle_work(),
            time.perf_counter() - self._current_stepped,
        )

    def _run_round(self, plan: Round) -> None:
        for task in plan.tasks:
            if not task.step():
                with self._cond:
                    self._active.remove(task)
                self._finished(task)
        if plan.background is not None:
            going = plan.background.step()
            self._current_stepped = time.perf_counter()
            if not going:
                with self._cond:
                    self._current = None
                self._finished(plan.background)
        if plan.scheduler:
            try:
                self.scheduler.step()
            except Exception:  # a scheduler bug must not kill the worker; the step's requests got their errors
                log.exception("scheduler step failed")

    def _finished(self, task: Task) -> None:
        if self._on_finished is not None:
            try:
                self._on_finished(task)
            except Exception:
                log.exception("task-finished hook failed")
