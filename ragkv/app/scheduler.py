"""The scheduler: admits requests by a token budget, prepares them one at a time, and
decodes every running request in one batched forward pass per step.

One `step()`:
  1. drop requests whose client went away (their caches are freed);
  2. prepare at most one waiting request (retrieve + load + fuse, or a prefill), when the
     KV rows of the running requests plus its estimate fit the token budget and a batch
     row is free; so a long prepare delays the running decodes by one prepare, never more;
  3. sample the next token of every running request from its logits, report it, and run
     one `CausalLM.decode_batch` for all that continue: each weight is read once for all
     rows; attention stays per request, over its own cache.

Used by the API's model worker (one thread owns the engine) and by `ragkv ask` (one request).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from ragkv.app.request import Request, RequestCancelled
from ragkv.engine.model import CausalLM

log = logging.getLogger("ragkv.app.scheduler")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 16
    """Requests decoding at once (rows of one batched decode step)."""
    max_waiting: int = 64
    """Requests waiting to be prepared; beyond this `add` refuses (the API answers 503)."""
    token_budget: int = 65536
    """KV rows the running requests may hold together (prompt + answer); a waiting request
    is admitted when its estimate fits (one request is always admitted when none runs)."""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_waiting", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class QueueFull(Exception):
    def __init__(self, waiting: int):
        super().__init__(f"{waiting} requests are waiting")
        self.waiting = waiting


class Scheduler:
    def __init__(self, model: CausalLM, tokenizer, eos_token_ids: set[int], config: SchedulerConfig = SchedulerConfig()):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(len(self.waiting))
        self.waiting.append(request)

    def step(self) -> None:
        self._drop_cancelled()
        if self.waiting and self._can_admit(self.waiting[0]):
            self._prepare(self.waiting.popleft())
        if self.running:
            self._decode()

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    # -- the parts of a step --------------------------------------------------------

    def _drop_cancelled(self) -> None:
        for queue in (self.waiting, self.running):
            for request in [r for r in queue if r.sink.cancelled]:
                queue.remove(request)
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
        request.sink.started({"citations": request.prepared.citations, "strategy": request.prepared.strategy,
                              "timings": request.timings.to_dict(), **request.prepared.info})

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
            logits = self.model.decode_batch([r.output_ids[-1] for r in continuing], [r.cache for r in continuing],
                                             [r.prepared.attention for r in continuing])
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
            return self._finish(request, "eos", request.detokenizer.rest(), first)
        request.accept(token)
        delta, stopped = request.detokenizer.push(token)
        if stopped:
            return self._finish(request, "stop", delta, first)
        if len(request.output_ids) >= request.generation.max_new_tokens:
            return self._finish(request, "length", delta + request.detokenizer.rest(), first)
        if first:
            request.first_token_sent()
        if delta:
            request.sink.token(delta)
        return True

    def _finish(self, request: Request, reason: str, delta: str, first: bool) -> bool:
        if first:
            request.first_token_sent()
        if delta:
            request.sink.token(delta)
        completion = request.finish(reason)
        self.running.remove(request)
        request.sink.finished(completion)
        return False

    def _drop(self, request: Request, error: BaseException) -> None:
        try:
            request.drop()
        except Exception:
            log.exception("request %d failed while being dropped", request.id)
        request.sink.failed(error)
