"""The scheduler: admits requests by a token budget, prepares them one at a time, and
decodes every running request in one batched forward pass per step.

A step is decided, then done:
  `schedule()`  a pure function of the waiting and running requests and the config: the
                `StepPlan` says which requests to drop (their client went away), which ONE
                waiting request to prepare (when the KV rows of the running requests plus
                its estimate fit the token budget and a batch row is free; so a long
                prepare delays the running decodes by one prepare, never more), which rows
                the batch decodes, and whether the step is idle;
  `execute()`   drops the dropped (their caches are freed), prepares the admitted one
                (retrieve + load + fuse, or a prefill), then post-processes the last
                forward pass (samples the next token of every row from its logits, reports
                it, finishes what ends) and runs the model side: one
                `CausalLM.decode_batch` for the rows that continue (each weight is read
                once for all rows; attention stays per request, over its own cache);
                an idle step (nothing waits, nothing runs) runs one piece of a live
                fidelity sample's full prefill instead (ragkv.app.live_fidelity), so a
                request that arrives meanwhile is admitted at the next step, after that
                piece at most.

With a prefetch stage (ragkv.app.server.prefetch) the requests' fetch parts (retrieval,
store reads, span look-ups) run ahead on its thread: `schedule` admits the first waiting
request whose fetch has finished, and the prepare on the model thread only computes.
Without one, a request's fetch runs inline in its prepare.

Used by the API's model worker (one thread owns the engine and steps the scheduler in its
one loop, beside the tasks) and by `ragkv ask` (one request). The scheduler alone holds the
waiting and running requests and bounds the waiting ones (`max_waiting`); `add` may be
called from any thread. `model` needs only `decode_batch`, so the admission and batching
rules are tested with a stand-in model.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ragkv.app.errors import QueueFull
from ragkv.app.live_fidelity import LiveFidelity
from ragkv.app.prefill_steps import SteppedPreparation
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
    max_num_batched_tokens: int = 512
    """Tokens one step computes: a preparation's prefill (or fusion recompute) runs a piece
    of at most this less the step's decode rows per step, beside the running decodes
    (ragkv.app.prefill_steps); with none decoding it runs whole; 0 = each preparation runs
    whole in one step."""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_waiting", "token_budget"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_num_batched_tokens < 0:
            raise ValueError("max_num_batched_tokens must be >= 0")


@dataclass(frozen=True)
class StepPlan:
    """What one scheduler step does, decided before anything runs."""

    drop: tuple[Request, ...] = ()
    """Waiting or running requests whose client went away: dropped, their caches freed."""
    prepare: Request | None = None
    """The one waiting request admitted this step (prepared, then decoded with the others)."""
    decode: tuple[Request, ...] = ()
    """The rows of this step's batch: the running requests that stay, then `prepare`."""
    idle: bool = False
    """Nothing waits and nothing runs, and there is idle work: one piece of it runs."""


class Prefetch(Protocol):
    """Runs waiting requests' fetch parts ahead of admission (ragkv.app.server.prefetch)."""

    def submit(self, request: Request) -> None: ...

    def release(self, request: Request) -> None: ...


WHOLE = 1 << 40
"""A step's room when no request decodes beside the preparation: all of what is left."""


def admits(request: Request, running: Sequence[Request], config: SchedulerConfig) -> bool:
    """Whether `request` may start beside `running`: a free batch row and room in the token
    budget for its estimate (one request is always admitted when none runs)."""
    if not running:
        return True
    if len(running) >= config.max_running:
        return False
    held = sum(r.held_tokens for r in running)
    return held + request.estimated_tokens <= config.token_budget


