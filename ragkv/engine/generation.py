"""What a request asks of generation: token limit, sampling, stop strings.

Generation itself is the application's scheduler step (ragkv.app.scheduler): every kind
of request decodes there, batched, with one incremental detokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragkv.engine.sampling import SamplingConfig

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
