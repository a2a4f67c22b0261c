"""GET /health."""

from __future__ import annotations

from pydantic import BaseModel, Field


class BackendHealth(BaseModel):
    backend: str
    redis_up: bool | None = Field(description="null when the backend uses no Redis")


class WorkerHealth(BaseModel):
    alive: bool
    queued: int
    active: int


class Health(BaseModel):
    status: str = Field(description="ok, degraded (a fallback is in use: Redis unreachable) or unavailable")
    problems: list[str]
    model: str
    fingerprint: str
    uptime_s: float
    store: BackendHealth
    registry: BackendHealth
    sessions: BackendHealth
    worker: WorkerHealth
