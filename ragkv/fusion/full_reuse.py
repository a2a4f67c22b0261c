"""`full_reuse`: reuse every chunk's KV untouched, keys at their local (precompute)
positions; only the question is computed. The A3 paper's naive-reuse baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import FusionStrategy
from ragkv.fusion.layout import FusionInput, Layout


@dataclass
class FullReuse(FusionStrategy):
    name = "full_reuse"

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        return layout.question_rows

    def chunk_key_positions(self, layout: Layout, fusion_input: FusionInput, chunk: int) -> torch.Tensor:
        start, end = layout.chunk_spans[chunk]
        return fusion_input.chunk_precompute_offset + torch.arange(end - start)
