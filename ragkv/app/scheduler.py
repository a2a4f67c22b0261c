"""The scheduler: admits requests by a token budget, prepares them one at a time, and
decodes every running request in one batched forward pass per step.

One `step()`:
  1. drop requests whose client went away (their caches are freed);
  2. prepare at most one waiting request (retrieve + load + fuse, or a prefill), when the
     KV rows of the running requests plus its estimate fit the token budget and a batch
     row is free; so a long prepare delays the running decodes by one prepare, never more;
  3. sample the next token of every running request from its logits, report it, and run
     one `CausalLM.decode_batch` for all that continue: each weight is read once for all
     rows; attention stays per request, over its own cache;
  4. only when nothing waits and nothing runs: one piece of a live fidelity sample's full
     prefill (ragkv.app.live_fidelity), so a request that arrives meanwhile is admitted
     at the next step, after that piece at most.

Used by the API's model worker (one thread owns the engine and steps the scheduler) and by
`ragkv ask` (one request). The scheduler alone holds the waiting and running requests and
bounds the waiting ones (`max_waiting`); `add` may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from ragkv.app.live_fidelity import LiveFidelity
from ragkv.app.request import FinishReason, Request, RequestCancelled
from ragkv.engine.model import CausalLM

log = logging.getLogger("ragkv.app.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 16
    """Requests decoding at once (rows of one batched decode step)."""
    max_waiting: int = 64
    """Requests waiting to be prepared; beyond this `add` refuses (QueueFull: the API answers
    503 with Retry-After)."""
    token_budget: int = 65536
    """KV rows the running requests may hold together (prompt + answer); a waiting request
    is admitted when its estimate fits (one request is always admitted when none runs)."""
    release_window_rows: bool = True
    """Dense decodes let the sliding-window layers (Gemma 3) drop rows their window no longer
    reaches (CausalLM.decode_batch), so those layers' KV stops growing with the context."""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_waiting", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class QueueFull(Exception):
    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        eos_token_ids: set[int],
        config: SchedulerConfig = SchedulerConfig(),
        fidelity: LiveFidelity | None = None,
    ):
        """`fidelity`: samples fused requests and measures them when idle; None = never."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.fidelity = fidelity
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._lock = threading.Lock()
        """Guards `waiting`: `add` may run on another thread than `step`."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_idle_work(self) -> bool:
        """Fidelity samples to measure: `step` runs them only when there is no other work."""
        return self.fidelity is not None and self.fidelity.has_work

    def add(self, *requests: Request) -> None:
        """Queue the requests, all or none: QueueFull when they do not all fit in `max_waiting`."""
        with self._lock:
            if len(self.waiting) + len(requests) > self.config.max_waiting:
                raise QueueFull(len(self.waiting))
            self.waiting.extend(requests)

    def step(self) -> None:
        self._drop_cancelled()
        with self._lock:
            admitted = self.waiting.popleft() if self.waiting and self._can_admit(self.waiting[0]) else None
        if admitted is not None:
            self._prepare(admitted)
        if self.running:
            self._decode()
        elif admitted is None and self.has_idle_work:
            with self._lock:
                idle = not self.waiting  # a request added meanwhile goes first
            if idle:
                self.fidelity.step(self.model)

    def abort(self, reason: str) -> None:
        """Drop every request (the server is stopping): each reports RequestCancelled."""
        with self._lock:
            dropped = list(self.waiting) + self.running
            self.waiting.clear()
        self.running = []
        if self.fidelity is not None:
            self.fidelity.clear()
        for request in dropped:
            self._drop(request, RequestCancelled(f"{request.kind} request {request.id} was cancelled: {reason}"))

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    # -- the parts of a step --------------------------------------------------------

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [r for r in self.waiting if r.sink.cancelled]
            for request in gone:
                self.waiting.remove(request)
        for request in [r for r in self.running if r.sink.cancelled]:
            self.running.remove(request)
            gone.append(request)
        for request in gone:
            self._drop(request, RequestCancelled(f"{request.kind} request {request.id} was cancelled"))

    def _can_admit(self, request: Request) -> bool:
        if not self.running:
            return True
        if len(self.running) >= self.config.max_running:
            return False
        held = sum(r.held_tokens for r in self.running)
        return held + request.estimated_tokens <= self.config.token_budget

    def _prepare(self, request: Request) -> None:
        try:
            request.prepare(self.tokenizer)
        except BaseException as error:  # the request's own failure: reported to it, the others go on
            self._drop(request, error)
            return
        self.running.append(request)
        if self.fidelity is not None:
            self.fidelity.prepared(request)
        request.sink.started(request.started())

    def _decode(self) -> None:
        continuing = []
        for request in list(self.running):
            try:
                if self._advance(request):
                    continuing.append(request)
            except BaseException as error:
                if request in self.running:
                    self.running.remove(request)
                self._drop(request, error)
        if not continuing:
            return
        try:
            logits = self.model.decode_batch(
                [r.output_ids[-1] for r in continuing],
                [r.cache for r in continuing],
                [r.prepared.attention for r in continuing],
                release_window_rows=[
                    self.config.release_window_rows and r.prepared.release_window_rows for r in continuing
                ],
            )
        except BaseException as error:
            log.exception("batched decode step failed")
            for request in continuing:
                self.running.remove(request)
                self._drop(request, error)
            return
        for request, row in zip(continuing, logits):
            request.pending_logits = row

    def _advance(self, request: Request) -> bool:
        """Sample and report one token of `request`; False when it finished."""
        token = request.sample()
        first = not request.output_ids and request.timings.ttft is None
        if token in self.eos_token_ids:
            request.eos_token = token
            return self._finish(request, FinishReason.EOS, request.detokenizer.rest(), first)
        request.accept(token)
        delta, stopped = request.detokenizer.push(token)
        if stopped:
            return self._finish(request, FinishReason.STOP, delta, first)
        if len(request.output_ids) >= request.generation.max_new_tokens:
            return self._finish(request, FinishReason.LENGTH, delta + request.detokenizer.rest(), first)
        if first:
            request.first_token_sent()
        if delta:
            request.sink.token(delta)
        return True

    def _finish(self, request: Request, reason: FinishReason, delta: str, first: bool) -> bool:
        if first:
            request.first_token_sent()
        if delta:
            request.sink.token(delta)
        if self.fidelity is not None:
            self.fidelity.finished(request)
        completion = request.finish(reason)
        self.running.remove(request)
        request.sink.finished(completion)
        return False

    def _drop(self, request: Request, error: BaseException) -> None:
        if self.fidelity is not None:
            self.fidelity.forget(request)
        try:
            request.drop()
        except Exception:
            log.exception("request %d failed while being dropped", request.id)
        request.sink.failed(error)
