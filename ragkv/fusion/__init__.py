"""Fusion strategies, one per file, registered in one place and chosen by spec string."""

from __future__ import annotations

from ragkv.fusion.a3 import A3
from ragkv.fusion.base import FusionResult, FusionStrategy
from ragkv.fusion.cacheblend import CacheBlend
from ragkv.fusion.config import CalibratedFusion, FusionConfig
from ragkv.fusion.epic import Epic
from ragkv.fusion.full import Full
from ragkv.fusion.full_reuse import FullReuse
from ragkv.fusion.layout import FusionInput, LoadedChunk
from ragkv.fusion.pie import Pie
from ragkv.fusion.probe import Probe
from ragkv.fusion.registry import DEFAULT_STRATEGY, STRATEGIES, STRATEGY_NAMES, build_strategy

__all__ = [
    "DEFAULT_STRATEGY",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "CalibratedFusion",
    "FusionConfig",
    "FusionInput",
    "FusionResult",
    "FusionStrategy",
    "LoadedChunk",
    "build_strategy",
    "A3",
    "CacheBlend",
    "Epic",
    "Full",
    "FullReuse",
    "Pie",
    "Probe",
]
