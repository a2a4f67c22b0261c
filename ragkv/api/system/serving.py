"""GET /health from the components' status."""

from __future__ import annotations

import time

from ragkv.api.state import AppState
from ragkv.api.system.protocol import BackendHealth, Health, WorkerHealth


def health(state: AppState) -> Health:
    """Component status; pings Redis (blocking: call from a thread)."""
    report = state.client.health()
    store, registry_up, sessions_redis, worker = report.store, report.registry_up, report.sessions_up, report.worker
    problems = []
    if not worker.alive:
        problems.append("the model worker has stopped")
    if store.redis_up is False:
        fallback = (
            "chunks are read from LMDB" if store.lmdb_fallback else "chunks are recomputed from the document text"
        )
        problems.append(f"chunk store: redis is unreachable; {fallback}")
    if registry_up is False:
        # "degraded", not "unavailable": every replica shares the registry, so taking this
        # one out of rotation (or restarting it) would not help.
        problems.append("registry: redis is unreachable; documents cannot be listed, ingested or retrieved")
    if sessions_redis is False:
        problems.append("sessions: redis is unreachable; sessions are kept in this process only")
    status = "unavailable" if not worker.alive else ("degraded" if problems else "ok")
    return Health(
        status=status,
        problems=problems,
        model=state.model_id,
        fingerprint=report.fingerprint,
        uptime_s=round(time.time() - state.started, 1),
        store=BackendHealth(backend=store.backend, redis_up=store.redis_up),
        registry=BackendHealth(backend=report.backends.registry, redis_up=registry_up),
        sessions=BackendHealth(backend=report.backends.sessions, redis_up=sessions_redis),
        worker=WorkerHealth(alive=worker.alive, queued=worker.queued, active=worker.active),
    )
