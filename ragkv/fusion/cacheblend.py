"""`cacheblend`: layers below the check layer run for every token; at the check layer the
fresh K/V of every document token are compared with the reused ones and the r·n tokens
that deviate most are recomputed from then on (CacheBlend's HKVD selection)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import SelectionContext, top_k_rows
from ragkv.fusion.ratio import RatioStrategy

DEVIATION_TARGETS = ("k", "v", "kv")


@dataclass
class CacheBlend(RatioStrategy):
    name = "cacheblend"
    deviation_on: str = "v"
    """Which fresh-vs-reused difference ranks tokens: keys, values or both."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deviation_on not in DEVIATION_TARGETS:
            raise ValueError(f"deviation_on must be one of {DEVIATION_TARGETS}")

    def select(self, context: SelectionContext) -> torch.Tensor:
        scores = kv_deviation(context, self.deviation_on)
        return top_k_rows(scores, self.budget(context.layout))


def kv_deviation(context: SelectionContext, target: str) -> torch.Tensor:
    """Squared distance between fresh and reused K and/or V per row (summed over heads),
    -inf for rows that are not document tokens."""
    layer, rows, layout = context.layer, context.rows, context.layout
    scores = torch.zeros(rows.numel(), device=rows.device)
    if target in ("k", "kv"):
        reused = context.cache.keys[layer, :, rows]
        scores += (context.projection.k - reused).float().pow(2).sum(dim=(0, 2))
    if target in ("v", "kv"):
        reused = context.cache.values[layer, :, rows]
        scores += (context.projection.v - reused).float().pow(2).sum(dim=(0, 2))
    is_document = (rows >= layout.prefix_len) & (rows < layout.question_start)
    return scores.masked_fill(~is_document, float("-inf"))
