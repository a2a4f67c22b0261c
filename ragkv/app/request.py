"""A request's typed state as the scheduler moves it through its phases.

    WAITING ─► (FETCHED: its `fetch` read its inputs, no model) ─►
    PREPARING (fuse / prefill: the request's `prepare`, model only) ─►
    DECODING (one row of the batched decode step per token) ─► FINISHED

A kind splits its preparation in two: `fetch` (tokenize, retrieve, span look-ups, store
reads; any thread, ahead of admission: ragkv.app.server.prefetch) gives a `Fetched`, and
`prepare` (the model thread) computes from it. Without a prefetch stage the fetch runs
inline, just before the prepare.

What a request produces goes to its `RequestSink` (the API's request stream, or a
collector for the CLI): `started` once the first token's logits exist, `token` per piece
of text, `finished` with the `RequestOutput`, or `failed`. A sink whose client went away
reports `cancelled`; the scheduler then drops the request and its cache.

Every kind of request (a RAG query, a chat turn, a plain completion) is one `Request`
with its own `prepare`; what a kind reports beyond the shared fields is its `RequestInfo`.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ragkv.app.detokenizer import Detokenizer
from ragkv.app.logprobs import TokenLogprob, token_logprob
from ragkv.app.usage import Timings, TokenUsage
from ragkv.engine.generation import GenerationConfig
from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import DecodeAttention
from ragkv.engine.sampling import Sampler
from ragkv.fusion import FusionResult

_ids = itertools.count(1)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREPARING = "preparing"
    DECODING = "decoding"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    """Why a request stopped generating."""

    EOS = "eos"
    """The model ended its answer (an end-of-sequence token)."""
    STOP = "stop"
    """A stop string was reached (it is not part of the text)."""
    LENGTH = "length"
    """max_new_tokens were generated."""


class RequestCancelled(Exception):
    """The client went away (or the server is stopping); the work was dropped. The one
    cancellation of the server: scheduler requests and the worker's tasks raise it."""


@dataclass
class RequestInfo:
    """What one kind of request reports beside the shared fields; each kind subclasses it
    (ragkv.app.query.QueryInfo, ragkv.app.chat.turn.ChatInfo)."""


@dataclass
class Fetched:
    """What a request's `fetch` read ahead of the model; each kind subclasses it
    (ragkv.app.query.QueryFetch, ragkv.app.completion.CompletionFetch, ragkv.app.chat.turn.ChatFetch)."""

    nbytes: int = 0
    """Bytes it holds (stored K/V read), for the prefetch stage's bound on bytes in flight."""


@dataclass(frozen=True)
class Started:
    """What a request reports once its prompt is ready (before its first token)."""

    citations: list
    strategy: str
    timings: Timings
    """A copy, taken when the request started."""
    info: RequestInfo | None


class RequestSink(Protocol):
    @property
    def cancelled(self) -> bool: ...

    def started(self, started: Started) -> None: ...

    def token(self, text: str) -> None: ...

    # Optional: `logprob(entry)` with each accepted token's TokenLogprob, before its text
    # reaches `token` (only when the generation asks for logprobs).

    def finished(self, completion: RequestOutput) -> None: ...

    def failed(self, error: BaseException) -> None: ...


@dataclass
class Prepared:
    """A cache whose last row produced `logits`: what `prepare` hands the scheduler."""

    cache: KVCache
    logits: torch.Tensor
    usage: TokenUsage
    strategy: str
    citations: list = field(default_factory=list)
    attention: DecodeAttention | None = None
    """Sparse decode attention for this request; None = dense."""
    info: RequestInfo | None = None
    """What the request's kind reports with the first token and the completion."""
    fused_prompt_ids: list[int] | None = None
    """The prompt's token ids when its cache reused stored chunk KV (a fusion); None for a
    prefill or a cached prefix with nothing fused. What a live fidelity sample prefills in
    full to compare first tokens (ragkv.app.live_fidelity)."""
    release_window_rows: bool = True
    """Whether decode may let sliding-window layers drop rows their window no longer reaches
    (chat turns say no by default: their context stays held for follow-ups, ChatTurns)."""


@dataclass
class RequestOutput:
    text: str
    finish_reason: FinishReason
    citations: list
    usage: TokenUsage
    timings: Timings
    strategy: str
    info: RequestInfo | None = None
    token_ids: list[int] = field(default_factory=list)
    eos_token: int | None = None
    """The end-of-sequence token that ended the answer (not in token_ids), if one did."""
    logprobs: list[TokenLogprob] | None = None
    """One per token of token_ids when the generation asked for logprobs."""


