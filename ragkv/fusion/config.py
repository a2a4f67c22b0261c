"""Typed choice of a fusion strategy; requests and the CLI convert to this."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ragkv.fusion.base import FusionStrategy, check_ratio
from ragkv.fusion.registry import DEFAULT_STRATEGY, build_strategy


@dataclass(frozen=True)
class CalibratedFusion:
    """A strategy's settings chosen for a model by `ragkv calibrate fusion`; requests that
    name no ratio get them, as a whole."""

    ratio: float
    refresh_ratio: float = 0.0
    """The probe's answer refresh (0 = none); ignored by strategies without one."""

    def apply(self, strategy: FusionStrategy, spec: str) -> FusionStrategy:
        """`strategy` (built from `spec`) with these settings, but those the spec names itself."""
        if spec_names_option(spec, "ratio"):
            return strategy
        changes: dict[str, float] = {"ratio": self.ratio}
        if has_option(strategy, "refresh_ratio") and not spec_names_option(spec, "refresh_ratio"):
            changes["refresh_ratio"] = self.refresh_ratio
        return dataclasses.replace(strategy, **changes)


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

    def build(self, calibrated: dict[str, CalibratedFusion] | None = None) -> FusionStrategy:
        """`calibrated`: settings per strategy name (ragkv calibrate fusion), used when
        neither `ratio` nor the spec names a ratio."""
        strategy = build_strategy(self.strategy)
        if self.ratio is None:
            chosen = (calibrated or {}).get(strategy.name)
            return strategy if chosen is None else chosen.apply(strategy, self.strategy)
        if not has_option(strategy, "ratio"):
            check_ratio(self.ratio)
            return strategy
        return dataclasses.replace(strategy, ratio=self.ratio)


def has_option(strategy: FusionStrategy, option: str) -> bool:
    """Whether the strategy has the setting `option` (ratio, refresh_ratio, ...)."""
    return any(item.name == option for item in dataclasses.fields(strategy))


def spec_names_option(spec: str, option: str) -> bool:
    """Whether a spec string ('probe:ratio=0.2,...') sets `option` itself."""
    _, _, options = spec.partition(":")
    return any(item.split("=", 1)[0].strip() == option for item in options.split(",") if item.strip())
