"""What the runtime reports about itself: the chunk store's health and the default fusion.

Typed answers for callers that must not reach into the store or the fusion package (the
API): they learn whether Redis answers, not which classes hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.fusion import CalibratedFusion, FusionConfig
from ragkv.store.base import ChunkStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore


@dataclass(frozen=True)
class StoreStatus:
    backend: str
    redis_up: bool | None
    """Whether every Redis tier answers PING; None when the store has no Redis tier."""
    lmdb_fallback: bool
    """An LMDB tier answers while Redis does not (else missing chunks are recomputed)."""


@dataclass(frozen=True)
class DefaultFusion:
    """The fusion requests that name none get."""

    strategy: str
    ratio: float | None
    calibrated: bool
    """The ratio was calibrated for this model (`ragkv calibrate fusion`)."""
    refresh_ratio: float = 0.0
    """The probe's answer refresh (0 = none)."""


def redis_tiers(store: ChunkStore) -> list[RedisStore]:
    if isinstance(store, RedisStore):
        return [store]
    if isinstance(store, TieredStore):
        return [tier for tier in store.tiers if isinstance(tier, RedisStore)]
    return []


def store_status(store: ChunkStore) -> StoreStatus:
    """Pings Redis (blocking: call from a thread)."""
    up = [tier.healthy() for tier in redis_tiers(store)]
    return StoreStatus(store.backend, all(up) if up else None, isinstance(store, TieredStore))


def default_fusion(calibrated: dict[str, CalibratedFusion]) -> DefaultFusion:
    """The default strategy and the ratio it runs at (`calibrated` for this model by `ragkv
    calibrate fusion`, or the strategy's default)."""
    strategy = FusionConfig().build(calibrated)
    refresh = getattr(strategy, "refresh_ratio", 0.0)
    return DefaultFusion(strategy.name, strategy.ratio, strategy.name in calibrated, refresh)