class Request:
    def __init__(
        self,
        kind: str,
        prepare: Callable[[Request], Prepared],
        generation: GenerationConfig,
        sink: RequestSink | None = None,
        *,
        estimated_tokens: int = 0,
        arrival: float | None = None,
        on_finished: Callable[[Request, RequestOutput], None] | None = None,
        on_dropped: Callable[[Request], None] | None = None,
        strip_text: bool = True,
        fetch: Callable[[Request], Fetched] | None = None,
    ):
        """`strip_text`: the completion's text loses its surrounding white space (answers),
        or is kept as generated (a plain completion continues its prompt exactly).
        `fetch`: reads the request's inputs without the model (kept in `fetched` for
        `prepare`); None = `prepare` does everything."""
        self.id = next(_ids)
        self.kind = kind
        self.phase = Phase.WAITING
        self.generation = generation
        self.eos_token: int | None = None
        self.sink = sink
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.estimated_tokens = estimated_tokens + generation.max_new_tokens
        """KV rows the request may hold at most (prompt estimate + answer), for admission."""
        self.timings = Timings()
        self.prepared: Prepared | None = None
        self.sampler = Sampler(generation.sampling)
        self.detokenizer: Detokenizer | None = None
        self.output_ids: list[int] = []
        self.pending_logits: torch.Tensor | None = None
        self.token_times: list[float] = []
        """perf_counter() when each token was sampled (inter-token latency)."""
        self.logprobs: list[TokenLogprob] | None = [] if generation.logprobs is not None else None
        self._sampled: TokenLogprob | None = None
        self._tokenizer = None
        self._prepare = prepare
        self._fetch = fetch
        self.fetched: Fetched | None = None
        self._fetch_error: BaseException | None = None
        self._fetch_done = threading.Event()
        self._on_finished = on_finished
        self._on_dropped = on_dropped
        self._decode_started = 0.0
        self._strip_text = strip_text

    @property
    def cache(self) -> KVCache | None:
        return self.prepared.cache if self.prepared is not None else None

    @property
    def held_tokens(self) -> int:
        """KV rows this request may grow to (its cache's rows plus what it may still decode)."""
        if self.prepared is None:
            return self.estimated_tokens
        return self.prepared.cache.length + self.generation.max_new_tokens - len(self.output_ids)

    @property
    def ready(self) -> bool:
        """Its inputs are read (or it reads none): the scheduler may prepare it."""
        return self._fetch is None or self._fetch_done.is_set()

    def run_fetch(self) -> None:
        """Run the fetch part (any thread, once); its result or its error is kept for `prepare`."""
        if self.ready:
            return
        try:
            self.fetched = self._fetch(self)
        except BaseException as error:  # the request's own failure: `prepare` raises it
            self._fetch_error = error
        self._fetch_done.set()

    def prepare(self, tokenizer) -> None:
        self.phase = Phase.PREPARING
        self.timings.queue = time.perf_counter() - self.arrival
        self.run_fetch()  # inline when no prefetch stage ran it
        if self._fetch_error is not None:
            raise self._fetch_error
        self.prepared = self._prepare(self)
        self.fetched = None  # read into the cache: not held past the prepare
        self.pending_logits = self.prepared.logits
        self.detokenizer = Detokenizer(tokenizer, self.generation.stop)
        self._tokenizer = tokenizer
        self.phase = Phase.DECODING
        self._decode_started = time.perf_counter()

    def sample(self) -> int:
        """The next token, chosen from the pending logits."""
        token = self.sampler(self.pending_logits)
        self.token_times.append(time.perf_counter())
        if self.logprobs is not None:  # from the logits that chose the token, before they are replaced
            self._sampled = token_logprob(self.pending_logits, token, self.generation.logprobs, self._tokenizer)
        return token

    def accept(self, token: int) -> None:
        """`token` (sampled, not end-of-sequence) is part of the answer."""
        self.output_ids.append(token)
        if self.logprobs is not None and self._sampled is not None:
            self.logprobs.append(self._sampled)
            report = getattr(self.sink, "logprob", None)
            if report is not None:
                report(self._sampled)

    def first_token_sent(self) -> None:
        self.timings.ttft = time.perf_counter() - self.arrival

    def started(self) -> Started:
        prepared = self.prepared
        return Started(prepared.citations, prepared.strategy, dataclasses.replace(self.timings), prepared.info)

    def finish(self, finish_reason: FinishReason) -> RequestOutput:
        prepared = self.prepared
        self.phase = Phase.FINISHED
        self.timings.decode = time.perf_counter() - self._decode_started
        prepared.usage.completion_tokens = len(self.output_ids)
        text = self.detokenizer.text.strip() if self._strip_text else self.detokenizer.text
        completion = RequestOutput(
            text,
            finish_reason,
            prepared.citations,
            prepared.usage,
            self.timings,
            prepared.strategy,
            prepared.info,
            list(self.output_ids),
            self.eos_token,
            list(self.logprobs) if self.logprobs is not None else None,
        )
        if self._on_finished is not None:
            self._on_finished(self, completion)
        self.release()
        return completion

    def drop(self) -> None:
        """Cancelled or failed: undo what the request holds (session locks) and free its cache."""
        self.phase = Phase.FINISHED
        if self._on_dropped is not None:
            self._on_dropped(self)
        self.release()

    def release(self) -> None:
        self.prepared = None
        self.fetched = None
        self.pending_logits = None
        self._on_dropped = self._on_finished = None


def fused_prompt_ids(fusion: FusionResult) -> list[int] | None:
    """The fused prompt's token ids when stored KV was reused (a full recompute is the full
    prefill already: nothing to compare)."""
    return fusion.layout.token_ids.tolist() if fusion.reused_tokens > 0 else None
