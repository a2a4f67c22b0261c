"""`epic`: recompute the first and last N tokens of every chunk from layer 0 (EPIC /
LegoLink): a chunk's first tokens were attention sinks when it was computed alone."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import FusionStrategy
from ragkv.fusion.layout import Layout


@dataclass
class Epic(FusionStrategy):
    name = "epic"
    boundary_tokens: int = 16
    """N: tokens recomputed at each end of every chunk."""

    def __post_init__(self) -> None:
        if self.boundary_tokens < 0:
            raise ValueError("boundary_tokens must be >= 0")

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        return torch.cat([boundary_rows(layout, self.boundary_tokens), layout.question_rows]).unique(sorted=True)


def boundary_rows(layout: Layout, n: int) -> torch.Tensor:
    """The first and last `n` rows of every chunk."""
    parts = [torch.zeros(0, dtype=torch.long)]
    for start, end in layout.chunk_spans:
        parts.append(torch.arange(start, min(start + n, end)))
        parts.append(torch.arange(max(end - n, start), end))
    return torch.cat(parts).unique(sorted=True)
