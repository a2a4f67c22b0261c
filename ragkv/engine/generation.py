"""Streaming generation from a prefilled cache: stop strings, EOS, token limits."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ragkv.engine.kv_cache import KVCache
from ragkv.engine.model import CausalLM, DecodeAttention
from ragkv.engine.sampling import Sampler, SamplingConfig

MAX_LOGPROBS = 20
"""OpenAI's limit on top_logprobs."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    """Upper bound on generated tokens (the stop reason is then 'length')."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    """Strings that end generation; the stop string itself is not returned."""
    logprobs: int | None = None
    """Report each generated token's log-probability and the `logprobs` most likely
    alternatives (0: the chosen token's only); None = not computed."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= 32768:
            raise ValueError(f"max_new_tokens must be in [1, 32768], got {self.max_new_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")


@dataclass
class TokenEvent:
    """One step of a stream: the new token, the text it completes (may be empty while a
    possible stop string or a partial UTF-8 character is held back), and, on the last
    event, why generation ended ('stop', 'eos' or 'length')."""

    token_id: int | None
    text: str
    finish_reason: str | None = None
    logits: torch.Tensor | None = None
    """The logits the token was sampled from (for its log-probability)."""


class _TextTracker:
    """Turns a growing token list into text deltas, holding back what may still become a
    stop string or an incomplete multi-byte character."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.token_ids: list[int] = []
        self.emitted = 0

    def push(self, token_id: int) -> tuple[str, bool]:
        self.token_ids.append(token_id)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop)
            if at != -1:
                delta = text[self.emitted : at] if at > self.emitted else ""
                self.emitted = max(self.emitted, at)
                return delta, True
        safe = len(text)
        while safe > self.emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        for stop in self.stop:
            for keep in range(min(len(stop) - 1, safe - self.emitted), 0, -1):
                if text[safe - keep : safe] == stop[:keep]:
                    safe -= keep
                    break
        delta = text[self.emitted : safe]
        self.emitted = safe
        return delta, False

    def rest(self) -> str:
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta


def stream_tokens(
    model: CausalLM,
    tokenizer,
    cache: KVCache,
    first_logits: torch.Tensor,
    config: GenerationConfig,
    attention: DecodeAttention | None = None,
) -> Iterator[TokenEvent]:
    """Yield tokens decoded from `cache`, whose last row produced `first_logits`."""
    sampler = Sampler(config.sampling)
    eos = set(model.spec.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    tracker = _TextTracker(tokenizer, config.stop)
    logits = first_logits
    for step in range(config.max_new_tokens):
        token = sampler(logits)
        if token in eos:
            yield TokenEvent(token, tracker.rest(), "eos", logits)
            return
        delta, stopped = tracker.push(token)
        if stopped:
            yield TokenEvent(token, delta, "stop", logits)
            return
        if step + 1 == config.max_new_tokens:
            yield TokenEvent(token, delta + tracker.rest(), "length", logits)
            return
        yield TokenEvent(token, delta, None, logits)
        logits = model.decode_step(token, cache, attention)
