"""What a prompt's passages are and which of their rows the store gives: the plan that the
look-up (store reads, no model) hands to the fusion (model, no store reads).

    PassagePlan
      spans    the finder's passage spans of the searched ids (what new rows are stored as)
      placed   rows the store holds, each a run of positions with the stored K/V to place
               there (a whole stored passage, or the part of one this prompt shares)
    every other row between the first and the last passage is computed for the prompt
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.app.passages.finder import Span
from ragkv.engine.kv_storage import StoredKV


@dataclass(frozen=True)
class Placed:
    """Prompt rows [start, end) whose pre-RoPE K/V come from the store."""

    start: int
    end: int
    keys: StoredKV
    values: StoredKV
    run: str
    """Digest of the stored run the rows were read from."""

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PassagePlan:
    """The passages of a prompt's new tokens (positions in the prompt's ids, ascending)."""

    spans: list[Span]
    digests: list[str]
    """Per span, the digest of its whole tokens (its chunk key's hash)."""
    placed: list[Placed]
    """Stored rows, ascending and disjoint."""
    tenant: str = ""
    """Whose salt the new passages are stored under."""

    def __post_init__(self) -> None:
        if not self.spans and not self.placed:
            raise ValueError("a passage plan needs a span or placed rows")
        if len(self.digests) != len(self.spans):
            raise ValueError("one digest per span")
        ends = [0] + [p.end for p in self.placed]
        if any(p.start < end or p.end <= p.start for p, end in zip(self.placed, ends)):
            raise ValueError("placed rows must be ascending, disjoint and non-empty")

    @property
    def first(self) -> int:
        """The first row of a passage: every row before it is the fusion's prefix."""
        starts = [s.start for s in self.spans[:1]] + [p.start for p in self.placed[:1]]
        return min(starts)

    @property
    def last(self) -> int:
        """The row after the last passage: rows from here on are the fusion's question."""
        ends = [s.end for s in self.spans[-1:]] + [p.end for p in self.placed[-1:]]
        return max(ends)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored K/V the plan holds (the prefetch stage's bound counts them)."""
        return sum(_bytes(kv) for p in self.placed for kv in (p.keys, p.values))

    @property
    def reused_tokens(self) -> int:
        return sum(len(p) for p in self.placed)

    def covered(self, span: Span) -> int:
        """Tokens of `span` the placed rows cover."""
        return sum(max(0, min(span.end, p.end) - max(span.start, p.start)) for p in self.placed)

    def uncovered(self, span: Span) -> list[tuple[int, int]]:
        """The stretches [a, b) of `span` no placed rows cover, ascending."""
        stretches, position = [], span.start
        for piece in self.placed:
            if piece.end <= position or piece.start >= span.end:
                continue
            if piece.start > position:
                stretches.append((position, piece.start))
            position = max(position, piece.end)
        if position < span.end:
            stretches.append((position, span.end))
        return stretches

    @property
    def hits(self) -> int:
        """Spans every row of which the store gives."""
        return sum(self.covered(span) == len(span) for span in self.spans)

    @property
    def misses(self) -> int:
        return len(self.spans) - self.hits


def _bytes(stored: StoredKV) -> int:
    tensors = (stored,) if isinstance(stored, torch.Tensor) else (stored.codes, stored.scale, stored.minimum)
    return sum(t.numel() * t.element_size() for t in tensors)
