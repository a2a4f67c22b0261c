"""The shared base of strategies that recompute a share r of the document tokens past a
check layer (a3, cacheblend): the ratio, the check layer and their checks, written once.
Subclasses add their own fields and their `select` rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ragkv.fusion.base import FusionStrategy, check_ratio, ratio_budget
from ragkv.fusion.layout import Layout


@dataclass
class RatioStrategy(FusionStrategy):
    ratio: float = 0.15
    """r: fraction of document tokens recomputed past the check layer."""
    check_layer: int = 1
    """Layer where the tokens are chosen; layers below run for every token."""

    def __post_init__(self) -> None:
        check_ratio(self.ratio)
        if self.check_layer < 0:
            raise ValueError("check_layer must be >= 0")

    def initial_rows(self, layout: Layout) -> torch.Tensor:
        return torch.arange(layout.prefix_len, layout.length)

    def budget(self, layout: Layout) -> int:
        """Document tokens recomputed past the check layer: r·n, rounded."""
        return ratio_budget(self.ratio, layout)
