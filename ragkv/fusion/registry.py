"""The one list of fusion strategies, and their construction from spec strings
('a3', 'a3:ratio=0.3,deviation_share=0', 'epic:boundary_tokens=8')."""

from __future__ import annotations

from ragkv.engine.spec_string import build_from_spec
from ragkv.fusion.a3 import A3
from ragkv.fusion.base import FusionStrategy
from ragkv.fusion.cacheblend import CacheBlend
from ragkv.fusion.epic import Epic
from ragkv.fusion.full import Full
from ragkv.fusion.full_reuse import FullReuse
from ragkv.fusion.pie import Pie
from ragkv.fusion.probe import Probe

STRATEGIES: dict[str, type[FusionStrategy]] = {cls.name: cls for cls in (Full, FullReuse, Pie, Epic, CacheBlend, A3, Probe)}
STRATEGY_NAMES = tuple(STRATEGIES)
DEFAULT_STRATEGY = Probe.name


def build_strategy(spec: str) -> FusionStrategy:
    """The strategy a spec string names, its options validated by the strategy itself."""
    return build_from_spec(spec, STRATEGIES, "fusion strategy")
