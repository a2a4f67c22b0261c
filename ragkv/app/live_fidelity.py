"""Fidelity on live traffic: how far a fused first token is from the full prefill's, measured
on the server's own requests and documents while it has nothing else to do.

    prepare   a fused request (its cache reused stored chunk KV) is chosen with probability
              `rate`; its first-token log-probs (on the CPU), prompt ids and strategy are kept
    finish    the chosen request's sample joins a bounded queue (the oldest is dropped when
              it is full: counted)
    idle      when the scheduler has nothing waiting and nothing running, it calls `step`:
              one piece (`piece_tokens`) of the oldest sample's full prefill; the last piece
              gives KL(full || fused) of the first token, reported to `on_measured`

A request that arrives while a sample is being prefilled waits for at most the piece in
progress: the scheduler admits it at its next step and the sample is paused, keeping its
partial cache (one prompt's rows at most, outside the scheduler's token budget), and goes
on at the next idle step. A paused sample is never dropped by the queue bound.

The scheduler calls everything here on its own thread. What is measured goes to callbacks
(the API turns them into Prometheus series); this module knows no metrics.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragkv.app.request import Request
from ragkv.engine.chunked_prefill import ChunkedPrefill
from ragkv.engine.model import CausalLM
from ragkv.fusion.fidelity import next_token_kl

log = logging.getLogger("ragkv.app.live_fidelity")


@dataclass(frozen=True)
class LiveFidelityConfig:
    rate: float = 0.0
    """Share of fused requests whose first token is compared with a full prefill (0 = none)."""
    max_pending: int = 4
    """Samples waiting for an idle moment; beyond this the oldest is dropped."""
    piece_tokens: int = 256
    """Prompt tokens prefilled per idle scheduler step: the most a waiting request can be
    delayed by a sample."""
    seed: int | None = None
    """Seed of the sampling choice (tests); None = from the system."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"the fidelity sample rate must be in [0, 1], got {self.rate}")
        if self.max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        if self.piece_tokens < 1:
            raise ValueError("piece_tokens must be >= 1")


@dataclass(frozen=True)
class FidelitySample:
    """A finished fused request, as its full prefill needs it."""

    prompt_ids: list[int]
    fused_log_probs: torch.Tensor
    """The fused first token's log-probabilities [vocab], float32 on the CPU."""
    strategy: str


class LiveFidelity:
    def __init__(
        self,
        config: LiveFidelityConfig,
        on_measured: Callable[[str, float], None] | None = None,
        on_dropped: Callable[[], None] | None = None,
    ):
        """`on_measured(strategy, kl)`: each sample's first-token KL(full || fused), in nats;
        `on_dropped()`: a sample was given up (queue full, or its prefill failed)."""
        self.config = config
        self._on_measured = on_measured
        self._on_dropped = on_dropped
        self._random = random.Random(config.seed)
        self._chosen: dict[int, FidelitySample] = {}
        """Samples of requests still decoding, by request id."""
        self.pending: deque[FidelitySample] = deque()
        self.current: tuple[FidelitySample, ChunkedPrefill] | None = None
        """The sample whose full prefill has started (paused between idle steps)."""
        self.dropped = 0
        self.measured = 0

    @property
    def has_work(self) -> bool:
        return self.current is not None or bool(self.pending)

    # -- what the scheduler reports --------------------------------------------------

    def prepared(self, request: Request) -> None:
        """`request` was prepared: keep its sample when it was fused and is chosen."""
        prepared = request.prepared
        if prepared is None or prepared.fused_prompt_ids is None or not self.config.rate:
            return
        if self._random.random() >= self.config.rate:
            return
        try:
            log_probs = prepared.logits.detach().float().log_softmax(-1).cpu()
        except Exception:  # a sample is never worth failing the request it watches
            log.exception("could not keep a fidelity sample")
            return
        self._chosen[request.id] = FidelitySample(list(prepared.fused_prompt_ids), log_probs, prepared.strategy)

    def finished(self, request: Request) -> None:
        """`request` finished: its sample (if chosen) waits for an idle moment."""
        sample = self._chosen.pop(request.id, None)
        if sample is None:
            return
        if len(self.pending) >= self.config.max_pending:
            self.pending.popleft()
            self._dropped()
        self.pending.append(sample)

    def forget(self, request: Request) -> None:
        """`request` failed or was cancelled: nothing is measured for it."""
        self._chosen.pop(request.id, None)

    # -- idle work ---------------------------------------------------------------------

    def step(self, model: CausalLM) -> None:
        """One piece of the current sample's full prefill (starting the oldest pending one
        when none is current); the measurement when it was the last piece."""
        if self.current is None:
            if not self.pending:
                return
            sample = self.pending[0]
            try:
                self.current = (sample, ChunkedPrefill(model, sample.prompt_ids, self.config.piece_tokens))
            except Exception:
                log.exception("could not start the full prefill of a fidelity sample")
                self._dropped()
                return
            finally:  # taken off the queue once current: `has_work` never reads False in between
                self.pending.popleft()
        sample, prefill = self.current
        try:
            if not prefill.step():
                return
        except Exception:  # a failed measurement must not fail the scheduler
            log.exception("the full prefill of a fidelity sample failed")
            self.current = None
            self._dropped()
            return
        self.current = None
        kl = next_token_kl(prefill.logits.float().cpu(), sample.fused_log_probs)
        self.measured += 1
        if self._on_measured is not None:
            try:
                self._on_measured(sample.strategy, kl)
            except Exception:
                log.exception("reporting a fidelity measurement failed")

    def clear(self) -> None:
        """Give up every sample (the server is stopping); not counted as dropped."""
        self._chosen.clear()
        self.pending.clear()
        self.current = None

    def _dropped(self) -> None:
        self.dropped += 1
        if self._on_dropped is not None:
            self._on_dropped()
