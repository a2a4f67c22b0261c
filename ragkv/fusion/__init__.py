"""Fusion strategies, one per file, chosen by name."""

from __future__ import annotations

from ragkv.fusion.a3 import A3
from ragkv.fusion.base import FusionResult, FusionStrategy
from ragkv.fusion.cacheblend import CacheBlend
from ragkv.fusion.epic import Epic
from ragkv.fusion.full import Full
from ragkv.fusion.full_reuse import FullReuse
from ragkv.fusion.layout import FusionInput, LoadedChunk
from ragkv.fusion.pie import Pie

from ragkv.fusion.config import DEFAULT_STRATEGY, STRATEGY_NAMES, FusionConfig

__all__ = ["DEFAULT_STRATEGY", "STRATEGY_NAMES", "FusionConfig", "FusionInput", "FusionResult", "FusionStrategy", "LoadedChunk", "A3", "CacheBlend", "Epic", "Full", "FullReuse", "Pie"]