def schedule(
    waiting: Sequence[Request],
    running: Sequence[Request],
    config: SchedulerConfig,
    idle_work: bool = False,
    prefetched: bool = False,
    preparing: Request | None = None,
) -> StepPlan:
    """The next step's plan; reads the requests (their sinks, held and estimated tokens)
    and changes nothing. `prefetched`: a prefetch stage fetches the waiting requests' inputs,
    and only those fetched are admitted (else a fetch runs in its request's prepare).
    `preparing`: a preparation under way in pieces; no other starts until it ends (it goes
    on in `execute`)."""
    drop = tuple(r for r in (*waiting, *running, *([preparing] if preparing else [])) if r.sink.cancelled)
    queue = [r for r in waiting if r not in drop]  # each sink read once: a cancel may come meanwhile
    rows = tuple(r for r in running if r not in drop)
    busy = preparing is not None and preparing not in drop
    ready = next((r for r in queue if r.ready or not prefetched), None)
    prepare = ready if ready is not None and not busy and admits(ready, rows, config) else None
    decode = (*rows, prepare) if prepare is not None else rows
    return StepPlan(drop, prepare, decode, idle=idle_work and not queue and not rows and not busy)


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        eos_token_ids: set[int],
        config: SchedulerConfig = SchedulerConfig(),
        fidelity: LiveFidelity | None = None,
        prefetch: Prefetch | None = None,
    ):
        """`fidelity`: samples fused requests and measures them when idle; None = never.
        `prefetch`: runs the requests' fetch parts ahead; None = inline in their prepare."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.config = config
        self.fidelity = fidelity
        self.prefetch = prefetch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preparing: SteppedPreparation | None = None
        """The preparation under way, a piece per step (max_num_batched_tokens > 0)."""
        self.prefill_pieces = 0
        """Steps that ran a piece of a preparation which then paused for the next step (the
        steps where running requests decoded beside a part of a long prefill or recompute)."""
        self._lock = threading.Lock()
        """Guards `waiting`: `add` may run on another thread than `step`."""

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preparing)

    @property
    def has_ready_work(self) -> bool:
        """A step would do something now: requests run, a preparation is under way in pieces,
        or one waiting is fetched (or gone)."""
        if self.prefetch is None or self.running or self.preparing is not None:
            return self.has_work
        with self._lock:
            return any(r.ready or r.sink.cancelled for r in self.waiting)

    @property
    def has_idle_work(self) -> bool:
        """Fidelity samples to measure: `step` runs them only when there is no other work."""
        return self.fidelity is not None and self.fidelity.has_work and not self.waiting

    def add(self, *requests: Request) -> None:
        """Queue the requests, all or none: QueueFull when they do not all fit in `max_waiting`."""
        with self._lock:
            if len(self.waiting) + len(requests) > self.config.max_waiting:
                raise QueueFull(len(self.waiting))
            self.waiting.extend(requests)
        if self.prefetch is not None:
            for request in requests:
                self.prefetch.submit(request)

    def step(self) -> StepPlan:
        """Decide the next step (`schedule`), take its requests off the queues, run it."""
        with self._lock:
            preparing = self.preparing.request if self.preparing is not None else None
            plan = schedule(
                self.waiting, self.running, self.config, self.has_idle_work, self.prefetch is not None, preparing
            )
            for request in plan.drop:
                if request is not preparing:
                    (self.waiting if request in self.waiting else self.running).remove(request)
            if plan.prepare is not None:
                self.waiting.remove(plan.prepare)
        self.execute(plan)
        return plan

    def execute(self, plan: StepPlan) -> None:
        """Run a plan that `step` took off the queues: drops, the prepare, then the batch."""
        for request in plan.drop:
            self._drop(request, RequestCancelled(f"{request.kind} request {request.id} was cancelled"))
        if plan.prepare is not None and not self.config.max_num_batched_tokens:
            self._prepare(plan.prepare)
        elif plan.prepare is not None:
            self.preparing = SteppedPreparation(plan.prepare, self.tokenizer, self.model.pass_cost)
        ready = self._prepare_piece(len(plan.decode) - (plan.prepare is not None))
        rows = [r for r in plan.decode if r in self.running]  # a prepare that failed is gone
        rows += [ready] if ready is not None and ready not in rows else []
        if rows:
            self._decode(self._postprocess(rows))
        elif plan.idle:
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
        if self.preparing is not None:
            dropped.append(self.preparing.request)  # stopped by _drop
        if self.fidelity is not None:
            self.fidelity.clear()
        for request in dropped:
            self._drop(request, RequestCancelled(f"{request.kind} request {request.id} was cancelled: {reason}"))

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()

    # -- the parts of a step --------------------------------------------------------

    def _prepare(self, request: Request) -> None:
        try:
            request.prepare(self.tokenizer)
        except BaseException as error:  # the request's own failure: reported to it, the others go on
            self._drop(request, error)
            return
        finally:
            self._release_fetched(request)
        self._started(request)

    def _prepare_piece(self, decode_rows: int) -> Request | None:
        """One piece of the preparation under way, in the room the step's decode rows
        leave; the request once it is prepared (it then decodes in this step)."""
        preparation = self.preparing
        if preparation is None:
            return None
        try:
            # with no answer decoding there is no one to keep waiting: the rest runs whole
            # (no request starts decoding while a preparation is under way)
            room = self.config.max_num_batched_tokens - decode_rows if decode_rows > 0 else WHOLE
            if not preparation.advance(room):
                self.prefill_pieces += 1
                return None
        except BaseException as error:  # the request's own failure: reported to it, the others go on
            self.preparing = None
            self._drop(preparation.request, error)
            return None
        self.preparing = None
        self._release_fetched(preparation.request)
        self._started(preparation.request)
        return preparation.request

    def _started(self, request: Request) -> None:
        self.running.append(request)
        if self.fidelity is not None:
            self.fidelity.prepared(request)
        request.sink.started(request.started())

    def _postprocess(self, rows: list[Request]) -> list[Request]:
        """Sample and report the next token of each row from the last forward pass's
        logits; the rows that continue (the others finished, or failed and were dropped)."""
        continuing = []
        for request in rows:
            try:
                if self._advance(request):
                    continuing.append(request)
            except BaseException as error:
                if request in self.running:
                    self.running.remove(request)
                self._drop(request, error)
        return continuing

    def _decode(self, rows: list[Request]) -> None:
        """The model side: one batched decode step for `rows`, their next logits kept."""
        if not rows:
            return
        try:
            logits = self.model.decode_batch(
                [r.output_ids[-1] for r in rows],
                [r.cache for r in rows],
                [r.prepared.attention for r in rows],
                release_window_rows=[self.config.release_window_rows and r.prepared.release_window_rows for r in rows],
            )
        except BaseException as error:
            log.exception("batched decode step failed")
            for request in rows:
                self.running.remove(request)
                self._drop(request, error)
            return
        for request, row in zip(rows, logits):
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

    def _release_fetched(self, request: Request) -> None:
        if self.prefetch is not None:
            self.prefetch.release(request)

    def _drop(self, request: Request, error: BaseException) -> None:
        self._release_fetched(request)
        if self.preparing is not None and self.preparing.request is request:
            self.preparing.cancel(error)
            self.preparing = None
        if self.fidelity is not None:
            self.fidelity.forget(request)
        try:
            request.drop()
        except Exception:
            log.exception("request %d failed while being dropped", request.id)
        request.sink.failed(error)
