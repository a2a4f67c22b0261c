"""Typed choice of a fusion strategy; requests and the CLI convert to this."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ragkv.fusion.base import FusionStrategy, check_ratio
from ragkv.fusion.registry import DEFAULT_STRATEGY, build_strategy


@dataclass(frozen=True)
class FusionConfig:
    strategy: str = DEFAULT_STRATEGY
    """Fusion strategy spec: a name (full, full_reuse, pie, epic, cacheblend, a3, probe;
    default probe) or name:option=value,... (e.g. probe:ratio=0.15,
    a3:ratio=0.3,deviation_share=0); the options are the strategy's own fields."""
    ratio: float | None = None
    """r: share of document tokens recomputed, for strategies that have one (overrides the
    spec's; None = the spec's, else the ratio calibrated for the model, else the
    strategy's default). Strategies that recompute a
    fixed set of rows (full, full_reuse, pie, epic) have no ratio and ignore it."""

    def __post_init__(self) -> None:
        self.build()  # validates the spec and the strategy's fields

    def build(self, calibrated: dict[str, float] | None = None) -> FusionStrategy:
        """`calibrated`: ratio per strategy name (ragkv calibrate fusion), used when neither
        `ratio` nor the spec names one."""
        strategy = build_strategy(self.strategy)
        if self.ratio is None:
            ratio = (calibrated or {}).get(strategy.name)
            if ratio is None or spec_names_option(self.strategy, "ratio"):
                return strategy
            return dataclasses.replace(strategy, ratio=ratio)
        if not any(item.name == "ratio" for item in dataclasses.fields(strategy)):
            check_ratio(self.ratio)
            return strategy
        return dataclasses.replace(strategy, ratio=self.ratio)


def spec_names_option(spec: str, option: str) -> bool:
    """Whether a spec string ('probe:ratio=0.2,...') sets `option` itself."""
    _, _, options = spec.partition(":")
    return any(item.split("=", 1)[0].strip() == option for item in options.split(",") if item.strip())
