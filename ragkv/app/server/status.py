"""What the engine client reports of itself: its health (GET /health) and the figures read
when metrics are scraped, as typed values read from the components."""

from __future__ import annotations

from dataclasses import dataclass

from ragkv.app.passages.counters import SpanCounters
from ragkv.app.server.worker import ModelWorker
from ragkv.app.status import StoreStatus
from ragkv.store.stats import StoreStats


@dataclass(frozen=True)
class Backends:
    """Which backend each store runs on (lmdb, redis, tiered, memory)."""

    store: str
    registry: str
    sessions: str


@dataclass(frozen=True)
class WorkerLoad:
    alive: bool
    queued: int
    """Requests and tasks waiting."""
    active: int
    """Requests and tasks under way."""


@dataclass(frozen=True)
class SchedulerLoad:
    """The scheduler as vLLM's gauges report it."""

    running: int
    waiting: int
    """Model requests queued at the scheduler (not ingestion or other tasks)."""
    kv_cache_usage: float
    """Fraction (0 to 1) of the scheduler's KV token budget the running requests hold."""
    prefill_pieces: int = 0
    """Steps so far that ran a piece of a preparation cut by max_num_batched_tokens."""


@dataclass(frozen=True)
class ServerHealth:
    backends: Backends
    store: StoreStatus
    registry_up: bool | None
    """Whether the registry's Redis answers PING; None without Redis (as for the others)."""
    sessions_up: bool | None
    worker: WorkerLoad
    fingerprint: str
    """The model's fingerprint (what stored chunk keys are made under)."""


@dataclass(frozen=True)
class ServerStats:
    backends: Backends
    store: StoreStats
    store_redis_up: bool | None
    prompt_spans: SpanCounters
    sessions: dict
    """The session store's figures (ContextStore.stats)."""
    registry_up: bool | None
    ingest_jobs: dict[str, int]
    """Background ingestions of this process by status."""
    worker: WorkerLoad
    scheduler: SchedulerLoad | None


def worker_load(worker: ModelWorker) -> WorkerLoad:
    return WorkerLoad(alive=worker.alive, queued=worker.queued, active=worker.active)


def scheduler_load(worker: ModelWorker) -> SchedulerLoad | None:
    """Read from another thread than the worker's: lists are copied before reading, and a
    request finishing meanwhile counts as holding nothing."""
    scheduler = worker.scheduler
    if scheduler is None:
        return None
    running = list(scheduler.running)
    rows = 0
    for request in running:
        prepared = request.prepared
        if prepared is not None:
            rows += prepared.cache.length
    usage = min(rows / scheduler.config.token_budget, 1.0)
    return SchedulerLoad(
        running=len(running),
        waiting=len(scheduler.waiting),
        kv_cache_usage=usage,
        prefill_pieces=scheduler.prefill_pieces,
    )
