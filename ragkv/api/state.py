"""What the routes share: the runtime, the worker, sessions, ingestion records, metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from fastapi import Request

from ragkv.api.config import ServeConfig
from ragkv.api.errors import ApiError
from ragkv.api.ingest_records import IngestRecords
from ragkv.api.metrics import Metrics
from ragkv.api.service import Service
from ragkv.api.worker import ModelWorker
from ragkv.app.contexts import ContextStore
from ragkv.app.runtime import Runtime
from ragkv.store.base import ChunkStore
from ragkv.store.redis_store import RedisStore
from ragkv.store.tiered import TieredStore

log = logging.getLogger("ragkv.api")


@dataclass
class AppState:
    config: ServeConfig
    runtime: Runtime
    worker: ModelWorker
    sessions: ContextStore
    ingest_records: IngestRecords
    metrics: Metrics
    service: Service
    model_id: str
    started: float = field(default_factory=time.time)

    def check_model(self, model: str) -> None:
        """A generation request names the served model (or the alias "ragkv"), else 404."""
        if model not in (self.model_id, "ragkv"):
            raise ApiError(
                404,
                "model_not_found",
                f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                param="model",
            )

    def redis_stores(self) -> list[RedisStore]:
        return redis_tiers(self.runtime.store)

    def health(self) -> dict:
        """Component status; pings Redis (blocking: call from a thread)."""
        store_redis = [tier.healthy() for tier in self.redis_stores()]
        sessions_redis = self.sessions.healthy()
        registry_up = self.runtime.registry.healthy()
        problems = []
        if not self.worker.alive:
            problems.append("the model worker has stopped")
        if store_redis and not all(store_redis):
            fallback = (
                "chunks are read from LMDB"
                if isinstance(self.runtime.store, TieredStore)
                else "chunks are recomputed from the document text"
            )
            problems.append(f"chunk store: redis is unreachable; {fallback}")
        if registry_up is False:
            # "degraded", not "unavailable": every replica shares the registry, so taking this
            # one out of rotation (or restarting it) would not help.
            problems.append("registry: redis is unreachable; documents cannot be listed, ingested or retrieved")
        if sessions_redis is False:
            problems.append("sessions: redis is unreachable; sessions are kept in this process only")
        status = "unavailable" if not self.worker.alive else ("degraded" if problems else "ok")
        return {
            "status": status,
            "problems": problems,
            "model": self.model_id,
            "fingerprint": self.runtime.engine.fingerprint,
            "uptime_s": round(time.time() - self.started, 1),
            "store": {"backend": self.runtime.store.backend, "redis_up": (all(store_redis) if store_redis else None)},
            "registry": {"backend": self.runtime.registry.backend, "redis_up": registry_up},
            "sessions": {"backend": self.sessions.backend, "redis_up": sessions_redis},
            "worker": {"alive": self.worker.alive, "queued": self.worker.queued, "active": self.worker.active},
        }


def redis_tiers(store: ChunkStore) -> list[RedisStore]:
    if isinstance(store, RedisStore):
        return [store]
    if isinstance(store, TieredStore):
        return [tier for tier in store.tiers if isinstance(tier, RedisStore)]
    return []


def app_state(request: Request) -> AppState:
    return request.app.state.ragkv
