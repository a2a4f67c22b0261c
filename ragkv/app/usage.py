"""One definition of token usage and of timings, shared by the API, the CLI and the benchmarks.

Token counts (rows of the prompt's KV cache):
  prompt_tokens      every row the first token attends to
  cached_tokens      rows whose KV was not computed for this request: stored chunk KV kept
                     as it is, the engine's cached prefix, a cached context's prefix
                     (OpenAI's `usage.prompt_tokens_details.cached_tokens`)
  computed_tokens    prompt_tokens - cached_tokens
  recomputed_tokens  document rows a fusion strategy recomputed (part of computed_tokens)
  document_tokens    rows of retrieved chunks in the prompt

Timings are seconds. `ttft` runs from the request's arrival to its first token; its parts
(queue, retrieve, load, fuse, prefill) are reported beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from ragkv.fusion import FusionResult


@dataclass
class TokenUsage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    document_tokens: int = 0
    completion_tokens: int = 0

    @classmethod
    def of_fusion(
        cls, fusion: FusionResult, computed_before: int = 0, recomputed_chunks: Sequence[int] = ()
    ) -> TokenUsage:
        """TokenUsage of a fused prompt. `computed_before`: rows of the fusion's prefix that were
        computed for this request (a prefilled glue before newly fused chunks);
        `recomputed_chunks`: chunks the store could not give, computed for this request."""
        length = fusion.layout.length
        extra = chunk_rows_computed_here(fusion, recomputed_chunks)
        cached = max(0, length - int(fusion.final_rows.numel()) - computed_before - extra)
        return cls(
            prompt_tokens=length,
            cached_tokens=cached,
            recomputed_tokens=fusion.recomputed_tokens + extra,
            document_tokens=fusion.layout.num_document_tokens,
        )

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Timings:
    """Seconds spent per stage; None = the stage did not run for this request."""

    queue: float | None = None
    retrieve: float | None = None
    load: float | None = None
    fuse: float | None = None
    prefill: float | None = None
    ttft: float | None = None
    decode: float | None = None

    def to_dict(self) -> dict[str, float]:
        return {f.name: round(getattr(self, f.name), 4) for f in fields(self) if getattr(self, f.name) is not None}


def chunk_rows_computed_here(fusion: FusionResult, recomputed_chunks: Sequence[int]) -> int:
    """Rows of chunks whose KV the store could not give (computed for this request) that
    the fusion did not recompute itself: they were computed, not reused."""
    final = set(fusion.final_rows.tolist())
    rows = 0
    for index in recomputed_chunks:
        start, end = fusion.layout.chunk_spans[index]
        rows += sum(1 for row in range(start, end) if row not in final)
    return rows
