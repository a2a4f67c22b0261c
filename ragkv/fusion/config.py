"""Typed choice of a fusion strategy and its knobs; requests and the CLI convert to this."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.fusion.a3 import A3
from ragkv.fusion.base import FusionStrategy, check_ratio
from ragkv.fusion.cacheblend import CacheBlend
from ragkv.fusion.epic import Epic
from ragkv.fusion.full import Full
from ragkv.fusion.full_reuse import FullReuse
from ragkv.fusion.pie import Pie

STRATEGY_NAMES = ("full", "full_reuse", "pie", "epic", "cacheblend", "a3")
DEFAULT_STRATEGY = "a3"


@dataclass(frozen=True)
class FusionConfig:
    strategy: str = DEFAULT_STRATEGY
    """One of full, full_reuse, pie, epic, cacheblend, a3."""
    ratio: float = 0.15
    """r: share of document tokens recomputed (cacheblend, a3)."""
    check_layer: int = 1
    """Layer where cacheblend/a3 choose the recomputed tokens; layers below run in full."""
    boundary_tokens: int = 16
    """EPIC's N: tokens recomputed at each end of every chunk."""
    a3_query_tokens: str = "segment"
    """Question rows that score document tokens: 'segment' (all) or 'text' (its words)."""
    a3_head_aggregation: str = "sum"
    """How a3 combines heads: sum, max, or normalized (each head an equal vote)."""
    a3_exclude_sinks: bool = False
    """Leave the prefix (attention-sink) columns out of a3's softmax."""
    a3_boundary_tokens: int = 0
    """Part of a3's budget always spent on the first/last N tokens of each chunk."""
    a3_deviation_share: float = 0.5
    """Share of a3's budget chosen by KV deviation (0 = the A3 paper; 0.5 measured best,
    see BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ValueError(f"unknown fusion strategy {self.strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
        check_ratio(self.ratio)
        self.build()  # validates the strategy's own fields

    def build(self) -> FusionStrategy:
        if self.strategy == "full":
            return Full()
        if self.strategy == "full_reuse":
            return FullReuse()
        if self.strategy == "pie":
            return Pie()
        if self.strategy == "epic":
            return Epic(boundary_tokens=self.boundary_tokens)
        if self.strategy == "cacheblend":
            return CacheBlend(ratio=self.ratio, check_layer=self.check_layer)
        return A3(
            ratio=self.ratio,
            check_layer=self.check_layer,
            query_tokens=self.a3_query_tokens,
            head_aggregation=self.a3_head_aggregation,
            exclude_sinks=self.a3_exclude_sinks,
            boundary_tokens=self.a3_boundary_tokens,
            deviation_share=self.a3_deviation_share,
        )
